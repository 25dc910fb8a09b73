"""tools/bench_vs_allreduce.py: argument checks, and (as root) one short run over shaped links whose
bytes match the interfaces' counters, plus teardown when a run fails or is terminated."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from launch import REPO
from test_wan import _namespaces, needs_netns

sys.path.insert(0, str(REPO / "tools"))

import bench_vs_allreduce as bench  # noqa: E402
from pretrain_flags import flag_value  # noqa: E402
from vs_allreduce.figures import window_rate  # noqa: E402
from vs_allreduce.runs import METHODS, Bench, run_order, with_flag  # noqa: E402

HARNESS = [sys.executable, str(REPO / "tools" / "bench_vs_allreduce.py")]
PRETRAIN = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--max-position-embeddings", "64", "--micro-batch-size", "4", "--global-batch-size", "8",
            "--train-iters", "20", "--lr", "3e-3", "--lr-warmup-iters", "5", "--split", "90,10,0"]


def _data(ds, tmp_path) -> list[str]:
    return ["--data-path", str(ds / "c_text_document"), "--tokenizer-type", "SentencePieceTokenizer",
            "--tokenizer-model", str(ds / "sp.model"), "--data-cache-path", str(tmp_path / "cache")]


@pytest.mark.parametrize("args, message", [
    (["--rate", "10mbit", "--out", "o"], "flags after --"),
    (["--rate", "10mb", "--out", "o", "--", *PRETRAIN], "--rate must look like"),
    (["--rate", "10mbit", "--out", "o", "--", *PRETRAIN, "--dilocox-local-steps", "5"],
     "--dilocox-local-steps is set by the harness"),
    (["--rate", "10mbit", "--out", "o", "--", *PRETRAIN, "--seed=3"], "--seed is set by the harness"),
    (["--rate", "10mbit", "--out", "o", "--", *PRETRAIN[:-8]], "must contain --train-iters N"),
    (["--rate", "10mbit", "--out", "o", "--methods", "allreduce,fast", "--", *PRETRAIN], "--methods: unknown fast"),
    (["--rate", "10mbit", "--out", "o", "--local-steps", "7", "--", *PRETRAIN], "--local-steps must divide"),
    (["--rate", "10mbit", "--out", "o", "--clusters", "3", "--", *PRETRAIN], "divisible by --clusters 3"),
    (["--rate", "10mbit", "--out", "o", "--shaped-iters", "compute-only=5", "--", *PRETRAIN], "--shaped-iters takes"),
    (["--rate", "10mbit", "--out", "o", "--local-steps", "5", "--shaped-iters", "dilocox-sync=12", "--", *PRETRAIN],
     "N must be a multiple of 5"),
    (["--rate", "10mbit", "--out", "o", "--ranks-per-cluster", "0", "--", *PRETRAIN], "--ranks-per-cluster"),
    (["--rate", "10mbit", "--out", "o", "--compute-only-repeats", "0", "--", *PRETRAIN],
     "--compute-only-repeats must be >= 1, got 0"),
    (["--rate", "10mbit", "--out", "o", "--compression-args", "--dilocox-outer-lr 2", "--", *PRETRAIN],
     "--compression-args takes only codec flags"),
    (["--rate", "10mbit", "--out", "o", "--local-steps-ramp-iters", "-1", "--", *PRETRAIN],
     "--local-steps-ramp-iters must be >= 0, got -1"),
    (["--rate", "10mbit", "--out", "o", "--min-local-steps", "11", "--", *PRETRAIN],
     "--min-local-steps must be in 1..--local-steps 10, got 11"),
    (["--rate", "10mbit", "--out", "o", "--min-local-steps", "2", "--local-steps-ramp-iters", "0", "--", *PRETRAIN],
     "--min-local-steps bounds the H ramp"),
    (["--rate", "10mbit", "--out", "o", "--after-ramp-iters", "20", "--methods", "allreduce", "--", *PRETRAIN],
     "--after-ramp-iters measures dilocox-overlap-compressed after its H ramp"),
    (["--rate", "10mbit", "--out", "o", "--after-ramp-iters", "20", "--local-steps-ramp-iters", "0", "--",
      *PRETRAIN], "it needs that method and --local-steps-ramp-iters > 0"),
    (["--rate", "10mbit", "--out", "o", "--local-steps", "5", "--after-ramp-iters", "12", "--", *PRETRAIN],
     "--after-ramp-iters must be a multiple of --local-steps 5, at least 15, got 12"),
])
def test_argument_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.main(args)
    assert exit_.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("bench_vs_allreduce.py: error:") and message in last, last


def test_ramp_floor_and_outer_settings_reach_every_dilocox_method_only_projections_at_fixed_h():
    args = bench.build_parser().parse_args(["--rate", "10mbit", "--out", "o", "--local-steps", "5",
                                            "--local-steps-ramp-iters", "10", "--min-local-steps", "2",
                                            "--outer-lr", "1.4", "--", *PRETRAIN])
    cfg = dict(pretrain=PRETRAIN, iters=20, gbs=8, compression=[], shaped={"dilocox-sync": 10})
    b = Bench(args, cfg, None)
    for method in METHODS:
        flags = b._flags(method, 20, "m.jsonl", evaluate=True)
        dilocox = method not in ("allreduce", "compute-only")
        assert ("--dilocox-local-steps-ramp-iters" in flags) == dilocox, method
        if dilocox:  # a projected method at a fixed H (steady rounds)
            want = "0" if method == "dilocox-sync" else "10"
            assert flag_value(flags, "--dilocox-local-steps-ramp-iters") == want, method
            assert flag_value(flags, "--dilocox-min-local-steps") == (None if method == "dilocox-sync" else "2")
            assert flag_value(flags, "--dilocox-outer-lr") == "1.4"
    after_ramp = b._flags("dilocox-overlap-compressed", 15, "m.jsonl", evaluate=False, fixed_h=True)
    assert flag_value(after_ramp, "--dilocox-local-steps-ramp-iters") == "0"
    assert flag_value(after_ramp, "--dilocox-min-local-steps") is None


def test_window_rate_leaves_out_the_first_round_and_the_drain(tmp_path):
    # 2 s for the first round of 5 iterations, then 0.5 s an iteration; a drain record after the last.
    path = tmp_path / "m.jsonl"
    lines = [dict(iteration=i, lm_loss=5.0, tokens=100 * i, train_s=2.0 + 0.5 * (i - 5) if i >= 5 else 0.4 * i)
             for i in range(1, 21)]
    lines.append(dict(iteration=20, outer_step=4, drain=True, wait_s=9.0, bytes_sent=1))
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    window = window_rate(path, 5)
    assert window == dict(tokens_per_s=200.0, first_iteration=5, last_iteration=20, seconds=7.5)
    assert window_rate(path, 20) is None  # a run of one round has no steady part


def test_compute_only_runs_first_between_and_last():
    others = ["allreduce", "dilocox-sync", "dilocox-overlap", "dilocox-overlap-compressed"]
    a, b, c, d = others
    assert run_order(["compute-only", *others], 3) == ["compute-only", a, b, "compute-only", c, d, "compute-only"]
    assert run_order([*others, "compute-only"], 2) == ["compute-only", *others, "compute-only"]
    assert run_order([a, "compute-only"], 4) == ["compute-only", "compute-only", a, "compute-only", "compute-only"]
    assert run_order([c, "compute-only", a], 1) == [c, "compute-only", a]
    assert run_order(others, 3) == others


@needs_netns
def test_shaped_run_end_to_end(tiny_dataset, tmp_path):
    """2 clusters x 1 rank at 20 Mbit, 20 iterations: AllReduce, compressed DiLoCoX and compute-only
    measured, DiLoCoX sync projected from 15 shaped iterations (shorter than the lr warm-up), and
    compressed DiLoCoX's throughput after its H ramp from 15 more."""
    out, rate = tmp_path / "bench", 20 * 10**6
    before = _namespaces()
    proc = subprocess.run([*HARNESS, "--rate", "20mbit", "--clusters", "2", "--ranks-per-cluster", "1",
                           "--local-steps", "5", "--overlap-mode", "eager", "--eval-interval", "10", "--eval-iters", "2", "--out", str(out),
                           "--methods", "compute-only,dilocox-overlap-compressed,dilocox-sync,allreduce",
                           "--shaped-iters", "dilocox-sync=15", "--compute-only-repeats", "2", "--after-ramp-iters", "15",
                           "--", *PRETRAIN, *_data(tiny_dataset, tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    started = [line for line in proc.stdout.splitlines() if line.startswith("> ") and line.endswith(")")]
    assert [line.rsplit("(", 1)[1] for line in started] == [
        "compute-only, run 1)", "dilocox-overlap-compressed)", "dilocox-sync)", "allreduce)", "compute-only, run 2)"]
    assert _namespaces() == before
    assert "iteration 20/20" in proc.stdout  # progress while it runs
    result = json.loads((out / "results.json").read_text())
    by = {r["method"]: r for r in result["methods"]}
    assert [r["method"] for r in result["methods"]] == ["allreduce", "dilocox-sync", "dilocox-overlap-compressed",
                                                        "compute-only"]
    sync = by["dilocox-sync"]
    assert sync["kind"] == "projected (15 shaped its)" and sync["shaped_window"]["last_iteration"] == 15
    assert sync["tokens"] == 20 * 8 * 64 and sync["train_s"] == pytest.approx(sync["tokens"] / sync["tokens_per_s"])
    for r in by.values():  # the wall clock adds the validation at iteration 10 to the training time
        assert r["wall_s"] > r["train_s"] and r["tokens_per_s_wall"] < r["tokens_per_s"], r
    assert result["table"] in proc.stdout
    assert (out / "loss_vs_time.png").stat().st_size > 0 and (out / "loss_vs_bytes.png").stat().st_size > 0
    ar, dlx, alone = by["allreduce"], by["dilocox-overlap-compressed"], by["compute-only"]
    assert dlx["label"] == "DiLoCoX eager+comp" and result["setup"]["overlap_mode"] == "eager"
    assert all("--dilocox-sync-mode eager" in c for c in result["commands"]["dilocox-overlap-compressed"])
    # DiLoCoX ran as one job per cluster joined by a Lighthouse, AllReduce as one job across them.
    for name in ("dilocox-overlap-compressed", "dilocox-sync-shaped", "dilocox-sync-unshaped"):
        assert [f"--dilocox-cluster-index {k}" in c for k, c in enumerate(result["commands"][name])] == [True, True]
    assert len(result["commands"]["allreduce"]) == 2 and "--dilocox-lighthouse" not in str(result["commands"]["allreduce"])
    assert ar["tokens"] == dlx["tokens"] == alone["tokens"] == 20 * 8 * 64
    assert ar["speedup_vs_allreduce"] == 1.0 and alone["fraction_of_compute_only"] == 1.0
    assert [p["iteration"] for p in ar["curve"]] == [10, 20] == [p["iteration"] for p in alone["curve"]]
    # The audited cross-cluster bytes (1 rank per cluster) really crossed the shaped interfaces:
    # the counters add TCP/IP headers (~4%), rendezvous and evaluation traffic, nothing more.
    for sent in ar["link_tx_bytes"]:
        assert ar["cross_cluster_bytes"] <= sent <= 1.1 * ar["cross_cluster_bytes"] + 2**20, (sent, ar)
    # ... and they were rate-limited: they cannot cross faster than the link allows.
    assert ar["train_s"] >= 0.9 * ar["cross_cluster_bytes"] * 8 / rate, ar
    assert dlx["cross_cluster_bytes"] * 10 < ar["cross_cluster_bytes"]
    assert all(dlx["cross_cluster_bytes"] <= sent for sent in dlx["link_tx_bytes"]), dlx  # through the links too
    assert max(alone["link_tx_bytes"]) < 64 * 1024 and alone["cross_cluster_bytes"] == 0
    # compute-only's row is the slower of its two runs (the lower median), both listed.
    assert alone["kind"] == "measured (median of 2 runs)" and len(alone["repeats"]) == 2
    assert alone["tokens_per_s"] == min(r["tokens_per_s"] for r in alone["repeats"])
    assert (out / "compute-only-r1-c1.jsonl").is_file()
    # After the ramp: the same method at a fixed H, rated from the end of its first round.
    after = dlx["after_ramp"]
    assert (after["first_iteration"], after["last_iteration"]) == (5, 15) and after["tokens_per_s"] > 0
    assert all("--dilocox-local-steps-ramp-iters 0" in c
               for c in result["commands"]["dilocox-overlap-compressed-after-ramp"])
    assert "--dilocox-local-steps-ramp-iters" not in str(result["commands"]["dilocox-overlap-compressed"])
    assert after["speedup_vs_allreduce"] == pytest.approx(after["tokens_per_s"] / ar["tokens_per_s"])
    assert after["fraction_of_compute_only"] == pytest.approx(after["tokens_per_s"] / alone["steady_tokens_per_s"])
    assert f"after the H ramp: DiLoCoX eager+comp at H 5, iterations 5-15 over the 20mbit link: " \
           f"{after['tokens_per_s']:.0f} tokens/s" in proc.stdout


def _harness_processes(marker: str) -> list[str]:
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if marker in line and "ps -eo" not in line]


@needs_netns
def test_teardown_on_failed_run_and_on_sigterm(tiny_dataset, tmp_path):
    before = _namespaces()
    # A training job that fails (pretrain_gpt.py rejects the flag) ends the harness with the log named.
    failed = subprocess.run([*HARNESS, "--rate", "20mbit", "--ranks-per-cluster", "1", "--out", str(tmp_path / "f"),
                             "--methods", "allreduce", "--", *PRETRAIN, "--hidden-size", "63",
                             *_data(tiny_dataset, tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "error: command" in failed.stderr and "allreduce-c" in failed.stderr
    assert _namespaces() == before and not _harness_processes(str(tmp_path / "f"))
    # SIGTERM while training runs: children stopped, namespaces removed.
    out = tmp_path / "t"
    proc = subprocess.Popen([*HARNESS, "--rate", "20mbit", "--ranks-per-cluster", "1", "--out", str(out),
                             "--methods", "allreduce", "--prefix", f"s{os.getpid() % 10**6}",
                             "--", *with_flag(PRETRAIN, "--train-iters", 2000), *_data(tiny_dataset, tmp_path)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not (out / "allreduce.jsonl").exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.5)
    assert (out / "allreduce.jsonl").exists(), proc.communicate()[0]
    assert f"s{os.getpid() % 10**6}-hub" in _namespaces()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    assert _namespaces() == before and not _harness_processes(str(out))
