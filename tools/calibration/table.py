"""Predicted vs measured step time and cross-cluster bytes, one row per run."""
from __future__ import annotations

import os

from calibration.prediction import FIT, measured, predict, predicted_step
from calibration.runs import LAYOUTS, LOG_INTERVAL


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
