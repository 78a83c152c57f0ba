"""Built-in delta codecs (registered through the ``zerokld`` hooks; looked up by their ``compression_format`` name).

``arc_v2``: the XOR of the raw bytes of the base and the new tensor, zstd-compressed (level 1). Public reference:
Fireworks' hot-load format and its decoder on PyPI (``fireworks-delta-compression``).
"""
from __future__ import annotations

import numpy as np
import zstandard

__all__ = ["arc_v2_decode", "arc_v2_encode", "xor_bytes"]


def xor_bytes(a: bytes | memoryview, b: bytes | memoryview) -> bytes:
    """Bytewise XOR of two equal-length buffers.

    Raises:
        ValueError: lengths differ.
    """
    if len(a) != len(b):
        raise ValueError(f"length mismatch: {len(a)} vs {len(b)} bytes")
    return np.bitwise_xor(np.frombuffer(a, dtype=np.uint8), np.frombuffer(b, dtype=np.uint8)).tobytes()


def arc_v2_encode(base: bytes, new: bytes) -> bytes:
    """``zstd(base XOR new)``."""
    return zstandard.ZstdCompressor(level=1).compress(xor_bytes(base, new))


def arc_v2_decode(base: bytes, payload: bytes) -> bytes:
    """``base XOR unzstd(payload)``.

    Raises:
        ValueError: the decompressed length differs from the base's (wrong base or corrupt payload).
        zstandard.ZstdError: the payload is not valid zstd.
    """
    x = zstandard.ZstdDecompressor().decompress(payload, max_output_size=len(base) + 1)
    if len(x) != len(base):
        raise ValueError(f"delta decodes to {len(x)} bytes, base tensor has {len(base)}")
    return xor_bytes(base, x)
