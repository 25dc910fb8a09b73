"""The outer exchange between clusters that run as independent jobs, on torchft.

Each rank holds one torchft ``Manager``: its replica group is its cluster, its group rank its
place in the cluster. A Lighthouse (``torchft_lighthouse``) forms a quorum of the live clusters
for every round, and torchft reconfigures a gloo group per group rank over the quorum's members,
so the ranks that hold the same shard in every live cluster exchange with each other. A round:

1. **Quorum.** ``start_quorum`` returns the live clusters. A cluster whose committed-round count
   is behind the others (a restarted one) is healed inside it: torchft fetches a live peer's
   ``state_dict`` over HTTP and hands it to ``load_state_dict``; the healed cluster's own payload
   was computed on stale state, so it sends none this round (``valid`` 0; a caller may also send
   none, ``valid=False``).
2. **Payloads**, in one stage or more (a low-rank codec sends P, then Q). In each, every member
   all-gathers an envelope (cluster, round, valid, length, the caller's ``fingerprint`` of the
   state the payload was computed from, and the ``timings`` adaptive H decides from) plus its payload. Each
   rank checks what it received (the envelope, a fingerprint equal to its own, then the caller's
   ``verify``, for example the codec frame's checksum), and the members all-gather their
   verdicts: a payload is used only if every member accepted it, so every survivor applies the
   same set of clusters, and a corrupt one is dropped and named. **A state no majority holds
   stops its cluster**: if a strict majority of the senders share one fingerprint, the others'
   verdicts do not count (they compared against a state nobody else holds) and each of them
   raises :class:`StateDivergedError` once the round commits; with no such majority (two
   clusters that differ) every sender raises it. Otherwise two clusters that differ would each
   drop the other's payloads for the rest of the run: two runs, not one. (At the first round
   every difference is a configuration error, which :class:`ExchangeLink` reports.)
3. **Commit.** ``should_commit`` is an AND vote of the cluster's ranks (an error in a collective,
   a dead peer, fewer than ``min_clusters`` members: no), one per round whatever its stages. On
   no, the whole round is tried again with a fresh quorum, every stage anew, until
   ``failure_timeout_s`` has passed since the round began (plus ``failure_timeout_s`` once a peer was lost inside a quorum, and
   ``rejoin_timeout_s`` while fewer than ``min_clusters`` are live); then
   :class:`ClusterLossError`.

A cluster that dies mid-round costs the others one failed attempt: the all-gather errors (a
reset connection) or times out (a frozen peer, after ``failure_timeout_s``), and the next quorum
leaves it out once the Lighthouse has missed its heartbeats (``--heartbeat_timeout_ms``); that
quorum has a ``failure_timeout_s`` of its own, since a frozen peer used up the first.
"""
from __future__ import annotations

import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from megatron_dilocox.config import ExchangeConfig
from megatron_dilocox.errors import ClusterLossError, ConfigError, StateDivergedError
from megatron_dilocox.outer.link import Gathered, Verify, count, gathered_mean

ENVELOPE = 4  # int64 fields before the payload: cluster, round, valid, payload length
FINGERPRINT_BYTES = 32  # then the sender's fingerprint (a SHA-256) of the state its payload came from
TIMINGS = 2  # then float64 timings the sender carries for adaptive H (NaN: none), then the payload
HEAD_BYTES = ENVELOPE * 8 + FINGERPRINT_BYTES + TIMINGS * 8
DIFFERENT_STATE = "its fingerprint differs from this cluster's"
T = TypeVar("T")


def _not_flight_recorder(record: logging.LogRecord) -> bool:
    # torchft warns at every new quorum that it cannot reset NCCL's flight recorder, which a
    # gloo exchange never has.
    return "NCCL flight recorder" not in record.getMessage()


def _forget_previous_attempt(store_addr: str, store_port: int, rank: int) -> None:
    """Deletes what the cluster's previous torchrun attempt (``--max-restarts``) left in the
    torchrun store for torchft: its rank 0 Manager's address, under keys without an attempt
    prefix, which the restarted ranks would read before the new rank 0 replaces them and then
    fail to connect to a dead server. The other ranks wait until rank 0 has deleted them."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt == "0":
        return
    from torchft.manager import MANAGER_ADDR_KEY, REPLICA_ID_KEY

    store = dist.TCPStore(store_addr, store_port, is_master=False, wait_for_workers=False)
    forgotten = f"megatron_dilocox/attempt_{attempt}/torchft_keys_deleted"
    if rank == 0:
        for key in (MANAGER_ADDR_KEY, REPLICA_ID_KEY):
            store.delete_key(key)
        store.set(forgotten, "1")
    else:
        store.wait([forgotten])


@dataclass
class Delivery:
    """What one committed round delivered to this rank."""

    round: int
    """Rounds committed before this one (torchft's step), the same on every member."""
    clusters: list[int]
    """The clusters whose payloads are in ``payloads``, ascending."""
    payloads: list[torch.Tensor]
    """Their payloads (CPU uint8), in the order of ``clusters``."""
    members: list[int]
    """Every cluster of the quorum, including a healed one and the dropped ones."""
    healed: bool
    """This cluster's state was replaced by a live peer's in this round."""
    dropped: dict[int, str] = field(default_factory=dict)
    """Cluster -> why its payload was not used (healed, or failed a check on some member)."""
    timings: dict[int, tuple[float, ...]] = field(default_factory=dict)
    """Cluster -> the ``timings`` it sent with its payload, for the clusters in ``clusters``."""
    attempts: int = 1
    """Quorums this round took (more than 1 after a failure)."""
    seconds: float = 0.0
    """From the round's first quorum to this delivery."""


def majority_fingerprint(prints: list[bytes | None]) -> bytes | None:
    """The fingerprint more than half of the senders (the non-None entries) share, or None."""
    senders = [p for p in prints if p is not None]
    for p in set(senders):
        if 2 * senders.count(p) > len(senders):
            return p
    return None


class ClusterExchange:
    """One rank's side of the fault-tolerant exchange between clusters (see the module docstring).

    Args:
        config: the exchange settings (``lighthouse`` and ``cluster_index`` set).
        clusters: C, the clusters of the run: the first round waits up to
            ``config.startup_timeout_s`` for all of them.
        rank, world_size: this rank's place in its cluster and the cluster's size.
        store_addr, store_port: the cluster's own TCPStore (torchrun's ``MASTER_ADDR``/``MASTER_PORT``);
            the other clusters reach it to form the gloo groups.
        state_dict: returns what a healing peer needs to continue (global parameters, outer
            state); it is served while the round runs, so it must return copies.
        load_state_dict: applies a live peer's ``state_dict`` when this cluster heals.
    """

    def __init__(self, config: ExchangeConfig, clusters: int, *, rank: int, world_size: int, store_addr: str, store_port: int,
                 state_dict: Callable[[], Any], load_state_dict: Callable[[Any], None]):
        from torchft import Manager, ProcessGroupGloo
        from torchft.checkpointing import HTTPTransport

        class AdvertisedHTTPTransport(HTTPTransport):
            """torchft's checkpoint server (listening on every interface), advertised at the
            cluster's store address instead of the host's name, which may not resolve to an
            address the other clusters reach (in tools/wan's namespaces it is the loopback)."""

            def address(self) -> str:
                host = f"[{store_addr}]" if ":" in store_addr else store_addr
                return f"http://{host}:{self._server.socket.getsockname()[1]}/checkpoint/"

        try:
            config.validate(clusters)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if config.lighthouse is None:
            raise ConfigError("ClusterExchange needs --dilocox-lighthouse")
        self.config, self.clusters = config, clusters
        _forget_previous_attempt(store_addr, store_port, rank)
        logging.getLogger("torchft.manager").addFilter(_not_flight_recorder)
        timeout = timedelta(seconds=config.failure_timeout_s)
        self.pg = ProcessGroupGloo(timeout=timeout)
        self.manager = Manager(
            pg=self.pg, load_state_dict=load_state_dict, state_dict=state_dict,
            min_replica_size=config.min_clusters, use_async_quorum=False, init_sync=False,
            replica_id=f"c{config.cluster_index:05d}",  # torchft orders members by this string
            rank=rank, world_size=world_size, store_addr=store_addr, store_port=store_port,
            hostname=store_addr,  # where the other clusters reach this one (the host's name may not resolve there)
            checkpoint_transport=AdvertisedHTTPTransport(timeout=timeout, num_chunks=0),
            lighthouse_addr=config.lighthouse_url, timeout=timeout, quorum_timeout=timeout,
            connect_timeout=timeout)
        self._started = time.monotonic()

    @property
    def round(self) -> int:
        """Rounds committed so far (a healed cluster takes its peers' count)."""
        return self.manager.current_step()

    def exchange(self, payload: torch.Tensor, verify: Callable[[int, int, torch.Tensor], None] | None = None,
                 fingerprint: bytes = bytes(FINGERPRINT_BYTES), valid: bool = True) -> Delivery:
        """All-gathers ``payload`` (CPU uint8, the same size on every cluster) with the live clusters:
        a round of one stage (:meth:`run_round`), whose committed delivery it returns."""
        return self.run_round(lambda gather: gather(payload, verify), fingerprint, valid)

    def run_round(self, body: Callable[[Callable[..., Delivery]], Any],
                  fingerprint: bytes = bytes(FINGERPRINT_BYTES), valid: bool = True,
                  timings: tuple[float, ...] | None = None) -> Any:
        """Runs ``body(gather)`` as one committed round and returns what it returns.

        ``gather(payload, verify=None) -> Delivery`` is one stage: it all-gathers ``payload``
        (CPU uint8, the same size on every cluster) within the round's quorum. A body may call it
        several times (a low-rank codec sends P, then Q computed from the reduced P); all stages
        share one quorum and one commit, so a cluster lost between two stages costs the attempt,
        and the whole body runs again with the next quorum: it must change no state of its own
        until the round returns. A failed stage returns no payloads rather than raising, so every
        rank of a cluster runs the body's collectives inside its cluster in step.

        ``verify(cluster, round, payload)`` raises ``ValueError`` for a payload that must not be used
        (``round`` as :attr:`round` counts it, before the commit). ``fingerprint``
        (``FINGERPRINT_BYTES``): what every member's state must hash to; a payload sent with
        another is dropped (unless this cluster has just healed: its own state was stale).
        ``valid`` False: this cluster sends no payload this round (it takes part in the quorum
        and receives the others'). ``timings`` (``TIMINGS`` floats) travel with every stage's
        payload to :attr:`Delivery.timings`. Raises :class:`ClusterLossError` if no round
        commits within ``failure_timeout_s``.
        """
        cfg, mgr = self.config, self.manager
        begin, attempts, why, healed = time.monotonic(), 0, "no quorum", False
        members = self.clusters  # of the last quorum
        retry = 0.0  # a peer lost inside a quorum: the next quorum gets a window of its own
        while True:
            attempts += 1
            before = mgr.current_step()
            grace = retry + self._rejoin_grace(members)
            try:
                mgr.start_quorum(timeout=timedelta(seconds=max(1.0, self._left(begin) + grace)))
            except Exception as err:  # the Lighthouse gave no quorum in time
                why = f"quorum: {err}"
                self._give_up_if_late(begin, why, grace=grace)
                continue
            healed = healed or mgr.current_step() != before  # its payload stays stale on a retry too
            members = mgr.num_participants()
            if (mgr.current_step() == 0 and members < self.clusters
                    and time.monotonic() - self._started < cfg.startup_timeout_s):
                time.sleep(0.5)  # the first round waits for every cluster (a lone first one would commit alone)
                begin = time.monotonic()
                continue
            attempt = _Attempt(self, fingerprint, valid, healed, attempts, begin, timings)
            result = body(attempt.gather)
            if attempt.failure is not None:
                why, retry = attempt.failure, attempt.retry
            if mgr.should_commit():
                if attempt.diverged is not None:
                    raise StateDivergedError(attempt.diverged)
                return result
            if members < cfg.min_clusters:
                why = f"{members} live clusters, --dilocox-min-clusters is {cfg.min_clusters}"
                if cfg.rejoin_timeout_s:
                    why += f"; waited --dilocox-rejoin-timeout-s {cfg.rejoin_timeout_s:g} more for a rejoin"
            self._give_up_if_late(begin, why, grace=retry + self._rejoin_grace(members))

    def close(self) -> None:
        self.manager.shutdown(wait=False)

    def _left(self, begin: float) -> float:
        return self.config.failure_timeout_s - (time.monotonic() - begin)

    def _rejoin_grace(self, members: int) -> float:
        """Extra seconds a round may wait while fewer than ``min_clusters`` are live."""
        return self.config.rejoin_timeout_s if members < self.config.min_clusters else 0.0

    def _give_up_if_late(self, begin: float, why: str, grace: float = 0.0) -> None:
        if self._left(begin) + grace <= 0:
            raise ClusterLossError(f"cluster {self.config.cluster_index}: no outer round committed within "
                                   f"--dilocox-failure-timeout-s {self.config.failure_timeout_s:g} ({why})")

    def _envelope(self, payload: torch.Tensor, step: int, fingerprint: bytes, valid: bool,
                  timings: tuple[float, ...] | None) -> torch.Tensor:
        if len(fingerprint) != FINGERPRINT_BYTES:
            raise ValueError(f"a fingerprint has {FINGERPRINT_BYTES} bytes, got {len(fingerprint)}")
        head = torch.tensor([self.config.cluster_index, step, int(valid), payload.numel()], dtype=torch.int64)
        times = torch.tensor(timings if timings is not None else [math.nan] * TIMINGS, dtype=torch.float64)
        body = payload if valid else torch.zeros_like(payload)
        return torch.cat([head.view(torch.uint8), torch.frombuffer(bytearray(fingerprint), dtype=torch.uint8),
                          times.view(torch.uint8), body])

    def _diverged(self, prints: list[bytes | None], mine: bytes, majority: bytes | None, round_: int) -> str:
        senders = [p for p in prints if p is not None]
        held = (f"{senders.count(majority)} of {len(senders)} clusters hold {majority.hex()[:16]}" if majority
                else f"no majority among the {len(senders)} sending clusters")
        return (f"cluster {self.config.cluster_index}: DiLoCoX outer round {round_}: this cluster's global state "
                f"(fingerprint {mine.hex()[:16]}) is not the majority's ({held}); it stops rather than train on "
                "as a separate run. Resume it from its last checkpoint (torchrun --max-restarts does): behind "
                "the others, it heals from a live peer; with no majority, resume every cluster")

    @staticmethod
    def _fingerprint(row: torch.Tensor) -> bytes | None:
        """The fingerprint a row was sent with, None if it sent no payload (it does not vote)."""
        if not row[2 * 8: 3 * 8].view(torch.int64).item():
            return None
        return row[ENVELOPE * 8: ENVELOPE * 8 + FINGERPRINT_BYTES].numpy().tobytes()

    @staticmethod
    def _open(row: torch.Tensor, step: int, numel: int, verify,
              fingerprint: bytes | None) -> tuple[int, torch.Tensor, str | None]:
        """(cluster, payload, None) or, for a payload that must not be used, (cluster, payload, why);
        ``fingerprint`` None: not compared."""
        cluster, sent_step, valid, length = row[: ENVELOPE * 8].view(torch.int64).tolist()
        theirs = row[ENVELOPE * 8: ENVELOPE * 8 + FINGERPRINT_BYTES].numpy().tobytes()
        body = row[HEAD_BYTES:]
        if not valid:
            return cluster, body, "sent no payload this round (it healed: its state was stale)"
        if (sent_step, length) != (step, numel):
            return cluster, body, f"envelope says round {sent_step} and {length} bytes, expected {step} and {numel}"
        if fingerprint is not None and theirs != fingerprint:
            return cluster, body, f"{DIFFERENT_STATE} ({theirs.hex()[:16]} against {fingerprint.hex()[:16]})"
        try:
            if verify is not None:
                verify(cluster, step, body)
        except ValueError as err:
            return cluster, body, str(err)
        return cluster, body, None


class _Attempt:
    """One quorum's try at a round (:meth:`ClusterExchange.run_round`): its stages, and what
    went wrong in them."""

    def __init__(self, exchange: ClusterExchange, fingerprint: bytes, valid: bool, healed: bool, attempts: int,
                 begin: float, timings: tuple[float, ...] | None):
        self.exchange, self.fingerprint, self.healed, self.timings = exchange, fingerprint, healed, timings
        self.valid = valid and not healed
        self.attempts, self.begin = attempts, begin
        self.failure: str | None = None  # why a stage failed (the attempt does not commit)
        self.retry = 0.0  # the next quorum's own window, after a peer was lost inside this one
        self.diverged: str | None = None  # this cluster's state is not the majority's

    def gather(self, payload: torch.Tensor, verify: Callable[[int, int, torch.Tensor], None] | None = None) -> Delivery:
        """One stage: every member's payload, checked, and the members' verdicts (see the module docstring)."""
        from torch.distributed.distributed_c10d import AllgatherOptions

        ex, mgr = self.exchange, self.exchange.manager
        payload = payload.detach().to("cpu", torch.uint8).contiguous().view(-1)
        step = mgr.current_step()
        delivery = Delivery(round=step, clusters=[], payloads=[], members=[], healed=self.healed,
                            attempts=self.attempts)
        if mgr.errored():
            return delivery
        mine = ex._envelope(payload, step, self.fingerprint, valid=self.valid, timings=self.timings)
        try:
            rows = [torch.empty_like(mine) for _ in range(ex.pg.size())]
            ex.pg.allgather([rows], [mine], AllgatherOptions()).wait()
            decoded = [ex._open(row, step, payload.numel(), verify, None if self.healed else self.fingerprint)
                       for row in rows]
            prints = [ex._fingerprint(row) for row in rows]
            ok = torch.tensor([reason is None for _, _, reason in decoded], dtype=torch.uint8)
            verdicts = [torch.empty_like(ok) for _ in rows]
            ex.pg.allgather([verdicts], [ok], AllgatherOptions()).wait()
        except Exception as err:  # a dead or frozen peer
            mgr.report_error(err)
            self.failure = f"exchange: {err}"
            self.retry = ex.config.failure_timeout_s  # a frozen peer holds the all-gather for the whole timeout
            return delivery
        majority = majority_fingerprint(prints)
        voters = [v for v, p in zip(verdicts, prints) if majority is None or p in (None, majority)]
        accepted = torch.stack(voters).min(0).values.bool().tolist()
        for row, (cluster, body, reason), used in zip(rows, decoded, accepted):  # members come in cluster order
            delivery.members.append(cluster)
            if used:
                delivery.clusters.append(cluster)
                delivery.payloads.append(body)
                delivery.timings[cluster] = tuple(row[HEAD_BYTES - TIMINGS * 8: HEAD_BYTES].view(torch.float64).tolist())
            else:
                delivery.dropped[cluster] = reason or "refused by another cluster"
        own = self.fingerprint if self.valid else None  # a cluster that sent nothing is not judged
        if step > 0 and own is not None and own != majority:
            self.diverged = ex._diverged(prints, own, majority, step)
        delivery.seconds = time.monotonic() - self.begin
        return delivery


class ExchangeLink:
    """The outer link (:mod:`~megatron_dilocox.outer.link`) of a cluster that runs as its own job:
    every round (:meth:`run_round`; an :meth:`all_gather` outside one is a round of its own) is
    one committed round of a :class:`ClusterExchange` (made here, one per rank), and a payload counts only if every rank of this cluster got it (``settle_group``: a gloo group
    over the cluster, used by this link alone; None for a one-rank cluster). Each rank exchanges
    its own shard with its own quorum group, so a lost or corrupt cluster may be missing from one
    shard's delivery and not another's; the ranks take the intersection (one all-reduce of a
    C-entry mask), and every cluster computes the same one, so every survivor applies the same
    clusters to every shard. ``audit``: the run's CommAudit, told the bytes sent (torch.distributed
    does not see them).

    The outer loop that owns the link sets, before its first exchange:

    * ``fingerprint() -> bytes``: a SHA-256 of the state its payloads are computed from (global
      parameters and settings); a payload whose sender's differs is dropped, and at the first
      round, where every cluster starts from the same weights, that stops the run;
    * ``serve() -> state``: what a restarted cluster needs to continue (called by torchft while
      a round runs, when a peer heals; it must return copies);
    * ``on_heal(state)``: applies a live peer's ``serve()`` when this cluster heals, in the thread
      that called :meth:`run_round` (or :meth:`all_gather`), before the round's stages run.

    Exchanges start no extra collectives of their own (the fingerprint travels in each payload's
    envelope), so a cluster that restarts while the others run can take part in the round they
    are in: torchft heals it, it sends no payload that round and receives the others'.
    """

    verifies_state = True  # the fingerprint stands in for the start-up hash and the codec handshake

    def __init__(self, config: ExchangeConfig, clusters: int, *, rank: int, world_size: int, store_addr: str,
                 store_port: int, settle_group=None, audit=None):
        self.exchange = ClusterExchange(config, clusters, rank=rank, world_size=world_size, store_addr=store_addr,
                                        store_port=store_port, state_dict=self._serve, load_state_dict=self._heal)
        self.settle_group, self.audit = settle_group, audit
        self.cluster, self.clusters = config.cluster_index, clusters
        self.fingerprint: Callable[[], bytes] | None = None
        self.serve: Callable[[], Any] | None = None
        self.on_heal: Callable[[Any], None] | None = None
        self.used = list(range(self.clusters))
        """The clusters the last committed round delivered."""
        self._abstain = False
        self._stage: Callable[..., Delivery] | None = None  # the running round's gather
        self.timings: tuple[float, ...] | None = None
        self._peak: tuple[float, ...] | None = None
        self._last: tuple[Delivery, list[int]] | None = None  # its last stage, and the clusters used

    @property
    def delivered(self) -> int:
        return len(self.used)

    def abstain_next(self) -> None:
        """The next exchange sends no payload from this cluster (its progress is stale)."""
        self._abstain = True

    def run_round(self, body: Callable[[], T]) -> T:
        """Runs ``body()``, whose :meth:`all_gather` calls are the stages of one committed round
        (:meth:`ClusterExchange.run_round`: after a failure the whole body runs again, so it must
        leave its own state alone until this returns); inside a round, just ``body()``."""
        if self._stage is not None:
            return body()
        fingerprint = self.fingerprint() if self.fingerprint is not None else bytes(FINGERPRINT_BYTES)

        def attempt(gather):
            self._stage, self._last = gather, None
            try:
                return body()
            finally:
                self._stage = None

        result = self.exchange.run_round(attempt, fingerprint, valid=not self._abstain, timings=self.timings)
        self._abstain = False
        if self._last is not None:
            self._report(*self._last)
        return result

    def all_gather(self, payload: torch.Tensor, counter=None, verify: Verify | None = None) -> Gathered:
        """One stage of the running round (a round of its own outside :meth:`run_round`). A stage
        that failed delivers nothing (the round does not commit and runs again)."""
        if self._stage is None:
            return self.run_round(lambda: self.all_gather(payload, counter, verify))
        check = None if verify is None else (lambda cluster, _round, body: verify(cluster, body))
        delivery = self._stage(payload, check)
        sat_out = self._abstain or delivery.healed
        count(counter, payload.numel())
        if self.audit is not None:
            self.audit.count_exchange(payload.numel())
        used = delivery.clusters
        if self.settle_group is not None:  # every stage, failed or not: the cluster's ranks stay in step
            mask = torch.zeros(self.clusters, dtype=torch.int32)
            mask[used] = 1
            dist.all_reduce(mask, op=dist.ReduceOp.MIN, group=self.settle_group)
            used = [c for c in used if mask[c]]
            for c in set(delivery.clusters) - set(used):
                delivery.dropped[c] = "not delivered to every rank of this cluster"
        differ = {c: why for c, why in delivery.dropped.items() if why.startswith(DIFFERENT_STATE)}
        if delivery.round == 0 and differ:
            raise RuntimeError("DiLoCoX replicas start from different weights or settings (cluster "
                               f"{self.cluster} against " + "; ".join(f"cluster {c}: {w}" for c, w in differ.items())
                               + "): every cluster needs the same --seed, model and DiLoCoX flags")
        rows = [body for c, body in zip(delivery.clusters, delivery.payloads) if c in used]
        self._last = (delivery, used)
        empty = torch.empty(0, payload.numel(), dtype=torch.uint8)
        return Gathered(torch.stack(rows) if rows else empty, used, sat_out)

    def _report(self, delivery: Delivery, used: list[int]) -> None:
        """Takes a committed round's last stage as the clusters delivered, with a console line
        when they changed."""
        if used != self.used and dist.get_rank() == 0:  # a membership change: one line per cluster job
            missing = sorted(set(range(self.clusters)) - set(used))
            reasons = "; ".join(f"cluster {c}: {delivery.dropped.get(c, 'not in the quorum')}" for c in missing)
            print(f"> DiLoCoX outer exchange round {delivery.round}: {len(used)} of {self.clusters} clusters "
                  f"delivered{' (' + reasons + ')' if reasons else ''}", file=sys.stderr, flush=True)
        self.used = used
        carried = [delivery.timings[c] for c in used if not math.isnan(delivery.timings[c][0])]
        self._peak = tuple(map(max, zip(*carried))) if carried else None

    def peak_timings(self) -> tuple[float, ...] | None:
        return self._peak

    def mean(self, tensors: list[torch.Tensor], counter=None) -> list[torch.Tensor]:
        return gathered_mean(self, tensors, counter)

    def close(self) -> None:
        self.exchange.close()

    def state_dict(self) -> dict:
        """The rounds committed so far: a cluster resumed from an older checkpoint than the
        others is then behind them, and torchft heals it from a live peer."""
        return self.exchange.manager.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.exchange.manager.load_state_dict(state)

    def _serve(self):
        if self.serve is None:
            raise RuntimeError("a cluster asked for this cluster's state before its outer loop was set up")
        return self.serve()

    def _heal(self, state) -> None:
        if self.on_heal is None:
            raise RuntimeError("this cluster was healed before its outer loop was set up")
        self.on_heal(state)
