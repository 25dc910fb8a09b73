"""Memory per GPU: the largest pipeline stage's weights, gradients, optimizer states and activations.

No allowance for the CUDA context, allocator fragmentation, NCCL buffers or logits, so keep some
headroom:

* weights: 2 bytes/param with ``--bf16``, else 4;
* grads: 4 bytes/param (fp32 main-grad buffer of megatron DDP);
* inner AdamW: 12 bytes/param with bf16 (fp32 main param + 2 moments), 8 without; divided by
  DP_in with ``--use-distributed-optimizer``;
* outer DiLoCoX state: ``OUTER_BYTES_PER_PARAM`` (20 bytes/param in delay mode, 16 in sync, +4
  with error feedback, +4 more in sync with keep-unsent; see there) of the rank's outer shard (the
  distributed optimizer's shard, i.e. / DP_in, when it is used); with
  ``--dilocox-offload-outer-state`` it moves from the GPU to pinned host memory
  (``Memory.host_outer_state``, per GPU: multiply by GPUs per node for a node);
* activations (Korthikanti et al. 2022, 16-bit, no sequence parallel), per layer and
  micro-batch: ``s b h (10 + 24 / t + 5 a s / (h t))`` bytes, which is ``s b h (34 + 5 a s / h)``
  at t = 1; times the layers of a stage and the micro-batches in flight on the first stage with
  1F1B, ``min(PP, m)``. With full recompute only the layer inputs ``2 s b h`` are kept per layer
  and micro-batch, plus one layer's full activations for the recompute itself. Without ``--bf16``
  activations are doubled.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from megatron_dilocox.config import CompressionConfig, DiLoCoXConfig
from megatron_dilocox.planner.layout import Layout
from megatron_dilocox.planner.shapes import ModelShape

OUTER_BYTES_PER_PARAM = {"delay": 20, "eager": 20, "sync": 16}
"""Peak outer-state bytes per parameter of the outer shard, as ``outer/sync.py`` holds it: fp32
base and Nesterov momentum (8); in delay modes the round start (4) and the pseudo-gradient in
flight (4) live through the round, and at a boundary the new pseudo-gradient (4) meets the
previous round's average (4 of the 8 already counted) - 20 at peak, 16 between boundaries; in
sync mode the pseudo-gradient and its average exist only at the boundary (8 + 8). Error feedback
adds its fp32 residual (4), and ``keep_unsent`` in sync mode a round start (4). Codec buffers
(factors, payloads) are not counted."""


@dataclass(frozen=True)
class Memory:
    """Bytes per GPU of the largest pipeline stage."""

    weights: float
    grads: float
    inner_optimizer: float
    outer_state: float
    """On the GPU: 0 when offloaded."""
    activations: float
    host_outer_state: float
    """In pinned host memory per GPU (``--dilocox-offload-outer-state``), else 0."""

    def on_gpu(self) -> dict[str, float]:
        """The parts held on the GPU, by name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "host_outer_state"}

    @property
    def gpu_total(self) -> float:
        return sum(self.on_gpu().values())


def activation_bytes(m: ModelShape, lay: Layout) -> tuple[float, float, int]:
    """(full activations of one layer, kept layer input, layers per stage), per micro-batch."""
    s, b, h, a, t = m.seq_length, lay.micro_batch_size, m.hidden_size, m.num_attention_heads, lay.tp
    full_layer = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    per_stage = m.num_layers // lay.pp
    scale = 1 if lay.bf16 else 2
    return scale * full_layer, scale * 2 * s * b * h, per_stage


def memory_per_gpu(m: ModelShape, lay: Layout, d: DiLoCoXConfig, comp: CompressionConfig, dp_in: int,
                   num_microbatches: int, params_per_rank: int, outer_shard_params: float) -> Memory:
    """The memory of one GPU holding ``params_per_rank`` parameters and an outer shard of
    ``outer_shard_params`` (no outer state with one cluster)."""
    full_layer, inputs, per_stage = activation_bytes(m, lay)
    in_flight = min(lay.pp, num_microbatches)
    if lay.recompute_full:
        act = inputs * per_stage * in_flight + full_layer
    else:
        act = full_layer * per_stage * in_flight
    n_rank = params_per_rank
    adam = (12 if lay.bf16 else 8) * n_rank / (dp_in if lay.use_distributed_optimizer else 1)
    own_start = d.sync_mode == "sync" and comp.keep_unsent  # sync keeps no round start of its own otherwise
    outer = 0.0
    if d.clusters > 1:
        outer = (OUTER_BYTES_PER_PARAM[d.sync_mode] + 4 * comp.error_feedback + 4 * own_start) * outer_shard_params
    return Memory(weights=(2 if lay.bf16 else 4) * n_rank, grads=4 * n_rank, inner_optimizer=adam,
                  outer_state=0.0 if d.offload_outer_state else outer, activations=act,
                  host_outer_state=outer if d.offload_outer_state else 0.0)
