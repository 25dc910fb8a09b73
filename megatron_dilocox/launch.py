"""Run C DiLoCoX clusters on one machine, each its own torchrun job, joined by a torchft Lighthouse.

    python -m megatron_dilocox.launch --clusters 2 --nproc-per-cluster 2 -- \\
        pretrain_gpt.py --dilocox --pipeline-model-parallel-size 2 ... --save ckpt

Starts a Lighthouse (unless ``--lighthouse`` names a running one) and C torchrun jobs, each with
its own rendezvous and ``--dilocox-lighthouse ADDR --dilocox-cluster-index K --dilocox-clusters C``
added to the script's flags, so that no collective crosses clusters except the outer exchange.
Every job's output is printed with a ``[cluster K]`` prefix. A cluster that dies does not stop
the others (they go on without it, docs/reliability.md); with ``--max-restarts N`` torchrun
starts a cluster's failed workers again, up to N times, and the cluster rejoins the running
ones, taking the global parameters and outer state from a live peer. The exit status is 0 when at least one
cluster finished, else the first failed cluster's; the lost clusters are named either way.
Across machines, run ``torchft_lighthouse`` yourself and one torchrun per cluster with the same
flags (docs/reliability.md).
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

PROG = "python -m megatron_dilocox.launch"
HEARTBEAT_TIMEOUT_MS = 5000
"""How long the Lighthouse waits for a silent cluster before it forms quorums without it."""
LIGHTHOUSE_SETTINGS = dict(min_replicas=1, join_timeout_ms=60000, quorum_tick_ms=100,
                           heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
"""The Lighthouse's settings (torchft's ``LighthouseServer`` keywords, ``torchft_lighthouse`` flags)."""
TORCHFT_LOG_ENV = {"RUST_LOG": "warn"}
"""Environment for torchft's Rust side: its Lighthouse logs every quorum request at info."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--clusters", type=int, required=True, help="C: clusters, one torchrun job each")
    p.add_argument("--nproc-per-cluster", type=int, default=1, help="ranks per cluster (TP x PP x DP_in)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="times torchrun may restart a cluster whose worker failed (it then rejoins the others)")
    p.add_argument("--lighthouse", default=None,
                   help="HOST:PORT of a running torchft Lighthouse (default: start one on a free local port)")
    p.add_argument("script", nargs=argparse.REMAINDER, help="-- pretrain_gpt.py and its flags")
    return p


def cluster_command(script: list[str], k: int, clusters: int, nproc: int, lighthouse: str,
                    max_restarts: int = 0, master_addr: str = "127.0.0.1", master_port: int | None = None) -> list[str]:
    """The torchrun command line of cluster ``k``; ``master_addr``: the cluster's own address,
    where the other clusters reach its store (default: this machine's loopback, a free port)."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}", f"--master-addr={master_addr}",
            f"--master-port={master_port or _free_port()}", *script,
            "--dilocox-lighthouse", lighthouse, "--dilocox-cluster-index", str(k),
            "--dilocox-clusters", str(clusters)]


def lighthouse_command(port: int) -> list[str]:
    """A standalone Lighthouse on every interface at ``port`` (torchft's ``torchft_lighthouse``)."""
    binary = Path(sys.executable).with_name("torchft_lighthouse")
    return [str(binary), "--bind", f"[::]:{port}", *(x for key, value in LIGHTHOUSE_SETTINGS.items()
                                                   for x in (f"--{key}", str(value)))]


def _pump(stream, prefix: str, out) -> None:
    for line in stream:
        out.write(prefix + line)
        out.flush()


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script:
        print(f"{PROG}: error: give the training script after --, e.g. -- pretrain_gpt.py --dilocox ...",
              file=sys.stderr)
        return 2
    if args.clusters < 1 or args.nproc_per_cluster < 1 or args.max_restarts < 0:
        print(f"{PROG}: error: --clusters and --nproc-per-cluster must be >= 1, --max-restarts >= 0", file=sys.stderr)
        return 2
    if any(flag.split("=")[0] in ("--dilocox-lighthouse", "--dilocox-cluster-index", "--dilocox-clusters")
           for flag in script):
        print(f"{PROG}: error: the launcher sets --dilocox-lighthouse, --dilocox-cluster-index and "
              "--dilocox-clusters itself; leave them out of the script's flags", file=sys.stderr)
        return 2

    server = None
    lighthouse = args.lighthouse
    if lighthouse is None:
        for key, value in TORCHFT_LOG_ENV.items():
            os.environ.setdefault(key, value)
        from torchft._torchft import LighthouseServer

        server = LighthouseServer(bind="[::]:0", **LIGHTHOUSE_SETTINGS)
        lighthouse = server.address().replace("http://", "")
        print(f"> torchft Lighthouse at {lighthouse}", flush=True)

    procs, pumps = [], []
    for k in range(args.clusters):
        proc = subprocess.Popen(cluster_command(script, k, args.clusters, args.nproc_per_cluster, lighthouse,
                                                args.max_restarts),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)  # a Ctrl-C reaches the jobs through us only
        procs.append(proc)
        pumps.append(threading.Thread(target=_pump, args=(proc.stdout, f"[cluster {k}] ", sys.stdout), daemon=True))
        pumps[-1].start()

    def forward(signum, _frame):
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signum)

    previous = signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    try:
        codes = [proc.wait() for proc in procs]
        for pump in pumps:
            pump.join()
    finally:
        signal.signal(signal.SIGINT, previous)
        if server is not None:
            server.shutdown()
    lost = [k for k, code in enumerate(codes) if code != 0]
    if not lost:
        return 0
    finished = [k for k, code in enumerate(codes) if code == 0]
    print(f"> lost clusters: {', '.join(f'{k} (exit status {codes[k]})' for k in lost)}; "
          f"finished: {', '.join(map(str, finished)) or 'none'}", file=sys.stderr, flush=True)
    return 0 if finished else (codes[lost[0]] if codes[lost[0]] > 0 else 1)


if __name__ == "__main__":
    sys.exit(main())
