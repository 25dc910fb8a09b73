"""Clusters as independent torchrun jobs joined by a torchft Lighthouse (``python -m
megatron_dilocox.launch``): the same numbers as one world spanning the clusters, and a lost
cluster that does not stop the others."""

import os
import signal
import subprocess
import sys
import time

import psutil

from launch import REPO, read_jsonl, torchrun

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "3e-3",
         "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "200",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "5",
         "--eval-iters", "1", "--dilocox", "--dilocox-local-steps", "5"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
# Not compared record by record: timings, and the running byte total, which counts a background
# exchange in whichever record comes after it (compared at the end).
UNPAIRED = ("tokens_per_sec", "codec_fraction", "cross_cluster_bytes")


def launch(clusters, nproc, flags, **popen):
    cmd = [sys.executable, "-m", "megatron_dilocox.launch", "--clusters", str(clusters),
           "--nproc-per-cluster", str(nproc), "--", str(REPO / "pretrain_gpt.py"), *flags]
    return subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            **popen)


def _numbers(records):
    return [{k: v for k, v in r.items() if k not in UNPAIRED and not k.endswith("_s")} for r in records]


def test_cluster_jobs_train_exactly_as_one_world(tmp_path):
    """2 clusters x PP2, each its own job, against one 4-rank world: every loss, norm and byte count
    of the last rank's metrics is the same, and both clusters end at the same validation loss."""
    flags = MODEL + ["--train-iters", "20", "--eval-interval", "10", "--pipeline-model-parallel-size", "2"]
    jobs = launch(2, 2, flags + ["--metrics-file", str(tmp_path / "jobs.jsonl")])
    out, _ = jobs.communicate(timeout=900)
    assert jobs.returncode == 0, out[-6000:]
    torchrun(4, REPO / "pretrain_gpt.py", flags + ["--dilocox-clusters", "2",
                                                   "--metrics-file", str(tmp_path / "world.jsonl")], timeout=900)
    world = read_jsonl(tmp_path / "world.jsonl")  # written by the world's last rank: cluster 1's last stage
    cluster1 = read_jsonl(tmp_path / "jobs.cluster-1.jsonl")
    cluster0 = read_jsonl(tmp_path / "jobs.jsonl")
    assert _numbers(cluster1) == _numbers(world)
    total = [max(r.get("cross_cluster_bytes") or 0 for r in records) for records in (cluster1, world)]
    assert total[0] == total[1] > 0
    assert any(r.get("bytes_sent") for r in world) and any("val_loss" in r for r in world)
    assert [r["val_loss"] for r in cluster0 if "val_loss" in r] == [r["val_loss"] for r in world if "val_loss" in r]
    assert "cross-cluster bytes between boundaries: 0 |" in out


def _kill_cluster(k):
    """SIGKILL every process of cluster k's job (its torchrun agent and workers), as a lost machine."""
    victims = [p for p in psutil.process_iter(["cmdline"])
               if "--dilocox-cluster-index" in (cmd := p.info["cmdline"] or [])
               and cmd[cmd.index("--dilocox-cluster-index") + 1] == str(k)]
    for p in victims:
        p.send_signal(signal.SIGKILL)
    return len(victims)


def test_a_lost_cluster_does_not_stop_the_others(tmp_path):
    """3 single-rank clusters, dense fp32 blocking rounds; cluster 2 is killed after iteration 10.
    The others notice, go on with the mean of the two of them and finish, at the same loss."""
    flags = MODEL + ["--global-batch-size", "12", "--train-iters", "40", "--eval-interval", "20", "--dilocox-sync-mode", "sync",
                     "--dilocox-compression", "none", "--dilocox-failure-timeout-s", "60",
                     "--metrics-file", str(tmp_path / "m.jsonl")]
    jobs = launch(3, 1, flags)
    lines, killed_at = [], None
    deadline = time.monotonic() + 900
    for line in jobs.stdout:
        lines.append(line)
        if killed_at is None and line.startswith("[cluster 2]") and "iteration       10/" in line:
            assert _kill_cluster(2) >= 2
            killed_at = time.monotonic()
        assert time.monotonic() < deadline, "".join(lines[-80:])
    jobs.wait(timeout=60)
    out = "".join(lines)
    assert killed_at is not None, out[-6000:]
    assert jobs.returncode == 0, out[-6000:]
    assert "lost clusters: 2" in out
    assert "2 of 3 clusters delivered" in out
    survivors = [read_jsonl(tmp_path / "m.jsonl"), read_jsonl(tmp_path / "m.cluster-1.jsonl")]
    finals = [[r["val_loss"] for r in s if "val_loss" in r] for s in survivors]
    assert len(finals[0]) == 2 and finals[0] == finals[1]
    rounds = [(r["iteration"], r["participants"]) for r in survivors[0] if "outer_step" in r]
    assert rounds[-1][0] == 40
    # Every round before the loss averaged 3 clusters, the one in flight at most 3, every later one 2.
    assert all(n == 3 for it, n in rounds if it <= 10) and all(n == 2 for it, n in rounds if it > 15), rounds
    assert [n for _, n in rounds] == [r["participants"] for r in survivors[1] if "outer_step" in r]
