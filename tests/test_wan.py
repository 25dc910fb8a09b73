"""tools/wan: argument checks, the root check, and (as root) up/status/down making and removing
exactly its own namespaces, links and qdiscs, also when setup fails half-way."""

import os
import signal
import subprocess
import sys

import pytest

from launch import REPO, read_jsonl, worker_env

sys.path.insert(0, str(REPO / "tools" / "wan"))

import netns  # noqa: E402

WAN = [sys.executable, str(REPO / "tools" / "wan")]


def _can_make_namespaces() -> str | None:
    """Why namespace tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    probe = f"probe{os.getpid() % 10**5}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


NO_NETNS = _can_make_namespaces()
needs_netns = pytest.mark.skipif(NO_NETNS is not None, reason=str(NO_NETNS))


def _wan(*args) -> subprocess.CompletedProcess:
    return subprocess.run([*WAN, *args], capture_output=True, text=True, cwd=REPO)


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _host_links() -> str:
    return subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize("value, bits", [("10mbit", 10**7), ("1gbit", 10**9), ("500kbit", 5 * 10**5),
                                         ("2.5mbit", 25 * 10**5)])
def test_rates(value, bits):
    assert netns.rate_bits(value) == bits


@pytest.mark.parametrize("kwargs, flag", [
    (dict(rate="10mb"), "--rate"), (dict(rate="fast"), "--rate"), (dict(rate="1kbit"), "--rate"),
    (dict(prefix="Bad-name"), "--prefix"), (dict(prefix="abcdefghijk"), "--prefix"), (dict(clusters=1), "--clusters"),
    (dict(subnet="10.0.0.0/30", clusters=4), "--subnet"), (dict(subnet="fe80::/64"), "--subnet"),
    (dict(subnet="nonsense"), "--subnet"),
])
def test_bad_arguments_are_one_line_errors(kwargs, flag):
    with pytest.raises(netns.WanError) as err:
        netns.Wan(**{**dict(prefix="t", clusters=2, rate="10mbit"), **kwargs})
    assert str(err.value).startswith(flag) and "\n" not in str(err.value)


def test_not_root_is_refused():
    with pytest.raises(netns.WanError, match="needs root.*uid 1000"):
        netns.require_root(1000)
    netns.require_root(0)


def test_cli_argument_errors():
    bad_rate = _wan("up", "--clusters", "2", "--rate", "10mb", "--prefix", "tcli")
    assert bad_rate.returncode == 1 and bad_rate.stderr.strip() == (
        "wan: error: --rate must look like 10mbit, 1gbit or 500kbit, got '10mb'")
    bad_prefix = _wan("down", "--prefix", "Nope!")
    assert bad_prefix.returncode == 1 and "--prefix" in bad_prefix.stderr
    no_script = _wan("launch", "--nproc-per-node", "1")
    assert no_script.returncode == 2 and "after --" in no_script.stderr
    missing = _wan("up", "--rate", "10mbit")
    assert missing.returncode == 2 and "--clusters" in missing.stderr


@needs_netns
def test_up_status_down_own_exactly_their_namespaces():
    prefix = f"t{os.getpid() % 10**6}"
    before_ns, before_links = _namespaces(), _host_links()
    up = _wan("up", "--clusters", "3", "--rate", "25mbit", "--prefix", prefix)
    try:
        assert up.returncode == 0, up.stderr
        mine = {f"{prefix}-hub", f"{prefix}-c0", f"{prefix}-c1", f"{prefix}-c2"}
        assert _namespaces() == before_ns | mine
        assert _host_links() == before_links  # nothing created or changed in the host's namespace
        status = netns.status(prefix)
        assert [s["namespace"] for s in status] == [f"{prefix}-c{k}" for k in range(3)]
        assert [s["address"] for s in status] == ["10.213.0.1", "10.213.0.2", "10.213.0.3"]
        assert all(s["rate_bits"] == 25 * 10**6 for s in status)  # uplinks
        assert all(netns.link_stats(f"{prefix}-hub", f"c{k}")["rate_bits"] == 25 * 10**6 for k in range(3))  # downlinks
        again = _wan("up", "--clusters", "2", "--rate", "25mbit", "--prefix", prefix)
        assert again.returncode == 1 and "already exist" in again.stderr
        shown = _wan("status", "--prefix", prefix)
        assert shown.stdout.count("25 Mbit/s") == 3
    finally:
        down = _wan("down", "--prefix", prefix)
    assert down.returncode == 0 and down.stdout.startswith("down: removed")
    assert _namespaces() == before_ns and _host_links() == before_links
    assert _wan("down", "--prefix", prefix).stdout.strip() == "down: removed nothing"


@needs_netns
def test_failed_setup_removes_what_it_made(monkeypatch):
    """A tc failure on the second cluster (injected) leaves no namespace behind."""
    prefix = f"f{os.getpid() % 10**6}"
    real_tbf, calls = netns._tbf, []

    def tbf_failing_on_second_cluster(namespace, dev, bits):
        calls.append(namespace)
        if namespace == f"{prefix}-c1":
            raise netns.WanError("injected tc failure")
        real_tbf(namespace, dev, bits)

    monkeypatch.setattr(netns, "_tbf", tbf_failing_on_second_cluster)
    before = _namespaces()
    with pytest.raises(netns.WanError, match="injected"):
        netns.up(netns.Wan(prefix, 2, "10mbit"))
    assert f"{prefix}-c0" in calls and _namespaces() == before


@needs_netns
def test_a_cluster_restarted_in_its_namespace_heals_over_the_link(tmp_path):
    """2 single-rank clusters as jobs in their own namespaces (``launch --cluster-jobs
    --max-restarts 1``); cluster 1's worker is killed after iteration 10 and torchrun restarts it.
    It must fetch the running state from cluster 0 at cluster 0's namespace address (the host's
    name resolves to no address of the other namespace), join, and end with cluster 0's
    validation losses. Cluster 0 waits for it (``--dilocox-min-clusters 2`` with a rejoin
    timeout): on a loaded machine the restart can take longer than the rest of cluster 0's run."""
    from test_cluster_jobs import MODEL

    from tools.fault_soak import cluster_workers

    prefix = f"h{os.getpid() % 10**6}"
    assert _wan("up", "--clusters", "2", "--rate", "100mbit", "--prefix", prefix).returncode == 0
    metrics = tmp_path / "m.jsonl"
    flags = MODEL + ["--train-iters", "60", "--eval-interval", "30", "--dilocox-sync-mode", "sync",
                     "--dilocox-compression", "none", "--dilocox-failure-timeout-s", "30",
                     "--dilocox-min-clusters", "2", "--dilocox-rejoin-timeout-s", "600",
                     "--dilocox-emulated-delay-s", "1.5", "--metrics-file", str(metrics)]
    try:
        jobs = subprocess.Popen([*WAN, "launch", "--prefix", prefix, "--cluster-jobs", "--max-restarts", "1",
                                 "--nproc-per-node", "1", "--master-port", "29620", "--lighthouse-port", "29630",
                                 "--", "pretrain_gpt.py", *flags], cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=worker_env())
        killed, lines = None, []
        for line in jobs.stdout:
            lines.append(line)
            restarted = metrics.with_name("m.cluster-1.jsonl")
            # On the first training line once cluster 1 has logged iteration 10 (lines of both
            # clusters interleave, and a cluster prints its line before it writes the record).
            if killed is None and " iteration " in line and restarted.is_file() and any(
                    r.get("iteration", 0) >= 10 for r in read_jsonl(restarted) if "lm_loss" in r):
                workers = cluster_workers(1, jobs.pid)
                workers[0].send_signal(signal.SIGKILL)
                killed = len(workers)
        jobs.wait(timeout=60)
    finally:
        _wan("down", "--prefix", prefix)
    out = "".join(lines)
    assert killed == 1 and jobs.returncode == 0, out[-6000:]
    assert out.count("joined the running clusters") == 1, out[-6000:]
    vals = [[(r["iteration"], r["val_loss"]) for r in read_jsonl(path) if "val_loss" in r]
            for path in (metrics, metrics.with_name("m.cluster-1.jsonl"))]
    # The restarted cluster evaluates from its join on: the same losses as its peer at the same
    # iterations, to the end.
    assert [it for it, _ in vals[0]] == [30, 60] and vals[1] and vals[1] == vals[0][-len(vals[1]):], vals
