"""Bytes one rank sends per outer round, by codec: the formulas the codecs, the reducer, the
planner and the tests share. Pure arithmetic, no torch (the planner runs without it).

With ``H`` = :data:`HEADER_BYTES` per exchange (its fields in ``outer/compression/wire.py``),
``S(n)`` = :func:`quantized_bytes` (``4 n`` for fp32 parts), ``d`` the dense tensors and
``(m_i, n_i, r_i)`` the tensors sent low-rank (:func:`lowrank_shape`)::

    none                       4 numel                    (one fp32 all-reduce, no header)
    quantize                   H + sum_all S(numel)       (one exchange)
    lowrank, lowrank-quantize  H + sum_i S(m_i r_i) + sum_d S(numel_d)    (P and the dense tensors)
                               + H + sum_i S(n_i r_i)     (Q, a second, dependent exchange)
    topk                       H + T(numel)               (T = topk_bytes, layout in topk.py)

plus :data:`HANDSHAKE_BYTES` at the first round and after every resume. ``S`` uses fp32 for
``lowrank`` and the codec's bits for the quantizing codecs.
"""
from __future__ import annotations

import math
import struct
from typing import Sequence

from megatron_dilocox.config import QUANT_BITS, CompressionConfig

HEADER_FIELDS = struct.Struct("<4sBBBBQIQQ")
"""magic, version, codec, bits, stage, round, sender, layout digest, body length (wire.py)."""
CRC = struct.Struct("<I")
HEADER_BYTES = HEADER_FIELDS.size + CRC.size
HANDSHAKE_BYTES = 32
"""The settings digest every cluster sends before its first reduction (and after a resume)."""


def quantized_bytes(numel: int, bits: int, block: int) -> int:
    """S(n): fp32 when ``bits`` is 32, else blockwise: the padded blocks' codes plus one fp32
    scale per block."""
    if bits == 32:
        return 4 * numel
    return math.ceil(numel / block) * (block * bits // 8 + 4)


def lowrank_shape(shape: Sequence[int], rank: int) -> tuple[int, int, int] | None:
    """(m, n, r) of a tensor sent as rank-r factors, viewed as (shape[0], rest); None where it
    is sent dense (fewer than 2 dims, or factors no smaller than the matrix)."""
    if len(shape) < 2 or not shape[0]:
        return None
    m = shape[0]
    n = math.prod(shape) // m
    r = min(rank, m, n)
    return (m, n, r) if (m + n) * r < m * n else None


# -- top-k (layout in outer/compression/topk.py) ----------------------------------------------

def kept(length: int, density: float) -> int:
    """k(L): entries a chunk of ``length`` elements keeps."""
    return max(1, round(density * length))


def low_width(length: int, density: float) -> int:
    """b(L): the low bits of each position stored as they are in the Elias-Fano code,
    ``floor(log2(L / k))`` (0 when ``k >= L / 2``)."""
    return max(0, (length // kept(length, density)).bit_length() - 1)


def elias_fano_bits(length: int, density: float) -> int:
    """Bits of one chunk's Elias-Fano code: ``k b`` low bits and a bit vector of
    ``k + ((L - 1) >> b) + 1`` bits marking the high parts (about ``b + 2`` bits per position)."""
    k, b = kept(length, density), low_width(length, density)
    return k * b + k + ((length - 1) >> b) + 1


def position_bits(length: int, density: float) -> int:
    """P(L): bits of one chunk's positions, Elias-Fano or a bitmap of the chunk, whichever is smaller."""
    return min(elias_fano_bits(length, density), length)


def topk_sections(numel: int, chunk: int) -> list[tuple[int, int]]:
    """(chunks, length) of the full chunks and of the short last one, where there are any."""
    full, tail = divmod(numel, chunk)
    return [(r, n) for r, n in ((full, chunk), (1 if tail else 0, tail)) if r]


def topk_section_bytes(rows: int, length: int, density: float, bits: int) -> tuple[int, int, int]:
    """Bytes of a section's positions, codes and scales."""
    k = kept(length, density)
    return math.ceil(rows * position_bits(length, density) / 8), math.ceil(rows * k * bits / 8), 4 * rows


def topk_bytes(numel: int, chunk: int, density: float, bits: int) -> int:
    """T(n): top-k body bytes of ``numel`` elements."""
    return sum(sum(topk_section_bytes(r, n, density, bits)) for r, n in topk_sections(numel, chunk))


def codec_bytes(shapes: Sequence[Sequence[int]], config: CompressionConfig) -> int:
    """Bytes one rank sends per round for a shard of ``shapes`` (no handshake)."""
    numel = sum(math.prod(s) for s in shapes)
    codec = config.codec
    if codec == "none":
        return 4 * numel
    if codec == "topk":
        return HEADER_BYTES + topk_bytes(numel, config.topk_chunk, config.topk_density, config.bits)
    bits = config.bits if codec in QUANT_BITS else 32
    if codec == "quantize":
        return HEADER_BYTES + sum(quantized_bytes(math.prod(s), bits, config.block) for s in shapes)
    p = q = dense = 0
    for s in shapes:
        low = lowrank_shape(s, config.rank)
        if low:
            m, n, r = low
            p += quantized_bytes(m * r, bits, config.block)
            q += quantized_bytes(n * r, bits, config.block)
        else:
            dense += quantized_bytes(math.prod(s), bits, config.block)
    return 2 * HEADER_BYTES + p + dense + q
