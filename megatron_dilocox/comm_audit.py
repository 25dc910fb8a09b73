"""Counts the bytes this rank sends across clusters, by phase of training.

Wraps the ``torch.distributed`` collectives and point-to-point calls (megatron-core calls
them through the module, so every call is seen) and, for each call, asks whether its group
or peer leaves this rank's cluster. Calls from the DiLoCoX worker thread are counted under
``"outer"``; calls from the training thread under the phase the training loop has set
(``"startup"``, ``"step"``, ``"boundary"``, ``"eval"``, ``"checkpoint"``). The point: outside ``"boundary"``
and ``"outer"``, cross-cluster bytes must stay exactly zero.
"""

import inspect
import threading
from collections import defaultdict

import torch
import torch.distributed as dist

# collective -> name of the argument holding what this rank sends
_COLLECTIVES = {
    "all_reduce": "tensor",
    "broadcast": "tensor",
    "reduce": "tensor",
    "all_gather": "tensor",
    "all_gather_into_tensor": "input_tensor",
    "all_gather_single": "input_tensor",
    "reduce_scatter": "input_list",
    "reduce_scatter_tensor": "input",
    "reduce_scatter_single": "input",
}
_P2P_CALLS = ("send", "recv", "isend", "irecv")


def _nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(x) for x in obj)
    return 0


class CommAudit:
    """Byte tallies keyed by (phase, "cross" | "intra")."""

    def __init__(self, cluster_size: int):
        self.cluster_size = cluster_size
        self.cluster = dist.get_rank() // cluster_size
        self.phase = "startup"
        self.bytes = defaultdict(int)
        self._lock = threading.Lock()
        self._crosses = {}
        self._originals = {}

    def cross_cluster_bytes(self, *phases: str) -> int:
        """Cross-cluster bytes sent in the given phases; none given: those of training, every
        phase but start-up and checkpoint saves (a save's own agreement, after its tallies were
        taken, would otherwise make a resumed run's count differ from an uninterrupted one's)."""
        if not phases:
            phases = {phase for phase, _ in self.bytes} - {"startup", "checkpoint"}
        return sum(self.bytes[(phase, "cross")] for phase in phases)

    def state_dict(self) -> list[list]:
        """The tallies as ``[phase, "cross" | "intra", bytes]`` rows, for a checkpoint: a run
        resumed from it counts on from them, as its consumed samples do."""
        with self._lock:
            return [[phase, kind, n] for (phase, kind), n in self.bytes.items()]

    def load_state_dict(self, rows: list[list]) -> None:
        """Adds a checkpoint's tallies (:meth:`state_dict`) to this run's."""
        with self._lock:
            for phase, kind, n in rows:
                self.bytes[(phase, kind)] += int(n)

    def count_exchange(self, nbytes: int) -> None:
        """Counts bytes sent between cluster jobs by the outer exchange, which torch.distributed
        does not carry (torchft's own process groups, :mod:`megatron_dilocox.outer.cluster_exchange`)."""
        self._count(nbytes, crosses=True)

    def _group_crosses(self, group) -> bool:
        key = id(group)
        if key not in self._crosses:
            ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
            self._crosses[key] = any(r // self.cluster_size != self.cluster for r in ranks)
        return self._crosses[key]

    def _count(self, nbytes: int, crosses: bool) -> None:
        phase = self.phase if threading.current_thread() is threading.main_thread() else "outer"
        with self._lock:
            self.bytes[(phase, "cross" if crosses else "intra")] += nbytes

    def _wrap_collective(self, fn, sent_param):
        signature = inspect.signature(fn)

        def call(*args, **kwargs):
            bound = signature.bind_partial(*args, **kwargs).arguments
            self._count(_nbytes(bound.get(sent_param)), self._group_crosses(bound.get("group")))
            return fn(*args, **kwargs)
        return call

    def _peer_crosses(self, peer, group, group_peer) -> bool:
        if peer is None:
            peer = dist.get_global_rank(group, group_peer)
        return peer // self.cluster_size != self.cluster

    def _wrap_p2p(self, fn):
        # send/recv/isend/irecv(tensor, dst|src, group, tag, group_dst|group_src)
        def call(tensor, *args, **kwargs):
            positional = dict(zip(("peer", "group"), args))
            peer = kwargs.get("dst", kwargs.get("src", positional.get("peer")))
            group = kwargs.get("group", positional.get("group"))
            group_peer = kwargs.get("group_dst", kwargs.get("group_src"))
            self._count(_nbytes(tensor), self._peer_crosses(peer, group, group_peer))
            return fn(tensor, *args, **kwargs)
        return call

    def install(self) -> "CommAudit":
        wrappers = {name: self._wrap_collective(getattr(dist, name), sent)
                    for name, sent in _COLLECTIVES.items() if hasattr(dist, name)}
        wrappers.update({name: self._wrap_p2p(getattr(dist, name)) for name in _P2P_CALLS})
        for name, wrapper in wrappers.items():
            self._originals[name] = getattr(dist, name)
            setattr(dist, name, wrapper)
        # batch_isend_irecv calls isend/irecv through c10d's globals (and checks P2POp.op
        # against them), so the point-to-point wrappers replace those too.
        for name in _P2P_CALLS:
            setattr(dist.distributed_c10d, name, wrappers[name])
        return self

    def uninstall(self) -> None:
        for name, fn in self._originals.items():
            setattr(dist, name, fn)
            if name in _P2P_CALLS:
                setattr(dist.distributed_c10d, name, fn)
        self._originals.clear()
