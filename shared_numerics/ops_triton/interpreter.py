"""What the ``triton`` backend needs from Triton's CPU interpreter (``TRITON_INTERPRET=1``) that it lacks.

The interpreter runs kernels with numpy, so it proves the kernels' logic (indexing, masking, reduction order, split
and chunk structure), never the GPU's bits. Two of its gaps stop these kernels from running there at all, or make a
row's result depend on where it sits in a tile; :func:`install` fills them, once, in the interpreting process:

* **bfloat16 operands of** ``tl.dot``. The interpreter stores bfloat16 as its uint16 bit pattern and ``create_dot``
  only converts 8-bit floats, so a bf16 dot multiplies bit patterns (values around 1e10; triton-lang/triton#11584,
  closed upstream as "we just don't support it yet"). The tensor-core kernels feed bf16 straight into ``tl.dot``.
* **Position-dependent dot products.** ``create_dot`` is ``np.matmul``; numpy's float32 GEMM (OpenBLAS) rounds a row
  differently depending on its position in the tile (measured on this machine: 6,800 of 12,800 rows of 64x96 @ 96x32
  products changed when moved to row 0). On a GPU every element of an MMA is computed the same way wherever it sits;
  under the interpreter a query whose tile position differs between the trainer and vLLM (a decode token is row 0 of
  its tile, the same token is row ``pos % tile`` in training) got other bits: the source of the interpreter-only fp32
  mismatches (13/177 tokens). The replacement accumulates each element in float64 with ``np.einsum`` (one fixed order
  per element, whatever its position) and rounds once to the accumulator dtype, then adds the accumulator as before.
* **fp32 -> bf16 casts** truncate in the interpreter (``cast_impl`` passes no rounding mode); GPUs round to nearest
  even (``cvt.rn.bf16.f32``). The replacement rounds to nearest even through torch.

Nothing here runs on a GPU; :func:`install` is a no-op unless ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import os

import numpy as np

__all__ = ["ORIGINALS", "install"]

_INSTALLED = False
ORIGINALS: dict = {}  # the interpreter's own methods, replaced by install() (tests show why they are replaced)


def _bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16(x: np.ndarray) -> np.ndarray:
    import torch

    t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(torch.bfloat16)
    return t.view(torch.int16).numpy().view(np.uint16).reshape(x.shape)


def install() -> None:
    """Patch the interpreter's ``create_dot`` and float32 -> bfloat16 casts (idempotent)."""
    global _INSTALLED
    if _INSTALLED or os.environ.get("TRITON_INTERPRET") != "1":
        return
    import triton.language as tl
    from triton.runtime import interpreter as it

    def operand(h) -> np.ndarray:
        dt = h.dtype.scalar
        if dt == tl.bfloat16:
            return _bf16_to_f32(h.data)
        if dt.is_floating() and dt.primitive_bitwidth == 8:
            return it._convert_float(h.data, dt, tl.float16, None).view(np.float16)
        return h.data

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        prod = np.einsum(
            "...ik,...kj->...ij", operand(a).astype(np.float64), operand(b).astype(np.float64), optimize=False
        )
        return it.TensorHandle(prod.astype(d.data.dtype) + d.data, d.dtype.scalar)

    cast_impl = it.InterpreterBuilder.cast_impl
    fp_to_fp = it.InterpreterBuilder.create_fp_to_fp
    ORIGINALS.update(create_dot=it.InterpreterBuilder.create_dot, cast_impl=cast_impl, create_fp_to_fp=fp_to_fp)

    def to_bf16(self, src, dst_type, fallback, *args):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return it.TensorHandle(_f32_to_bf16(src.data), tl.bfloat16)
        return fallback(self, src, dst_type, *args)

    it.InterpreterBuilder.create_dot = create_dot
    it.InterpreterBuilder.cast_impl = lambda self, src, dst_type: to_bf16(self, src, dst_type, cast_impl)
    it.InterpreterBuilder.create_fp_to_fp = lambda self, src, dst_type, rounding_mode: to_bf16(
        self, src, dst_type, fp_to_fp, rounding_mode
    )
    _INSTALLED = True
