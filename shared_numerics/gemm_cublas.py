"""Batch-invariant GEMM by construction on a vendor library: every call of one fixed shape.

A GEMM library picks its kernel, tile, K blocking and split-K from the problem's shape (and the operands' strides
and alignment), so a row's bits can change with how many other rows share the call. Issued as calls of exactly
:data:`CUBLAS_ROWS` rows — full blocks as views of the (contiguous, 16-byte aligned) input, the last block
zero-padded into a buffer of the same shape and strides, every output written through the same ``out=`` path — every
call the library sees has the same ``(M, N, K)``, dtypes, strides and alignment, so it makes the same choice for
each, and a row's result depends only on the row, the weight and the bias: the same bits at decode (one row, padded)
and in a 4096-row prefill. This holds for any library that is deterministic for a given problem, which cuBLAS
documents ("all cuBLAS API routines from a given toolkit version generate the same bit-wise results at every run
when executed on GPUs with the same architecture and the same number of SMs"); on CPU it holds for torch's GEMM at a
fixed thread count.

What must match between trainer and engine (beyond :data:`CUBLAS_ROWS`, in the numerics contract): the GPU model
(architecture and SM count), the CUDA toolkit / cuBLAS version, and torch's process-wide cuBLAS settings (TF32 for
float32 — off by default —, reduced-precision reductions, ``CUBLAS_WORKSPACE_CONFIG``): they choose the kernels.

Arithmetic: cuBLAS's own (bf16/fp16 operands into tensor cores with float32 accumulation; float32 in IEEE unless TF32
is enabled), the bias added in the GEMM's epilogue by torch's ``addmm`` — so these bits differ from the Triton
backend's, which is why the backend is its own name (``cublas``) in :class:`shared_numerics.mode.NumericsMode`.

Cost: ``ceil(M / CUBLAS_ROWS)`` library calls from one Python loop (a call is a few us of host time; a 256 x 12288 x
4096 bf16 GEMM ~40 us of an H200), and decode pays a 256-row GEMM for one row.

Source: the fixed-shape idea of issue "Zero KLD without the speed tax" (``F.linear`` on fixed zero-padded row
chunks is row-invariant by construction); cuBLAS documentation, section "Results reproducibility".
"""

from __future__ import annotations

import torch

from .gemm_autograd import linear_with

__all__ = ["CUBLAS_ROWS", "fixed_rows_matmul", "linear"]

#: rows of every GEMM call (in the numerics contract, :func:`shared_numerics.mode.contract`). Measured on an H200,
#: bf16 4096 -> 12288, ours ÷ ``F.linear`` at M = 64 / 4096 (``benchmarks/results/gpu_kernels_h200*.json``, two runs):
#: 64 rows 0.82x, 0.69x / 0.28x, 0.30x (64-row GEMMs leave most SMs idle); 128 rows 0.46x, 0.38x / 0.55x, 0.60x;
#: 256 rows 0.51x, 0.27x / 0.84x, 0.86x; 512 rows 0.38x, 0.34x / 0.91x, 0.93x (M = 64 is dominated by per-call host
#: work and varies between runs). A multiple of every tensor-core tile height, so slices stay aligned
CUBLAS_ROWS = 256
_ALIGN = 16  # bytes: the alignment cuBLASLt's heuristics distinguish (torch passes it as the operands' alignment)


def _rows_operand(a: torch.Tensor) -> torch.Tensor:
    """``a`` as a row-major contiguous, 16-byte aligned ``[M, K]`` tensor (a copy only if it is not one)."""
    if a.is_contiguous() and a.data_ptr() % _ALIGN == 0:
        return a
    return a.clone(memory_format=torch.contiguous_format)  # a fresh allocation: contiguous and aligned


def fixed_rows_matmul(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, rows: int = CUBLAS_ROWS
) -> torch.Tensor:
    """``a @ b (+ bias)`` as library calls of exactly ``rows`` rows each.

    Args:
        a: ``[M, K]``, any strides (copied to row-major if not row-major and aligned).
        b: ``[K, N]``, ``a.dtype``, any strides (the same tensor for every call, e.g. ``weight.t()``).
        bias: ``[N]`` in ``a.dtype``, or ``None``.
        rows: rows per call.

    Returns:
        ``[M, N]`` in ``a.dtype``; row ``i`` depends only on ``a[i]``, ``b`` and ``bias`` (see the module).

    Raises:
        ValueError: operands that are not 2-D, or whose K or dtypes differ.
    """
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0] or a.dtype != b.dtype:
        raise ValueError(
            f"fixed_rows_matmul: a {tuple(a.shape)} {a.dtype} @ b {tuple(b.shape)} {b.dtype}: need "
            "[M, K] @ [K, N] of one dtype"
        )
    m, k = a.shape
    n = b.shape[1]
    out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    a = _rows_operand(a)

    def call(block: torch.Tensor, dest: torch.Tensor) -> None:
        if bias is None:
            torch.mm(block, b, out=dest)
        else:
            torch.addmm(bias, block, b, out=dest)

    full = m - m % rows
    for s in range(0, full, rows):
        call(a[s : s + rows], out[s : s + rows])
    if full < m:
        pad = a.new_zeros((rows, k))
        pad[: m - full] = a[full:]
        dest = torch.empty((rows, n), dtype=a.dtype, device=a.device)
        call(pad, dest)
        out[full:] = dest[: m - full]
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`shared_numerics.linear.linear` on fixed-shape library calls: ``[..., K] x [N, K] (+ [N]) -> [..., N]``
    in ``x.dtype`` (weight and bias rounded to ``x.dtype`` if they arrive in another, as in the Triton backend).

    Differentiable (:func:`shared_numerics.gemm_autograd.linear_with`): ``dX = dY W`` in the same fixed-shape calls
    (row-invariant), ``dW = dY^T X`` as one call (deterministic), the bias gradient a float32 column sum; ``dW`` comes
    back in the weight's dtype."""
    return linear_with(fixed_rows_matmul, x, weight, bias)
