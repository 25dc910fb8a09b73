"""Blockwise absmax quantization of a flat fp32 tensor to int8 or int4.

The tensor is cut into blocks of ``block`` elements (the last one zero-padded). Each block stores
its absolute maximum ``s`` as an fp32 scale and every element as a signed integer code
``q = round(x / s * qmax)`` with ``qmax = 2**(bits - 1) - 1`` (127 or 7; the code range is
symmetric, so ``-qmax..qmax``). Decoding gives ``(q / qmax) * s``.

Why these choices:

* **Round to nearest** (half to even): the error per element is at most half a step,
  ``s / (2 * qmax)``, plus fp32 rounding.
* **fp32 scales**: the scale is the block's absmax itself, stored exactly. fp16 would overflow
  above 65504 and flush block maxima below ~6e-8 (pseudo-gradient entries of a late, low-lr round
  are that small) to zero; bf16 keeps the range but rounds the absmax by up to 0.4%, which then
  clips the block maximum. The cost is 4 bytes a block: 1.6% of an int8 block of 256, 3.1% of
  an int4 one.
* **No inf/NaN from finite input**: ``x / s`` lies in [-1, 1] and cannot overflow (``qmax / s``
  would, for denormal ``s``); decoding multiplies a level in [-1, 1] by ``s``, so the result never
  exceeds the block's absmax (``q * s / qmax`` could overflow near the fp32 maximum). A block with
  a NaN or inf decodes to non-finite values (its scale is NaN/inf), so a bad pseudo-gradient stays
  visible to the caller's finiteness check.
* **Decoding is portable**: ``(q / qmax) * s`` is one true division and one multiply, each
  exactly rounded, so every device decodes the same bytes to the same bits. The divisor is a
  tensor on the data's device: PyTorch's CUDA kernels turn a division by a Python (CPU) scalar
  into a multiply by its reciprocal, which can differ in the last bit.
* **int4 packing**: codes are stored as ``q + 8`` (1..15) in a nibble, two per byte, the even
  element in the low nibble.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_dilocox.config import QUANT_BITS

BITS = QUANT_BITS["quantize"]


def qmax(bits: int) -> int:
    """Largest code magnitude for ``bits``: 127 for int8, 7 for int4."""
    return 2 ** (bits - 1) - 1


def check_args(bits: int, block: int) -> None:
    """Raises ValueError unless ``bits`` is 4 or 8 and ``block`` a positive even number."""
    if bits not in BITS:
        raise ValueError(f"quantization bits must be 4 or 8, got {bits}")
    if block < 2 or block % 2:
        raise ValueError(f"quantization block must be a positive even number, got {block}")


@dataclass(frozen=True)
class QuantizedTensor:
    """A quantized 1-D fp32 tensor.

    Attributes:
        codes: uint8, ``blocks * block * bits / 8`` bytes: int8 codes as two's complement bytes,
            or int4 codes ``q + 8`` packed two per byte.
        scales: fp32, one per block: the block's absmax.
        numel: length of the original tensor (the padding is dropped on decode).
        bits: 8 or 4.
        block: elements per scale.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    numel: int
    bits: int
    block: int

    @property
    def nbytes(self) -> int:
        """Bytes of codes plus scales."""
        return self.codes.numel() + 4 * self.scales.numel()


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Packs int4 codes in [-8, 7] (an even number of them) into uint8, two per byte."""
    assert q.numel() % 2 == 0
    nib = (q.to(torch.int16) + 8).to(torch.uint8).reshape(-1, 2)
    return nib[:, 0] | (nib[:, 1] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: int8 codes, twice as many as bytes."""
    lo = (packed & 0x0F).to(torch.int8) - 8
    hi = (packed >> 4).to(torch.int8) - 8
    return torch.stack([lo, hi], dim=1).reshape(-1)


def quantize(x: torch.Tensor, bits: int = 8, block: int = 256) -> QuantizedTensor:
    """Quantizes a 1-D fp32 tensor blockwise (see the module docstring).

    Args:
        x: 1-D fp32 tensor of any length (also 0).
        bits: 8 or 4.
        block: elements per scale, a positive even number.

    Returns:
        The codes and scales, on ``x``'s device.
    """
    check_args(bits, block)
    if x.dim() != 1 or x.dtype != torch.float32:
        raise ValueError(f"quantize needs a 1-D fp32 tensor, got {x.dtype} of shape {tuple(x.shape)}")
    n = x.numel()
    blocks = math.ceil(n / block)
    padded = (x if n == blocks * block else torch.nn.functional.pad(x, (0, blocks * block - n))).view(blocks, block)
    scales = padded.abs().amax(dim=1)  # NaN propagates into the scale
    # Zero blocks divide by 1 (and stay 0); NaN/inf blocks are carried by their scale alone.
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.div(padded, safe[:, None]).mul_(qmax(bits)).round_().nan_to_num_(0.0)
    q = q.clamp_(-qmax(bits), qmax(bits)).to(torch.int8).reshape(-1)
    codes = q.view(torch.uint8) if bits == 8 else pack_int4(q)
    return QuantizedTensor(codes, scales, n, bits, block)


def dequantize(q: QuantizedTensor) -> torch.Tensor:
    """Decodes :func:`quantize` output back to a 1-D fp32 tensor of ``q.numel`` elements."""
    codes = q.codes.view(torch.int8) if q.bits == 8 else unpack_int4(q.codes)
    divisor = torch.tensor(float(qmax(q.bits)), device=codes.device)
    values = codes.float().div_(divisor).view(-1, q.block).mul_(q.scales[:, None])
    return values.reshape(-1)[: q.numel]
