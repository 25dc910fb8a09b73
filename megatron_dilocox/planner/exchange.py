"""The cross-cluster link: what AllReduce and DiLoCoX send between clusters, and how long it takes.

``--inter-bandwidth-gbps`` is the link between two clusters, shared by all M = TP PP DP_in ranks
of a cluster (``--inter-link per-rank`` gives every rank its own link instead). Per-rank bytes
below are what one rank sends; link time = (sum over the cluster's ranks) / bandwidth.

* AllReduce baseline: gradients are reduced over all C DP_in replicas every step,
  hierarchically (reduce-scatter inside the cluster, all-reduce across clusters, all-gather inside),
  so each rank sends ``2 (C - 1) / C * 4 N_rank / DP_in`` bytes of fp32 gradient across clusters
  per step, i.e. the whole model's fp32 gradient crosses once each way. Not overlapped with
  compute (stated assumption; the cross leg is far slower than the backward pass anyway).
* DiLoCoX: once per round of H steps each rank exchanges its outer shard's payload, from the
  formulas of ``megatron_dilocox/payload.py`` (the reducer's: a 40-byte header per exchange,
  blocks of 256 values with one fp32 scale, low-rank (m + n) r factors where they save bytes, 1-D
  dense; ``topk``: chunked indices, codes and scales of the flat shard).
  ``none`` is an fp32 ring all-reduce (``2 (C - 1) / C * payload`` on the wire); the codecs
  all-gather (``(C - 1) * payload``). In the overlapped modes the exchange hides behind the
  steps before its average lands (``T`` = ``--dilocox-overlap-steps``, at most H): round time =
  H * step + max(0, exchange - T * step); ``sync`` mode adds the whole exchange. Codec compute (measured 1.3-2.1%
  of a round's compute on CPU) is ignored. With the distributed optimizer the outer shard of a
  matrix is modelled as (m / DP_in, n); the real shard is a flat range cut across tensors.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_dilocox.config import CompressionConfig, DiLoCoXConfig
from megatron_dilocox.payload import HANDSHAKE_BYTES, codec_bytes
from megatron_dilocox.planner.layout import Machine, gbps_to_bytes_per_s
from megatron_dilocox.planner.shapes import Tensor


@dataclass(frozen=True)
class AllReduceCost:
    """The baseline's cross-cluster gradient all-reduce, every step (per rank: the largest stage's)."""

    per_stage: list[float]
    """Bytes one rank of each pipeline stage sends per step."""
    bytes_per_rank_per_step: float
    link_bytes_per_step: float
    comm: float
    """Seconds on the link per step."""
    step: float
    """Seconds per step: the inner step and ``comm``."""


@dataclass(frozen=True)
class DiLoCoXCost:
    """DiLoCoX's exchange of the outer shards' payloads, once per round of H steps (per rank: the
    largest stage's)."""

    payload_per_stage: list[int]
    """Bytes of one rank's payload per round, by pipeline stage (what its codec encodes)."""
    payload_per_rank: int
    flush_per_stage: list[int]
    """Bytes of the residual's final flush (``--dilocox-flush-residual``, once), by stage; else 0."""
    flush_per_rank: int
    sent_per_stage: list[float]
    """Bytes one rank puts on the wire per round, by stage."""
    bytes_per_rank_per_step: float
    link_bytes_per_round: float
    exchange: float
    """Seconds of a round's exchange on the link."""
    round_compute: float
    round: float
    """Seconds per round: its compute and the part of the exchange the overlap window does not hide."""
    step: float
    """Seconds per step: ``round`` / H."""
    hidden: bool
    """Whether the overlap window hides the whole exchange."""
    dense_bytes: int
    """Bytes of the largest outer shard in fp32."""


def link_bytes(sent_per_stage: list[float], tp: int, dp_in: int, mach: Machine) -> float:
    """Bytes through one cross-cluster link when each rank of stage k sends ``sent_per_stage[k]``:
    a shared link carries every rank's (TP x DP_in per stage), a link per rank the largest stage's."""
    if mach.inter_link == "shared" and mach.gpus_per_cluster > 1:
        return sum(sent_per_stage) * tp * dp_in
    return max(sent_per_stage)


def allreduce_cost(stage_numel: list[int], clusters: int, tp: int, dp_in: int, mach: Machine,
                   inner_step: float) -> AllReduceCost:
    """Per rank, its 1/DP_in piece of the fp32 gradient, all-reduced across clusters every step."""
    c = clusters
    per_stage = [2 * (c - 1) / c * 4 * n / dp_in for n in stage_numel]
    link = link_bytes(per_stage, tp, dp_in, mach)
    comm = link / gbps_to_bytes_per_s(mach.inter_bandwidth_gbps)
    return AllReduceCost(per_stage=per_stage, bytes_per_rank_per_step=max(per_stage), link_bytes_per_step=link,
                         comm=comm, step=inner_step + comm)


def shard_shapes(tensors: list[Tensor], shard_div: int) -> list[tuple[int, ...]]:
    """The shapes of a stage's outer shard, each tensor's first dimension split ``shard_div`` ways."""
    return [(math.ceil(t.shape[0] / shard_div), *t.shape[1:]) for t in tensors]


def dilocox_cost(outer_stages: list[list[Tensor]], shard_div: int, d: DiLoCoXConfig, comp: CompressionConfig,
                 tp: int, dp_in: int, mach: Machine, inner_step: float, outer_shard_params: int) -> DiLoCoXCost:
    """The payload of each stage's outer shard, on the wire once a round."""
    c = d.clusters
    shards = [shard_shapes(ts, shard_div) for ts in outer_stages]
    payload = [codec_bytes(shapes, comp) for shapes in shards]
    # Once, at the end (--dilocox-flush-residual): the residual int8, after its own handshake.
    flush = [0] * len(shards)
    if comp.flush_residual:
        flush = [codec_bytes(shapes, comp.flush_config()) + HANDSHAKE_BYTES for shapes in shards]
    on_wire = 2 * (c - 1) / c if comp.codec == "none" else c - 1  # ring all-reduce / all-gather
    sent = [on_wire * x for x in payload]
    link = link_bytes(sent, tp, dp_in, mach)
    exchange = link / gbps_to_bytes_per_s(mach.inter_bandwidth_gbps)
    h_steps = d.local_steps
    compute_round = h_steps * inner_step
    window = 0 if d.sync_mode == "sync" else min(d.landing or h_steps, h_steps) * inner_step
    rnd = compute_round + max(0.0, exchange - window)  # training waits for what the window does not hide
    return DiLoCoXCost(payload_per_stage=payload, payload_per_rank=max(payload), flush_per_stage=flush,
                       flush_per_rank=max(flush), sent_per_stage=sent,
                       bytes_per_rank_per_step=max(sent) / h_steps, link_bytes_per_round=link,
                       exchange=exchange, round_compute=compute_round, round=rnd, step=rnd / h_steps,
                       hidden=exchange <= window, dense_bytes=4 * outer_shard_params)
