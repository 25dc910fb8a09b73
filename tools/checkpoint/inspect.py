"""Print what a checkpoint holds and check every file against its manifest.

    python tools/checkpoint/inspect.py CKPT_DIR [--iteration N] [--no-verify] [--json]

Shows the iteration, model, layout, DiLoCoX state (outer step, whether a reduction was in flight,
compressor state), sizes, and ``OK`` / the problem for every file, files the manifest does not
list included. Exits 1 if a file fails, 2 if the checkpoint cannot be read (e.g. its manifest
does not match its digest).
Reads files only: no process group, no megatron.
"""

import os
import sys

# This folder holds inspect.py, which would shadow the standard library's inspect module (used by
# torch) for every script started from here: take the script's folder off the import path.
sys.path = [p for p in sys.path if p != os.path.dirname(os.path.abspath(__file__))]

import argparse  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

from megatron_dilocox.checkpoint import files  # noqa: E402
from megatron_dilocox.errors import CheckpointError  # noqa: E402


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB"


def _outer_summary(folder: Path, name: str) -> dict:
    """The DiLoCoX state of one rank file, in numbers."""
    import torch  # here, not at the top: the usage and errors print without torch's start-up

    state = torch.load(folder / name, weights_only=True)["dilocox"]
    sync = state["sync"]
    summary = {"outer_step": sync["outer_step"], "sync_mode": sync["sync_mode"],
               "outer_params": sync["base"].numel(),
               "round_in_flight": sync["pending_grad"] is not None,
               "momentum": any(b is not None for b in sync["optimizer"]["momentum_buffers"]),
               "local_steps": state["local_steps"], "next_boundary": state["next_boundary"]}
    compressor = state["compressor"]
    if compressor is not None:
        summary.update(compressor_round=compressor["round"], ranks=sorted(set(compressor["ranks"])),
                       error_feedback_residual=compressor["residual"] is not None)
    return summary


def inspect(root, iteration: int | None, verify: bool) -> dict:
    folder = files.iteration_dir(root, iteration) if iteration is not None else files.latest(root)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: no such checkpoint")
    manifest = files.read_manifest(folder)
    report = {key: manifest.get(key) for key in ("kind", "iteration", "saved_at", "source", "consumed_samples",
                                                  "eval_round", "model", "layout", "dilocox")}
    report["folder"] = str(folder)
    report["files"] = {}
    for name, info in sorted(manifest["files"].items()):
        status = "not checked"
        if verify:
            try:
                files.verify(folder, manifest, [name])
                status = "OK"
            except CheckpointError as err:
                status = str(err)
        report["files"][name] = {"bytes": info["bytes"], "sha256": info["sha256"], "status": status}
    if verify:
        for name in files.unlisted(folder, manifest):
            report["files"][name] = {"bytes": (folder / name).stat().st_size, "sha256": None,
                                     "status": f"{folder / name}: {files.NOT_LISTED}"}
    ranks = [n for n in manifest["files"] if n.startswith("ranks/")]
    if manifest.get("dilocox") and ranks and report["files"][ranks[0]]["status"] in ("OK", "not checked"):
        report["outer_state"] = {"file": ranks[0], **_outer_summary(folder, ranks[0])}
    return report


def _print(report: dict) -> None:
    print(f"checkpoint {report['folder']}")
    print(f"  kind {report['kind']}, iteration {report['iteration']}, saved {report['saved_at']}"
          + (f", from {report['source']}" if report.get("source") else ""))
    if report.get("consumed_samples") is not None:
        print(f"  consumed samples {report['consumed_samples']:,}, validation batches used {report['eval_round']}")
    print("  model  " + " ".join(f"{k}={v}" for k, v in report["model"].items()))
    layout = report["layout"]
    print("  layout " + (" ".join(f"{k}={v}" for k, v in layout.items()) if layout else
                         "none (weights only: loads into any layout)"))
    if report["dilocox"]:
        print("  DiLoCoX " + " ".join(f"{k}={v}" for k, v in report["dilocox"].items()))
    if "outer_state" in report:
        summary = dict(report["outer_state"])
        print(f"  outer state of {summary.pop('file')}: " + " ".join(f"{k}={v}" for k, v in summary.items()))
    by_part = {}
    for name, info in report["files"].items():
        part = name.split("/")[0] if "/" in name else "."
        by_part.setdefault(part, []).append(info["bytes"])
    for part, sizes in sorted(by_part.items()):
        print(f"  {part + '/':8s} {len(sizes):4d} files {_mib(sum(sizes)):>14s}")
    bad = {n: i["status"] for n, i in report["files"].items() if i["status"] not in ("OK", "not checked")}
    checked = [i for i in report["files"].values() if i["status"] == "OK"]
    if bad:
        for status in bad.values():
            print(f"  FAILED {status}")
    elif checked:
        print(f"  checksums OK ({len(checked)} files, sha256)")
    else:
        print("  checksums not checked (--no-verify)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="inspect.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="checkpoint directory (the one --save wrote)")
    parser.add_argument("--iteration", type=int, default=None, help="inspect iter_N instead of the latest")
    parser.add_argument("--no-verify", action="store_true", help="skip the sha256 check of every file")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    try:
        report = inspect(args.checkpoint, args.iteration, not args.no_verify)
    except CheckpointError as err:
        print(f"inspect.py: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=1)) if args.json else _print(report)
    return 1 if any(i["status"] not in ("OK", "not checked") for i in report["files"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
