"""The record of one DiLoCoX round boundary, as logged: built by
:class:`~megatron_dilocox.training.dilocox.DiLoCoX`, written by
:class:`~megatron_dilocox.training.metrics.MetricsLogger`.

Everything but the pseudo-gradient norm describes the reduction *applied* since the previous
boundary (in the overlapping modes the previous round's, which lands ``--dilocox-overlap-steps``
into this round or at this boundary; see docs/dilocox.md). :meth:`OuterRound.metrics`
gives the JSON-lines record whose keys the tools read (README, "Metrics file").
"""

from dataclasses import asdict, dataclass

from megatron_dilocox.outer.sync import AppliedReduction


@dataclass(frozen=True)
class CodecRound:
    """What compression did to the applied reduction (this rank's shard)."""

    dense_bytes: int
    """Bytes the shard would have taken as fp32."""
    compression_ratio: float
    """``dense_bytes`` over the encoded payload's bytes."""
    rel_error: float
    """``|x - decode(encode(x))| / |x|`` of what this rank encoded (``x``: its ``delta`` plus
    the error-feedback residual)."""
    mean_rank: float
    """Low-rank codecs: the mean rank of the low-rank matrices (0 without any)."""
    codec_s: float
    """Seconds spent encoding and decoding."""
    residual_ratio: float
    """Error feedback: the norm of the residual carried into the next round over ``|delta|``
    (0 without)."""


@dataclass(frozen=True)
class OuterRound(AppliedReduction):
    """One round boundary (``drain``: the in-flight round applied at the end of training): the
    applied reduction as this rank saw it, and the cluster's view of the round."""

    outer_step: int
    """Round boundaries passed so far (1 at the first)."""
    iteration: int
    """The training iteration the boundary follows."""
    pseudo_grad_norm: float
    """L2 norm of this cluster's whole pseudo-gradient (the replica's ``delta`` over all of its
    shards) measured at this boundary; 0 for a drain. Parameters replicated across
    tensor-parallel ranks (norms, biases) count once per TP rank."""
    drain: bool
    compression: CodecRound | None = None
    """With a codec, when a reduction was applied."""
    round_compute_s: float | None = None
    """Seconds since the previous boundary (not for a drain)."""
    local_steps: int | None = None
    """H of the next round (not for a drain)."""
    slowest_exchange_s: float | None = None
    """Adaptive H: the longest exchange over every cluster's ranks (measured a round or two
    earlier), from which ``local_steps`` was chosen."""
    slowest_step_s: float | None = None
    """Adaptive H: the longest time per inner step over every cluster's ranks, likewise."""
    cross_cluster_bytes_between_boundaries: int | None = None
    """Bytes the training thread sent across clusters outside boundaries so far (must be 0);
    with clusters only."""
    cross_cluster_bytes: int | None = None
    """All bytes this rank sent across clusters so far, as training records count them; the
    drain's is the run's total (it follows the last training record)."""
    global_sha256: str | None = None
    """The drain: SHA-256 (hex) of this rank's final global parameters and outer settings, the
    fingerprint a cluster-jobs exchange compares every round; equal on the ranks that hold the
    same shard in every cluster."""

    @property
    def codec_fraction(self) -> float | None:
        """Codec time as a fraction of the round's compute."""
        if self.compression is None or self.round_compute_s is None:
            return None
        return self.compression.codec_s / self.round_compute_s

    def metrics(self) -> dict:
        """The metrics-file record: the fields by name, compression's flattened, ``codec_fraction``
        added; fields that do not apply (None) left out."""
        record = asdict(self)
        record.update(record.pop("compression") or {})
        record["codec_fraction"] = self.codec_fraction
        return {key: value for key, value in record.items() if value is not None}
