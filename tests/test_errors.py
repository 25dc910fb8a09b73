"""Bad flags and bad input files fail fast with one line naming the flag or file."""

import os
import subprocess
import sys

import pytest

from launch import REPO, free_port

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "1", "--train-iters", "2", "--lr", "1e-3"]
MOCK = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64"]


def run_pretrain(args, world_env=False):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    if world_env:  # a one-process "torchrun" environment, without torchrun's own start-up cost
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    return subprocess.run([sys.executable, str(REPO / "pretrain_gpt.py"), *args], env=env,
                          capture_output=True, text=True, timeout=300)


def assert_one_line_error(proc, *needles):
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]


@pytest.mark.parametrize("extra, needles", [
    (["--hidden-size", "30"], ["--hidden-size 30", "--num-attention-heads 4"]),
    (["--tensor-model-parallel-size", "3"], ["--num-attention-heads 4", "--tensor-model-parallel-size 3"]),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
      "--no-overlap-p2p-communication", "--num-layers", "4"], ["--num-layers-per-virtual-pipeline-stage", "batched p2p"]),
    (["--dilocox", "--dilocox-local-steps", "0"], ["--dilocox-local-steps"]),
    (["--dilocox", "--dilocox-outer-momentum", "1"], ["--dilocox-outer-momentum"]),
    (["--dilocox", "--dilocox-local-steps-ramp-iters", "-1"], ["--dilocox-local-steps-ramp-iters"]),
    (["--dilocox", "--dilocox-local-steps-ramp-iters", "50", "--dilocox-max-local-steps", "40"],
     ["--dilocox-local-steps-ramp-iters", "--dilocox-max-local-steps"]),
    (["--dilocox", "--dilocox-rank", "4", "--dilocox-min-rank", "6"], ["--dilocox-min-rank", "--dilocox-rank"]),
    (["--dilocox", "--dilocox-rank-energy", "1.5"], ["--dilocox-rank-energy"]),
    (["--dilocox", "--dilocox-compression", "none", "--dilocox-keep-unsent"], ["--dilocox-keep-unsent"]),
    (["--dilocox", "--no-dilocox-error-feedback", "--dilocox-keep-unsent"], ["--dilocox-keep-unsent", "--dilocox-error-feedback"]),
    (["--dilocox", "--dilocox-compression", "none", "--dilocox-flush-residual"], ["--dilocox-flush-residual"]),
    (["--dilocox-lighthouse", "localhost:29510"], ["--dilocox-lighthouse needs --dilocox"]),
    (["--dilocox", "--dilocox-lighthouse", "localhost:29510"], ["--dilocox-cluster-index in 0..1, got None"]),
    (["--sequence-parallel"], ["--sequence-parallel"]),
    (["--save-interval", "10"], ["--save-interval needs --save"]),
    (["--load", "/nonexistent/ckpt"], ["--load", "/nonexistent/ckpt"]),
    (["--dilocox", "--use-distributed-optimizer", "--pipeline-model-parallel-size", "2"],
     ["--untie-embeddings-and-output-weights"]),
    (["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "/nonexistent.model"], ["/nonexistent.model"]),
])
def test_bad_flags(extra, needles):
    assert_one_line_error(run_pretrain(BASE + MOCK + extra), *needles)


def test_missing_data_path():
    assert_one_line_error(run_pretrain(BASE + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "64"]),
                          "--data-path")


def test_help_documents_every_flag():
    proc = subprocess.run([sys.executable, str(REPO / "pretrain_gpt.py"), "--help"], capture_output=True, text=True)
    assert proc.returncode == 0
    for flag in ("--num-layers", "--swiglu", "--num-layers-per-virtual-pipeline-stage", "--use-distributed-optimizer",
                 "--recompute-granularity", "--data-path", "--metrics-file", "--wandb-exp-name",
                 "--dilocox-sync-mode", "--dilocox-no-nesterov"):
        assert flag in proc.stdout


def _data_flags(dataset, prefix):
    return ["--data-path", str(prefix), "--tokenizer-model", str(dataset / "sp.model"), "--data-cache-path",
            str(dataset / "cache")]


def test_world_size_must_match_layout(tiny_dataset):
    proc = run_pretrain(BASE + _data_flags(tiny_dataset, tiny_dataset / "c_text_document") + ["--tensor-model-parallel-size", "2"],
                        world_env=True)
    assert_one_line_error(proc, "world size 1", "--tensor-model-parallel-size")


def test_truncated_bin_file(tiny_dataset, tmp_path):
    for ext in (".bin", ".idx"):
        (tmp_path / f"t{ext}").write_bytes((tiny_dataset / f"c_text_document{ext}").read_bytes())
    with open(tmp_path / "t.bin", "r+b") as f:
        f.truncate(os.path.getsize(tmp_path / "t.bin") - 10)
    proc = run_pretrain(BASE + _data_flags(tiny_dataset, tmp_path / "t"), world_env=True)
    assert_one_line_error(proc, "t.bin", "truncated")


def test_missing_bin_file(tiny_dataset):
    proc = run_pretrain(BASE + _data_flags(tiny_dataset, tiny_dataset / "nope"), world_env=True)
    assert_one_line_error(proc, "nope.bin", "not found")


def test_wrong_tokenizer_model(tiny_dataset):
    proc = run_pretrain(BASE + ["--data-path", str(tiny_dataset / "c_text_document"),
                                "--tokenizer-model", str(tiny_dataset / "corpus.jsonl")], world_env=True)
    assert_one_line_error(proc, "corpus.jsonl")


def test_dataset_from_another_tokenizer(tiny_dataset, tmp_path):
    subprocess.run([sys.executable, "tools/train_tokenizer.py", "--input", str(tiny_dataset / "corpus.jsonl"),
                    "--json-keys", "text", "--vocab-size", "350", "--model-prefix", str(tmp_path / "small")],
                   cwd=REPO, check=True, capture_output=True)
    proc = run_pretrain(BASE + ["--data-path", str(tiny_dataset / "c_text_document"), "--tokenizer-model",
                                str(tmp_path / "small.model"), "--data-cache-path", str(tmp_path)], world_env=True)
    assert_one_line_error(proc, "c_text_document.bin", "another --tokenizer-model")


def test_world_must_split_into_clusters():
    proc = run_pretrain(BASE + MOCK + ["--dilocox", "--dilocox-clusters", "2"], world_env=True)
    assert_one_line_error(proc, "--dilocox-clusters 2")


def test_dataset_records_its_tokenizer_and_refuses_a_larger_one(tiny_dataset, tmp_path):
    """preprocess_data.py writes the tokenizer's identity next to the .bin/.idx; a tokenizer with a
    larger vocabulary (every token id of the data still fits) is refused naming both."""
    import hashlib
    import json

    record = json.loads((tiny_dataset / "c_text_document.tokenizer.json").read_text())
    assert record == {"tokenizer_type": "SentencePieceTokenizer", "model": str(tiny_dataset / "sp.model"),
                      "model_sha256": hashlib.sha256((tiny_dataset / "sp.model").read_bytes()).hexdigest(),
                      "vocab_size": 400}
    subprocess.run([sys.executable, "tools/train_tokenizer.py", "--input", str(tiny_dataset / "corpus.jsonl"),
                    "--json-keys", "text", "--vocab-size", "450", "--model-prefix", str(tmp_path / "big")],
                   cwd=REPO, check=True, capture_output=True)
    proc = run_pretrain(BASE + ["--data-path", str(tiny_dataset / "c_text_document"), "--tokenizer-model",
                                str(tmp_path / "big.model"), "--data-cache-path", str(tmp_path)], world_env=True)
    assert_one_line_error(proc, "c_text_document.bin was made with another --tokenizer-model",
                          f"{tiny_dataset / 'sp.model'} (sha256 {record['model_sha256'][:12]}..., 400 tokens)",
                          f"this run has {tmp_path / 'big.model'} (sha256", "450 tokens)")


def test_dataset_without_a_tokenizer_record_is_still_checked(tiny_dataset, tmp_path):
    """Datasets made before the record existed load (the caller warns), and still fail the token-id check."""
    from megatron_dilocox.data.tokenizer import NullTokenizer, build_tokenizer
    from megatron_dilocox.training.data import _check_files

    for ext in (".bin", ".idx"):
        (tmp_path / f"old{ext}").write_bytes((tiny_dataset / f"c_text_document{ext}").read_bytes())
    tokenizer = build_tokenizer("SentencePieceTokenizer", str(tiny_dataset / "sp.model"))
    prefixes = [str(tiny_dataset / "c_text_document"), str(tmp_path / "old")]
    assert _check_files(prefixes, tokenizer) == [str(tmp_path / "old")]
    with pytest.raises(ValueError, match="old.bin holds token id .* but the tokenizer has 51 tokens"):
        _check_files([str(tmp_path / "old")], NullTokenizer(50))


def test_error_reaches_torchruns_summary_from_every_rank():
    """Under torchrun each rank that meets an error writes it to its error file: torchrun's summary
    names it even when the rank that would print it is killed first."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3",
                           f"--master-port={free_port()}", str(REPO / "pretrain_gpt.py"), *BASE, *MOCK,
                           "--load", "/nonexistent/ckpt"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    root_cause = proc.stderr.split("Root Cause (first observed failure):")[-1]
    assert "exitcode  : 2" in root_cause, proc.stderr
    assert "traceback : pretrain_gpt.py: error: --load: no such directory: /nonexistent/ckpt" in root_cause, proc.stderr


def test_split_without_a_sample_is_refused_before_training(tiny_dataset):
    """megatron-core would index an empty validation split forever; the test split is never read."""
    proc = run_pretrain(BASE + _data_flags(tiny_dataset, tiny_dataset / "c_text_document") + ["--split", "999,1,0"],
                        world_env=True)
    assert_one_line_error(proc, "--split 999,1,0: the validation split of", "gets 0 of its 60 documents",
                          "--seq-length + 1 = 17 tokens")
