"""DiLoCoX vs vanilla AllReduce vs compute-only, same model, data, seed and tokens, over emulated slow links.

    python tools/bench_vs_allreduce.py --rate 10mbit --clusters 2 --ranks-per-cluster 2 \\
        --out runs/bench/10mbit -- <pretrain_gpt.py model, data and training flags>

Needs root: it creates one network namespace per cluster with tools/wan, shapes every cluster's
uplink and downlink to ``--rate`` and removes them again (also on Ctrl-C or error). Methods:

- ``allreduce``: vanilla megatron, gradients reduced across all clusters every step;
- ``dilocox-sync``, ``dilocox-overlap``: DiLoCoX without compression, blocking / overlapped
  (the overlapped methods, ``dilocox-overlap*``, run ``--overlap-mode``: ``delay`` or ``eager``,
  see outer/sync.py);
- ``dilocox-overlap-compressed``: overlapped with compressed pseudo-gradients
  (``--compression-args``, default: the product's default codec and its settings,
  ``pretrain_gpt.py --help``);
- ``dilocox-overlap-compressed-adaptive``: overlapped, low-rank + quantized with the adaptive rank
  (``--dilocox-adaptive``);
- ``compute-only``: each cluster trains alone as its own torchrun job (world = its ranks, its
  share of the global batch), all clusters at once: no cross-cluster exchange at all. It runs
  ``--compute-only-repeats`` times (default 3), spread over the other methods (first, in between,
  last), and its row is the run with the median tokens/s, so that the machine's speed drifting
  during the benchmark cannot bias the fractions of compute-only; every run's tokens/s is in
  ``results.json``.

AllReduce runs as one torchrun job across the clusters. DiLoCoX runs as the product runs it: one
torchrun job per cluster, joined by a torchft Lighthouse in cluster 0's namespace (``python
tools/wan launch --cluster-jobs``).

``--shaped-iters METHOD=N`` is for methods whose full run over the shaped link would take too
long: their loss comes from a full run without shaping (the math does not depend on the link),
their throughput from N iterations over the shaped link (steady state, after the first round
or step), and their training time is tokens / that throughput. Such rows say "projected"; a
DiLoCoX method projected so runs without the H ramp (``--dilocox-local-steps-ramp-iters 0``),
whose short rounds are not steady.

``--after-ramp-iters N`` adds what a long run spends nearly all its time in: the
``dilocox-overlap-compressed`` row's throughput after its H ramp, from N iterations over the
shaped link at the fixed H (from the end of the first round, the drain left out), against
compute-only's rate over the same iterations; printed below the table, in ``results.json`` as
that row's ``after_ramp``.

Throughput is measured on the training clock, which validation pauses (as in Megatron's log:
under DiLoCoX every cluster validates the global parameters on the whole validation batch,
compute-only clusters on their share): ``train s`` and ``tokens/s``, with the last round's
drain; ``wall s`` and ``(of c-only)`` include validation. Prints a table, writes
``results.json`` and two plots (validation loss vs training time and vs cross-cluster bytes)
into ``--out``; per-run metrics and logs stay there too.
"""

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "wan"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import launch  # noqa: E402
import netns  # noqa: E402
from pretrain_flags import flag_value  # noqa: E402
from vs_allreduce.figures import add_ratios  # noqa: E402
from vs_allreduce.report import plot, table  # noqa: E402
from vs_allreduce.runs import METHODS, Bench  # noqa: E402

OWNED = ("--dilocox", "--metrics-file", "--log-interval", "--eval-interval", "--eval-iters", "--seed")
NEEDED = ("--train-iters", "--global-batch-size", "--seq-length")
CODEC_FLAGS = ("--dilocox-compression", "--dilocox-quant-", "--dilocox-rank", "--dilocox-min-rank",
               "--dilocox-error-feedback", "--dilocox-ef-decay")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_vs_allreduce.py", description=__doc__.split("\n\n")[0],
                                usage="%(prog)s --rate RATE --out DIR [options] -- PRETRAIN_FLAGS...")
    p.add_argument("--rate", required=True, help="per-cluster uplink and downlink rate, e.g. 100mbit, 10mbit")
    p.add_argument("--out", required=True, help="folder for metrics, logs, results.json and plots")
    p.add_argument("--clusters", type=int, default=2)
    p.add_argument("--ranks-per-cluster", type=int, default=2, help="TP x PP x DP_in ranks of one cluster")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of: " + ", ".join(METHODS))
    p.add_argument("--local-steps", type=int, default=10, help="H for every DiLoCoX method")
    p.add_argument("--local-steps-ramp-iters", type=int,
                   help="--dilocox-local-steps-ramp-iters for every DiLoCoX method (default: the product's)")
    p.add_argument("--min-local-steps", type=int,
                   help="--dilocox-min-local-steps (the H ramp's shortest round) for every ramped DiLoCoX method "
                        "(default: the product's, 1)")
    p.add_argument("--outer-lr", type=float, help="--dilocox-outer-lr (default: the product's)")
    p.add_argument("--outer-momentum", type=float,
                   help="--dilocox-outer-momentum (default: the product's); 0 = plain outer SGD, no Nesterov")
    p.add_argument("--overlap-mode", choices=("delay", "eager"), default="delay",
                   help="--dilocox-sync-mode of the overlapped DiLoCoX methods (the dilocox-overlap* rows)")
    p.add_argument("--compression-args", default="",
                   help="codec flags for dilocox-overlap-compressed, e.g. --compression-args='--dilocox-compression "
                        "quantize --dilocox-quant-bits 4' (default: the product's default codec)")
    p.add_argument("--shaped-iters", action="append", default=[], metavar="METHOD=N",
                   help="loss from a full unshaped run, throughput from N iterations over the shaped link "
                        "(a DiLoCoX method so projected runs at a fixed H, without the H ramp)")
    p.add_argument("--after-ramp-iters", type=int, metavar="N",
                   help="also run dilocox-overlap-compressed N iterations over the shaped link at the fixed H "
                        "that its H ramp ends in, for the throughput of a long run after the ramp (from the end "
                        "of the first round, the drain left out; no loss)")
    p.add_argument("--compute-only-repeats", type=int, default=3,
                   help="runs of compute-only, spread over the other methods; its row is their median")
    p.add_argument("--eval-interval", type=int, default=50)
    p.add_argument("--eval-iters", type=int, default=8)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--prefix", default=f"b{os.getpid() % 10**8}", help="namespace name prefix (unique per run)")
    p.add_argument("--master-port", type=int, default=29500)
    p.add_argument("pretrain", nargs=argparse.REMAINDER, help="-- then pretrain_gpt.py flags")
    return p


def check_args(parser, args) -> dict:
    """Validates the flags (one-line errors naming the flag); returns the derived settings."""
    pretrain = args.pretrain[1:] if args.pretrain[:1] == ["--"] else args.pretrain
    if not pretrain:
        parser.error("give the pretrain_gpt.py model, data and training flags after --")
    for item in pretrain:
        if item.startswith(OWNED):
            parser.error(f"{item.split('=')[0]} is set by the harness; use its own flags (see --help)")
    values = {}
    for flag in NEEDED:
        value = flag_value(pretrain, flag)
        if value is None or not value.isdigit() or int(value) < 1:
            parser.error(f"the pretrain flags must contain {flag} N (a positive integer)")
        if f"{flag}=" in " ".join(pretrain):
            parser.error(f"write {flag} N, not {flag}=N, so the harness can adjust it")
        values[flag] = int(value)
    iters, gbs = values["--train-iters"], values["--global-batch-size"]
    try:
        netns.Wan(args.prefix, args.clusters, args.rate)
    except netns.WanError as err:
        parser.error(str(err))
    if args.ranks_per_cluster < 1:
        parser.error(f"--ranks-per-cluster must be >= 1, got {args.ranks_per_cluster}")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        parser.error(f"--methods: unknown {', '.join(unknown) or '(empty)'}; choose from {', '.join(METHODS)}")
    if args.local_steps < 1 or iters % args.local_steps:
        parser.error(f"--local-steps must divide --train-iters {iters}, got {args.local_steps}")
    if gbs % args.clusters:
        parser.error(f"--global-batch-size {gbs} must be divisible by --clusters {args.clusters}")
    if args.local_steps_ramp_iters is not None and args.local_steps_ramp_iters < 0:
        parser.error(f"--local-steps-ramp-iters must be >= 0, got {args.local_steps_ramp_iters}")
    if args.min_local_steps is not None and not 1 <= args.min_local_steps <= args.local_steps:
        parser.error(f"--min-local-steps must be in 1..--local-steps {args.local_steps}, got {args.min_local_steps}")
    if args.min_local_steps is not None and args.local_steps_ramp_iters == 0:
        parser.error("--min-local-steps bounds the H ramp: it needs --local-steps-ramp-iters > 0")
    if args.after_ramp_iters is not None:
        n, h = args.after_ramp_iters, args.local_steps
        if "dilocox-overlap-compressed" not in methods or args.local_steps_ramp_iters == 0:
            parser.error("--after-ramp-iters measures dilocox-overlap-compressed after its H ramp: it needs that "
                         "method and --local-steps-ramp-iters > 0")
        if n < 3 * h or n % h:
            parser.error(f"--after-ramp-iters must be a multiple of --local-steps {h}, at least {3 * h}, got {n}")
    if args.compute_only_repeats < 1:
        parser.error(f"--compute-only-repeats must be >= 1, got {args.compute_only_repeats}")
    if args.eval_interval < 1 or args.eval_iters < 1:
        parser.error("--eval-interval and --eval-iters must be >= 1")
    compression = shlex.split(args.compression_args)
    for item in compression:
        if item.startswith("--") and not item.startswith(CODEC_FLAGS):
            parser.error(f"--compression-args takes only codec flags ({', '.join(CODEC_FLAGS)}), got {item}")
    shaped = {}
    for item in args.shaped_iters:
        name, sep, n = item.partition("=")
        if not sep or name not in methods or name == "compute-only" or not n.isdigit():
            parser.error(f"--shaped-iters takes METHOD=N for a benchmarked method other than compute-only, got {item!r}")
        unit = 1 if name == "allreduce" else args.local_steps
        if int(n) < 3 * unit or int(n) % unit or int(n) > iters:
            parser.error(f"--shaped-iters {item}: N must be a multiple of {unit}, at least {3 * unit}, at most {iters}")
        shaped[name] = int(n)
    return dict(pretrain=pretrain, iters=iters, gbs=gbs, seq=values["--seq-length"], methods=methods, shaped=shaped,
                compression=compression)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cfg = check_args(parser, args)
    launch.exit_on_sigterm()
    try:
        netns.require_root(os.geteuid())
    except netns.WanError as err:
        print(f"bench_vs_allreduce.py: error: {err}", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wan = netns.Wan(args.prefix, args.clusters, args.rate)
    setup = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), host=platform.node(),
                 cpus=os.cpu_count(), load_before=os.getloadavg(), rate=args.rate, clusters=args.clusters,
                 ranks_per_cluster=args.ranks_per_cluster, local_steps=args.local_steps,
                 local_steps_ramp_iters=args.local_steps_ramp_iters, min_local_steps=args.min_local_steps,
                 overlap_mode=args.overlap_mode, outer_lr=args.outer_lr, outer_momentum=args.outer_momentum,
                 compression_args=args.compression_args, seed=args.seed, after_ramp_iters=args.after_ramp_iters,
                 compute_only_repeats=args.compute_only_repeats,
                 pretrain_flags=cfg["pretrain"],
                 harness_command=shlex.join([sys.executable, *sys.argv]))
    print(f"> {args.clusters} clusters x {args.ranks_per_cluster} ranks, every cluster link shaped to {args.rate} "
          f"(namespaces {args.prefix}-*); {cfg['iters']} iterations x {cfg['gbs']} x {cfg['seq']} tokens; "
          f"load average {setup['load_before'][0]:.1f}", flush=True)
    try:
        netns.up(wan)
        bench = Bench(args, cfg, wan)
        results = bench.run_all(cfg["methods"])
    except netns.WanError as err:
        print(f"bench_vs_allreduce.py: error: {err}", file=sys.stderr)
        return 1
    finally:
        netns.down(args.prefix)
    setup["load_after"] = os.getloadavg()
    order = {m: i for i, m in enumerate(["allreduce", "dilocox-sync", "dilocox-overlap", "dilocox-overlap-compressed",
                                         "dilocox-overlap-compressed-adaptive", "compute-only"])}
    results.sort(key=lambda r: order[r["method"]])
    add_ratios(results)
    text = table(results)
    print()
    print(text)
    for r in results:
        if r["kind"].startswith("projected"):
            print(f"projected: {r['label']}: loss and bytes from a full unshaped run; tokens/s measured over the "
                  f"{args.rate} link on iterations {r['shaped_window']['first_iteration']}-"
                  f"{r['shaped_window']['last_iteration']}; train s = tokens / that rate")
    for r in results:
        if "after_ramp" in r:
            s = r["after_ramp"]
            ratios = ""
            if s["speedup_vs_allreduce"] is not None:
                ratios += f", {s['speedup_vs_allreduce']:.1f}x AllReduce"
            if s["fraction_of_compute_only"] is not None:
                ratios += (f", {s['fraction_of_compute_only']:.1%} of compute-only's rate from iteration "
                           f"{args.local_steps} on")
            print(f"after the H ramp: {r['label']} at H {args.local_steps}, iterations {s['first_iteration']}-"
                  f"{s['last_iteration']} over the {args.rate} link: {s['tokens_per_s']:.0f} tokens/s{ratios}")
    if "compute-only" in cfg["methods"]:
        alone = next(r for r in results if r["method"] == "compute-only")
        print("compute-only: each cluster trained alone on its share of every batch; its loss is the mean of "
              "the clusters' separate models; tokens/s of its runs, in order: "
              + ", ".join(f"{r['tokens_per_s']:.0f}" for r in alone["repeats"]) + " (the row: their median)")
    print("train s and tokens/s: training time (validation excluded, the last round's drain included); "
          "wall s and (of c-only): with validation")
    plots = plot(results, out, f"{args.clusters} clusters x {args.ranks_per_cluster} ranks, {args.rate} per cluster link")
    (out / "results.json").write_text(json.dumps(dict(setup=setup, commands=bench.commands, table=text,
                                                      methods=results), indent=1))
    print(f"\n> wrote {out / 'results.json'}, {', '.join(str(p) for p in plots)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
