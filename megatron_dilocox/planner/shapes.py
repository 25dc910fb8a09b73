"""The model's parameters as megatron-core's GPT (local layer spec) holds them, per TP rank and
pipeline stage.

With ``kv = kv_channels * query_groups``, ``kv_channels = h / heads``; ``b(x)`` is ``x`` with
biases, 0 with ``--disable-bias-linear``; ``ln`` = 2h for LayerNorm, h for RMSNorm::

    embedding   V_pad * h   (+ max_pos * h for learned absolute positions)
    per layer   ln                          input layernorm
                h * (h + 2 kv) + b(h + 2 kv)   QKV
                h * h + b(h)                   attention output projection
                ln                          pre-MLP layernorm
                h * f * g + b(f * g)          fc1 (g = 2 with SwiGLU, else 1)
                f * h + b(h)                   fc2
    final       ln
    output      V_pad * h if untied (tied: no new parameter; with PP > 1 the last stage holds a
                copy of the embedding, counted in its memory, not here; it follows the first
                stage's copy, so it has no outer state and sends no pseudo-gradient)

``V_pad`` = vocab rounded up to a multiple of lcm(make_vocab_size_divisible_by, TP).
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class ModelShape:
    """A megatron-core GPT (local spec), in Megatron-LM flag terms."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    seq_length: int
    ffn_hidden_size: int | None = None  # default 4 h
    num_query_groups: int | None = None  # default: one per head
    max_position_embeddings: int | None = None  # default seq_length
    position_embedding_type: str = "learned_absolute"
    swiglu: bool = False
    untie_embeddings_and_output_weights: bool = False
    disable_bias_linear: bool = False
    normalization: str = "LayerNorm"
    make_vocab_size_divisible_by: int = 128

    def __post_init__(self):
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden size {self.hidden_size} not divisible by heads {self.num_attention_heads}")


def padded_vocab(vocab: int, multiple_of: int, tp: int) -> int:
    m = math.lcm(multiple_of, tp)
    return -(-vocab // m) * m


@dataclass(frozen=True)
class Tensor:
    """One parameter tensor as a rank holds it: (out, in) for matrices, (n,) for vectors."""

    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def layer_tensors(m: ModelShape, tp: int = 1) -> list[Tensor]:
    """Parameters of one transformer layer on one TP rank (column-parallel outputs / tp)."""
    h, f = m.hidden_size, m.ffn_hidden_size
    kv = (h // m.num_attention_heads) * m.num_query_groups
    qkv_out, fc1_out = h + 2 * kv, f * (2 if m.swiglu else 1)
    bias = not m.disable_bias_linear

    def ln(prefix):
        ts = [Tensor(prefix + ".weight", (h,))]
        return ts + ([Tensor(prefix + ".bias", (h,))] if m.normalization == "LayerNorm" else [])

    ts = ln("input_layernorm") + [Tensor("qkv.weight", (qkv_out // tp, h))]
    ts += [Tensor("qkv.bias", (qkv_out // tp,))] if bias else []
    ts += [Tensor("proj.weight", (h, h // tp))] + ([Tensor("proj.bias", (h,))] if bias else [])
    ts += ln("pre_mlp_layernorm") + [Tensor("fc1.weight", (fc1_out // tp, h))]
    ts += [Tensor("fc1.bias", (fc1_out // tp,))] if bias else []
    ts += [Tensor("fc2.weight", (h, f // tp))] + ([Tensor("fc2.bias", (h,))] if bias else [])
    return ts


def stage_tensors(m: ModelShape, tp: int, pp: int, stage: int) -> list[Tensor]:
    """Parameters of one (TP rank, pipeline stage); even split of layers over stages."""
    if m.num_layers % pp:
        raise ValueError(f"--num-layers {m.num_layers} not divisible by --pipeline-model-parallel-size {pp}")
    h, v = m.hidden_size, padded_vocab(m.vocab_size, m.make_vocab_size_divisible_by, tp)
    ts: list[Tensor] = []
    if stage == 0:
        ts.append(Tensor("word_embeddings", (v // tp, h)))
        if m.position_embedding_type == "learned_absolute":
            ts.append(Tensor("position_embeddings", (m.max_position_embeddings, h)))
    for _ in range(m.num_layers // pp):
        ts += layer_tensors(m, tp)
    if stage == pp - 1:
        ts.append(Tensor("final_layernorm.weight", (h,)))
        if m.normalization == "LayerNorm":
            ts.append(Tensor("final_layernorm.bias", (h,)))
        if m.untie_embeddings_and_output_weights or pp > 1:  # tied + PP>1: a copy on the last stage
            ts.append(Tensor("output_layer", (v // tp, h)))
    return ts


def outer_tensors(m: ModelShape, tp: int, pp: int, stage: int) -> list[Tensor]:
    """The stage's parameters in the DiLoCoX outer loop: all but a tied embedding's copy on the
    last stage (training/dilocox.py mirrors it from the first stage instead of sending it)."""
    ts = stage_tensors(m, tp, pp, stage)
    if stage == pp - 1 and pp > 1 and not m.untie_embeddings_and_output_weights:
        ts = [t for t in ts if t.name != "output_layer"]
    return ts


def param_count(m: ModelShape, tp: int = 1) -> int:
    """Unique parameters of the model (the formula of this module's docstring)."""
    h, f, L = m.hidden_size, m.ffn_hidden_size, m.num_layers
    v = padded_vocab(m.vocab_size, m.make_vocab_size_divisible_by, tp)
    kv = (h // m.num_attention_heads) * m.num_query_groups
    g = 2 if m.swiglu else 1
    ln = 2 * h if m.normalization == "LayerNorm" else h
    b = 0 if m.disable_bias_linear else 1
    per_layer = (ln + h * (h + 2 * kv) + b * (h + 2 * kv) + h * h + b * h + ln
                 + h * f * g + b * f * g + f * h + b * h)
    emb = v * h + (m.max_position_embeddings * h if m.position_embedding_type == "learned_absolute" else 0)
    out = v * h if m.untie_embeddings_and_output_weights else 0
    return emb + L * per_layer + ln + out
