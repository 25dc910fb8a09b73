"""Megatron-LM's torch_dist checkpoints, both ways, proven with Megatron-LM's own code
(tests/megatron_lm_side.py: its parser, model config, ``save_checkpoint`` and ``load_checkpoint``
on CPU; ``megatron.training`` ships with megatron-core 0.17+, so these run on the Python 3.12 leg):

* a checkpoint Megatron-LM saved loads here with its logits, and a DiLoCoX run trains on from its
  iteration and learning-rate schedule;
* that run's checkpoint, converted with ``tools/checkpoint/convert.py to-megatron-lm``, loads in
  Megatron-LM with our logits.
"""

import functools
import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch

import megatron_lm_side as mlm
from launch import REPO, free_port, run_in_fork, torchrun, worker_env

needs_megatron_lm = pytest.mark.skipif(importlib.util.find_spec("megatron.training") is None,
                                       reason="Megatron-LM's training package ships with megatron-core 0.17+ (Python 3.12)")
TOL = 1e-5
RESUMED_AT = mlm.ITERATION + 1


def _megatron_lm(action: str, directory) -> None:
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "megatron_lm_side.py"), action, str(directory)],
                          cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"Megatron-LM {action} failed:\n{(proc.stdout + proc.stderr)[-6000:]}"


def _our_logits(folders: dict) -> dict:
    """In a forked child: our TP1 model of :data:`megatron_lm_side.MODEL`, loaded from each folder."""
    from megatron_dilocox.platform import cpu

    cpu.install()
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_dilocox.arguments import padded_vocab_size, parse_args
    from megatron_dilocox.checkpoint.checkpointing import load_weights
    from megatron_dilocox.training.model import build_gpt_chunks, transformer_config

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(99)
    run = parse_args(mlm.MODEL + mlm.SCHEDULE + ["--mock-data"])
    (chunk,) = build_gpt_chunks(run.model, transformer_config(run), padded_vocab_size(100, run.model))
    chunk.eval()
    logits = {}
    for name, folder in folders.items():
        load_weights([chunk], folder)
        logits[name] = mlm.logits(chunk)
    return logits


@pytest.fixture(scope="module")
def trip(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_lm")
    theirs, ours, back = root / "megatron_lm", root / "ours", root / "back"
    theirs.mkdir()
    _megatron_lm("save", theirs)
    run = torchrun(2, REPO / "pretrain_gpt.py", [
        *mlm.MODEL, *mlm.SCHEDULE, "--mock-data", "--dilocox", "--dilocox-clusters", "2", "--dilocox-local-steps", "2",
        "--dilocox-local-steps-ramp-iters", "0",
        "--load", str(theirs), "--save", str(ours), "--log-interval", "1", "--eval-iters", "1"])
    convert = subprocess.run([sys.executable, "tools/checkpoint/convert.py", "to-megatron-lm", "--load", str(ours),
                              "--save", str(back)], cwd=REPO, env=worker_env(), capture_output=True, text=True,
                             timeout=300)
    assert convert.returncode == 0, convert.stderr[-4000:]
    _megatron_lm("load", back)
    our = run_in_fork(functools.partial(_our_logits, {"theirs": theirs / f"iter_{mlm.ITERATION:07d}",
                                                      "ours": ours / "iter_0000020"}), root)
    return {"log": run.stdout + run.stderr, "convert": convert.stdout, "our": our,
            "saved": torch.load(theirs / "saved_logits.pt"), "loaded": torch.load(back / "loaded_logits.pt")}


@needs_megatron_lm
def test_megatron_lm_checkpoint_gives_its_logits_here(trip):
    assert (trip["our"]["theirs"] - trip["saved"]).abs().max().item() < TOL
    assert trip["saved"].abs().max().item() > 1.0  # logits far from zero: the check can fail


@needs_megatron_lm
def test_dilocox_trains_on_from_its_iteration_and_schedule(trip):
    log = trip["log"]
    assert f"iteration {mlm.ITERATION}): weights only (resharded from a Megatron-LM checkpoint)" in log, log[-3000:]
    first = next(line for line in log.splitlines() if "| consumed samples:" in line)
    assert f"iteration {RESUMED_AT:8d}/      20" in first, first
    # Cosine from 1e-3 to 1e-4 after 2 warm-up iterations over 20: at iteration 8, 1e-4 + 9e-4 * 0.75.
    assert "learning rate: 7.750000E-04" in first, first
    assert "saved checkpoint at iteration       20" in log
    # Outer rounds every H = 2 iterations from the loaded one on; the last iteration ends a short one.
    rounds = [int(i) for i in re.findall(r"outer step +\d+ at iteration +(\d+)", log)]
    assert rounds == list(range(RESUMED_AT + 1, 20, 2)) + [20], rounds


@needs_megatron_lm
def test_our_checkpoint_converted_loads_in_megatron_lm_with_our_logits(trip):
    assert "Megatron-LM torch_dist, iteration 20" in trip["convert"]
    assert trip["loaded"]["iteration"] == 20
    assert (trip["loaded"]["logits"] - trip["our"]["ours"]).abs().max().item() < TOL
    # Trained on since: not Megatron-LM's weights any more.
    assert (trip["our"]["ours"] - trip["saved"]).abs().max().item() > 1e-3


# -- the reader's checks, on both interpreters (folders written by megatron-core's dist_checkpointing) --


def _reader_scenarios(root: str) -> dict:
    """In a forked child (a 1-rank world: dist_checkpointing writes collectively): what the reader
    says about folders in Megatron-LM's layout."""
    from megatron_dilocox.platform import cpu

    cpu.install()
    import argparse

    import torch.distributed as dist

    from megatron_dilocox.checkpoint import megatron_lm
    from megatron_dilocox.checkpoint.checkpointing import tracked_folder
    from megatron_dilocox.errors import CheckpointError

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    weights = {"w": torch.arange(4.0)}
    args = dict(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=1,
                group_query_attention=False, position_embedding_type="learned_absolute",
                max_position_embeddings=32, normalization="LayerNorm", swiglu=False,
                untie_embeddings_and_output_weights=False, add_bias_linear=True, padded_vocab_size=128,
                global_batch_size=4)
    results = {}

    def outcome(folder):
        try:
            return megatron_lm.read_manifest(folder)
        except CheckpointError as err:
            return str(err)

    plain = megatron_lm.save(os.path.join(root, "plain"), 3, weights, argparse.Namespace(**args))
    results["plain"] = (str(tracked_folder(os.path.join(root, "plain"))), outcome(plain))
    results["folder_itself"] = str(tracked_folder(plain))  # --load naming the iteration folder
    results["qk"] = outcome(megatron_lm.save(os.path.join(root, "qk"), 3, weights,
                                             argparse.Namespace(**args, qk_layernorm=True)))
    results["no_args"] = outcome(megatron_lm.save(os.path.join(root, "no_args"), 3, weights, None))
    release = megatron_lm.save(os.path.join(root, "release"), 0, weights, argparse.Namespace(**args))
    os.replace(release, os.path.join(root, "release", megatron_lm.RELEASE))
    with open(os.path.join(root, "release", "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("release")
    results["release"] = str(tracked_folder(os.path.join(root, "release")))
    return results


@pytest.fixture(scope="module")
def read(tmp_path_factory):
    root = tmp_path_factory.mktemp("reader")
    return root, run_in_fork(functools.partial(_reader_scenarios, str(root)), root, timeout=120)


def test_its_args_become_our_model_flags(read):
    root, results = read
    folder, manifest = results["plain"]
    assert folder == str(root / "plain" / "iter_0000003") == results["folder_itself"]
    assert manifest["iteration"] == 3 and manifest["global_batch_size"] == 4 and manifest["layout"] is None
    # Megatron-LM's num_query_groups (1) counts only with --group-query-attention; add_bias_linear is negated.
    assert manifest["model"]["num_query_groups"] == 4 and manifest["model"]["disable_bias_linear"] is False
    assert manifest["args"]["num_query_groups"] == 4 and manifest["args"]["rotary_base"] == 10000
    assert "scheduler" not in manifest  # Megatron-LM saves its schedule with the optimizer only: ours follows the iteration


def test_a_model_we_do_not_build_is_refused_by_flag(read):
    _, results = read
    assert results["qk"].endswith("trained with --qk-layernorm True, a model this package does not build")
    assert results["no_args"].endswith("not a Megatron-LM training checkpoint (no args or iteration in it)")


def test_a_release_tracker_points_at_the_release_folder(read):
    root, results = read
    assert results["release"] == str(root / "release" / "release")


def test_its_schedule_counts_samples_ours_iterations():
    from megatron_dilocox.checkpoint.megatron_lm import _in_iterations

    saved = {"num_steps": 28, "lr_warmup_steps": 8, "lr_decay_steps": 80, "wd_incr_steps": 80, "max_lr": 1e-3,
             "min_lr": 1e-4, "lr_decay_style": "cosine", "start_wd": 0.1, "end_wd": 0.1, "wd_incr_style": "constant"}
    assert _in_iterations(saved, 4) == {**saved, "num_steps": 7, "lr_warmup_steps": 2, "lr_decay_steps": 20,
                                        "wd_incr_steps": 20}
