"""The settings of a run, one dataclass per flag group, named and meaning what they do in Megatron-LM.

Each field is a ``pretrain_gpt.py`` flag of the same name (:mod:`megatron_dilocox.flags`; these
sections have no prefix: ``num_layers`` is ``--num-layers``); a field without a default is a
required flag. ``__post_init__`` checks what a section can check alone, raising
:class:`~megatron_dilocox.errors.ConfigError` with a message naming the flag; the checks across
sections are :func:`megatron_dilocox.arguments.parse_args`'s. No torch here.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from megatron_dilocox.config import CompressionConfig, DiLoCoXConfig, ExchangeConfig
from megatron_dilocox.errors import ConfigError, require


def _at_least_one(section, *names):
    for name in names:
        value = getattr(section, name)
        require(value >= 1, f"--{name.replace('_', '-')} must be >= 1, got {value}")


@dataclass(kw_only=True)
class ModelConfig:
    """The network: the flags that define the weights' shapes and meaning."""

    num_layers: int
    """Number of transformer layers."""

    hidden_size: int
    """Transformer hidden size."""

    num_attention_heads: int
    """Number of attention heads."""

    num_query_groups: int | None = None
    """Key/value head groups for grouped-query attention (default: one per head)."""

    ffn_hidden_size: int | None = None
    """MLP hidden size (default: 4 x hidden size)."""

    seq_length: int
    """Sequence length of a training sample."""

    max_position_embeddings: int | None = None
    """Size of the learned position table (default: --seq-length)."""

    position_embedding_type: str = field(default="learned_absolute",
                                         metadata={"choices": ("learned_absolute", "rope")})
    """Position embedding type."""

    rotary_base: int = 10000
    """RoPE base."""

    normalization: str = field(default="LayerNorm", metadata={"choices": ("LayerNorm", "RMSNorm")})
    """Normalization layer."""

    swiglu: bool = False
    """Gated SiLU MLP (SwiGLU)."""

    disable_bias_linear: bool = False
    """No biases in linear layers."""

    untie_embeddings_and_output_weights: bool = False
    """Separate output layer instead of reusing the input embedding."""

    init_method_std: float = 0.02
    """Std of the normal weight init (output projections are scaled by 1/sqrt(2L))."""

    hidden_dropout: float = 0.1
    """Dropout after attention and MLP."""

    attention_dropout: float = 0.1
    """Dropout on attention probabilities."""

    attention_backend: str = field(default="auto", metadata={"choices": ("auto", "local", "unfused")})
    """Megatron-LM's attention backend; each choice here is megatron-core's own attention (flash and
    fused need Transformer Engine, which this build does not use)."""

    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary to a multiple of this (and of the TP size)."""

    def __post_init__(self):
        _at_least_one(self, "num_layers", "hidden_size", "num_attention_heads", "seq_length")
        require(self.hidden_size % self.num_attention_heads == 0,
                f"--hidden-size {self.hidden_size} is not divisible by "
                f"--num-attention-heads {self.num_attention_heads}")
        if self.num_query_groups is not None:
            require(self.num_attention_heads % self.num_query_groups == 0,
                    f"--num-attention-heads {self.num_attention_heads} is not divisible by "
                    f"--num-query-groups {self.num_query_groups}")
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        require(self.position_embedding_type == "rope" or self.max_position_embeddings >= self.seq_length,
                f"--max-position-embeddings {self.max_position_embeddings} is smaller than "
                f"--seq-length {self.seq_length}")
        for name in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, name)
            require(0.0 <= value < 1.0, f"--{name.replace('_', '-')} must be in [0, 1), got {value}")

    @property
    def query_groups(self) -> int:
        """Key/value head groups, one per head when --num-query-groups is not given."""
        return self.num_query_groups or self.num_attention_heads


@dataclass(kw_only=True)
class ParallelConfig:
    """How one cluster's ranks split the model (tensor, pipeline) and the optimizer state."""

    tensor_model_parallel_size: int = 1
    """Tensor-parallel size."""

    pipeline_model_parallel_size: int = 1
    """Pipeline-parallel size."""

    num_layers_per_virtual_pipeline_stage: int | None = None
    """Layers per virtual stage: enables the interleaved 1F1B schedule."""

    overlap_p2p_comm: bool = field(default=True, metadata={"flag": "overlap-p2p-communication"})
    """Interleaved schedule: batch pipeline sends/receives instead of overlapping them."""

    sequence_parallel: bool = False
    """Shard LayerNorm/dropout activations along the sequence (needs TP > 1)."""

    use_distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks (ZeRO-1)."""

    distributed_backend: str | None = field(default=None, metadata={"choices": ("nccl", "gloo")})
    """Process-group backend (default: nccl with CUDA, gloo without)."""

    distributed_timeout_minutes: int = 10
    """Timeout of intra-cluster collectives."""

    def __post_init__(self):
        require(self.tensor_model_parallel_size >= 1 and self.pipeline_model_parallel_size >= 1,
                "--tensor-model-parallel-size and --pipeline-model-parallel-size must be >= 1")


@dataclass(kw_only=True)
class TrainingConfig:
    """Batches, the inner optimizer (AdamW), its learning-rate schedule, activation recomputation."""

    micro_batch_size: int
    """Samples per micro-batch per rank."""

    global_batch_size: int | None = None
    """Samples per optimizer step over all data-parallel ranks (default: micro batch x
    data-parallel size)."""

    train_iters: int
    """Optimizer steps to train."""

    lr: float
    """Peak learning rate."""

    min_lr: float = 0.0
    """Learning rate floor after decay."""

    lr_decay_style: str = field(default="linear",
                                metadata={"choices": ("constant", "linear", "cosine", "inverse-square-root")})
    """Learning-rate decay."""

    lr_decay_iters: int | None = None
    """Iterations to decay over (default: --train-iters)."""

    lr_warmup_iters: int = 0
    """Linear warmup iterations."""

    lr_warmup_fraction: float | None = None
    """Linear warmup over this fraction of --lr-decay-iters, instead of --lr-warmup-iters."""

    weight_decay: float = 0.01
    """AdamW weight decay."""

    adam_beta1: float = 0.9
    """AdamW beta1."""

    adam_beta2: float = 0.999
    """AdamW beta2."""

    adam_eps: float = 1e-8
    """AdamW epsilon."""

    clip_grad: float = 1.0
    """Gradient clipping by global norm (0: off)."""

    bf16: bool = False
    """bf16 weights and compute, fp32 main params."""

    seed: int = 1234
    """Random seed (init, data order, dropout)."""

    recompute_granularity: str | None = field(default=None, metadata={"choices": ("full", "selective")})
    """Activation recomputation."""

    recompute_method: str = field(default="uniform", metadata={"choices": ("uniform", "block")})
    """How full recomputation groups layers."""

    recompute_num_layers: int = 1
    """Layers per recomputation group (full recomputation)."""

    def __post_init__(self):
        _at_least_one(self, "micro_batch_size", "train_iters")
        require(self.lr > 0, f"--lr must be > 0, got {self.lr}")
        require(0 <= self.min_lr <= self.lr, f"--min-lr must be in [0, --lr], got {self.min_lr}")
        require(self.lr_warmup_iters >= 0, f"--lr-warmup-iters must be >= 0, got {self.lr_warmup_iters}")
        if self.lr_decay_iters is None:
            self.lr_decay_iters = self.train_iters
        if self.lr_warmup_fraction is not None:
            require(0 <= self.lr_warmup_fraction < 1,
                    f"--lr-warmup-fraction must be in [0, 1), got {self.lr_warmup_fraction}")
            require(self.lr_warmup_iters == 0, "--lr-warmup-fraction and --lr-warmup-iters exclude each other")
        require(self.lr_decay_iters > self.lr_warmup_steps or self.lr_decay_style == "constant",
                f"--lr-decay-iters {self.lr_decay_iters} must exceed the warmup ({self.lr_warmup_steps:g} iterations)")
        require(self.clip_grad >= 0, f"--clip-grad must be >= 0, got {self.clip_grad}")

    @property
    def lr_warmup_steps(self) -> float:
        """Warmup length in iterations; a fraction of the decay iterations need not be whole, as in Megatron-LM."""
        if self.lr_warmup_fraction is not None:
            return self.lr_warmup_fraction * self.lr_decay_iters
        return self.lr_warmup_iters


@dataclass(kw_only=True)
class DataConfig:
    """The datasets and the tokenizer."""

    data_path: list[str] | None = None
    """Dataset prefix(es) of .bin/.idx files, optionally weighted: 'w1 p1 w2 p2'."""

    split: str = "969,30,1"
    """Train,valid,test split of each dataset."""

    mock_data: bool = False
    """Synthetic tokens instead of --data-path."""

    tokenizer_type: str = field(default="SentencePieceTokenizer",
                                metadata={"choices": ("SentencePieceTokenizer", "NullTokenizer")})
    """Tokenizer type."""

    tokenizer_model: str | None = None
    """SentencePiece model file."""

    vocab_size: int | None = None
    """Vocabulary size for NullTokenizer."""

    data_cache_path: str | None = None
    """Where dataset index caches go (default: next to the data)."""

    def __post_init__(self):
        if self.mock_data:
            require(not self.data_path, "--mock-data and --data-path are exclusive")
        else:
            require(bool(self.data_path), "--data-path is required (or --mock-data)")
            paths = self.data_path
            if len(paths) > 1:
                require(len(paths) % 2 == 0, "--data-path takes one prefix or pairs 'weight prefix', got an odd count")
                for weight in paths[0::2]:
                    try:
                        float(weight)
                    except ValueError:
                        raise ConfigError(f"--data-path: expected a weight, got {weight!r}") from None
        if self.tokenizer_type == "SentencePieceTokenizer":
            require(self.tokenizer_model is not None, "--tokenizer-model is required for SentencePieceTokenizer")
            require(os.path.isfile(self.tokenizer_model), f"--tokenizer-model: file not found: {self.tokenizer_model}")
        else:
            require(self.vocab_size is not None and self.vocab_size > 1, "--vocab-size is required for NullTokenizer")
        try:
            split = [float(x) for x in self.split.replace("/", ",").split(",")]
        except ValueError:
            raise ConfigError(f"--split: expected 'train,valid,test' numbers, got {self.split!r}") from None
        require(len(split) <= 3 and all(x >= 0 for x in split) and sum(split) > 0,
                f"--split: expected up to three non-negative weights, got {self.split!r}")


@dataclass(kw_only=True)
class LoggingConfig:
    """Evaluation and logging."""

    eval_interval: int = 1000
    """Evaluate every N iterations."""

    eval_iters: int = 100
    """Validation batches per evaluation."""

    full_validation: bool = False
    """Every evaluation runs over the whole validation split, the same batches each time (one
    epoch; --eval-iters is ignored), so evaluations are comparable across runs."""

    log_interval: int = 100
    """Log every N iterations."""

    tensorboard_dir: str | None = None
    """Write TensorBoard scalars here."""

    wandb_project: str | None = None
    """Log to this Weights & Biases project."""

    wandb_exp_name: str | None = None
    """Weights & Biases run name."""

    wandb_save_dir: str | None = None
    """Weights & Biases local directory."""

    metrics_file: str | None = None
    """Append JSON lines here: one per log interval and one per evaluation."""

    def __post_init__(self):
        require(self.log_interval >= 1 and self.eval_interval >= 1, "--log-interval and --eval-interval must be >= 1")
        require(self.eval_iters >= 0, f"--eval-iters must be >= 0, got {self.eval_iters}")


@dataclass(kw_only=True)
class CheckpointConfig:
    """Where checkpoints are saved to and loaded from, and how often."""

    save: str | None = None
    """Directory to save checkpoints to."""

    save_interval: int | None = None
    """Save every N iterations (and always at the end of training with --save)."""

    load: str | None = None
    """Resume from the latest checkpoint in this directory: exactly with the same layout, from the
    (resharded) weights with another TP/PP/cluster layout. A directory with no checkpoint yet, or
    the --save directory before it exists (Megatron-LM's --save DIR --load DIR on a first launch):
    start from scratch, with a warning."""

    exit_interval: int | None = None
    """Stop after the first iteration divisible by N, saving a checkpoint with --save."""

    most_recent_k: int = -1
    """Keep only the K most recent checkpoints (highest iterations) in --save, deleting older ones
    once a new save is complete; never the one the tracker points at. -1 keeps all. (Megatron-LM's
    name, from its checkpoint config; its --save-retain-interval keeps every N-th iteration
    instead.)"""

    def __post_init__(self):
        for name in ("save_interval", "exit_interval"):
            value = getattr(self, name)
            require(value is None or value >= 1, f"--{name.replace('_', '-')} must be >= 1, got {value}")
        require(self.save_interval is None or self.save, "--save-interval needs --save DIR")
        require(self.most_recent_k == -1 or self.most_recent_k >= 1,
                f"--most-recent-k must be >= 1 (or -1: keep all), got {self.most_recent_k}")
        if self.load is not None:
            first_launch = self.save is not None and os.path.abspath(self.load) == os.path.abspath(self.save)
            require(os.path.isdir(self.load) or first_launch, f"--load: no such directory: {self.load}")


SECTIONS = {"model": ModelConfig, "parallel": ParallelConfig, "training": TrainingConfig, "data": DataConfig,
            "logging": LoggingConfig, "checkpoint": CheckpointConfig}
"""The :class:`RunConfig` field of each flag section, in the order of ``--help``."""


@dataclass(kw_only=True)
class RunConfig:
    """A parsed command line: a field per section, and the values resolved from several of them."""

    model: ModelConfig
    parallel: ParallelConfig
    training: TrainingConfig
    data: DataConfig
    logging: LoggingConfig
    checkpoint: CheckpointConfig
    dilocox: bool
    """--dilocox: the outer loop is on."""
    outer: DiLoCoXConfig
    compression: CompressionConfig
    exchange: ExchangeConfig
    dilocox_flags: dict
    """The ``--dilocox-*`` flags as given (None where not given), by attribute: what run records
    keep, where the sections hold the values they resolve to."""
    virtual_pipeline_model_parallel_size: int | None = None
    data_parallel_size: int | None = None
    """Set by :func:`~megatron_dilocox.arguments.validate_world`, with :attr:`num_microbatches`."""
    num_microbatches: int | None = None
    padded_vocab_size: int | None = None
    """Set once the tokenizer is known."""

    @property
    def clusters(self) -> int:
        return self.outer.clusters

    def flat(self) -> dict:
        """Every setting by the parsed flags' attribute names, as checkpoints, run records and
        tools keep them (and as the command line's namespace held them)."""
        flat = {f.name: getattr(getattr(self, name), f.name)
                for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
        flat.update(dilocox=self.dilocox, **self.dilocox_flags,
                    virtual_pipeline_model_parallel_size=self.virtual_pipeline_model_parallel_size,
                    clusters=self.clusters, dilocox_landing=self.outer.landing if self.dilocox else None)
        for name in ("data_parallel_size", "num_microbatches", "padded_vocab_size"):
            if getattr(self, name) is not None:
                flat[name] = getattr(self, name)
        return flat
