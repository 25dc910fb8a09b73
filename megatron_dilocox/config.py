"""Dataclass configs for megatron-dilocox."""
from __future__ import annotations

import math
from dataclasses import dataclass

SYNC_MODES = ("sync", "delay", "eager", "delay-naive")
CODECS = ("none", "quantize", "lowrank", "lowrank-quantize", "topk")
"""``--dilocox-compression`` choices; the wire header numbers them in this order (append only)."""
QUANT_BITS = {"quantize": (8, 4), "lowrank-quantize": (8, 4), "topk": (2, 3, 4)}
"""``--dilocox-quant-bits`` values each quantizing codec takes (the others send fp32)."""


def default_bits(codec: str) -> int:
    """``--dilocox-quant-bits`` when not given: 8 (2 for ``topk``, see :class:`CompressionConfig`)."""
    return 2 if codec == "topk" else 8


def default_error_feedback(codec: str) -> bool:
    """``--dilocox-error-feedback`` when not given: on for ``topk`` only."""
    return codec == "topk"


DEFAULT_OVERLAP_STEPS = 1
"""``--dilocox-overlap-steps`` when not given: the average lands one inner step into the next
round (closest to blocking ``sync`` of the overlapped settings measured, docs/convergence.md)."""


@dataclass
class DiLoCoXConfig:
    """Settings of the DiLoCoX outer loop (the ``--dilocox-*`` flags)."""

    clusters: int = 2
    """Number of clusters C; each holds a full model replica and trains on its own data.
    ``--dilocox-clusters``."""

    local_steps: int = 20
    """Inner optimizer steps H between two outer synchronisations (the first H when adaptive).
    ``--dilocox-local-steps``."""

    min_local_steps: int | None = None
    """Lower bound of an adaptive H. ``--dilocox-min-local-steps``."""

    max_local_steps: int | None = None
    """Upper bound of an adaptive H; setting it turns adaptation on: after every round H becomes
    the fewest steps whose compute covers the slowest measured exchange (with 20% margin), so one
    round's communication hides inside the next round's training. ``--dilocox-max-local-steps``."""

    sync_mode: str = "delay"
    """Overlap policy at a round boundary. ``--dilocox-sync-mode``.

    ``sync``: plain DiLoCo, average and apply this round's pseudo-gradient before training on.
    ``delay`` (the default): one-step-delay overlap; the replica trains on from where it is (its
    own fresh progress kept) while the round's average is on its way, and swaps that progress for
    the average when it lands (:attr:`overlap_steps`).
    ``eager``: as ``delay``, but the replica keeps only its 1/C share of its fresh progress (the
    part of the coming average it already knows); better than ``delay`` when the average lands
    only at the next boundary, worse when it lands within a step or two: the replica's first steps
    after the boundary start from a point it never trained at (docs/convergence.md).
    ``delay-naive``: ablation of ``delay`` that drops the fresh progress; unstable with the
    default outer settings, never use it for real runs.
    """

    overlap_steps: int | None = None
    """``delay`` and ``eager``: inner steps a round's exchange overlaps before its average is
    applied (:meth:`~megatron_dilocox.outer.sync.OuterSync.land`); H or more: at the next
    boundary. None: :data:`DEFAULT_OVERLAP_STEPS` (with adaptive H, the next boundary: H is then
    sized to hide the exchange in a whole round). The exchange must finish within these steps or
    training waits for it (the round's ``wait_s``; tools/plan.py shows whether it hides).
    ``--dilocox-overlap-steps``."""

    outer_lr: float = 1.0
    """Learning rate of the outer SGD. ``--dilocox-outer-lr``. 1.0 without momentum (the mean of
    the replicas' progress, applied as it is) by measurement at H=10 (docs/convergence.md): 1.5
    and outer momentum lost (DiLoCo's Nesterov 0.7 / 0.9 stalled); 0.7 helped uncompressed
    blocking DiLoCo a little but lost with the default codec."""

    outer_momentum: float = 0.0
    """Momentum of the outer SGD, in [0, 1); 0 is plain SGD. ``--dilocox-outer-momentum``."""

    nesterov: bool = True
    """Use Nesterov momentum in the outer SGD when ``outer_momentum`` > 0 (with 0 the outer step
    is plain SGD either way); ``--dilocox-no-nesterov`` turns it off."""

    offload_outer_state: bool = False
    """Keep the outer state (fp32 base, round start, momentum, the in-flight result; with
    compression also its warm starts and residuals) in pinned host memory instead of GPU memory;
    the pseudo-gradient is staged through it and the exchange runs over gloo on CPU tensors.
    No effect without CUDA (the state is in host memory anyway). ``--dilocox-offload-outer-state``."""

    outer_timeout_s: float = 3600.0
    """Seconds a round boundary waits for the cross-cluster reduction before failing
    (a dead peer cluster must not hang training forever). ``--dilocox-outer-timeout-s``."""

    @property
    def landing(self) -> int | None:
        """Inner steps into a round at which the previous round's average is applied, or None
        where it is applied at the boundary (``sync``, ``delay-naive``, adaptive H by default);
        the training loop lands it at the boundary as well when this is not below the round's H."""
        if self.sync_mode not in ("delay", "eager"):
            return None
        if self.overlap_steps is None:
            return None if self.max_local_steps is not None else DEFAULT_OVERLAP_STEPS
        return self.overlap_steps

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
        if self.max_local_steps is not None:
            low = self.min_local_steps or 1
            if not 1 <= low <= self.local_steps <= self.max_local_steps:
                raise ValueError("need 1 <= --dilocox-min-local-steps <= --dilocox-local-steps <= "
                                 f"--dilocox-max-local-steps, got {low}, {self.local_steps}, {self.max_local_steps}")
            if self.sync_mode == "sync":
                raise ValueError("--dilocox-max-local-steps adapts H to hide communication, which only the "
                                 "delay modes overlap; --dilocox-sync-mode sync blocks on it")
        elif self.min_local_steps is not None:
            raise ValueError("--dilocox-min-local-steps needs --dilocox-max-local-steps (which turns adaptive H on)")
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
        if not (math.isfinite(self.outer_lr) and self.outer_lr > 0):
            raise ValueError(f"--dilocox-outer-lr must be > 0, got {self.outer_lr}")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(
                f"--dilocox-outer-momentum must be in [0, 1), got {self.outer_momentum}"
            )
        if not self.outer_timeout_s > 0:
            raise ValueError(
                f"--dilocox-outer-timeout-s must be > 0, got {self.outer_timeout_s}"
            )


@dataclass
class CompressionConfig:
    """How the pseudo-gradient is compressed for the cross-cluster exchange (``--dilocox-*``)."""

    codec: str = "topk"
    """``none``, ``quantize``, ``lowrank``, ``lowrank-quantize`` or ``topk``. ``--dilocox-compression``.
    ``topk`` by measurement: the lowest loss of the codecs sending at least 100x fewer bytes per round
    than dense fp32 (rank-8 8-bit low rank without error feedback stalled; docs/convergence.md)."""

    bits: int | None = None
    """Bits per quantized value, 8 or 4; ``topk``: 2, 3 or 4. ``--dilocox-quant-bits``. None: 8
    (2 for ``topk``). 8: rank 8 with 8-bit factors sent 96x fewer bytes than fp32 at +0.8% loss,
    4-bit 189x at +2% (docs/compression.md). ``topk``'s 2 (as SparseLoCo's): 141x fewer bytes than
    fp32 at density 1/64; its indices (12 bits each in chunks of 4096) outweigh the values, so 4-bit
    values would send 124x."""

    block: int = 256
    """Values per quantization block (one fp32 absmax scale each). ``--dilocox-quant-block``."""

    rank: int = 8
    """Low-rank (PowerSGD) rank of 2-D shards; the upper bound when adaptive. ``--dilocox-rank``."""

    min_rank: int = 1
    """Lower bound of the adaptive rank. ``--dilocox-min-rank``."""

    rank_energy: float = 0.9
    """Adaptive rank keeps the smallest rank holding this fraction of the previous round's
    spectrum energy. ``--dilocox-rank-energy``."""

    adaptive: bool = False
    """Choose each matrix's rank every round from the spectrum. ``--dilocox-adaptive``."""

    error_feedback: bool | None = None
    """Keep what compression dropped and add it to the next round. ``--dilocox-error-feedback``.
    None: on for ``topk``, which drops most entries every round (they must arrive later), off for
    the others by measurement: with outer momentum the residual grew to 3x the pseudo-gradient and
    bought no loss (docs/compression.md)."""

    ef_decay: float = 0.95
    """Factor applied to the kept residual each round, in [0, 1]. ``--dilocox-ef-decay``. 0.95 (as
    SparseLoCo's): with ``topk`` it ended at the loss of 1.0 (docs/convergence.md) while keeping
    the residual bounded (about 8x the pseudo-gradient instead of growing past 30x)."""

    topk_density: float = 1 / 64
    """``topk``: fraction of each chunk's entries sent, in (0, 1]. ``--dilocox-topk-density``."""

    topk_chunk: int = 4096
    """``topk``: elements per chunk (each keeps its own top entries and scale).
    ``--dilocox-topk-chunk``."""

    keep_unsent: bool = False
    """Each replica keeps in its weights what compression has not yet sent of its own progress
    (the error-feedback residual), restarting a round from ``base - residual`` instead of the
    global weights. ``--dilocox-keep-unsent``; needs error feedback."""

    def __post_init__(self):
        if self.bits is None:
            self.bits = default_bits(self.codec)
        if self.error_feedback is None:
            self.error_feedback = default_error_feedback(self.codec)

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
        if self.keep_unsent and not (self.error_feedback and self.codec != "none"):
            raise ValueError("--dilocox-keep-unsent needs a compression codec with --dilocox-error-feedback")
