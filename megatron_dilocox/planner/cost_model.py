"""The plan of a launch: the cluster's layout checked and divided, then its memory, step time and
cross-cluster costs; throughput ratio = (H * AllReduce step) / DiLoCoX round time, at equal tokens."""
from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_dilocox.config import CompressionConfig, DiLoCoXConfig
from megatron_dilocox.planner.exchange import AllReduceCost, DiLoCoXCost, allreduce_cost, dilocox_cost
from megatron_dilocox.planner.layout import GIB, Layout, Machine
from megatron_dilocox.planner.memory import OUTER_BYTES_PER_PARAM, Memory, memory_per_gpu
from megatron_dilocox.planner.shapes import ModelShape, outer_tensors, param_count, stage_tensors
from megatron_dilocox.planner.step_time import StepTime, step_time


@dataclass(frozen=True)
class Plan:
    """What one launch holds per GPU and costs per step, by method."""

    params: int
    params_per_rank: int
    """Of the largest pipeline stage."""
    outer_shard_params: int
    """The largest outer shard (the distributed optimizer's share of a stage's outer tensors)."""
    dp_in: int
    num_microbatches: int
    memory: Memory
    fits: bool
    """Whether ``memory``'s GPU part fits the machine's GPU memory."""
    step: StepTime
    allreduce: AllReduceCost
    dilocox: DiLoCoXCost
    ratio: float
    """Throughput of DiLoCoX over that of AllReduce."""


def plan(m: ModelShape, lay: Layout, d: DiLoCoXConfig, comp: CompressionConfig, mach: Machine) -> Plan:
    """The plan of a model, layout, DiLoCoX and compression settings (pretrain_gpt.py's configs) and machine."""
    tp, pp, c = lay.tp, lay.pp, d.clusters
    if mach.gpus_per_cluster % (tp * pp):
        raise ValueError(f"--gpus-per-cluster {mach.gpus_per_cluster} not divisible by TP x PP = {tp * pp}")
    if d.sync_mode not in OUTER_BYTES_PER_PARAM:
        raise ValueError(f"--dilocox-sync-mode {d.sync_mode!r}: expected one of {sorted(OUTER_BYTES_PER_PARAM)}")
    dp_in = mach.gpus_per_cluster // (tp * pp)
    per_step = lay.micro_batch_size * dp_in * c
    if lay.global_batch_size % per_step:
        raise ValueError(f"--global-batch-size {lay.global_batch_size} not divisible by micro batch x "
                         f"DP_in x clusters = {per_step}")
    nmb = lay.global_batch_size // per_step

    stage_numel = [sum(t.numel for t in stage_tensors(m, tp, pp, k)) for k in range(pp)]
    n_rank = max(stage_numel)
    outer_stages = [outer_tensors(m, tp, pp, k) for k in range(pp)]
    shard_div = dp_in if lay.use_distributed_optimizer else 1
    n_outer = max(sum(t.numel for t in ts) for ts in outer_stages) / shard_div
    memory = memory_per_gpu(m, lay, d, comp, dp_in, nmb, n_rank, n_outer)
    step = step_time(m, lay, mach, c, dp_in, nmb, n_rank)
    allreduce = allreduce_cost(stage_numel, c, tp, dp_in, mach, step.total)
    dilocox = dilocox_cost(outer_stages, shard_div, d, comp, tp, dp_in, mach, step.total, math.ceil(n_outer))
    return Plan(params=param_count(m, tp), params_per_rank=n_rank, outer_shard_params=math.ceil(n_outer),
                dp_in=dp_in, num_microbatches=nmb, memory=memory,
                fits=memory.gpu_total <= mach.gpu_memory_gib * GIB, step=step, allreduce=allreduce,
                dilocox=dilocox, ratio=d.local_steps * allreduce.step / dilocox.round)
