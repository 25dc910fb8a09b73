"""The measured runs: the models and layouts, each one ``torchrun pretrain_gpt.py`` launch on the
quickstart data, run once the machine is quiet; its metrics file records the load around it."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

from calibration.quiet import load, wait_quiet

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ITERS, LOG_INTERVAL = 50, 10
"""Steps per measured run and per log window; the first window (warm-up) is not counted."""

MODELS = {
    # examples/quickstart_gpt.sh's model, and one 4x wider in FLOPs per token.
    "h256": ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4"],
    "h512": ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8"],
}
COMMON = ["--seq-length", "128", "--max-position-embeddings", "128", "--hidden-dropout", "0",
          "--attention-dropout", "0", "--micro-batch-size", "4", "--global-batch-size", "16",
          "--train-iters", str(ITERS), "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
          "--lr-warmup-iters", "10", "--weight-decay", "0.1", "--clip-grad", "1.0",
          "--log-interval", str(LOG_INTERVAL), "--eval-interval", str(ITERS), "--eval-iters", "0"]
LAYOUTS = {
    # name: (processes, flags)
    "tp1pp1": (1, []),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "tp2": (2, ["--tensor-model-parallel-size", "2"]),
    "dp2": (2, []),
    "allreduce-2xpp2": (4, ["--pipeline-model-parallel-size", "2", "--dilocox-clusters", "2"]),
    "dilocox-2xpp2": (4, ["--pipeline-model-parallel-size", "2", "--dilocox", "--dilocox-clusters", "2",
                          "--dilocox-local-steps", "10", "--dilocox-compression", "lowrank-quantize",
                          "--dilocox-quant-bits", "8", "--dilocox-rank", "8"]),
}


def data_args(data: str) -> list[str]:
    return ["--data-path", f"{data}/stdlib_text_document", "--tokenizer-type", "SentencePieceTokenizer",
            "--tokenizer-model", f"{data}/stdlib_sp.model", "--split", "98,2,0",
            "--data-cache-path", f"{data}/cache"]


def launch_flags(model: str, layout: str, data: str) -> list[str]:
    return MODELS[model] + COMMON + LAYOUTS[layout][1] + data_args(data)


def model_shape(model: str):
    from megatron_dilocox import planner as pl

    flags = dict(zip(MODELS[model][::2], MODELS[model][1::2]))
    return pl.ModelShape(num_layers=int(flags["--num-layers"]), hidden_size=int(flags["--hidden-size"]),
                         num_attention_heads=int(flags["--num-attention-heads"]), vocab_size=4096,
                         seq_length=128)


def measure_run(model: str, layout: str, data: str, out: str, max_busy: float) -> str:
    """Runs one layout unless its metrics file exists, once the machine is quiet; returns the
    metrics path. The busy share before and the load averages around the run are recorded."""
    path = os.path.join(out, f"{model}-{layout}.jsonl")
    if os.path.exists(path):
        return path
    nproc = LAYOUTS[layout][0]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-port=29517",
           "pretrain_gpt.py", *launch_flags(model, layout, data), "--metrics-file", path + ".part"]
    print(f"> {model} {layout}: {shlex.join(cmd[1:])}", flush=True)
    if os.path.exists(path + ".part"):
        os.remove(path + ".part")
    busy = wait_quiet(max_busy)
    before = load()
    with open(os.path.join(out, f"{model}-{layout}.log"), "w") as log:
        subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, check=True)
    with open(path + ".part", "a") as f:
        f.write(json.dumps({"busy_before": busy, "load_before": before, "load_after": load(),
                            "command": shlex.join(cmd[2:])}) + "\n")
    os.replace(path + ".part", path)
    return path
