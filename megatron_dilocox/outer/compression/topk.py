"""Chunked top-k sparsification with low-bit values, for one flat fp32 buffer (after SparseLoCo).

The buffer of ``n`` elements is cut into chunks of ``chunk`` elements (the last one may be
short). A chunk of ``L`` elements keeps its ``k(L) = max(1, round(density * L))`` largest
magnitudes (Python's ``round``, half to even); every other entry decodes to exactly 0 (under
error feedback the caller keeps it whole in its residual).

**Body.** The full chunks form one section and a short last chunk a second one; a section of
``r`` chunks of ``L`` elements stores, each part padded to whole bytes:

* positions, ``ceil(r * P(L) / 8)`` bytes: the kept entries' indices within their chunk,
  ascending, in the Elias-Fano code, or, where that is larger, a bitmap of the ``L`` entries
  (:func:`~megatron_dilocox.payload.position_bits`). Elias-Fano with ``b = floor(log2(L / k))``:
  each index's low ``b`` bits as they are (``k b`` bits), then a bit vector of
  ``k + ((L - 1) >> b) + 1`` bits with bit ``(p_i >> b) + i`` set for the ``i``-th index ``p_i``.
  Its size depends only on ``L`` and ``k``, at most about ``b + 2`` bits per index (8 at 1/64 of
  4096, against 12 for plain indices), near the ``log2 C(L, k) / k`` (7.4) that any code of
  ``k`` positions among ``L`` needs;
* codes, ``ceil(r * k(L) * bits / 8)`` bytes, in the order of the positions;
* scales, ``4 r`` bytes: each chunk's absmax, fp32.

All bit fields are packed least significant bit first. So :func:`~megatron_dilocox.payload.topk_bytes` is
``sum over sections of ceil(r P(L) / 8) + ceil(r k(L) bits / 8) + 4 r``, fixed by the layout:
every rank knows every payload's size in advance (variable-length codes of the gaps would save
at most the last bit per index, and not at a fixed size).

**Selection is deterministic**: a chunk keeps every entry above its k-th largest magnitude and
fills up with the lowest-indexed entries equal to it, so every device picks the same entries.
NaN counts as the largest magnitude, so a non-finite chunk keeps its NaN/inf entries and, with
its non-finite scale, decodes to non-finite values the caller's finiteness check sees.

**Values** (``bits`` 2, 3 or 4, ``M = 2**bits`` codes): code ``c = floor((v / s + 1) M / 2)``
(clamped to ``M - 1``), decoded to ``(2 c + 1 - M) / M * s``, with ``s`` the chunk's absmax
(fp32, exact): ``M`` uniform bins over ``[-s, s]``, each decoded to its centre. So the error is
at most ``s / M`` and the decoded magnitude below ``s``. Why this grid: there is no level 0, which
kept entries (the chunk's largest) rarely need, so all ``M`` codes are levels; a grid with 0
and ``±s`` as levels (``quantize.py``'s) has at 2 bits only ``0, ±s``, and one anchored at ``±s``
(``±s/3, ±s``) is coarser: keeping 64 of 4096 entries of Gaussian, Laplace and Student-t(3)
noise at 2 bits, the kept values' relative error was 0.14 / 0.31 / 0.55 with this grid against
0.36 / 0.36 / 0.79 with that one. A grid
over ``[k-th magnitude, s]`` would be finer (0.08 on the Gaussian) but needs a second number per
chunk. The price: a kept exact zero (in a chunk with fewer than ``k`` nonzero entries) decodes
to ``s / M``, which error feedback takes back in the next round. Decoding is one exact
division by a power of two and one multiply: the same bits on every device.
"""
from __future__ import annotations

import math

import torch

from megatron_dilocox.config import QUANT_BITS
from megatron_dilocox.payload import elias_fano_bits, kept, low_width, topk_bytes, topk_section_bytes, topk_sections

BITS = QUANT_BITS["topk"]


def check_args(chunk: int, density: float, bits: int) -> None:
    """Raises ValueError unless ``chunk >= 2``, ``density`` in (0, 1] and ``bits`` in 2..4."""
    if chunk < 2:
        raise ValueError(f"top-k chunk must be >= 2, got {chunk}")
    if not 0 < density <= 1:
        raise ValueError(f"top-k density must be in (0, 1], got {density}")
    if bits not in BITS:
        raise ValueError(f"top-k bits must be 2, 3 or 4, got {bits}")


def _bitmap(length: int, density: float) -> bool:
    """Whether a chunk's positions are a bitmap (no larger than their Elias-Fano code)."""
    return length <= elias_fano_bits(length, density)


def _elias_fano(cols: torch.Tensor, length: int, density: float) -> torch.Tensor:
    """The bits (one int64 0/1 per bit, ``(r, P)``) of each row's ascending positions ``cols``."""
    r, k = cols.shape
    b = low_width(length, density)
    low = (cols.unsqueeze(2) >> torch.arange(b, device=cols.device)) & 1
    high = torch.zeros(r, k + ((length - 1) >> b) + 1, dtype=torch.int64, device=cols.device)
    high.scatter_(1, (cols >> b) + torch.arange(k, device=cols.device), 1)
    return torch.cat([low.reshape(r, k * b), high], dim=1)


def _elias_fano_positions(bits: torch.Tensor, length: int, density: float) -> torch.Tensor:
    """Inverse of :func:`_elias_fano`: the ``(r, k)`` positions from the ``(r, P)`` bits."""
    r = bits.shape[0]
    k, b = kept(length, density), low_width(length, density)
    low = (bits[:, : k * b].view(r, k, b) << torch.arange(b, device=bits.device)).sum(2)
    high = bits[:, k * b:].nonzero()[:, 1].view(r, k) - torch.arange(k, device=bits.device)
    return (high << b) | low


def _pack(values: torch.Tensor, width: int) -> torch.Tensor:
    """Non-negative integers below ``2**width`` as a bit stream, LSB first, padded to bytes."""
    bits = ((values.reshape(-1, 1) >> torch.arange(width, device=values.device)) & 1).reshape(-1)
    bits = torch.nn.functional.pad(bits, (0, -bits.numel() % 8)).view(-1, 8)
    return (bits << torch.arange(8, device=values.device)).sum(1).to(torch.uint8)


def _unpack(data: torch.Tensor, count: int, width: int) -> torch.Tensor:
    """Inverse of :func:`_pack`: ``count`` int64 values of ``width`` bits."""
    bits = (data.reshape(-1, 1) >> torch.arange(8, dtype=torch.uint8, device=data.device)) & 1
    bits = bits.reshape(-1)[: count * width].view(count, width).long()
    return (bits << torch.arange(width, device=data.device)).sum(1)


def _grid_codes(rows: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes of the rows' values on the grid of ``2**bits`` bin centres over ``[-s, s]`` (the
    module docstring), ``scale`` holding each row's ``s``; values beyond ``s`` clamp to the end
    bins, a row with ``s = 0`` codes its bins next to 0."""
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    levels = 2**bits
    codes = torch.div(rows, safe[:, None]).add_(1).mul_(levels // 2).floor_()
    return codes.nan_to_num_(0.0).clamp_(0, levels - 1).long()


def _grid_values(codes: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`_grid_codes`: fp32 ``(2 c + 1 - M) / M * s``, ``scales`` the rows' ``s``
    as the fp32 bytes the body carries. The same bits on every device."""
    levels = 2**bits
    # 2c + 1 - M and the division by the power of two M are exact; one rounding, the multiply.
    values = codes.mul(2).add(1 - levels).float().div_(levels)
    return values.mul_(scales.clone().view(torch.float32)[:, None])  # clone: an aligned storage


def _encode_section(rows: torch.Tensor, density: float, bits: int) -> list[torch.Tensor]:
    """Positions, codes and scales of the chunks ``rows`` (one chunk a row)."""
    length = rows.shape[1]
    k = kept(length, density)
    mag = rows.abs().nan_to_num_(nan=math.inf, posinf=math.inf)
    # Non-negative floats order as their int32 bit patterns, and an integer top-k is about 1.5x
    # faster on a CPU: the same k-th magnitude, exactly.
    kth = mag.view(torch.int32).topk(k, dim=1, sorted=False).values.amin(1, keepdim=True).view(torch.float32)
    keep = mag >= kth
    found = keep.nonzero()
    if found.shape[0] > keep.shape[0] * k:  # ties at the k-th magnitude: the lowest indices win
        crowded = keep.sum(1) > k
        sub, edge = mag[crowded], kth[crowded]
        above, tied = sub > edge, sub == edge
        keep[crowded] = above | (tied & (tied.cumsum(1) <= k - above.sum(1, keepdim=True)))
        found = keep.nonzero()
    cols = found[:, 1].view(-1, k)  # row-major: ascending within each chunk
    scale = mag.amax(1)
    codes = _grid_codes(rows.gather(1, cols), scale, bits)
    if _bitmap(length, density):
        positions = _pack(keep.view(-1).long(), 1)
    else:
        positions = _pack(_elias_fano(cols, length, density), 1)
    return [positions, _pack(codes, bits), scale.view(torch.uint8)]


def encode(x: torch.Tensor, chunk: int, density: float, bits: int) -> torch.Tensor:
    """The body (uint8, on ``x``'s device) of a 1-D fp32 tensor; see the module docstring."""
    check_args(chunk, density, bits)
    parts, offset = [], 0
    for r, n in topk_sections(x.numel(), chunk):
        parts += _encode_section(x[offset: offset + r * n].view(r, n), density, bits)
        offset += r * n
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=x.device)


def decode(body: torch.Tensor, numel: int, chunk: int, density: float, bits: int) -> torch.Tensor:
    """Inverse of :func:`encode`: the flat fp32 tensor of ``numel`` elements, on ``body``'s device."""
    assert body.numel() == topk_bytes(numel, chunk, density, bits), "body size does not match the layout"
    out = torch.zeros(numel, dtype=torch.float32, device=body.device)
    start = offset = 0
    for r, n in topk_sections(numel, chunk):
        k = kept(n, density)
        sizes = topk_section_bytes(r, n, density, bits)
        positions, codes, scales = body[start: start + sum(sizes)].split(sizes)
        start += sum(sizes)
        if _bitmap(n, density):
            cols = _unpack(positions, r * n, 1).view(r, n).nonzero()[:, 1].view(r, k)
        else:
            code = _unpack(positions, r * elias_fano_bits(n, density), 1).view(r, -1)
            cols = _elias_fano_positions(code, n, density)
        values = _grid_values(_unpack(codes, r * k, bits).view(r, k), scales, bits)
        out[offset: offset + r * n].view(r, n).scatter_(1, cols, values)
        offset += r * n
    return out


class TopKCodec:
    """The layout of one top-k payload, with :class:`~.segments.SegmentCodec`'s interface.

    Args:
        numels: element counts of the parts the flat buffer concatenates (chunks cross them).
        bits: 2, 3 or 4.
        chunk: elements per chunk.
        density: fraction of each chunk kept.
    """

    def __init__(self, numels, bits: int, chunk: int, density: float):
        check_args(chunk, density, bits)
        self.numels = [int(n) for n in numels]
        self.numel = sum(self.numels)
        self.bits, self.chunk, self.density = bits, chunk, density
        self.nbytes = topk_bytes(self.numel, chunk, density, bits)
        self.layout = ("topk", self.numel, chunk, density, bits)
        """What the payload header's layout digest covers."""

    def encode(self, parts) -> torch.Tensor:
        """Body bytes of the fp32 ``parts`` (concatenated, then encoded as one buffer)."""
        assert [p.numel() for p in parts] == self.numels, "parts do not match the layout"
        flat = parts[0].reshape(-1) if len(parts) == 1 else torch.cat([p.reshape(-1) for p in parts])
        return encode(flat, self.chunk, self.density, self.bits)

    def decode(self, body: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`encode`: one flat fp32 tensor."""
        return decode(body, self.numel, self.chunk, self.density, self.bits)
