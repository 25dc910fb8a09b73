"""The plan as text, one figure a line (what tools/plan.py prints)."""
from __future__ import annotations

from megatron_dilocox.config import CompressionConfig, DiLoCoXConfig
from megatron_dilocox.planner.cost_model import Plan
from megatron_dilocox.planner.layout import GIB, Layout, Machine
from megatron_dilocox.planner.shapes import ModelShape, padded_vocab


def _fmt_bytes(x: float) -> str:
    for unit, div in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if x >= div:
            return f"{x / div:,.2f} {unit}"
    return f"{x:,.0f} B"


def _fmt_s(x: float) -> str:
    return f"{x * 1e3:,.1f} ms" if x < 1 else f"{x:,.2f} s"


def report(p: Plan, m: ModelShape, lay: Layout, d: DiLoCoXConfig, comp: CompressionConfig, mach: Machine) -> str:
    """The plan as text, one figure a line."""
    L = [
        f"parameters: {p.params:,} ({p.params / 1e9:.3f} B); padded vocab "
        f"{padded_vocab(m.vocab_size, m.make_vocab_size_divisible_by, lay.tp):,}",
        f"layout: {d.clusters} clusters x (TP {lay.tp} x PP {lay.pp} x DP_in {p.dp_in}) = "
        f"{d.clusters * mach.gpus_per_cluster} {'CPU processes' if mach.cpu_cores else 'GPUs'}; {p.num_microbatches} micro-batches per step",
        f"parameters per GPU (largest stage): {p.params_per_rank:,}; outer shard {p.outer_shard_params:,}",
        "memory per GPU:",
    ]
    L += [f"  {k:<16} {_fmt_bytes(v):>14}" for k, v in p.memory.on_gpu().items()]
    L += [f"  {'total':<16} {_fmt_bytes(p.memory.gpu_total):>14} of {mach.gpu_memory_gib:g} GiB: "
          f"{'fits' if p.fits else 'DOES NOT FIT'} (no allowance for context/fragmentation)"]
    if p.memory.host_outer_state:
        L += [f"host memory per GPU (pinned, --dilocox-offload-outer-state): outer_state "
              f"{_fmt_bytes(p.memory.host_outer_state)}"]
    s = p.step
    L += [
        f"step: matmul {_fmt_s(s.matmul)}"
        + (f" + element-wise {_fmt_s(s.elementwise)}" if mach.cpu_cores else "")
        + f" + TP all-reduce {_fmt_s(s.tp_comm)} + pipeline p2p "
        f"{_fmt_s(s.p2p)}, bubble {s.bubble_factor:.3f} -> {_fmt_s(s.pipeline)}"
        + (f", cores bound {_fmt_s(s.cores_bound)}" if mach.cpu_cores else "")
        + f"; + intra-cluster all-reduce {_fmt_s(s.intra_allreduce)} = {_fmt_s(s.total)} "
        f"({s.tokens_per_step:,.0f} tokens)",
        f"AllReduce baseline: {_fmt_bytes(p.allreduce.bytes_per_rank_per_step)} per rank per step across "
        f"clusters, link time {_fmt_s(p.allreduce.comm)} -> step {_fmt_s(p.allreduce.step)}",
        f"DiLoCoX ({comp.codec}, {comp.bits}-bit, "
        f"{f'density {comp.topk_density:g}' if comp.codec == 'topk' else f'rank {comp.rank}'}, "
        f"H {d.local_steps}, {d.sync_mode}{f', lands after {d.landing}' if d.landing else ''}): "
        f"payload {p.dilocox.payload_per_rank:,} B per rank per round "
        f"(dense fp32 {p.dilocox.dense_bytes:,} B), {_fmt_bytes(p.dilocox.bytes_per_rank_per_step)} "
        f"per rank per step"
        + (f"; final flush {p.dilocox.flush_per_rank:,} B per rank, once" if comp.flush_residual else ""),
        f"  exchange {_fmt_s(p.dilocox.exchange)} vs round compute {_fmt_s(p.dilocox.round_compute)}"
        f"{f' (overlap window {min(d.landing, d.local_steps)} steps)' if d.landing else ''}"
        f" ({'hidden' if p.dilocox.hidden else 'NOT hidden'}) -> round {_fmt_s(p.dilocox.round)}",
        f"throughput DiLoCoX / AllReduce: {p.ratio:,.1f}x",
    ]
    return "\n".join(L)
