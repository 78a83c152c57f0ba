"""oneMKL VML's first-call dispatch race, settled when :mod:`shared_numerics` is imported.

ATen computes contiguous float32 / float64 ``exp``, ``log``, ``sin``, ``cos``, ``sqrt``, ``tanh``, ``erf`` and the
other ops of :data:`VML_OPS` with MKL's vector math library: each intra-op thread calls ``vm[sd]<Op>(n, in, out,
VML_HA | ...)`` on its chunk of the tensor (``aten/src/ATen/cpu/vml.h``, ``IMPLEMENT_VML_MKL``; chunks of at least
2,048 elements, so a tensor of 4,096 elements already runs on two threads). oneMKL 2024.2 — the version inside torch
2.13's wheels (``torch.backends.mkl``; ``MKL_Get_Version_String``) — resolves a VML function's kernel lazily on its
first call, and when that first call runs on several threads at once one thread can run a low-accuracy kernel for its
whole chunk of that one call, though ``VML_HA`` was asked for (pytorch/pytorch#188792; oneMKL >= 2025.0 no longer
shows it). The next call is right, so the damage is one call per process: the first.

What it did to zerokld (measured on a 2-core Xeon, AVX-512, torch 2.13.0+cpu): the trainer's first forward in a fresh
process computed its RoPE table (:func:`shared_numerics.rope.rope_cos_sin`: float64 ``cos`` rounded to float32) with
float32-level errors on the worker thread's half of the rows — 98 to 118 of 3,232 entries one float32 ulp off — so
that forward's log-probs differed from every later one's (1 in 5 to 1 in 10 fresh processes). Every float64 ``exp``
this package rounds to float32 (:func:`shared_numerics.exp64`, the router's softmax, the log-probs' sums) is the same
kind of call.

The remedy is the upstream one (pytorch/pytorch#188791): call each VML function once per precision on a single
thread (a one-element tensor never splits) before anything else can, so every later call finds its kernel resolved.
:func:`settle_vml_dispatch` does it; ``shared_numerics`` runs it on import, before any of its ops can run. Where torch
has no MKL it does nothing.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["VML_DTYPES", "VML_OPS", "settle_vml_dispatch"]

#: the torch ops ATen computes with MKL VML on contiguous CPU tensors (``aten/src/ATen/cpu/vml.h``,
#: ``IMPLEMENT_VML_MKL``: acos, asin, atan, cos, erf, erfc, erfinv, exp, log, log10, log2, sin, sqrt, tan, tanh,
#: trunc)
VML_OPS = (
    "acos",
    "asin",
    "atan",
    "cos",
    "erf",
    "erfc",
    "erfinv",
    "exp",
    "log",
    "log10",
    "log2",
    "sin",
    "sqrt",
    "tan",
    "tanh",
    "trunc",
)
#: the precisions VML serves (``vms<Op>``, ``vmd<Op>``)
VML_DTYPES = (torch.float32, torch.float64)


@functools.cache
def settle_vml_dispatch() -> bool:
    """Resolve every VML function's kernel with one single-threaded call of each op of :data:`VML_OPS` in each
    dtype of :data:`VML_DTYPES` (a one-element CPU tensor of 0.5, inside every op's domain; microseconds in all).
    Idempotent.

    Returns:
        ``True`` where torch has MKL (the calls ran), ``False`` where it has none (nothing to settle).
    """
    if not torch.backends.mkl.is_available():
        return False
    for dtype in VML_DTYPES:
        x = torch.full((1,), 0.5, dtype=dtype, device="cpu")  # (whatever the default device)
        for op in VML_OPS:
            getattr(torch, op)(x)
    return True
