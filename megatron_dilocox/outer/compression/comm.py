"""The one collective compressed payloads use: an all-gather of equal-sized byte buffers.

Quantized contributions cannot be summed in flight without re-quantizing, and each rank
dequantizing a different partial sum would break agreement. So every rank receives every
cluster's payload and reduces them itself, in cluster order (see ``reducer.py``).

Bytes are counted on the caller's :class:`~megatron_dilocox.outer.sync.ByteCounter` the way its
``all_reduce`` counts: the size of the buffer this rank hands to the collective (its payload).
On the wire a ring all-gather moves ``(C - 1)`` times that per rank, a ring all-reduce of the
same buffer about ``2 (C - 1) / C`` times.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _gather_single(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    # torch 2.13 renamed all_gather_into_tensor to all_gather_single (looked up per call).
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def count(counter, nbytes: int) -> None:
    """Adds one collective of ``nbytes`` to ``counter`` (a ByteCounter; None counts nothing)."""
    if counter is not None:
        with counter._lock:  # ByteCounter's own lock: the worker thread and readers share it
            counter.bytes += int(nbytes)
            counter.calls += 1


def comm_device(group) -> torch.device:
    """Device the group's backend moves tensors from: the current GPU for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_bytes(payload: torch.Tensor, group, counter=None) -> torch.Tensor:
    """Every rank's ``payload`` (CPU uint8, the same size on all ranks), stacked in group-rank order.

    Args:
        payload: this rank's bytes.
        group: the outer process group, or None for a single cluster (no communication).
        counter: ByteCounter to count ``payload.numel()`` bytes on.

    Returns:
        CPU uint8 tensor of shape ``(C, payload.numel())``; row ``k`` came from group rank ``k``.
    """
    if group is None:
        return payload.view(1, -1)
    size = dist.get_world_size(group)
    device = comm_device(group)
    out = torch.empty(size * payload.numel(), dtype=torch.uint8, device=device)
    count(counter, payload.numel())
    _gather_single(out, payload.to(device), group=group)
    return out.cpu().view(size, -1)
