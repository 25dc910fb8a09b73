"""One single-rank cluster in the fault tests of the exchange between clusters (test_cluster_exchange.py).

    python tests/cluster_worker.py CLUSTER CLUSTERS ROUNDS LIGHTHOUSE [--corrupt-round R] [--inner-s S]
        [--hold-round R --hold-file PATH] [--diverge-round R] [--freeze-round R] [--failure-timeout-s S]

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
that hangs mid-round.
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

from megatron_dilocox.config import ExchangeConfig  # noqa: E402
from megatron_dilocox.errors import StateDivergedError  # noqa: E402
from megatron_dilocox.outer.cluster_exchange import ClusterExchange  # noqa: E402
from megatron_dilocox.outer.compression import wire  # noqa: E402

NUMEL = 64


def pseudo_gradient(cluster: int, rnd: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(1000 * rnd + cluster))


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
    p.add_argument("--failure-timeout-s", type=float, default=30.0)
    a = p.parse_args()

    w = torch.zeros(NUMEL)
    healed_from = {}

    def load_state_dict(state):
        w.copy_(state["w"])
        healed_from["digest"] = digest(w)

    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)  # the cluster's own store
    ex = ClusterExchange(ExchangeConfig(a.lighthouse, cluster_index=a.cluster, failure_timeout_s=a.failure_timeout_s), a.clusters,
                         rank=0, world_size=1, store_addr="localhost", store_port=store.port,
                         state_dict=lambda: {"w": w.clone()}, load_state_dict=load_state_dict)
    print(json.dumps(dict(event="up", cluster=a.cluster)), flush=True)
    while ex.round < a.rounds:
        rnd = ex.round
        while rnd == a.hold_round and not a.hold_file.exists():
            time.sleep(0.1)
        payload = wire.frame(pseudo_gradient(a.cluster, rnd).view(torch.uint8), header(a.cluster, rnd))
        if rnd == a.corrupt_round:
            payload[-1] ^= 0x5A  # a bit flip in the body: the checksum must catch it
        if rnd == a.diverge_round:
            w[0] += 0.5
        if rnd == a.freeze_round:
            allgather = ex.pg.allgather
            ex.pg.allgather = lambda *args: (os.kill(os.getpid(), signal.SIGSTOP), allgather(*args))[1]
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
        print(json.dumps(dict(event="round", cluster=a.cluster, round=got.round, clusters=got.clusters,
                              members=got.members, dropped=got.dropped, healed=got.healed,
                              healed_digest=healed_from.pop("digest", None), attempts=got.attempts,
                              seconds=round(got.seconds, 3), digest=digest(w), t=time.time())), flush=True)
        time.sleep(a.inner_s)  # the inner steps
    ex.close()


if __name__ == "__main__":
    main()
