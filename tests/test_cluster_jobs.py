"""Clusters as independent torchrun jobs joined by a torchft Lighthouse (``python -m
megatron_dilocox.launch``): the same numbers as one world spanning the clusters, and a lost
cluster that does not stop the others."""

import math
import signal
import subprocess
import sys
import threading
import time

import pytest

from launch import REPO, read_jsonl, read_tensorboard, read_wandb, torchrun, worker_env

from megatron_dilocox.payload import HANDSHAKE_BYTES
from tools.fault_soak import cluster_processes, cluster_workers

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "3e-3",
         "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "200",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "5",
         "--eval-iters", "1", "--dilocox", "--dilocox-local-steps", "5",
         "--dilocox-local-steps-ramp-iters", "0"]  # H = 5 from the start: the tests count rounds of 5
# Not compared record by record: timings, and the running byte total, which counts a background
# exchange in whichever record comes after it (compared at the end).
UNPAIRED = ("tokens_per_sec", "codec_fraction", "cross_cluster_bytes")


def launch(clusters, nproc, flags, args=(), script=REPO / "pretrain_gpt.py", env=None):
    cmd = [sys.executable, "-m", "megatron_dilocox.launch", "--clusters", str(clusters),
           "--nproc-per-cluster", str(nproc), *args, "--", str(script), *flags]
    return subprocess.Popen(cmd, cwd=REPO, env=env or worker_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _numbers(records):
    return [{k: v for k, v in r.items() if k not in UNPAIRED and not k.endswith("_s")} for r in records]


def test_cluster_jobs_train_exactly_as_one_world(tmp_path):
    """2 clusters x PP2, each its own job, against one 4-rank world: every loss, norm and byte count
    of the last rank's metrics is the same, and both clusters end at the same validation loss."""
    flags = MODEL + ["--train-iters", "20", "--eval-interval", "10", "--pipeline-model-parallel-size", "2"]
    jobs = launch(2, 2, flags + ["--metrics-file", str(tmp_path / "jobs.jsonl")])
    out, _ = jobs.communicate(timeout=900)
    assert jobs.returncode == 0, out[-6000:]
    torchrun(4, REPO / "pretrain_gpt.py", flags + ["--dilocox-clusters", "2", "--tensorboard-dir", str(tmp_path / "tb"),
                                                   "--wandb-project", "tests", "--wandb-save-dir", str(tmp_path),
                                                   "--metrics-file", str(tmp_path / "world.jsonl")],
             timeout=900, env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    world = read_jsonl(tmp_path / "world.jsonl")  # written by the world's last rank: cluster 1's last stage
    cluster1 = read_jsonl(tmp_path / "jobs.cluster-1.jsonl")
    cluster0 = read_jsonl(tmp_path / "jobs.jsonl")
    # The jobs send neither the world's start-up hash nor the codecs' handshakes (in the first round
    # and in the flush of the residual at the end): each payload's envelope carries a fingerprint
    # of the sender's state instead.
    expected = _numbers(world)
    first = next(i for i, r in enumerate(expected) if r.get("bytes_sent"))
    for record in (expected[first], next(r for r in expected if r.get("drain"))):
        record["bytes_sent"] -= HANDSHAKE_BYTES
    assert _numbers(cluster1) == expected
    total = [max(r.get("cross_cluster_bytes") or 0 for r in records) for records in (cluster1, world)]
    assert total[0] == total[1] - 2 * HANDSHAKE_BYTES > 0  # (the world's start-up hash precedes the count)
    assert any(r.get("bytes_sent") for r in world) and any("val_loss" in r for r in world)
    assert [r["val_loss"] for r in cluster0 if "val_loss" in r] == [r["val_loss"] for r in world if "val_loss" in r]
    assert "cross-cluster bytes between boundaries: 0 |" in out
    # Both clusters end with bit-identical global parameters (their last stages' fingerprints).
    ends = [next(r["global_sha256"] for r in records if r.get("drain")) for records in (cluster0, cluster1)]
    assert ends[0] == ends[1] and len(ends[0]) == 64
    # TensorBoard and W&B get every round's fields under "dilocox/", the drain's under
    # "dilocox/drain/", as the metrics file has them (TensorBoard in float32).
    board, rounds = read_tensorboard(tmp_path / "tb"), [r for r in world if "outer_step" in r]
    _, history = read_wandb(tmp_path)
    for prefix, records in (("dilocox/", [r for r in rounds if not r.get("drain")]),
                            ("dilocox/drain/", [r for r in rounds if r.get("drain")])):
        assert records
        for key in ("bytes_sent", "pseudo_grad_norm", "outer_step", "participants"):
            tag = prefix + key
            assert board[tag] == [(r["iteration"], pytest.approx(r[key], rel=1e-6)) for r in records], tag
            assert history[tag] == [(r["iteration"], r[key]) for r in records], tag


def follow(jobs, kills):
    """Reads the launcher's output to its end; ``kills`` maps (cluster, iteration) to a call made
    once, when that cluster logs that iteration, that returns how many processes it found.
    Returns the lines and the kills made, in order, as (cluster, iteration, processes found)."""
    lines, made, pending = [], [], dict(kills)
    deadline = time.monotonic() + 900
    for line in jobs.stdout:
        lines.append(line)
        for k, after in [key for key in pending
                         if line.startswith(f"[cluster {key[0]}]") and f"iteration {key[1]:>8}/" in line]:
            made.append((k, after, pending.pop((k, after))()))
        assert time.monotonic() < deadline, "".join(lines[-80:])
    jobs.wait(timeout=60)
    return lines, made


def _freeze_then_kill_worker(jobs, k, hold_s):
    """SIGSTOP cluster k's training process (a hung rank: its heartbeats stop too) and SIGKILL it
    ``hold_s`` later, so that torchrun restarts it no sooner than that."""
    workers = cluster_workers(k, jobs.pid)
    for p in workers:
        p.send_signal(signal.SIGSTOP)
    threading.Timer(hold_s, lambda: [p.send_signal(signal.SIGKILL) for p in workers]).start()
    return len(workers)


def _kill_first_worker(jobs, k):
    """SIGKILL one of cluster k's training processes: torchrun stops the others and restarts all."""
    workers = cluster_workers(k, jobs.pid)
    workers[0].send_signal(signal.SIGKILL)
    return len(workers)


def _kill_cluster(jobs, k):
    """SIGKILL every process of cluster k's job (its torchrun agent and workers), as a lost machine."""
    victims = cluster_processes(k, jobs.pid)
    for p in victims:
        p.send_signal(signal.SIGKILL)
    return len(victims)


def test_a_lost_cluster_does_not_stop_the_others(tmp_path):
    """3 single-rank clusters, dense fp32 blocking rounds, ``--dilocox-min-clusters 2``. Cluster 2
    is killed after iteration 10: the others notice, go on with the mean of the two of them, at
    the same losses. Cluster 1 is killed after iteration 30: cluster 0, alone, saves a checkpoint
    and stops with a one-line error."""
    flags = MODEL + ["--global-batch-size", "12", "--train-iters", "60", "--eval-interval", "20", "--dilocox-sync-mode", "sync",
                     "--dilocox-compression", "none", "--dilocox-failure-timeout-s", "20", "--dilocox-min-clusters", "2",
                     "--metrics-file", str(tmp_path / "m.jsonl"), "--save", str(tmp_path / "ckpt")]
    jobs = launch(3, 1, flags)
    lines, killed = follow(jobs, {(2, 10): lambda: _kill_cluster(jobs, 2), (1, 30): lambda: _kill_cluster(jobs, 1)})
    out = "".join(lines)
    assert [m[:2] for m in killed] == [(2, 10), (1, 30)] and all(n >= 2 for *_, n in killed), out[-6000:]
    assert jobs.returncode != 0 and "finished: none" in out, out[-6000:]
    assert "2 of 3 clusters delivered" in out
    stopped = [line for line in lines if line.startswith("[cluster 0]") and "saving a checkpoint before stopping" in line]
    assert len(stopped) == 1 and "no outer round committed within" in stopped[0], out[-6000:]
    assert "pretrain_gpt.py: error: cluster 0: no outer round committed within" in out, out[-6000:]  # one line, no traceback of ours
    survivors = [read_jsonl(tmp_path / "m.jsonl"), read_jsonl(tmp_path / "m.cluster-1.jsonl")]
    vals = [[r["val_loss"] for r in s if "val_loss" in r] for s in survivors]
    assert vals[0][0] == vals[1][0]  # the evaluation at iteration 20, after the loss of cluster 2
    rounds = [(r["iteration"], r["participants"]) for r in survivors[0] if "outer_step" in r]
    # Every round before the loss averaged 3 clusters, the one in flight at most 3, the later ones 2.
    assert all(n == 3 for it, n in rounds if it <= 10) and all(n == 2 for it, n in rounds if it > 15), rounds
    assert [(it, n) for it, n in rounds if it <= 30] == [(r["iteration"], r["participants"])
                                                           for r in survivors[1] if "outer_step" in r][:len(rounds)]
    # Cluster 0 saved where it stopped: the round after the last one it committed.
    saved = int((tmp_path / "ckpt" / "cluster-0" / "latest_checkpointed_iteration.txt").read_text())
    assert saved == rounds[-1][0] + 5, (saved, rounds)


def test_a_restarted_cluster_rejoins_from_a_live_peer(tmp_path):
    """2 clusters x PP2, dense fp32 blocking rounds; one worker of cluster 1 is killed after
    iteration 10 and torchrun (``--max-restarts 1``) restarts the cluster's workers from nothing.
    Each of its ranks takes its stage's global parameters and outer state from the rank with the
    same place in cluster 0, in the round it comes back in; the cluster jumps to the running
    iteration, and from the next round on its payloads are used again: every payload carries a
    fingerprint of its sender's global parameters, and one that differs is dropped. Both clusters
    end at the same validation loss."""
    flags = MODEL + ["--train-iters", "120", "--eval-interval", "60", "--pipeline-model-parallel-size", "2",
                     "--dilocox-sync-mode", "sync", "--dilocox-compression", "none", "--dilocox-failure-timeout-s", "60",
                     "--dilocox-emulated-delay-s", "1.5", "--metrics-file", str(tmp_path / "m.jsonl")]
    jobs = launch(2, 2, flags, args=["--max-restarts", "1"])
    lines, killed = follow(jobs, {(1, 10): lambda: _kill_first_worker(jobs, 1)})
    out = "".join(lines)
    restarted_log = "".join(line for line in lines if line.startswith("[cluster 1]"))
    assert killed == [(1, 10, 2)] and jobs.returncode == 0 and "lost clusters" not in out, (restarted_log or out)[-6000:]
    joined = [line for line in lines if line.startswith("[cluster 1]") and "joined the running clusters" in line]
    assert len(joined) == 1, out[-6000:]
    # The metrics files are written by each cluster's last pipeline stage.
    metrics = [read_jsonl(tmp_path / name) for name in ("m.jsonl", "m.cluster-1.jsonl")]
    rounds = [(r["iteration"], r["participants"]) for r in metrics[0] if "outer_step" in r]
    assert rounds[-1][0] == 120
    back = next(it for it, n in rounds if it > 15 and n == 2)  # the first round with cluster 1 again
    assert any(n == 1 for it, n in rounds if 10 < it < back), rounds  # it was out, then back
    assert all(n == 2 for it, n in rounds if it >= back), rounds
    # The restarted cluster's rounds: its first two, then the one it joined in (recorded at the
    # running iteration, without a payload of its own), then every round with the other.
    restarted = [(r["iteration"], r["participants"]) for r in metrics[1] if "outer_step" in r]
    assert restarted[:2] == rounds[:2] and restarted[3:] == [(it, n) for it, n in rounds if it >= back]
    assert restarted[2] == (back - 5, 1), restarted
    # From the join on both clusters hold the same global parameters, on both stages, and
    # evaluate the same batches: the same validation losses (at 60 only if it was back by then,
    # which a loaded machine can delay past it; at 120 always).
    vals = [[(r["iteration"], r["val_loss"]) for r in m if "val_loss" in r] for m in metrics]
    assert [it for it, _ in vals[0]] == [60, 120] and vals[1] and vals[1] == vals[0][-len(vals[1]):], vals


def test_below_min_clusters_the_survivor_waits_for_a_rejoin(tmp_path):
    """2 single-rank clusters, ``--dilocox-min-clusters 2 --dilocox-rejoin-timeout-s 600``: cluster
    1's worker hangs after iteration 10 and is killed 30 s later, then restarted by torchrun.
    Cluster 0 cannot apply a round alone and waits in it, past ``--dilocox-failure-timeout-s``
    (20 s), instead of stopping; the
    restarted cluster heals from it in that round and both finish: every round but the one it
    joined in averages both, and the two end at the same validation loss."""
    flags = MODEL + ["--train-iters", "40", "--eval-interval", "20", "--dilocox-sync-mode", "sync",
                     "--dilocox-compression", "none", "--dilocox-min-clusters", "2", "--dilocox-failure-timeout-s", "20",
                     "--dilocox-rejoin-timeout-s", "600", "--metrics-file", str(tmp_path / "m.jsonl")]
    jobs = launch(2, 1, flags, args=["--max-restarts", "1"])
    lines, killed = follow(jobs, {(1, 10): lambda: _freeze_then_kill_worker(jobs, 1, hold_s=30)})
    out = "".join(lines)
    assert killed == [(1, 10, 1)] and jobs.returncode == 0 and "lost clusters" not in out, out[-6000:]
    assert "saving a checkpoint before stopping" not in out
    metrics = [read_jsonl(tmp_path / name) for name in ("m.jsonl", "m.cluster-1.jsonl")]
    rounds = [(r["iteration"], r["participants"]) for r in metrics[0] if "outer_step" in r]
    assert [it for it, _ in rounds] == list(range(5, 45, 5)), (rounds, out[-6000:])  # no round was skipped or lost
    assert [n for _, n in rounds].count(1) == 1 and rounds[0][1] == rounds[1][1] == 2, (rounds, out[-6000:])  # the join's
    # Cluster 0 entered that round at most a few iterations after the hang and waited in it for
    # longer than a round may take without the rejoin timeout.
    assert next(r["wait_s"] for r in metrics[0] if r.get("participants") == 1) > 20
    vals = [[(r["iteration"], r["val_loss"]) for r in m if "val_loss" in r] for m in metrics]
    assert vals[0][-1] == vals[1][-1], vals


def test_a_corrupt_payload_is_dropped_and_its_sender_goes_on(tmp_path):
    """2 single-rank clusters, the default codec (topk with error feedback, ``delay``), adaptive H
    over an exchange slowed to 1 s. Cluster 1's payload of outer round 2 has a byte flipped after
    framing: cluster 0 refuses it (checksum), names it, and both apply that round with cluster 0's
    payload alone. Cluster 1, whose own payload was refused, takes part as a cluster that lost
    its round (it does not stop): every other round averages both, both clusters choose the same
    H from the timings every payload's envelope carries, and they end at the same validation loss."""
    flags = MODEL + ["--train-iters", "40", "--eval-interval", "20", "--metrics-file", str(tmp_path / "m.jsonl"),
                     "--dilocox-min-local-steps", "2", "--dilocox-max-local-steps", "8", "--dilocox-emulated-delay-s", "1"]
    jobs = launch(2, 1, flags, script=REPO / "tests" / "corrupting_pretrain.py",
                  env=worker_env(CORRUPT_CLUSTER_ROUND="1:2"))
    out, _ = jobs.communicate(timeout=900)
    assert jobs.returncode == 0 and "lost clusters" not in out, out[-6000:]
    named = [line for line in out.splitlines() if "round 2: 1 of 2 clusters delivered (cluster 1:" in line]
    assert len(named) == 2 and all("failed its checksum" in line for line in named), out[-6000:]  # one per cluster
    metrics = [read_jsonl(tmp_path / name) for name in ("m.jsonl", "m.cluster-1.jsonl")]
    rounds = [[(r["iteration"], r["participants"], r["local_steps"], r.get("slowest_exchange_s"), r.get("slowest_step_s"))
               for r in m if "outer_step" in r and not r["drain"]] for m in metrics]
    # delay: each record holds the reduction launched at the boundary before (none at the first).
    participants = [n for _, n, *_ in rounds[0]]
    assert rounds[0] == rounds[1] and participants == [0, 2, 2, 1] + [2] * (len(participants) - 4), rounds
    # H follows the rule from the third round on, which has the first exchange's time (1 s at least).
    assert [(h, exchange) for _, _, h, exchange, _ in rounds[0][:2]] == [(5, None), (5, None)], rounds
    for _, _, h, exchange, step in rounds[0][2:]:
        assert exchange >= 1 and h == min(max(math.ceil(1.2 * exchange / step), 2), 8), rounds
    finals = [[r["val_loss"] for r in m if "val_loss" in r] for m in metrics]
    assert finals[0] == finals[1] and len(finals[0]) == 2, finals
