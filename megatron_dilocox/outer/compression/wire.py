"""Wire format of one compressed payload: a fixed 40-byte header, then the body.

Header (little-endian)::

    magic  4s  b"DLCX"
    version B  1
    codec  B   CODECS index
    bits   B   32 (raw fp32), 8 or 4; topk 2, 3 or 4
    stage  B   STAGES index: which exchange of the round this is
    round  Q   outer round number (1 at the first reduction)
    sender I   rank of the sender in the outer group, i.e. its cluster index
    layout Q   digest of what the body holds (tensor sizes, ranks, block, dtype; topk chunk, density)
    length Q   body bytes
    crc32  I   zlib.crc32 of the header bytes above and the body

:func:`unframe` checks all of it and raises ``ValueError`` naming the round and the sending
cluster; a payload that fails is never decoded. crc32 detects every burst error up to 32 bits
and any random corruption with probability 1 - 2**-32; it guards against corruption, not against
a malicious peer.
"""
from __future__ import annotations

import hashlib
import sys
import zlib
from dataclasses import dataclass

import torch

from megatron_dilocox.config import CODECS  # their order gives the wire numbers: append, never reorder
from megatron_dilocox.payload import CRC as _CRC
from megatron_dilocox.payload import HEADER_BYTES
from megatron_dilocox.payload import HEADER_FIELDS as _FIELDS
STAGES = ("dense", "P", "Q")
MAGIC, VERSION = b"DLCX", 1

if sys.byteorder != "little":  # bodies are native tensor bytes
    raise ImportError("megatron_dilocox.outer.compression supports little-endian machines only")


@dataclass(frozen=True)
class Header:
    """What a payload claims to be (see the module docstring for the fields)."""

    codec: str
    bits: int
    stage: str
    round: int
    sender: int
    layout: int
    length: int


def layout_digest(*parts) -> int:
    """64-bit digest of the ``repr`` of ``parts`` (sizes, ranks, block...), for the header."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")


def _fields(h: Header) -> bytes:
    return _FIELDS.pack(MAGIC, VERSION, CODECS.index(h.codec), h.bits, STAGES.index(h.stage),
                        h.round, h.sender, h.layout, h.length)


def frame(body: torch.Tensor, header: Header) -> torch.Tensor:
    """Header + ``body`` as one CPU uint8 tensor; ``header.length`` must equal the body size."""
    body = body.detach().to("cpu", torch.uint8).contiguous()
    assert header.length == body.numel(), "header length does not match the body"
    head = _fields(header)
    crc = zlib.crc32(body.numpy(), zlib.crc32(head))
    out = torch.empty(HEADER_BYTES + body.numel(), dtype=torch.uint8)
    out[:HEADER_BYTES] = torch.frombuffer(bytearray(head + _CRC.pack(crc)), dtype=torch.uint8)
    out[HEADER_BYTES:] = body
    return out


def unframe(buf: torch.Tensor, expect: Header) -> torch.Tensor:
    """Verifies a received payload against what this rank expects and returns its body.

    Args:
        buf: the received bytes (CPU uint8).
        expect: the header the sender should have written (same round, codec, layout...;
            ``sender`` is the cluster whose slot ``buf`` came from).

    Raises:
        ValueError: naming the round and the cluster, if the payload is truncated, is not a
            DiLoCoX payload, fails its checksum, or was encoded for something else.
    """
    where = f"outer round {expect.round}: payload from cluster {expect.sender}"
    raw = memoryview(buf.contiguous().numpy())  # no copy
    if len(raw) < HEADER_BYTES:
        raise ValueError(f"{where} is truncated ({len(raw)} bytes, the header alone is {HEADER_BYTES})")
    magic, version, codec, bits, stage, rnd, sender, layout, length = _FIELDS.unpack_from(raw)
    if magic != MAGIC or version != VERSION:
        raise ValueError(f"{where} is not a DiLoCoX v{VERSION} payload (magic {magic!r}, version {version})")
    if HEADER_BYTES + length != len(raw):
        raise ValueError(f"{where} has {len(raw) - HEADER_BYTES} body bytes, its header says {length}")
    (crc,) = _CRC.unpack_from(raw, _FIELDS.size)
    actual = zlib.crc32(raw[HEADER_BYTES:], zlib.crc32(raw[: _FIELDS.size]))
    if crc != actual:
        raise ValueError(f"{where} failed its checksum (crc32 {actual:#010x}, header says {crc:#010x}); "
                         "refusing to apply it")
    got = Header(CODECS[codec] if codec < len(CODECS) else f"#{codec}", bits,
                 STAGES[stage] if stage < len(STAGES) else f"#{stage}", rnd, sender, layout, length)
    if got != expect:
        diff = ", ".join(f"{k} {getattr(got, k)!r} (expected {getattr(expect, k)!r})"
                         for k in Header.__dataclass_fields__ if getattr(got, k) != getattr(expect, k))
        raise ValueError(f"{where} does not match this rank's round: {diff}; do all clusters run the "
                         "same compression settings from the same checkpoint?")
    return buf[HEADER_BYTES:]
