"""Launch a multi-process scenario script with torchrun and collect what it wrote."""

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


def worker_env(**extra: str) -> dict:
    """The environment of a test's worker processes: one thread each (the machine's cores are
    shared), no warnings, then ``extra``."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **extra}


def torchrun(nproc: int, script: str, args: list[str], timeout: int = 600, env=None) -> subprocess.CompletedProcess:
    """Runs ``script`` under torchrun on ``nproc`` CPU processes; fails the test with the output tail."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--master-port={free_port()}", str(script), *args]
    proc = subprocess.run(cmd, cwd=REPO, env=worker_env(**(env or {})), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}")
    return proc


def read_jsonl(path) -> list[dict]:
    """A metrics file's records, read as the tools read them."""
    from tools.compare_runs import read_records

    return read_records(path)


def _forked_worker(rank, port, out_dir, scenarios):
    import datetime
    import traceback

    import torch
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=60))
        group = dist.new_group([0, 1])  # a dedicated group, as the outer loop gets
        torch.save(scenarios(rank, group), os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


def _forked_child(out_dir, scenarios):
    import traceback

    import torch

    try:
        torch.save(scenarios(), os.path.join(out_dir, "child.pt"))
    except BaseException:
        with open(os.path.join(out_dir, "child.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


def _join(procs, out: Path, timeout: float) -> None:
    """Waits for forked processes; kills what outlives ``timeout`` and fails the test with their tracebacks."""
    import time

    import pytest

    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(timeout=max(1.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    errors = [f.read_text() for f in sorted(out.glob("*.err"))]
    codes = [p.exitcode for p in procs]
    if errors or any(codes):
        pytest.fail(f"forked processes failed (exit codes {codes}):\n" + "\n".join(errors))


def run_forked(scenarios, out: Path, timeout: float = 120):
    """Runs ``scenarios(rank, group) -> dict`` on 2 gloo ranks forked after import (no second
    torch import; all scenarios share one launch) and returns each rank's dict. Failures and
    hangs fail the test with the workers' tracebacks."""
    import multiprocessing

    import torch

    ctx = multiprocessing.get_context("fork")
    port = free_port()
    procs = [ctx.Process(target=_forked_worker, args=(r, port, str(out), scenarios)) for r in range(2)]
    for p in procs:
        p.start()
    _join(procs, out, timeout)
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def run_in_fork(scenarios, out: Path, timeout: float = 300):
    """Runs ``scenarios()`` in one forked child (the process group, megatron's global state and
    the CPU bridge it sets up stay out of the pytest process) and returns what it returned.
    Failures and hangs fail the test with the child's traceback."""
    import multiprocessing

    import torch

    child = multiprocessing.get_context("fork").Process(target=_forked_child, args=(str(out), scenarios))
    child.start()
    _join([child], out, timeout)
    return torch.load(out / "child.pt", weights_only=False)


def read_tensorboard(folder) -> dict[str, list[tuple[int, float]]]:
    """Every scalar that TensorBoard's own event reader finds in ``folder``: {tag: [(step, value), ...]}
    in the order written."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep every point
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def read_wandb(folder) -> tuple[dict, dict[str, list[tuple[int, float]]]]:
    """The one offline W&B run under ``folder`` (a run's ``--wandb-save-dir``), read back from its
    ``.wandb`` file: (its config, {key: [(step, value), ...]} of every logged number in the order
    logged). The file is W&B's record log (LevelDB's log format: a 7-byte file header, 32 KiB
    blocks, each chunk a 4-byte checksum, 2-byte length and 1-byte type before its bytes) of
    W&B's own protobuf ``Record`` messages; wandb 0.31 ships no reader of its own."""
    import json
    from wandb.proto import wandb_internal_pb2

    (path,) = Path(folder).glob("wandb/offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run log"
    block, pos, chunks, config, history = 32768, 7, [], {}, {}
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunks.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind not in (1, 4):  # FIRST and MIDDLE chunks of a record that goes on
            continue
        record = wandb_internal_pb2.Record()
        record.ParseFromString(b"".join(chunks))
        chunks = []
        if record.WhichOneof("record_type") == "run":
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
        elif record.WhichOneof("record_type") == "history":
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                if not key.startswith("_"):  # W&B's own _step, _runtime, _timestamp
                    history.setdefault(key, []).append((record.history.step.num, json.loads(item.value_json)))
    return config, history
