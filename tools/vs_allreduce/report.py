"""The benchmark's table and its two plots (validation loss vs training time and vs bytes)."""

from pathlib import Path


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
