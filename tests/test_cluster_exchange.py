"""The exchange between independent clusters on torchft (megatron_dilocox/outer/cluster_exchange.py):
three single-rank clusters as separate processes around one Lighthouse. One cluster is killed
(SIGKILL) between rounds and restarted; another sends a corrupt payload. Checked against a
single-process replay of the same rounds. Then a cluster whose state no majority holds, and the
low-rank codec's two exchanges as one round, against threads running the same codec."""

import json
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from launch import REPO, worker_env

sys.path.insert(0, str(REPO / "tests"))

import cluster_worker  # noqa: E402

from megatron_dilocox.config import ExchangeConfig  # noqa: E402
from megatron_dilocox.outer.cluster_exchange import majority_fingerprint  # noqa: E402
from megatron_dilocox.outer.compression.reducer import CompressedReducer  # noqa: E402
from megatron_dilocox.outer.link import Gathered  # noqa: E402

ROUNDS, KILL_AFTER, HOLD, CORRUPT = 10, 2, 5, 7
DIVERGE = 2
HEARTBEAT_MS = 3000


class Cluster:
    """A worker process whose JSON lines are collected as they come."""

    def __init__(self, name, argv, log):
        self.name, self.records = name, []
        self.proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "cluster_worker.py"), *argv],
                                     stdout=subprocess.PIPE, stderr=log, text=True,
                                     env=worker_env())
        self._pump = threading.Thread(target=self._read, daemon=True)
        self._pump.start()

    def _read(self):
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.records.append(json.loads(line))

    def rounds(self):
        return [r for r in self.records if r["event"] == "round"]

    def wait_for(self, pred, timeout=240):
        end = time.time() + timeout
        while time.time() < end:
            found = next((r for r in self.records if pred(r)), None)
            if found:
                return found
            if self.proc.poll() is not None and not self._pump.is_alive():
                break
            time.sleep(0.05)
        raise AssertionError(f"{self.name}: no such record in {timeout} s; got {self.records}")


def _stop(clusters, log):
    """Kills whichever of the clusters' processes still run, then closes their shared stderr log."""
    for c in clusters:
        if c.proc.poll() is None:
            c.proc.kill()
            c.proc.wait()
    log.close()


@pytest.fixture
def lighthouse(monkeypatch):
    monkeypatch.setenv("RUST_LOG", "warn")  # the Lighthouse logs every quorum request at info
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=20000, quorum_tick_ms=100,
                              heartbeat_timeout_ms=HEARTBEAT_MS)
    yield server.address()
    server.shutdown()


def test_a_lost_cluster_costs_its_round_and_rejoins_bit_identical(lighthouse, tmp_path):
    hold = tmp_path / "go"
    common = [str(ROUNDS), lighthouse, "--hold-round", str(HOLD), "--hold-file", str(hold)]
    log = open(tmp_path / "stderr.txt", "w")
    procs = []
    try:
        c0 = Cluster("c0", ["0", "3", *common], log)
        c1 = Cluster("c1", ["1", "3", *common, "--corrupt-round", str(CORRUPT)], log)
        c2 = Cluster("c2", ["2", "3", *common], log)
        procs += [c0, c1, c2]
        c2.wait_for(lambda r: r.get("round") == KILL_AFTER)
        c2.proc.send_signal(signal.SIGKILL)  # in its inner steps, between rounds
        killed = time.time()
        c2.proc.wait()
        survivors = c0.wait_for(lambda r: r.get("clusters") == [0, 1])
        c2b = Cluster("c2b", ["2", "3", *common], log)
        procs.append(c2b)
        c2b.wait_for(lambda r: r["event"] == "up")
        hold.touch()  # the survivors go on from round HOLD; the restarted cluster heals there
        for c in (c0, c1, c2b):
            assert c.proc.wait(timeout=240) == 0, (tmp_path / "stderr.txt").read_text()[-4000:]
    finally:
        _stop(procs, log)

    print(f"a lost cluster noticed after {survivors['t'] - killed:.2f} s (heartbeat timeout {HEARTBEAT_MS} ms)")
    by_round = {}
    for c in (c0, c1, c2, c2b):
        for r in c.rounds():
            by_round.setdefault(r["round"], []).append(r)
    # The survivors commit every round once, in order; every member of a round agrees bit for bit.
    assert [r["round"] for r in c0.rounds()] == list(range(ROUNDS))
    assert [r["round"] for r in c1.rounds()] == list(range(ROUNDS))
    for rnd, reports in by_round.items():
        assert len({(r["digest"], tuple(r["clusters"])) for r in reports}) == 1, reports
    # Only the dead cluster's own rounds are missing, until it rejoins at the hold.
    used = {rnd: reports[0]["clusters"] for rnd, reports in by_round.items()}
    lost = [rnd for rnd in range(ROUNDS) if 2 not in used[rnd]]
    assert lost[0] == KILL_AFTER + 1 and lost[-1] == HOLD
    assert all(used[rnd] == [0, 1] for rnd in lost if rnd != CORRUPT)
    # The restarted cluster healed from a peer's state at its first round and went on with everyone.
    first = c2b.rounds()[0]
    assert first["round"] == HOLD and first["healed"] and first["dropped"] == {
        "2": "sent no payload this round (it healed: its state was stale)"}
    assert first["healed_digest"] == by_round[HOLD - 1][0]["digest"]
    # The corrupt payload was dropped and named on every member, the round applied without it.
    for r in by_round[CORRUPT]:
        assert r["clusters"] == [0, 2] and "cluster 1 failed its checksum" in r["dropped"]["1"]
    assert len({c.rounds()[-1]["digest"] for c in (c0, c1, c2b)}) == 1
    # The result is what one process computes from the same rounds: the mean over the delivered clusters.
    w = torch.zeros(cluster_worker.NUMEL)
    for rnd in range(ROUNDS):
        w += sum(cluster_worker.pseudo_gradient(c, rnd) for c in used[rnd]) / len(used[rnd])
        assert cluster_worker.digest(w) == by_round[rnd][0]["digest"], rnd


def test_a_cluster_frozen_inside_a_round_costs_its_survivor_one_attempt(lighthouse, tmp_path):
    """Cluster 1 stops (SIGSTOP) inside round FREEZE's exchange, after it joined the quorum: cluster
    0's all-gather waits out the failure timeout, and the next quorum, formed once the Lighthouse
    has missed cluster 1's heartbeats, gets a window of its own: cluster 0 commits that round alone
    and finishes (it had raised ClusterLossError, with the whole timeout spent in the all-gather)."""
    timeout = ["--failure-timeout-s", "8"]
    log = open(tmp_path / "stderr.txt", "w")
    procs = []
    try:
        c0 = Cluster("c0", ["0", "2", "5", lighthouse, *timeout], log)
        c1 = Cluster("c1", ["1", "2", "5", lighthouse, *timeout, "--freeze-round", str(DIVERGE)], log)
        procs += [c0, c1]
        assert c0.proc.wait(timeout=240) == 0, (tmp_path / "stderr.txt").read_text()[-4000:]
    finally:
        _stop(procs, log)
    rounds = c0.rounds()
    assert [r["round"] for r in rounds] == list(range(5))
    assert [r["clusters"] for r in rounds] == [[0, 1]] * DIVERGE + [[0]] * (5 - DIVERGE)
    assert rounds[DIVERGE]["attempts"] >= 2 and rounds[DIVERGE]["seconds"] >= 8


@pytest.mark.parametrize("fields, message", [
    (dict(cluster_index=3), "--dilocox-cluster-index in 0..2, got 3"),
    (dict(cluster_index=None), "--dilocox-cluster-index in 0..2, got None"),
    (dict(cluster_index=0, min_clusters=4), "--dilocox-min-clusters must be in 1..3"),
    (dict(cluster_index=0, failure_timeout_s=0), "--dilocox-failure-timeout-s must be > 0"),
])
def test_bad_settings_are_named(fields, message):
    with pytest.raises(ValueError, match=message):
        ExchangeConfig("localhost:29510", **fields).validate(clusters=3)


def test_majority_fingerprint():
    a, b, c = b"a" * 32, b"b" * 32, b"c" * 32
    assert majority_fingerprint([a, a, b]) == a
    assert majority_fingerprint([a, None, a, b]) == a  # a cluster that sent nothing does not vote
    assert majority_fingerprint([a, b]) is None and majority_fingerprint([a, a, b, b]) is None
    assert majority_fingerprint([a, b, c]) is None and majority_fingerprint([None]) is None
    assert majority_fingerprint([c]) == c


@pytest.mark.parametrize("clusters", [2, 3])
def test_a_state_no_majority_holds_stops_its_cluster(lighthouse, tmp_path, clusters):
    """Cluster 1 changes its global state before round DIVERGE. With three clusters it is outvoted:
    it stops with the error, and the other two apply that round's payloads of theirs (cluster 1's
    refusals do not count) and go on. With two there is no majority, and both stop at that round
    rather than train on as two runs."""
    log = open(tmp_path / "stderr.txt", "w")
    workers = []
    try:
        for k in range(clusters):
            extra = ["--diverge-round", str(DIVERGE)] if k == 1 else []
            workers.append(Cluster(f"c{k}", [str(k), str(clusters), str(DIVERGE + 2), lighthouse, "--inner-s", "0.1",
                                             *extra], log))
        codes = [w.proc.wait(timeout=240) for w in workers]
    finally:
        _stop(workers, log)
    stopped = [k for k, code in enumerate(codes) if code == 3]
    assert stopped == ([1] if clusters == 3 else [0, 1]), (codes, (tmp_path / "stderr.txt").read_text()[-4000:])
    for k in stopped:
        (event,) = [r for r in workers[k].records if r["event"] == "diverged"]
        assert event["round"] == DIVERGE and "not the majority's" in event["error"]
        assert ("2 of 3 clusters hold" if clusters == 3 else "no majority among the 2") in event["error"]
        assert [r["round"] for r in workers[k].rounds()] == list(range(DIVERGE))
    if clusters == 3:
        for k in (0, 2):
            rounds = workers[k].rounds()
            assert codes[k] == 0 and [r["round"] for r in rounds] == list(range(DIVERGE + 2))
            at = rounds[DIVERGE]
            assert at["clusters"] == [0, 2] and "fingerprint differs" in at["dropped"]["1"], at
        assert workers[0].rounds()[-1]["digest"] == workers[2].rounds()[-1]["digest"]


class ThreadLink:
    """The outer link of one replica among threads of one process, for a replay: every stage
    all-gathers the ``senders``' payloads (the others of ``members`` receive only, healed)."""

    verifies_state = True

    def __init__(self, cluster, clusters, board, barrier, senders):
        self.cluster, self.clusters, self.delivered = cluster, clusters, len(senders)
        self.board, self.barrier, self.senders, self.stage = board, barrier, senders, 0

    def run_round(self, body):
        return body()

    def all_gather(self, payload, counter=None, verify=None):
        self.stage += 1
        self.board[self.stage, self.cluster] = payload.clone()
        self.barrier.wait()
        rows = [self.board[self.stage, k] for k in self.senders]
        return Gathered(torch.stack(rows), list(self.senders), sat_out=self.cluster not in self.senders)


def replay_round(reducers, members, senders, rnd):
    """One round of ``reducers`` (cluster -> CompressedReducer) over ``members``; the mean."""
    board, barrier, out = {}, threading.Barrier(len(members)), {}

    def run(k):
        link = ThreadLink(k, 3, board, barrier, senders)
        (out[k],) = reducers[k]([cluster_worker.lowrank_gradient(k, rnd)], link)

    threads = [threading.Thread(target=run, args=(k,)) for k in members]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(out[k], out[members[0]]) for k in members)
    return out[members[0]]


def test_a_low_rank_round_is_one_commit_of_its_two_stages(lighthouse, tmp_path):
    """Three clusters send the low-rank codec's two exchanges (P, then Q from the reduced P) as one
    round. Cluster 2 freezes in round FREEZE's Q exchange, after its P was delivered: the others'
    attempt fails, and they run the whole round again, P included, without it (the codec's state
    untouched by the failed attempt). Killed and restarted, it heals at round HOLD from a peer:
    global state, round counter, adaptive ranks and warm starts, and goes on bit-identical. Every
    round equals a replay of the same codec in threads, over the clusters each round delivered."""
    freeze, hold, rounds = 2, 5, 8
    go = tmp_path / "go"
    common = [str(rounds), lighthouse, "--lowrank", "--failure-timeout-s", "8", "--hold-round", str(hold),
              "--hold-file", str(go), "--inner-s", "0.1"]
    log = open(tmp_path / "stderr.txt", "w")
    procs = []
    try:
        c0, c1 = (Cluster(f"c{k}", [str(k), "3", *common], log) for k in range(2))
        c2 = Cluster("c2", ["2", "3", *common, "--freeze-round", str(freeze), "--freeze-stage", "2"], log)
        procs += [c0, c1, c2]
        c0.wait_for(lambda r: r.get("round") == freeze)
        c2.proc.kill()
        c2.proc.wait()
        c2b = Cluster("c2b", ["2", "3", *common], log)
        procs.append(c2b)
        c2b.wait_for(lambda r: r["event"] == "up")
        go.touch()
        for c in (c0, c1, c2b):
            assert c.proc.wait(timeout=240) == 0, (tmp_path / "stderr.txt").read_text()[-4000:]
    finally:
        _stop(procs, log)

    by_round = {}
    for c in (c0, c1, c2, c2b):
        for r in c.rounds():
            by_round.setdefault(r["round"], []).append(r)
    assert [r["round"] for r in c0.rounds()] == [r["round"] for r in c1.rounds()] == list(range(rounds))
    assert [r["round"] for r in c2.rounds()] == list(range(freeze))
    assert [r["round"] for r in c2b.rounds()] == list(range(hold, rounds))
    for rnd, reports in by_round.items():
        assert len({(r["digest"], tuple(r["clusters"]), tuple(r["ranks"])) for r in reports}) == 1, reports
    used = {rnd: reports[0]["clusters"] for rnd, reports in by_round.items()}
    assert [used[rnd] for rnd in range(rounds)] == [[0, 1, 2]] * freeze + [[0, 1]] * (hold + 1 - freeze) + [
        [0, 1, 2]] * (rounds - hold - 1)
    assert c2b.rounds()[0]["healed_digest"] == by_round[hold - 1][0]["digest"]

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers (OMP_NUM_THREADS=1): the same local matmuls
    try:
        reducers = {k: CompressedReducer(cluster_worker.SHAPES, cluster_worker.LOWRANK) for k in range(3)}
        w = torch.zeros(cluster_worker.NUMEL_LOWRANK)
        for rnd in range(rounds):
            members = used[rnd]
            if rnd == hold:  # the restarted cluster: a fresh codec, healed from cluster 0's
                reducers[2] = CompressedReducer(cluster_worker.SHAPES, cluster_worker.LOWRANK)
                reducers[2].join(reducers[0].serve())
                members = [0, 1, 2]
            w += replay_round(reducers, members, used[rnd], rnd)
            assert cluster_worker.digest(w) == by_round[rnd][0]["digest"], rnd
            assert reducers[0].last_stats["ranks"] == by_round[rnd][0]["ranks"]
    finally:
        torch.set_num_threads(threads)
    assert len({tuple(r["ranks"]) for reports in by_round.values() for r in reports}) > 1  # the rank adapted
