"""Cyclic subsets: each round sends every P-th entry of the flat buffer as low-bit values, no indices.

Round ``t`` (1 at the first) sends the entries ``i`` with ``i mod P == t mod P``, so under error
feedback every entry is sent, with all it gathered since, exactly once every ``P`` rounds, and
the residual never holds more than ``P`` rounds of an entry's pseudo-gradient. Every rank knows
the subset from the round number, so no positions travel: the bytes that top-k spends on
indices (about 86% of its payload at density 1/64) buy values here, ``1 / P`` of the entries
at 2 bits for about the bytes of top-k's 1/64.

**Body.** A round's ``m = ceil(n / P)`` slots (the subset in ascending order; the last slot stays
empty when fewer entries are due) are cut into blocks of ``block`` values, the last one padded
with zeros (``block`` a multiple of 8, so a block's codes fill whole bytes). Each block stores
its codes, ``block * bits / 8`` bytes packed least significant bit first, then its scale ``s``,
fp32. So :func:`nbytes` is ``ceil(m / block) * (block * bits / 8 + 4)``.

**Values** use top-k's grid (``topk.grid_codes``: ``2**bits`` bin centres over ``[-s, s]``, no
level 0) with ``s = min(2 rms, absmax)`` of the block instead of its absmax: these are typical
entries, not a chunk's largest. On Gaussian values at 2 bits that halves the relative squared
error (0.12 against 0.23 over the absmax; Laplace 0.20 against 0.68); what the clamp at ``±s``
cuts off, error feedback sends ``P`` rounds later. The rms is taken of the block divided by its
absmax, so it neither overflows nor underflows in fp32 for any finite input.

**Non-finite input.** An entry that is not due this round would hide a NaN from the caller's
finiteness check, so when any entry of the buffer is non-finite every scale is NaN: the round
decodes non-finite everywhere and is skipped.
"""
from __future__ import annotations

import math

import torch

from megatron_dilocox.config import QUANT_BITS
from megatron_dilocox.outer.compression import bitpack, topk

BITS = QUANT_BITS["cyclic"]
RMS_SPAN = 2.0
"""The grid covers ``[-s, s]`` with ``s = min(RMS_SPAN * rms, absmax)`` of each block."""


def check_args(period: int, bits: int, block: int) -> None:
    """Raises ValueError unless ``period >= 1``, ``bits`` in 1..4 and ``block`` a multiple of 8."""
    if period < 1:
        raise ValueError(f"cyclic period must be >= 1, got {period}")
    if bits not in BITS:
        raise ValueError(f"cyclic bits must be one of {', '.join(map(str, BITS))}, got {bits}")
    if block < 8 or block % 8:
        raise ValueError(f"cyclic block must be a positive multiple of 8, got {block}")


def slots(numel: int, period: int) -> int:
    """m: values one round sends (at most; the slot after the last due entry stays empty)."""
    return math.ceil(numel / period)


def nbytes(numel: int, period: int, bits: int, block: int) -> int:
    """Body bytes of a buffer of ``numel`` elements (the formula in the module docstring)."""
    return math.ceil(slots(numel, period) / block) * (block * bits // 8 + 4)


def offset(round_: int, period: int) -> int:
    """The first entry round ``round_`` sends; it sends every ``period``-th from there."""
    return round_ % period


def encode(x: torch.Tensor, round_: int, period: int, bits: int, block: int) -> torch.Tensor:
    """The body (uint8, on ``x``'s device) of a 1-D fp32 tensor for round ``round_``."""
    check_args(period, bits, block)
    m = slots(x.numel(), period)
    blocks = math.ceil(m / block)
    due = x[offset(round_, period)::period]
    rows = torch.zeros(blocks * block, dtype=torch.float32, device=x.device)
    rows[: due.numel()] = due
    rows = rows.view(blocks, block)
    absmax = rows.abs().amax(1)
    unit = torch.where(absmax > 0, absmax, torch.ones_like(absmax))[:, None]
    rms = torch.div(rows, unit).square_().mean(1).sqrt_().mul_(absmax)
    scale = torch.minimum(rms.mul_(RMS_SPAN), absmax)
    if not bool(torch.isfinite(x).all()):
        scale.fill_(math.nan)
    codes = bitpack.pack(topk.grid_codes(rows, scale, bits), bits).view(blocks, block * bits // 8)
    return torch.cat([codes, scale.view(torch.uint8).view(blocks, 4)], 1).reshape(-1)


def decode(body: torch.Tensor, numel: int, round_: int, period: int, bits: int, block: int) -> torch.Tensor:
    """Inverse of :func:`encode`: the flat fp32 tensor of ``numel`` elements, zero where not due."""
    assert body.numel() == nbytes(numel, period, bits, block), "body size does not match the layout"
    blocks, width = math.ceil(slots(numel, period) / block), block * bits // 8
    rows = body.view(blocks, width + 4)
    codes = bitpack.unpack(rows[:, :width], blocks * block, bits).view(blocks, block)
    values = topk.grid_values(codes, rows[:, width:].reshape(-1), bits).reshape(-1)
    out = torch.zeros(numel, dtype=torch.float32, device=body.device)
    due = out[offset(round_, period)::period]
    due.copy_(values[: due.numel()])
    return out


class CyclicCodec:
    """The layout of one round's cyclic payload, with :class:`~.segments.SegmentCodec`'s interface.

    Args:
        numels: element counts of the parts the flat buffer concatenates (the cycle runs across them).
        bits: 1 to 4.
        period: P, rounds between two sends of one entry.
        block: values per scale.
        round_: the outer round (the subset it sends).
    """

    def __init__(self, numels, bits: int, period: int, block: int, round_: int):
        check_args(period, bits, block)
        self.numels = [int(n) for n in numels]
        self.numel = sum(self.numels)
        self.bits, self.period, self.block, self.round = bits, period, block, round_
        self.nbytes = nbytes(self.numel, period, bits, block)
        self.layout = ("cyclic", self.numel, period, block, bits, offset(round_, period))
        """What the payload header's layout digest covers."""

    def encode(self, parts) -> torch.Tensor:
        """Body bytes of the fp32 ``parts`` (concatenated, then encoded as one buffer)."""
        assert [p.numel() for p in parts] == self.numels, "parts do not match the layout"
        flat = parts[0].reshape(-1) if len(parts) == 1 else torch.cat([p.reshape(-1) for p in parts])
        return encode(flat, self.round, self.period, self.bits, self.block)

    def decode(self, body: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`encode`: one flat fp32 tensor."""
        return decode(body, self.numel, self.round, self.period, self.bits, self.block)
