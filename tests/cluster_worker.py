"""One single-rank cluster in the fault tests of the exchange between clusters (test_cluster_exchange.py).

    python tests/cluster_worker.py CLUSTER CLUSTERS ROUNDS LIGHTHOUSE [--corrupt-round R] [--inner-s S]
        [--hold-round R --hold-file PATH] [--diverge-round R] [--freeze-round R [--freeze-stage S]]
        [--failure-timeout-s S] [--lowrank]

Every round it sends a framed fp32 "pseudo-gradient" drawn from (cluster, round), adds the mean of
the delivered ones to its "global parameters" ``w`` and prints one JSON line: the round, the
clusters used and dropped, whether it healed, and ``w``'s digest (its SHA-256 is the payload's
fingerprint, so a cluster whose ``w`` differs is dropped). It stops once ``ROUNDS`` rounds
are committed (a restarted cluster takes its peers' count when it heals). ``--hold-round`` waits
before that round until ``--hold-file`` exists (so that survivors are still running when a
restarted cluster has finished its imports). ``--diverge-round`` changes one entry of ``w``
before that round (a state no other cluster holds); a StateDivergedError prints
``{"event": "diverged", ...}`` and exits with status 3. ``--freeze-round`` stops the process
(SIGSTOP, heartbeats included) inside that round's exchange, after it joined the quorum: a peer
that hangs mid-round; ``--freeze-stage 2``: in the second stage (a low-rank round's Q exchange).

``--lowrank``: the round is the real low-rank codec instead (:class:`CompressedReducer`, P then Q,
adaptive rank, error feedback) over the real :class:`ExchangeLink`, on ``lowrank_gradient``; the
global state ``w`` (``NUMEL_LOWRANK`` entries) and the codec's shared state are what a healing
cluster takes from a peer.
"""
import argparse
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_dilocox.config import CompressionConfig, ExchangeConfig  # noqa: E402
from megatron_dilocox.errors import StateDivergedError  # noqa: E402
from megatron_dilocox.outer.cluster_exchange import ClusterExchange, ExchangeLink  # noqa: E402
from megatron_dilocox.outer.compression import wire  # noqa: E402
from megatron_dilocox.outer.compression.reducer import CompressedReducer  # noqa: E402

NUMEL = 64
SHAPES = [(16, 12), (12,)]  # a matrix sent low-rank, a vector sent dense with P
NUMEL_LOWRANK = 16 * 12 + 12
LOWRANK = CompressionConfig(codec="lowrank", rank=3, adaptive=True, error_feedback=True)


def pseudo_gradient(cluster: int, rnd: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(1000 * rnd + cluster))


def lowrank_gradient(cluster: int, rnd: int) -> torch.Tensor:
    """A rank-2 matrix the clusters share plus each one's noise (the adaptive rank shrinks to
    about 2), and a vector."""
    shared, own = torch.Generator().manual_seed(rnd), torch.Generator().manual_seed(1000 * rnd + cluster)
    low = torch.randn(16, 2, generator=shared) @ torch.randn(2, 12, generator=shared)
    return torch.cat([(low + 0.1 * torch.randn(16, 12, generator=own)).view(-1), torch.randn(12, generator=own)])


def freeze_in(pg, stage: int) -> None:
    """SIGSTOPs this process in the round's ``stage``-th payload all-gather (each stage all-gathers
    the payloads, then the verdicts)."""
    allgather, calls = pg.allgather, []

    def stop_then_gather(*args):
        calls.append(1)
        if len(calls) == 2 * stage - 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        return allgather(*args)

    pg.allgather = stop_then_gather


def header(cluster: int, rnd: int) -> wire.Header:
    return wire.Header("none", 32, "dense", rnd + 1, cluster, wire.layout_digest(NUMEL), 4 * NUMEL)


def digest(w: torch.Tensor) -> str:
    return hashlib.sha256(w.numpy().tobytes()).hexdigest()[:16]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("cluster", type=int)
    p.add_argument("clusters", type=int)
    p.add_argument("rounds", type=int)
    p.add_argument("lighthouse")
    p.add_argument("--corrupt-round", type=int, default=-1)
    p.add_argument("--inner-s", type=float, default=0.3)
    p.add_argument("--hold-round", type=int, default=-1)
    p.add_argument("--hold-file", type=Path)
    p.add_argument("--diverge-round", type=int, default=-1)
    p.add_argument("--freeze-round", type=int, default=-1)
    p.add_argument("--freeze-stage", type=int, default=1)
    p.add_argument("--failure-timeout-s", type=float, default=30.0)
    p.add_argument("--lowrank", action="store_true")
    a = p.parse_args()

    w = torch.zeros(NUMEL_LOWRANK if a.lowrank else NUMEL)
    healed_from = {}
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)  # the cluster's own store
    config = ExchangeConfig(a.lighthouse, cluster_index=a.cluster, failure_timeout_s=a.failure_timeout_s)
    place = dict(rank=0, world_size=1, store_addr="localhost", store_port=store.port)
    if a.lowrank:
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)  # the cluster's world (one rank)
        link = ExchangeLink(config, a.clusters, **place)
        reducer = CompressedReducer(SHAPES, LOWRANK)
        ex = link.exchange

        def heal(state):
            w.copy_(state["w"])
            reducer.join(state["codec"])
            healed_from["digest"] = digest(w)

        link.fingerprint = lambda: hashlib.sha256(w.numpy().tobytes()).digest()
        link.serve = lambda: {"w": w.clone(), "codec": reducer.serve()}
        link.on_heal = heal
    else:
        def load_state_dict(state):
            w.copy_(state["w"])
            healed_from["digest"] = digest(w)

        ex = ClusterExchange(config, a.clusters, **place, state_dict=lambda: {"w": w.clone()},
                             load_state_dict=load_state_dict)
    print(json.dumps(dict(event="up", cluster=a.cluster)), flush=True)
    while ex.round < a.rounds:
        rnd = ex.round
        while rnd == a.hold_round and not a.hold_file.exists():
            time.sleep(0.1)
        if rnd == a.diverge_round:
            w[0] += 0.5
        if rnd == a.freeze_round:
            freeze_in(ex.pg, a.freeze_stage)
        if a.lowrank:
            (mean,) = reducer([lowrank_gradient(a.cluster, rnd)], link)
            w += mean
            record = dict(round=ex.round - 1, clusters=link.used, ranks=reducer.last_stats["ranks"])
        else:
            payload = wire.frame(pseudo_gradient(a.cluster, rnd).view(torch.uint8), header(a.cluster, rnd))
            if rnd == a.corrupt_round:
                payload[-1] ^= 0x5A  # a bit flip in the body: the checksum must catch it
            # The fingerprint of w: after a heal the restarted cluster's must equal everyone's again.
            try:
                got = ex.exchange(payload, verify=lambda c, r, body: wire.unframe(body, header(c, r)),
                                  fingerprint=hashlib.sha256(w.numpy().tobytes()).digest())
            except StateDivergedError as err:
                print(json.dumps(dict(event="diverged", cluster=a.cluster, round=rnd, error=str(err))), flush=True)
                ex.close()
                # At once: the interpreter's teardown with torchft's threads still winding down after
                # close() aborted the process now and then under load ("terminate called without an
                # active exception", status -6 instead of 3).
                os._exit(3)
            acc = torch.zeros(NUMEL)
            for body in got.payloads:
                acc += body[wire.HEADER_BYTES:].view(torch.float32)
            if got.payloads:
                w += acc / len(got.payloads)
            record = dict(round=got.round, clusters=got.clusters, members=got.members, dropped=got.dropped,
                          healed=got.healed, attempts=got.attempts, seconds=round(got.seconds, 3))
        print(json.dumps(dict(event="round", cluster=a.cluster, **record, healed_digest=healed_from.pop("digest", None),
                              digest=digest(w), t=time.time())), flush=True)
        time.sleep(a.inner_s)  # the inner steps
    ex.close()


if __name__ == "__main__":
    main()
