"""Built-in delta codecs (registered through the ``zerokld`` hooks; looked up by their ``compression_format`` name).

``arc_v2``: the XOR of the raw bytes of the base and the new tensor, zstd-compressed (level 1). Public reference:
Fireworks' hot-load format and its decoder on PyPI (``fireworks-delta-compression``). The interoperable default.

``zkd_sparse_v1``: ours, denser — changed 16-bit words as byte-shuffled position gaps + XOR values in a zstd'd
safetensors container (below).

``zkd_sparse_v2``: ours, densest and fastest — changed 16-bit words as byte-shuffled position gaps + zigzag-coded
integer differences (an optimizer step moves a bf16 weight by a few units in the last place: its difference is a
small integer where the XOR of a carry is not), each stream its own zstd frame (below).
"""

from __future__ import annotations

import numpy as np
import zstandard

__all__ = [
    "SPARSE_NAME",
    "SPARSE_V2_NAME",
    "arc_v2_decode",
    "arc_v2_encode",
    "bounded_decompress",
    "sparse_decode",
    "sparse_encode",
    "sparse_v2_decode",
    "sparse_v2_encode",
    "xor_bytes",
]


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
    if idx.size and idx[-1] >= 2**32:
        raise ValueError(f"{SPARSE_NAME}: tensors over 2^32 words are not supported")
    gaps = np.diff(idx, prepend=-1).astype(np.uint32) - np.uint32(1)
    container = save(
        {"gaps": torch.from_numpy(_planes(gaps)), "xor": torch.from_numpy(_planes(words[idx]))},
        metadata={"codec": SPARSE_NAME, "bytes": str(x.size), "word": str(words.itemsize), "changed": str(idx.size)},
    )
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
    meta = json.loads(raw[8 : 8 + header_len]).get("__metadata__") or {}
    if meta.get("codec") != SPARSE_NAME or int(meta.get("bytes", -1)) != len(base):
        raise ValueError(
            f"{SPARSE_NAME}: payload is for {meta.get('bytes')} bytes of codec {meta.get('codec')!r}, "
            f"base tensor has {len(base)} bytes"
        )
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


# --- zkd_sparse_v2 ------------------------------------------------------------------------------------------------
# Words as in v1 (16-bit for even byte lengths, else bytes). The changed words' positions are gaps (uint32, byte
# planes) as in v1; their values are the wrapping integer difference new - base of the words, zigzag-coded
# ((d << 1) ^ (d >> 15): small magnitudes of either sign become small unsigned numbers), byte planes. Each stream is
# its own zstd frame (level 1: the streams are small; separate frames let zstd build one entropy table per byte
# plane statistics instead of one for the mixture). Container: a safetensors file (numpy, never pickle) holding the
# two frames as uint8 arrays, metadata {"codec", "bytes", "word", "changed"}. Small (< 1 MiB) or dense (> 25%
# changed) tensors may be stored as the plain zstd'd XOR stream (payload mode byte 0, shared with v1).

SPARSE_V2_NAME = "zkd_sparse_v2"
_SPARSE_V2 = b"\x02"


def _words(buf: bytes | memoryview | np.ndarray) -> np.ndarray:
    b = np.frombuffer(buf, dtype=np.uint8)
    return b.view(np.uint16) if b.size % 2 == 0 else b


def sparse_v2_encode(base: bytes, new: bytes) -> bytes:
    """Encode ``new`` against ``base`` (equal lengths; any bytes-like) as changed-word positions + zigzag integer
    differences (see above).

    Raises:
        ValueError: lengths differ, or a tensor of 2^32 words or more.
    """
    from safetensors.numpy import save

    if len(base) != len(new):
        raise ValueError(f"length mismatch: {len(base)} vs {len(new)} bytes")
    a, b = _words(base), _words(new)
    idx = np.flatnonzero(a != b)
    if idx.size and idx[-1] >= 2**32:
        raise ValueError(f"{SPARSE_V2_NAME}: tensors over 2^32 words are not supported")
    if a.nbytes < (1 << 20) or idx.size * 4 > a.size:  # small or dense: the plain XOR stream may be smaller
        dense = _DENSE + zstandard.ZstdCompressor(level=1).compress(np.bitwise_xor(a, b).tobytes())
        if idx.size * 4 > a.size:
            return dense
    else:
        dense = None
    gaps = (np.diff(idx, prepend=-1) - 1).astype(np.uint32)
    signed = np.int16 if a.itemsize == 2 else np.int8
    d = (b[idx] - a[idx]).view(signed)  # wraps modulo 2^bits
    zz = ((d << 1) ^ (d >> (8 * a.itemsize - 1))).view(a.dtype)
    zc = zstandard.ZstdCompressor(level=1)
    sparse = _SPARSE_V2 + save(
        {
            "gaps": np.frombuffer(zc.compress(_planes(gaps).tobytes()), dtype=np.uint8),
            "diff": np.frombuffer(zc.compress(_planes(zz).tobytes()), dtype=np.uint8),
        },
        metadata={"codec": SPARSE_V2_NAME, "bytes": str(a.nbytes), "word": str(a.itemsize), "changed": str(idx.size)},
    )
    return dense if dense is not None and len(dense) < len(sparse) else sparse


def sparse_v2_decode(base: bytes, payload: bytes) -> bytes | memoryview:
    """Inverse of :func:`sparse_v2_encode`: the new bytes as a read-write ``memoryview`` (bytes-like; no extra copy
    of the tensor); ``base`` any bytes-like (not modified).

    Raises:
        ValueError: not this codec's payload, a length or word count that differs from the base's, streams of the
            wrong size, or out-of-range positions (checked before anything is written).
        zstandard.ZstdError: a stream is not valid zstd.
    """
    from safetensors.numpy import load

    payload = bytes(payload)
    mode, body = payload[:1], payload[1:]
    if mode == _DENSE:
        return sparse_decode(base, payload)
    if mode != _SPARSE_V2:
        raise ValueError(f"{SPARSE_V2_NAME}: unknown payload mode {mode!r}")
    try:
        arrays = load(body)
        import json
        import struct

        meta = json.loads(body[8 : 8 + struct.unpack("<Q", body[:8])[0]]).get("__metadata__") or {}
    except ValueError:
        raise
    except Exception as e:  # a container safetensors cannot read
        raise ValueError(f"{SPARSE_V2_NAME}: unreadable container ({e})") from e
    a = _words(base)
    if (
        meta.get("codec") != SPARSE_V2_NAME
        or meta.get("bytes") != str(a.nbytes)
        or meta.get("word") != str(a.itemsize)
        or set(arrays) != {"gaps", "diff"}
    ):
        raise ValueError(
            f"{SPARSE_V2_NAME}: payload is for {meta.get('bytes')} bytes of codec {meta.get('codec')!r}, "
            f"base tensor has {a.nbytes} bytes"
        )
    n = int(meta.get("changed", -1))
    if not 0 <= n <= a.size:
        raise ValueError(f"{SPARSE_V2_NAME}: changed-word count {n} out of range")
    gaps = np.frombuffer(bounded_decompress(arrays["gaps"].tobytes(), 4 * n), dtype=np.uint8)
    zz = np.frombuffer(bounded_decompress(arrays["diff"].tobytes(), a.itemsize * n), dtype=np.uint8)
    idx = np.cumsum(_unplanes(gaps, np.uint32, n).astype(np.int64) + 1) - 1
    if n and idx[-1] >= a.size:
        raise ValueError(f"{SPARSE_V2_NAME}: changed-word position out of range")
    z = _unplanes(zz, a.dtype, n)
    d = (z >> 1) ^ (0 - (z & 1)).astype(a.dtype)  # zigzag back to the wrapping difference
    out = a.copy()
    out[idx] += d
    return memoryview(out.view(np.uint8))
