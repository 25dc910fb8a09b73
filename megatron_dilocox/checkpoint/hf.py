"""Weights between our GPT model and Hugging Face ``transformers`` (Llama and GPT-2 families).

Our side is the full (TP1) parameters keyed by global name, as
:func:`megatron_dilocox.training.model.gather_full_params` returns them. Per layer ``i``
(``L = decoder.layers.{i}.``, ``.b`` = the ``.bias`` twin of a weight, present without
``--disable-bias-linear``; LayerNorm also has biases, RMSNorm none):

===========================================  ===============================  ===============================
ours                                         Llama (LlamaForCausalLM)         GPT-2 (GPT2LMHeadModel)
===========================================  ===============================  ===============================
embedding.word_embeddings.weight             model.embed_tokens.weight        transformer.wte.weight
embedding.position_embeddings.weight         (RoPE: none)                     transformer.wpe.weight
L input_layernorm.weight/.b                  model.layers.i.input_layernorm   transformer.h.i.ln_1
L self_attention.linear_qkv.weight/.b        self_attn.{q,k,v}_proj (1)       attn.c_attn (1)(2)
L self_attention.linear_proj.weight/.b       self_attn.o_proj                 attn.c_proj (2)
L pre_mlp_layernorm.weight/.b                post_attention_layernorm         ln_2
L mlp.linear_fc1.weight/.b                   mlp.{gate,up}_proj (3)           mlp.c_fc (2)
L mlp.linear_fc2.weight/.b                   mlp.down_proj                    mlp.c_proj (2)
decoder.final_layernorm.weight/.b            model.norm                       transformer.ln_f
output_layer.weight (untied only)            lm_head.weight (4)               lm_head.weight (4)
===========================================  ===============================  ===============================

(1) megatron's fused QKV rows are grouped per query group: for each of the ``ng`` groups, the
    ``np/ng`` query heads of the group, then its key head, then its value head
    (``[q_0..q_{np/ng-1}, k, v]`` x ``ng``, ``head_dim`` rows each). Query head ``j`` of group
    ``g`` is head ``g*np/ng + j``, which is the head HF's ``repeat_kv`` pairs with kv head ``g``.
    GPT-2's ``c_attn`` is ``[Q; K; V]`` of all heads instead (``ng = np``).
(2) GPT-2's ``Conv1D`` stores weights as ``[in, out]``: the transpose of ours.
(3) SwiGLU's fc1 is ``[gate; up]`` (megatron: ``silu(first half) * second half``).
(4) Tied embeddings: HF's state dict still lists ``lm_head.weight`` (the embedding itself);
    :func:`to_hf` includes it, :func:`from_hf` accepts it missing.

Everything else that defines the model's function is checked, not assumed: HF's attention
scales by ``1/sqrt(head_dim)`` as megatron does; RoPE is the non-interleaved rotate-half form
in both (``--rotary-base`` = ``rope_theta``, default rope type only); megatron's GELU is the
exact ``F.gelu`` (HF ``"gelu"``, not GPT-2's default ``"gelu_new"``); the norm epsilon is
megatron's ``layernorm_epsilon`` (no flag sets it).
"""

import math
from dataclasses import dataclass

import torch
from megatron.core.transformer import TransformerConfig
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from megatron_dilocox.arguments import padded_vocab_size
from megatron_dilocox.errors import ConfigError
from megatron_dilocox.run_config import ModelConfig

_FAMILY_FLAGS = {  # (--position-embedding-type, --normalization, --swiglu)
    "llama": ("rope", "RMSNorm", True),
    "gpt2": ("learned_absolute", "LayerNorm", False),
}


def _describe(position, norm, swiglu):
    return f"--position-embedding-type {position} --normalization {norm} {'--swiglu' if swiglu else '(no --swiglu)'}"


def hf_family(model: ModelConfig) -> str:
    """``"llama"`` (RoPE + RMSNorm + SwiGLU) or ``"gpt2"`` (learned positions + LayerNorm + GELU)."""
    ours = (model.position_embedding_type, model.normalization, model.swiglu)
    for family, flags in _FAMILY_FLAGS.items():
        if ours == flags:
            return family
    raise ConfigError(f"{_describe(*ours)} fits no Hugging Face family: Llama needs "
                      f"{_describe(*_FAMILY_FLAGS['llama'])}, GPT-2 {_describe(*_FAMILY_FLAGS['gpt2'])}")


@dataclass(frozen=True)
class _Arch:
    """What the name and tensor mapping depends on."""

    family: str
    layers: int
    heads: int
    groups: int
    head_dim: int
    bias: bool
    tied: bool


def _split_qkv(w, a: _Arch):
    """megatron's grouped QKV rows -> (Q, K, V), each with rows in head order."""
    per_group = a.heads // a.groups
    x = w.reshape(a.groups, per_group + 2, a.head_dim, *w.shape[1:])
    rest = w.shape[1:]
    return (x[:, :per_group].reshape(a.heads * a.head_dim, *rest),
            x[:, per_group].reshape(a.groups * a.head_dim, *rest),
            x[:, per_group + 1].reshape(a.groups * a.head_dim, *rest))


def _merge_qkv(q, k, v, a: _Arch):
    """The inverse of :func:`_split_qkv`."""
    rest = q.shape[1:]
    parts = [q.reshape(a.groups, a.heads // a.groups, a.head_dim, *rest),
             k.reshape(a.groups, 1, a.head_dim, *rest),
             v.reshape(a.groups, 1, a.head_dim, *rest)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def _same(t):
    return [t]


def _conv1d(t):
    """Our [out, in] weight <-> GPT-2 Conv1D's [in, out] (an involution; biases pass unchanged)."""
    return [t.t() if t.dim() == 2 else t]


def _rules(a: _Arch):
    """(our names, HF names, ours -> HF, HF -> ours) for every tensor, in model order."""
    suffixes = ("weight", "bias") if a.bias else ("weight",)
    norm_suffixes = ("weight",) if a.family == "llama" else ("weight", "bias")  # RMSNorm has no bias
    rules = []

    def add(ours, theirs, fwd=_same, inv=_same):
        rules.append((ours if isinstance(ours, list) else [ours], theirs if isinstance(theirs, list) else [theirs],
                      fwd, inv))

    if a.family == "llama":
        add("embedding.word_embeddings.weight", "model.embed_tokens.weight")
        for i in range(a.layers):
            ours, hf = f"decoder.layers.{i}.", f"model.layers.{i}."
            add(ours + "input_layernorm.weight", hf + "input_layernorm.weight")
            add(ours + "pre_mlp_layernorm.weight", hf + "post_attention_layernorm.weight")
            for s in suffixes:
                add(ours + f"self_attention.linear_qkv.{s}", [hf + f"self_attn.{p}_proj.{s}" for p in "qkv"],
                    lambda t: list(_split_qkv(t, a)), lambda q, k, v: [_merge_qkv(q, k, v, a)])
                add(ours + f"self_attention.linear_proj.{s}", hf + f"self_attn.o_proj.{s}")
                add(ours + f"mlp.linear_fc1.{s}", [hf + f"mlp.gate_proj.{s}", hf + f"mlp.up_proj.{s}"],
                    lambda t: list(t.chunk(2)), lambda gate, up: [torch.cat([gate, up])])
                add(ours + f"mlp.linear_fc2.{s}", hf + f"mlp.down_proj.{s}")
        add("decoder.final_layernorm.weight", "model.norm.weight")
    else:
        add("embedding.word_embeddings.weight", "transformer.wte.weight")
        add("embedding.position_embeddings.weight", "transformer.wpe.weight")
        for i in range(a.layers):
            ours, hf = f"decoder.layers.{i}.", f"transformer.h.{i}."
            for s in norm_suffixes:
                add(ours + f"input_layernorm.{s}", hf + f"ln_1.{s}")
                add(ours + f"pre_mlp_layernorm.{s}", hf + f"ln_2.{s}")
            for s in suffixes:
                # ng = np here: each head's [q; k; v] rows -> [Q; K; V], then Conv1D's transpose.
                add(ours + f"self_attention.linear_qkv.{s}", hf + f"attn.c_attn.{s}",
                    lambda t: _conv1d(torch.cat(_split_qkv(t, a))),
                    lambda t: [_merge_qkv(*_conv1d(t)[0].chunk(3), a)])
                add(ours + f"self_attention.linear_proj.{s}", hf + f"attn.c_proj.{s}", _conv1d, _conv1d)
                add(ours + f"mlp.linear_fc1.{s}", hf + f"mlp.c_fc.{s}", _conv1d, _conv1d)
                add(ours + f"mlp.linear_fc2.{s}", hf + f"mlp.c_proj.{s}", _conv1d, _conv1d)
        for s in norm_suffixes:
            add(f"decoder.final_layernorm.{s}", f"transformer.ln_f.{s}")
    if not a.tied:
        add("output_layer.weight", "lm_head.weight")
    return rules


def _apply(rules, source: dict, side: int, what: str) -> dict:
    """Runs each rule from ``side`` (0: ours -> HF, 1: HF -> ours); every key of ``source``
    must be used. Outputs are fresh contiguous tensors (no shared storage, safetensors-ready)."""
    wanted = {name for rule in rules for name in rule[side]}
    missing, unexpected = sorted(wanted - source.keys()), sorted(source.keys() - wanted)
    if missing or unexpected:
        raise ConfigError(f"{what} do not fit the model: missing {missing[:4]}, unexpected {unexpected[:4]}")
    out = {}
    for rule in rules:
        names, targets, convert = rule[side], rule[1 - side], rule[2 + side]
        try:
            tensors = convert(*[source[n] for n in names])
        except RuntimeError as err:
            shapes = [tuple(source[n].shape) for n in names]
            raise ConfigError(f"{what}: {names[0]} has shape {shapes[0]}, which does not fit the model ({err})") from None
        for name, tensor in zip(targets, tensors):
            out[name] = tensor.clone(memory_format=torch.contiguous_format)
    return out


def _check_shapes(model_cls, config, state_dict, what):
    """Every tensor has the shape HF's own model (built on the meta device) gives it."""
    with torch.device("meta"):
        expected = model_cls(config).state_dict()
    for name, tensor in state_dict.items():  # unknown names are left to _apply's key check
        if name in expected and tuple(tensor.shape) != tuple(expected[name].shape):
            raise ConfigError(f"{what}: {name} has shape {tuple(tensor.shape)}, the config says "
                              f"{tuple(expected[name].shape)}")


def to_hf(full_params: dict[str, torch.Tensor], model: ModelConfig, model_config: TransformerConfig, vocab_size: int):
    """Our full (TP1) parameters -> ``(transformers config, HF state dict)``.

    ``full_params``: every parameter by global name (:func:`gather_full_params` at TP1/PP1, or
    all pipeline stages merged); ``model``: the run's model section; ``model_config``: the
    model's megatron config (it states the norm epsilon); ``vocab_size``: the tokenizer's,
    before padding (the HF model gets the padded size, as our embedding has).
    The state dict loads with ``strict=True`` into ``LlamaForCausalLM`` / ``GPT2LMHeadModel``
    built from the config; when tied, ``lm_head.weight`` is the embedding tensor itself (as in
    HF's own state dict; ``save_pretrained`` stores it once). Token ids (bos/eos/pad) are left unset: the
    caller sets them from the tokenizer (:mod:`megatron_dilocox.checkpoint.hf_tokenizer`).
    """
    family = hf_family(model)
    heads, groups = model.num_attention_heads, model.query_groups
    bias = not model.disable_bias_linear
    if family == "gpt2" and groups != heads:
        raise ConfigError(f"GPT-2 has no grouped-query attention: --num-query-groups {groups} must equal "
                          f"--num-attention-heads {heads}")
    if family == "gpt2" and not bias:
        raise ConfigError("GPT-2 always has linear biases: a model trained with --disable-bias-linear does not convert")
    arch = _Arch(family, model.num_layers, heads, groups, model.hidden_size // heads, bias,
                 tied=not model.untie_embeddings_and_output_weights)
    eps = model_config.layernorm_epsilon
    padded = padded_vocab_size(vocab_size, model)
    if family == "llama":
        model_cls = LlamaForCausalLM
        config = LlamaConfig(
            vocab_size=padded, hidden_size=model.hidden_size, intermediate_size=model.ffn_hidden_size,
            num_hidden_layers=model.num_layers, num_attention_heads=heads, num_key_value_heads=groups,
            head_dim=arch.head_dim, hidden_act="silu", max_position_embeddings=model.max_position_embeddings,
            rms_norm_eps=eps, rope_parameters={"rope_type": "default", "rope_theta": float(model.rotary_base)},
            attention_bias=bias, mlp_bias=bias, attention_dropout=model.attention_dropout,
            tie_word_embeddings=arch.tied, initializer_range=model.init_method_std,
            bos_token_id=None, eos_token_id=None, pad_token_id=None)
    else:
        model_cls = GPT2LMHeadModel
        config = GPT2Config(
            vocab_size=padded, n_positions=model.max_position_embeddings, n_embd=model.hidden_size,
            n_layer=model.num_layers, n_head=heads, n_inner=model.ffn_hidden_size, activation_function="gelu",
            layer_norm_epsilon=eps, resid_pdrop=model.hidden_dropout, embd_pdrop=model.hidden_dropout,
            attn_pdrop=model.attention_dropout, tie_word_embeddings=arch.tied,
            initializer_range=model.init_method_std, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    state_dict = _apply(_rules(arch), full_params, 0, "our parameters")
    rows = full_params["embedding.word_embeddings.weight"].shape[0]
    if rows != padded:
        raise ConfigError(f"the embedding has {rows} rows, but vocab size {vocab_size} pads to {padded} "
                          f"with --make-vocab-size-divisible-by {model.make_vocab_size_divisible_by}")
    if arch.tied:
        prefix = "model.embed_tokens" if family == "llama" else "transformer.wte"
        state_dict["lm_head.weight"] = state_dict[f"{prefix}.weight"]
    _check_shapes(model_cls, config, state_dict, "our parameters")
    return config, state_dict


def _require(ok, message):
    if not ok:
        raise ConfigError(message)


def _arch_and_flags(config):
    """The mapping and our flags for a HF config; refuses what our model computes differently."""
    model_type = getattr(config, "model_type", None)
    _require(model_type in ("llama", "gpt2"),
             f"Hugging Face model type {model_type!r} is not supported: only 'llama' and 'gpt2' convert")
    # No flag sets megatron's norm epsilon: a model with another one would compute other logits.
    eps = TransformerConfig.layernorm_epsilon
    c = config
    if model_type == "llama":
        _require(c.hidden_act == "silu", f"Llama hidden_act {c.hidden_act!r}: only 'silu' (SwiGLU) converts")
        _require(c.attention_bias == c.mlp_bias,
                 f"Llama attention_bias={c.attention_bias} with mlp_bias={c.mlp_bias}: one flag "
                 f"(--disable-bias-linear) covers both")
        head_dim = c.hidden_size // c.num_attention_heads
        _require(c.head_dim == head_dim, f"Llama head_dim {c.head_dim} != hidden_size / num_attention_heads = {head_dim}")
        rope = c.rope_parameters
        _require(rope.get("rope_type", "default") == "default" and len(rope.keys() - {"rope_type", "rope_theta"}) == 0,
                 f"Llama rope_parameters {rope}: only the default RoPE (rope_theta alone) converts")
        theta = rope["rope_theta"]
        _require(float(theta).is_integer(), f"Llama rope_theta {theta} is not an integer (--rotary-base is)")
        _require(c.rms_norm_eps == eps, f"Llama rms_norm_eps {c.rms_norm_eps} differs from megatron's {eps}")
        groups = c.num_key_value_heads or c.num_attention_heads
        arch = _Arch("llama", c.num_hidden_layers, c.num_attention_heads, groups, head_dim,
                     bool(c.attention_bias), bool(c.tie_word_embeddings))
        flags = dict(num_layers=c.num_hidden_layers, hidden_size=c.hidden_size,
                     num_attention_heads=c.num_attention_heads, num_query_groups=groups,
                     ffn_hidden_size=c.intermediate_size, max_position_embeddings=c.max_position_embeddings,
                     position_embedding_type="rope", rotary_base=int(theta), normalization="RMSNorm", swiglu=True)
    else:
        _require(c.activation_function == "gelu",
                 f"GPT-2 activation_function {c.activation_function!r}: only 'gelu' (exact, megatron's F.gelu) converts")
        _require(c.scale_attn_weights and not c.scale_attn_by_inverse_layer_idx and not c.add_cross_attention,
                 "GPT-2 attention must be scaled by 1/sqrt(head_dim) only, without cross-attention "
                 "(scale_attn_weights, scale_attn_by_inverse_layer_idx, add_cross_attention)")
        _require(c.layer_norm_epsilon == eps, f"GPT-2 layer_norm_epsilon {c.layer_norm_epsilon} differs from megatron's {eps}")
        arch = _Arch("gpt2", c.n_layer, c.n_head, c.n_head, c.n_embd // c.n_head, True, bool(c.tie_word_embeddings))
        flags = dict(num_layers=c.n_layer, hidden_size=c.n_embd, num_attention_heads=c.n_head,
                     num_query_groups=c.n_head, ffn_hidden_size=c.n_inner or 4 * c.n_embd,
                     max_position_embeddings=c.n_positions, position_embedding_type="learned_absolute",
                     normalization="LayerNorm", swiglu=False)
    flags.update(
        disable_bias_linear=not arch.bias,
        untie_embeddings_and_output_weights=not arch.tied,
        vocab_size=config.vocab_size,
        # Our padding then leaves the HF vocabulary as it is (on TP sizes dividing this).
        make_vocab_size_divisible_by=math.gcd(config.vocab_size, 128),
    )
    return arch, flags


def from_hf(hf_model_or_state_dict, hf_config):
    """A HF ``LlamaForCausalLM`` / ``GPT2LMHeadModel`` (or its ``state_dict()``) -> ``(our full
    parameters by global name, flags)``; the exact inverse of :func:`to_hf`.

    ``flags`` maps ``pretrain_gpt.py`` flags (by attribute name) to the values that
    build this model: pass them through :func:`as_argv`. ``vocab_size`` is the HF vocabulary and
    ``make_vocab_size_divisible_by`` keeps it unpadded.
    """
    arch, flags = _arch_and_flags(hf_config)
    state_dict = hf_model_or_state_dict
    if isinstance(state_dict, torch.nn.Module):
        state_dict = state_dict.state_dict()
    state_dict = dict(state_dict)
    model_cls = LlamaForCausalLM if arch.family == "llama" else GPT2LMHeadModel
    _check_shapes(model_cls, hf_config, state_dict, "the Hugging Face weights")
    if arch.tied:
        state_dict.pop("lm_head.weight", None)  # the embedding again (see the module docstring, (4))
    return _apply(_rules(arch), state_dict, 1, "the Hugging Face weights"), flags


def as_argv(flags: dict) -> list[str]:
    """``pretrain_gpt.py`` command-line words for :func:`from_hf`'s flags."""
    argv = []
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is not False:
            argv += [flag, str(value)]
    return argv
