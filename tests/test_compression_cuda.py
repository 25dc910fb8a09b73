"""Heterogeneous clusters: one rank on the CPU, one on a CUDA device, must agree bit for bit.

Skipped without CUDA. The two ranks are two threads of this process joined by an in-memory
all-gather (gloo cannot all-gather between a CPU tensor and a CUDA tensor of one process, and
one GPU cannot hold two NCCL ranks). Their local matmuls differ (MKL vs cuBLAS), so their
payloads differ, but both decode the same bytes and must end with the same bits.
"""
import threading

import pytest
import torch
import torch.distributed as dist

from megatron_dilocox.config import CompressionConfig
from megatron_dilocox.outer import link
from megatron_dilocox.outer.compression import CompressedReducer, lowrank
from megatron_dilocox.outer.compression import quantize as qz

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SHAPES = [(512, 1024), (1024,), (384, 96), (3, 7), (64, 1000), (4097,)]
NUMEL = sum(torch.Size(s).numel() for s in SHAPES)
DEVICES = ("cpu", "cuda")


class ThreadGroup:
    """An all-gather between threads: thread k is rank k."""

    def __init__(self, size):
        self.size, self.slots, self.barrier, self.local = size, [None] * size, threading.Barrier(size), threading.local()

    def all_gather_bytes(self, payload, group, counter=None):
        self.slots[self.local.rank] = payload.clone()
        self.barrier.wait()
        rows = torch.stack(self.slots)
        self.barrier.wait()
        return rows


@pytest.fixture
def thread_group(monkeypatch):
    group = ThreadGroup(2)
    monkeypatch.setattr(link, "all_gather_bytes", group.all_gather_bytes)
    monkeypatch.setattr(dist, "get_world_size", lambda g=None: g.size)
    monkeypatch.setattr(dist, "get_rank", lambda g=None: g.local.rank)
    return group


def run_ranks(group, kwargs, rounds=3):
    outs, errors = [[] for _ in DEVICES], []

    def rank(k):
        try:
            group.local.rank = k
            red = CompressedReducer(SHAPES, CompressionConfig(**kwargs))
            for rnd in range(rounds):
                g = torch.Generator().manual_seed(100 * k + rnd)
                x = torch.randn(NUMEL, generator=g).to(DEVICES[k])
                (out,) = red([x], group)
                outs[k].append((out.cpu(), list(red.ranks)))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            group.barrier.abort()

    threads = [threading.Thread(target=rank, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return outs


@pytest.mark.parametrize("kwargs", [
    dict(codec="quantize", bits=8),
    dict(codec="quantize", bits=4, error_feedback=True),
    dict(codec="lowrank", rank=8),
    dict(codec="lowrank-quantize", bits=4, rank=16, adaptive=True, rank_energy=0.5, error_feedback=True),
    dict(codec="topk", bits=2),
    dict(codec="topk", bits=3, topk_chunk=48, topk_density=0.3),  # bitmap positions
])
def test_cpu_and_cuda_ranks_agree_bit_for_bit(thread_group, kwargs):
    cpu, cuda = run_ranks(thread_group, kwargs)
    for rnd, ((a, ra), (b, rb)) in enumerate(zip(cpu, cuda)):
        assert ra == rb, f"round {rnd + 1}: adaptive ranks differ"
        assert torch.equal(a, b), f"round {rnd + 1}: {int((a != b).sum())} elements differ"


def test_shared_steps_are_device_independent():
    g = torch.Generator().manual_seed(0)
    p = torch.randn(3, 2000, 12, generator=g)
    q = torch.randn(700, 12, generator=g)
    assert torch.equal(lowrank.orthonormalize(p), lowrank.orthonormalize(p.cuda()).cpu())
    out_cpu, out_gpu = torch.empty(2000, 700), torch.empty(2000, 700, device="cuda")
    lowrank.reconstruct(p[0], q, out_cpu)
    lowrank.reconstruct(p[0].cuda(), q.cuda(), out_gpu)
    assert torch.equal(out_cpu, out_gpu.cpu())
    assert lowrank.column_energy(q) == lowrank.column_energy(q.cuda())
    x = torch.randn(100_000, generator=g) * torch.logspace(-30, 30, 100_000)
    for bits in (8, 4):
        qt = qz.quantize(x, bits, 256)
        on_gpu = qz.QuantizedTensor(qt.codes.cuda(), qt.scales.cuda(), qt.numel, bits, 256)
        assert torch.equal(qz.dequantize(qt), qz.dequantize(on_gpu).cpu())
    two = torch.tensor(3.0)
    assert torch.equal(x.clone().div_(two), x.cuda().div_(two.cuda()).cpu())  # how _div divides
