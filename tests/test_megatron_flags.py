"""The flags of Megatron-LM's own GPT-3 launch scripts (examples/gpt3/train_gpt3_175b_distributed.sh
and train_gpt3_857m_distributed.sh in NVIDIA/Megatron-LM, the same flag set at two sizes): each one
works here with Megatron-LM's meaning, or is refused by name; none is silently ignored."""

import pytest

from megatron_dilocox.arguments import NOT_SUPPORTED, parse_args
from megatron_dilocox.errors import ConfigError

# The 175B script's flags with its placeholders filled in ($CHECKPOINT_PATH, ...).
GPT3_175B = [
    ["--num-layers", "96"], ["--hidden-size", "12288"], ["--num-attention-heads", "96"],
    ["--seq-length", "2048"], ["--max-position-embeddings", "2048"], ["--attention-backend", "auto"],
    ["--micro-batch-size", "1"], ["--global-batch-size", "1536"], ["--rampup-batch-size", "16", "16", "5859375"],
    ["--train-iters", "500000"], ["--weight-decay", "0.1"], ["--adam-beta1", "0.9"], ["--adam-beta2", "0.95"],
    ["--init-method-std", "0.006"], ["--clip-grad", "1.0"], ["--fp16"], ["--lr", "6.0e-5"],
    ["--lr-decay-style", "cosine"], ["--min-lr", "6.0e-6"], ["--lr-warmup-fraction", ".001"],
    ["--lr-decay-iters", "430000"], ["--tensor-model-parallel-size", "8"], ["--pipeline-model-parallel-size", "16"],
    ["--data-path", "data/my-gpt3_00_text_document"], ["--vocab-file", "gpt2-vocab.json"],
    ["--merge-file", "gpt2-merges.txt"], ["--split", "949,50,1"], ["--log-interval", "100"],
    ["--save-interval", "10000"], ["--eval-interval", "1000"], ["--save", "ckpt"], ["--load", "ckpt"],
    ["--eval-iters", "10"], ["--tensorboard-dir", "tb"],
]

# Where each supported flag's value lands, as Megatron-LM's args would hold it.
MEANING = {
    "--num-layers": ("model", "num_layers", 96), "--hidden-size": ("model", "hidden_size", 12288),
    "--num-attention-heads": ("model", "num_attention_heads", 96), "--seq-length": ("model", "seq_length", 2048),
    "--max-position-embeddings": ("model", "max_position_embeddings", 2048),
    "--attention-backend": ("model", "attention_backend", "auto"),
    "--micro-batch-size": ("training", "micro_batch_size", 1),
    "--global-batch-size": ("training", "global_batch_size", 1536),
    "--train-iters": ("training", "train_iters", 500000), "--weight-decay": ("training", "weight_decay", 0.1),
    "--adam-beta1": ("training", "adam_beta1", 0.9), "--adam-beta2": ("training", "adam_beta2", 0.95),
    "--init-method-std": ("model", "init_method_std", 0.006), "--clip-grad": ("training", "clip_grad", 1.0),
    "--lr": ("training", "lr", 6e-5), "--lr-decay-style": ("training", "lr_decay_style", "cosine"),
    "--min-lr": ("training", "min_lr", 6e-6),
    # Megatron-LM: warmup steps = lr_warmup_fraction * lr_decay_iters (with the script's 430000).
    "--lr-warmup-fraction": ("training", "lr_warmup_steps", 0.001 * 430000),
    "--lr-decay-iters": ("training", "lr_decay_iters", 430000),
    "--tensor-model-parallel-size": ("parallel", "tensor_model_parallel_size", 8),
    "--pipeline-model-parallel-size": ("parallel", "pipeline_model_parallel_size", 16),
    "--data-path": ("data", "data_path", ["data/my-gpt3_00_text_document"]),
    "--split": ("data", "split", "949,50,1"), "--log-interval": ("logging", "log_interval", 100),
    "--save-interval": ("checkpoint", "save_interval", 10000), "--eval-interval": ("logging", "eval_interval", 1000),
    "--save": ("checkpoint", "save", "ckpt"), "--load": ("checkpoint", "load", "ckpt"),
    "--eval-iters": ("logging", "eval_iters", 10), "--tensorboard-dir": ("logging", "tensorboard_dir", "tb"),
}
REFUSED = {"--rampup-batch-size", "--fp16", "--vocab-file", "--merge-file"}
# What every run needs besides the flag under test (the script's model and batch, mock data, and
# a decay length that leaves room for any warmup), so that the flag alone decides the outcome.
BASE = ["--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96", "--seq-length", "2048",
        "--max-position-embeddings", "2048", "--micro-batch-size", "1", "--train-iters", "500000",
        "--lr", "6.0e-5", "--lr-decay-iters", "430000", "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "50257"]

# Stricter than Megatron-LM: an interval needs a directory, and a --load directory that does not
# exist yet is fine only as the --save one (the script's first launch).
COMPANIONS = {"--save-interval": ["--save", "ckpt"], "--load": ["--save", "ckpt"]}


def test_every_flag_is_covered():
    assert {flag[0] for flag in GPT3_175B} == set(MEANING) | REFUSED
    assert REFUSED <= set(NOT_SUPPORTED)


@pytest.mark.parametrize("flag", GPT3_175B, ids=lambda flag: flag[0])
def test_each_flag_works_with_megatron_lms_meaning_or_is_refused_by_name(flag):
    name = flag[0]
    argv = [a for a in BASE if not (name == "--data-path" and a == "--mock-data")] + flag + COMPANIONS.get(name, [])
    if name in REFUSED:
        with pytest.raises(ConfigError) as err:
            parse_args(argv)
        assert str(err.value) == f"{name} is a Megatron-LM flag not supported here: {NOT_SUPPORTED[name]}"
        return
    section, field, expected = MEANING[name]
    value = getattr(getattr(parse_args(argv), section), field)
    assert value == pytest.approx(expected) if isinstance(expected, float) else value == expected


def test_the_whole_script_stops_at_its_first_unsupported_flag():
    argv = [token for flag in GPT3_175B for token in flag]
    with pytest.raises(ConfigError, match="^--rampup-batch-size is a Megatron-LM flag not supported here"):
        parse_args(argv)


def test_other_attention_backends_and_unknown_flags_are_refused(capsys):
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--attention-backend", "flash"])
    assert "--attention-backend: invalid choice: 'flash'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--no-such-flag", "3"])
    assert "unrecognized arguments: --no-such-flag 3" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="^--load: no such directory: elsewhere$"):
        parse_args(BASE + ["--save", "ckpt", "--load", "elsewhere"])
    with pytest.raises(ConfigError, match="--lr-warmup-fraction and --lr-warmup-iters exclude each other"):
        parse_args(BASE + ["--lr-warmup-fraction", "0.01", "--lr-warmup-iters", "10"])
