"""Built-in delta codecs (registered through the ``zerokld`` hooks; looked up by their ``compression_format`` name).

``arc_v2``: the XOR of the raw bytes of the base and the new tensor, zstd-compressed (level 1). Public reference:
Fireworks' hot-load format and its decoder on PyPI (``fireworks-delta-compression``). The interoperable default.

``zkd_sparse_v1``: ours, denser — changed 16-bit words as byte-shuffled position gaps + XOR values in a zstd'd
safetensors container (below).
"""
from __future__ import annotations

import numpy as np
import zstandard

__all__ = ["SPARSE_NAME", "arc_v2_decode", "arc_v2_encode", "bounded_decompress", "sparse_decode", "sparse_encode",
           "xor_bytes"]


def bounded_decompress(payload: bytes, limit: int) -> bytes:
    """Decompress the zstd frame ``payload``, streaming, producing at most ``limit`` bytes.

    ``ZstdDecompressor.decompress(max_output_size=...)`` ignores the limit when the frame header declares its content
    size (it allocates and fills that many bytes: a 32 KB frame declaring 4 GiB of zeros costs 4 GiB of RAM before
    any check). Here the frame is read through ``stream_reader`` in pieces of at most 1 MiB, so memory stays within
    ``limit`` plus one piece whatever the header claims.

    Raises:
        ValueError: the frame decodes to more than ``limit`` bytes.
        zstandard.ZstdError: the payload is not valid zstd (or is truncated).
    """
    out = bytearray()
    with zstandard.ZstdDecompressor().stream_reader(payload, read_across_frames=False) as reader:
        while True:
            piece = reader.read(min(1 << 20, limit + 1 - len(out)) or 1)
            if not piece:
                return bytes(out)
            out += piece
            if len(out) > limit:
                raise ValueError(f"zstd payload decodes to more than {limit} bytes")


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
        ValueError: the decompressed length differs from the base's (wrong base or corrupt payload); decoding stops
            one byte past the base's length (:func:`bounded_decompress`).
        zstandard.ZstdError: the payload is not valid zstd.
    """
    x = bounded_decompress(payload, len(base))
    if len(x) != len(base):
        raise ValueError(f"delta decodes to {len(x)} bytes, base tensor has {len(base)}")
    return xor_bytes(base, x)


# --- zkd_sparse_v1: our denser lossless codec -------------------------------------------------------------------
# The XOR is taken per 16-bit word (bf16/fp16 elements; bytes for odd lengths). Only the changed words are kept:
# their positions as gaps (index differences - 1, uint32) and their XOR values; each array is split into byte planes
# (byte shuffle, as in Blosc/HDF5 shuffle filters) so zstd sees long runs of zero high bytes. The arrays live in a
# safetensors container (never pickle) whose metadata records the codec and the byte length, then the container is
# zstd-compressed. Small (< 1 MiB) or dense (> 25% changed) tensors may instead be stored as the plain zstd'd XOR
# stream when that is smaller; the payload's first byte says which. Decoding checks the length, the word count and
# every index before XOR-ing.

SPARSE_NAME = "zkd_sparse_v1"
_DENSE, _SPARSE = b"\x00", b"\x01"  # payload's first byte: plain zstd'd XOR stream | sparse container


def _planes(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a.view(np.uint8).reshape(-1, a.itemsize).T).reshape(-1)


def _unplanes(p: np.ndarray, dtype, n: int) -> np.ndarray:
    size = np.dtype(dtype).itemsize
    if p.size != n * size:
        raise ValueError(f"{SPARSE_NAME}: plane size {p.size} != {n} x {size}")
    return np.ascontiguousarray(p.reshape(size, n).T).reshape(-1).view(dtype)


def sparse_encode(base: bytes, new: bytes) -> bytes:
    """Encode ``new`` against ``base`` (equal lengths) as changed-word positions + XOR values (see above)."""
    import torch
    from safetensors.torch import save

    x = np.frombuffer(xor_bytes(base, new), dtype=np.uint8)
    words = x.view(np.uint16) if x.size % 2 == 0 else x
    idx = np.flatnonzero(words)
    if idx.size and idx[-1] >= 2 ** 32:
        raise ValueError(f"{SPARSE_NAME}: tensors over 2^32 words are not supported")
    gaps = np.diff(idx, prepend=-1).astype(np.uint32) - np.uint32(1)
    container = save({"gaps": torch.from_numpy(_planes(gaps)), "xor": torch.from_numpy(_planes(words[idx]))},
                     metadata={"codec": SPARSE_NAME, "bytes": str(x.size), "word": str(words.itemsize),
                               "changed": str(idx.size)})
    sparse = _SPARSE + zstandard.ZstdCompressor(level=3).compress(container)
    if x.size < (1 << 20) or idx.size * 4 > words.size:  # small or dense tensor: the plain XOR stream may be smaller
        dense = _DENSE + zstandard.ZstdCompressor(level=1).compress(x.tobytes())
        if len(dense) < len(sparse):
            return dense
    return sparse


def sparse_decode(base: bytes, payload: bytes) -> bytes:
    """Inverse of :func:`sparse_encode`.

    Raises:
        ValueError: not this codec's container, a length that differs from the base's, or out-of-range positions.
        zstandard.ZstdError: the payload is not valid zstd.
    """
    import json
    import struct

    from safetensors.torch import load

    mode, payload = payload[:1], payload[1:]
    if mode == _DENSE:
        x = bounded_decompress(payload, len(base))
        if len(x) != len(base):
            raise ValueError(f"{SPARSE_NAME}: delta decodes to {len(x)} bytes, base tensor has {len(base)}")
        return xor_bytes(base, x)
    if mode != _SPARSE:
        raise ValueError(f"{SPARSE_NAME}: unknown payload mode {mode!r}")
    raw = bounded_decompress(payload, 16 * len(base) + (1 << 20))
    header_len = struct.unpack("<Q", raw[:8])[0]
    meta = json.loads(raw[8: 8 + header_len]).get("__metadata__") or {}
    if meta.get("codec") != SPARSE_NAME or int(meta.get("bytes", -1)) != len(base):
        raise ValueError(f"{SPARSE_NAME}: payload is for {meta.get('bytes')} bytes of codec {meta.get('codec')!r}, "
                         f"base tensor has {len(base)} bytes")
    arrays = load(raw)
    wdtype = np.uint16 if meta["word"] == "2" else np.uint8
    n = int(meta["changed"])
    gaps = _unplanes(arrays["gaps"].numpy(), np.uint32, n).astype(np.int64)
    vals = _unplanes(arrays["xor"].numpy(), wdtype, n)
    idx = np.cumsum(gaps + 1) - 1
    out = np.frombuffer(base, dtype=np.uint8).copy()
    words = out.view(wdtype)
    if n and (idx[-1] >= words.size or idx[0] < 0):
        raise ValueError(f"{SPARSE_NAME}: changed-word position out of range")
    words[idx] ^= vals
    return out.tobytes()
