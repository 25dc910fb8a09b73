"""Bytes of the final flush, written from the format (not from the code's own formulas)."""
import math

from megatron_dilocox.payload import HANDSHAKE_BYTES, HEADER_BYTES


def int8_flush_bytes(numels, block=256):
    """One cluster's flush of its residual: per tensor, its blocks' int8 codes (the last block
    zero-padded) and one fp32 scale each; one header; the flush's own settings handshake."""
    blocks = [math.ceil(n / block) for n in numels if n]
    return sum(b * block + 4 * b for b in blocks) + HEADER_BYTES + HANDSHAKE_BYTES
