"""Connects megatron-core's optimizer to the DiLoCoX outer loop (:mod:`megatron_dilocox.outer`).

The outer loop works on the inner optimizer's fp32 main params (for the distributed optimizer:
this rank's shard of them, see :mod:`~megatron_dilocox.megatron_state`).
"""

import contextlib
import hashlib
import math
import time
from dataclasses import fields, replace
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_dilocox.config import CompressionConfig, DiLoCoXConfig
from megatron_dilocox.errors import ClusterLossError
from megatron_dilocox.megatron_state import main_params, model_param_of, push_to_model, uses_distributed_optimizer
from megatron_dilocox.outer.compression.reducer import CompressedReducer
from megatron_dilocox.outer.link import GroupLink, OuterLink
from megatron_dilocox.outer.sync import AppliedReduction, ByteCounter, OuterSync, RoundStats, allreduce_mean
from megatron_dilocox.platform.backend import device
from megatron_dilocox.topology import Topology
from megatron_dilocox.training.round_record import CodecRound, OuterRound


class DiLoCoX:
    """Round boundaries of one rank: every ``H`` inner steps, an :class:`OuterSync` step."""

    def __init__(self, optimizer, topo: Topology, config: DiLoCoXConfig,
                 compression: CompressionConfig, seed: int = 0, audit=None, link: OuterLink | None = None):
        """``audit``: the run's :class:`~megatron_dilocox.comm_audit.CommAudit` (with clusters),
        whose count of bytes sent across clusters outside boundaries each round's record carries.
        ``link``: how this rank reaches the other clusters (default: the topology's outer
        reduction group, one world spanning every cluster)."""
        self.optimizer = optimizer
        self.topo = topo
        self.link = link or GroupLink(topo.outer_reduce_group)
        self.config = config
        self.audit = audit
        self.params = main_params(optimizer)
        if not self.link.verifies_state:  # a link that does checks every payload's fingerprint (_fingerprint)
            self._check_identical_start()
        self._tied_index = self._find_tied_embedding()
        # The outer loop's parameters: all but the last stage's copy of a tied embedding, which
        # follows the first stage's copy (see _mirror_tied_embedding) and is never sent.
        copy_index = None if parallel_state.is_pipeline_first_stage(ignore_virtual=True) else self._tied_index
        self.outer_params = [p for i, p in enumerate(self.params) if i != copy_index]
        self.counter = ByteCounter()
        self.compressor = None
        reduce = partial(allreduce_mean, counter=self.counter)
        shapes = [p.shape for p in self.outer_params]
        if compression.codec != "none":
            self.compressor = reduce = CompressedReducer(shapes, compression, counter=self.counter, seed=seed)
        residual = lambda: self.compressor.residual  # noqa: E731
        flush_reducer = None
        if compression.flush_residual:
            flush_reducer = CompressedReducer(shapes, compression.flush_config(), counter=self.counter, seed=seed)
        self.sync = OuterSync(self.outer_params, self.link, config, reducer=reduce,
                              counter=self.counter, agree=self._agree,
                              unsent=residual if compression.keep_unsent else None,
                              flush=residual if compression.flush_residual else None,
                              flush_reducer=flush_reducer)
        self._round_start_time = time.perf_counter()
        self.start_at(0)
        self.next_landing: int | None = None
        self._rejoined: int | None = None  # see take_rejoin
        if self.link.verifies_state:
            self.link.fingerprint, self.link.serve, self.link.on_heal = self._fingerprint, self._serve, self._on_heal

    def _check_identical_start(self):
        """Every replica must start from bit-identical weights (one hash exchange at start)."""
        if self.link.clusters == 1:
            return
        digest = hashlib.sha256()
        for p in self.params:
            digest.update(p.detach().cpu().numpy().tobytes())
        got = self.link.all_gather(torch.frombuffer(bytearray(digest.digest()), dtype=torch.uint8))
        everyone = {k: bytes(row.tolist()).hex()[:16] for k, row in zip(got.senders, got.rows)}
        if len(set(everyone.values())) != 1:
            raise RuntimeError(f"DiLoCoX replicas start from different weights (sha256 by cluster): {everyone}")

    def _agree(self, flags: list[bool]) -> list[bool]:
        """Each flag ANDed over this rank's cluster (one tiny all-reduce inside it), so a round is
        skipped by the whole model or not at all; on reduced results, bit-identical across
        clusters, every cluster reaches the same answer without talking to the others."""
        flags = torch.tensor(flags, dtype=torch.int32, device=device())
        dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=self.topo.cluster_group)
        return [bool(f) for f in flags.tolist()]

    def _fingerprint(self) -> bytes:
        """SHA-256 of this rank's global parameters and the outer and codec settings: equal on
        the ranks holding the same shard in every cluster, round after round (checked by the link)."""
        c = self.config
        settings = (c.sync_mode, c.local_steps, c.ramp_iters, c.min_local_steps, c.landing, c.peak_outer_lr,
                    c.outer_lr_warmup_iters, c.outer_momentum, c.use_nesterov,
                    self.compressor._setup() if self.compressor is not None else None)
        digest = hashlib.sha256(repr(settings).encode())
        digest.update(self.sync.base.detach().cpu().numpy())  # the array's own buffer, no copy on the CPU
        return digest.digest()

    def _serve(self) -> dict:
        """What a restarted cluster takes from this one to join the run (the link's ``serve``)."""
        return {"sync": self.sync.serve(), "compressor": self.compressor.serve() if self.compressor else None}

    def _on_heal(self, state: dict) -> None:
        self.sync.join(state["sync"])
        if self.compressor is not None:
            self.compressor.join(state["compressor"])

    def take_rejoin(self) -> int | None:
        """The iteration the run is at, once after this cluster joined it from a live peer (the
        training loop goes on from there: schedule and data follow the iteration); else None."""
        rejoined, self._rejoined = self._rejoined, None
        return rejoined

    def _after_join(self, applied_at: int) -> None:
        """Sets the round bookkeeping after :meth:`OuterSync.join` took effect: the peers applied
        the reduction launched at their iteration ``joined_at`` at ``applied_at``."""
        launched, self.sync.joined_at = self.sync.joined_at, None
        self._rejoined = applied_at
        boundary = launched  # the peers' next boundary: their rounds from there on (H ramp included)
        while boundary <= applied_at:
            self.local_steps = self.config.local_steps_at(boundary)
            boundary += self.local_steps
        self.next_boundary = boundary

    def _find_tied_embedding(self) -> int | None:
        """Index of this rank's copy of a tied word embedding kept on two pipeline stages.

        megatron keeps the copies equal by reducing their gradients, so both stages train the
        same values. Only the first stage's copy takes part in the outer loop; reducing the last
        stage's too would send the embedding twice across clusters, and compressed (or, for
        C > 2, differently ordered) reductions of the two would not be bit-identical.
        :meth:`_mirror_tied_embedding` makes the last stage's copy follow after every outer update.
        """
        model_of = model_param_of(self.optimizer)
        tied = [i for i, p in enumerate(self.params) if getattr(model_of[id(p)], "shared_embedding", False)]
        assert len(tied) <= 1 and not (tied and uses_distributed_optimizer(self.optimizer)), "refused by parse_args"
        return tied[0] if tied else None

    def _mirror_tied_embedding(self) -> None:
        """Copies the first stage's embedding to the last stage's copy (a collective of both)."""
        if self._tied_index is None:
            return
        group = parallel_state.get_embedding_group()
        first_stage = min(dist.get_process_group_ranks(group))  # stage 0 has the lowest rank (tp-pp-dp order)
        with torch.no_grad():
            dist.broadcast(self.params[self._tied_index], first_stage, group=group)

    def start_at(self, iteration: int) -> None:
        """Schedules the rounds of a fresh outer state that starts at ``iteration`` (0, or where
        a weights-only load left the run): the first ends H steps later."""
        self.local_steps = self.config.local_steps_at(iteration)
        self.next_boundary = iteration + self.local_steps

    def is_boundary(self, iteration: int) -> bool:
        return iteration == self.next_boundary

    def is_landing(self, iteration: int) -> bool:
        """Whether the in-flight round's average is applied after ``iteration`` (--dilocox-overlap-steps)."""
        return iteration == self.next_landing

    def land(self) -> None:
        """Applies the in-flight round's average mid-round (:meth:`OuterSync.land`)."""
        try:
            self.sync.land()
        except ClusterLossError:
            self.next_landing = None  # a run resumed from a checkpoint saved now goes on to the next boundary
            raise
        self._mirror_tied_embedding()
        push_to_model(self.optimizer)
        self.next_landing = None
        if self.sync.joined_at is not None:
            self._after_join(self.sync.joined_at + self.config.landing)

    def _adapt_local_steps(self) -> dict[str, float]:
        """Adaptive H: the fewest steps whose compute covers the slowest exchange, +20%.

        Every rank of every cluster must decide alike, so the decision uses the maxima of the
        exchange time and time per step that every rank of the clusters that delivered the
        reduction just applied sent with it (:attr:`OuterSync.peak_timings`, then the maximum
        over this cluster's ranks: one 16-byte all-reduce inside it), which it returns for the
        round's record. A reduction carries the exchange time of the one before it, so H follows
        the exchange a round or two late; until one is measured, H stays.
        """
        measured = torch.tensor(self.sync.peak_timings or (0.0, 0.0), dtype=torch.float64, device=device())
        dist.all_reduce(measured, op=dist.ReduceOp.MAX, group=self.topo.cluster_group)
        comm_s, step_s = measured.tolist()
        if not (comm_s > 0 and step_s > 0):
            return {}
        wanted = math.ceil(1.2 * comm_s / step_s)
        self.local_steps = min(max(wanted, self.config.min_local_steps or 1), self.config.max_local_steps)
        return {"slowest_exchange_s": comm_s, "slowest_step_s": step_s}

    def _norm(self, sq: float) -> float:
        """The cluster's whole pseudo-gradient norm from this rank's squared shard norm, summed
        over the ranks that hold one replica's distinct shards: the whole cluster with the
        distributed optimizer (each data-parallel rank owns a shard of the main params), the
        model-parallel group without it (each data-parallel rank holds the whole replica).

        Parameters replicated across tensor-parallel ranks (norms, biases) count once per TP rank.
        """
        group = self.topo.cluster_group if uses_distributed_optimizer(self.optimizer) else self.topo.pg_collection.mp
        total = torch.tensor([sq], dtype=torch.float64, device=device())
        dist.all_reduce(total, group=group)
        return float(total.sqrt())

    def _codec_round(self, stats: RoundStats) -> CodecRound | None:
        """The compressor's account of the reduction applied at this call (in the overlapping
        modes: the previous round's); None without compression or without a reduction."""
        last = stats.codec
        if last is None or not stats.bytes_sent:
            return None
        return CodecRound(dense_bytes=last["dense_bytes"], compression_ratio=last["ratio"],
                          rel_error=last["rel_error"], mean_rank=last["mean_rank"],
                          codec_s=last["encode_s"] + last["decode_s"], residual_ratio=last["residual_ratio"])

    def _record(self, stats: RoundStats, drain: bool, **extra) -> OuterRound:
        """The round's record (collective in the cluster: the norm); ``extra``: the fields of a boundary
        (``round_compute_s``, ``local_steps``, adaptive H's measurements) or of the drain (``global_sha256``)."""
        between = self.audit.cross_cluster_bytes("step", "eval") if self.audit is not None else None
        total = self.audit.cross_cluster_bytes() if self.audit is not None else None
        applied = {f.name: getattr(stats, f.name) for f in fields(AppliedReduction)}
        return OuterRound(**applied, outer_step=stats.outer_step, iteration=stats.iteration,
                          pseudo_grad_norm=self._norm(stats.pseudo_grad_sq), drain=drain,
                          compression=self._codec_round(stats),
                          cross_cluster_bytes_between_boundaries=between, cross_cluster_bytes=total, **extra)

    def step(self, iteration: int, lr_scale: float = 1.0) -> OuterRound:
        """The round boundary after ``iteration``, where the inner lr has decayed to ``lr_scale``
        times its peak; returns the round's record."""
        compute_s = time.perf_counter() - self._round_start_time
        adaptive = self.config.max_local_steps is not None
        follows_lr = self.compressor is not None and self.compressor.config.ef_decay_follows_lr
        try:
            stats = self.sync.step(iteration, compute_s / self.local_steps if adaptive else None,
                                   lr_scale if follows_lr else None)
        except ClusterLossError:
            self.next_boundary = iteration + self.local_steps  # as above
            raise
        self._mirror_tied_embedding()
        push_to_model(self.optimizer)
        adapted = {}
        if not adaptive:
            self.local_steps = self.config.local_steps_at(iteration)
        elif stats.bytes_sent:
            adapted = self._adapt_local_steps()
        record = self._record(stats, drain=False, round_compute_s=compute_s, local_steps=self.local_steps, **adapted)
        self.next_boundary = iteration + self.local_steps
        if self.sync.joined_at is not None:  # sync: applied where launched; delay, eager: one round later
            self._after_join(self.sync.joined_at + (0 if self.config.sync_mode == "sync" else self.local_steps))
            iteration = self._rejoined
            record = replace(record, iteration=iteration)  # the run's iteration, as the peers record it
        tau = self.config.landing
        self.next_landing = iteration + tau if tau is not None and tau < self.local_steps else None
        self._round_start_time = time.perf_counter()
        return record

    def finish(self) -> OuterRound | None:
        """Drains and applies the in-flight round, so the final model holds all work."""
        stats = self.sync.finish()
        self._mirror_tied_embedding()
        push_to_model(self.optimizer)
        self.sync.close()
        record = None if stats is None else self._record(stats, drain=True, global_sha256=self._fingerprint().hex())
        self.link.close()
        return record

    def stop(self) -> None:
        """Stops without draining, for a run that exits after saving its in-flight round."""
        self.sync.close()
        self.link.close()

    def state_dict(self) -> dict:
        """Outer loop state for a checkpoint (waits for an in-flight reduction and keeps its
        result); the main params themselves are the checkpoint's to save."""
        return {"sync": self.sync.state_dict(),
                "compressor": None if self.compressor is None else self.compressor.state_dict(),
                "local_steps": self.local_steps, "next_boundary": self.next_boundary,
                "next_landing": self.next_landing, "link": self.link.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restores :meth:`state_dict` output; the main params must already hold their saved
        values (they are pushed to the model here). ValueError on a mismatch of settings."""
        if (state["compressor"] is None) != (self.compressor is None):
            raise ValueError("saved with --dilocox-compression "
                             f"{'none' if state['compressor'] is None else 'on'}, this run has "
                             f"{'none' if self.compressor is None else 'on'}")
        self.sync.load_state_dict(state["sync"])
        if self.compressor is not None:
            self.compressor.load_state_dict(state["compressor"])
        self.local_steps = int(state["local_steps"])
        self.next_boundary = int(state["next_boundary"])
        self.next_landing = state.get("next_landing")  # absent before --dilocox-overlap-steps existed
        if state.get("link") is not None:  # absent before clusters ran as jobs; None from one world
            self.link.load_state_dict(state["link"])
        push_to_model(self.optimizer)

    @contextlib.contextmanager
    def global_params(self, drained: bool = False):
        """Temporarily puts the outer (global) parameters into the model, e.g. for evaluation;
        ``drained``: with the in-flight round applied (see :meth:`OuterSync.drained_base`)."""
        saved = [p.detach().clone() for p in self.params]
        base = self.sync.drained_base() if drained else self.sync.base
        with torch.no_grad():
            for p, b in zip(self.outer_params, self.sync.views(base)):
                p.copy_(b)
        self._mirror_tied_embedding()
        push_to_model(self.optimizer)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, s in zip(self.params, saved):
                    p.copy_(s)
            push_to_model(self.optimizer)
