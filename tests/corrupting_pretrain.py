"""pretrain_gpt.py with one cluster's outer payload corrupted on the wire, for the bad-peer test
(test_cluster_jobs.py): ``CORRUPT_CLUSTER_ROUND=K:R`` flips a byte of cluster K's payload in
outer round R (rounds counted from 0, as torchft's step) after it was framed and checksummed,
as a faulty link or NIC would."""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_dilocox.outer.cluster_exchange import ClusterExchange  # noqa: E402

CLUSTER, ROUND = (int(v) for v in os.environ["CORRUPT_CLUSTER_ROUND"].split(":"))
_envelope = ClusterExchange._envelope


def _corrupted_envelope(self, payload, step, fingerprint, valid, timings):
    row = _envelope(self, payload, step, fingerprint, valid, timings)
    if self.config.cluster_index == CLUSTER and step == ROUND and valid:
        row[-1] ^= 0x5A
    return row


ClusterExchange._envelope = _corrupted_envelope

if __name__ == "__main__":
    import pretrain_gpt

    sys.exit(pretrain_gpt.main())
