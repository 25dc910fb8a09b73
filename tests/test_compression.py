"""Compression codecs in one process: quantization, int4 packing, PowerSGD pieces, top-k, wire
format, error feedback, adaptive rank, checkpointing, flags. The gloo (C = 2) scenarios are in
test_compression_dist.py. No test runs on zeros only.
"""
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from megatron_dilocox.arguments import parse_args
from megatron_dilocox.errors import ConfigError
from megatron_dilocox import payload
from megatron_dilocox.config import CompressionConfig
from megatron_dilocox.outer.compression import CompressedReducer, lowrank, topk, wire
from megatron_dilocox.outer.compression import quantize as qz
from megatron_dilocox.outer.compression.segments import SegmentCodec

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TINY = 2.0 ** -149  # smallest fp32 denormal: the rounding slack of a denormal result


def rand(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


# -- quantization ------------------------------------------------------------------------------

AWKWARD_SIZES = st.sampled_from([1, 2, 3, 255, 256, 257, 511, 1000])
MAGNITUDES = st.sampled_from([1e-40, 1e-30, 1e-8, 1.0, 1e5, 1e30, 3e38])


@st.composite
def vectors(draw):
    """Mixed-sign fp32 vectors of awkward sizes: raw fp32 draws or unit values times a magnitude."""
    n = draw(AWKWARD_SIZES | st.integers(1, 700))
    if draw(st.booleans()):
        vals = draw(st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False),
                             min_size=n, max_size=n))
        x = torch.tensor(vals, dtype=torch.float32)
    else:
        seed = draw(st.integers(0, 2**31 - 1))
        x = (torch.rand(n, generator=torch.Generator().manual_seed(seed)) * 2 - 1) * draw(MAGNITUDES)
        x = x.float()
    assume(bool((x != 0).any()))
    return x


def block_absmax(x, block):
    n = x.numel()
    pad = torch.nn.functional.pad(x.double().abs(), (0, -n % block))
    return pad.view(-1, block).amax(1).repeat_interleave(block)[:n]


@FAST
@given(x=vectors(), bits=st.sampled_from([8, 4]), block=st.sampled_from([2, 64, 256]))
def test_quantize_round_trip_error_is_bounded_per_block(x, bits, block):
    q = qz.quantize(x, bits, block)
    y = qz.dequantize(q)
    assert y.shape == x.shape and y.dtype == torch.float32
    assert bool(torch.isfinite(y).all()), "finite input must decode finite"
    err = (y.double() - x.double()).abs()
    absmax = block_absmax(x, block)
    half_step = absmax / (2 * qz.qmax(bits))  # round to nearest: half a quantization step
    assert bool((err <= half_step * (1 + 2**-20) + TINY).all()), float((err - half_step).max())
    assert bool((err <= absmax / 2 ** (bits - 1) + TINY).all())  # the coarser stated bound
    assert bool((y.abs() <= absmax.float()).all()), "decoding never exceeds the block's absmax"
    assert q.nbytes == quantized_bytes(x.numel(), bits, block) == payload.quantized_bytes(x.numel(), bits, block)
    assert q.codes.dtype == torch.uint8 and q.codes.numel() == math.ceil(x.numel() / block) * block * bits // 8


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_extremes(bits):
    x = torch.tensor([3.4028235e38, -3.4028235e38, 1e-40, -1e-45, 0.0, 1.0, -2.5], dtype=torch.float32)
    for block in (2, 8):
        y = qz.dequantize(qz.quantize(x, bits, block))
        assert bool(torch.isfinite(y).all())
        assert y[0] == x[0] and y[1] == x[1]  # the block maximum is exact (fp32 scale = absmax)
    # each block's maximum comes back exactly, denormal or not
    x = torch.tensor([1e-40, 0.0, 0.0, -5.0])
    assert torch.equal(qz.dequantize(qz.quantize(x, bits, 2)), x)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_rounds_to_nearest(bits):
    m = qz.qmax(bits)
    # with absmax m, the step is exactly 1: 0.49 -> 0, 0.51 -> 1, 2.5 -> 2 (half to even)
    x = torch.tensor([float(m), 0.49, 0.51, -0.51, 2.5, -3.4], dtype=torch.float32)
    y = qz.dequantize(qz.quantize(x, bits, 6))
    assert y.tolist() == [float(m), 0.0, 1.0, -1.0, 2.0, -3.0]


@pytest.mark.parametrize("bits", [8, 4])
def test_non_finite_blocks_stay_non_finite_and_isolated(bits):
    x = rand(12)
    x[1], x[6] = float("nan"), float("inf")
    y = qz.dequantize(qz.quantize(x, bits, 4))
    assert not bool(torch.isfinite(y[:8]).any())  # blocks 0 and 1 carry the NaN / inf
    assert bool(torch.isfinite(y[8:]).all())
    assert (y[8:] - x[8:]).abs().max() <= x[8:].abs().max() / qz.qmax(bits)


def test_quantize_rejects_bad_args():
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        qz.quantize(rand(4), 3, 4)
    with pytest.raises(ValueError, match="even"):
        qz.quantize(rand(4), 4, 5)
    with pytest.raises(ValueError, match="1-D fp32"):
        qz.quantize(rand(2, 2), 8, 4)
    assert qz.dequantize(qz.quantize(torch.empty(0), 8, 4)).numel() == 0


@FAST
@given(codes=st.lists(st.integers(-8, 7), min_size=0, max_size=300).filter(lambda c: len(c) % 2 == 0))
def test_int4_pack_round_trip(codes):
    q = torch.tensor(codes, dtype=torch.int8)
    packed = qz.pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.numel() == len(codes) // 2
    assert torch.equal(qz.unpack_int4(packed), q)


def test_int4_nibble_order():
    # q + 8 per nibble, the even element in the low nibble: (-8, 7) -> 0x0 | 0xF << 4
    assert qz.pack_int4(torch.tensor([-8, 7, 1, -1], dtype=torch.int8)).tolist() == [0xF0, 0x79]


def test_segments_quantize_each_part_separately():
    big, small = rand(300, seed=1, scale=1e6), rand(5, seed=2, scale=1e-3)
    codec = SegmentCodec([300, 5], 8, 256)
    assert codec.nbytes == quantized_bytes(300, 8, 256) + quantized_bytes(5, 8, 256) == 3 * (256 + 4)  # 2 + 1 blocks
    body = codec.encode([big, small])
    assert body.numel() == codec.nbytes
    out = codec.decode(body)
    assert out.shape == (305,)
    # the small part has its own scale, so it keeps its precision next to the huge one
    assert (out[300:] - small).abs().max() <= small.abs().max() / 254 * 1.001
    raw = SegmentCodec([300, 5], 32, 256)
    assert torch.equal(raw.decode(raw.encode([big, small])), torch.cat([big, small]))


# -- PowerSGD pieces ---------------------------------------------------------------------------


@FAST
@given(m=st.integers(2, 40), n=st.integers(2, 40), k=st.integers(1, 6), extra=st.integers(0, 3),
       seed=st.integers(0, 1000))
def test_lowrank_exact_for_matrices_of_rank_at_most_r(m, n, k, extra, seed):
    k = min(k, m, n)
    r = min(k + extra, m, n)
    assume((m + n) * r < m * n)  # the factors are smaller than the matrix: it goes low-rank
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g) @ torch.randn(k, n, generator=g)
    red = CompressedReducer([(m, n)], CompressionConfig(codec="lowrank", rank=r))
    assert len(red.matrices) == 1
    (out,) = red([a.reshape(-1)], None)
    rel = (out.view(m, n) - a).norm() / a.norm()
    assert rel < 1e-4, float(rel)


def test_orthonormalize_properties_and_thread_independence():
    p = rand(40000, 6, seed=3)  # big enough for torch to split elementwise ops across threads
    p[:, 4] = p[:, 0] * 2 - p[:, 1]  # a dependent column
    p[:, 5] = 0  # a zero column
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = lowrank.orthonormalize(p)
        torch.set_num_threads(2)
        two = lowrank.orthonormalize(p)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    assert torch.equal(one[:, 5], torch.zeros(40000))
    keep = one[:, :4]
    assert torch.allclose(keep.T @ keep, torch.eye(4), atol=1e-6)
    # span is preserved: projecting p onto the basis gives p back
    assert torch.allclose(one @ (one.T @ p), p, atol=1e-4)
    batched = lowrank.orthonormalize(torch.stack([p, p * 3]))
    assert torch.equal(batched[0], one)


def test_reconstruct_is_chunk_independent_and_matches_matmul():
    p, q = rand(700, 5, seed=4), rand(600, 5, seed=5)
    out = torch.empty(700, 600)
    lowrank.reconstruct(p, q, out)
    assert torch.allclose(out, p @ q.T, rtol=1e-5, atol=1e-5)
    # the same sum in a single chunk, term by term, must give the same bits
    ref = p[:, :1] * q[:, 0]
    for j in range(1, 5):
        ref = ref + p[:, j: j + 1] * q[:, j]
    assert torch.equal(out, ref)


def test_tree_sum_and_random_columns_are_deterministic():
    x = rand(37, 3, seed=6).double()
    assert torch.allclose(lowrank.tree_sum(x, 0), x.sum(0))
    assert lowrank.tree_sum(torch.empty(0, 3), 0).tolist() == [0, 0, 0]
    assert torch.equal(lowrank.random_columns(10, 3, 1, 2, 3), lowrank.random_columns(10, 3, 1, 2, 3))
    assert not torch.equal(lowrank.random_columns(10, 3, 1, 2, 3), lowrank.random_columns(10, 3, 1, 2, 4))


def test_layout_sends_only_matrices_that_save_bytes_low_rank():
    red = CompressedReducer([(64, 32), (32,), (1, 100), (3, 4), (4, 3, 5), (64, 2, 4)],
                            CompressionConfig(codec="lowrank", rank=4))
    assert [(a.index, a.m, a.n, a.max_rank) for a in red.matrices] == [(0, 64, 32, 4), (5, 64, 8, 4)]
    assert [n for _, n in red.dense] == [32, 100, 12, 60]
    assert CompressedReducer([(64, 32)], CompressionConfig(codec="quantize")).matrices == []


# -- adaptive rank -----------------------------------------------------------------------------


def test_choose_rank_shrinks_and_then_holds_on_an_unchanged_spectrum():
    spectrum = [0.6, 0.28, 0.08, 0.04, 0.0, 0.0, 0.0, 0.0]
    rank, keep, outside = lowrank.choose_rank(spectrum, 8, 1, 8, 0.9, 0.0)
    assert (rank, keep) == (3, [0, 1, 2])
    assert outside == pytest.approx(0.04 / 0.96)
    # next round sees only the 3 kept directions: it must not shrink further
    again = lowrank.choose_rank(spectrum[:3], 3, 1, 8, 0.9, outside)
    assert again[0] == 3 and again[2] == outside


def test_choose_rank_grows_when_the_spectrum_flattens_and_respects_bounds():
    rank, keep, outside = lowrank.choose_rank([0.34, 0.33, 0.33], 3, 1, 8, 0.9, 0.5)
    assert rank == 4 and sorted(keep) == [0, 1, 2] and outside >= 0
    assert lowrank.choose_rank([1.0, 1e-9, 1e-9, 1e-9], 4, 2, 4, 0.9, 0.0)[0] == 2  # min_rank
    assert lowrank.choose_rank([0.25] * 4, 4, 1, 4, 0.9, 0.0)[0] == 4  # at max, flat: stay
    # unordered energies: the strongest columns are kept
    assert lowrank.choose_rank([0.01, 0.9, 0.01, 0.08], 4, 1, 4, 0.9, 0.0)[:2] == (1, [1])
    assert lowrank.choose_rank([float("nan"), 1.0], 2, 1, 2, 0.9, 0.0)[0] == 2
    assert lowrank.choose_rank([0.0, 0.0], 2, 1, 2, 0.9, 0.0)[0] == 2


def test_adaptive_reducer_finds_the_rank_of_a_low_rank_pseudo_gradient():
    g = torch.Generator().manual_seed(7)
    a = torch.randn(80, 2, generator=g) @ torch.randn(2, 60, generator=g)
    b = (torch.randn(50, 1, generator=g) @ torch.randn(1, 70, generator=g)) * 1e-4
    x = torch.cat([a.reshape(-1), b.reshape(-1), rand(10, seed=8)])
    red = CompressedReducer([(80, 60), (50, 70), (10,)],
                            CompressionConfig(codec="lowrank-quantize", rank=8, adaptive=True))
    ranks = []
    for _ in range(4):
        (out,) = red([x], None)
        ranks.append(list(red.ranks))
        assert red.last_stats["rel_error"] < 0.02
    assert ranks[0] == [2, 1] and ranks[-1] == [2, 1]
    assert red.last_stats["ranks"] == [2, 1] and red.last_stats["mean_rank"] == 1.5


# -- top-k -------------------------------------------------------------------------------------


def quantized_bytes(numel, bits, block):
    """Blockwise quantized bytes: every block padded to ``block`` codes, plus its fp32 scale."""
    return math.ceil(numel / block) * (block * bits // 8 + 4)


def topk_bytes(numel, chunk, density, bits):
    """Body bytes of the top-k format, chunk by chunk (the full chunks, then the short one)."""
    total = 0
    for length, count in ((chunk, numel // chunk), (numel % chunk, 1 if numel % chunk else 0)):
        if not count:
            continue
        k = max(1, round(density * length))
        low = max(0, math.floor(math.log2(length / k)))  # Elias-Fano: low bits per index, then
        elias_fano = k * low + k + (length - 1) // 2**low + 1  # one bit per index and per high value
        positions = min(elias_fano, length)  # or a bitmap of the chunk
        total += math.ceil(count * positions / 8) + math.ceil(count * k * bits / 8) + 4 * count
    return total


def expected_kept(x, chunk, density):
    """Per chunk, the k largest magnitudes, ties to the lower index (a stable sort)."""
    keep = torch.zeros(x.numel(), dtype=torch.bool)
    for start in range(0, x.numel(), chunk):
        part = x[start: start + chunk].abs().tolist()
        k = max(1, round(density * len(part)))
        order = sorted(range(len(part)), key=lambda i: (-part[i], i))
        keep[[start + i for i in order[:k]]] = True
    return keep


@st.composite
def sparse_inputs(draw):
    """(x, chunk, density, bits): random lengths and settings; values with many ties (a few
    distinct magnitudes) or without, and often one chunk of zeros; never all zeros."""
    n = draw(st.integers(1, 3000))
    chunk = draw(st.sampled_from([2, 3, 16, 100, 256, 1000, 4096]))
    density = draw(st.sampled_from([1 / 64, 0.01, 0.05, 0.1, 0.3, 0.5, 1.0]) | st.floats(1e-4, 1.0))
    bits = draw(st.sampled_from(topk.BITS))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    scale = draw(MAGNITUDES)
    if draw(st.booleans()):
        x = torch.randint(-3, 4, (n,), generator=g).float() * (scale / 4)  # ties everywhere
    else:
        x = (torch.randn(n, generator=g) * (scale / 8)).float()
    if draw(st.booleans()):
        start = draw(st.integers(0, (n - 1) // chunk)) * chunk
        x[start: start + chunk] = 0
    assume(bool((x != 0).any()) and bool(torch.isfinite(x).all()))
    return x, chunk, density, bits


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=sparse_inputs())
def test_topk_round_trip_keeps_the_top_k_per_chunk(case):
    x, chunk, density, bits = case
    body = topk.encode(x, chunk, density, bits)
    assert body.dtype == torch.uint8 and body.numel() == topk_bytes(x.numel(), chunk, density, bits)
    assert payload.topk_bytes(x.numel(), chunk, density, bits) == body.numel()
    y = topk.decode(body, x.numel(), chunk, density, bits)
    assert y.shape == x.shape and y.dtype == torch.float32
    keep = expected_kept(x, chunk, density)
    assert bool((y[~keep] == 0).all()), "an entry outside the top k decoded to non-zero"
    absmax = block_absmax(x, chunk).float()  # the chunk's absmax, per element
    err = (y.double() - x.double()).abs()[keep]
    bound = absmax.double()[keep] / 2**bits  # half a bin of 2 * absmax / 2**bits
    assert bool((err <= bound * (1 + 2**-20) + TINY).all()), float((err - bound).max())
    assert bool((y.abs() <= absmax).all()), "decoding never exceeds the chunk's absmax"
    # Error feedback keeps exactly what was not sent: every dropped entry whole. (The reducer
    # treats a round whose fp32 norm overflows, entries above ~1e19, as non-finite.)
    assume(math.isfinite(float(torch.linalg.vector_norm(x))))
    red = CompressedReducer([(x.numel(),)], CompressionConfig(codec="topk", bits=bits, topk_chunk=chunk,
                                                              topk_density=density, ef_decay=1.0))
    (out,) = red([x], None)
    assert torch.equal(out, y) and red.config.error_feedback
    assert torch.equal(red.residual, x - y) and torch.equal(red.residual[~keep], x[~keep])
    assert red.last_stats["payload_bytes"] == wire.HEADER_BYTES + body.numel()


def test_topk_ties_go_to_the_lower_index_and_zero_chunks_decode_to_zero():
    x = torch.tensor([1.0, -2.0, 2.0, -2.0, 2.0, 0.5] + [0.0] * 6)
    y = topk.decode(topk.encode(x, 6, 0.5, 4), 12, 6, 0.5, 4)
    # |-2| ties four times for 3 places: indices 1, 2, 3; the second chunk is all zeros
    assert y.nonzero().view(-1).tolist() == [1, 2, 3]
    assert y[1:4].tolist() == [-2 * 15 / 16, 2 * 15 / 16, -2 * 15 / 16]
    # 2 bits: the four levels are -3/4, -1/4, 1/4 and 3/4 of the absmax
    x = torch.tensor([4.0, -3.0, 1.5, -0.5])
    assert topk.decode(topk.encode(x, 4, 1.0, 2), 4, 4, 1.0, 2).tolist() == [3.0, -3.0, 1.0, -1.0]


def test_topk_bitmap_where_indices_cost_more():
    # chunk 16, k = 8: Elias-Fano 8 x 1 low bits + 8 + 8 high bits = 24 bits, more than the 16-bit bitmap;
    # k = 2: 2 x 3 + 2 + 2 = 10 bits; 4096 at 1/64: 64 x 6 + 64 + 64 = 8 bits per index
    assert payload.position_bits(16, 0.5) == 16 and payload.position_bits(16, 0.25) == 16
    assert payload.position_bits(16, 1 / 8) == 10 and payload.position_bits(4096, 1 / 64) == 64 * 8
    x = rand(40, seed=30)
    for density in (0.5, 0.1):
        y = topk.decode(topk.encode(x, 16, density, 3), 40, 16, density, 3)
        assert torch.equal(y != 0, expected_kept(x, 16, density))


def test_topk_non_finite_chunks_stay_non_finite():
    x = rand(30, seed=31)
    x[2], x[17] = float("nan"), float("inf")
    y = topk.decode(topk.encode(x, 10, 0.2, 2), 30, 10, 0.2, 2)
    assert not bool(torch.isfinite(y[:10]).all()) and not bool(torch.isfinite(y[10:20]).all())
    assert bool(torch.isfinite(y[20:]).all())


# -- wire format -------------------------------------------------------------------------------

HEADER = wire.Header("lowrank-quantize", 4, "Q", 7, 1, wire.layout_digest("Q", [6], 4, 256), 10)


def test_wire_round_trip():
    body = torch.arange(10, dtype=torch.uint8) * 7
    buf = wire.frame(body, HEADER)
    assert buf.numel() == wire.HEADER_BYTES + 10 == 50
    assert torch.equal(wire.unframe(buf, HEADER), body)


@FAST
@given(pos=st.integers(0, 49), bit=st.integers(0, 7))
def test_wire_detects_any_flipped_bit(pos, bit):
    buf = wire.frame(torch.arange(10, dtype=torch.uint8) * 7 + 1, HEADER)
    buf[pos] ^= 1 << bit
    with pytest.raises(ValueError, match="^outer round 7: payload from cluster 1 "):
        wire.unframe(buf, HEADER)


def test_wire_errors_name_the_problem():
    buf = wire.frame(torch.arange(10, dtype=torch.uint8), HEADER)
    tampered = buf.clone()
    tampered[45] ^= 0x10  # a body byte
    with pytest.raises(ValueError, match="outer round 7: payload from cluster 1 failed its checksum"):
        wire.unframe(tampered, HEADER)
    with pytest.raises(ValueError, match="truncated"):
        wire.unframe(buf[:20], HEADER)
    with pytest.raises(ValueError, match="body bytes"):
        wire.unframe(buf[:-1], HEADER)
    with pytest.raises(ValueError, match="round 6 .expected 7."):
        wire.unframe(wire.frame(torch.arange(10, dtype=torch.uint8), wire.Header(*[
            6 if f == "round" else getattr(HEADER, f) for f in wire.Header.__dataclass_fields__])), HEADER)


# -- the reducer in one process (C = 1) --------------------------------------------------------

SHAPES = [(48, 40), (40,), (3, 4, 5), (1, 90), (64, 24)]
NUMEL = sum(math.prod(s) for s in SHAPES)


def header_bytes_formula(red):
    """Bytes a round of ``red`` sends, from the documented formula."""
    c = red.config
    if c.codec == "topk":
        return wire.HEADER_BYTES + topk_bytes(red.numel, c.topk_chunk, c.topk_density, c.bits)
    def s(n):
        return 4 * n if red.payload_bits == 32 else quantized_bytes(n, red.payload_bits, c.block)
    dense = sum(s(n) for _, n in red.dense)
    if not red.matrices:
        return wire.HEADER_BYTES + dense
    p = sum(s(a.m * r) for a, r in zip(red.matrices, red.ranks))
    q = sum(s(a.n * r) for a, r in zip(red.matrices, red.ranks))
    return 2 * wire.HEADER_BYTES + p + dense + q


@pytest.mark.parametrize("codec,bits", [("quantize", 8), ("quantize", 4), ("lowrank", 8),
                                        ("lowrank-quantize", 8), ("lowrank-quantize", 4), ("topk", 2)])
def test_single_cluster_round_stats_and_bytes(codec, bits):
    red = CompressedReducer(SHAPES, CompressionConfig(codec=codec, bits=bits, rank=4, block=64))
    x = rand(NUMEL, seed=9)
    before = x.clone()
    expected = header_bytes_formula(red)
    (out,) = red([x], None)
    assert torch.equal(x, before), "compressing codecs must not modify the input"
    st_ = red.last_stats
    assert st_["payload_bytes"] == expected and st_["sent_bytes"] == 0
    assert st_["dense_bytes"] == 4 * NUMEL and st_["ratio"] == pytest.approx(4 * NUMEL / expected)
    assert 0 < st_["rel_error"] < 1
    assert st_["rel_error"] == pytest.approx(float((out - x).norm() / x.norm()), rel=1e-4)
    assert st_["round"] == 1 and min(st_["encode_s"], st_["decode_s"]) >= 0


def test_none_is_not_a_compressed_reduction():
    with pytest.raises(ValueError, match="--dilocox-compression none sends the fp32 mean"):
        CompressedReducer(SHAPES, CompressionConfig(codec="none"))


@pytest.mark.parametrize("codec", ["quantize", "lowrank", "lowrank-quantize", "topk"])
def test_non_finite_round_propagates_and_the_next_round_recovers(codec):
    red = CompressedReducer(SHAPES, CompressionConfig(codec=codec, rank=4, error_feedback=True, topk_chunk=256))
    x = rand(NUMEL, seed=11)
    bad = x.clone()
    bad[5] = float("nan")
    (out,) = red([bad], None)
    assert not bool(torch.isfinite(out).all())
    (out,) = red([x], None)
    assert bool(torch.isfinite(out).all()), "warm starts and residual must recover from a NaN round"
    assert bool(torch.isfinite(red.residual).all())


def test_rejects_bad_setup():
    with pytest.raises(ValueError, match="--dilocox-compression must be one of"):
        CompressedReducer(SHAPES, CompressionConfig(codec="randk"))
    with pytest.raises(ValueError, match="--dilocox-quant-bits must be 8, 4 with --dilocox-compression quantize"):
        CompressedReducer(SHAPES, CompressionConfig(codec="quantize", bits=2))
    with pytest.raises(ValueError, match="--dilocox-quant-bits must be 2, 3, 4 with --dilocox-compression topk"):
        CompressedReducer(SHAPES, CompressionConfig(codec="topk", bits=8))
    with pytest.raises(ValueError, match="--dilocox-topk-density"):
        CompressedReducer(SHAPES, CompressionConfig(codec="topk", topk_density=0.0))
    with pytest.raises(ValueError, match="--dilocox-topk-chunk"):
        CompressedReducer(SHAPES, CompressionConfig(codec="topk", topk_chunk=1))
    with pytest.raises(ValueError, match="--dilocox-min-rank"):
        CompressedReducer(SHAPES, CompressionConfig(codec="lowrank", rank=2, min_rank=3))
    with pytest.raises(ValueError, match="--dilocox-ef-decay"):
        CompressedReducer(SHAPES, CompressionConfig(codec="lowrank", ef_decay=1.5))
    red = CompressedReducer(SHAPES, CompressionConfig(codec="quantize"))
    with pytest.raises(ValueError, match=f"flat fp32 buffer of {NUMEL} elements"):
        red([rand(NUMEL + 1)], None)
    with pytest.raises(ValueError, match="one flat buffer"):
        red([rand(NUMEL), rand(NUMEL)], None)


# -- error feedback ----------------------------------------------------------------------------


def ef_input():
    """Random dense parts, rank-3 matrices (error feedback with rank r keeps the residual of a
    rank-k matrix within about k/r times the input; for full-rank noise the bound is min(m, n)/r,
    reached only after many rounds)."""
    g = torch.Generator().manual_seed(12)
    x = torch.randn(NUMEL, generator=g)
    x[: 48 * 40] = (torch.randn(48, 3, generator=g) @ torch.randn(3, 40, generator=g)).reshape(-1)
    x[-64 * 24:] = (torch.randn(64, 3, generator=g) @ torch.randn(3, 24, generator=g)).reshape(-1)
    return x


@pytest.mark.parametrize("codec,bits,rank", [("quantize", 4, 1), ("lowrank-quantize", 4, 2),
                                             ("lowrank-quantize", 8, 1), ("lowrank", 8, 2)])
def test_error_feedback_is_unbiased_over_rounds(codec, bits, rank):
    """The same input every round: with (undecayed) error feedback the running sum of outputs tracks the
    running sum of inputs (the gap is the residual, which stays bounded); without, it drifts."""
    x = ef_input()
    rounds = 40
    gaps = {}
    for ef in (True, False):
        red = CompressedReducer(SHAPES, CompressionConfig(codec=codec, bits=bits, rank=rank, block=64,
                                                          error_feedback=ef, ef_decay=1.0))
        total = torch.zeros(NUMEL, dtype=torch.float64)
        gap = []
        for t in range(1, rounds + 1):
            (out,) = red([x], None)
            total += out.double()
            gap.append(float((total - t * x.double()).norm() / x.norm()))
        gaps[ef] = gap
        if ef:
            # the gap is exactly the residual (up to fp32 rounding of the running sums)
            assert gap[-1] == pytest.approx(float(red.residual.norm() / x.norm()), rel=1e-3, abs=1e-4)
    assert max(gaps[True]) < 4, gaps[True]
    assert gaps[True][-1] < 0.2 * gaps[False][-1], (gaps[True][-1], gaps[False][-1])
    assert gaps[False][-1] > 5 * gaps[False][4]  # without error feedback the bias keeps growing


def test_ef_decay_damps_the_residual():
    x = rand(NUMEL, seed=13)
    norms = {}
    for decay in (1.0, 0.5, 0.0):
        red = CompressedReducer(SHAPES, CompressionConfig(codec="lowrank", rank=1, error_feedback=True, ef_decay=decay))
        for _ in range(5):
            red([x], None)
        norms[decay] = float(red.residual.norm())
    assert norms[1.0] > norms[0.5] > norms[0.0] == 0.0


def test_ef_decay_follows_the_inner_lr():
    """With --dilocox-ef-decay-follows-lr (the default with error feedback) a round at lr_scale s
    damps the residual as a constant decay of 1 - (1 - ef_decay) * s does, and ignores lr_scale
    with --no-dilocox-ef-decay-follows-lr."""
    x = rand(NUMEL, seed=17)

    def residual(scales, **config):
        red = CompressedReducer(SHAPES, CompressionConfig(codec="topk", topk_chunk=512, **config))
        for s in scales:
            red([x], None, lr_scale=s)
        return red.residual

    follows = residual([1.0, 0.4, 0.1], ef_decay=0.8)  # on by default with error feedback
    for steady, scales in ((0.8, [1.0] * 3), (0.92, [0.4] * 3), (0.98, [0.1] * 3)):
        assert not torch.equal(follows, residual(scales, ef_decay=steady, ef_decay_follows_lr=False))
    stepped = CompressedReducer(SHAPES, CompressionConfig(codec="topk", topk_chunk=512, ef_decay=0.8))
    for decay in (0.8, 0.92, 0.98):  # the same rounds with the decay each lr_scale gives
        stepped.config.ef_decay = decay
        stepped([x], None)
    assert torch.equal(follows, stepped.residual)
    constant = {"ef_decay": 0.8, "ef_decay_follows_lr": False}
    assert torch.equal(residual([1.0, 0.4, 0.1], **constant), residual([1.0] * 3, **constant))
    assert not CompressionConfig(codec="quantize").ef_decay_follows_lr  # no error feedback by default
    assert CompressionConfig(codec="topk", ef_decay=0.9, ef_decay_follows_lr=True).ef_decay_at(0.5) == pytest.approx(0.95)
    with pytest.raises(ValueError, match="--dilocox-ef-decay-follows-lr"):
        CompressionConfig(codec="quantize", ef_decay_follows_lr=True).validate()


# -- checkpointing -----------------------------------------------------------------------------


@pytest.mark.parametrize("codec", ["lowrank-quantize", "quantize", "topk"])
def test_state_dict_resume_matches_uninterrupted(codec):
    def make(**changed):
        settings = {**dict(bits=4, rank=4, error_feedback=True, adaptive=True, topk_chunk=512), **changed}
        return CompressedReducer(SHAPES, CompressionConfig(codec, **settings), seed=3)

    inputs = [rand(NUMEL, seed=20 + t) for t in range(5)]
    full = make()
    outs = [full([x], None)[0] for x in inputs]
    part = make()
    for x in inputs[:3]:
        part([x], None)
    state = part.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    assert resumed.round == 3
    assert torch.equal(resumed.residual, part.residual) and resumed.residual is not part.residual
    for x, want in zip(inputs[3:], outs[3:]):
        assert torch.equal(resumed([x], None)[0], want)
    assert torch.equal(resumed.residual, full.residual)
    for changed in [dict(bits=2 if codec == "topk" else 8)] + [dict(topk_density=0.1)] * (codec == "topk"):
        with pytest.raises(ValueError, match="different settings"):
            make(**changed).load_state_dict(state)


def test_numpy_interop_of_int4_layout():
    # the body is plain bytes: a numpy reader can unpack int4 codes the same way
    q = qz.quantize(rand(8, seed=14), 4, 8)
    codes = np.frombuffer(q.codes.numpy().tobytes(), dtype=np.uint8)
    lo, hi = (codes & 0xF).astype(np.int8) - 8, (codes >> 4).astype(np.int8) - 8
    assert np.array_equal(np.stack([lo, hi], 1).reshape(-1), qz.unpack_int4(q.codes).numpy())


# -- flags -------------------------------------------------------------------------------------

FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--micro-batch-size", "1", "--train-iters", "2", "--lr", "1e-3", "--mock-data",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--dilocox"]


def test_topk_flags_defaults_and_one_line_errors():
    comp = parse_args(FLAGS + ["--dilocox-compression", "topk"]).compression
    assert (comp.bits, comp.error_feedback, comp.topk_density, comp.topk_chunk) == (2, True, 1 / 32, 4096)
    comp = parse_args(FLAGS + ["--dilocox-compression", "topk", "--no-dilocox-error-feedback",
                               "--dilocox-quant-bits", "4"]).compression
    assert (comp.bits, comp.error_feedback) == (4, False)
    comp = parse_args(FLAGS + ["--dilocox-compression", "quantize"]).compression
    assert (comp.bits, comp.error_feedback) == (8, False)
    for extra, needle in [(["--dilocox-compression", "topk", "--dilocox-quant-bits", "8"], "--dilocox-quant-bits"),
                          (["--dilocox-compression", "quantize", "--dilocox-quant-bits", "2"],
                           "--dilocox-quant-bits must be 8, 4 with"),
                          (["--dilocox-compression", "topk", "--dilocox-topk-density", "0"], "--dilocox-topk-density"),
                          (["--dilocox-compression", "topk", "--dilocox-topk-chunk", "1"], "--dilocox-topk-chunk")]:
        with pytest.raises(ConfigError, match=needle):
            parse_args(FLAGS + extra)
