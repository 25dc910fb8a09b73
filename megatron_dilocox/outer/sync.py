"""DiLoCoX round boundary for one rank: pseudo-gradient, cross-cluster reduction, outer step.

Every H inner steps the training loop calls :meth:`OuterSync.step`. Notation (docs/dilocox.md, "The algorithm"), all
fp32 and flat over the shard this rank owns:

* ``base``        outer parameters; bit-identical on the C ranks of the outer group.
* ``round_start`` the point this round's local training started from.
* ``params``      the live parameters the inner optimizer trains (read and written here).
* ``delta_t = round_start - params``: this replica's progress in round t, measured from where
  the round started, before anything is applied.
* ``g_t = mean over clusters of delta_t``; ``Nesterov(base, g)`` is :class:`OuterNesterov`.

Modes at boundary t:

* ``sync``:  ``base = Nesterov(base, g_t)``; ``params = round_start = base``.
* ``delay``: ``base = Nesterov(base, g_{t-1})`` (nothing at t = 0); start reducing ``delta_t``
  in the background; ``params = round_start = base - delta_t``.
  Each replica's progress is counted exactly once: during round t+1 its own ``delta_t`` is in
  its params as a local carry; at boundary t+1 ``delta_{t+1}`` is measured from
  ``round_start``, so it holds only round t+1's progress, and the carry is replaced by
  ``g_t`` (which contains ``delta_t`` averaged) when the new start ``base' - delta_{t+1}``
  is written.
* ``eager``: as ``delay`` but ``params = round_start = base - delta_t / C``: the replica carries
  only its own share of the average that is on its way (the "eager update" of Kale et al. 2025,
  arXiv 2502.12996, with the other clusters' share left out until it arrives). ``delay`` carries
  its whole ``delta_t``, so the replicas drift further apart; at boundary t+1 both carries are
  replaced by ``g_t`` in the same way.
* Landing mid-round (``overlap_steps`` tau < H, ``delay`` and ``eager``): the reduction launched
  at boundary t is applied by :meth:`OuterSync.land` after tau inner steps of round t+1 instead of
  at boundary t+1: ``base = Nesterov(base, g_t)``, and each replica trades its carry for it,
  ``params += base - round_start``, ``round_start = base``. The replica keeps the tau steps of
  progress it made meanwhile (measured from the shifted ``round_start``, so ``delta_{t+1}`` still
  holds exactly round t+1's progress) and trains on the average for the rest of the round: the
  average is tau steps late instead of H (Streaming DiLoCo's overlap of tau inner steps,
  Douillard et al. 2025, arXiv 2501.18512).

Non-finite pseudo-gradients: the reduced ``g`` is checked with :func:`all_finite` before it is
applied. Any NaN/Inf sent by any cluster makes the fp32 sum non-finite, and the reduced tensor is
bit-identical on every rank of the outer group. A rank holds only a shard of the model, so the
shards' answers are combined by the ``agree`` callable (the DiLoCoX glue: one tiny all-reduce
inside the cluster); as every cluster combines the same bits, all ranks of all clusters skip the
same round (``RoundStats.skipped``) with no cross-cluster traffic. On a skip ``base`` is unchanged
and the round's work is dropped everywhere: ``params`` restart from ``base`` (in ``delay`` mode
from ``base - delta_t``, the fresh progress that is already on its way). A replica with a
non-finite ``delta_t`` on any of its ranks still sends it (so the group skips it in step) but
restarts from ``base`` at once instead of training on NaN.
"""
from __future__ import annotations

import concurrent.futures
import copy
import functools
import math
import threading
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Callable, NamedTuple, Sequence

import torch

from megatron_dilocox.config import DiLoCoXConfig
from megatron_dilocox.outer.link import as_link
from megatron_dilocox.outer.optimizer import OuterNesterov

Reducer = Callable[[list[torch.Tensor], Any], list[torch.Tensor]]
Agree = Callable[[list[bool]], list[bool]]


@dataclass(frozen=True)
class AppliedReduction:
    """The reduction applied since the previous boundary: in ``sync`` this round's, in the
    overlapping modes the previous round's, at :meth:`OuterSync.land` or at this boundary
    (zeros when there was none)."""

    bytes_sent: int
    """Payload bytes this rank sent to its outer group for it."""
    comm_s: float
    """Wall time of the reduction itself, measured in the worker thread."""
    wait_s: float
    """Time the training thread blocked waiting for it."""
    skipped: bool
    """It was non-finite somewhere in the model and was not applied."""
    participants: int
    """Clusters whose pseudo-gradients its mean holds (C unless one was lost or refused; 0:
    none applied, or a round resumed from a checkpoint)."""


@dataclass(frozen=True)
class RoundStats(AppliedReduction):
    """What happened at one round boundary (or at :meth:`OuterSync.finish`): the applied
    reduction, and this rank's local ``delta`` measured at this call (0 for ``finish``)."""

    outer_step: int
    """Number of round boundaries passed so far (1 at the first)."""
    iteration: int
    """Training iteration given to :meth:`OuterSync.step`."""
    pseudo_grad_norm: float
    """L2 norm of this rank's local ``delta`` (its shard only)."""
    pseudo_grad_sq: float
    """Squared L2 norm of the local ``delta``; sum it within the cluster for the global norm."""
    codec: dict | None = None
    """The reducer's account of the last reduction applied (a compressed reducer's
    ``last_stats``, taken as that reduction finished), or None."""


class ByteCounter:
    """Counts the payload bytes of the cross-cluster collectives :class:`OuterSync` and its
    reducers issue (every one goes through an outer link, :mod:`~megatron_dilocox.outer.link`,
    handed this counter), so ``bytes`` is all this module sent (payload, not wire bytes: a ring
    allreduce moves about twice as much)."""

    def __init__(self):
        self.bytes = 0
        self.calls = 0
        self._lock = threading.Lock()


def allreduce_mean(tensors: list[torch.Tensor], link, counter: ByteCounter | None = None) -> list[torch.Tensor]:
    """Default reducer: in-place fp32 mean over the outer ``link`` (or process group; identity
    for a single cluster), bit-identical on every rank that receives it (:meth:`OuterLink.mean`)."""
    return as_link(link).mean(tensors, counter)


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` is finite, in one pass (``torch.isfinite(t).all()`` takes
    four): a sum is finite iff all its terms are, unless it overflows, which takes magnitudes near
    3e38 / numel that only a diverged run reaches; such a tensor counts as non-finite too. Equal
    tensors give equal answers on every rank."""
    return math.isfinite(float(t.sum()))


class _Reduced(NamedTuple):
    grad: torch.Tensor
    comm_s: float
    nbytes: int
    participants: int
    codec: dict | None  # the reducer's last_stats, taken right after this reduction
    joined: dict | None = None  # a live peer's serve(), when this cluster healed in this reduction
    peak_timings: tuple[float, ...] | None = None  # the link's, right after this reduction


def _done(result: _Reduced) -> concurrent.futures.Future:
    future = concurrent.futures.Future()
    future.set_result(result)
    return future


class OuterSync:
    """The DiLoCoX outer loop of one rank (see the module docstring for the math).

    Args:
        params: live fp32 tensors this rank trains (the inner optimizer's main params). Read and
            written in place at boundaries only; the background thread never touches them.
        group: the outer link (:mod:`~megatron_dilocox.outer.link`), or the process group of the
            C ranks (one per cluster) holding the same shard; used by the background thread only
            (give it a dedicated one); None when C == 1.
        config: outer settings; ``config.clusters`` must equal the link's clusters.
        reducer: ``reducer(tensors, link) -> tensors`` used instead of :func:`allreduce_mean`
            (a test hook; it must return bit-identical results on all ranks and should send
            through ``counter`` to be counted).
        counter: byte counter for the default reducer; a fresh one if None.
        agree: ``agree(flags) -> flags``: each flag ANDed over all ranks holding a part of this
            rank's model replica, the same answer on each of them (a collective: called at the
            same points on all of them). None: the identity, for a replica on one rank.
        unsent: ``unsent() -> tensor | None``: what compression has not yet sent of this rank's
            progress (the reducer's error-feedback residual, laid out as ``base``), read between
            reductions only. Given, a replica restarts from ``base - unsent()`` instead of
            ``base``: it keeps its own unsent progress while error feedback sends it.
        flush: ``flush() -> tensor | None``: the same residual, for :meth:`finish` to send
            as one last outer step (and then zero).
        flush_reducer: how :meth:`finish` reduces flush's residual (same contract as
            ``reducer``); None: the dense fp32 mean.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        group,
        config: DiLoCoXConfig,
        reducer: Reducer | None = None,
        counter: ByteCounter | None = None,
        agree: Agree | None = None,
        unsent: Callable[[], torch.Tensor | None] | None = None,
        flush: Callable[[], torch.Tensor | None] | None = None,
        flush_reducer: Reducer | None = None,
    ):
        config.validate()
        self.params = list(params)
        if not self.params:
            raise ValueError("OuterSync needs at least one parameter")
        for p in self.params:
            if p.dtype != torch.float32:
                raise ValueError(f"OuterSync needs the fp32 main params, got {p.dtype}")
            if p.device != self.params[0].device:
                raise ValueError("OuterSync params must all be on one device")
        self.group = as_link(group)
        if self.group.clusters != config.clusters:
            raise ValueError(
                f"--dilocox-clusters is {config.clusters} but the outer group has {self.group.clusters} ranks"
            )
        self.config = config
        self.counter = counter if counter is not None else ByteCounter()
        self.reducer = reducer or functools.partial(allreduce_mean, counter=self.counter)
        self.agree = agree or (lambda flags: flags)
        self.unsent, self.flush = unsent, flush
        self.flush_reducer = flush_reducer or functools.partial(allreduce_mean, counter=self.counter)
        with torch.no_grad():
            self.base = self._state_tensor(torch.cat([p.detach().reshape(-1) for p in self.params]), copy=False)
        self.base_views = self.views(self.base)
        # The share of its fresh delta a replica carries into the next round (delay modes that
        # keep it); sync always starts a round from base and shares its buffer.
        self._carry = {"delay": 1.0, "eager": 1.0 / config.clusters}.get(config.sync_mode)
        own_start = self._carry or unsent is not None
        self.round_start = self._state_tensor(self.base, copy=True) if own_start else self.base
        self.optimizer = OuterNesterov(
            [self.base], config.peak_outer_lr, config.outer_momentum, config.use_nesterov
        )
        self.outer_step = 0
        self._iteration = 0
        self._inflight: concurrent.futures.Future | None = None
        self._landed: AppliedReduction | None = None  # by land(), for the next boundary to report
        self._codec: dict | None = None  # RoundStats.codec
        self._launched = {"outer_step": 0, "iteration": 0}  # where the in-flight reduction was launched
        self._joining: dict | None = None  # a peer's state, handed over within the running reduction
        self.joined_at: int | None = None  # see join()
        self._stale = False  # the live params hold progress made before a join
        self._last_comm_s = 0.0  # the worker's: the last reduction's comm_s, carried by the next one
        self.peak_timings: tuple[float, ...] | None = None
        """Of the reduction collected last: the maxima over the clusters that delivered it of the
        (previous reduction's comm s, time per inner step) their ranks sent with it (see
        :meth:`step`'s ``step_s``); None if it carried none."""
        # One worker: reductions run one at a time, in launch order, on every rank.
        self._executor = concurrent.futures.ThreadPoolExecutor(1, "dilocox-outer")

    @torch.no_grad()
    def step(self, iteration: int, step_s: float | None = None, lr_scale: float | None = None) -> RoundStats:
        """Round boundary; call after every H inner steps, on every rank, in the same order.

        ``step_s`` (adaptive H): this round's time per inner step; the reduction launched now
        carries it to every cluster, with the comm time of the reduction before it
        (:attr:`peak_timings`). Give it at every boundary or at none. ``lr_scale``: the inner lr
        over its peak, handed to the reducer of the reduction launched now
        (``reducer(tensors, link, lr_scale=...)``); None: not handed."""
        self.outer_step += 1
        self._iteration = iteration
        mode = self.config.sync_mode
        delta = self._state_tensor(torch.cat([p.detach().reshape(-1) for p in self.params]), copy=False)
        torch.sub(self.round_start, delta, out=delta)
        sq = float(torch.dot(delta, delta))

        if mode == "sync":
            self._submit(delta, step_s, lr_scale)
        # sync: this round's; delay modes: the previous round's, unless land() applied it already.
        result, wait_s = self._wait()
        # The local check as all_finite's: a NaN or Inf makes the sum of squares one.
        finite, local_ok = self.agree([result is None or all_finite(result.grad), math.isfinite(sq)])
        self._codec = result.codec if result is not None else self._codec
        skipped = result is not None and not self._apply(result.grad, finite)
        applied = self._landed or AppliedReduction(result.nbytes if result else 0, result.comm_s if result else 0.0,
                                                   wait_s, skipped, result.participants if result else 0)
        self._landed = None
        stale, self._stale = self._stale, False
        if stale:  # joined: what this replica trained since is on stale weights, so it is dropped
            self.round_start.copy_(self._anchor())
            if mode != "sync":  # and the round launched now sends nothing (sync sent it already, sat out)
                delta.zero_()
                self.group.abstain_next()
        elif local_ok:
            anchor = self._anchor()
            if self._carry:
                torch.sub(anchor, delta, alpha=self._carry, out=self.round_start)
            elif anchor is not self.round_start:
                self.round_start.copy_(anchor)
        else:
            if self._carry:
                warnings.warn(
                    f"DiLoCoX outer step {self.outer_step}: local pseudo-gradient is non-finite "
                    "(on this rank or another of the replica); "
                    "restarting this replica from base (the group skips it next boundary)",
                    RuntimeWarning,
                )
            self.round_start.copy_(self.base)
        self._write_params(self.round_start)
        if mode != "sync":
            self._submit(delta, step_s, lr_scale)  # hands delta over to the worker; no more reads here

        return RoundStats(**asdict(applied), outer_step=self.outer_step, iteration=iteration,
                          pseudo_grad_norm=math.sqrt(sq), pseudo_grad_sq=sq, codec=self._codec)

    @torch.no_grad()
    def land(self) -> None:
        """Applies the in-flight reduction mid-round (``delay`` and ``eager`` with
        ``overlap_steps``; see the module docstring): ``base`` takes the outer step and the
        replica's carried share of its own progress is replaced by it. Call on every rank at the
        same inner step; the next :meth:`step` reports what was applied. Does nothing when no
        reduction is in flight."""
        assert self._carry, "only delay and eager carry progress that an average can replace"
        result, wait_s = self._wait()
        if result is None:
            return
        (finite,) = self.agree([all_finite(result.grad)])
        skipped = not self._apply(result.grad, finite)
        stale, self._stale = self._stale, False
        if stale:  # joined: the replica restarts from the joined global parameters
            self.round_start.copy_(self._anchor())
            self._write_params(self.round_start)
        elif not skipped:  # a skipped average leaves the carry in place, as at a boundary
            anchor = self._anchor()
            for p, b, s in zip(self.params, self.views(anchor), self.views(self.round_start)):
                p.add_(b - s)
            self.round_start.copy_(anchor)
        self._landed = AppliedReduction(result.nbytes, result.comm_s, wait_s, skipped, result.participants)
        self._codec = result.codec

    @torch.no_grad()
    def finish(self) -> RoundStats | None:
        """Drains and applies the in-flight reduction and sets ``params = base`` (which they are
        already in ``sync`` without ``unsent``).

        Call at the end of training, after the last :meth:`step` (or :meth:`land`), so the final
        model is the outer one with every round's averaged work (with ``flush``, then the mean
        residual too). Both are applied as they are with ``averages_at_end`` (the config's
        ``final_average``), else as outer steps. Returns the stats of what it sent and applied,
        or None when nothing was (``sync`` without ``flush``, or a round that already landed).
        Its ``wait_s`` is all the time it held training up: the in-flight reduction's wait and
        the flush, which runs on the training thread.
        """
        result, wait_s = self._wait()
        skipped = False
        nbytes, comm_s = (result.nbytes, result.comm_s) if result is not None else (0, 0.0)
        plain = self.config.averages_at_end
        if result is not None:
            (finite,) = self.agree([all_finite(result.grad)])
            skipped = not self._apply(result.grad, finite, plain)
        owed = self.flush() if self.flush is not None else None
        if owed is not None:
            sent, start = self.counter.bytes, time.perf_counter()
            (mean,) = self.flush_reducer([owed], self.group)  # the default reduces in place
            (finite,) = self.agree([all_finite(mean)])
            skipped = not self._apply(mean, finite, plain) or skipped
            owed.zero_()  # sent: a checkpoint saved after this must not send it again
            flush_s = time.perf_counter() - start
            nbytes, comm_s, wait_s = nbytes + self.counter.bytes - sent, comm_s + flush_s, wait_s + flush_s
        if self.config.sync_mode != "sync" or self.unsent is not None or owed is not None:
            self.round_start.copy_(self.base)
            self._write_params(self.base)
        if result is None and owed is None:
            return None
        participants = self.group.delivered if owed is not None else result.participants
        return RoundStats(bytes_sent=nbytes, comm_s=comm_s, wait_s=wait_s, skipped=skipped, participants=participants,
                          outer_step=self.outer_step, iteration=self._iteration,
                          pseudo_grad_norm=0.0, pseudo_grad_sq=0.0,
                          codec=result.codec if result is not None else self._codec)

    def close(self) -> None:
        """Stops the worker thread (waits for a running reduction)."""
        self._executor.shutdown(wait=True)

    def serve(self) -> dict[str, Any]:
        """What a restarted cluster needs to join: the global parameters and outer optimizer as
        they are while the in-flight reduction runs (it is the one the joining cluster takes part
        in), and where that reduction was launched. Copies: called from torchft's thread, while
        the training thread goes on (which changes none of these before the reduction is done)."""
        return {"base": self.base.clone(), "optimizer": copy.deepcopy(self.optimizer.state_dict()),
                **self._launched}

    def join(self, state: dict[str, Any]) -> None:
        """Takes a live peer's :meth:`serve` (called by the link within the running reduction, in
        the worker thread): when that reduction is collected, ``base`` and the outer optimizer
        become the peer's, the reduction (the others' average) is applied to them as on the peer,
        the replica restarts from the result, and ``joined_at`` is the iteration at which the peer
        launched it. The progress this replica made before is dropped."""
        if state["base"].shape != self.base.shape:
            raise ValueError(f"a peer's outer shard has {state['base'].numel()} elements, this rank has "
                             f"{self.base.numel()}: the clusters run different models or layouts")
        self._joining = state

    def state_dict(self) -> dict[str, Any]:
        """Outer state for a checkpoint: base, round start, outer optimizer, in-flight round.

        Waits for the in-flight reduction and stores its reduced, not yet applied result, so a
        resumed run applies it at its next boundary exactly as this run would. Returns
        references, not copies: save before the next :meth:`step`. ``params`` (the inner
        optimizer's main params) are the caller's to checkpoint.
        """
        result, _ = self._wait()
        if result is not None:
            self._inflight = _done(result)  # keep it for the next boundary of this run too
        return {
            "sync_mode": self.config.sync_mode,
            "outer_step": self.outer_step,
            "base": self.base,
            "round_start": self.round_start,
            "optimizer": self.optimizer.state_dict(),
            "pending_grad": None if result is None else result.grad,
            "launched": dict(self._launched),  # the pending round's outer lr follows from it
        }

    @torch.no_grad()
    def drained_base(self) -> torch.Tensor:
        """The outer params :meth:`finish` would produce now (the in-flight round applied),
        without changing any state: what a checkpoint's global weights should hold."""
        result, _ = self._wait()
        if result is None:
            return self.base
        self._inflight = _done(result)
        (finite,) = self.agree([all_finite(result.grad)])
        if not finite:
            return self.base
        if self.config.averages_at_end:
            return self.base - result.grad
        base = self.base.clone()
        preview = OuterNesterov([base], self._outer_lr(), self.config.outer_momentum, self.config.use_nesterov)
        preview.load_state_dict(self.optimizer.state_dict())  # copies the momentum buffers
        preview.step([result.grad])
        return base

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict` output (tensors are copied)."""
        if state["sync_mode"] != self.config.sync_mode:
            raise ValueError(
                f"checkpoint was written with --dilocox-sync-mode {state['sync_mode']}, "
                f"resume with the same mode (got {self.config.sync_mode})"
            )
        if state["base"].shape != self.base.shape:
            raise ValueError(
                f"checkpoint outer shard has {state['base'].numel()} elements, "
                f"this rank has {self.base.numel()}"
            )
        self._wait()  # drop whatever this instance had in flight
        with torch.no_grad():
            self.round_start.copy_(state["round_start"])  # before base: they may share storage
            self.base.copy_(state["base"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.outer_step = int(state["outer_step"])
        self._launched = {k: int(v) for k, v in state["launched"].items()}
        self._landed = None  # what an earlier run applied; this one reports only its own exchanges
        g = state["pending_grad"]
        if g is not None:
            self._inflight = _done(_Reduced(g.to(self.base.device, torch.float32, copy=True), 0.0, 0, 0, None))

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """``flat`` (laid out like ``base``) cut into views shaped like ``params``."""
        views, offset = [], 0
        for p in self.params:
            views.append(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        return views

    # -- internals ---------------------------------------------------------------------------

    def _state_tensor(self, flat: torch.Tensor, copy: bool) -> torch.Tensor:
        """``flat`` where the outer state lives: next to the params, or in pinned host memory
        with ``offload_outer_state`` (set on a GPU only; that copy is the staging step). ``copy``:
        never return ``flat`` itself."""
        if self.config.offload_outer_state:
            return torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True).copy_(flat)
        return flat.clone() if copy else flat

    def _anchor(self) -> torch.Tensor:
        """Where the replica restarts from: ``base``, less its unsent progress with ``unsent``."""
        residual = self.unsent() if self.unsent is not None else None
        return self.base if residual is None else self.base - residual.to(self.base.device)

    def _write_params(self, flat: torch.Tensor) -> None:
        for p, v in zip(self.params, self.views(flat)):
            p.copy_(v)

    def _submit(self, delta: torch.Tensor, step_s: float | None, lr_scale: float | None) -> None:
        assert self._inflight is None, "a reduction is already in flight"
        self._launched = {"outer_step": self.outer_step, "iteration": self._iteration}
        self._inflight = self._executor.submit(self._reduce, delta, step_s, lr_scale)

    def _reduce(self, delta: torch.Tensor, step_s: float | None, lr_scale: float | None) -> _Reduced:
        # Runs in the worker thread; owns ``delta`` (a private tensor) and nothing else.
        if step_s is not None:
            self.group.timings = (self._last_comm_s, step_s)
        start_bytes, start = self.counter.bytes, time.perf_counter()
        if self.config.emulated_delay_s > 0:
            time.sleep(self.config.emulated_delay_s)  # a slow link, for benchmarks and tests
        round_args = {} if lr_scale is None else {"lr_scale": lr_scale}
        (g,) = self.reducer([delta], self.group, **round_args)
        assert g.shape == delta.shape and g.dtype == torch.float32
        codec = getattr(self.reducer, "last_stats", None)  # read here: the next reduction replaces it
        joined, self._joining = self._joining, None
        self._last_comm_s = time.perf_counter() - start
        return _Reduced(g, self._last_comm_s, self.counter.bytes - start_bytes, self.group.delivered,
                        dict(codec) if codec else None, joined,
                        self.group.peak_timings() if step_s is not None else None)

    def _wait(self) -> tuple[_Reduced | None, float]:
        if self._inflight is None:
            return None, 0.0
        start = time.perf_counter()
        try:
            result = self._inflight.result(timeout=self.config.outer_timeout_s)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(
                f"DiLoCoX outer reduction not done after {self.config.outer_timeout_s:.0f} s "
                "(--dilocox-outer-timeout-s): is a peer cluster down?"
            ) from None
        except Exception:
            self._inflight = None  # the reduction failed: nothing of it is applied, the state stays as it was
            raise
        self._inflight = None
        self.peak_timings = result.peak_timings
        if result.joined is not None:
            self._take(result.joined)
            result = result._replace(joined=None)
        return result, time.perf_counter() - start

    def _take(self, state: dict[str, Any]) -> None:
        """The training thread's half of :meth:`join`, before the reduction is applied."""
        self.base.copy_(state["base"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.outer_step = int(state["outer_step"])
        self._launched = {"outer_step": self.outer_step, "iteration": int(state["iteration"])}  # the peer's round
        self.joined_at = self._launched["iteration"]
        self._stale = True

    def _apply(self, g: torch.Tensor, finite: bool, plain: bool = False) -> bool:
        """Applies ``g`` if ``finite`` (the agreed answer for the whole model) with the outer
        step, or with ``plain`` as it is (``base - g``: the replicas' mean); returns ``finite``."""
        if not finite:
            warnings.warn(
                f"DiLoCoX outer step {self.outer_step}: reduced pseudo-gradient is non-finite "
                "(on this rank or another of the model); skipping the outer update",
                RuntimeWarning,
            )
            return False
        if plain:
            self.base.sub_(g)
        else:
            self.optimizer.lr = self._outer_lr()
            self.optimizer.step([g])
        return True

    def _outer_lr(self) -> float:
        """The outer lr of the round being applied: the last one launched (the flush: the last round's)."""
        return self.config.outer_lr_at(self._launched["iteration"])
