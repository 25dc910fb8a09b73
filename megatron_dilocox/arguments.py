"""Command-line flags, named and meaning what they do in Megatron-LM.

:func:`parse_args` builds the parser, parses, and checks everything that can be
checked before the process group exists; :func:`validate_world` checks the
layout against the world size. Every user error is a
:class:`~megatron_dilocox.errors.ConfigError` whose message names the flag.
"""

import argparse
import math
import os

from megatron_dilocox import flags
from megatron_dilocox.config import CompressionConfig, DiLoCoXConfig, ExchangeConfig
from megatron_dilocox.errors import ConfigError


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends each flag's default to its help, unless the help already says it or there is none
    to show (no default, an on/off switch)."""

    def _get_help_string(self, action):
        if action.default is None or action.nargs == 0 or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _model_args(parser):
    g = parser.add_argument_group("model")
    g.add_argument("--num-layers", type=int, required=True, help="Number of transformer layers.")
    g.add_argument("--hidden-size", type=int, required=True, help="Transformer hidden size.")
    g.add_argument("--num-attention-heads", type=int, required=True, help="Number of attention heads.")
    g.add_argument("--num-query-groups", type=int, default=None,
                   help="Key/value head groups for grouped-query attention (default: one per head).")
    g.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="MLP hidden size (default: 4 x hidden size).")
    g.add_argument("--seq-length", type=int, required=True, help="Sequence length of a training sample.")
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="Size of the learned position table (default: --seq-length).")
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"],
                   default="learned_absolute", help="Position embedding type.")
    g.add_argument("--rotary-base", type=int, default=10000, help="RoPE base.")
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm",
                   help="Normalization layer.")
    g.add_argument("--swiglu", action="store_true", help="Gated SiLU MLP (SwiGLU).")
    g.add_argument("--disable-bias-linear", action="store_true", help="No biases in linear layers.")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="Separate output layer instead of reusing the input embedding.")
    g.add_argument("--init-method-std", type=float, default=0.02,
                   help="Std of the normal weight init (output projections are scaled by 1/sqrt(2L)).")
    g.add_argument("--hidden-dropout", type=float, default=0.1, help="Dropout after attention and MLP.")
    g.add_argument("--attention-dropout", type=float, default=0.1, help="Dropout on attention probabilities.")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="Pad the vocabulary to a multiple of this (and of the TP size).")


def _parallel_args(parser):
    g = parser.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1, help="Tensor-parallel size.")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="Pipeline-parallel size.")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="Layers per virtual stage: enables the interleaved 1F1B schedule.")
    g.add_argument("--no-overlap-p2p-communication", action="store_false", dest="overlap_p2p_comm",
                   help="Interleaved schedule: batch pipeline sends/receives instead of overlapping them.")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="Shard LayerNorm/dropout activations along the sequence (needs TP > 1).")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="Shard optimizer state over data-parallel ranks (ZeRO-1).")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None,
                   help="Process-group backend (default: nccl with CUDA, gloo without).")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10,
                   help="Timeout of intra-cluster collectives.")


def _training_args(parser):
    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, required=True, help="Samples per micro-batch per rank.")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="Samples per optimizer step over all data-parallel ranks "
                        "(default: micro batch x data-parallel size).")
    g.add_argument("--train-iters", type=int, required=True, help="Optimizer steps to train.")
    g.add_argument("--lr", type=float, required=True, help="Peak learning rate.")
    g.add_argument("--min-lr", type=float, default=0.0, help="Learning rate floor after decay.")
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root"],
                   default="linear", help="Learning-rate decay.")
    g.add_argument("--lr-decay-iters", type=int, default=None,
                   help="Iterations to decay over (default: --train-iters).")
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="Linear warmup iterations.")
    g.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay.")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="AdamW beta1.")
    g.add_argument("--adam-beta2", type=float, default=0.999, help="AdamW beta2.")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="AdamW epsilon.")
    g.add_argument("--clip-grad", type=float, default=1.0, help="Gradient clipping by global norm (0: off).")
    g.add_argument("--bf16", action="store_true", help="bf16 weights and compute, fp32 main params.")
    g.add_argument("--seed", type=int, default=1234, help="Random seed (init, data order, dropout).")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None,
                   help="Activation recomputation.")
    g.add_argument("--recompute-method", choices=["uniform", "block"], default="uniform",
                   help="How full recomputation groups layers.")
    g.add_argument("--recompute-num-layers", type=int, default=1,
                   help="Layers per recomputation group (full recomputation).")


def _data_args(parser):
    g = parser.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="Dataset prefix(es) of .bin/.idx files, optionally weighted: 'w1 p1 w2 p2'.")
    g.add_argument("--split", default="969,30,1", help="Train,valid,test split of each dataset.")
    g.add_argument("--mock-data", action="store_true", help="Synthetic tokens instead of --data-path.")
    g.add_argument("--tokenizer-type", choices=["SentencePieceTokenizer", "NullTokenizer"],
                   default="SentencePieceTokenizer", help="Tokenizer type.")
    g.add_argument("--tokenizer-model", default=None, help="SentencePiece model file.")
    g.add_argument("--vocab-size", type=int, default=None, help="Vocabulary size for NullTokenizer.")
    g.add_argument("--data-cache-path", default=None,
                   help="Where dataset index caches go (default: next to the data).")


def _logging_args(parser):
    g = parser.add_argument_group("evaluation and logging")
    g.add_argument("--eval-interval", type=int, default=1000, help="Evaluate every N iterations.")
    g.add_argument("--eval-iters", type=int, default=100, help="Validation batches per evaluation.")
    g.add_argument("--full-validation", action="store_true",
                   help="Every evaluation runs over the whole validation split, the same batches each time "
                        "(one epoch; --eval-iters is ignored), so evaluations are comparable across runs.")
    g.add_argument("--log-interval", type=int, default=100, help="Log every N iterations.")
    g.add_argument("--tensorboard-dir", default=None, help="Write TensorBoard scalars here.")
    g.add_argument("--wandb-project", default=None, help="Log to this Weights & Biases project.")
    g.add_argument("--wandb-exp-name", default=None, help="Weights & Biases run name.")
    g.add_argument("--wandb-save-dir", default=None, help="Weights & Biases local directory.")
    g.add_argument("--metrics-file", default=None,
                   help="Append JSON lines here: one per log interval and one per evaluation.")


def _checkpoint_args(parser):
    g = parser.add_argument_group(
        "checkpointing", "Megatron layout: SAVE_DIR/iter_XXXXXXX/ folders and latest_checkpointed_iteration.txt.")
    g.add_argument("--save", default=None, help="Directory to save checkpoints to.")
    g.add_argument("--save-interval", type=int, default=None,
                   help="Save every N iterations (and always at the end of training with --save).")
    g.add_argument("--load", default=None,
                   help="Resume from the latest checkpoint in this directory: exactly with the same layout, "
                        "from the (resharded) weights with another TP/PP/cluster layout. A directory "
                        "with no checkpoint yet: start from scratch, with a warning.")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="Stop after the first iteration divisible by N, saving a checkpoint with --save.")
    g.add_argument("--most-recent-k", type=int, default=-1,
                   help="Keep only the K most recent checkpoints (highest iterations) in --save, deleting "
                        "older ones once a new save is complete; never the one the tracker points at. "
                        "-1 keeps all. (Megatron-LM's name, from its checkpoint config; its "
                        "--save-retain-interval keeps every N-th iteration instead.)")


def _dilocox_args(parser):
    g = parser.add_argument_group(
        "DiLoCoX", "Train C clusters apart and exchange a pseudo-gradient every H steps "
                   "instead of reducing gradients across clusters every step.")
    g.add_argument("--dilocox", action="store_true", help="Enable the DiLoCoX outer loop.")
    flags.add_flags(g, DiLoCoXConfig, "dilocox")
    flags.add_flags(g, CompressionConfig, "dilocox")
    g = parser.add_argument_group(
        "DiLoCoX clusters as independent jobs",
        "Each cluster its own torchrun job; the outer exchange runs through a torchft Lighthouse and "
        "goes on without a lost cluster (docs/reliability.md).")
    flags.add_flags(g, ExchangeConfig, "dilocox")


def dilocox_config(args) -> DiLoCoXConfig:
    """The DiLoCoX settings of a parsed command line (``args.clusters`` resolved by parse_args)."""
    return flags.from_args(DiLoCoXConfig, args, "dilocox", clusters=args.clusters)


def compression_config(args) -> CompressionConfig:
    """The pseudo-gradient compression settings of a parsed command line."""
    return flags.from_args(CompressionConfig, args, "dilocox")


def exchange_config(args) -> ExchangeConfig:
    """The settings of the fault-tolerant exchange between cluster jobs."""
    return flags.from_args(ExchangeConfig, args, "dilocox")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pretrain_gpt.py",
        description="GPT pretraining on megatron-core. Launch with torchrun; "
                    "without --dilocox this is the vanilla AllReduce baseline.",
        allow_abbrev=False,
        formatter_class=HelpFormatter,
    )
    for add in (_model_args, _parallel_args, _training_args, _data_args, _logging_args, _checkpoint_args,
                _dilocox_args):
        add(parser)
    return parser


def _require(condition, message):
    if not condition:
        raise ConfigError(message)


def _check_model(args):
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                 "micro_batch_size", "train_iters"):
        value = getattr(args, flag)
        _require(value >= 1, f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    _require(args.hidden_size % args.num_attention_heads == 0,
             f"--hidden-size {args.hidden_size} is not divisible by "
             f"--num-attention-heads {args.num_attention_heads}")
    if args.num_query_groups is not None:
        _require(args.num_attention_heads % args.num_query_groups == 0,
                 f"--num-attention-heads {args.num_attention_heads} is not divisible by "
                 f"--num-query-groups {args.num_query_groups}")
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    _require(args.position_embedding_type == "rope" or args.max_position_embeddings >= args.seq_length,
             f"--max-position-embeddings {args.max_position_embeddings} is smaller than "
             f"--seq-length {args.seq_length}")
    for flag in ("hidden_dropout", "attention_dropout"):
        value = getattr(args, flag)
        _require(0.0 <= value < 1.0, f"--{flag.replace('_', '-')} must be in [0, 1), got {value}")


def _check_parallel(args):
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    _require(tp >= 1 and pp >= 1, "--tensor-model-parallel-size and --pipeline-model-parallel-size must be >= 1")
    _require(args.num_attention_heads % tp == 0,
             f"--num-attention-heads {args.num_attention_heads} is not divisible by "
             f"--tensor-model-parallel-size {tp}")
    groups = args.num_query_groups or args.num_attention_heads
    _require(groups % tp == 0,
             f"--num-query-groups {groups} is not divisible by --tensor-model-parallel-size {tp}")
    _require(args.ffn_hidden_size % tp == 0,
             f"--ffn-hidden-size {args.ffn_hidden_size} is not divisible by --tensor-model-parallel-size {tp}")
    _require(args.num_layers % pp == 0,
             f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp}")
    _require(not args.sequence_parallel or tp > 1, "--sequence-parallel needs --tensor-model-parallel-size > 1")
    _require(not args.sequence_parallel or args.normalization == "RMSNorm",
             "--sequence-parallel needs --normalization RMSNorm here (the local LayerNorm does not support it)")
    args.virtual_pipeline_model_parallel_size = None
    vpp_layers = args.num_layers_per_virtual_pipeline_stage
    if vpp_layers is not None:
        _require(pp > 2 or (pp == 2 and args.overlap_p2p_comm),
                 "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size >= 2, and "
                 "with 2 stages batched p2p (--no-overlap-p2p-communication) gives wrong gradients")
        layers_per_stage = args.num_layers // pp
        _require(vpp_layers >= 1 and layers_per_stage % vpp_layers == 0 and layers_per_stage > vpp_layers,
                 f"--num-layers-per-virtual-pipeline-stage {vpp_layers} must divide the "
                 f"{layers_per_stage} layers of each pipeline stage into at least 2 chunks")
        args.virtual_pipeline_model_parallel_size = layers_per_stage // vpp_layers


def _check_training(args):
    _require(args.lr > 0, f"--lr must be > 0, got {args.lr}")
    _require(0 <= args.min_lr <= args.lr, f"--min-lr must be in [0, --lr], got {args.min_lr}")
    _require(args.lr_warmup_iters >= 0, f"--lr-warmup-iters must be >= 0, got {args.lr_warmup_iters}")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    _require(args.lr_decay_iters > args.lr_warmup_iters or args.lr_decay_style == "constant",
             f"--lr-decay-iters {args.lr_decay_iters} must exceed --lr-warmup-iters {args.lr_warmup_iters}")
    _require(args.clip_grad >= 0, f"--clip-grad must be >= 0, got {args.clip_grad}")
    _require(args.log_interval >= 1 and args.eval_interval >= 1,
             "--log-interval and --eval-interval must be >= 1")
    _require(args.eval_iters >= 0, f"--eval-iters must be >= 0, got {args.eval_iters}")


def _check_data(args):
    if args.mock_data:
        _require(not args.data_path, "--mock-data and --data-path are exclusive")
    else:
        _require(bool(args.data_path), "--data-path is required (or --mock-data)")
        paths = args.data_path
        if len(paths) > 1:
            _require(len(paths) % 2 == 0,
                     "--data-path takes one prefix or pairs 'weight prefix', got an odd count")
            for weight in paths[0::2]:
                try:
                    float(weight)
                except ValueError:
                    raise ConfigError(f"--data-path: expected a weight, got {weight!r}") from None
    if args.tokenizer_type == "SentencePieceTokenizer":
        _require(args.tokenizer_model is not None, "--tokenizer-model is required for SentencePieceTokenizer")
        _require(os.path.isfile(args.tokenizer_model),
                 f"--tokenizer-model: file not found: {args.tokenizer_model}")
    else:
        _require(args.vocab_size is not None and args.vocab_size > 1,
                 "--vocab-size is required for NullTokenizer")
    try:
        split = [float(x) for x in args.split.replace("/", ",").split(",")]
    except ValueError:
        raise ConfigError(f"--split: expected 'train,valid,test' numbers, got {args.split!r}") from None
    _require(len(split) <= 3 and all(x >= 0 for x in split) and sum(split) > 0,
             f"--split: expected up to three non-negative weights, got {args.split!r}")


def _check_checkpointing(args):
    for flag in ("save_interval", "exit_interval"):
        value = getattr(args, flag)
        _require(value is None or value >= 1, f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    _require(args.save_interval is None or args.save, "--save-interval needs --save DIR")
    _require(args.most_recent_k == -1 or args.most_recent_k >= 1,
             f"--most-recent-k must be >= 1 (or -1: keep all), got {args.most_recent_k}")
    if args.load is not None:
        _require(os.path.isdir(args.load), f"--load: no such directory: {args.load}")


def parse_args(argv=None) -> argparse.Namespace:
    """Parses and checks flags. Raises ConfigError on a bad combination."""
    args = build_parser().parse_args(argv)
    _check_model(args)
    _check_parallel(args)
    _check_training(args)
    _check_data(args)
    _check_checkpointing(args)
    if args.dilocox_clusters is not None:
        args.clusters = args.dilocox_clusters
    else:
        args.clusters = DiLoCoXConfig.clusters if args.dilocox else 1
    _require(args.clusters >= 1, f"--dilocox-clusters must be >= 1, got {args.clusters}")
    args.dilocox_landing = None  # resolved below, so a run's recorded settings show when a default moves it
    if args.dilocox:
        _require(not (args.use_distributed_optimizer and args.pipeline_model_parallel_size > 1
                      and not args.untie_embeddings_and_output_weights),
                 "--dilocox with --use-distributed-optimizer and --pipeline-model-parallel-size > 1 needs "
                 "--untie-embeddings-and-output-weights (tied copies on two stages are kept equal by "
                 "mirroring whole tensors, which a sharded optimizer does not hold)")
        config, compression = dilocox_config(args), compression_config(args)
        try:
            config.validate()
            compression.validate()
            exchange_config(args).validate(args.clusters)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        args.dilocox_landing = config.landing
        if args.dilocox_lighthouse:
            _require(config.max_local_steps is None,
                     "--dilocox-max-local-steps (adaptive H) needs every cluster's timings each round, which "
                     "clusters joined by --dilocox-lighthouse do not share yet")
            _require(not compression.codec.startswith("lowrank"),
                     f"--dilocox-compression {args.dilocox_compression} needs two exchanges per round, which "
                     "--dilocox-lighthouse does not support yet (use topk, quantize or none)")
    else:
        _require(not args.dilocox_lighthouse, "--dilocox-lighthouse needs --dilocox")
    return args


def validate_world(args, world_size: int) -> None:
    """Checks the layout against the world size and derives data-parallel sizes."""
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    _require(world_size % model_parallel == 0,
             f"world size {world_size} is not divisible by --tensor-model-parallel-size x "
             f"--pipeline-model-parallel-size = {model_parallel}")
    args.data_parallel_size = world_size // model_parallel
    if args.dilocox_lighthouse:  # the world is one cluster; data parallelism spans all C of them
        args.data_parallel_size *= args.clusters
    else:
        clusters = args.clusters
        _require(args.data_parallel_size % clusters == 0,
                 f"world size {world_size} does not split into --dilocox-clusters {clusters} clusters of "
                 f"TP x PP x DP_in ranks (data-parallel size {args.data_parallel_size})")
    step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = step
    _require(args.global_batch_size % step == 0,
             f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size x "
             f"data-parallel size = {step}")
    args.num_microbatches = args.global_batch_size // step
    _require(args.virtual_pipeline_model_parallel_size is None
             or args.num_microbatches % args.pipeline_model_parallel_size == 0,
             f"the interleaved schedule needs the number of micro-batches ({args.num_microbatches}) to be "
             f"a multiple of --pipeline-model-parallel-size {args.pipeline_model_parallel_size}")


def padded_vocab_size(vocab_size: int, args) -> int:
    """Vocabulary padded to a multiple of lcm(--make-vocab-size-divisible-by, TP).

    Unlike Megatron-LM (multiple of divisor x TP), the padding does not depend on TP
    when TP divides the divisor, so checkpoints and losses are the same on every layout.
    """
    multiple = math.lcm(args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)
    return -(-vocab_size // multiple) * multiple
