"""The outer link: how one rank reaches the ranks holding its shard in the other clusters.

Everything the outer loop sends between clusters goes through a link's calls, so the
reducers (:func:`~megatron_dilocox.outer.sync.allreduce_mean`, the compressed reducer) run one
code path whether the clusters share one torch.distributed world or run as independent jobs:

* :meth:`all_gather` returns every delivering cluster's bytes, in cluster order;
* :meth:`mean` averages fp32 tensors in place, bit-identical on every rank that receives it;
* :meth:`run_round` makes several all-gathers one round (a low-rank codec's P and Q), which a
  fault-tolerant link commits or retries as a whole.

:class:`GroupLink` is a torch.distributed group with one rank per cluster (one world spanning
every cluster: every cluster always delivers). The fault-tolerant link of clusters that run as
their own jobs is :class:`~megatron_dilocox.outer.cluster_exchange.ExchangeLink`, whose
deliveries may leave out a lost cluster.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Protocol, TypeVar

import torch
import torch.distributed as dist


# -- the one collective: an all-gather of equal-sized byte buffers ------------------------------
# Quantized contributions cannot be summed in flight without re-quantizing, and each rank
# dequantizing a different partial sum would break agreement. So every rank receives every
# cluster's payload and reduces them itself, in cluster order. Bytes are counted as a
# ByteCounter's all-reduce would be: the size of the buffer this rank hands to the collective;
# on the wire a ring all-gather moves (C - 1) times that per rank, a ring all-reduce about
# 2 (C - 1) / C times.

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


T = TypeVar("T")
Verify = Callable[[int, torch.Tensor], object]
"""``verify(cluster, payload)`` raises ValueError for a payload that must not be used."""


class Gathered(NamedTuple):
    rows: torch.Tensor
    """CPU uint8 ``(n, payload bytes)``: one row per delivering cluster."""
    senders: list[int]
    """The cluster of each row, ascending; this rank's own is among them unless ``sat_out``."""
    sat_out: bool = False
    """This cluster sent no payload this round (it was healed from a peer, its own was stale)."""


class OuterLink(Protocol):
    cluster: int
    """This rank's cluster."""
    clusters: int
    """C, the clusters of the run (a round may deliver fewer)."""
    delivered: int
    """The clusters the last exchange delivered (C before the first)."""
    verifies_state: bool
    """Whether every exchange checks that the senders' states agree (then the outer loop needs no
    start-up hash or codec handshake of its own)."""
    timings: tuple[float, ...] | None
    """What this rank sends along with its next round (adaptive H's measurements; None: nothing),
    set by the thread that runs the rounds."""

    def peak_timings(self) -> tuple[float, ...] | None:
        """The elementwise maximum of the ``timings`` the clusters that delivered the last round
        sent with it (None: none sent any), the same on each rank of those clusters' outer group."""

    def all_gather(self, payload: torch.Tensor, counter=None, verify: Verify | None = None) -> Gathered:
        """Every delivering cluster's ``payload`` (CPU uint8, the same size everywhere)."""

    def run_round(self, body: Callable[[], T]) -> T:
        """Runs ``body()``, whose :meth:`all_gather` calls are one round's exchanges (a low-rank
        codec's two), delivered by the same clusters' quorum; a link that retries a failed round
        runs ``body`` again, so it must change no state until this returns."""

    def mean(self, tensors: list[torch.Tensor], counter=None) -> list[torch.Tensor]:
        """In-place fp32 mean over the delivering clusters."""

    def close(self) -> None:
        """Leaves the exchange (at the end of training)."""

    def state_dict(self) -> dict | None:
        """What a checkpoint keeps of the link (None: nothing)."""

    def load_state_dict(self, state: dict) -> None:
        """Restores :meth:`state_dict`."""


class GroupLink:
    """The link over a torch.distributed group of one rank per cluster; None: a single cluster
    (nothing is sent). A payload that fails ``verify`` fails the round on every rank alike: all
    of them received the same bytes."""

    verifies_state = False
    timings = None

    def __init__(self, group):
        self.group = group
        self.cluster = 0 if group is None else dist.get_rank(group)
        self.clusters = self.delivered = 1 if group is None else dist.get_world_size(group)

    def all_gather(self, payload: torch.Tensor, counter=None, verify: Verify | None = None) -> Gathered:
        rows = all_gather_bytes(payload, self.group, counter)
        senders = list(range(rows.shape[0]))
        if verify is not None:
            for k in senders:
                verify(k, rows[k])
        return Gathered(rows, senders)

    def run_round(self, body: Callable[[], T]) -> T:
        return body()  # every cluster always delivers: nothing to retry

    def peak_timings(self) -> tuple[float, ...] | None:
        """One all-reduce of the ``timings`` (set on every rank alike, or on none)."""
        if self.timings is None:
            return None
        t = torch.tensor(self.timings, dtype=torch.float64)
        if self.group is not None:
            t = t.to(comm_device(self.group))
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return tuple(t.tolist())

    def mean(self, tensors: list[torch.Tensor], counter=None) -> list[torch.Tensor]:
        """Sums with ``all_reduce``, then divides by C. The sum is bit-identical on all ranks:
        gloo's (and NCCL's) ring allreduce reduces each chunk once, on one path, and then
        circulates the finished chunk, so every rank receives the same bits."""
        if self.group is None:
            return tensors
        for t in tensors:
            count(counter, t.numel() * t.element_size())
            dist.all_reduce(t, group=self.group)
            t.div_(self.clusters)
        return tensors

    def close(self) -> None:
        pass  # the group is the run's, destroyed with its process group

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, state) -> None:
        raise ValueError("the checkpoint was saved by a cluster running as its own job (--dilocox-lighthouse); "
                         "resume it the same way")


def as_link(group_or_link) -> OuterLink:
    """A link as it is; a process group (or None) as its :class:`GroupLink`."""
    return group_or_link if hasattr(group_or_link, "all_gather") else GroupLink(group_or_link)


def gathered_mean(link: OuterLink, tensors: list[torch.Tensor], counter=None) -> list[torch.Tensor]:
    """:meth:`OuterLink.mean` from :meth:`OuterLink.all_gather`: the fp32 bytes of every delivering
    cluster, summed in cluster order and divided by their count (a tensor divisor: true IEEE
    division on every device), so every receiving rank runs the same exactly rounded operations."""
    flat = torch.cat([t.detach().reshape(-1).cpu() for t in tensors])
    got = link.all_gather(flat.view(torch.uint8), counter)
    total = torch.zeros_like(flat) if not got.senders else None  # no cluster delivered (this one sat out)
    for row in got.rows:
        values = row.view(torch.float32)
        total = values.clone() if total is None else total.add_(values)
    total.div_(torch.tensor(float(max(1, len(got.senders)))))
    offset = 0
    for t in tensors:
        t.copy_(total[offset: offset + t.numel()].view_as(t))
        offset += t.numel()
    return tensors
