"""Fault soak: DiLoCoX clusters as independent jobs (``python -m megatron_dilocox.launch``) while a
random live cluster's training process is killed every few rounds and torchrun restarts it, beside
the same run without faults and the same run as one torch.distributed world.

    python tools/fault_soak.py --out runs/faults --clusters 3 --kill-every 6 -- <pretrain_gpt.py flags>

The pretrain flags must hold ``--dilocox`` and ``--dilocox-local-steps``; the tool adds the metrics
files. Runs, in order, each in its own folder under ``--out``:

- ``world``: one torchrun world of C processes spanning the clusters (``--dilocox-clusters C``);
- ``jobs``: the C clusters as jobs with no faults (throughput against ``world``);
- ``faults``: the same, with a kill (SIGKILL of the cluster's worker; its torchrun agent stays and
  restarts it, up to ``--max-restarts`` times) after every ``--kill-every`` rounds, the last
  ``--quiet-rounds`` rounds left without faults so the last restarted cluster can rejoin.

Prints and writes ``results.json``: rounds applied, for each failure the round it hit, how long
the round in flight took on the survivors (detection: the torchft Lighthouse's heartbeat timeout),
how many rounds the cluster was missing and the seconds until it had rejoined, the cluster-rounds
of work lost in all, and the final validation loss of every run.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare_runs import read_records  # noqa: E402
from pretrain_flags import flag_value  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
ITERATION = re.compile(r"^\[cluster (\d+)\] .* iteration +(\d+)/")
JOINED = re.compile(r"^\[cluster (\d+)\] > joined the running clusters")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for the runs and results.json")
    p.add_argument("--clusters", type=int, default=3, help="C: clusters, one single-rank job each")
    p.add_argument("--kill-every", type=int, default=6, help="rounds between kills")
    p.add_argument("--quiet-rounds", type=int, default=8, help="rounds at the end without kills")
    p.add_argument("--max-restarts", type=int, default=100, help="torchrun restarts per cluster")
    p.add_argument("--seed", type=int, default=1, help="seed of the choice of the cluster to kill")
    p.add_argument("pretrain", nargs=argparse.REMAINDER, help="-- pretrain_gpt.py flags")
    return p


def check_args(parser, args) -> list[str]:
    pretrain = args.pretrain[1:] if args.pretrain[:1] == ["--"] else args.pretrain
    if "--dilocox" not in pretrain:
        parser.error("the pretrain flags must hold --dilocox")
    for flag in ("--dilocox-local-steps", "--train-iters"):
        if not (flag_value(pretrain, flag) or "").isdigit():
            parser.error(f"the pretrain flags must hold {flag} N")
    if any(f.split("=")[0] in ("--metrics-file", "--dilocox-clusters") for f in pretrain):
        parser.error("leave --metrics-file and --dilocox-clusters out of the pretrain flags: the tool sets them")
    if args.clusters < 2 or args.kill_every < 1 or args.quiet_rounds < 0:
        parser.error("--clusters must be >= 2, --kill-every >= 1, --quiet-rounds >= 0")
    return pretrain


def cluster_processes(cluster: int, launcher: int, agent: bool = True) -> list[psutil.Process]:
    """Cluster ``cluster``'s processes (its torchrun agent unless ``agent`` is False, and its
    workers) among the descendants of ``launcher`` (the pid of the local launcher): another run
    on the same machine is left alone."""
    found = []
    for p in psutil.Process(launcher).children(recursive=True):
        try:
            cmd = p.cmdline()
        except psutil.NoSuchProcess:
            continue
        if ("--dilocox-cluster-index" in cmd and cmd[cmd.index("--dilocox-cluster-index") + 1] == str(cluster)
                and (agent or "torch.distributed.run" not in cmd)):
            found.append(p)
    return found


def cluster_workers(cluster: int, launcher: int) -> list[psutil.Process]:
    """Cluster ``cluster``'s training processes (not its torchrun agent)."""
    return cluster_processes(cluster, launcher, agent=False)


def _stream(cmd: list[str], log: Path, on_line=None) -> int:
    """Runs ``cmd``, writing its output to ``log`` and handing each line and ``cmd``'s pid to ``on_line``."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            for line in proc.stdout:
                out.write(line)
                if on_line is not None:
                    on_line(line, proc.pid)
            return proc.wait()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def run_jobs(args, pretrain: list[str], folder: Path, faults: bool) -> dict:
    """The clusters as jobs; with ``faults``, kills a random live cluster every ``--kill-every`` rounds."""
    folder.mkdir(parents=True, exist_ok=True)
    h, iters = int(flag_value(pretrain, "--dilocox-local-steps")), int(flag_value(pretrain, "--train-iters"))
    rng = random.Random(args.seed)
    kills, joins, up = [], [], set(range(args.clusters))
    next_kill = args.kill_every * h if faults else None
    last_kill = iters - args.quiet_rounds * h

    def on_line(line: str, launcher: int) -> None:
        nonlocal next_kill
        if faults and (joined := JOINED.match(line)):
            k = int(joined.group(1))
            joins.append(dict(cluster=k, t=time.time()))
            up.add(k)
        if not faults or not (m := ITERATION.match(line)):
            return
        if int(m.group(2)) >= next_kill and next_kill <= last_kill:
            live = sorted(k for k in up if cluster_workers(k, launcher))
            if len(live) > 1:  # never the last one
                k = rng.choice(live)
                for p in cluster_workers(k, launcher):
                    p.send_signal(signal.SIGKILL)
                up.discard(k)
                kills.append(dict(cluster=k, iteration=int(m.group(2)), t=time.time()))
                print(f"> killed cluster {k} after iteration {m.group(2)}", flush=True)
            next_kill += args.kill_every * h

    metrics = folder / "m.jsonl"
    cmd = [sys.executable, "-m", "megatron_dilocox.launch", "--clusters", str(args.clusters),
           "--max-restarts", str(args.max_restarts if faults else 0), "--", str(REPO / "pretrain_gpt.py"),
           *pretrain, "--metrics-file", str(metrics)]
    start = time.time()
    code = _stream(cmd, folder / "log.txt", on_line)
    if code != 0:
        raise SystemExit(f"fault_soak.py: error: the {'faulty' if faults else 'fault-free'} run failed "
                         f"(exit status {code}); see {folder / 'log.txt'}")
    files = [metrics if k == 0 else metrics.with_name(f"m.cluster-{k}.jsonl") for k in range(args.clusters)]
    return dict(wall_s=time.time() - start, kills=kills, joins=joins, records=[read_records(f) for f in files])


def run_world(args, pretrain: list[str], folder: Path) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.clusters}",
           str(REPO / "pretrain_gpt.py"), *pretrain, "--dilocox-clusters", str(args.clusters),
           "--metrics-file", str(folder / "m.jsonl")]
    start = time.time()
    if (code := _stream(cmd, folder / "log.txt")) != 0:
        raise SystemExit(f"fault_soak.py: error: the one-world run failed (exit status {code}); "
                         f"see {folder / 'log.txt'}")
    return dict(wall_s=time.time() - start, records=[read_records(folder / "m.jsonl")])


def _tokens_per_s(records: list[dict]) -> float:
    return statistics.median(r["tokens_per_sec"] for r in records if "tokens_per_sec" in r)


def _final_val(records: list[dict]) -> float | None:
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    return vals[-1] if vals else None


def analyze(faulty: dict, clusters: int) -> dict:
    """Rounds applied, and per failure: detection, rounds missing, time to rejoin."""
    rounds: dict[int, dict] = {}  # iteration -> the round as the clusters that committed it record it
    for records in faulty["records"]:
        for r in records:
            if "outer_step" in r and not r.get("drain") and r["iteration"] not in rounds:
                rounds[r["iteration"]] = r
    order = sorted(rounds)
    failures = []
    for kill in faulty["kills"]:
        hit = next((it for it in order if it > kill["iteration"] and rounds[it]["participants"] < clusters), None)
        back = next((it for it in order if hit is not None and it > hit and rounds[it]["participants"] == clusters),
                    None)
        missing = [it for it in order if hit is not None and hit <= it and (back is None or it < back)]
        join = next((j for j in faulty["joins"] if j["cluster"] == kill["cluster"] and j["t"] > kill["t"]), None)
        failures.append(dict(
            cluster=kill["cluster"], killed_after_iteration=kill["iteration"], round_hit=hit,
            detection_s=rounds[hit]["comm_s"] if hit is not None else None,
            rounds_missing=len(missing), cluster_rounds_lost=sum(clusters - rounds[it]["participants"] for it in missing),
            back_at_iteration=back, rejoin_s=join["t"] - kill["t"] if join else None))
    return dict(rounds_applied=len(order), failures=failures,
                cluster_rounds_lost=sum(clusters - r["participants"] for r in rounds.values()),
                fault_free_comm_s=statistics.median(r["comm_s"] for r in rounds.values()
                                                    if r["participants"] == clusters) if rounds else None)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    pretrain = check_args(parser, args)
    out = Path(args.out)
    print("> one world", flush=True)
    world = run_world(args, pretrain, out / "world")
    print("> clusters as jobs, no faults", flush=True)
    clean = run_jobs(args, pretrain, out / "jobs", faults=False)
    print(f"> clusters as jobs, a kill every {args.kill_every} rounds", flush=True)
    faulty = run_jobs(args, pretrain, out / "faults", faults=True)
    soak = analyze(faulty, args.clusters)
    finals = [_final_val(r) for r in faulty["records"]]
    results = dict(
        clusters=args.clusters, kill_every=args.kill_every, **soak,
        val_loss=dict(world=_final_val(world["records"][0]), jobs=_final_val(clean["records"][0]),
                      faults=finals[0], faults_all_clusters=finals),
        tokens_per_sec=dict(world=_tokens_per_s(world["records"][0]), jobs=_tokens_per_s(clean["records"][0])))
    results["tokens_per_sec"]["jobs_over_world"] = results["tokens_per_sec"]["jobs"] / results["tokens_per_sec"]["world"]
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(results, indent=1))
    os.replace(tmp, out / "results.json")

    print(f"\nrounds applied: {soak['rounds_applied']}, failures: {len(soak['failures'])}, cluster-rounds lost: "
          f"{soak['cluster_rounds_lost']} (a fault-free round's exchange: {soak['fault_free_comm_s']:.2f} s)")
    print(f"{'cluster':>7} {'killed after':>12} {'round hit':>9} {'detection s':>11} {'rounds out':>10} "
          f"{'rejoined at':>11} {'rejoin s':>8}")
    for f in soak["failures"]:
        print(f"{f['cluster']:>7} {f['killed_after_iteration']:>12} {f['round_hit'] or '-':>9} "
              f"{f['detection_s'] if f['detection_s'] is None else round(f['detection_s'], 2):>11} "
              f"{f['rounds_missing']:>10} {f['back_at_iteration'] or '-':>11} "
              f"{'-' if f['rejoin_s'] is None else round(f['rejoin_s'], 1):>8}")
    v, t = results["val_loss"], results["tokens_per_sec"]
    print(f"final validation loss: with faults {v['faults']:.4f} (every cluster: "
          f"{', '.join(f'{x:.4f}' for x in finals if x is not None)}), without {v['jobs']:.4f}, one world {v['world']:.4f}")
    print(f"tokens/s: jobs {t['jobs']:.0f}, one world {t['world']:.0f} (jobs / world {t['jobs_over_world']:.3f})")
    print(f"> {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
