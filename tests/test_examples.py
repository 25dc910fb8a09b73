"""The multi-node launch scripts: --dry-run prints one torchrun command per node and a plan that fits."""
import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p for p in (REPO / "examples").glob("*/*.sh") if "launch_common.sh" in p.read_text())
NODES = {"pretrain_gpt_1.3b.sh": 2, "pretrain_gpt_107b_dilocox.sh": 32}


def dry_run(script: Path, **env) -> subprocess.CompletedProcess:
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"  # the venv's python and torchrun
    return subprocess.run(["bash", str(script), "--dry-run"], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PATH": path, **env})


@functools.lru_cache(maxsize=None)
def default_dry_run(script: Path) -> subprocess.CompletedProcess:
    """Each script's default dry run, once per test session (it imports torch once, for the planner)."""
    return dry_run(script)


def test_every_launch_script_is_covered():
    assert sorted(p.name for p in SCRIPTS) == sorted(NODES)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_dry_run_prints_every_node_and_a_plan_that_fits(script):
    proc = default_dry_run(script)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    commands = [line for line in proc.stdout.splitlines() if line.startswith("torchrun ")]
    nodes = NODES[script.name]
    assert len(commands) == nodes
    for rank, cmd in enumerate(commands):
        assert f"--nnodes {nodes} --node-rank {rank} " in cmd and " pretrain_gpt.py " in cmd
        for flag in ("--save", "--load", "--save-interval", "--tensorboard-dir", "--metrics-file", "--dilocox",
                     "--dilocox-clusters", "--dilocox-local-steps"):
            assert f" {flag} " in cmd, flag
    assert re.search(r"total .* of 80 GiB: fits", proc.stdout)
    # The plan is of the launched flags: same layers and layout as the command lines.
    layers = re.search(r"--num-layers (\d+)", commands[0]).group(1)
    tp = re.search(r"--tensor-model-parallel-size (\d+)", commands[0]).group(1)
    pp = re.search(r"--pipeline-model-parallel-size (\d+)", commands[0]).group(1)
    assert f"(TP {tp} x PP {pp} x DP_in" in proc.stdout and int(layers) > 0


def test_107b_dry_run_plans_the_paper_preset():
    import tools.plan as cli
    from megatron_dilocox import planner as pl

    proc = default_dry_run(REPO / "examples/gpt_107b/pretrain_gpt_107b_dilocox.sh")
    ratio = re.search(r"throughput DiLoCoX / AllReduce: ([\d.,]+)x", proc.stdout).group(1)
    preset = pl.plan(*cli.configs(cli.resolve(["--preset", "paper-107b"])))
    assert ratio == f"{preset.ratio:,.1f}"
    assert "parameters: 106,758,860,800" in proc.stdout


def test_layout_and_fit_errors_are_one_line_and_fatal():
    script = REPO / "examples/gpt_1.3b/pretrain_gpt_1.3b.sh"
    proc = dry_run(script, NNODES="3")
    assert proc.returncode == 2 and "NNODES=3 does not split into CLUSTERS=2 equal clusters" in proc.stderr
    proc = dry_run(script, GPU_MEMORY_GIB="20")
    assert proc.returncode != 0 and "does not fit 20 GiB per GPU" in proc.stderr
    assert not [line for line in proc.stdout.splitlines() if line.startswith("torchrun ")]
