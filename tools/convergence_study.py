"""Convergence study: methods x seeds at equal tokens, one table of final validation losses.

    python tools/convergence_study.py --out runs/study --seeds 1,2,3 --nproc 2 \\
        --method "AllReduce lr 1e-3=" --method "AllReduce lr 2e-3=--lr 2e-3" \\
        --baseline "AllReduce lr 1e-3" --baseline "AllReduce lr 2e-3" \\
        --method "DiLoCoX=--dilocox" \\
        --method "sync fp32=--dilocox --dilocox-sync-mode sync --dilocox-compression none" \\
        --compare "sync fp32" -- <pretrain_gpt.py model, data and training flags>

Every run is ``pretrain_gpt.py`` under torchrun (the product's own path: nothing is simulated),
with the setting's flags, then the method's, then ``--seed``. Every run evaluates with
``--full-validation``: the whole validation split, the same batches each time, so the curves of
all runs are measured on one fixed held-out set; its standard error is reported.

- **Baseline:** the best (lowest mean final validation loss) of the ``--baseline`` methods, e.g.
  AllReduce at several learning rates. Baseline candidates run the first seed only until all of
  them have it; then only the best runs the remaining seeds.
- **Order:** the first seed of every method, then the next seed of every method, and so on, so
  an interrupted study already holds one full comparison.
- **Resume:** each finished run leaves ``done.json`` in its folder; a rerun with the same ``--out``
  skips finished runs (a run whose command changed is an error) and restarts unfinished ones,
  or, with ``--checkpoint-interval N``, resumes them from their last checkpoint (saved every N
  iterations in the run's ``ckpt/``, removed once it finishes): the resume is exact, so the run
  ends as it would have without the interruption, and its metrics file keeps the records up to
  the checkpoint.
- **Several processes, one study:** a process claims a run before making it (``claim.json`` in
  the run's folder, holding its host and pid) and skips runs other live processes hold, so two
  or more launches with the same ``--out`` share the study's runs (on more cores, or machines
  sharing the folder); a claim whose process died on this host is taken over.
- **Gap:** ``(method - baseline) / baseline`` of the mean final validation losses over the seeds
  both have finished (paired: a method with seed 1 only is compared with the baseline's seed 1,
  not with the mean of its three seeds); ``> spread`` says whether it exceeds the larger of the
  two methods' seed standard deviations over those seeds.

Writes ``results.json`` and ``curves.png`` (validation loss vs tokens and vs cross-cluster bytes,
mean over seeds) into ``--out``; per-run metrics and logs stay in ``--out/runs/``.
"""

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent / "wan"))  # for wan/launch.py's own imports
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from compare_runs import final_cross_cluster_bytes, read_records  # noqa: E402
from pretrain_flags import flag_value  # noqa: E402
from wan import launch  # noqa: E402  (tools/wan/launch.py: runs commands, stops them all on error or Ctrl-C)

REPO = Path(__file__).resolve().parent.parent
OWNED = ("--seed", "--metrics-file", "--full-validation", "--eval-iters", "--save", "--load")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="convergence_study.py", description=__doc__.split("\n\n")[0],
                                usage="%(prog)s --out DIR --method NAME=FLAGS ... [options] -- PRETRAIN_FLAGS...",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, help="study folder (runs, results.json, curves.png); reused to resume")
    p.add_argument("--method", action="append", default=[], metavar="NAME=FLAGS",
                   help="a method: its name, '=', and the pretrain_gpt.py flags it adds (may be empty)")
    p.add_argument("--baseline", action="append", default=[], metavar="NAME",
                   help="baseline candidate (repeat); the best of them by mean final loss is the baseline")
    p.add_argument("--compare", default=None, metavar="NAME", help="a second reference method for a gap column")
    p.add_argument("--seeds", default="1,2,3", help="comma-separated --seed values")
    p.add_argument("--nproc", type=int, default=2, help="processes per run (torchrun --nproc-per-node)")
    p.add_argument("--threads", type=int, default=None,
                   help="OMP_NUM_THREADS per process (default: CPU cores // --nproc, at least 1)")
    p.add_argument("--checkpoint-interval", type=int, default=0, metavar="N",
                   help="each run saves a checkpoint every N iterations, and a rerun resumes an interrupted "
                        "run from it (0: it starts over)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and commands, run nothing")
    p.add_argument("--report", action="store_true",
                   help="write results.json, curves.png and the table from the runs finished so far; run nothing")
    p.add_argument("pretrain", nargs=argparse.REMAINDER, help="-- then pretrain_gpt.py flags shared by all methods")
    return p


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "method"


def check_args(parser, args) -> dict:
    """Validates the flags (one-line errors naming the flag); returns the study plan's settings."""
    import shlex

    pretrain = args.pretrain[1:] if args.pretrain[:1] == ["--"] else args.pretrain
    if not pretrain:
        parser.error("give the pretrain_gpt.py model, data and training flags after --")
    methods = {}
    for item in args.method:
        name, sep, flags = item.partition("=")
        name = name.strip()
        if not sep or not name:
            parser.error(f"--method takes NAME=FLAGS, got {item!r}")
        if name in methods:
            parser.error(f"--method {name!r} is given twice")
        methods[name] = shlex.split(flags)
    if not methods:
        parser.error("give at least one --method NAME=FLAGS")
    if len({_slug(n) for n in methods}) != len(methods):
        parser.error("--method names must differ in their letters and digits (they name folders)")
    for flags in [pretrain, *methods.values()]:
        for item in flags:
            if item.startswith(OWNED):
                parser.error(f"{item.split('=')[0]} is set by the study; remove it from the flags")
    for name in [*args.baseline, *([args.compare] if args.compare else [])]:
        if name not in methods:
            parser.error(f"--baseline/--compare {name!r} is not a --method (have: {', '.join(methods)})")
    if not args.baseline:
        parser.error("name at least one --baseline method (e.g. AllReduce)")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--seeds takes comma-separated integers, got {args.seeds!r}")
    if not seeds or len(set(seeds)) != len(seeds):
        parser.error(f"--seeds needs distinct integers, got {args.seeds!r}")
    if args.nproc < 1:
        parser.error(f"--nproc must be >= 1, got {args.nproc}")
    for flag in ("--train-iters", "--global-batch-size", "--seq-length"):
        value = flag_value(pretrain, flag)
        if value is None or not value.isdigit():
            parser.error(f"the pretrain flags must contain {flag} N")
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.nproc)
    return dict(pretrain=pretrain, methods=methods, seeds=seeds, threads=threads)


def setting_facts(pretrain: list[str]) -> dict:
    """Parameters, tokens and whether the training data repeats, from the pretrain flags."""
    import warnings

    with warnings.catch_warnings():  # megatron-core's "Transformer Engine and Apex are not installed"
        warnings.simplefilter("ignore")
        from megatron_dilocox import arguments, planner

    args, _ = arguments.build_parser().parse_known_args(pretrain)
    tokens = args.train_iters * args.global_batch_size * args.seq_length
    facts = dict(train_tokens=tokens, global_batch_size=args.global_batch_size, seq_length=args.seq_length,
                 train_iters=args.train_iters)
    vocab = args.vocab_size
    if args.tokenizer_type == "SentencePieceTokenizer" and args.tokenizer_model:
        import sentencepiece

        vocab = sentencepiece.SentencePieceProcessor(model_file=args.tokenizer_model).get_piece_size()
    if vocab:
        fields = {f: getattr(args, f) for f in planner.ModelShape.__dataclass_fields__ if f != "vocab_size"}
        facts["parameters"] = planner.param_count(planner.ModelShape(vocab_size=vocab, **fields))
        facts["tokens_per_parameter"] = tokens / facts["parameters"]
    if args.data_path and len(args.data_path) == 1:
        facts["train_split_tokens"] = train_split_tokens(args.data_path[0], args.split)
    return facts


def train_split_tokens(prefix: str, split: str) -> int:
    """Tokens in the training split of a single-prefix dataset, as pretrain_gpt.py splits it."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )
    from megatron.core.datasets.indexed_dataset import _IndexReader

    from megatron_dilocox.training.data import split_tokens

    train_bounds = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))[0]
    return split_tokens(_IndexReader(prefix + ".idx", multimodal=False), train_bounds)[1]


def data_fingerprint(pretrain: list[str]) -> dict:
    """What the runs train and validate on: SHA-256 of the dataset's .bin and .idx and of the
    tokenizer model, so that a study never mixes runs made on different data (the large corpus
    depends on the installed packages, docs/data.md)."""
    from megatron_dilocox import arguments
    from megatron_dilocox.checkpoint.files import sha256_file as sha256

    args, _ = arguments.build_parser().parse_known_args(pretrain)
    prefixes = [p for p in args.data_path or [] if not p.replace(".", "", 1).isdigit()]  # a blend's weights
    facts = {f"{Path(p).name}{ext}": sha256(p + ext) for p in prefixes for ext in (".bin", ".idx")}
    if args.tokenizer_model:
        facts[Path(args.tokenizer_model).name] = sha256(args.tokenizer_model)
    return facts


class Study:
    """Plans, runs (or skips, when finished) and summarizes the runs of one study."""

    def __init__(self, args, cfg: dict):
        self.args, self.cfg = args, cfg
        self.out = Path(args.out)
        self.runs_dir = self.out / "runs"
        self._settings: dict[tuple[str, int], dict] = {}

    def folder(self, method: str, seed: int) -> Path:
        return self.runs_dir / _slug(method) / f"seed{seed}"

    def flags(self, method: str, seed: int) -> list[str]:
        """The run's pretrain_gpt.py flags: the setting's, the method's, then what the study sets."""
        return [*self.cfg["pretrain"], *self.cfg["methods"][method], "--seed", str(seed), "--full-validation",
                "--metrics-file", str(self.folder(method, seed) / "metrics.jsonl")]

    def settings(self, method: str, seed: int) -> dict:
        """Every pretrain_gpt.py setting of the run, defaults resolved, as the run itself parses them."""
        if (method, seed) not in self._settings:
            import dataclasses

            from megatron_dilocox import flags
            from megatron_dilocox.arguments import parse_args
            from megatron_dilocox.config import CompressionConfig

            run = parse_args(self.flags(method, seed))
            resolved = run.flat()
            if run.dilocox:  # the codec's defaults as the run resolves them (None: "the codec's default")
                comp = run.compression
                resolved.update({flags.dest(f, "dilocox"): getattr(comp, f.name)
                                 for f in dataclasses.fields(CompressionConfig)})
                if comp.codec != "topk":  # its settings do not apply (so their defaults may move)
                    resolved = {k: v for k, v in resolved.items() if not k.startswith("dilocox_topk_")}
            else:  # AllReduce: the outer loop's settings do not apply (the clusters only count bytes)
                resolved = {k: v for k, v in resolved.items()
                            if not k.startswith("dilocox_") or k == "dilocox_clusters"}
            self._settings[method, seed] = json.loads(json.dumps(resolved, default=str))
        return self._settings[method, seed]

    def done(self, method: str, seed: int) -> dict | None:
        """The finished run's summary, or None; refuses a finished run made with other flags or
        other defaults (a default that changed since would silently change what a method means)."""
        path = self.folder(method, seed) / "done.json"
        if not path.is_file():
            return None
        summary = json.loads(path.read_text())
        # Absent in runs recorded before settings were; a setting added since (a new flag, whose
        # default keeps what the code did before) is not compared.
        recorded = summary.get("settings") or {}
        changed = sorted(k for k, v in self.settings(method, seed).items() if k in recorded and recorded[k] != v)
        # Other flags that resolve to the recorded settings spell the same run (a default pinned
        # since it moved, so that the method's name keeps its meaning).
        other_flags = summary["flags"] != self.flags(method, seed) and (changed or not recorded)
        if other_flags or summary["nproc"] != self.args.nproc:
            raise SystemExit(f"convergence_study.py: error: {path.parent} was run with other flags; "
                             "use another --out or remove that folder")
        if "data" in summary and summary["data"] != self.cfg["data"]:  # absent in records made before it was
            raise SystemExit(f"convergence_study.py: error: {path.parent} was run on other data (its done.json "
                             f"records {summary['data']}, {', '.join(self.cfg['data']) or 'no file'} differ now); "
                             "use another --out or the data it was run on")
        if changed:
            raise SystemExit(f"convergence_study.py: error: {path.parent} was run with other settings of "
                             f"{', '.join(changed)} (changed defaults?); use another --out or remove that folder")
        return summary

    def total(self) -> int:
        """Runs in the whole study: baseline candidates other than the best run one seed."""
        seeds, others = len(self.cfg["seeds"]), len(self.args.baseline) - 1
        return (len(self.cfg["methods"]) - others) * seeds + others

    def pending(self) -> list[tuple[str, int]]:
        """The next runs to make, in order (see the module docstring); empty when complete."""
        seeds, candidates = self.cfg["seeds"], self.args.baseline
        first = [(m, seeds[0]) for m in self.cfg["methods"] if not self.done(m, seeds[0])]
        if first:
            return first
        best = self.best_baseline()
        return [(m, s) for s in seeds[1:] for m in self.cfg["methods"]
                if (m not in candidates or m == best) and not self.done(m, s)]

    def best_baseline(self) -> str:
        means = {m: statistics.mean(r["val_loss"] for r in self.finished(m)) for m in self.args.baseline
                 if self.finished(m)}
        return min(means, key=means.get) if means else self.args.baseline[0]

    def finished(self, method: str) -> list[dict]:
        return [s for s in (self.done(method, seed) for seed in self.cfg["seeds"]) if s]

    def claim(self, method: str, seed: int) -> bool:
        """Takes the run for this process; False when another live process holds it."""
        path = self.folder(method, seed) / "claim.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        me = dict(host=socket.gethostname(), pid=os.getpid())
        for _ in range(2):
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                try:
                    holder = json.loads(path.read_text())
                except (FileNotFoundError, json.JSONDecodeError):  # released, or being written: busy
                    return False
                if holder["host"] != me["host"] or psutil.pid_exists(holder["pid"]):
                    return False
                path.unlink(missing_ok=True)  # its process died: take it over
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            return True
        return False

    def release(self, method: str, seed: int) -> None:
        (self.folder(method, seed) / "claim.json").unlink(missing_ok=True)

    def next_run(self) -> tuple[str, int] | None:
        """The first pending run no other process holds, claimed; None when there is none."""
        return next((run for run in self.pending() if self.claim(*run)), None)

    def resume_point(self, folder: Path) -> int | None:
        """The iteration of an unfinished run's last checkpoint (None: start over). Its metrics
        file is cut back to the records up to it, and its log kept aside as ``log.to-N.txt``."""
        latest = folder / "ckpt" / "latest_checkpointed_iteration.txt"
        if not (self.args.checkpoint_interval and latest.is_file()):
            return None
        iteration = int(latest.read_text())
        kept = [r for r in _records(folder / "metrics.jsonl") if r.get("iteration", 0) <= iteration]
        tmp = folder / "metrics.jsonl.tmp"
        tmp.write_text("".join(json.dumps(r) + "\n" for r in [*kept, {"resumed_at": iteration}]))
        os.replace(tmp, folder / "metrics.jsonl")
        if (folder / "log.txt").is_file():
            os.replace(folder / "log.txt", folder / f"log.to-{iteration}.txt")
        return iteration

    def checkpointing(self, folder: Path, resumed: int | None) -> list[str]:
        """The flags that save the run's checkpoints (and resume it); they change none of its numbers."""
        if not self.args.checkpoint_interval:
            return []
        ckpt = str(folder / "ckpt")
        return ["--save", ckpt, "--save-interval", str(self.args.checkpoint_interval), "--most-recent-k", "1",
                *(["--load", ckpt] if resumed is not None else [])]

    def run(self, method: str, seed: int, index: int) -> None:
        folder = self.folder(method, seed)
        folder.mkdir(parents=True, exist_ok=True)
        resumed = self.resume_point(folder)
        if resumed is None:
            for stale in ("metrics.jsonl", "log.txt"):
                (folder / stale).unlink(missing_ok=True)
            shutil.rmtree(folder / "ckpt", ignore_errors=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={self.args.nproc}",
               f"--master-port={launch_port()}", str(REPO / "pretrain_gpt.py"), *self.flags(method, seed),
               *self.checkpointing(folder, resumed)]
        label = f"[{index}/{self.total()}] {method}, seed {seed}"
        print(f"> {label}{'' if resumed is None else f' (resumed from its checkpoint at iteration {resumed})'}: "
              f"torchrun --nproc-per-node {self.args.nproc} pretrain_gpt.py "
              f"{' '.join(self.flags(method, seed) + self.checkpointing(folder, resumed))}", flush=True)
        start = time.monotonic()
        iters = self.cfg["facts"]["train_iters"]

        def progress():
            records = _records(folder / "metrics.jsonl")
            train = [r for r in records if "lm_loss" in r]
            if train:
                it, elapsed = train[-1]["iteration"], time.monotonic() - start
                evals = [r["val_loss"] for r in records if "val_loss" in r]
                print(f"  {label}: iteration {it}/{iters}, lm loss {train[-1]['lm_loss']:.4f}"
                      + (f", val {evals[-1]:.4f}" if evals else "")
                      + f", {elapsed / 60:.1f} min, about {elapsed / max(it - (resumed or 0), 1) * (iters - it) / 60:.1f}"
                      " min left", flush=True)

        try:
            launch.run([cmd], logs=[folder / "log.txt"], poll=progress, poll_s=60.0,
                       env={"OMP_NUM_THREADS": str(self.cfg["threads"]), "PYTHONWARNINGS": "ignore"})
        except launch.WanError as err:
            raise SystemExit(f"convergence_study.py: error: {label} failed: {err}") from None
        summary = summarize_run(folder / "metrics.jsonl")
        summary.update(method=method, seed=seed, flags=self.flags(method, seed), nproc=self.args.nproc,
                       settings=self.settings(method, seed), data=self.cfg["data"], run_s=time.monotonic() - start)
        tmp = folder / "done.json.tmp"
        tmp.write_text(json.dumps(summary, indent=1))
        os.replace(tmp, folder / "done.json")
        shutil.rmtree(folder / "ckpt", ignore_errors=True)
        print(f"  {label}: final val loss {summary['val_loss']:.4f} (se {summary['val_loss_se']:.4f}), "
              f"{summary['run_s'] / 60:.1f} min", flush=True)


def launch_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _records(path: Path) -> list[dict]:
    try:
        return read_records(path)
    except FileNotFoundError:  # not written yet
        return []


def summarize_run(path: Path) -> dict:
    """Final validation loss, its standard error, the curves and the cross-cluster bytes of a run
    (its byte count goes on across a resume; its training time is summed over the resumed parts)."""
    records = read_records(str(path))
    train = [r for r in records if "lm_loss" in r]
    parts = [i for i, r in enumerate(records) if "resumed_at" in r] + [len(records)]
    train_s = sum(next((r["train_s"] for r in reversed(records[a:b]) if "lm_loss" in r), 0.0)
                  for a, b in zip([0, *parts[:-1]], parts))
    evals = [r for r in records if "val_loss" in r]
    rounds = [r for r in records if "outer_step" in r and r.get("bytes_sent")]
    tokens_per_iter = train[-1]["tokens"] / train[-1]["iteration"]
    bytes_at = {r["iteration"]: r.get("cross_cluster_bytes", 0) for r in train}
    return dict(
        val_loss=evals[-1]["val_loss"], val_loss_se=evals[-1]["val_loss_se"], val_batches=evals[-1]["val_batches"],
        tokens=train[-1]["tokens"], train_s=train_s,
        cross_cluster_bytes=final_cross_cluster_bytes(records) or 0,
        rounds=len(rounds),
        bytes_per_round=statistics.mean(r["bytes_sent"] for r in rounds) if rounds else None,
        dense_bytes_per_round=(statistics.mean(r.get("dense_bytes", r["bytes_sent"]) for r in rounds)
                               if rounds else None),
        curve=[dict(tokens=e["iteration"] * tokens_per_iter, val_loss=e["val_loss"],
                    cross_cluster_bytes=bytes_at.get(e["iteration"])) for e in evals],
    )


def _std(xs: list[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def _paired_gap(key: str, runs: list[dict], ref_runs: list[dict]) -> dict:
    """``key``: the gap of ``runs`` to ``ref_runs`` over the seeds both finished (a method's
    seeds against the same seeds of its reference, never against the reference's other seeds);
    ``key_seeds``: those seeds; ``key_exceeds_spread``: whether the difference of the means is
    above the larger seed standard deviation (with two paired seeds or more)."""
    ref = {r["seed"]: r["val_loss"] for r in ref_runs}
    seeds = sorted(r["seed"] for r in runs if r["seed"] in ref)
    if not seeds:
        return {}
    own = {r["seed"]: r["val_loss"] for r in runs}
    a, b = [own[s] for s in seeds], [ref[s] for s in seeds]
    out = {key: statistics.mean(a) / statistics.mean(b) - 1, key + "_seeds": seeds}
    if len(seeds) > 1:  # a spread needs two seeds
        out[key + "_exceeds_spread"] = abs(statistics.mean(a) - statistics.mean(b)) > max(_std(a), _std(b))
    return out


def summarize(study: Study) -> dict:
    """Per-method figures over seeds, the baseline and the gaps."""
    rows = {}
    for method in study.cfg["methods"]:
        runs = study.finished(method)
        if not runs:
            continue
        losses = [r["val_loss"] for r in runs]
        rows[method] = dict(
            seeds=[r["seed"] for r in runs], val_loss=statistics.mean(losses), std=_std(losses),
            min=min(losses), max=max(losses), val_loss_se=statistics.mean(r["val_loss_se"] for r in runs),
            cross_cluster_bytes=statistics.mean(r["cross_cluster_bytes"] for r in runs),
            bytes_per_round=runs[0]["bytes_per_round"], dense_bytes_per_round=runs[0]["dense_bytes_per_round"],
            rounds=runs[0]["rounds"], train_s=statistics.mean(r["train_s"] for r in runs),
            flags=study.cfg["methods"][method], runs=runs)
    base = study.best_baseline()
    for name, row in rows.items():
        for key, ref in (("gap", base), ("gap_compare", study.args.compare)):
            if ref in rows:
                row.update(_paired_gap(key, row["runs"], rows[ref]["runs"]))
        if base in rows and rows[base]["cross_cluster_bytes"] and row["cross_cluster_bytes"]:
            row["bytes_vs_baseline"] = rows[base]["cross_cluster_bytes"] / row["cross_cluster_bytes"]
    return dict(baseline=base, compare=study.args.compare, setting=study.cfg["facts"],
                pretrain=study.cfg["pretrain"], seeds=study.cfg["seeds"], methods=rows)


def print_table(results: dict) -> None:
    facts = results["setting"]
    print(f"\nsetting: {facts.get('parameters', 0):,} parameters, {facts['train_tokens']:,} training tokens"
          + (f" ({facts['tokens_per_parameter']:.1f} per parameter)" if "tokens_per_parameter" in facts else "")
          + f"; baseline: {results['baseline']}")
    compare = results["compare"]
    width = max([len("method"), *map(len, results["methods"])])
    header = (f"{'method':<{width}} {'n':>2} {'val loss':>8} {'std':>6} {'se':>6} {'vs base':>8} {'>spread':>7}"
              + (f" {'vs ' + compare:>{len(compare) + 4}}" if compare else "")
              + f" {'B/round':>11} {'fp32/round':>10} {'MiB/rank':>9} {'bytes vs base':>13}")
    print(header)
    print("-" * len(header))
    for name, r in results["methods"].items():
        gap = f"{r['gap'] * 100:+7.2f}%" if "gap" in r else f"{'n/a':>8}"
        exceeds = {True: "yes", False: "no", None: "-"}[r.get("gap_exceeds_spread")]
        cmp = ""
        if compare:
            w = len(compare) + 3
            cmp = f" {r['gap_compare'] * 100:+{w}.2f}%" if "gap_compare" in r else f" {'n/a':>{w + 1}}"
        per_round = f"{r['bytes_per_round']:,.0f}" if r["bytes_per_round"] else "-"
        ratio = (f"{r['dense_bytes_per_round'] / r['bytes_per_round']:.0f}x" if r["bytes_per_round"] else "-")
        vs = f"1/{r['bytes_vs_baseline']:,.0f}" if r.get("bytes_vs_baseline") else "-"
        print(f"{name:<{width}} {len(r['seeds']):>2} {r['val_loss']:>8.4f} {r['std']:>6.4f} {r['val_loss_se']:>6.4f}"
              f" {gap} {exceeds:>7}{cmp} {per_round:>11} {ratio:>10} {r['cross_cluster_bytes'] / 2**20:>9.1f} {vs:>13}")
    print("std: over seeds; se: standard error of the validation set; >spread: |gap| above the larger std; "
          "fp32/round: dense fp32 pseudo-gradient bytes over the bytes sent; vs: over the seeds both finished")
    methods = results["methods"]
    for name, r in methods.items():
        for key, ref in (("gap", results["baseline"]), ("gap_compare", compare)):
            paired = r.get(key + "_seeds")
            if paired and (paired != sorted(r["seeds"]) or paired != sorted(methods[ref]["seeds"])):
                print(f"  {name} vs {ref}: over seed(s) {', '.join(map(str, paired))} only")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax in (a, b):
        ax.set_prop_cycle(color=plt.cm.tab20.colors)  # distinct colours for up to 20 methods
    for name, r in results["methods"].items():
        curves = [run["curve"] for run in r["runs"]]
        n = min(len(c) for c in curves)
        mean = [statistics.mean(c[i]["val_loss"] for c in curves) for i in range(n)]
        a.plot([curves[0][i]["tokens"] for i in range(n)], mean, label=name)
        xs = [curves[0][i]["cross_cluster_bytes"] for i in range(n)]
        if all(x for x in xs):
            b.plot([x / 2**20 for x in xs], mean, label=name)
    a.set_xlabel("training tokens")
    b.set_xlabel("cross-cluster MiB sent per rank")
    b.set_xscale("log")
    for ax in (a, b):
        ax.set_ylabel("validation loss (mean over seeds)")
        ax.grid(alpha=0.3)
    a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cfg = check_args(parser, args)
    cfg["facts"] = facts = setting_facts(cfg["pretrain"])
    cfg["data"] = data_fingerprint(cfg["pretrain"])
    if facts.get("train_split_tokens") is not None and facts["train_tokens"] > facts["train_split_tokens"]:
        parser.error(f"the runs need {facts['train_tokens']:,} training tokens but the training split holds "
                     f"{facts['train_split_tokens']:,}: the data would repeat (fewer --train-iters or more data)")
    study = Study(args, cfg)
    print(f"> study in {study.out}: {len(cfg['methods'])} methods x seeds {cfg['seeds']}, {args.nproc} processes "
          f"x {cfg['threads']} threads per run; " + ", ".join(f"{k} {v:,}" if isinstance(v, int) else f"{k} {v:.2f}"
                                                               for k, v in facts.items()), flush=True)
    if args.dry_run:
        for method in cfg["methods"]:
            print(f"{method}: {' '.join(study.flags(method, cfg['seeds'][0]))}")
        return 0
    index = sum(1 for m in cfg["methods"] for s in cfg["seeds"] if study.done(m, s))
    while not args.report and (todo := study.next_run()):  # re-planned after every run: the best baseline may change
        index += 1
        try:
            study.run(*todo, index)
        finally:
            study.release(*todo)
    if not args.report and (busy := study.pending()):
        print(f"> {len(busy)} runs are being made by other processes sharing {study.out}: "
              "the table below holds what has finished so far", flush=True)
    results = summarize(study)
    study.out.mkdir(parents=True, exist_ok=True)
    tmp = study.out / "results.json.tmp"
    tmp.write_text(json.dumps(results, indent=1))
    os.replace(tmp, study.out / "results.json")
    plot(results, study.out / "curves.png")
    print_table(results)
    print(f"\n> {study.out / 'results.json'}, {study.out / 'curves.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
