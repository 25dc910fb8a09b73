"""The benchmarked methods and their runs: every method's pretrain_gpt.py flags, launched over the
clusters' namespaces (or, unshaped, all in the first one) as one job across the clusters
(AllReduce) or as one job per cluster (compute-only, and DiLoCoX joined by a torchft
Lighthouse), with progress lines and the shaped interfaces' byte counters."""

import time
from pathlib import Path

import launch
import netns
from compare_runs import read_records
from pretrain_flags import flag_value
from vs_allreduce.figures import compute_only_figures, measured_figures, projected_figures, window_rate

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


def run_order(methods: list[str], compute_only_repeats: int) -> list[str]:
    """The methods in the order given, compute-only ``compute_only_repeats`` times spread evenly
    over them (the first and the last run among them), so that drift of the machine's speed during
    the benchmark moves its median less than any one measurement."""
    others = [m for m in methods if m != "compute-only"]
    if "compute-only" not in methods or compute_only_repeats == 1:
        return list(methods)
    slots = [round(i * len(others) / (compute_only_repeats - 1)) for i in range(compute_only_repeats)]
    order = []
    for k in range(len(others) + 1):
        order += ["compute-only"] * slots.count(k)
        order += others[k:k + 1]
    return order


def with_flag(argv: list[str], flag: str, value) -> list[str]:
    """``argv`` with ``flag``'s value replaced."""
    out = list(argv)
    i = out.index(flag)
    out[i + 1] = str(value)
    return out


class Bench:
    """Runs the methods and collects their curves and figures."""

    def __init__(self, args, cfg, wan: netns.Wan):
        self.args, self.cfg, self.wan = args, cfg, wan
        self.out = Path(args.out)
        self.commands = {}

    def _flags(self, method: str, iters: int, metrics: Path, evaluate: bool, fixed_h: bool = False) -> list[str]:
        """``method``'s pretrain_gpt.py flags; ``fixed_h`` (always for a projected method): a DiLoCoX
        method without the H ramp, for its throughput in steady rounds."""
        a = self.args
        flags = with_flag(self.cfg["pretrain"], "--train-iters", iters)
        if iters != self.cfg["iters"] and flag_value(flags, "--lr-decay-iters") is None:
            flags += ["--lr-decay-iters", str(self.cfg["iters"])]  # a short run keeps the full run's schedule
        flags += ["--seed", str(a.seed), "--log-interval", "1", "--metrics-file", str(metrics),
                  "--eval-interval", str(a.eval_interval if evaluate else iters),
                  "--eval-iters", str(a.eval_iters if evaluate else 0)]
        extra = METHODS[method][1]
        if extra is None:  # compute-only: one cluster alone, its share of the global batch
            return with_flag(flags, "--global-batch-size", self.cfg["gbs"] // a.clusters)
        flags += ["--dilocox-clusters", str(a.clusters), *(f.format(overlap=a.overlap_mode) for f in extra)]
        if extra:
            flags += ["--dilocox-local-steps", str(a.local_steps)]
            fixed_h = fixed_h or method in self.cfg["shaped"]
            ramp = 0 if fixed_h else a.local_steps_ramp_iters
            floor = None if fixed_h else a.min_local_steps
            for flag, value in (("--dilocox-local-steps-ramp-iters", ramp), ("--dilocox-min-local-steps", floor),
                                ("--dilocox-outer-lr", a.outer_lr), ("--dilocox-outer-momentum", a.outer_momentum)):
                if value is not None:
                    flags += [flag, str(value)]
            if a.outer_momentum == 0:  # plain outer SGD: Nesterov needs momentum
                flags += ["--dilocox-no-nesterov"]
            if method == "dilocox-overlap-compressed":
                flags += self.cfg["compression"]
        return flags

    def _launch(self, name: str, cmds: list[list[str]], metrics: list[Path], shaped: bool, iters: int,
                service: list[str] | None = None) -> dict:
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
                   env={"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}, service=service)
        progress()  # the last iteration, also for runs shorter than one poll
        after = [netns.link_stats(self.wan.namespace(k))["tx_bytes"] for k in range(self.wan.clusters)]
        tx = [b - a for a, b in zip(before, after)]
        print(f"    {name}: done in {time.monotonic() - start:.0f} s; "
              f"link tx per cluster (interface counters): {', '.join(f'{b / 2**20:.1f} MiB' for b in tx)}"
              f"{'' if shaped else ' (unshaped run on loopback)'}", flush=True)
        return dict(link_tx_bytes=tx if shaped else None)

    def trained(self, method: str, iters: int, shaped: bool, tag: str, evaluate: bool = True,
                fixed_h: bool = False) -> tuple[Path, dict]:
        """One training run of ``method``, through the shaped links or (unshaped) all in one
        namespace; returns its metrics file (under DiLoCoX as jobs: cluster 0's) and link counters."""
        a, name = self.args, f"{method}{tag}"
        metrics = self.out / f"{name}.jsonl"
        flags = ["pretrain_gpt.py", *self._flags(method, iters, metrics, evaluate, fixed_h)]
        if "--dilocox" in flags:
            namespaces = [self.wan.namespace(k if shaped else 0) for k in range(a.clusters)]
            addresses = [self.wan.address(k) if shaped else "127.0.0.1" for k in range(a.clusters)]
            lighthouse, cmds = launch.cluster_jobs(namespaces, addresses, a.ranks_per_cluster, flags, a.master_port)
            return metrics, self._launch(name, cmds, [metrics], shaped, iters, service=lighthouse)
        if shaped:
            cmds = launch.spanning_job([self.wan.namespace(k) for k in range(a.clusters)], self.wan.address(0),
                                       a.ranks_per_cluster, flags, a.master_port)
        else:  # every rank in cluster 0's namespace, over its loopback
            cmds = [launch.in_namespace(self.wan.namespace(0), launch.torchrun_cmd(
                1, 0, a.clusters * a.ranks_per_cluster, "127.0.0.1", a.master_port, flags))]
        return metrics, self._launch(name, cmds, [metrics], shaped, iters)

    def compute_only(self, repeat: int) -> tuple[list[Path], dict]:
        a, name = self.args, f"compute-only-r{repeat}"
        metrics = [self.out / f"{name}-c{k}.jsonl" for k in range(a.clusters)]
        cmds = [launch.in_namespace(self.wan.namespace(k), launch.torchrun_cmd(
            1, 0, a.ranks_per_cluster, self.wan.address(k), a.master_port,
            ["pretrain_gpt.py", *self._flags("compute-only", self.cfg["iters"], metrics[k], True)]))
            for k in range(a.clusters)]
        return metrics, self._launch(name, cmds, metrics, True, self.cfg["iters"])

    def run_all(self, methods: list[str]) -> list[dict]:
        """Every method's figures; compute-only's are those of its median run by tokens/s (of
        ``--compute-only-repeats``), with every run's throughput beside them."""
        results, alone = [], []
        for method in run_order(methods, self.args.compute_only_repeats):
            (alone if method == "compute-only" else results).append(self.run(method, repeat=len(alone)))
        if alone:
            median = sorted(alone, key=lambda r: r["tokens_per_s"])[(len(alone) - 1) // 2]
            results.append(dict(median, kind=f"measured (median of {len(alone)} runs)" if len(alone) > 1 else "measured",
                                repeats=[dict(tokens_per_s=r["tokens_per_s"], train_s=r["train_s"]) for r in alone]))
        return results

    def run(self, method: str, repeat: int = 0) -> dict:
        label = METHODS[method][0].format(overlap=self.args.overlap_mode)
        print(f"> {label} ({method}{f', run {repeat + 1}' if method == 'compute-only' else ''})", flush=True)
        if method == "compute-only":
            paths, link = self.compute_only(repeat)
            return dict(method=method, label=label, kind="measured", **link,
                        **compute_only_figures(paths, self.args.local_steps))
        n = self.cfg["shaped"].get(method)
        if n is None:
            path, link = self.trained(method, self.cfg["iters"], True, "")
            row = dict(method=method, label=label, kind="measured", **link, **measured_figures(path))
            if method == "dilocox-overlap-compressed" and self.args.after_ramp_iters:
                # The run above stays in the H ramp for its first --dilocox-local-steps-ramp-iters;
                # a long run spends nearly all its time after it, at H: this run measures that.
                print(f"> {label} after the H ramp: at H {self.args.local_steps}, "
                      f"{self.args.after_ramp_iters} iterations, throughput only", flush=True)
                steady, _ = self.trained(method, self.args.after_ramp_iters, True, "-after-ramp",
                                         evaluate=False, fixed_h=True)
                row["after_ramp"] = window_rate(steady, self.args.local_steps)
            return row
        full, _ = self.trained(method, self.cfg["iters"], False, "-unshaped")
        short, link = self.trained(method, n, True, "-shaped", evaluate=False)
        unit = 1 if method == "allreduce" else self.args.local_steps
        return dict(method=method, label=label, kind=f"projected ({n} shaped its)", **link,
                    **projected_figures(full, short, unit))
