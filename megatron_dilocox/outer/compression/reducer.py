"""CompressedReducer: compressed, bit-identical mean of the pseudo-gradient over the outer group.

Plugs into :class:`~megatron_dilocox.outer.sync.OuterSync` as its ``reducer``: called with
``[delta]`` (one flat fp32 buffer, the concatenation of this rank's parameter shards laid out as
``shapes``) from OuterSync's single worker thread, one round at a time, in the same order on
every rank; returns ``[g]``, the decompressed mean, bit-identical on every rank::

    counter = ByteCounter()
    reducer = CompressedReducer([p.shape for p in params],
                                CompressionConfig(codec="lowrank-quantize", bits=4, rank=8), counter=counter)
    sync = OuterSync(params, group, config, reducer=reducer, counter=counter)
    ...
    sync.step(iteration); reducer.last_stats  # ratio, rel_error, ranks, timings of the last round

**How agreement is guaranteed.** Nothing is summed in flight (``none``, the fp32 mean, is
:func:`~megatron_dilocox.outer.sync.allreduce_mean`, not this class). Each exchange
all-gathers every cluster's framed payload (header + crc32, see ``wire.py``); every rank checks
and decodes all C payloads, including its own as it came back, and sums them in fp32 in cluster
order 0, 1, ..., C-1, then divides by C (a tensor divide: true IEEE division on every device).
So all ranks run the same exactly rounded operations on the same bytes in the same order. The
PowerSGD steps between and after the exchanges are built the same way (``lowrank.py``), and so
is the adaptive rank, which is decided from the shared reduced factors. A one-time handshake (and
again after :meth:`load_state_dict`) compares a digest of the settings, round and ranks of every
cluster, so a misconfigured peer fails with a clear error instead of a mismatched collective.

**Bytes per round**, counted on ``counter`` as this rank's payload (see :mod:`~megatron_dilocox.outer.link`): the
formulas of :mod:`megatron_dilocox.payload` (one exchange per round; two, P then Q, for the
low-rank codecs; the handshake at the first round and after a resume).
"""
from __future__ import annotations

import hashlib
import math
import time
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

import torch

from megatron_dilocox.config import QUANT_BITS, CompressionConfig
from megatron_dilocox.outer.compression import lowrank, topk, wire
from megatron_dilocox.outer.compression.segments import SegmentCodec
from megatron_dilocox.outer.link import Gathered, OuterLink, as_link
from megatron_dilocox.payload import HANDSHAKE_BYTES, lowrank_shape

if TYPE_CHECKING:
    from megatron_dilocox.outer.sync import ByteCounter

CODECS = wire.CODECS
_STATE_VERSION = 1


@dataclass(frozen=True)
class _Matrix:
    """A tensor of the layout compressed low-rank, viewed as (m, n) = (shape[0], rest)."""

    index: int
    offset: int
    m: int
    n: int
    max_rank: int


class _LowRankNext(NamedTuple):
    """What a low-rank round decides for the next one, applied once the round commits."""

    ranks: list[int]
    outside: list[float]  # per matrix: the energy beyond its new rank window (choose_rank)
    q: list[torch.Tensor]  # the warm starts


class _Attempt(NamedTuple):
    """One try at a round's exchanges (:meth:`CompressedReducer._reduce`)."""

    round: _Round
    x: torch.Tensor  # what was encoded: the pseudo-gradient plus the residual under error feedback
    ranks: list[int]  # the low-rank ranks used ([] without low-rank matrices)
    mean: torch.Tensor  # the mean over the delivering clusters' payloads
    own: torch.Tensor  # this rank's own payload, decoded
    lowrank_next: _LowRankNext | None


class CompressedReducer:
    """OuterSync reducer that compresses the pseudo-gradient (docs/compression.md).

    Args:
        shapes: shapes of the tensors the flat buffer concatenates, in order. Tensors of 2 or
            more dims are (shape[0], rest) matrices; they go low-rank if the factors are smaller
            than the matrix, the rest go dense.
        config: the codec and its settings (``quantize``: every
            tensor blockwise int8/int4; ``lowrank``: PowerSGD fp32 factors, dense tensors fp32;
            ``lowrank-quantize``: factors and dense tensors quantized; ``topk``: the flat
            buffer's largest entries per chunk, low-bit, see ``topk.py``). The PowerSGD rank is
            capped at min(m, n) per matrix; the adaptive rank is chosen every round from the
            shared spectrum (:func:`~megatron_dilocox.outer.compression.lowrank.choose_rank`).
            ``keep_unsent`` is the caller's business (it reads :attr:`residual`).
        counter: ByteCounter to count sent bytes on (share OuterSync's); None counts nothing.
        seed: seed of the random warm-start factors (must match across clusters).
    """

    def __init__(self, shapes: Sequence[Sequence[int]], config: CompressionConfig,
                 counter: ByteCounter | None = None, seed: int = 0):
        config.validate()
        codec = config.codec
        if codec == "none":
            raise ValueError("--dilocox-compression none sends the fp32 mean (outer.sync.allreduce_mean); "
                             "CompressedReducer needs a codec")
        self.shapes = [torch.Size(s) for s in shapes]
        self.config = config
        self.counter, self.seed = counter, seed
        self.payload_bits = config.bits if codec in QUANT_BITS else 32
        self.numel = sum(s.numel() for s in self.shapes)

        self.matrices: list[_Matrix] = []
        self.dense: list[tuple[int, int]] = []  # (offset, numel) of the dense tensors
        offset = 0
        for i, s in enumerate(self.shapes):
            low = lowrank_shape(s, self.config.rank) if codec.startswith("lowrank") else None
            if low:
                self.matrices.append(_Matrix(i, offset, *low))
            elif s.numel():
                self.dense.append((offset, s.numel()))
            offset += s.numel()

        self.round = 0
        self.ranks = [mat.max_rank for mat in self.matrices]
        self.residual: torch.Tensor | None = None
        self.last_stats: dict[str, Any] = {}
        self._q: list[torch.Tensor | None] = [None] * len(self.matrices)
        self._outside = [0.0] * len(self.matrices)
        self._agreed = False

    # -- the reducer hook --------------------------------------------------------------------

    def __call__(self, tensors: list[torch.Tensor], link, lr_scale: float = 1.0) -> list[torch.Tensor]:
        """Mean over the outer ``link`` (or process group) of the one flat fp32 tensor in
        ``tensors`` (see the module doc): over the clusters that delivered this round's payload.

        ``link`` None (one cluster) runs the same compression with no communication. The
        input is left alone. ``lr_scale``: the round's inner lr over its peak, for
        ``--dilocox-ef-decay-follows-lr``.
        """
        if len(tensors) != 1:
            raise ValueError(f"CompressedReducer reduces one flat buffer, got {len(tensors)} tensors")
        (delta,) = tensors
        if delta.dtype != torch.float32 or delta.dim() != 1 or delta.numel() != self.numel:
            raise ValueError(
                f"CompressedReducer expects a flat fp32 buffer of {self.numel} elements (its shapes), "
                f"got {delta.dtype} of shape {tuple(delta.shape)}"
            )
        with torch.no_grad():
            return [self._reduce(delta, as_link(link), self.config.ef_decay_at(lr_scale))]

    def _reduce(self, delta: torch.Tensor, link: OuterLink, ef_decay: float) -> torch.Tensor:
        self.round += 1
        if self.config.error_feedback:
            if self.residual is None:
                self.residual = torch.zeros_like(delta)
            self.residual = self.residual.to(delta.device)  # a no-op unless just loaded

        def attempt() -> _Attempt:
            # One round's exchanges, run again after a failure (OuterLink.run_round): nothing of
            # this reducer's state changes in here. A cluster healed from a peer took its
            # counter and warm starts before this runs (join).
            r = _Round(link, self.counter, delta.device)
            if not self._agreed and not link.verifies_state:
                self._handshake(r)
            with r.timed("encode"):
                x = delta + self.residual if self.config.error_feedback else delta
            if self.matrices:
                return _Attempt(r, x, list(self.ranks), *self._lowrank_round(x, r))
            return _Attempt(r, x, [], *self._dense_round(x, r), None)

        done = link.run_round(attempt)
        r, x, ranks_used, own = done.round, done.x, done.ranks, done.own
        if done.lowrank_next is not None:
            self.ranks, self._outside, self._q = done.lowrank_next

        with r.timed("encode"):
            # What compression dropped this round (the next residual under error feedback).
            dropped = torch.sub(x, own, out=self.residual if self.config.error_feedback else None)
            err = torch.linalg.vector_norm(dropped).item()
            norm = torch.linalg.vector_norm(x).item()
            residual_ratio = 0.0
            if self.config.error_feedback:
                if r.sat_out:
                    self.residual.zero_()  # healed: what it owed was computed on stale state
                elif not math.isfinite(err):
                    self.residual.zero_()  # a non-finite round is skipped by all; drop it here too
                else:
                    if ef_decay != 1.0:
                        self.residual.mul_(ef_decay)
                    dn = torch.linalg.vector_norm(delta).item()
                    residual_ratio = ef_decay * err / dn if dn else 0.0
        self.last_stats = dict(
            round=self.round, codec=self.config.codec, dense_bytes=4 * self.numel,
            payload_bytes=r.payload, sent_bytes=r.sent,
            ratio=4 * self.numel / r.payload if r.payload else math.inf,
            rel_error=err / norm if norm else 0.0, ranks=ranks_used,
            mean_rank=sum(ranks_used) / len(ranks_used) if ranks_used else 0.0,
            encode_s=r.times["encode"], comm_s=r.times["comm"],
            decode_s=r.times["decode"], residual_ratio=residual_ratio,
        )
        return done.mean

    # -- one round ---------------------------------------------------------------------------

    def _dense_parts(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [x[o: o + n] for o, n in self.dense]

    def _write_dense(self, flat: torch.Tensor, dst: torch.Tensor) -> None:
        offset = 0
        for o, n in self.dense:
            dst[o: o + n] = flat[offset: offset + n]
            offset += n

    def _dense_round(self, x: torch.Tensor, r: _Round) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, own decoded) when every tensor is dense: the parts, in order, tile ``x``."""
        numels = [n for _, n in self.dense]
        with r.timed("encode"):
            if self.config.codec == "topk":
                codec = topk.TopKCodec(numels, self.config.bits, self.config.topk_chunk, self.config.topk_density)
            else:
                codec = SegmentCodec(numels, self.payload_bits, self.config.block)
            body = codec.encode(self._dense_parts(x))
        total, mine = self._exchange(r, "dense", codec, body)
        with r.timed("decode"):
            return r.div(total), mine

    def _lowrank_round(self, x: torch.Tensor, r: _Round) -> tuple[torch.Tensor, torch.Tensor, _LowRankNext]:
        """(mean, own decoded, the next round's ranks and warm starts): low-rank matrices in two
        exchanges, the dense tensors with P."""
        out, own = torch.empty_like(x), torch.empty_like(x)
        mats = [x[a.offset: a.offset + a.m * a.n].view(a.m, a.n) for a in self.matrices]
        dense_numels = [n for _, n in self.dense]
        with r.timed("encode"):
            missing = [(i, None, [], self.ranks[i]) for i, q in enumerate(self._q) if q is None]
            first = dict(zip([i for i, *_ in missing], self._warm_starts(missing)))  # seeded: the same on every rank
            qs = [(first[i] if q is None else q).to(x.device) for i, q in enumerate(self._q)]
            ps = [m @ q for m, q in zip(mats, qs)]
            codec = SegmentCodec([p.numel() for p in ps] + dense_numels, self.payload_bits, self.config.block)
            body = codec.encode(ps + self._dense_parts(x))
        total, mine = self._exchange(r, "P", codec, body)

        with r.timed("decode"):
            split = sum(p.numel() for p in ps)
            self._write_dense(r.div(total[split:]), out)
            self._write_dense(mine[split:], own)
            p_sum = _split(total[:split], [p.shape for p in ps])
            p_hat = _by_shape(p_sum, lowrank.orthonormalize)

        with r.timed("encode"):
            qs_local = [m.T @ p for m, p in zip(mats, p_hat)]
            codec = SegmentCodec([q.numel() for q in qs_local], self.payload_bits, self.config.block)
            body = codec.encode(qs_local)
        total, mine = self._exchange(r, "Q", codec, body)

        with r.timed("decode"):
            q_mean = _split(r.div(total), [q.shape for q in qs_local])
            q_own = _split(mine, [q.shape for q in qs_local])
            plans, outside = [], []
            for i, a in enumerate(self.matrices):
                span = slice(a.offset, a.offset + a.m * a.n)
                lowrank.reconstruct(p_hat[i], q_mean[i], out[span].view(a.m, a.n))
                torch.matmul(p_hat[i], q_own[i].T, out=own[span].view(a.m, a.n))  # local only
                plan, beyond = self._plan(i, q_mean[i])
                plans.append(plan)
                outside.append(beyond)
        return out, own, _LowRankNext([rank for *_, rank in plans], outside, self._warm_starts(plans))

    def _plan(self, i: int, q_mean: torch.Tensor) -> tuple[tuple[int, torch.Tensor, list[int], int], float]:
        """Next round's rank of matrix i and the columns of this round's Q to start it from, as a
        plan for :meth:`_warm_starts`, and the energy beyond the new window (``choose_rank``)."""
        r = self.ranks[i]
        if not self.config.adaptive:
            return (i, q_mean, list(range(r)), r), self._outside[i]
        new, keep, outside = lowrank.choose_rank(
            lowrank.column_energy(q_mean), r, min(self.config.min_rank, self.matrices[i].max_rank),
            self.matrices[i].max_rank, self.config.rank_energy, self._outside[i])
        return (i, q_mean, keep, new), outside

    def _warm_starts(self, plans) -> list[torch.Tensor]:
        """Orthonormal (n, rank) starts from kept Q columns plus seeded random ones.

        A non-finite Q (a skipped round) restarts from random columns; a column that comes out
        exactly zero (a matrix that was all zeros) is refilled, so no direction dies for good.
        """
        cands = []
        for i, q, keep, r in plans:
            n = self.matrices[i].n
            kept = q.double()[:, keep] if q is not None else torch.empty(n, 0, dtype=torch.float64)
            if not bool(torch.isfinite(kept).all()):
                kept = kept[:, :0]
            fresh = lowrank.random_columns(n, r - kept.shape[1], self.seed, self.round, i)
            cands.append(torch.cat([kept, fresh.to(kept.device)], dim=1))
        qs = _by_shape(cands, lowrank.orthonormalize)
        for j, (i, *_rest) in enumerate(plans):
            dead = [c for c, e in enumerate(lowrank.column_energy(qs[j])) if not e > 0]
            if dead:
                refill = lowrank.random_columns(cands[j].shape[0], len(dead), self.seed, self.round, i, 1)
                cands[j][:, dead] = refill.to(cands[j].device)
                qs[j] = lowrank.orthonormalize(cands[j])
        return [q.float() for q in qs]

    # -- exchange ----------------------------------------------------------------------------

    def _exchange(self, r: _Round, stage: str, codec: SegmentCodec | topk.TopKCodec, body: torch.Tensor):
        """All-gathers this rank's framed ``body``; returns (sum in cluster order, own decoded)."""
        with r.timed("encode"):
            header = wire.Header(self.config.codec, self.payload_bits, stage, self.round, r.me,
                                 wire.layout_digest(stage, *codec.layout), codec.nbytes)
            payload = wire.frame(body, header)
        with r.timed("comm"):  # the link checks every row (header and checksum) before it delivers
            # The round as it is when the rows are checked: a cluster healed in this exchange takes its peers' (join).
            got = r.all_gather(payload, verify=lambda sender, row: wire.unframe(
                row, replace(header, sender=sender, round=self.round)))
        with r.timed("decode"):
            total = mine = None
            for k, row in zip(got.senders, got.rows):  # fixed cluster order: the same adds on every rank
                dec = codec.decode(row[wire.HEADER_BYTES:].to(r.device))
                if total is None:
                    total = dec.clone() if k == r.me else dec  # this rank's own stays intact
                else:
                    total.add_(dec)
                if k == r.me:
                    mine = dec
        if mine is None:  # sat out (healed) or refused: its own counts as nothing sent
            if total is None:  # and no other cluster delivered
                total = torch.zeros_like(codec.decode(body.to(r.device)))
            mine = torch.zeros_like(total)
        return total, mine

    def _handshake(self, r: _Round) -> None:
        """Checks that every cluster runs the same settings, round and ranks (HANDSHAKE_BYTES each)."""
        digest = hashlib.blake2b(repr((self._setup(), self.round, self.ranks)).encode(),
                                 digest_size=HANDSHAKE_BYTES).digest()
        if r.link.clusters > 1:
            got = r.all_gather(torch.frombuffer(bytearray(digest), dtype=torch.uint8), payload=False)
            c = self.config
            for k, row in zip(got.senders, got.rows):
                if row.numpy().tobytes() != digest:
                    raise ValueError(
                        f"outer round {self.round}: cluster {k} runs different compression settings or "
                        f"state than cluster {r.me} (this one: codec {c.codec}, bits {c.bits}, rank {c.rank}, "
                        f"block {c.block}, adaptive {c.adaptive}, ranks {self.ranks}, topk chunk {c.topk_chunk}, "
                        f"density {c.topk_density}); all clusters "
                        "need the same compression flags and must resume "
                        "from the same checkpoint"
                    )
        self._agreed = True

    # -- checkpointing -----------------------------------------------------------------------

    def _setup(self) -> tuple:
        # topk's settings only for topk, so checkpoints of the other codecs keep loading.
        c = self.config
        extra = (c.topk_chunk, c.topk_density) if c.codec == "topk" else ()
        return (_STATE_VERSION, c.codec, self.payload_bits, c.block, c.rank, c.min_rank,
                c.adaptive, c.rank_energy, self.seed, tuple(tuple(s) for s in self.shapes)) + extra

    def state_dict(self) -> dict[str, Any]:
        """Round counter, warm-start factors, ranks and the error-feedback residual.

        Take it when no reduction is in flight (after ``OuterSync.state_dict()``, which waits).
        Returns references, not copies: save before the next reduction.
        """
        return dict(setup=self._setup(), round=self.round, ranks=list(self.ranks),
                    outside=list(self._outside), q=list(self._q), residual=self.residual)

    def serve(self) -> dict[str, Any]:
        """What every cluster holds alike, for a cluster that heals from this one (:meth:`join`):
        the round counter, and the low-rank ranks and warm starts. Copies: called from torchft's
        thread while a round runs, before its exchanges."""
        return dict(round=self.round, ranks=list(self.ranks), outside=list(self._outside),
                    q=[None if q is None else q.clone() for q in self._q])

    def join(self, state: dict[str, Any]) -> None:
        """Takes a live peer's :meth:`serve` when this cluster heals from it (called before the
        round's exchanges); the round then counts this cluster's own payload as not sent and
        drops its residual."""
        if len(state["q"]) != len(self._q):
            raise ValueError(f"a peer compresses {len(state['q'])} low-rank matrices, this rank "
                             f"{len(self._q)}: the clusters run different models or layouts")
        self.round = int(state["round"])
        self.ranks = [int(r) for r in state["ranks"]]
        self._outside = [float(o) for o in state["outside"]]
        self._q = [None if q is None else q.clone() for q in state["q"]]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict` output (tensors are copied); the next call re-handshakes."""
        if tuple(state["setup"]) != self._setup():
            raise ValueError(
                "compression checkpoint was written with different settings: "
                f"{state['setup']} (version, codec, bits, block, rank, min_rank, adaptive, energy, "
                f"seed, shapes[, topk chunk, density]), this run has {self._setup()}"
            )
        self.round = int(state["round"])
        self.ranks = [int(r) for r in state["ranks"]]
        self._outside = [float(o) for o in state["outside"]]
        self._q = [None if q is None else q.detach().clone() for q in state["q"]]
        res = state["residual"]
        self.residual = None if res is None else res.detach().clone()
        self._agreed = False


class _Round:
    """One round's exchange with the other clusters: who delivered, what this rank sent, timings."""

    def __init__(self, link: OuterLink, counter: ByteCounter | None, device: torch.device):
        self.link, self.counter, self.device = link, counter, device
        self.me = link.cluster
        self.clusters = link.clusters  # those that delivered the last exchange
        self.times: dict[str, float] = defaultdict(float)
        self.payload = 0  # bytes of this round's framed payloads (what one cluster contributes)
        self.sent = 0  # bytes handed to a collective: the payloads and a handshake, 0 alone
        self.sat_out = False  # this cluster's own payload was not sent (it healed)

    def all_gather(self, data: torch.Tensor, payload: bool = True, verify=None) -> Gathered:
        """The delivering clusters' ``data`` in cluster order; ``payload``: counts as the round's payload."""
        # Without sat_out, a payload of this cluster's own that is missing was refused by another
        # cluster (it failed a check there): the others' mean is applied, and under error feedback
        # the residual keeps all of this round's progress, to be sent again.
        got = self.link.all_gather(data, self.counter, verify)
        self.sat_out = got.sat_out
        self.clusters = len(got.senders)
        self.payload += data.numel() if payload else 0
        self.sent += data.numel() if self.link.clusters > 1 else 0
        return got

    def div(self, t: torch.Tensor) -> torch.Tensor:
        """``t / n`` in place, n the clusters that delivered. A tensor divisor: true IEEE division
        on every device (a Python scalar may become a multiply by the reciprocal on some)."""
        return t.div_(torch.tensor(float(max(1, self.clusters)), dtype=t.dtype, device=t.device))

    def timed(self, key: str) -> _Timer:
        return _Timer(self.times, key, self.device)


class _Timer:
    def __init__(self, times, key, device):
        self.times, self.key, self.cuda = times, key, device.type == "cuda"

    def __enter__(self):
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
        self.times[self.key] += time.perf_counter() - self.start


def _split(flat: torch.Tensor, shapes) -> list[torch.Tensor]:
    out, offset = [], 0
    for s in shapes:
        n = math.prod(s)
        out.append(flat[offset: offset + n].view(s))
        offset += n
    return out


def _by_shape(tensors: list[torch.Tensor], fn) -> list[torch.Tensor]:
    """``[fn(t) for t in tensors]``, batching tensors of one shape into one call of ``fn``."""
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, t in enumerate(tensors):
        groups[tuple(t.shape)].append(i)
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for idx in groups.values():
        for i, r in zip(idx, fn(torch.stack([tensors[i] for i in idx])).unbind(0)):
            out[i] = r
    return out
