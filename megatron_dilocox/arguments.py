"""Command-line flags, named and meaning what they do in Megatron-LM.

:func:`parse_args` builds the parser from the config sections
(:mod:`megatron_dilocox.run_config`, :mod:`megatron_dilocox.config`), parses, and checks
everything that can be checked before the process group exists, into one
:class:`~megatron_dilocox.run_config.RunConfig`; :func:`validate_world` checks the layout
against the world size. Every user error is a
:class:`~megatron_dilocox.errors.ConfigError` whose message names the flag.
"""

import argparse
import math

from megatron_dilocox import flags
from megatron_dilocox.config import CompressionConfig, DiLoCoXConfig, ExchangeConfig
from megatron_dilocox.errors import ConfigError, require
from megatron_dilocox.run_config import SECTIONS, ModelConfig, ParallelConfig, RunConfig


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends each flag's default to its help, unless the help already says it or there is none
    to show (no default, an on/off switch)."""

    def _get_help_string(self, action):
        if action.default is None or action.nargs == 0 or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


_GROUPS = {  # the argparse group of each section: title, description
    "model": ("model", None),
    "parallel": ("parallelism", None),
    "training": ("training", None),
    "data": ("data", None),
    "logging": ("evaluation and logging", None),
    "checkpoint": ("checkpointing",
                   "Megatron layout: SAVE_DIR/iter_XXXXXXX/ folders and latest_checkpointed_iteration.txt."),
}


def _section_args(parser):
    for name, cls in SECTIONS.items():
        flags.add_flags(parser.add_argument_group(*_GROUPS[name]), cls, None)


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


# Megatron-LM flags of its GPT launch scripts that this trainer does not implement: refused by
# name, with what to use instead, rather than as unrecognized (tests/test_megatron_flags.py).
_GPT2_BPE = ("GPT-2 BPE tokenizers are not supported; preprocess the data with a SentencePiece model "
             "and pass --tokenizer-model")
NOT_SUPPORTED = {
    "--fp16": "fp16 with loss scaling is not implemented; train in --bf16",
    "--rampup-batch-size": "a global batch that grows during training is not implemented",
    "--vocab-file": _GPT2_BPE,
    "--merge-file": _GPT2_BPE,
}


def _refuse(parser: argparse.ArgumentParser, unknown: list[str]):
    """Names the first Megatron-LM flag of ``unknown`` that is not supported, else lets argparse
    report them all as unrecognized."""
    for token in unknown:
        name = token.split("=", 1)[0]
        if name in NOT_SUPPORTED:
            raise ConfigError(f"{name} is a Megatron-LM flag not supported here: {NOT_SUPPORTED[name]}")
    parser.error(f"unrecognized arguments: {' '.join(unknown)}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pretrain_gpt.py",
        description="GPT pretraining on megatron-core. Launch with torchrun; "
                    "without --dilocox this is the vanilla AllReduce baseline.",
        allow_abbrev=False,
        formatter_class=HelpFormatter,
    )
    _section_args(parser)
    _dilocox_args(parser)
    return parser


def _check_parallel(model: ModelConfig, parallel: ParallelConfig) -> int | None:
    """Checks the layout against the model; returns the virtual pipeline size (None: not interleaved)."""
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    require(model.num_attention_heads % tp == 0,
            f"--num-attention-heads {model.num_attention_heads} is not divisible by "
            f"--tensor-model-parallel-size {tp}")
    require(model.query_groups % tp == 0,
            f"--num-query-groups {model.query_groups} is not divisible by --tensor-model-parallel-size {tp}")
    require(model.ffn_hidden_size % tp == 0,
            f"--ffn-hidden-size {model.ffn_hidden_size} is not divisible by --tensor-model-parallel-size {tp}")
    require(model.num_layers % pp == 0,
            f"--num-layers {model.num_layers} is not divisible by --pipeline-model-parallel-size {pp}")
    require(not parallel.sequence_parallel or tp > 1, "--sequence-parallel needs --tensor-model-parallel-size > 1")
    require(not parallel.sequence_parallel or model.normalization == "RMSNorm",
            "--sequence-parallel needs --normalization RMSNorm here (the local LayerNorm does not support it)")
    vpp_layers = parallel.num_layers_per_virtual_pipeline_stage
    if vpp_layers is None:
        return None
    require(pp > 2 or (pp == 2 and parallel.overlap_p2p_comm),
            "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size >= 2, and "
            "with 2 stages batched p2p (--no-overlap-p2p-communication) gives wrong gradients")
    layers_per_stage = model.num_layers // pp
    require(vpp_layers >= 1 and layers_per_stage % vpp_layers == 0 and layers_per_stage > vpp_layers,
            f"--num-layers-per-virtual-pipeline-stage {vpp_layers} must divide the "
            f"{layers_per_stage} layers of each pipeline stage into at least 2 chunks")
    return layers_per_stage // vpp_layers


def _dilocox_configs(args, sections: dict):
    """The DiLoCoX sections of a parsed namespace, checked (``--dilocox-clusters`` resolved)."""
    run_dilocox = args.dilocox
    given = args.dilocox_clusters
    clusters = given if given is not None else (DiLoCoXConfig.clusters if run_dilocox else 1)
    require(clusters >= 1, f"--dilocox-clusters must be >= 1, got {clusters}")
    config = flags.from_args(DiLoCoXConfig, args, "dilocox", clusters=clusters)
    compression = flags.from_args(CompressionConfig, args, "dilocox")
    exchange = flags.from_args(ExchangeConfig, args, "dilocox")
    if not run_dilocox:
        require(not exchange.lighthouse, "--dilocox-lighthouse needs --dilocox")
        return config, compression, exchange
    parallel, model = sections["parallel"], sections["model"]
    require(not (parallel.use_distributed_optimizer and parallel.pipeline_model_parallel_size > 1
                 and not model.untie_embeddings_and_output_weights),
            "--dilocox with --use-distributed-optimizer and --pipeline-model-parallel-size > 1 needs "
            "--untie-embeddings-and-output-weights (tied copies on two stages are kept equal by "
            "mirroring whole tensors, which a sharded optimizer does not hold)")
    try:
        config.validate()
        compression.validate()
        exchange.validate(clusters)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return config, compression, exchange


def parse_args(argv=None) -> RunConfig:
    """Parses and checks flags. Raises ConfigError on a bad combination."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        _refuse(parser, unknown)
    sections = {name: flags.from_args(cls, args, None) for name, cls in SECTIONS.items()}
    vpp = _check_parallel(sections["model"], sections["parallel"])
    outer, compression, exchange = _dilocox_configs(args, sections)
    return RunConfig(**sections, dilocox=args.dilocox, outer=outer, compression=compression, exchange=exchange,
                     dilocox_flags={k: v for k, v in vars(args).items() if k.startswith("dilocox_")},
                     virtual_pipeline_model_parallel_size=vpp)


def validate_world(run: RunConfig, world_size: int) -> None:
    """Checks the layout against the world size and derives data-parallel sizes and the global batch."""
    parallel, training = run.parallel, run.training
    model_parallel = parallel.tensor_model_parallel_size * parallel.pipeline_model_parallel_size
    require(world_size % model_parallel == 0,
            f"world size {world_size} is not divisible by --tensor-model-parallel-size x "
            f"--pipeline-model-parallel-size = {model_parallel}")
    data_parallel_size = world_size // model_parallel
    if run.exchange.lighthouse:  # the world is one cluster; data parallelism spans all C of them
        data_parallel_size *= run.clusters
    else:
        require(data_parallel_size % run.clusters == 0,
                f"world size {world_size} does not split into --dilocox-clusters {run.clusters} clusters of "
                f"TP x PP x DP_in ranks (data-parallel size {data_parallel_size})")
    run.data_parallel_size = data_parallel_size
    step = training.micro_batch_size * data_parallel_size
    if training.global_batch_size is None:
        training.global_batch_size = step
    require(training.global_batch_size % step == 0,
            f"--global-batch-size {training.global_batch_size} is not divisible by --micro-batch-size x "
            f"data-parallel size = {step}")
    run.num_microbatches = training.global_batch_size // step
    require(run.virtual_pipeline_model_parallel_size is None
            or run.num_microbatches % parallel.pipeline_model_parallel_size == 0,
            f"the interleaved schedule needs the number of micro-batches ({run.num_microbatches}) to be "
            f"a multiple of --pipeline-model-parallel-size {parallel.pipeline_model_parallel_size}")


def padded_vocab_size(vocab_size: int, model: ModelConfig, tensor_parallel_size: int = 1) -> int:
    """Vocabulary padded to a multiple of lcm(--make-vocab-size-divisible-by, TP).

    Unlike Megatron-LM (multiple of divisor x TP), the padding does not depend on TP
    when TP divides the divisor, so checkpoints and losses are the same on every layout.
    """
    multiple = math.lcm(model.make_vocab_size_divisible_by, tensor_parallel_size)
    return -(-vocab_size // multiple) * multiple
