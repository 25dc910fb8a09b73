"""Hugging Face conversion (megatron_dilocox/checkpoint/hf.py): our model and the transformers
model made from it give the same logits, both ways, and the mapping round-trips exactly.

The megatron side runs in one forked child (a 1-rank gloo world, megatron at TP1/PP1, the CPU
bridge installed): none of that global state reaches the pytest process.
"""

import pytest
import torch
import transformers

from launch import free_port, run_in_fork
from megatron_dilocox.arguments import parse_args
from megatron_dilocox.errors import ConfigError
from megatron_dilocox.checkpoint.hf import as_argv, from_hf, hf_family, to_hf

VOCAB, SEQ, TOL = 100, 32, 1e-4  # VOCAB pads to 128: the HF models get the padded size
TRAIN = ["--seq-length", str(SEQ), "--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-3",
         "--mock-data", "--tokenizer-type", "NullTokenizer", "--hidden-dropout", "0", "--attention-dropout", "0"]
# init std 0.2: attention far from uniform, so a swapped q/k/v or gate/up changes the logits.
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--init-method-std", "0.2"]
LLAMA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--ffn-hidden-size", "96"]
CASES = {
    "llama": LLAMA + ["--disable-bias-linear", "--untie-embeddings-and-output-weights", "--num-query-groups", "2",
                      "--rotary-base", "5000"],
    "gpt2": [],  # learned_absolute, LayerNorm, GELU, biases, tied
    "llama-mqa-bias-tied": LLAMA + ["--num-query-groups", "1"],
}
HF_CLASSES = {"llama": transformers.LlamaForCausalLM, "gpt2": transformers.GPT2LMHeadModel}
MODEL_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
               "max_position_embeddings", "position_embedding_type", "normalization", "swiglu",
               "disable_bias_linear", "untie_embeddings_and_output_weights")


def flags_for(case, *extra):
    return parse_args(MODEL + TRAIN + ["--vocab-size", str(VOCAB)] + CASES[case] + list(extra))


def _perturb_1d(module, gen):
    """Norm weights and biases off their ones/zeros init, so a misplaced one shows."""
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn(p.shape, generator=gen))


def _wrong_mappings(family, params, sd, config):
    """Plausible mapping mistakes; each must change the logits (the check is sensitive to them)."""
    qkv0 = params["decoder.layers.0.self_attention.linear_qkv.weight"]
    if family == "llama":
        p = "model.layers.0."
        yield "k_proj <-> v_proj", {**sd, p + "self_attn.k_proj.weight": sd[p + "self_attn.v_proj.weight"],
                                    p + "self_attn.v_proj.weight": sd[p + "self_attn.k_proj.weight"]}, config
        yield "gate <-> up", {**sd, p + "mlp.gate_proj.weight": sd[p + "mlp.up_proj.weight"],
                              p + "mlp.up_proj.weight": sd[p + "mlp.gate_proj.weight"]}, config
        if config.num_key_value_heads > 1:  # with one group megatron's layout is [Q; K; V] already
            kv_rows = config.num_key_value_heads * config.head_dim
            q, k, v = qkv0.split([config.hidden_size, kv_rows, kv_rows])  # grouped QKV read as [Q; K; V]
            yield "QKV not regrouped", {**sd, p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                                        p + "self_attn.v_proj.weight": v}, config
        theta = 2 * config.rope_parameters["rope_theta"]
        other = transformers.LlamaConfig(**{**config.to_dict(), "rope_parameters": {"rope_type": "default",
                                                                                  "rope_theta": theta}})
        yield "rope_theta 2 x --rotary-base", sd, other
    else:
        p = "transformer.h.0."
        yield "QKV not regrouped", {**sd, p + "attn.c_attn.weight": qkv0.t()}, config
        yield "c_proj not transposed", {**sd, p + "attn.c_proj.weight": sd[p + "attn.c_proj.weight"].t()}, config
        other = transformers.GPT2Config(**{**config.to_dict(), "activation_function": "gelu_new"})
        yield "gelu_new instead of gelu", sd, other


def _megatron_scenarios():
    """Runs in the forked child: every measurement the tests check."""
    from megatron_dilocox.platform import cpu

    cpu.install()
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_dilocox.arguments import padded_vocab_size
    from megatron_dilocox.training.model import (
        _global_names, build_gpt_chunks, gather_full_params, initialize_parameters, transformer_config)

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)

    def ours(args, vocab, params=None):
        config = transformer_config(args)
        tied = not args.model.untie_embeddings_and_output_weights
        (chunk,) = build_gpt_chunks(args.model, config, padded_vocab_size(vocab, args.model))
        if params is None:
            initialize_parameters([chunk], config, seed=7, tied=tied)
            _perturb_1d(chunk, torch.Generator().manual_seed(8))
        else:
            with torch.no_grad():
                for param, name in _global_names(chunk, tied).items():
                    param.copy_(params[name])
        return chunk.eval()

    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(9))
    positions = torch.arange(SEQ).expand(2, SEQ)

    def max_diff(chunk, hf):
        with torch.no_grad():
            return (chunk(tokens, positions, None) - hf(tokens).logits).abs().max().item()

    def hf_model(family, config, sd):
        model = HF_CLASSES[family](config).eval()
        model.load_state_dict(sd, strict=True)
        return model

    results = {}
    for case in CASES:
        r = results[case] = {}
        args = flags_for(case)
        family = hf_family(args.model)
        chunk = ours(args, VOCAB)
        params = gather_full_params([chunk], tied=not args.model.untie_embeddings_and_output_weights)
        config, sd = to_hf(params, args.model, transformer_config(args), VOCAB)
        hf = hf_model(family, config, sd)
        r["vocab"] = config.vocab_size
        r["export_diff"] = max_diff(chunk, hf)
        r["wrong_mapping_diffs"] = {what: max_diff(chunk, hf_model(family, cfg, wrong))
                                    for what, wrong, cfg in _wrong_mappings(family, params, sd, config)}
        for source in ("state_dict", "model"):
            back, flags = from_hf(sd if source == "state_dict" else hf, config)
            r[f"round_trip_{source}"] = (back.keys() == params.keys()
                                         and all(torch.equal(back[k], params[k]) for k in params))
        model = args.model
        model.num_query_groups = model.query_groups  # None: one per head
        r["flags_mismatch"] = {k: (getattr(model, k), flags[k]) for k in MODEL_FLAGS if getattr(model, k) != flags[k]}

        # Import: a HF model of its own init (HF's, plus perturbed norms/biases) becomes ours.
        torch.manual_seed(10)
        theirs = HF_CLASSES[family](config).eval()
        _perturb_1d(theirs, torch.Generator().manual_seed(11))
        hf_weights = theirs.state_dict()
        if config.tie_word_embeddings:
            del hf_weights["lm_head.weight"]  # as save_pretrained stores a tied model
        imported, flags = from_hf(hf_weights, theirs.config)
        args_in = parse_args(as_argv(flags) + TRAIN)
        r["import_padded_vocab"] = padded_vocab_size(args_in.data.vocab_size, args_in.model)
        r["import_diff"] = max_diff(ours(args_in, args_in.data.vocab_size, imported), theirs)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return results


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    return run_in_fork(_megatron_scenarios, tmp_path_factory.mktemp("hf"))


@pytest.mark.parametrize("case", CASES)
def test_exported_model_gives_our_logits(measured, case):
    r = measured[case]
    print(f"{case}: max |logits ours - HF| = {r['export_diff']:.3g}; wrong mappings: "
          + ", ".join(f"{what} {diff:.3g}" for what, diff in r["wrong_mapping_diffs"].items()))
    assert r["vocab"] == 128
    assert r["export_diff"] < TOL


@pytest.mark.parametrize("case", CASES)
def test_logit_check_catches_wrong_mappings(measured, case):
    diffs = measured[case]["wrong_mapping_diffs"]
    assert len(diffs) >= 2
    for what, diff in diffs.items():
        assert diff > 10 * TOL, f"{case}: {what} went unnoticed (max diff {diff:.3g})"


@pytest.mark.parametrize("case", CASES)
def test_round_trip_is_exact(measured, case):
    r = measured[case]
    assert r["round_trip_state_dict"] and r["round_trip_model"]
    assert r["flags_mismatch"] == {}


@pytest.mark.parametrize("case", CASES)
def test_imported_model_gives_hf_logits(measured, case):
    r = measured[case]
    print(f"{case}: max |logits HF - ours (imported)| = {r['import_diff']:.3g}")
    assert r["import_padded_vocab"] == 128  # our padding leaves the HF vocabulary as it is
    assert r["import_diff"] < TOL


def test_family_from_flags():
    assert hf_family(flags_for("llama").model) == "llama"
    assert hf_family(flags_for("gpt2").model) == "gpt2"
    with pytest.raises(ConfigError, match="--position-embedding-type rope --normalization LayerNorm"):
        hf_family(flags_for("gpt2", "--position-embedding-type", "rope").model)
    with pytest.raises(ConfigError, match=r"--normalization RMSNorm \(no --swiglu\) fits no"):
        hf_family(flags_for("gpt2", "--position-embedding-type", "rope", "--normalization", "RMSNorm").model)


def _to_hf(params, args, vocab):
    from megatron_dilocox.training.model import transformer_config

    return to_hf(params, args.model, transformer_config(args), vocab)


def test_gpt2_refuses_what_it_cannot_hold():
    with pytest.raises(ConfigError, match="--num-query-groups 2 must equal --num-attention-heads 4"):
        _to_hf({}, flags_for("gpt2", "--num-query-groups", "2"), VOCAB)
    with pytest.raises(ConfigError, match="--disable-bias-linear"):
        _to_hf({}, flags_for("gpt2", "--disable-bias-linear"), VOCAB)


def _gpt2_config(**changes):
    return transformers.GPT2Config(**{"n_layer": 1, "n_embd": 64, "n_head": 4, "n_positions": SEQ,
                                      "vocab_size": 128, "activation_function": "gelu",
                                      "bos_token_id": None, "eos_token_id": None, **changes})


def test_to_hf_checks_names_and_vocab():
    args = flags_for("gpt2", "--num-layers", "1")
    with pytest.raises(ConfigError, match=r"missing \['decoder.final_layernorm.bias'"):
        _to_hf({}, args, VOCAB)
    params, _ = from_hf(transformers.GPT2LMHeadModel(_gpt2_config()), _gpt2_config())
    assert _to_hf(params, args, VOCAB)[0].vocab_size == 128
    with pytest.raises(ConfigError, match="the embedding has 128 rows, but vocab size 300 pads to 384"):
        _to_hf(params, args, 300)


def test_from_hf_refuses_what_our_model_computes_differently():
    with pytest.raises(ConfigError, match="model type 'bert' is not supported"):
        from_hf({}, transformers.BertConfig())
    with pytest.raises(ConfigError, match="'gelu_new'"):
        from_hf({}, _gpt2_config(activation_function="gelu_new"))
    with pytest.raises(ConfigError, match="rms_norm_eps 1e-06"):
        from_hf({}, transformers.LlamaConfig(rms_norm_eps=1e-6))
    with pytest.raises(ConfigError, match="rope_type"):
        from_hf({}, transformers.LlamaConfig(rope_scaling={"rope_type": "linear", "factor": 2.0}, rms_norm_eps=1e-5))
    with pytest.raises(ConfigError, match="hidden_act 'gelu'"):
        from_hf({}, transformers.LlamaConfig(hidden_act="gelu"))


def test_from_hf_checks_weights():
    sd = transformers.GPT2LMHeadModel(_gpt2_config()).state_dict()
    with pytest.raises(ConfigError, match=r"missing \['transformer.ln_f.bias'\]"):
        from_hf({k: v for k, v in sd.items() if k != "transformer.ln_f.bias"}, _gpt2_config())
    with pytest.raises(ConfigError, match=r"unexpected \['extra'\]"):
        from_hf({**sd, "extra": torch.zeros(1)}, _gpt2_config())
    with pytest.raises(ConfigError, match=r"transformer.wte.weight has shape \(128, 64\), the config says \(256, 64\)"):
        from_hf(sd, _gpt2_config(vocab_size=256))
