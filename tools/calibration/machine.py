"""The machine figures of the planner's CPU mode: achieved matmul GFLOP/s and gloo loopback bandwidth."""
from __future__ import annotations

import os
import statistics
import time

from calibration.quiet import load, wait_quiet
from calibration.runs import model_shape


def _gemms(model: str, threads: int, repeats: int = 7) -> float:
    """Achieved matmul GFLOP/s of this process with ``threads`` threads, on one layer's GEMMs
    (forward, input gradient, weight gradient), its attention products and the logits, at the
    model's micro-batch (4 x 128 tokens), fp32; median of ``repeats`` timed passes."""
    import torch

    from megatron_dilocox import planner as pl

    torch.set_num_threads(threads)
    m = model_shape(model)
    tokens, s, h, a = 4 * m.seq_length, m.seq_length, m.hidden_size, m.num_attention_heads
    mats = [t.shape for t in pl.layer_tensors(m) if len(t.shape) == 2]
    mats.append((pl.padded_vocab(m.vocab_size, m.make_vocab_size_divisible_by, 1), h))
    x = {n: torch.randn(tokens, n) for n in {d for shape in mats for d in shape}}
    w = [torch.randn(shape) for shape in mats]
    q = torch.randn(4 * a, s, h // a)
    probs = torch.randn(4 * a, s, s)
    flops = sum(3 * 2 * tokens * o * i for o, i in mats) + 3 * 2 * 2 * 4 * a * s * s * (h // a)

    def one_pass():
        for (o, i), wt in zip(mats, w):
            x[i] @ wt.t()                  # forward
            x[o] @ wt                      # input gradient
            x[o].t() @ x[i]                # weight gradient
        for _ in range(3):                 # scores and weighted values, forward and 2 backward products
            torch.bmm(q, q.transpose(1, 2))
            torch.bmm(probs, q)

    one_pass()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        one_pass()
        times.append(time.perf_counter() - start)
    return flops / statistics.median_high(times) / 1e9


def _gloo_worker(rank: int, port: int, numel: int, out) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    x = torch.ones(numel)
    dist.all_reduce(x)
    times = []
    for _ in range(9):
        start = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - start)
    if rank == 0:
        out.send(statistics.median_high(times))
    dist.destroy_process_group()


def gloo_gbps(nbytes: int) -> float:
    """Loopback bandwidth of a 2-process gloo all-reduce of ``nbytes`` (median of 9), in Gbit/s as
    the planner counts it: a 2-rank ring moves ``2 (2 - 1) / 2 x nbytes`` = nbytes per rank."""
    import multiprocessing
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    procs = [ctx.Process(target=_gloo_worker, args=(r, port, nbytes // 4, send)) for r in range(2)]
    for proc in procs:
        proc.start()
    seconds = recv.recv()
    for proc in procs:
        proc.join()
    return nbytes * 8 / seconds / 1e9


def machine_figures(model: str, max_busy: float) -> dict:
    """The measured inputs of the planner's CPU mode for ``model``: matmul GFLOP/s with 1 and
    with all threads, gloo loopback bandwidth at the fp32 gradient size (data-parallel
    all-reduce) and at one micro-batch's activations (tensor-parallel all-reduce, pipeline sends)."""
    from megatron_dilocox import planner as pl

    m = model_shape(model)
    grads = 4 * pl.param_count(m)
    acts = 4 * 4 * m.seq_length * m.hidden_size
    wait_quiet(max_busy)
    intra, tp = gloo_gbps(grads), gloo_gbps(acts)  # forked before any matmul starts threads
    one, all_ = _gemms(model, 1), _gemms(model, os.cpu_count())
    return dict(cpu_gflops=(one, all_), intra_gbps=intra, tp_gbps=tp, load=load())
