"""Starts torchrun jobs inside cluster namespaces and stops all of them if one fails or on Ctrl-C.

One job across all clusters (:func:`spanning_job`): cluster ``k`` runs ``torchrun --nnodes C
--node-rank k`` in its namespace, rendezvous (env/static) at cluster 0's address. Or one job per
cluster (:func:`cluster_jobs`), as ``python -m megatron_dilocox.launch`` runs them on one machine:
each its own torchrun world at its own address, joined only by a torchft Lighthouse in cluster
0's namespace. Either way gloo binds to the shaped interface (``GLOO_SOCKET_IFNAME``), so every
byte between clusters crosses the shaped links while ranks of one cluster talk over loopback.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from netns import WAN_IFNAME, WanError

from megatron_dilocox.launch import TORCHFT_LOG_ENV, cluster_command, lighthouse_command


def torchrun_cmd(nnodes: int, node_rank: int, nproc_per_node: int, master_addr: str, master_port: int,
                 argv: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--node-rank={node_rank}",
            f"--nproc-per-node={nproc_per_node}", f"--master-addr={master_addr}", f"--master-port={master_port}",
            *argv]


def in_namespace(namespace: str, cmd: list[str]) -> list[str]:
    """``cmd`` inside ``namespace``, with gloo bound to its shaped interface."""
    return ["ip", "netns", "exec", namespace, "env", f"GLOO_SOCKET_IFNAME={WAN_IFNAME}", *cmd]


def spanning_job(namespaces: list[str], master_addr: str, nproc_per_node: int, argv: list[str],
                 master_port: int = 29500) -> list[list[str]]:
    """One torchrun job over all clusters: one command per cluster namespace."""
    return [in_namespace(ns, torchrun_cmd(len(namespaces), k, nproc_per_node, master_addr, master_port, argv))
            for k, ns in enumerate(namespaces)]


def cluster_jobs(namespaces: list[str], addresses: list[str], nproc_per_node: int, argv: list[str],
                 master_port: int = 29500, lighthouse_port: int = 29510,
                 max_restarts: int = 0) -> tuple[list[str], list[list[str]]]:
    """One torchrun job per cluster (cluster k in ``namespaces[k]`` at ``addresses[k]``, its store at
    ``master_port + k``, restarted by torchrun up to ``max_restarts`` times), and the Lighthouse that
    joins them (in the first namespace): returns the Lighthouse's command and one command per
    cluster. The same namespace may hold several clusters."""
    lighthouse = f"{addresses[0]}:{lighthouse_port}"
    jobs = [in_namespace(ns, cluster_command(argv, k, len(namespaces), nproc_per_node, lighthouse, max_restarts,
                                             master_addr=address, master_port=master_port + k))
            for k, (ns, address) in enumerate(zip(namespaces, addresses))]
    return in_namespace(namespaces[0], lighthouse_command(lighthouse_port)), jobs


def exit_on_sigterm() -> None:
    """Turns SIGTERM into SystemExit, so ``finally`` blocks (teardown) run as they do on Ctrl-C."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def _stop(procs: list[subprocess.Popen]) -> None:
    for sig, grace in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
        alive = [p for p in procs if p.poll() is None]
        for p in alive:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        for p in alive:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass


def run(cmds: list[list[str]], logs: list[Path] | None = None, poll=None, poll_s: float = 5.0,
        env: dict | None = None, service: list[str] | None = None) -> None:
    """Runs the commands concurrently, each in its own process group, until all exit.

    Args:
        cmds: full command lines (e.g. from :func:`spanning_job`).
        logs: one file per command for its stdout and stderr; ``None`` inherits the terminal.
        poll: called every ``poll_s`` seconds while they run (progress reporting).
        env: extra environment variables.
        service: a command started first and stopped when the others are done (the Lighthouse of
            :func:`cluster_jobs`); it logs beside the first command's log.

    Raises:
        WanError: naming the first command that failed (and its log); the others are stopped.
    """
    full_env = {**os.environ, **TORCHFT_LOG_ENV, **(env or {})}
    if service is not None:
        cmds, logs = [service, *cmds], logs and [logs[0].with_suffix(".lighthouse.log"), *logs]
    files = [open(log, "w") for log in logs] if logs else [None] * len(cmds)
    procs = []
    try:
        for cmd, f in zip(cmds, files):
            procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT if f else None,
                                          env=full_env, start_new_session=True))
        next_poll = time.monotonic() + poll_s
        while True:
            codes = [p.poll() for p in procs]
            bad = next((i for i, code in enumerate(codes) if code not in (None, 0)), None)
            if bad is not None:
                where = f" (log: {logs[bad]})" if logs else ""
                raise WanError(f"command {bad} exited with {codes[bad]}{where}: {' '.join(cmds[bad])}")
            if all(code == 0 for code in codes[service is not None:]):
                return
            time.sleep(0.2)
            if poll and time.monotonic() >= next_poll:
                poll()
                next_poll += poll_s
    finally:
        _stop(procs)
        for f in files:
            if f:
                f.close()
