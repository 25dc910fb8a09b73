"""A 4-process TP2/PP2 run on a dataset made with the tools learns, its metrics file is JSON lines,
and TensorBoard and W&B (offline) get the same numbers under Megatron-LM's tags."""

import math

import pytest

from launch import REPO, read_jsonl, read_tensorboard, read_wandb, torchrun


def test_tp2_pp2_lowers_validation_loss(tiny_dataset, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    torchrun(4, REPO / "pretrain_gpt.py", [
        "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--micro-batch-size", "4", "--global-batch-size", "16", "--train-iters", "200", "--lr", "3e-3",
        "--lr-warmup-iters", "10", "--lr-decay-style", "cosine", "--min-lr", "3e-4",
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--data-path", str(tiny_dataset / "c_text_document"), "--tokenizer-model", str(tiny_dataset / "sp.model"),
        "--data-cache-path", str(tmp_path / "cache"), "--split", "95,5,0",
        "--log-interval", "20", "--eval-interval", "20", "--eval-iters", "4", "--metrics-file", str(metrics),
        "--tensorboard-dir", str(tmp_path / "tb"),
        "--wandb-project", "tests", "--wandb-exp-name", "tp2-pp2", "--wandb-save-dir", str(tmp_path)],
        env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    records = read_jsonl(metrics)
    train = [r for r in records if "lm_loss" in r]
    evals = [r for r in records if "val_loss" in r]
    assert [r["iteration"] for r in train] == list(range(20, 201, 20))
    assert {"iteration", "lm_loss", "lr", "grad_norm", "tokens", "tokens_per_sec", "elapsed_s",
            "train_s"} <= set(train[0])
    assert {"iteration", "val_loss", "val_ppl", "eval_s"} <= set(evals[0])
    # Validation pauses the training clock: the wall clock runs ahead of it by exactly the
    # evaluations done so far (the log itself takes microseconds).
    for t in train:
        paused = sum(e["eval_s"] for e in evals if e["iteration"] < t["iteration"])
        assert paused > 0 or t["iteration"] == 20
        assert t["elapsed_s"] - t["train_s"] == pytest.approx(paused, abs=0.05), (t, paused)
    assert train[-1]["tokens"] == 200 * 16 * 64
    assert [r["iteration"] for r in evals] == list(range(20, 201, 20))
    # An untrained model scores about ln(vocab) = ln(400) = 6.0; most of the drop comes early.
    val = [r["val_loss"] for r in evals]
    assert val[-1] < math.log(400) - 1.5 and val[-1] < val[0] - 0.15, val
    # TensorBoard, read back with its own event reader: every number of the metrics file under
    # Megatron-LM's tag (float32 there), also against the samples consumed where Megatron-LM has it.
    board = read_tensorboard(tmp_path / "tb")
    for key, tag, records in (("lm_loss", "lm loss", train), ("lr", "learning-rate", train),
                              ("grad_norm", "grad-norm", train), ("val_loss", "lm loss validation", evals),
                              ("val_ppl", "lm loss validation ppl", evals)):
        expected = [(r["iteration"], pytest.approx(r[key], rel=1e-6)) for r in records]
        assert board[tag] == expected, tag
        assert board[f"{tag} vs samples"] == [(16 * step, value) for step, value in expected], tag
    assert board["batch-size"] == [(r["iteration"], 16) for r in train]
    assert [step for step, _ in board["iteration-time"]] == [r["iteration"] for r in train]
    assert board["tokens_per_sec"] == [(r["iteration"], pytest.approx(r["tokens_per_sec"], rel=1e-6)) for r in train]
    # W&B, read back from the offline run's log: the same tags at full precision, and the flags.
    config, history = read_wandb(tmp_path)
    assert (config["train_iters"], config["tensor_model_parallel_size"], config["wandb_exp_name"]) == (200, 2, "tp2-pp2")
    for key, tag, records in (("lm_loss", "lm loss", train), ("lr", "learning-rate", train),
                              ("grad_norm", "grad-norm", train), ("tokens_per_sec", "tokens_per_sec", train),
                              ("val_loss", "lm loss validation", evals), ("val_ppl", "lm loss validation ppl", evals)):
        assert history[tag] == [(r["iteration"], r[key]) for r in records], tag
    assert history["batch-size"] == [(r["iteration"], 16) for r in train]
    assert not any(tag.endswith(" vs samples") for tag in history)  # TensorBoard's alone, as in Megatron-LM
