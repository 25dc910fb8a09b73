"""A method's figures from its metrics files: tokens, training and wall time, throughput,
cross-cluster bytes, validation loss and its curve; then the ratios between methods."""

from pathlib import Path

from compare_runs import read_records, summarize


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
    drain = sum(r["wait_s"] for r in records if r.get("drain"))  # the last round's reduction and the flush
    train, wall = s["train_s"] + drain, s["wall_s"] + drain
    curve = _curve(records, lambda t: t["train_s"])
    curve[-1]["time_s"] = train
    return dict(tokens=s["tokens"], train_s=train, wall_s=wall, tokens_per_s=s["tokens"] / train,
                tokens_per_s_wall=s["tokens"] / wall, val_loss=s["val_loss"],
                cross_cluster_bytes=_final_bytes(records), curve=curve)


def window_rate(path: Path, unit: int) -> dict | None:
    """Steady throughput of one run: tokens per training second from the end of iteration
    ``unit`` (the first round, or step) to the end of the last; the start-up before it and the
    drain after it are left out. None for a run that ends at ``unit``."""
    train = [r for r in read_records(path) if "lm_loss" in r]
    first, last = next(r for r in train if r["iteration"] == unit), train[-1]
    if last is first:
        return None
    seconds = last["train_s"] - first["train_s"]
    return dict(tokens_per_s=(last["tokens"] - first["tokens"]) / seconds, first_iteration=first["iteration"],
                last_iteration=last["iteration"], seconds=seconds)


def projected_figures(full: Path, short: Path, unit: int) -> dict:
    """Loss and bytes of the unshaped full run; time = tokens / steady shaped throughput."""
    s, records = summarize(str(full)), read_records(full)
    window = window_rate(short, unit)
    rate = window.pop("tokens_per_s")
    wall = s["tokens"] / rate + _eval_s(records)  # validation as long as in the unshaped run
    return dict(tokens=s["tokens"], train_s=s["tokens"] / rate, wall_s=wall, tokens_per_s=rate,
                tokens_per_s_wall=s["tokens"] / wall, val_loss=s["val_loss"],
                cross_cluster_bytes=_final_bytes(records), curve=_curve(records, lambda t: t["tokens"] / rate),
                shaped_window=window)


def compute_only_figures(paths: list[Path], unit: int) -> dict:
    """Clusters trained alone, concurrently: tokens and tokens/s add up, loss is their mean;
    ``steady_tokens_per_s`` from the end of iteration ``unit`` on (:func:`window_rate`)."""
    runs = [summarize(str(p)) for p in paths]
    steady = [window_rate(p, unit) for p in paths]
    curves = [_curve(read_records(p), lambda t: t["train_s"]) for p in paths]
    curve = [dict(iteration=pts[0]["iteration"], tokens=sum(p["tokens"] for p in pts),
                  time_s=max(p["time_s"] for p in pts), bytes=0,
                  val_loss=sum(p["val_loss"] for p in pts) / len(pts)) for pts in zip(*curves)]
    return dict(tokens=sum(r["tokens"] for r in runs), train_s=max(r["train_s"] for r in runs),
                wall_s=max(r["wall_s"] for r in runs), tokens_per_s=sum(r["tokens"] / r["train_s"] for r in runs),
                tokens_per_s_wall=sum(r["tokens"] / r["wall_s"] for r in runs),
                val_loss=sum(r["val_loss"] for r in runs) / len(runs), cross_cluster_bytes=0, curve=curve,
                per_cluster_val_loss=[r["val_loss"] for r in runs],
                steady_tokens_per_s=sum(w["tokens_per_s"] for w in steady) if all(steady) else None)


def add_ratios(results: list[dict]) -> None:
    base = next((r for r in results if r["method"] == "allreduce"), None)
    limit = next((r for r in results if r["method"] == "compute-only"), None)
    for r in results:
        r["speedup_vs_allreduce"] = r["tokens_per_s"] / base["tokens_per_s"] if base else None
        r["fraction_of_compute_only"] = r["tokens_per_s"] / limit["tokens_per_s"] if limit else None
        r["fraction_of_compute_only_wall"] = r["tokens_per_s_wall"] / limit["tokens_per_s_wall"] if limit else None
        r["val_loss_gap_vs_allreduce"] = r["val_loss"] / base["val_loss"] - 1 if base else None
        steady = r.get("after_ramp")
        if steady:  # AllReduce's rate is steady already (projected) or nearly (one start-up step in a full run)
            steady["speedup_vs_allreduce"] = steady["tokens_per_s"] / base["tokens_per_s"] if base else None
            steady["fraction_of_compute_only"] = (steady["tokens_per_s"] / limit["steady_tokens_per_s"]
                                                  if limit and limit["steady_tokens_per_s"] else None)
