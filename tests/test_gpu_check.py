"""tools/gpu_check.py: the wheels it prepares for an offline GPU machine, the figures it reads from
the runs' metrics files, and its whole plumbing on the CPU (vanilla and DiLoCoX as cluster jobs)."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch import REPO, free_port, worker_env

from megatron_dilocox.run_config import LoggingConfig
from megatron_dilocox.training.metrics import MetricsLogger
from tools import gpu_check
from tools.compare_runs import read_records


def test_wheel_versions_come_from_the_constraints_for_the_gpu_machines_python():
    pins = {version: gpu_check.constraint_pins(REPO / "constraints-cpu.txt", version) for version in ("3.11", "3.12")}
    assert pins["3.11"]["megatron-core"] == "0.16.1" and pins["3.12"]["megatron-core"] == "0.19.2"
    assert pins["3.12"]["torch"] == "2.13.0" and pins["3.11"]["torch"] == "2.13.0"  # the local build tag dropped
    assert all(package in pins["3.12"] for package in gpu_check.GPU_IMAGE_LACKS)


def test_the_memory_record_is_what_the_check_reads(tmp_path):
    logger = MetricsLogger(LoggingConfig(metrics_file=str(tmp_path / "m.jsonl")), 10, 4, is_writer=True)
    logger.memory(10, 3 * 2**30, 2**29)
    logger.memory(10, 2**30, None)  # a torch that reports no pinned figure: the last record counts
    logger.close()
    records = read_records(tmp_path / "m.jsonl")
    assert records[0] == {"iteration": 10, "peak_gpu_memory_gib": 3.0, "peak_pinned_host_gib": 0.5}
    assert gpu_check.memory(records) == (1.0, None)


def test_figures_from_metrics_records():
    timed = {"comm_s": 0.5, "codec_s": 0.1, "wait_s": 0.25}
    records = [{"iteration": 5, "lm_loss": 7.0, "tokens_per_sec": 10.0},  # the warm-up window
               {"iteration": 10, "lm_loss": 6.0, "tokens_per_sec": 40.0},
               {"outer_step": 1, "drain": False, "bytes_sent": 0, "participants": 0, **timed},  # nothing landed
               {"outer_step": 2, "drain": False, "bytes_sent": 9, "participants": 2, **timed},
               {"iteration": 15, "lm_loss": 5.0, "tokens_per_sec": 50.0},
               {"outer_step": 3, "drain": False, "bytes_sent": 9, "participants": 1, **timed, "comm_s": 0.7},
               {"iteration": 20, "lm_loss": 4.5, "tokens_per_sec": 20.0},
               {"outer_step": 3, "drain": True, "bytes_sent": 9, "participants": 2, "global_sha256": "ab",
                **timed, "comm_s": 0.9, "wait_s": 1.0}]
    assert gpu_check.steady_tokens_per_sec(records) == 40.0
    assert gpu_check.losses(records) == (7.0, 4.5)
    assert gpu_check.rounds(records) == {"rounds": 3, "full": 2, "global_sha256": "ab", "comm_s": 0.7,
                                         "codec_s": 0.1, "wait_s": 1.5}
    with pytest.raises(ValueError, match="2 logging windows"):
        gpu_check.steady_tokens_per_sec(records[:1])


def test_peak_flops_by_device_name():
    assert gpu_check.peak_tflops("NVIDIA H100 80GB HBM3", None) == 989.4
    assert gpu_check.peak_tflops("NVIDIA H100 PCIe", None) == 756.0
    assert gpu_check.peak_tflops("NVIDIA H200", None) == 989.4
    assert gpu_check.peak_tflops("Some GPU", 123.0) == 123.0
    with pytest.raises(SystemExit, match="--peak-tflops"):
        gpu_check.peak_tflops("Some GPU", None)


def test_the_check_runs_end_to_end_on_the_cpu(tmp_path):
    """The same parts as on a GPU (fp32, no offload, no CUDA tests): both runs train, every
    round is delivered by both clusters and they end with the same global parameters."""
    out = tmp_path / "check"
    proc = subprocess.run([sys.executable, "tools/gpu_check.py", "--allow-cpu", "--sizes", "tiny", "--iters", "10",
                           "--dilocox-iters", "10", "--local-steps", "2", "--peak-tflops", "1", "--out", str(out),
                           "--master-port", str(free_port())],
                          cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    results = json.loads((out / "results.json").read_text())
    assert results["failures"] == [] and results["device"] == "CPU"
    vanilla = results["vanilla"]["tiny"]
    assert vanilla["tokens_per_sec"] > 0 and vanilla["loss"][1] < vanilla["loss"][0]
    dilocox = results["dilocox"]["on the device"]
    # 10 iterations, H 2: 5 rounds, the first landing at the second boundary, the last in the drain
    assert dilocox["rounds"] == dilocox["rounds_both_delivered"] == 5
    assert dilocox["same_final_sha256"]
    assert "5 rounds, 5 delivered by both clusters, final SHA-256 equal" in proc.stdout


def test_the_script_says_what_it_needs_without_wheels(tmp_path):
    run = lambda *args: subprocess.run(["bash", "tools/gpu_check.sh", *args], cwd=REPO, capture_output=True, text=True,
                                       env={**worker_env(), "WHEELS": str(tmp_path / "none")}, timeout=120)
    missing = run()
    assert missing.returncode == 2
    assert "no wheels in" in missing.stderr and "bash tools/gpu_check.sh --prepare" in missing.stderr
    usage = run("--help")
    assert usage.returncode == 0 and "--prepare" in usage.stdout and "--peak-tflops" in usage.stdout


def test_a_run_past_its_timeout_is_killed_with_its_children(tmp_path):
    pid_file = tmp_path / "child.pid"
    script = f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); " \
             f"open({str(pid_file)!r}, 'w').write(str(p.pid)); print('started', flush=True); time.sleep(60)"
    with pytest.raises(RuntimeError, match="timeout after 2 s") as failed:
        gpu_check.run_logged([sys.executable, "-c", script], tmp_path / "run.log", timeout_s=2)
    assert "started" in str(failed.value)  # the end of the log comes with the error
    child = int(pid_file.read_text())
    for _ in range(50):  # killed with the group: gone once reaped by init
        if not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"child {child} of the timed-out run is still alive")
