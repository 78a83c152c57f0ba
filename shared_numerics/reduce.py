"""Fixed-order reductions and position-independent transcendentals.

These are the two building blocks that make every other op in ``shared_numerics`` batch invariant on CPU:

* ``tree_sum`` adds along one dimension with a fixed binary tree made only of elementwise additions. An
  elementwise add is exact IEEE arithmetic on each element, whatever the tensor's shape, strides, thread count or
  SIMD tail handling, so the sum of one row never depends on how many other rows share the call. (``torch.sum``
  picks its vectorisation and split by shape; ATen's reductions are not guaranteed row invariant.)
* ``exp64`` (and ``sigmoid64``) evaluates the exponential in float64 and rounds to the caller's dtype. ATen computes
  ``exp`` with SIMD (Sleef) in the body of a tensor and with scalar libm in the tail, and which elements fall
  in the tail depends on the tensor's size and on the per-thread split, so float32 ``torch.exp`` of the same number
  can differ by one ulp depending on what else is in the batch. Both float64 implementations are accurate to < 1
  ulp of float64, so after rounding to float32 they agree except when the exact value lies within ~1e-16 relative of
  a float32 rounding boundary (probability ~2^-29 per element); no such case was seen in the test suite.

On CPU the attention, SiLU-and-mul and inference RMSNorm run compiled kernels (``csrc/``) that fix the same
properties in C: one scalar formula per element, sums in a fixed order (:mod:`shared_numerics.cpu_kernels`).

Source: the batch-invariance analysis of Thinking Machines, "Defeating Nondeterminism in LLM Inference" (2025),
applied to ATen's CPU kernels (``aten/src/ATen/native/cpu/Loops.h``: ``vectorized_loop`` + scalar ``basic_loop``).
"""

from __future__ import annotations

import torch

__all__ = ["tree_sum", "exp64", "sigmoid64", "true_divide"]


def true_divide(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """``x / divisor`` correctly rounded (IEEE division) on every device.

    ``x / 448.0`` is not that on CUDA: when the divisor is a CPU scalar, ATen's CUDA kernel multiplies by its
    reciprocal (``aten/src/ATen/native/cuda/BinaryDivTrueKernel.cu``), so some quotients come out one ulp off the CPU's
    and a Triton kernel's ``div_rn`` (measured on an H200: the FP8 scales differed). Dividing by a 0-d tensor on
    ``x``'s device (in ``x.dtype``) takes the true division everywhere; on CPU the bits are those of ``x / divisor``.

    Args:
        x: floating tensor, any shape and device. divisor: a Python number.

    Returns:
        ``x / divisor`` in ``x.dtype``, same shape and device.
    """
    return x / x.new_full((), divisor)  # filled on the device: no host-to-device copy


def tree_sum(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """Sum ``x`` along ``dim`` with a fixed pairwise tree of elementwise adds.

    Args:
        x: any floating tensor, any shape; the reduction runs in ``x.dtype``.
        dim: the dimension to reduce.
        keepdim: keep the reduced dimension with size 1.

    Returns:
        ``x.sum(dim)`` up to rounding, bitwise identical for a given row whatever the other dimensions are.
        The tree: the length is zero-padded to the next power of two, then halves are added
        (``a[:h] + a[h:]``) until one element remains. Differentiable (autograd of slicing and add).
    """
    dim = dim % x.dim()
    n = x.shape[dim]
    if n == 0:
        shape = list(x.shape)
        shape[dim] = 1
        out = x.new_zeros(shape)
        return out if keepdim else out.squeeze(dim)
    p = 1 << (n - 1).bit_length()
    if p != n:
        pad_shape = list(x.shape)
        pad_shape[dim] = p - n
        x = torch.cat([x, x.new_zeros(pad_shape)], dim=dim)
    while p > 1:
        h = p // 2
        x = x.narrow(dim, 0, h) + x.narrow(dim, h, h)
        p = h
    return x if keepdim else x.squeeze(dim)


def exp64(x: torch.Tensor) -> torch.Tensor:
    """``exp(x)`` evaluated in float64 and rounded to ``x.dtype``; see the module docstring for why."""
    return torch.exp(x.double()).to(x.dtype)


def sigmoid64(x: torch.Tensor) -> torch.Tensor:
    """``sigmoid(x)`` evaluated in float64 and rounded once to float32, for the reason of :func:`exp64` (ATen's float32
    ``torch.sigmoid`` has the same SIMD-body / libm-tail split: seen as a 1-ulp log-prob difference in a float32
    DeepSeek-V3 rollout). Differentiable."""
    return (1.0 / (1.0 + torch.exp(-x.double()))).float()
