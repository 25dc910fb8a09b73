"""Dataclass configs for megatron-dilocox."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

SYNC_MODES = ("sync", "delay", "eager")
CODECS = ("none", "quantize", "lowrank", "lowrank-quantize", "topk")
"""``--dilocox-compression`` choices; the wire header numbers them in this order (append only)."""
QUANT_BITS = {"quantize": (8, 4), "lowrank-quantize": (8, 4), "topk": (2, 3, 4)}
"""``--dilocox-quant-bits`` values each quantizing codec takes (the others send fp32)."""
ALL_QUANT_BITS = tuple(sorted({b for bits in QUANT_BITS.values() for b in bits}, reverse=True))
FLUSH_BITS = 8
"""Bits per entry of the final flush of the error-feedback residual (``--dilocox-flush-residual``):
blockwise absmax int8, an error of at most 1/254 of a block's largest entry, at about a quarter
of the bytes of fp32."""


DEFAULT_RAMP_ITERS = 1000
"""``--dilocox-local-steps-ramp-iters`` when not given (and H not adaptive)."""
OUTER_LR_GAIN = 2.8
"""The default outer lr is ``1 + OUTER_LR_GAIN * (1 - 1 / C)`` (:attr:`DiLoCoXConfig.peak_outer_lr`)."""

DEFAULT_OVERLAP_STEPS = 1
"""``--dilocox-overlap-steps`` when not given: the average lands one inner step into the next
round (closest to blocking ``sync`` of the overlapped settings measured, docs/convergence.md)."""


@dataclass
class DiLoCoXConfig:
    """Settings of the DiLoCoX outer loop: the ``--dilocox-*`` flags (:mod:`megatron_dilocox.flags`)."""

    clusters: int = field(default=2, metadata={"resolved": True})
    """C: clusters; the world splits into C contiguous blocks of TP x PP x DP_in ranks (default 2
    with --dilocox). Without --dilocox they only say which traffic is counted as cross-cluster,
    for comparisons.

    Each cluster holds a full model replica and trains on its own data."""

    local_steps: int = 10
    """H: inner steps per outer round.

    The other defaults were chosen and measured at 10 (docs/convergence.md). With adaptive H
    (:attr:`max_local_steps`) the first round's H."""

    local_steps_ramp_iters: int | None = None
    """Grow H from 1 to --dilocox-local-steps over the first this many iterations (0: off;
    default 1000, with adaptive H 0).

    The round that starts at iteration i runs :meth:`local_steps_at` (i) inner steps:
    ``min(H, max(min_local_steps, 1 + H * i // N))``, so the first rounds, where the replicas
    would drift apart most while the loss falls fastest, are short (docs/convergence.md: with 600
    at H = 10 the gap to AllReduce halved and the seed spread went; on 1,400-iteration runs 1000
    ended lower still in every seed at 2 and 4 clusters, and became the default). The ramp adds about
    ``N / H * (1/2 + 1/3 + ... + 1/H)`` rounds (116 at N = 600, 193 at N = 1000, H = 10), each on
    a slow link costing a round's fixed overhead on top of its step (docs/benchmarks.md). None:
    :attr:`ramp_iters`."""

    min_local_steps: int | None = None
    """The shortest round: the H ramp's rounds and an adaptive H stay at or above it (default 1).

    Above 1 the ramp skips its shortest rounds, which cost the most per step on a slow link."""

    max_local_steps: int | None = None
    """Adapt H after every round (within these bounds) so that one round's exchange fits inside
    the next round's compute; H starts at --dilocox-local-steps.

    After every round H becomes the fewest steps whose compute covers the slowest measured
    exchange (with 20% margin), so one round's communication hides inside the next round's
    training."""

    sync_mode: str = field(default="delay", metadata={"choices": SYNC_MODES})
    """delay: one-step-delay overlap, the replica trains on from where it is while the average is
    on its way; eager: the same overlap, restart from base plus 1/C of the fresh local progress;
    sync: blocking DiLoCo.

    ``sync``: plain DiLoCo, average and apply this round's pseudo-gradient before training on.
    ``delay``: the replica trains on from where it is (its own fresh progress kept) while the
    round's average is on its way, and swaps that progress for the average when it lands
    (:attr:`overlap_steps`). ``eager``: as ``delay``, but the replica keeps only its 1/C share of
    its fresh progress (the part of the coming average it already knows); better than ``delay``
    when the average lands only at the next boundary, worse when it lands within a step or two:
    the replica's first steps after the boundary start from a point it never trained at
    (docs/convergence.md)."""

    overlap_steps: int | None = None
    """delay/eager: apply a round's average this many inner steps into the next round (the
    exchange must finish by then); H or more: at the next boundary (default 1; with adaptive H:
    the next boundary).

    Applied by :meth:`~megatron_dilocox.outer.sync.OuterSync.land`. None: :attr:`landing`. If the
    exchange has not finished within these steps, training waits for it (the round's ``wait_s``;
    tools/plan.py shows whether it hides)."""

    outer_lr: float | None = None
    """Outer SGD learning rate (default 1 + 2.8 (1 - 1/C): 2.4 at 2 clusters, 3.1 at 4).

    Without momentum, warmed up from 1 (:attr:`outer_lr_warmup_iters`), by measurement at H = 10
    with the H ramp (docs/convergence.md): the replicas' averaged progress is shorter than
    either's where they disagree, the more so the more replicas are averaged, and a longer step
    restores it. The best measured: 2.4 at C = 2 (1.1% below 1.7 over three seeds on a 1.1M
    model, 2.5% on a 5.8M one, seed 1), 3.1-4.0 at C = 4 (3.1 2.5% below 1.7 over three seeds);
    the default passes through 2.4 and 3.1 and is 1 (the replica itself) at C = 1, an extrapolation
    above 4 clusters that saturates at 3.8. Without the warm-up 1.7 lost from the first rounds
    on. Outer momentum lost (DiLoCo's Nesterov 0.7 / 0.9 stalled). None: :attr:`peak_outer_lr`."""

    outer_lr_warmup_iters: int = 600
    """Grow the outer lr linearly from 1 (the plain average) to --dilocox-outer-lr over the
    first this many iterations (0: off).

    The round that ends at iteration i steps with :meth:`outer_lr_at` (i): the replicas'
    averaged progress is applied as it is while the loss falls fastest, and extrapolated
    (outer lr above 1) only once rounds are long (docs/convergence.md)."""

    final_average: bool | None = None
    """At the end of training, apply the round still in flight and the flushed residual as they
    are (outer lr 1, no momentum) instead of with the outer step, so that the final model is the
    replicas' average rather than an extrapolation of their last progress (default: on).

    By measurement (docs/convergence.md): the outer lr above 1 pays while training goes on, but
    the end has no later round to correct its overshoot. At C = 4 the flushed residual applied
    at outer lr 3.1 ended 0.56% above the same run's average."""

    outer_momentum: float = 0.0
    """Outer SGD momentum, in [0, 1) (0: plain SGD; Nesterov when > 0 unless
    --dilocox-no-nesterov)."""

    nesterov: bool = True
    """Plain momentum instead of Nesterov in the outer SGD.

    (The flag turns Nesterov off; with momentum 0 the outer step is plain SGD either way.)"""

    offload_outer_state: bool = False
    """Keep the outer state (fp32 base, momentum, residuals) in pinned CPU memory and stage the
    cross-cluster exchange through it over gloo (saves GPU memory; no-op on CPU).

    With compression the codec's warm starts and residuals move too; the round start and the
    in-flight result as well."""

    outer_timeout_s: float = 3600.0
    """Seconds a round waits for the cross-cluster reduction before failing.

    A dead peer cluster must not hang training forever."""

    emulated_delay_s: float = 0.0
    """Add this many seconds to every cross-cluster reduction: see the overlap hide a slow link
    without one (benchmarks and tests)."""

    @property
    def landing(self) -> int | None:
        """Inner steps into a round at which the previous round's average is applied, or None
        where it is applied at the boundary (``sync``, adaptive H by default);
        the training loop lands it at the boundary as well when this is not below the round's H."""
        if self.sync_mode not in ("delay", "eager"):
            return None
        if self.overlap_steps is None:
            return None if self.max_local_steps is not None else DEFAULT_OVERLAP_STEPS
        return self.overlap_steps

    @property
    def ramp_iters(self) -> int:
        """The H ramp's length: :attr:`local_steps_ramp_iters`, or when not given
        ``DEFAULT_RAMP_ITERS`` (0 with adaptive H, which sets H itself)."""
        if self.local_steps_ramp_iters is not None:
            return self.local_steps_ramp_iters
        return 0 if self.max_local_steps is not None else DEFAULT_RAMP_ITERS

    def local_steps_at(self, iteration: int) -> int:
        """H of the round that starts after ``iteration`` inner steps (:attr:`ramp_iters`)."""
        if iteration >= self.ramp_iters:
            return self.local_steps
        ramped = 1 + self.local_steps * iteration // self.ramp_iters
        return min(self.local_steps, max(self.min_local_steps or 1, ramped))

    @property
    def peak_outer_lr(self) -> float:
        """The outer lr after the warm-up: :attr:`outer_lr`, or when not given
        ``1 + OUTER_LR_GAIN * (1 - 1 / clusters)``."""
        if self.outer_lr is not None:
            return self.outer_lr
        return 1.0 + OUTER_LR_GAIN * (1.0 - 1.0 / self.clusters)

    def outer_lr_at(self, iteration: int) -> float:
        """Outer lr of the round that ends at ``iteration`` (:attr:`outer_lr_warmup_iters`)."""
        if iteration >= self.outer_lr_warmup_iters:
            return self.peak_outer_lr
        return 1.0 + (self.peak_outer_lr - 1.0) * iteration / self.outer_lr_warmup_iters

    @property
    def averages_at_end(self) -> bool:
        """:attr:`final_average`: on unless turned off."""
        return self.final_average is not False

    @property
    def use_nesterov(self) -> bool:
        """Whether the outer step is Nesterov (it needs momentum)."""
        return self.nesterov and self.outer_momentum > 0

    def validate(self) -> None:
        """Checks the settings.

        Raises:
            ValueError: with a one-line message naming the offending flag.
        """
        if self.clusters < 1:
            raise ValueError(f"--dilocox-clusters must be >= 1, got {self.clusters}")
        if self.local_steps < 1:
            raise ValueError(f"--dilocox-local-steps must be >= 1, got {self.local_steps}")
        if self.ramp_iters < 0:
            raise ValueError(f"--dilocox-local-steps-ramp-iters must be >= 0, got {self.ramp_iters}")
        if self.outer_lr_warmup_iters < 0:
            raise ValueError(f"--dilocox-outer-lr-warmup-iters must be >= 0, got {self.outer_lr_warmup_iters}")
        if self.ramp_iters and self.max_local_steps is not None:
            raise ValueError("--dilocox-local-steps-ramp-iters and --dilocox-max-local-steps (adaptive H) both set H: use one")
        if self.max_local_steps is not None:
            low = self.min_local_steps or 1
            if not 1 <= low <= self.local_steps <= self.max_local_steps:
                raise ValueError("need 1 <= --dilocox-min-local-steps <= --dilocox-local-steps <= "
                                 f"--dilocox-max-local-steps, got {low}, {self.local_steps}, {self.max_local_steps}")
            if self.sync_mode == "sync":
                raise ValueError("--dilocox-max-local-steps adapts H to hide communication, which only the "
                                 "delay modes overlap; --dilocox-sync-mode sync blocks on it")
        elif self.min_local_steps is not None:
            if not self.ramp_iters:
                raise ValueError("--dilocox-min-local-steps bounds the H ramp or adaptive H: it needs "
                                 "--dilocox-local-steps-ramp-iters > 0 or --dilocox-max-local-steps")
            if not 1 <= self.min_local_steps <= self.local_steps:
                raise ValueError("need 1 <= --dilocox-min-local-steps <= --dilocox-local-steps, "
                                 f"got {self.min_local_steps}, {self.local_steps}")
        if self.sync_mode not in SYNC_MODES:
            raise ValueError(
                f"--dilocox-sync-mode must be one of {', '.join(SYNC_MODES)}, got {self.sync_mode!r}"
            )
        if self.overlap_steps is not None:
            if self.sync_mode not in ("delay", "eager"):
                raise ValueError("--dilocox-overlap-steps needs --dilocox-sync-mode delay or eager, "
                                 f"got {self.sync_mode}")
            if self.overlap_steps < 1:
                raise ValueError(f"--dilocox-overlap-steps must be >= 1, got {self.overlap_steps}")
        if self.outer_lr is not None and not (math.isfinite(self.outer_lr) and self.outer_lr > 0):
            raise ValueError(f"--dilocox-outer-lr must be > 0, got {self.outer_lr}")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(
                f"--dilocox-outer-momentum must be in [0, 1), got {self.outer_momentum}"
            )
        if not self.outer_timeout_s > 0:
            raise ValueError(
                f"--dilocox-outer-timeout-s must be > 0, got {self.outer_timeout_s}"
            )
        if not self.emulated_delay_s >= 0:
            raise ValueError(f"--dilocox-emulated-delay-s must be >= 0, got {self.emulated_delay_s}")


@dataclass
class CompressionConfig:
    """How the pseudo-gradient is compressed for the cross-cluster exchange: the ``--dilocox-*``
    compression flags (:mod:`megatron_dilocox.flags`)."""

    codec: str = field(default="topk", metadata={"flag": "compression", "choices": CODECS})
    """How the pseudo-gradient is compressed: low-rank (PowerSGD) factors of 2-D shards and/or
    blockwise absmax quantization; topk: each chunk's largest entries, low-bit (SparseLoCo-style).

    ``topk`` by measurement: the lowest loss of the codecs sending at least 100x fewer bytes per
    round than dense fp32 (rank-8 8-bit low rank without error feedback stalled;
    docs/convergence.md)."""

    bits: int | None = field(default=None, metadata={"flag": "quant-bits", "choices": ALL_QUANT_BITS})
    """Bits per quantized value: 8 or 4 (default 8); topk: 2, 3 or 4 (default 2).

    8: rank 8 with 8-bit factors sent 96x fewer bytes than fp32 at +0.8% loss, 4-bit 189x at +2%
    (docs/compression.md). ``topk``'s 2 (as SparseLoCo's): 111x fewer bytes than fp32 at density
    1/32 (an Elias-Fano code of 7 bits per index and the 2-bit value); 4-bit values would send
    91x, and gained 0.1% at density 1/64 (docs/convergence.md)."""

    block: int = field(default=256, metadata={"flag": "quant-block"})
    """Values per quantization scale (one fp32 absmax each)."""

    rank: int = 8
    """Low-rank rank (upper bound when adaptive)."""

    min_rank: int = 1
    """Lower bound of the adaptive rank."""

    rank_energy: float = 0.9
    """Adaptive rank keeps this fraction of the previous round's spectrum energy."""

    adaptive: bool = False
    """Choose each matrix's rank every round."""

    error_feedback: bool | None = None
    """Carry what compression dropped into the next round (default: on for topk, off for the
    others).

    On for ``topk``, which drops most entries every round (they must arrive later); off for the
    others by measurement: with outer momentum the residual grew to 3x the pseudo-gradient and
    bought no loss (docs/compression.md)."""

    ef_decay: float = 0.95
    """Factor applied to the error-feedback residual each round, in [0, 1] (SparseLoCo: 0.95).

    With ``topk`` it ended at the loss of 1.0 (docs/convergence.md) while keeping the residual
    bounded (about 8x the pseudo-gradient instead of growing past 30x)."""

    ef_decay_follows_lr: bool | None = None
    """Scale what the decay drops each round, ``1 - ef_decay``, by the inner lr over its peak once
    the lr decays: :attr:`ef_decay` up to the end of the lr warm-up, nearer 1 as the lr decays
    (:meth:`ef_decay_at`; default: on with error feedback).

    The decay keeps the replicas, which train on their own unsent progress, from drifting apart;
    that drift costs most in the first rounds, while the progress the decay drops costs most
    late in a run. On by measurement: lower final loss in each of three seeds at C = 2 (0.45% on
    the mean), 0.71% on a 4x larger model, level at C = 4 (docs/convergence.md). (Scaled during
    the warm-up as well, the first rounds' residual grew a third larger and the run ended 0.8%
    behind the constant decay.)"""

    topk_density: float = 1 / 32
    """topk: fraction of each chunk's entries sent, in (0, 1] (default 1/32).

    1/32 by measurement: 2.0% lower final loss than 1/64 at 5 tokens per parameter
    (docs/convergence.md), at 111x fewer bytes per round than fp32, about the densest setting
    above 100x; smaller chunks at the same bytes lost."""

    topk_chunk: int = 4096
    """topk: elements per chunk; each keeps its own largest entries and fp32 scale."""

    keep_unsent: bool | None = None
    """Each replica keeps the progress compression has not sent yet (the error-feedback residual)
    instead of restarting each round from the global weights (default: on with error feedback).

    A round then restarts from ``base - residual`` (docs/dilocox.md). On by measurement together
    with :attr:`flush_residual`: the pair ended 3.3% and 1.6% below neither in two seeds
    (docs/convergence.md); alone it was -1.2% and +0.3%, the final weights lacking the residual."""

    flush_residual: bool | None = None
    """At the end of training, send what error feedback still holds, every entry at
    :data:`FLUSH_BITS` bits (blocks of ``--dilocox-quant-block``), as one last outer step, so
    that the final model has every replica's progress (default: on with error feedback).

    That one round costs about a quarter of an uncompressed fp32 round, so a run of R rounds
    sends about R / ratio + 1/4 dense rounds in all. Without it the final global weights lack the
    residual: several rounds' worth of the replicas' smaller entries, sent late or (decayed) never."""

    def __post_init__(self):
        if self.bits is None:  # 8, topk 2 (see the field)
            self.bits = 2 if self.codec == "topk" else 8
        if self.error_feedback is None:  # topk only (see the field)
            self.error_feedback = self.codec == "topk"
        residual = self.error_feedback and self.codec != "none"
        if self.ef_decay_follows_lr is None:
            self.ef_decay_follows_lr = residual
        if self.keep_unsent is None:
            self.keep_unsent = residual
        if self.flush_residual is None:
            self.flush_residual = residual

    def ef_decay_at(self, lr_scale: float) -> float:
        """The residual's factor in a round whose inner lr is ``lr_scale`` times its peak."""
        if not self.ef_decay_follows_lr:
            return self.ef_decay
        return 1.0 - (1.0 - self.ef_decay) * min(max(lr_scale, 0.0), 1.0)

    def flush_config(self) -> "CompressionConfig":
        """How :attr:`flush_residual` sends the residual: every entry, blockwise quantized."""
        return CompressionConfig(codec="quantize", bits=FLUSH_BITS, block=self.block)

    def validate(self) -> None:
        """Raises ValueError with a one-line message naming the offending flag."""
        if self.codec not in CODECS:
            raise ValueError(f"--dilocox-compression must be one of {', '.join(CODECS)}, got {self.codec!r}")
        allowed = QUANT_BITS.get(self.codec, QUANT_BITS["quantize"])
        if self.bits not in allowed:
            raise ValueError(f"--dilocox-quant-bits must be {', '.join(map(str, allowed))} with "
                             f"--dilocox-compression {self.codec}, got {self.bits}")
        if self.block < 2 or self.block % 2:
            raise ValueError(f"--dilocox-quant-block must be an even number >= 2, got {self.block}")
        if not 1 <= self.min_rank <= self.rank:
            raise ValueError(f"need 1 <= --dilocox-min-rank <= --dilocox-rank, got {self.min_rank} and {self.rank}")
        if not 0 < self.rank_energy <= 1:
            raise ValueError(f"--dilocox-rank-energy must be in (0, 1], got {self.rank_energy}")
        if not 0 <= self.ef_decay <= 1:
            raise ValueError(f"--dilocox-ef-decay must be in [0, 1], got {self.ef_decay}")
        if not 0 < self.topk_density <= 1:
            raise ValueError(f"--dilocox-topk-density must be in (0, 1], got {self.topk_density}")
        if self.topk_chunk < 2:
            raise ValueError(f"--dilocox-topk-chunk must be >= 2, got {self.topk_chunk}")
        for flag, given in (("--dilocox-ef-decay-follows-lr", self.ef_decay_follows_lr),
                            ("--dilocox-keep-unsent", self.keep_unsent),
                            ("--dilocox-flush-residual", self.flush_residual)):
            if given and not (self.error_feedback and self.codec != "none"):
                raise ValueError(f"{flag} needs a compression codec with --dilocox-error-feedback")


@dataclass
class ExchangeConfig:
    """Clusters as independent jobs joined by a fault-tolerant outer exchange (torchft): the
    ``--dilocox-*`` flags of :mod:`megatron_dilocox.outer.cluster_exchange`."""

    lighthouse: str | None = None
    """torchft Lighthouse HOST:PORT: this torchrun job is one cluster, and clusters exchange only
    through the Lighthouse's quorums (a lost cluster costs the others one round).

    Without it the run is one torchrun world spanning every cluster. ``python -m
    megatron_dilocox.launch`` starts a Lighthouse and the C jobs on one machine; across machines
    run ``torchft_lighthouse --min_replicas 1 --bind [::]:PORT`` once and every cluster's torchrun
    with the same flags plus its own ``--dilocox-cluster-index`` (docs/reliability.md)."""

    cluster_index: int | None = None
    """This job's cluster, 0 to C-1 (needed with --dilocox-lighthouse)."""

    min_clusters: int = 1
    """Fewest live clusters an outer round may be applied with; below it the survivors save a
    checkpoint (with --save) and stop with a one-line error, unless --dilocox-rejoin-timeout-s
    lets them wait for clusters to come back."""

    rejoin_timeout_s: float = 0.0
    """Below --dilocox-min-clusters, how long beyond --dilocox-failure-timeout-s the survivors
    wait in the round for clusters to (re)join (a restarted cluster heals from them and the
    round goes on with it); 0: they stop after --dilocox-failure-timeout-s."""

    failure_timeout_s: float = 60.0
    """Bound on one outer round, retries included: a cluster that died or froze mid-round is
    left out of it after this long at most (and after the Lighthouse's heartbeat timeout, a
    few seconds, when its processes are gone).

    A cluster frozen inside the exchange holds it for this long; the round then gets this long
    again for the quorum without it, so such a round may take twice this before it commits."""

    startup_timeout_s: float = 300.0
    """How long the first round waits for all C clusters to be up."""

    @property
    def lighthouse_url(self) -> str:
        return self.lighthouse if "://" in self.lighthouse else f"http://{self.lighthouse}"

    def validate(self, clusters: int) -> None:
        """Raises ValueError with a one-line message naming the offending flag."""
        if self.lighthouse is None:
            if self.cluster_index is not None:
                raise ValueError("--dilocox-cluster-index needs --dilocox-lighthouse")
            return
        if self.cluster_index is None or not 0 <= self.cluster_index < clusters:
            raise ValueError(f"--dilocox-lighthouse needs --dilocox-cluster-index in 0..{clusters - 1}, "
                             f"got {self.cluster_index}")
        if not 1 <= self.min_clusters <= clusters:
            raise ValueError(f"--dilocox-min-clusters must be in 1..{clusters}, got {self.min_clusters}")
        for flag, value in (("failure", self.failure_timeout_s), ("startup", self.startup_timeout_s)):
            if not value > 0:
                raise ValueError(f"--dilocox-{flag}-timeout-s must be > 0, got {value}")
        if not self.rejoin_timeout_s >= 0:
            raise ValueError(f"--dilocox-rejoin-timeout-s must be >= 0, got {self.rejoin_timeout_s}")
