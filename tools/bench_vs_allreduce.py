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
  share of the global batch), all clusters at once: no cross-cluster exchange at all.

``--shaped-iters METHOD=N`` is for methods whose full run over the shaped link would take too
long: their loss comes from a full run without shaping (the math does not depend on the link),
their throughput from N iterations over the shaped link (steady state, after the first round
or step), and their training time is tokens / that throughput. Such rows say "projected".

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
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "wan"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import launch  # noqa: E402
import netns  # noqa: E402
from compare_runs import read_records, summarize  # noqa: E402
from pretrain_flags import flag_value  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DILOCOX = ["--dilocox"]
METHODS = {  # name: (label, pretrain_gpt.py flags; None = independent clusters); {overlap}: --overlap-mode
    "compute-only": ("compute-only", None),
    "dilocox-overlap-compressed": ("DiLoCoX {overlap}+comp", DILOCOX + ["--dilocox-sync-mode", "{overlap}"]),
    "dilocox-overlap-compressed-adaptive": ("DiLoCoX {overlap}+comp adapt.", DILOCOX + [
        "--dilocox-sync-mode", "{overlap}", "--dilocox-compression", "lowrank-quantize", "--dilocox-adaptive"]),
    "dilocox-overlap": ("DiLoCoX {overlap}", DILOCOX + ["--dilocox-sync-mode", "{overlap}", "--dilocox-compression", "none"]),
    "dilocox-sync": ("DiLoCoX sync", DILOCOX + ["--dilocox-sync-mode", "sync", "--dilocox-compression", "none"]),
    "allreduce": ("AllReduce", []),
}
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
    p.add_argument("--outer-lr", type=float, help="--dilocox-outer-lr (default: the product's)")
    p.add_argument("--outer-momentum", type=float,
                   help="--dilocox-outer-momentum (default: the product's); 0 = plain outer SGD, no Nesterov")
    p.add_argument("--overlap-mode", choices=("delay", "eager"), default="delay",
                   help="--dilocox-sync-mode of the overlapped DiLoCoX methods (the dilocox-overlap* rows)")
    p.add_argument("--compression-args", default="",
                   help="codec flags for dilocox-overlap-compressed, e.g. --compression-args='--dilocox-compression "
                        "quantize --dilocox-quant-bits 4' (default: the product's default codec)")
    p.add_argument("--shaped-iters", action="append", default=[], metavar="METHOD=N",
                   help="loss from a full unshaped run, throughput from N iterations over the shaped link")
    p.add_argument("--eval-interval", type=int, default=50)
    p.add_argument("--eval-iters", type=int, default=8)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--prefix", default=f"b{os.getpid() % 10**8}", help="namespace name prefix (unique per run)")
    p.add_argument("--master-port", type=int, default=29500)
    p.add_argument("pretrain", nargs=argparse.REMAINDER, help="-- then pretrain_gpt.py flags")
    return p


def _with_flag(argv: list[str], flag: str, value) -> list[str]:
    """``argv`` with ``flag``'s value replaced."""
    out = list(argv)
    i = out.index(flag)
    out[i + 1] = str(value)
    return out


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


class Bench:
    """Runs the methods and collects their curves and figures."""

    def __init__(self, args, cfg, wan: netns.Wan):
        self.args, self.cfg, self.wan = args, cfg, wan
        self.out = Path(args.out)
        self.commands = {}

    def _flags(self, method: str, iters: int, metrics: Path, evaluate: bool) -> list[str]:
        a = self.args
        flags = _with_flag(self.cfg["pretrain"], "--train-iters", iters)
        if iters != self.cfg["iters"] and flag_value(flags, "--lr-decay-iters") is None:
            flags += ["--lr-decay-iters", str(self.cfg["iters"])]  # a short run keeps the full run's schedule
        flags += ["--seed", str(a.seed), "--log-interval", "1", "--metrics-file", str(metrics),
                  "--eval-interval", str(a.eval_interval if evaluate else iters),
                  "--eval-iters", str(a.eval_iters if evaluate else 0)]
        extra = METHODS[method][1]
        if extra is None:  # compute-only: one cluster alone, its share of the global batch
            return _with_flag(flags, "--global-batch-size", self.cfg["gbs"] // a.clusters)
        flags += ["--dilocox-clusters", str(a.clusters), *(f.format(overlap=a.overlap_mode) for f in extra)]
        if extra:
            flags += ["--dilocox-local-steps", str(a.local_steps)]
            for flag, value in (("--dilocox-outer-lr", a.outer_lr), ("--dilocox-outer-momentum", a.outer_momentum)):
                if value is not None:
                    flags += [flag, str(value)]
            if a.outer_momentum == 0:  # plain outer SGD: Nesterov needs momentum
                flags += ["--dilocox-no-nesterov"]
            if method == "dilocox-overlap-compressed":
                flags += self.cfg["compression"]
        return flags

    def _launch(self, name: str, cmds: list[list[str]], metrics: list[Path], shaped: bool, iters: int) -> dict:
        for m in metrics:
            m.unlink(missing_ok=True)
        logs = [self.out / f"{name}{'-c%d' % k if len(cmds) > 1 else ''}.log" for k in range(len(cmds))]
        self.commands[name] = [" ".join(c) for c in cmds]
        before = [netns.link_stats(self.wan.namespace(k))["tx_bytes"] for k in range(self.wan.clusters)]
        last = [None]

        def progress():
            try:
                train = [r for r in read_records(metrics[-1]) if "lm_loss" in r]
            except FileNotFoundError:
                return
            if train and train[-1] is not last[0]:
                r = last[0] = train[-1]
                print(f"    {name}: iteration {r['iteration']}/{iters}  loss {r['lm_loss']:.3f}  "
                      f"{r['tokens_per_sec']:.0f} tokens/s  {r['elapsed_s']:.0f} s", flush=True)

        start = time.monotonic()
        launch.run(cmds, logs, poll=progress, poll_s=15.0,
                   env={"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
        progress()  # the last iteration, also for runs shorter than one poll
        after = [netns.link_stats(self.wan.namespace(k))["tx_bytes"] for k in range(self.wan.clusters)]
        tx = [b - a for a, b in zip(before, after)]
        print(f"    {name}: done in {time.monotonic() - start:.0f} s; "
              f"link tx per cluster (interface counters): {', '.join(f'{b / 2**20:.1f} MiB' for b in tx)}"
              f"{'' if shaped else ' (unshaped run on loopback)'}", flush=True)
        return dict(link_tx_bytes=tx if shaped else None)

    def spanning(self, method: str, iters: int, shaped: bool, tag: str, evaluate: bool = True) -> tuple[Path, dict]:
        """One job over all clusters, through the shaped links or (unshaped) all in one namespace."""
        a, name = self.args, f"{method}{tag}"
        metrics = self.out / f"{name}.jsonl"
        flags = ["pretrain_gpt.py", *self._flags(method, iters, metrics, evaluate)]
        if shaped:
            cmds = launch.spanning_job([self.wan.namespace(k) for k in range(a.clusters)], self.wan.address(0),
                                       a.ranks_per_cluster, flags, a.master_port)
        else:  # every rank in cluster 0's namespace, over its loopback
            cmds = [launch.in_namespace(self.wan.namespace(0), launch.torchrun_cmd(
                1, 0, a.clusters * a.ranks_per_cluster, "127.0.0.1", a.master_port, flags))]
        return metrics, self._launch(name, cmds, [metrics], shaped, iters)

    def compute_only(self) -> tuple[list[Path], dict]:
        a = self.args
        metrics = [self.out / f"compute-only-c{k}.jsonl" for k in range(a.clusters)]
        cmds = [launch.in_namespace(self.wan.namespace(k), launch.torchrun_cmd(
            1, 0, a.ranks_per_cluster, self.wan.address(k), a.master_port,
            ["pretrain_gpt.py", *self._flags("compute-only", self.cfg["iters"], metrics[k], True)]))
            for k in range(a.clusters)]
        return metrics, self._launch("compute-only", cmds, metrics, True, self.cfg["iters"])

    def run(self, method: str) -> dict:
        label = METHODS[method][0].format(overlap=self.args.overlap_mode)
        print(f"> {label} ({method})", flush=True)
        if method == "compute-only":
            paths, link = self.compute_only()
            return dict(method=method, label=label, kind="measured", **link, **compute_only_figures(paths))
        n = self.cfg["shaped"].get(method)
        if n is None:
            path, link = self.spanning(method, self.cfg["iters"], True, "")
            return dict(method=method, label=label, kind="measured", **link, **measured_figures(path))
        full, _ = self.spanning(method, self.cfg["iters"], False, "-unshaped")
        short, link = self.spanning(method, n, True, "-shaped", evaluate=False)
        unit = 1 if method == "allreduce" else self.args.local_steps
        return dict(method=method, label=label, kind=f"projected ({n} shaped its)", **link,
                    **projected_figures(full, short, unit))


def _final_bytes(records: list[dict]) -> int:
    """Cross-cluster bytes sent by the metrics rank: the per-round records under DiLoCoX (complete,
    drain included), else the cumulative count of the last training record."""
    rounds = [r["bytes_sent"] for r in records if "outer_step" in r]
    train = [r for r in records if "lm_loss" in r]
    return sum(rounds) if rounds else int(train[-1].get("cross_cluster_bytes") or 0)


def _eval_s(records: list[dict]) -> float:
    """Seconds spent in validation during training (the final evaluation comes after the clock)."""
    last = max(r["iteration"] for r in records if "lm_loss" in r)
    return sum(r["eval_s"] for r in records if "val_loss" in r and r["iteration"] < last)


def _curve(records: list[dict], time_of) -> list[dict]:
    """Validation points: iteration, tokens, seconds, cumulative cross-cluster bytes, loss."""
    train = {r["iteration"]: r for r in records if "lm_loss" in r}
    points = []
    for r in records:
        if "val_loss" in r and r["iteration"] in train:
            t = train[r["iteration"]]
            points.append(dict(iteration=r["iteration"], tokens=t["tokens"], time_s=time_of(t),
                               bytes=int(t.get("cross_cluster_bytes") or 0), val_loss=r["val_loss"]))
    if points:
        points[-1]["bytes"] = _final_bytes(records)
    return points


def measured_figures(path: Path) -> dict:
    s, records = summarize(str(path)), read_records(path)
    drain = sum(r["wait_s"] for r in records if r.get("drain"))  # last round's in-flight reduction
    train, wall = s["train_s"] + drain, s["wall_s"] + drain
    curve = _curve(records, lambda t: t["train_s"])
    curve[-1]["time_s"] = train
    return dict(tokens=s["tokens"], train_s=train, wall_s=wall, tokens_per_s=s["tokens"] / train,
                tokens_per_s_wall=s["tokens"] / wall, val_loss=s["val_loss"],
                cross_cluster_bytes=_final_bytes(records), curve=curve)


def projected_figures(full: Path, short: Path, unit: int) -> dict:
    """Loss and bytes of the unshaped full run; time = tokens / steady shaped throughput."""
    s, records = summarize(str(full)), read_records(full)
    train = [r for r in read_records(short) if "lm_loss" in r]
    first, last = next(r for r in train if r["iteration"] == unit), train[-1]
    rate = (last["tokens"] - first["tokens"]) / (last["train_s"] - first["train_s"])
    wall = s["tokens"] / rate + _eval_s(records)  # validation as long as in the unshaped run
    return dict(tokens=s["tokens"], train_s=s["tokens"] / rate, wall_s=wall, tokens_per_s=rate,
                tokens_per_s_wall=s["tokens"] / wall, val_loss=s["val_loss"],
                cross_cluster_bytes=_final_bytes(records), curve=_curve(records, lambda t: t["tokens"] / rate),
                shaped_window=dict(first_iteration=first["iteration"], last_iteration=last["iteration"],
                                   seconds=last["train_s"] - first["train_s"]))


def compute_only_figures(paths: list[Path]) -> dict:
    """Clusters trained alone, concurrently: tokens and tokens/s add up, loss is their mean."""
    runs = [summarize(str(p)) for p in paths]
    curves = [_curve(read_records(p), lambda t: t["train_s"]) for p in paths]
    curve = [dict(iteration=pts[0]["iteration"], tokens=sum(p["tokens"] for p in pts),
                  time_s=max(p["time_s"] for p in pts), bytes=0,
                  val_loss=sum(p["val_loss"] for p in pts) / len(pts)) for pts in zip(*curves)]
    return dict(tokens=sum(r["tokens"] for r in runs), train_s=max(r["train_s"] for r in runs),
                wall_s=max(r["wall_s"] for r in runs), tokens_per_s=sum(r["tokens"] / r["train_s"] for r in runs),
                tokens_per_s_wall=sum(r["tokens"] / r["wall_s"] for r in runs),
                val_loss=sum(r["val_loss"] for r in runs) / len(runs), cross_cluster_bytes=0, curve=curve,
                per_cluster_val_loss=[r["val_loss"] for r in runs])


def add_ratios(results: list[dict]) -> None:
    base = next((r for r in results if r["method"] == "allreduce"), None)
    limit = next((r for r in results if r["method"] == "compute-only"), None)
    for r in results:
        r["speedup_vs_allreduce"] = r["tokens_per_s"] / base["tokens_per_s"] if base else None
        r["fraction_of_compute_only"] = r["tokens_per_s"] / limit["tokens_per_s"] if limit else None
        r["fraction_of_compute_only_wall"] = r["tokens_per_s_wall"] / limit["tokens_per_s_wall"] if limit else None
        r["val_loss_gap_vs_allreduce"] = r["val_loss"] / base["val_loss"] - 1 if base else None


def table(results: list[dict]) -> str:
    def fmt(value, spec, scale=1.0):
        return "n/a" if value is None else format(value * scale, spec)

    header = (f"{'method':<26} {'tokens':>9} {'train s':>8} {'tokens/s':>9} {'x AllRed':>8} {'of c-only':>9} "
              f"{'wall s':>8} {'(of c-only)':>11} {'x-cluster MiB/rank':>18} {'val loss':>8} {'vs AllRed':>9}  how")
    lines = [header, "-" * len(header)]
    for r in results:
        gap = "" if r["val_loss_gap_vs_allreduce"] is None else f"{100 * r['val_loss_gap_vs_allreduce']:+.1f}%"
        lines.append(
            f"{r['label']:<26} {r['tokens']:>9,} {r['train_s']:>8.1f} {r['tokens_per_s']:>9.0f} "
            f"{fmt(r['speedup_vs_allreduce'], '.1f'):>7}x {fmt(r['fraction_of_compute_only'], '.1%'):>9} "
            f"{r['wall_s']:>8.1f} {fmt(r['fraction_of_compute_only_wall'], '.1%'):>11} "
            f"{r['cross_cluster_bytes'] / 2**20:>18,.2f} {r['val_loss']:>8.4f} {gap:>9}  {r['kind']}")
    return "\n".join(lines)


def plot(results: list[dict], out: Path, title: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for key, xlabel, fname in (("time_s", "training time (s), validation excluded", "loss_vs_time.png"),
                               ("bytes", "cross-cluster bytes sent per rank", "loss_vs_bytes.png")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in results:
            pts = [p for p in r["curve"] if key == "time_s" or p["bytes"] > 0]
            if pts:
                style = "--" if r["kind"].startswith("projected") else "-"
                ax.plot([p[key] for p in pts], [p["val_loss"] for p in pts], style, marker="o", ms=3,
                        label=r["label"] + (" (projected)" if style == "--" else ""))
        ax.set_xscale("log")
        ax.set_xlabel(xlabel + " (log scale)")
        ax.set_ylabel("validation loss")
        ax.set_title(title + ("" if key == "time_s" else "\n(compute-only sends nothing: not shown)"), fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=120)
        plt.close(fig)
        paths.append(out / fname)
    return paths


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
                 overlap_mode=args.overlap_mode, outer_lr=args.outer_lr, outer_momentum=args.outer_momentum,
                 compression_args=args.compression_args, seed=args.seed,
                 pretrain_flags=cfg["pretrain"],
                 harness_command=shlex.join([sys.executable, *sys.argv]))
    print(f"> {args.clusters} clusters x {args.ranks_per_cluster} ranks, every cluster link shaped to {args.rate} "
          f"(namespaces {args.prefix}-*); {cfg['iters']} iterations x {cfg['gbs']} x {cfg['seq']} tokens; "
          f"load average {setup['load_before'][0]:.1f}", flush=True)
    try:
        netns.up(wan)
        bench = Bench(args, cfg, wan)
        results = [bench.run(m) for m in cfg["methods"]]
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
    if "compute-only" in cfg["methods"]:
        print("compute-only: each cluster trained alone on its share of every batch; its loss is the mean of "
              "the clusters' separate models")
    print("train s and tokens/s: training time (validation excluded, the last round's drain included); "
          "wall s and (of c-only): with validation")
    plots = plot(results, out, f"{args.clusters} clusters x {args.ranks_per_cluster} ranks, {args.rate} per cluster link")
    (out / "results.json").write_text(json.dumps(dict(setup=setup, commands=bench.commands, table=text,
                                                      methods=results), indent=1))
    print(f"\n> wrote {out / 'results.json'}, {', '.join(str(p) for p in plots)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
