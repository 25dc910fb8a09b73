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
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from calibration.machine import machine_figures  # noqa: E402
from calibration.prediction import FIT, fit_elementwise  # noqa: E402
from calibration.runs import LAYOUTS, MODELS, REPO, measure_run  # noqa: E402
from calibration.table import table  # noqa: E402


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
