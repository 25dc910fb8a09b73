"""Calibrate the planner's CPU mode against measured runs of pretrain_gpt.py, side by side.

Two steps, both on this machine:

1. Machine figures (once per model, kept in ``runs/calibration/machine.json``): the achieved
   matmul GFLOP/s of one process with 1 and with all cores' threads on the model's own GEMMs
   (forward and both backward products of each linear layer, attention products, logits), and
   the loopback bandwidth of a 2-process gloo all-reduce at the gradient and activation sizes:
   the ``--cpu-gflops``, ``--intra-bandwidth-gbps`` and ``--tp-bandwidth-gbps`` of tools/plan.py.
2. Measured runs: ``torchrun pretrain_gpt.py`` on the quickstart data for several layouts (one
   cluster TP1/PP1, PP2, TP2, DP2; 2 clusters x PP2 with AllReduce and with compressed DiLoCoX),
   then a table of predicted vs measured step time and cross-cluster bytes.

Usage (after ``bash examples/quickstart.sh`` built data/quickstart)::

    python tools/calibrate_planner.py                 # measure what is missing, print the table
    python tools/calibrate_planner.py --table-only    # reprint from runs/calibration/

Runs and figures already measured (``runs/calibration/``) are reused; delete them to measure
again. The load average before and after each run is recorded next to it.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tools"))

from compare_runs import read_records  # noqa: E402

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


def load() -> float:
    return os.getloadavg()[0]


def cpu_busy(seconds: float = 1.0) -> float:
    """Share of all cores' time spent busy over the next ``seconds`` (from /proc/stat). Unlike
    the load average it has no memory of this tool's own previous runs, and gloo's sleeping
    threads do not count."""
    def snapshot():
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        return sum(ticks), ticks[3] + ticks[4]  # total, idle + iowait

    total0, idle0 = snapshot()
    time.sleep(seconds)
    total1, idle1 = snapshot()
    return 1.0 - (idle1 - idle0) / max(total1 - total0, 1)


def wait_quiet(max_busy: float) -> float:
    """Waits until other jobs keep at most ``max_busy`` of the cores busy for 3 s in a row (they
    distort timings; call it while this tool runs nothing); returns the last busy share."""
    quiet = 0
    while quiet < 3:
        busy = cpu_busy()
        quiet = quiet + 1 if busy <= max_busy else 0
    return busy


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


def _gemms(model: str, threads: int, repeats: int = 7) -> float:
    """Achieved matmul GFLOP/s of this process with ``threads`` threads, on one layer's GEMMs
    (forward, input gradient, weight gradient), its attention products and the logits, at the
    model's micro-batch (4 x 128 tokens), fp32; median of ``repeats`` timed passes."""
    import torch

    from megatron_dilocox import planner as pl

    torch.set_num_threads(threads)
    m = model_shape(model)
    tokens, s, h, a = 4 * m.seq_length, m.seq_length, m.hidden_size, m.num_attention_heads
    mats = [t.shape for t in pl.layer_tensors(m) if len(t.shape) == 2]
    mats.append((pl.padded_vocab(m.vocab_size, m.make_vocab_size_divisible_by, 1), h))
    x = {n: torch.randn(tokens, n) for n in {d for shape in mats for d in shape}}
    w = [torch.randn(shape) for shape in mats]
    q = torch.randn(4 * a, s, h // a)
    probs = torch.randn(4 * a, s, s)
    flops = sum(3 * 2 * tokens * o * i for o, i in mats) + 3 * 2 * 2 * 4 * a * s * s * (h // a)

    def one_pass():
        for (o, i), wt in zip(mats, w):
            x[i] @ wt.t()                  # forward
            x[o] @ wt                      # input gradient
            x[o].t() @ x[i]                # weight gradient
        for _ in range(3):                 # scores and weighted values, forward and 2 backward products
            torch.bmm(q, q.transpose(1, 2))
            torch.bmm(probs, q)

    one_pass()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        one_pass()
        times.append(time.perf_counter() - start)
    return flops / sorted(times)[len(times) // 2] / 1e9


def model_shape(model: str):
    from megatron_dilocox import planner as pl

    flags = dict(zip(MODELS[model][::2], MODELS[model][1::2]))
    return pl.ModelShape(num_layers=int(flags["--num-layers"]), hidden_size=int(flags["--hidden-size"]),
                         num_attention_heads=int(flags["--num-attention-heads"]), vocab_size=4096,
                         seq_length=128)


def _gloo_worker(rank: int, port: int, numel: int, out) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    x = torch.ones(numel)
    dist.all_reduce(x)
    times = []
    for _ in range(9):
        start = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - start)
    if rank == 0:
        out.send(sorted(times)[len(times) // 2])
    dist.destroy_process_group()


def gloo_gbps(nbytes: int) -> float:
    """Loopback bandwidth of a 2-process gloo all-reduce of ``nbytes`` (median of 9), in Gbit/s as
    the planner counts it: a 2-rank ring moves ``2 (2 - 1) / 2 x nbytes`` = nbytes per rank."""
    import multiprocessing
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    procs = [ctx.Process(target=_gloo_worker, args=(r, port, nbytes // 4, send)) for r in range(2)]
    for proc in procs:
        proc.start()
    seconds = recv.recv()
    for proc in procs:
        proc.join()
    return nbytes * 8 / seconds / 1e9


def machine_figures(model: str, max_busy: float) -> dict:
    """The measured inputs of the planner's CPU mode for ``model``: matmul GFLOP/s with 1 and
    with all threads, gloo loopback bandwidth at the fp32 gradient size (data-parallel
    all-reduce) and at one micro-batch's activations (tensor-parallel all-reduce, pipeline sends)."""
    from megatron_dilocox import planner as pl

    m = model_shape(model)
    grads = 4 * pl.param_count(m)
    acts = 4 * 4 * m.seq_length * m.hidden_size
    wait_quiet(max_busy)
    intra, tp = gloo_gbps(grads), gloo_gbps(acts)  # forked before any matmul starts threads
    one, all_ = _gemms(model, 1), _gemms(model, os.cpu_count())
    return dict(cpu_gflops=(one, all_), intra_gbps=intra, tp_gbps=tp, load=load())


FIT = ("h256", "dp2")
"""The one run ``--cpu-elementwise-ns`` is fitted to; every other row of the table is a prediction."""


def predict(model: str, layout: str, data: str, fig: dict, elementwise_ns: float):
    """The planner's CPU-mode plan of one measured run, from that run's own launch flags."""
    import tools.plan as cli
    from megatron_dilocox import planner as pl

    nproc, flags = LAYOUTS[layout]
    ns = cli.resolve([
        "--cpu-cores", str(os.cpu_count()), "--cpu-gflops", *(f"{x:.3f}" for x in fig["cpu_gflops"]),
        "--intra-bandwidth-gbps", f"{fig['intra_gbps']:.4f}", "--tp-bandwidth-gbps", f"{fig['tp_gbps']:.4f}",
        # the "link" between clusters is loopback too: every stage pair all-reduces on its own
        "--inter-bandwidth-gbps", f"{fig['intra_gbps']:.4f}", "--inter-link", "per-rank",
        "--cpu-elementwise-ns", repr(elementwise_ns),
        "--vocab-size", "4096", "--gpus-per-cluster", str(nproc // (2 if "--dilocox-clusters" in flags else 1)),
        "--", *launch_flags(model, layout, data)])
    return pl.plan(*cli.configs(ns)), ns


def predicted_step(p, layout: str) -> float:
    """The planner's time per step of the method a layout runs: the AllReduce baseline includes
    its cross-cluster gradient all-reduce, DiLoCoX its round time over H."""
    flags = LAYOUTS[layout][1]
    if "--dilocox" in flags:
        return p.dilocox.step
    return p.allreduce.step if "--dilocox-clusters" in flags else p.step.total


def measured(path: str) -> dict:
    recs = read_records(path)
    logs = [r for r in recs if "tokens_per_sec" in r]
    tokens_per_step = logs[0]["tokens"] / logs[0]["iteration"]
    steps = [tokens_per_step / r["tokens_per_sec"] for r in logs[1:]]  # first window: warm-up
    rounds = [r["bytes_sent"] for r in recs if "outer_step" in r and r["bytes_sent"]]
    meta = recs[-1]
    return dict(step=sorted(steps)[len(steps) // 2], step_min=min(steps), step_max=max(steps),
                last_iteration=logs[-1]["iteration"], cumulative=logs[-1].get("cross_cluster_bytes"),
                rounds=rounds, load=(meta["load_before"], meta["load_after"]))


def fit_elementwise(data: str, out: str, figures: dict) -> float:
    """The ``--cpu-elementwise-ns`` at which the planner's step time equals FIT's fastest measured
    window, the one least disturbed by other jobs (bisection: the predicted time rises with it)."""
    model, layout = FIT
    target = measured(os.path.join(out, f"{model}-{layout}.jsonl"))["step_min"]
    lo, hi = 0.0, 1e4
    for _ in range(60):
        mid = (lo + hi) / 2
        if predicted_step(predict(model, layout, data, figures[model], mid)[0], layout) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def table(models, layouts, data: str, out: str, figures: dict, elementwise_ns: float) -> str:
    from megatron_dilocox.payload import HANDSHAKE_BYTES

    rows = ["| model | layout | processes | predicted step | measured step: fastest window (median; slowest) | "
            "error vs fastest (vs median) | predicted bytes | measured bytes | load before/after |",
            "|---|---|---|---|---|---|---|---|---|"]
    for model in models:
        for layout in layouts:
            path = os.path.join(out, f"{model}-{layout}.jsonl")
            if not os.path.exists(path):
                continue
            p, ns = predict(model, layout, data, figures[model], elementwise_ns)
            got = measured(path)
            step = predicted_step(p, layout)
            err, err_median = step / got["step_min"] - 1, step / got["step"] - 1
            c = ns.dilocox_clusters
            if "--dilocox" in LAYOUTS[layout][1]:
                h = ns.dilocox_local_steps
                per_round = int(p.dilocox.sent_per_stage[-1])
                started = got["last_iteration"] // h
                want = f"{per_round:,}/round; {started * per_round + HANDSHAKE_BYTES:,} cum."
                have = f"{'/'.join(f'{b:,}' for b in sorted(set(got['rounds'])))}/round; {got['cumulative']:,} cum."
            elif c > 1:
                # + the loss average over data-parallel replicas at each log line: 2 float64
                per_step, logs = int(p.allreduce.per_stage[-1]), got["last_iteration"] // LOG_INTERVAL
                want = f"{per_step:,}/step; {per_step * got['last_iteration'] + 16 * logs:,} cum."
                have = f"{got['cumulative'] / got['last_iteration']:,.1f}/step; {got['cumulative']:,} cum."
            else:
                want = have = "-"
            fitted = " (fitted)" if (model, layout) == FIT else ""
            rows.append(f"| {model} | {layout}{fitted} | {LAYOUTS[layout][0]} | {step * 1e3:.0f} ms | "
                        f"{got['step_min'] * 1e3:.0f} ms ({got['step'] * 1e3:.0f}; {got['step_max'] * 1e3:.0f}) | "
                        f"{100 * err:+.1f}% ({100 * err_median:+.1f}%) | {want} | {have} | {got['load'][0]:.2f} / {got['load'][1]:.2f} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="data/quickstart")
    ap.add_argument("--out", default="runs/calibration")
    ap.add_argument("--models", nargs="+", default=sorted(MODELS), choices=sorted(MODELS))
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--table-only", action="store_true", help="Print the table from runs already measured.")
    ap.add_argument("--max-busy", type=float, default=0.1,
                    help="Start a measurement only when other jobs keep at most this share of the cores busy "
                    "(3 s in a row).")
    args = ap.parse_args(argv)
    out = os.path.join(REPO, args.out)
    os.makedirs(out, exist_ok=True)
    fig_path = os.path.join(out, "machine.json")
    figures = json.load(open(fig_path)) if os.path.exists(fig_path) else {}
    for model in args.models:
        if model not in figures:
            figures[model] = machine_figures(model, args.max_busy)
            with open(fig_path, "w") as f:
                json.dump(figures, f, indent=1)
        fig = figures[model]
        print(f"> {model}: --cpu-gflops {fig['cpu_gflops'][0]:.1f} {fig['cpu_gflops'][1]:.1f} "
              f"--intra-bandwidth-gbps {fig['intra_gbps']:.2f} --tp-bandwidth-gbps {fig['tp_gbps']:.2f} "
              f"(measured under load {fig['load']:.2f})")
        if not args.table_only:
            for layout in args.layouts:
                measure_run(model, layout, args.data, out, args.max_busy)
    elementwise_ns = fit_elementwise(args.data, out, figures)
    print(f"> --cpu-elementwise-ns {elementwise_ns:.4f} (fitted to {FIT[0]} {FIT[1]})")
    print(table(args.models, args.layouts, args.data, out, figures, elementwise_ns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
