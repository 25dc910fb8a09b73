"""Plan a run: parameters, per-GPU memory, step time, DiLoCoX vs AllReduce across slow links.

Pure arithmetic; formulas and assumptions in ``megatron_dilocox/planner/``. Examples::

    python tools/plan.py --num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 128 \\
        --vocab-size 4096 --pipeline-model-parallel-size 2 --micro-batch-size 4 --global-batch-size 16 \\
        --dilocox-clusters 2 --gpus-per-cluster 2
    python tools/plan.py --preset paper-107b
    python tools/plan.py --vocab-size 32000 --gpus-per-cluster 64 --check-fits -- <pretrain_gpt.py flags>

After ``--``, the flags of a ``pretrain_gpt.py`` launch (parsed by its own parser) fill in every
model, layout and DiLoCoX figure not given before ``--``; the launch scripts in examples/ plan
exactly what they launch that way.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_dilocox import flags  # noqa: E402
from megatron_dilocox.config import CompressionConfig, DiLoCoXConfig  # noqa: E402
from megatron_dilocox.run_config import ModelConfig, ParallelConfig, TrainingConfig  # noqa: E402
from megatron_dilocox.planner import Layout, Machine, ModelShape, plan  # noqa: E402
from megatron_dilocox.planner.report import report  # noqa: E402

PLANNED_OUTER = ("clusters", "local_steps", "sync_mode", "overlap_steps", "offload_outer_state")
PLANNED_COMPRESSION = ("codec", "bits", "block", "topk_density", "topk_chunk", "rank", "error_feedback",
                       "keep_unsent")
"""The DiLoCoX and compression settings the plan depends on (their pretrain_gpt.py flags)."""
PLANNED_DEFAULTS = {**flags.defaults(DiLoCoXConfig, "dilocox", PLANNED_OUTER),
                    **flags.defaults(CompressionConfig, "dilocox", PLANNED_COMPRESSION)}
"""Their values when neither the command line, a preset nor a launch gives them, by flag dest."""

PAPER_RATIO = 357.0
"""DiLoCoX paper (arXiv 2506.21263): 107B over 1 Gbps, 357x faster than vanilla AllReduce."""

# A ~107B GPT (our choice: the paper's exact shape is not available to us). 84 layers x
# (12 h^2 + 13 h) + untied 51,200 x 10,240 embeddings = 106.8B parameters. Machine and layout
# are assumptions: 2 clusters of 16 nodes x 8 GPUs (80 GiB, 150 achievable TFLOP/s, e.g. A800
# at ~48% of its 312 peak), 400 Gbps per GPU inside a cluster (1,600 Gbps NVLink for TP, the
# A800's 400 GB/s both ways), 1 Gbps between the clusters;
# TP8 x PP4 x DP_in 4 with the distributed optimizer, full recompute, outer state offloaded.
PRESETS = {
    "paper-107b": dict(
        num_layers=84, hidden_size=10240, num_attention_heads=80, ffn_hidden_size=40960,
        seq_length=2048, vocab_size=50257, untie_embeddings_and_output_weights=True,
        tensor_model_parallel_size=8, pipeline_model_parallel_size=4, micro_batch_size=1,
        global_batch_size=1024, use_distributed_optimizer=True, bf16=True, recompute_granularity="full",
        dilocox_clusters=2, dilocox_local_steps=125, dilocox_sync_mode="delay", dilocox_overlap_steps=125,
        dilocox_compression="lowrank-quantize",
        dilocox_quant_bits=8, dilocox_rank=8, gpu_memory_gib=80, gpu_tflops=150, gpus_per_cluster=128,
        intra_bandwidth_gbps=400, tp_bandwidth_gbps=1600, inter_bandwidth_gbps=1, dilocox_offload_outer_state=True,
    ),
}


class _HelpFormatter(argparse.HelpFormatter):
    """Appends the value a flag takes when neither it, --preset nor launch flags give one (DEFAULTS)."""

    def _get_help_string(self, action):
        default = DEFAULTS.get(action.dest)
        if default is None or action.nargs == 0 or "default" in (action.help or ""):
            return action.help
        return f"{action.help} (default: {default})"


# The launch flags the planner reads (stated once, in megatron_dilocox/run_config.py).
PLANNED_MODEL = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                 "seq_length", "max_position_embeddings", "position_embedding_type", "normalization",
                 "make_vocab_size_divisible_by", "swiglu", "disable_bias_linear", "untie_embeddings_and_output_weights")
PLANNED_PARALLEL = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "use_distributed_optimizer")
PLANNED_TRAINING = ("micro_batch_size", "global_batch_size", "bf16", "recompute_granularity")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=_HelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), help="Fill every flag from a preset "
                    "(flags given on the command line still win).")
    g = ap.add_argument_group("model")
    flags.add_flags(g, ModelConfig, None, names=PLANNED_MODEL, unset=True)
    g.add_argument("--vocab-size", type=int, help="Tokenizer vocabulary (before padding).")
    g = ap.add_argument_group("parallelism and training", "--recompute-granularity full is modelled as +33%% "
                              "compute (layer inputs kept only), selective as no recomputation.")
    flags.add_flags(g, ParallelConfig, None, names=PLANNED_PARALLEL, unset=True)
    flags.add_flags(g, TrainingConfig, None, names=PLANNED_TRAINING, unset=True)
    g = ap.add_argument_group("DiLoCoX")
    flags.add_flags(g, DiLoCoXConfig, "dilocox", names=PLANNED_OUTER, unset=True)
    flags.add_flags(g, CompressionConfig, "dilocox", names=PLANNED_COMPRESSION, unset=True)
    g = ap.add_argument_group("machine")
    g.add_argument("--gpu-memory-gib", type=float, help="Memory per GPU.")
    g.add_argument("--gpu-tflops", type=float, help="Achievable dense bf16 TFLOP/s per GPU.")
    g.add_argument("--gpus-per-cluster", type=int, help="GPUs (ranks) per cluster (default: TP x PP).")
    g.add_argument("--intra-bandwidth-gbps", type=float, help="Per-GPU bandwidth inside a cluster.")
    g.add_argument("--tp-bandwidth-gbps", type=float, help="Per-GPU bandwidth of tensor-parallel all-reduces.")
    g.add_argument("--inter-bandwidth-gbps", type=float, help="Link between clusters.")
    g.add_argument("--inter-link", choices=["shared", "per-rank"],
                   help="shared (default): one link for all ranks of a cluster; per-rank: one each.")
    g.add_argument("--cpu-cores", type=int, help="CPU mode: every rank is a process on one machine with this "
                   "many cores (the calibration runs); --gpus-per-cluster then counts processes.")
    g.add_argument("--cpu-gflops", type=float, nargs=2, metavar=("ONE_THREAD", "ALL_THREADS"),
                   help="CPU mode: measured matmul GFLOP/s of one process (tools/calibrate_planner.py "
                   "prints them).")
    g.add_argument("--cpu-elementwise-ns", type=float,
                   help="CPU mode: ns of non-matmul work per token, hidden unit and layer at one thread, "
                   "done by every TP rank (default 0; tools/calibrate_planner.py fits it).")
    ap.add_argument("--check-fits", action="store_true",
                    help="Exit with status 3 when the memory per GPU exceeds --gpu-memory-gib.")
    return ap


DEFAULTS = dict(
    tensor_model_parallel_size=1, pipeline_model_parallel_size=1, micro_batch_size=1,
    position_embedding_type="learned_absolute", normalization="LayerNorm", make_vocab_size_divisible_by=128,
    swiglu=False, disable_bias_linear=False, untie_embeddings_and_output_weights=False,
    use_distributed_optimizer=False, bf16=False,
    **PLANNED_DEFAULTS,
    gpu_memory_gib=80.0, gpu_tflops=400.0, intra_bandwidth_gbps=400.0, tp_bandwidth_gbps=3600.0,
    inter_bandwidth_gbps=1.0, inter_link="shared", cpu_cores=0, cpu_gflops=(0.0, 0.0), cpu_elementwise_ns=0.0,
)
LAUNCH_KEYS = (
    "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "seq_length",
    "max_position_embeddings", "position_embedding_type", "normalization", "vocab_size",
    "make_vocab_size_divisible_by", "swiglu", "disable_bias_linear", "untie_embeddings_and_output_weights",
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "micro_batch_size", "global_batch_size",
    "use_distributed_optimizer", "bf16", "recompute_granularity",
    *PLANNED_DEFAULTS,
)
"""What a pretrain_gpt.py launch decides for the plan (same flag names on both sides)."""


def launch_values(launch_argv: list[str]) -> dict:
    """The plan's figures from pretrain_gpt.py flags, read by pretrain_gpt.py's own parser.

    Flags that parser does not know are named in a warning (pretrain_gpt.py itself would refuse
    them); a launch without ``--dilocox`` and ``--dilocox-clusters`` is one cluster.
    """
    from megatron_dilocox.arguments import build_parser as pretrain_parser

    ns, unknown = pretrain_parser().parse_known_args(launch_argv)
    unknown_flags = [x for x in unknown if x.startswith("--")]
    if unknown_flags:
        print(f"tools/plan.py: warning: pretrain_gpt.py does not know {' '.join(unknown_flags)}", file=sys.stderr)
    values = {k: getattr(ns, k) for k in LAUNCH_KEYS if getattr(ns, k, None) is not None}
    if ns.dilocox_clusters is None:
        values["dilocox_clusters"] = DiLoCoXConfig.clusters if ns.dilocox else 1
    return values


def resolve(argv=None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    launch = argv[argv.index("--") + 1:] if "--" in argv else None
    ap = build_parser()
    args = ap.parse_args(argv[:argv.index("--")] if launch is not None else argv)
    if launch is not None and args.preset:
        ap.error("--preset and pretrain_gpt.py flags after -- are exclusive")
    base = dict(DEFAULTS, **(PRESETS[args.preset] if args.preset else {}),
                **(launch_values(launch) if launch is not None else {}))
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
    outer = flags.from_args(DiLoCoXConfig, args, "dilocox", PLANNED_OUTER)
    compression = flags.from_args(CompressionConfig, args, "dilocox", PLANNED_COMPRESSION)
    machine = Machine(gpu_memory_gib=args.gpu_memory_gib, gpu_tflops=args.gpu_tflops,
                      gpus_per_cluster=args.gpus_per_cluster, intra_bandwidth_gbps=args.intra_bandwidth_gbps,
                      tp_bandwidth_gbps=args.tp_bandwidth_gbps, inter_bandwidth_gbps=args.inter_bandwidth_gbps,
                      inter_link=args.inter_link, cpu_cores=args.cpu_cores,
                      cpu_gflops_1thread=args.cpu_gflops[0], cpu_gflops_all_threads=args.cpu_gflops[1],
                      cpu_elementwise_ns=args.cpu_elementwise_ns)
    return model, layout, outer, compression, machine


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
    if args.check_fits and not p.fits:
        print(f"error: {p.memory.gpu_total / 2**30:,.2f} GiB per GPU does not fit --gpu-memory-gib "
              f"{args.gpu_memory_gib:g}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
