"""The planner's prediction of a measured run, what the run measured, and the fit of
``--cpu-elementwise-ns`` to one run."""
from __future__ import annotations

import os
import statistics

from calibration.runs import LAYOUTS, launch_flags
from compare_runs import read_records


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
    return dict(step=statistics.median_high(steps), step_min=min(steps), step_max=max(steps),
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
