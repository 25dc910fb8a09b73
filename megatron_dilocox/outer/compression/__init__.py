"""Pseudo-gradient compression for the DiLoCoX outer loop (docs/compression.md), plain torch.

* :class:`CompressedReducer` - the ``OuterSync`` reducer hook: codecs ``none``, ``quantize``,
  ``lowrank``, ``lowrank-quantize``, ``topk``; error feedback; adaptive rank; bit-identical results.
* :mod:`.quantize` - blockwise absmax int8/int4 with fp32 scales.
* :mod:`.topk` - chunked top-k sparsification with 2-4 bit values (after SparseLoCo).
* :mod:`.lowrank` - PowerSGD steps that agree bit for bit on every device; adaptive rank rule.
* :mod:`.wire` - payload header and crc32 checksum.
"""
from megatron_dilocox.outer.compression.reducer import CODECS, CompressedReducer

# quantize()/dequantize() live in the .quantize submodule (not re-exported: the package
# attribute ``quantize`` must stay the module).
__all__ = ["CODECS", "CompressedReducer"]
