"""Fixed-width bit fields packed into bytes, least significant bit first (the sparse codecs' layout)."""
from __future__ import annotations

import torch


def pack(values: torch.Tensor, width: int) -> torch.Tensor:
    """Non-negative integers below ``2**width`` as a bit stream, LSB first, padded to bytes."""
    bits = ((values.reshape(-1, 1) >> torch.arange(width, device=values.device)) & 1).reshape(-1)
    bits = torch.nn.functional.pad(bits, (0, -bits.numel() % 8)).view(-1, 8)
    return (bits << torch.arange(8, device=values.device)).sum(1).to(torch.uint8)


def unpack(data: torch.Tensor, count: int, width: int) -> torch.Tensor:
    """Inverse of :func:`pack`: ``count`` int64 values of ``width`` bits."""
    bits = (data.reshape(-1, 1) >> torch.arange(8, dtype=torch.uint8, device=data.device)) & 1
    bits = bits.reshape(-1)[: count * width].view(count, width).long()
    return (bits << torch.arange(width, device=data.device)).sum(1)
