"""Prints training runs side by side from their ``--metrics-file`` outputs.

    python tools/compare_runs.py DiLoCoX=runs/dilocox.jsonl AllReduce=runs/allreduce.jsonl

The last run named is the baseline that the ratio columns refer to. Naming several files
alike (``delay=seed1.jsonl delay=seed2.jsonl``) averages them and shows the spread
(max - min) of the validation loss.
"""

import argparse
import json
import sys
from pathlib import Path


def read_records(path) -> list[dict]:
    """The records of a ``--metrics-file`` in order: the one reader of the tools and tests.

    A last line that is not yet whole (the run is writing it, or was killed while it did) is
    left out; any other line that is not a JSON object raises ValueError naming file and line.
    OSError (no such file) passes through.
    """
    *lines, tail = Path(path).read_text().split("\n")
    records = []
    for number, line in enumerate(lines + [tail], 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines) + 1:  # the unfinished last line
                break
            raise ValueError(f"{path}:{number}: not a JSON record: {line[:80]!r}") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{number}: not a JSON object: {line[:80]!r}")
        records.append(record)
    return records


def final_cross_cluster_bytes(records: list[dict]) -> int | None:
    """The run's cross-cluster bytes: the last count any record carries (a DiLoCoX run's drained
    last round, with the final flush, comes after its last training record)."""
    counts = [r["cross_cluster_bytes"] for r in records if r.get("cross_cluster_bytes") is not None]
    return counts[-1] if counts else None


def summarize(path: str) -> dict:
    """Final validation loss, tokens, time and cross-cluster bytes of one metrics file.

    ``train_s`` and ``tokens_per_sec`` leave out validation and checkpoint saves (as the
    training log does); ``wall_s`` is the wall clock at the last training record.
    """
    records = read_records(path)
    train = [r for r in records if "lm_loss" in r]
    evals = [r for r in records if "val_loss" in r]
    if not train or not evals:
        raise SystemExit(f"compare_runs.py: error: {path}: no training or validation records")
    last = train[-1]
    train_s = last.get("train_s", last["elapsed_s"])  # files written before train_s: wall clock
    return dict(val_loss=evals[-1]["val_loss"], tokens=last["tokens"], train_s=train_s,
                wall_s=last["elapsed_s"], tokens_per_sec=last["tokens"] / train_s,
                cross_cluster_bytes=final_cross_cluster_bytes(records),
                rounds=sum(1 for r in records if "outer_step" in r and not r.get("drain")))


def _mb(nbytes):
    return "n/a" if nbytes is None else f"{nbytes / 2**20:,.1f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="NAME=METRICS_FILE")
    args = parser.parse_args(argv)
    groups = {}
    for item in args.runs:
        name, sep, path = item.partition("=")
        if not sep:
            parser.error(f"expected NAME=METRICS_FILE, got {item!r}")
        try:
            groups.setdefault(name, []).append(summarize(path))
        except (OSError, ValueError) as err:
            parser.error(str(err))
    rows = [(name, _mean(runs)) for name, runs in groups.items()]
    base = rows[-1][1]
    header = (f"{'run':<14} {'n':>2} {'val loss':>9} {'spread':>7} {'vs base':>8} {'tokens':>10} {'train s':>8} "
              f"{'tokens/s':>9} {'x-cluster MiB/rank':>19} {'bytes vs base':>14}")
    print(header)
    print("-" * len(header))
    for name, s in rows:
        gap = (s["val_loss"] / base["val_loss"] - 1) * 100
        ratio = ("n/a" if not s["cross_cluster_bytes"] or not base["cross_cluster_bytes"]
                 else f"1/{base['cross_cluster_bytes'] / s['cross_cluster_bytes']:.1f}")
        print(f"{name:<14} {s['n']:>2} {s['val_loss']:>9.4f} {s['spread']:>7.4f} {gap:>+7.1f}% {s['tokens']:>10,} "
              f"{s['train_s']:>8.1f} {s['tokens_per_sec']:>9.0f} {_mb(s['cross_cluster_bytes']):>19} {ratio:>14}")
    return 0


def _mean(runs: list[dict]) -> dict:
    """Mean of each figure over runs, plus the validation-loss spread (max - min)."""
    out = {key: sum(r[key] for r in runs) / len(runs) for key in ("val_loss", "tokens", "train_s", "tokens_per_sec")}
    out["tokens"] = int(out["tokens"])
    xs = [r["cross_cluster_bytes"] for r in runs]
    out["cross_cluster_bytes"] = None if None in xs else sum(xs) / len(xs)
    out["spread"] = max(r["val_loss"] for r in runs) - min(r["val_loss"] for r in runs)
    out["n"] = len(runs)
    return out


if __name__ == "__main__":
    sys.exit(main())
