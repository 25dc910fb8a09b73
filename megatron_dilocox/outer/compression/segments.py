"""Encodes a list of fp32 tensors (the parts of one payload) into one byte body, and back.

``bits=32`` stores the raw fp32 bytes. ``bits=8|4`` quantizes each part on its own (padded to
whole blocks, so no block mixes two tensors of different magnitude) and stores all codes, then
all scales. The body size depends only on the parts' sizes, ``bits`` and ``block``, so every rank
knows it in advance.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from megatron_dilocox.outer.compression import quantize as qz
from megatron_dilocox.payload import quantized_bytes


class SegmentCodec:
    """Fixed layout of parts of ``numels`` elements, encoded with ``bits`` (32, 8 or 4).

    Args:
        numels: element count of each part, in payload order.
        bits: 32 (raw fp32), 8 or 4 (blockwise quantized).
        block: elements per quantization scale (ignored for 32).
    """

    def __init__(self, numels: Sequence[int], bits: int, block: int):
        if bits != 32:
            qz.check_args(bits, block)
        self.numels = [int(n) for n in numels]
        self.bits, self.block = bits, block
        self.numel = sum(self.numels)
        self.layout = (self.numels, bits, block, "fp32")
        """What the payload header's layout digest covers."""
        self.nbytes = sum(quantized_bytes(n, bits, block) for n in self.numels)
        if bits != 32:
            # Each part starts on a block boundary of the padded stream.
            self.padded = [math.ceil(n / block) * block for n in self.numels]
            self.blocks = sum(self.padded) // block
            self.code_bytes = self.blocks * block * bits // 8

    def encode(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """Body bytes (uint8, on the parts' device) of fp32 ``parts`` with this layout."""
        assert [p.numel() for p in parts] == self.numels, "parts do not match the layout"
        flat = [p.reshape(-1) for p in parts]
        if not flat:
            return torch.empty(0, dtype=torch.uint8)
        if self.bits == 32:
            return torch.cat(flat).view(torch.uint8)
        stream = flat[0].new_zeros(sum(self.padded))
        offset = 0
        for p, size in zip(flat, self.padded):
            stream[offset: offset + p.numel()] = p
            offset += size
        q = qz.quantize(stream, self.bits, self.block)
        return torch.cat([q.codes, q.scales.view(torch.uint8)])

    def decode(self, body: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`encode`: the parts concatenated, one flat fp32 tensor."""
        assert body.numel() == self.nbytes, "body size does not match the layout"
        if self.bits == 32:
            return body.clone().view(torch.float32)  # clone: a fresh, aligned storage
        scales = body[self.code_bytes:].clone().view(torch.float32)
        stream = qz.dequantize(qz.QuantizedTensor(
            body[: self.code_bytes], scales, self.blocks * self.block, self.bits, self.block
        ))
        if all(n == size for n, size in zip(self.numels, self.padded)):
            return stream
        parts, offset = [], 0
        for n, size in zip(self.numels, self.padded):
            parts.append(stream[offset: offset + n])
            offset += size
        return torch.cat(parts)
