"""A run with a SentencePiece tokenizer, exported with tools/checkpoint/convert.py to-hf: the folder
works with transformers alone (AutoTokenizer, AutoModelForCausalLM, generate), encodes as the
run's data was encoded, and gives the run's own validation loss on the run's validation tokens."""

import json
import re
import shutil
import subprocess
import sys

import pytest
import sentencepiece as spm
import torch

from launch import REPO, read_jsonl, torchrun, worker_env

ITERS = 30
TRICKY = ["  leading spaces", "trailing  spaces  ", "a docstring saying <s>, </s> and <unk> as text",
          "ｆｕｌｌｗｉｄｔｈ ① ﬁ", "tab\tand\nnewline", "bytes: é 🤖 中文", "", " ", "▁already escaped"]


def _flags(ds, out):
    return ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--position-embedding-type", "rope", "--normalization", "RMSNorm",
            "--swiglu", "--disable-bias-linear", "--micro-batch-size", "4", "--global-batch-size", "4",
            "--train-iters", str(ITERS), "--lr", "1e-2", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--data-path", str(ds / "c_text_document"), "--tokenizer-type", "SentencePieceTokenizer",
            "--tokenizer-model", str(ds / "sp.model"), "--data-cache-path", str(out / "cache"),
            "--split", "80,20,0", "--full-validation", "--eval-interval", str(ITERS), "--log-interval", "10",
            "--save", str(out / "ckpt"), "--save-interval", str(ITERS), "--metrics-file", str(out / "metrics.jsonl")]


def _convert(*argv, ok=True):
    proc = subprocess.run([sys.executable, "tools/checkpoint/convert.py", *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env=worker_env())
    assert (proc.returncode == 0) == ok, proc.stdout + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def exported(tiny_dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_tokenizer")
    flags = _flags(tiny_dataset, out)
    torchrun(1, "pretrain_gpt.py", flags)
    printed = _convert("to-hf", "--load", str(out / "ckpt"), "--save", str(out / "hf")).stdout
    return out, flags, printed


def _texts(ds):
    with open(ds / "corpus.jsonl", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f] + TRICKY


def test_the_folder_encodes_as_sentencepiece(tiny_dataset, exported):
    from transformers import AutoTokenizer

    out, _, printed = exported
    sp = spm.SentencePieceProcessor(model_file=str(tiny_dataset / "sp.model"))
    tokenizer = AutoTokenizer.from_pretrained(out / "hf")
    assert "> tokenizer: " in printed and f"({sp.get_piece_size()} pieces, bos 2, eos 3)" in printed
    assert (out / "hf" / "tokenizer.model").read_bytes() == (tiny_dataset / "sp.model").read_bytes()
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (sp.bos_id(), sp.eos_id(), sp.pad_id())
    for text in _texts(tiny_dataset):
        ids = sp.encode(text)
        assert tokenizer(text, add_special_tokens=False)["input_ids"] == ids, text[:80]
        assert tokenizer.decode(ids) == sp.decode(ids), text[:80]


def test_hf_loss_on_the_validation_tokens_is_our_validation_loss(exported):
    """The run's validation split rebuilt with the run's own data code, scored by transformers."""
    from transformers import AutoModelForCausalLM

    from megatron_dilocox.arguments import parse_args
    from megatron_dilocox.data.tokenizer import build_tokenizer
    from megatron_dilocox.training.data import build_datasets

    out, flags, _ = exported
    run = parse_args(flags)
    _, valid = build_datasets(run, build_tokenizer("SentencePieceTokenizer", run.data.tokenizer_model))
    batch = run.training.global_batch_size
    samples = [valid[i] for i in range(len(valid) // batch * batch)]  # whole batches, as validation reads
    tokens = torch.stack([s["tokens"] for s in samples])
    labels = torch.stack([s["labels"] for s in samples])
    assert len(samples) >= 100 and len(torch.unique(tokens)) > 100  # a real split, not a few ids
    model = AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        logits = torch.cat([model(chunk).logits for chunk in tokens.split(64)])
    theirs = torch.nn.functional.cross_entropy(logits.flatten(0, 1).double(), labels.flatten()).item()
    ours = [r["val_loss"] for r in read_jsonl(out / "metrics.jsonl") if "val_loss" in r and r["iteration"] == ITERS]
    print(f"validation loss over {len(samples)} samples: ours {ours[-1]:.6f}, transformers {theirs:.6f}")
    assert abs(theirs - ours[-1]) < 1e-5 * ours[-1]


def test_generate_runs_on_the_folder(exported):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _, _ = exported
    tokenizer = AutoTokenizer.from_pretrained(out / "hf")
    model = AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float32).eval()
    assert (model.generation_config.eos_token_id, model.generation_config.pad_token_id) == (3, 0)
    prompt = tokenizer("def main(argv):", return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    new = generated[0, prompt["input_ids"].shape[1]:]
    assert torch.equal(generated[0, :prompt["input_ids"].shape[1]], prompt["input_ids"][0])
    assert 0 < len(new) <= 12 and tokenizer.decode(generated[0]).startswith("def main(argv):")
    # Greedy: each new token is the argmax of the logits of what came before it.
    with torch.no_grad():
        logits = model(generated[:, :-1]).logits[0, prompt["input_ids"].shape[1] - 1:]
    assert torch.equal(logits.argmax(-1), new)


def test_from_hf_hands_the_tokenizer_back(tiny_dataset, exported, tmp_path):
    out, _, _ = exported
    printed = _convert("from-hf", "--load", str(out / "hf"), "--save", str(tmp_path / "ours")).stdout
    back = tmp_path / "ours" / "tokenizer.model"
    assert back.read_bytes() == (tiny_dataset / "sp.model").read_bytes()
    assert f"--tokenizer-type SentencePieceTokenizer --tokenizer-model {back} --load {tmp_path / 'ours'}" in printed
    # A folder whose tokenizer disagrees with its config is refused, naming both.
    bad = tmp_path / "bad"
    shutil.copytree(out / "hf", bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "eos_token_id": 5}))
    err = _convert("from-hf", "--load", str(bad), "--save", str(tmp_path / "refused"), ok=False).stderr
    assert re.search(r"tokenizer\.model has eos id 3, config\.json says 5$", err.strip()), err


def test_to_hf_names_a_moved_tokenizer(exported, tmp_path):
    out, _, _ = exported
    moved = tmp_path / "ckpt"
    shutil.copytree(out / "ckpt", moved)
    err = _convert("to-hf", "--load", str(moved), "--save", str(tmp_path / "hf"), "--tokenizer-model",
                   str(tmp_path / "gone.model"), ok=False).stderr
    assert err.strip().endswith(f"--tokenizer-model {tmp_path / 'gone.model'}: file not found "
                                "(the run's SentencePiece model; name where it is now)"), err
    assert not (tmp_path / "hf").exists()
