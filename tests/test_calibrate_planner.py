"""tools/calibrate_planner.py (tools/calibration/): the fit and the predicted-vs-measured rows, on
synthetic metrics; the wait for a quiet machine."""
import io
import json
import sys

import pytest

from launch import REPO

sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(REPO))

from calibration import quiet  # noqa: E402
from calibration.prediction import fit_elementwise, predict, predicted_step  # noqa: E402
from calibration.table import table as rows_table  # noqa: E402

FIG = {"cpu_gflops": [100.0, 180.0], "intra_gbps": 8.0, "tp_gbps": 4.0}


def _metrics(path, step_s: list[float], bytes_per_step: float = 0.0) -> None:
    """A metrics file as pretrain_gpt.py writes it: one line per 10 iterations, then the tool's meta."""
    tokens_per_step = 16 * 128
    with open(path, "w") as f:
        for i, s in enumerate(step_s, 1):
            f.write(json.dumps({"iteration": 10 * i, "tokens": 10 * i * tokens_per_step,
                                "tokens_per_sec": tokens_per_step / s,
                                "cross_cluster_bytes": int(10 * i * bytes_per_step)}) + "\n")
        f.write(json.dumps({"busy_before": 0.0, "load_before": 1.0, "load_after": 2.0, "command": "x"}) + "\n")


def test_fit_and_rows(tmp_path):
    # h256 DP2 measured at 0.5 s in its fastest window after warm-up (the first window is dropped)
    _metrics(tmp_path / "h256-dp2.jsonl", [9.0, 0.6, 0.5, 0.55])
    ns = fit_elementwise("data", str(tmp_path), {"h256": FIG})
    p, _ = predict("h256", "dp2", "data", FIG, ns)
    assert ns > 0 and predicted_step(p, "dp2") == pytest.approx(0.5, rel=1e-6)
    # the AllReduce row is its inner step plus the cross-cluster gradient all-reduce; DiLoCoX's is
    # its round over H (the exchange hidden in delay mode): the same inner step
    ar, _ = predict("h256", "allreduce-2xpp2", "data", FIG, ns)
    dlx, _ = predict("h256", "dilocox-2xpp2", "data", FIG, ns)
    assert predicted_step(ar, "allreduce-2xpp2") == pytest.approx(ar.step.total + ar.allreduce.comm)
    assert ar.allreduce.comm > 0
    assert predicted_step(dlx, "dilocox-2xpp2") == pytest.approx(dlx.step.total)
    # a row 20% slower than predicted reads -16.7%; bytes per step are compared with the planner's
    per_step = ar.allreduce.per_stage[-1]
    _metrics(tmp_path / "h256-allreduce-2xpp2.jsonl", [9.0] + [1.2 * predicted_step(ar, "allreduce-2xpp2")] * 4,
             per_step)
    table = rows_table(["h256"], ["dp2", "allreduce-2xpp2"], "data", str(tmp_path), {"h256": FIG}, ns)
    rows = table.splitlines()[2:]
    assert len(rows) == 2 and "| dp2 (fitted) |" in rows[0] and "+0.0%" in rows[0]
    assert "-16.7%" in rows[1] and f"{int(per_step):,}/step" in rows[1]


def test_cpu_busy_from_proc_stat(monkeypatch):
    # /proc/stat before and after the sleep: user nice system idle iowait irq softirq (steal guest
    # guest_nice 0); the per-core lines must be ignored. Over the interval 800 ticks passed, 400 idle
    # and 150 iowait, so 250 of them busy.
    snapshots = iter(["cpu  100 10 50 700 100 20 20 0 0 0\ncpu0 1 1 1 1 1 1 1 0 0 0\n",
                      "cpu  250 20 120 1100 250 40 20 0 0 0\ncpu0 9 9 9 9 9 9 9 0 0 0\n"])
    slept = []

    def read(path):
        assert path == "/proc/stat"
        return io.StringIO(next(snapshots))

    monkeypatch.setattr(quiet, "open", read, raising=False)
    monkeypatch.setattr(quiet.time, "sleep", slept.append)
    assert quiet.cpu_busy(0.5) == pytest.approx(250 / 800)
    assert slept == [0.5]


def test_wait_quiet_needs_three_quiet_seconds_in_a_row(monkeypatch):
    # a busy second starts the count again: quiet, quiet (at the limit), busy, then three quiet ones
    shares = iter([0.05, 0.1, 0.5, 0.02, 0.08, 0.03, 0.9])
    monkeypatch.setattr(quiet, "cpu_busy", lambda: next(shares))
    assert quiet.wait_quiet(0.1) == 0.03
    assert next(shares) == 0.9  # nothing read after the third quiet second


def test_table_only_reprints_from_the_measured_files(tmp_path, capsys):
    import calibrate_planner

    (tmp_path / "machine.json").write_text(json.dumps({"h256": {**FIG, "load": 0.5}}))
    _metrics(tmp_path / "h256-dp2.jsonl", [9.0, 0.6, 0.5, 0.55])
    assert calibrate_planner.main(["--table-only", "--out", str(tmp_path), "--models", "h256"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "> h256: --cpu-gflops 100.0 180.0 --intra-bandwidth-gbps 8.00 --tp-bandwidth-gbps 4.00 " \
                     "(measured under load 0.50)"
    assert out[1].startswith("> --cpu-elementwise-ns ") and out[1].endswith(" (fitted to h256 dp2)")
    assert len(out) == 5 and "| h256 | dp2 (fitted) | 2 |" in out[4]  # header, rule, the one measured run
