"""CompressedReducer over gloo with C = 2 clusters: agreement, accuracy, bytes, tampering.

All scenarios run in ONE launch of two forked worker processes (process start costs seconds);
the module fixture collects their results and the tests below check them. Each worker wraps
the torch.distributed collectives to record the bytes it actually handed to them, and can flip
one byte of a received payload to play a corrupting link.
"""
import hashlib
import math
from dataclasses import asdict

import pytest
import torch
import torch.distributed as dist

from megatron_dilocox.config import CompressionConfig, DiLoCoXConfig
from megatron_dilocox.outer.compression import CompressedReducer, topk, wire
from megatron_dilocox.outer.sync import ByteCounter, OuterSync
from test_compression import header_bytes_formula
from launch import run_forked

SHAPES = [(48, 40), (40,), (3, 4, 5), (1, 90), (64, 24), (7,)]
NUMEL = sum(math.prod(s) for s in SHAPES)
ROUNDS = 3
CASES = {
    "quantize8": dict(codec="quantize", bits=8),
    "quantize4-ef": dict(codec="quantize", bits=4, error_feedback=True),
    "lowrank": dict(codec="lowrank", rank=4),
    "lowrank-quantize8-adaptive": dict(codec="lowrank-quantize", bits=8, rank=4, adaptive=True),
    "lowrank-quantize4-ef": dict(codec="lowrank-quantize", bits=4, rank=4, error_feedback=True),
    "topk2": dict(codec="topk", bits=2, topk_chunk=256, topk_density=0.05),  # error feedback on by default
    "topk4-bitmap": dict(codec="topk", bits=4, topk_chunk=64, topk_density=0.25, error_feedback=False),
}
MATRIX_SPANS = [(0, 48, 40), (1920 + 40 + 60 + 90, 64, 24)]  # (offset, m, n) of the 2-D tensors


def cluster_input(cluster, rnd):
    """Random dense parts; the matrices are rank 1 per cluster, so their mean has rank <= 2."""
    g = torch.Generator().manual_seed(1000 * cluster + rnd)
    x = torch.randn(NUMEL, generator=g) * (1 + cluster)
    for offset, m, n in MATRIX_SPANS:
        x[offset: offset + m * n] = (torch.randn(m, 1, generator=g) @ torch.randn(1, n, generator=g)).reshape(-1)
    return x


def digest(t):
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


# -- worker side -------------------------------------------------------------------------------


class Wire:
    """Wraps the collectives: counts the bytes handed to them, optionally corrupts one payload."""

    def __init__(self):
        self.sent = 0
        self.corrupt_next_gather = False
        gather_name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
        gather, reduce = getattr(dist, gather_name), dist.all_reduce

        def counted_gather(out, inp, group=None, async_op=False):
            self.sent += inp.numel() * inp.element_size()
            res = gather(out, inp, group=group, async_op=async_op)
            if self.corrupt_next_gather:  # flip a body byte of cluster 1's slot, on every rank
                self.corrupt_next_gather = False
                out[inp.numel() + wire.HEADER_BYTES + 3] ^= 0x20
            return res

        def counted_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            self.sent += tensor.numel() * tensor.element_size()
            return reduce(tensor, op=op, group=group, async_op=async_op)

        setattr(dist, gather_name, counted_gather)
        dist.all_reduce = counted_reduce


def scenario_codecs(rank, group, tap):
    out = {}
    for name, kwargs in CASES.items():
        counter = ByteCounter()
        red = CompressedReducer(SHAPES, CompressionConfig(**kwargs), counter=counter)
        rounds = []
        for rnd in range(1, ROUNDS + 1):
            expected = header_bytes_formula(red) + 32 * (rnd == 1)
            b0, s0 = counter.bytes, tap.sent
            (res,) = red([cluster_input(rank, rnd)], group)
            rounds.append(dict(out=res.clone(), counted=counter.bytes - b0, actual=tap.sent - s0,
                               expected=expected, stats=dict(red.last_stats)))
        out[name] = rounds
    return out


def scenario_tamper(rank, group, tap, codec="lowrank-quantize"):
    red = CompressedReducer(SHAPES, CompressionConfig(codec=codec, bits=4, rank=4))
    red([cluster_input(rank, 1)], group)
    tap.corrupt_next_gather = True  # round 2, first exchange (P)
    try:
        red([cluster_input(rank, 2)], group)
    except ValueError as e:
        return str(e)
    return None


def scenario_mismatch(rank, group, tap, codec="quantize", **per_rank):
    """Clusters that differ in one setting: ``per_rank`` maps it to (cluster 0's, cluster 1's)."""
    settings = {k: v[rank] for k, v in (per_rank or dict(bits=(8, 4))).items()}
    red = CompressedReducer(SHAPES, CompressionConfig(codec, **settings))
    try:
        red([cluster_input(rank, 1)], group)
    except ValueError as e:
        return str(e)
    return None


def scenario_outer_sync(rank, group, tap):
    """OuterSync (delay mode) with the compressed reducer on a toy problem."""
    counter = ByteCounter()
    params = [torch.zeros(s) for s in SHAPES]
    with torch.no_grad():
        for p, v in zip(params, torch.randn(NUMEL, generator=torch.Generator().manual_seed(5)).split(
                [math.prod(s) for s in SHAPES])):
            p.copy_(v.view_as(p))
    red = CompressedReducer(SHAPES, CompressionConfig(codec="lowrank-quantize", bits=4, rank=4, adaptive=True,
                                                      error_feedback=True), counter=counter)
    sync = OuterSync(params, group, DiLoCoXConfig(clusters=2, local_steps=2, sync_mode="delay"),
                     reducer=red, counter=counter)
    bases, stats = [], []
    for rnd in range(1, 5):
        with torch.no_grad():
            for p, d in zip(params, cluster_input(rank, rnd).split([math.prod(s) for s in SHAPES])):
                p.sub_(0.01 * d.view_as(p))  # "local training"
        stats.append(asdict(sync.step(rnd)))
        bases.append(digest(sync.base))
    stats.append(asdict(sync.finish()))
    sync.close()
    return dict(bases=bases, stats=stats, bytes=counter.bytes, final=digest(sync.base),
                finite=bool(torch.isfinite(sync.base).all()))


def _scenarios(rank, group):
    tap = Wire()
    return {name: fn(rank, group, tap) for name, fn in (
        ("codecs", scenario_codecs), ("tamper", scenario_tamper),
        ("tamper_topk", lambda *a: scenario_tamper(*a, codec="topk")),
        ("mismatch", scenario_mismatch), ("outer_sync", scenario_outer_sync),
        ("mismatch_topk", lambda *a: scenario_mismatch(*a, codec="topk", topk_density=(0.05, 0.1))))}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Results of all scenarios, one dict per rank."""
    return run_forked(_scenarios, tmp_path_factory.mktemp("compression"), timeout=90)


# -- checks ------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_every_codec_is_bit_identical_on_both_ranks(ranks, case):
    for rnd in range(ROUNDS):
        a, b = (ranks[k]["codecs"][case][rnd] for k in range(2))
        assert torch.equal(a["out"], b["out"]), f"round {rnd + 1}: ranks disagree"
        assert bool(torch.isfinite(a["out"]).all())
        assert a["stats"]["ranks"] == b["stats"]["ranks"]


@pytest.mark.parametrize("case", list(CASES))
def test_bytes_counted_equal_bytes_sent_and_the_formula(ranks, case):
    for rank in ranks:
        for rnd in rank["codecs"][case]:
            assert rnd["counted"] == rnd["actual"] == rnd["expected"] == rnd["stats"]["sent_bytes"]
            assert rnd["stats"]["dense_bytes"] == 4 * NUMEL


def mean_input(rnd):
    return (cluster_input(0, rnd) + cluster_input(1, rnd)) / 2


def test_lowrank_fp32_is_exact_for_low_rank_means_and_dense_parts(ranks):
    mask = torch.ones(NUMEL, dtype=torch.bool)
    for offset, m, n in MATRIX_SPANS:
        mask[offset: offset + m * n] = False
    for rnd in range(ROUNDS):
        out, want = ranks[0]["codecs"]["lowrank"][rnd]["out"], mean_input(rnd + 1)
        assert torch.equal(out[mask], want[mask])  # dense fp32: sum of two, halved, as all-reduce
        assert float((out - want).norm() / want.norm()) < 1e-5


@pytest.mark.parametrize("case,tol", [("quantize8", 0.02), ("quantize4-ef", 0.2),
                                      ("lowrank-quantize8-adaptive", 0.03), ("lowrank-quantize4-ef", 0.25)])
def test_quantized_codecs_approximate_the_mean(ranks, case, tol):
    out, want = ranks[0]["codecs"][case][0]["out"], mean_input(1)  # round 1: no residual yet
    assert float((out - want).norm() / want.norm()) < tol
    assert ranks[0]["codecs"][case][0]["stats"]["ratio"] > 2


@pytest.mark.parametrize("case", ["topk2", "topk4-bitmap"])
def test_topk_is_the_mean_of_both_decoded_payloads(ranks, case):
    """Round 1 (no residual yet): the fp32 sum of both clusters' decoded payloads, in cluster
    order, halved; the clusters' top entries differ, so the mean has up to twice as many."""
    kw = CASES[case]
    out = ranks[0]["codecs"][case][0]["out"]
    decoded = [topk.decode(topk.encode(cluster_input(k, 1), kw["topk_chunk"], kw["topk_density"], kw["bits"]),
                           NUMEL, kw["topk_chunk"], kw["topk_density"], kw["bits"]) for k in range(2)]
    assert torch.equal(out, (decoded[0] + decoded[1]) / 2)
    assert ranks[0]["codecs"][case][0]["stats"]["ratio"] > 2


def test_adaptive_rank_agrees_and_shrinks_to_the_mean_rank(ranks):
    stats = [r["stats"] for r in ranks[0]["codecs"]["lowrank-quantize8-adaptive"]]
    assert stats[0]["ranks"] == [4, 4] and stats[-1]["ranks"] == [2, 2]


@pytest.mark.parametrize("scenario", ["tamper", "tamper_topk"])
def test_tampered_payload_raises_on_every_rank(ranks, scenario):
    for rank in ranks:
        assert rank[scenario] is not None
        assert rank[scenario].startswith("outer round 2: payload from cluster 1 failed its checksum")


@pytest.mark.parametrize("scenario", ["mismatch", "mismatch_topk"])
def test_mismatched_settings_fail_the_handshake_on_every_rank(ranks, scenario):
    assert "cluster 1 runs different compression settings" in ranks[0][scenario]
    assert "cluster 0 runs different compression settings" in ranks[1][scenario]


def test_outer_sync_with_compressed_reducer_keeps_bases_identical(ranks):
    a, b = ranks[0]["outer_sync"], ranks[1]["outer_sync"]
    assert a["bases"] == b["bases"] and a["final"] == b["final"] and a["finite"]
    assert len(set(a["bases"])) == len(a["bases"])  # the base moves every round after the first
    assert sum(s["bytes_sent"] for s in a["stats"]) == a["bytes"]
    assert not any(s["skipped"] for s in a["stats"])
