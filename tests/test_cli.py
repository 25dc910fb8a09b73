"""The command-line surface a new user meets first: the environment script, --help, a run outside
the environment, Ctrl-C. (tools/bench_cli.py prints the --help start-up times.)"""

import os
import signal
import subprocess
import sys
import time

import pytest

from launch import REPO, free_port

TOOLS = ["pretrain_gpt.py", "tools/plan.py", "tools/checkpoint/inspect.py", "tools/checkpoint/convert.py"]


def _bash(script: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def test_sourcing_setup_env_keeps_the_callers_shell_options():
    proc = _bash('before="$(set +o; shopt -p)"; set -- a b; source tools/setup_env.sh; echo "status $? args $*"; '
                 '[ "$before" = "$(set +o; shopt -p)" ] && echo "options kept"; command -v python',
                 VENV=sys.prefix)
    assert proc.stdout.splitlines() == ["status 0 args a b", "options kept", f"{sys.prefix}/bin/python"], proc.stderr


def test_a_relative_venv_is_made_absolute():
    """VENV=.venv-py312 (README's form) from the repo root: PATH gets the absolute folder, so that
    python and sys.executable keep working from any directory."""
    parent, name = os.path.split(sys.prefix)
    proc = _bash(f'cd "{parent}" && source "{REPO}/tools/setup_env.sh" && cd / && command -v python', VENV=name)
    assert proc.stdout.splitlines() == [f"{sys.prefix}/bin/python"], proc.stderr


def test_setup_env_failures_stay_fatal_under_set_e(tmp_path):
    broken = dict(VENV=str(tmp_path / "venv"), PYTHON="false")  # creating the venv fails
    proc = _bash("set -euo pipefail; source tools/setup_env.sh; echo not reached", **broken)
    assert proc.returncode != 0 and "not reached" not in proc.stdout
    proc = _bash("source tools/setup_env.sh; echo status $? opts $-", **broken)
    status, options = proc.stdout.splitlines()[-1].split(" opts ")
    assert status == "status 1" and "e" not in options  # the caller goes on, without set -e
    assert "tools/setup_env.sh: error: installing into" in proc.stderr


def _without_torch(tmp_path):
    """A Python that has no site-packages: no torch, no megatron-core, no sentencepiece."""
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    python.chmod(0o755)
    return str(python)


@pytest.mark.parametrize("tool", TOOLS)
def test_help_parses_flags_before_heavy_imports(tool, tmp_path):
    """--help comes without torch (so without its seconds of start-up) and shows defaults."""
    proc = subprocess.run([_without_torch(tmp_path), tool, "--help"], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("usage:"), proc.stderr
    if tool in ("pretrain_gpt.py", "tools/plan.py"):
        assert "H: inner steps per outer round. (default: 10)" in " ".join(proc.stdout.split())


def test_every_flag_has_help():
    sys.path.insert(0, str(REPO))
    import tools.plan
    from megatron_dilocox.arguments import build_parser

    for parser in (build_parser(), tools.plan.build_parser()):
        assert [a.option_strings for a in parser._actions if not a.help] == []


def test_every_dilocox_flag_reaches_its_config_field():
    """Flags generated from the config dataclasses: each given value lands in its own field."""
    sys.path.insert(0, str(REPO))
    from megatron_dilocox.arguments import parse_args
    from megatron_dilocox.config import CompressionConfig, DiLoCoXConfig

    base = ["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2", "--seq-length", "8",
            "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3", "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "64"]
    args = parse_args(base + [
        "--dilocox", "--dilocox-clusters", "3", "--dilocox-local-steps", "7", "--dilocox-min-local-steps", "2",
        "--dilocox-max-local-steps", "9", "--dilocox-sync-mode", "eager", "--dilocox-overlap-steps", "4",
        "--dilocox-outer-lr", "0.5", "--dilocox-outer-momentum", "0.3", "--dilocox-no-nesterov",
        "--dilocox-offload-outer-state", "--dilocox-outer-timeout-s", "12", "--dilocox-emulated-delay-s", "0.25",
        "--dilocox-compression", "lowrank-quantize", "--dilocox-quant-bits", "4", "--dilocox-quant-block", "64",
        "--dilocox-rank", "5", "--dilocox-min-rank", "2", "--dilocox-rank-energy", "0.8", "--dilocox-adaptive",
        "--dilocox-error-feedback", "--dilocox-ef-decay", "0.5", "--dilocox-topk-density", "0.25",
        "--dilocox-topk-chunk", "128", "--dilocox-keep-unsent", "--dilocox-flush-residual"])
    assert args.outer == DiLoCoXConfig(
        clusters=3, local_steps=7, min_local_steps=2, max_local_steps=9, sync_mode="eager", overlap_steps=4,
        outer_lr=0.5, outer_momentum=0.3, nesterov=False, offload_outer_state=True, outer_timeout_s=12.0,
        emulated_delay_s=0.25)
    assert args.compression == CompressionConfig(
        codec="lowrank-quantize", bits=4, block=64, rank=5, min_rank=2, rank_energy=0.8, adaptive=True,
        error_feedback=True, ef_decay=0.5, topk_density=0.25, topk_chunk=128, keep_unsent=True, flush_residual=True)
    plain = parse_args(base + ["--dilocox"])
    assert plain.outer == DiLoCoXConfig() and plain.compression == CompressionConfig()
    assert parse_args(base + ["--dilocox", "--no-dilocox-error-feedback"]).compression.error_feedback is False
    assert parse_args(base).clusters == 1  # without --dilocox one cluster, unless --dilocox-clusters says


def test_a_run_outside_the_environment_names_what_is_missing(tmp_path):
    python = _without_torch(tmp_path)
    proc = subprocess.run([python, "pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "32",
                           "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "1",
                           "--train-iters", "2", "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer",
                           "--vocab-size", "64"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        f"pretrain_gpt.py: error: Python module 'torch' is not installed for {sys.executable}: install the pinned "
        "dependencies with `source tools/setup_env.sh` (or: pip install -r requirements-cpu.txt && pip install -e .)"]
    script = "examples/gpt_107b/pretrain_gpt_107b_dilocox.sh"
    proc = subprocess.run(["bash", script, "--dry-run"], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHON": python, "PATH": "/usr/bin:/bin"})
    # The planner needs no torch: the dry run still plans, and names what a real launch lacks.
    assert proc.returncode == 0 and "error:" not in proc.stderr, proc.stderr
    assert "gpt_107b_dilocox: note: torchrun not found" in proc.stderr and "throughput DiLoCoX" in proc.stdout


def test_ctrl_c_stops_with_one_line_naming_the_last_checkpoint(tiny_dataset, tmp_path):
    """Ctrl-C reaches a rank twice under torchrun (the terminal's, then torchrun's forwarded one)."""
    save = tmp_path / "ckpt"
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.Popen(
        [sys.executable, "pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--micro-batch-size", "1", "--train-iters", "100000", "--lr", "1e-3",
         "--data-path", str(tiny_dataset / "c_text_document"), "--tokenizer-model", str(tiny_dataset / "sp.model"),
         "--data-cache-path", str(tmp_path / "cache"), "--save", str(save), "--save-interval", "2",
         "--log-interval", "1000"], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while not (save / "latest_checkpointed_iteration.txt").exists() and proc.poll() is None:
        assert time.monotonic() < deadline, "no checkpoint within 180 s"
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    try:
        _, stderr = proc.communicate(timeout=300)  # exiting tears down torch: seconds, more under load
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)  # faulthandler prints where it hangs
        pytest.fail(f"no exit within 300 s of Ctrl-C:\n{proc.communicate()[1][-8000:]}")
    assert proc.returncode == 128 + signal.SIGINT, stderr
    lines = [line for line in stderr.splitlines() if not line.startswith("WARNING:")]
    assert len(lines) == 1 and "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    assert lines[0].startswith(f"pretrain_gpt.py: interrupted: last checkpoint {save}/iter_"), lines[0]
    assert lines[0].endswith(f"(resume with --load {save})")
