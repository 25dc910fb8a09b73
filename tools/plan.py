"""Plan a run: parameters, per-GPU memory, step time, DiLoCoX vs AllReduce across slow links.

Pure arithmetic; formulas and assumptions in ``megatron_dilocox/planner.py``. Examples::

    python tools/plan.py --num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 128 \\
        --vocab-size 4096 --pipeline-model-parallel-size 2 --micro-batch-size 4 --global-batch-size 16 \\
        --dilocox-clusters 2 --gpus-per-cluster 2
    python tools/plan.py --preset paper-107b
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_dilocox.planner import DiLoCoXSettings, Layout, Machine, ModelShape, plan, report  # noqa: E402

PAPER_RATIO = 357.0
"""DiLoCoX paper (arXiv 2506.21263): 107B over 1 Gbps, 357x faster than vanilla AllReduce."""

# A ~107B GPT (our choice: the paper's exact shape is not available to us). 84 layers x
# (12 h^2 + 13 h) + untied 51,200 x 10,240 embeddings = 106.8B parameters. Machine and layout
# are assumptions: 2 clusters of 16 nodes x 8 GPUs (80 GiB, 150 achievable TFLOP/s, e.g. A800
# at ~48% of its 312 peak), 400 Gbps per GPU inside a cluster, 1 Gbps between the clusters;
# TP8 x PP4 x DP_in 4 with the distributed optimizer, full recompute, outer state offloaded.
PRESETS = {
    "paper-107b": dict(
        num_layers=84, hidden_size=10240, num_attention_heads=80, ffn_hidden_size=40960,
        seq_length=2048, vocab_size=50257, untie_embeddings_and_output_weights=True,
        tensor_model_parallel_size=8, pipeline_model_parallel_size=4, micro_batch_size=1,
        global_batch_size=1024, use_distributed_optimizer=True, bf16=True, recompute_granularity="full",
        dilocox_clusters=2, dilocox_local_steps=125, dilocox_compression="lowrank-quantize",
        dilocox_quant_bits=8, dilocox_rank=8, gpu_memory_gib=80, gpu_tflops=150, gpus_per_cluster=128,
        intra_bandwidth_gbps=400, inter_bandwidth_gbps=1, dilocox_offload_outer_state=True,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), help="Fill every flag from a preset "
                    "(flags given on the command line still win).")
    g = ap.add_argument_group("model")
    g.add_argument("--num-layers", type=int)
    g.add_argument("--hidden-size", type=int)
    g.add_argument("--num-attention-heads", type=int)
    g.add_argument("--num-query-groups", type=int)
    g.add_argument("--ffn-hidden-size", type=int, help="Default 4 x hidden size.")
    g.add_argument("--seq-length", type=int)
    g.add_argument("--max-position-embeddings", type=int)
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"])
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"])
    g.add_argument("--vocab-size", type=int)
    g.add_argument("--make-vocab-size-divisible-by", type=int)
    g.add_argument("--swiglu", action="store_true", default=None)
    g.add_argument("--disable-bias-linear", action="store_true", default=None)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true", default=None)
    g = ap.add_argument_group("parallelism and training")
    g.add_argument("--tensor-model-parallel-size", type=int)
    g.add_argument("--pipeline-model-parallel-size", type=int)
    g.add_argument("--micro-batch-size", type=int)
    g.add_argument("--global-batch-size", type=int, help="Samples per step over all clusters.")
    g.add_argument("--use-distributed-optimizer", action="store_true", default=None)
    g.add_argument("--bf16", action="store_true", default=None)
    g.add_argument("--recompute-granularity", choices=["full", "selective"],
                   help="'full' keeps layer inputs only (+33%% compute); 'selective' is modelled as none.")
    g = ap.add_argument_group("DiLoCoX")
    g.add_argument("--dilocox-clusters", type=int)
    g.add_argument("--dilocox-local-steps", type=int)
    g.add_argument("--dilocox-compression", choices=["none", "quantize", "lowrank", "lowrank-quantize"])
    g.add_argument("--dilocox-quant-bits", type=int, choices=[8, 4])
    g.add_argument("--dilocox-quant-block", type=int)
    g.add_argument("--dilocox-rank", type=int)
    g.add_argument("--dilocox-sync-mode", choices=["delay", "sync"])
    g.add_argument("--dilocox-offload-outer-state", action="store_true", default=None)
    g = ap.add_argument_group("machine")
    g.add_argument("--gpu-memory-gib", type=float)
    g.add_argument("--gpu-tflops", type=float, help="Achievable dense bf16 TFLOP/s per GPU.")
    g.add_argument("--gpus-per-cluster", type=int)
    g.add_argument("--intra-bandwidth-gbps", type=float, help="Per-GPU bandwidth inside a cluster.")
    g.add_argument("--inter-bandwidth-gbps", type=float, help="Link between clusters.")
    g.add_argument("--inter-link", choices=["shared", "per-rank"],
                   help="shared (default): one link for all ranks of a cluster; per-rank: one each.")
    return ap


DEFAULTS = dict(
    tensor_model_parallel_size=1, pipeline_model_parallel_size=1, micro_batch_size=1,
    position_embedding_type="learned_absolute", normalization="LayerNorm", make_vocab_size_divisible_by=128,
    swiglu=False, disable_bias_linear=False, untie_embeddings_and_output_weights=False,
    use_distributed_optimizer=False, bf16=False, dilocox_clusters=2, dilocox_local_steps=20,
    dilocox_compression="lowrank-quantize", dilocox_quant_bits=8, dilocox_quant_block=256, dilocox_rank=8,
    dilocox_sync_mode="delay", dilocox_offload_outer_state=False, gpu_memory_gib=80.0, gpu_tflops=400.0,
    intra_bandwidth_gbps=400.0, inter_bandwidth_gbps=1.0, inter_link="shared",
)


def resolve(argv=None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    base = dict(DEFAULTS, **(PRESETS[args.preset] if args.preset else {}))
    for k, v in base.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    missing = [f"--{k.replace('_', '-')}" for k in ("num_layers", "hidden_size", "num_attention_heads",
                                                    "seq_length", "vocab_size") if getattr(args, k) is None]
    if missing:
        ap.error(f"missing {', '.join(missing)} (or give --preset)")
    if args.gpus_per_cluster is None:
        args.gpus_per_cluster = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.gpus_per_cluster // (
            args.tensor_model_parallel_size * args.pipeline_model_parallel_size) * args.dilocox_clusters
    return args


def configs(args):
    model = ModelShape(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        vocab_size=args.vocab_size, seq_length=args.seq_length, ffn_hidden_size=args.ffn_hidden_size,
        num_query_groups=args.num_query_groups, max_position_embeddings=args.max_position_embeddings,
        position_embedding_type=args.position_embedding_type, swiglu=args.swiglu,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        disable_bias_linear=args.disable_bias_linear, normalization=args.normalization,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
    )
    layout = Layout(tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
                    micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
                    use_distributed_optimizer=args.use_distributed_optimizer, bf16=args.bf16,
                    recompute_full=args.recompute_granularity == "full")
    dl = DiLoCoXSettings(clusters=args.dilocox_clusters, local_steps=args.dilocox_local_steps,
                         compression=args.dilocox_compression, quant_bits=args.dilocox_quant_bits,
                         rank=args.dilocox_rank, block=args.dilocox_quant_block, sync_mode=args.dilocox_sync_mode,
                         offload_outer_state=args.dilocox_offload_outer_state)
    machine = Machine(gpu_memory_gib=args.gpu_memory_gib, gpu_tflops=args.gpu_tflops,
                      gpus_per_cluster=args.gpus_per_cluster, intra_bandwidth_gbps=args.intra_bandwidth_gbps,
                      inter_bandwidth_gbps=args.inter_bandwidth_gbps, inter_link=args.inter_link)
    return model, layout, dl, machine


def main(argv=None) -> int:
    args = resolve(argv)
    try:
        cfg = configs(args)
        p = plan(*cfg)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report(p, *cfg))
    if args.preset == "paper-107b":
        print(f"paper reports: {PAPER_RATIO:g}x (predicted above: {p.ratio:,.1f}x; constants not tuned to it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
