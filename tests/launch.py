"""Launch a multi-process scenario script with torchrun and collect what it wrote."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, script: str, args: list[str], timeout: int = 600, env=None) -> subprocess.CompletedProcess:
    """Runs ``script`` under torchrun on ``nproc`` CPU processes; fails the test with the output tail."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--master-port={free_port()}", str(script), *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
    proc = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}")
    return proc


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def run_forked(worker, out: Path, nprocs: int = 2, timeout: float = 120):
    """Runs ``worker(rank, port, out_dir)`` in ``nprocs`` processes forked after import (no
    second torch import), then returns each rank's ``out/rank{r}.pt``. A worker reports failure
    by writing ``out/rank{r}.err``; failures and hangs fail the test with the tracebacks."""
    import multiprocessing
    import time

    import pytest
    import torch

    ctx = multiprocessing.get_context("fork")
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, port, str(out))) for r in range(nprocs)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(timeout=max(1.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    errors = [f.read_text() for f in sorted(out.glob("*.err"))]
    codes = [p.exitcode for p in procs]
    if errors or codes != [0] * nprocs:
        pytest.fail(f"workers failed (exit codes {codes}):\n" + "\n".join(errors))
    return [torch.load(out / f"rank{r}.pt") for r in range(nprocs)]
