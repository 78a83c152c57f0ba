"""Batch-invariant GEMM (``linear`` and its backward) as one fixed-config Triton kernel.

Every output tile ``[BLOCK_M, BLOCK_N]`` is one program; K is walked in ``BLOCK_K`` steps in increasing order with an
fp32 accumulator (``tl.dot(..., input_precision="ieee")``: exact fp32 products, no TF32), bias added in fp32, one
rounding to the output dtype. No split-K and no autotuning, so a row's result depends only on that row and the weight
— the contract of :func:`shared_numerics.linear.linear` (whose CPU tiles give other bits: the torch and triton
backends agree to fp32 rounding, not bitwise). Source: Thinking Machines' batch-invariant persistent matmul (one fixed
config per dtype); vLLM ``model_executor/layers/batch_invariant.py``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["gemm", "linear"]

BLOCK_M, BLOCK_N, BLOCK_K = 32, 64, 32


@triton.jit
def _gemm_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K, sam, sak, sbk, sbn, scm, scn,
                 HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        a = tl.load(a_ptr + rm[:, None] * sam + kk[None, :] * sak, mask=(rm[:, None] < M) & (kk[None, :] < K),
                    other=0.0).to(tl.float32)
        b = tl.load(b_ptr + kk[:, None] * sbk + rn[None, :] * sbn, mask=(kk[:, None] < K) & (rn[None, :] < N),
                    other=0.0).to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision="ieee")
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + rm[:, None] * scm + rn[None, :] * scn, acc.to(c_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def gemm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b (+ bias)`` for 2-D ``a [M, K]``, ``b [K, N]`` (any strides), fp32 accumulation, result in ``out_dtype``."""
    m, k = a.shape
    n = b.shape[1]
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return c
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _gemm_kernel[grid](a, b, c, bias if bias is not None else c, m, n, k, a.stride(0), a.stride(1), b.stride(0),
                       b.stride(1), c.stride(0), c.stride(1), HAS_BIAS=bias is not None, BM=BLOCK_M, BN=BLOCK_N,
                       BK=BLOCK_K)
    return c


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight, bias):
        ctx.save_for_backward(x2, weight)
        ctx.has_bias = bias is not None
        return gemm(x2, weight.t(), x2.dtype, bias)

    @staticmethod
    def backward(ctx, gy):
        x2, weight = ctx.saved_tensors
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = gemm(gy, weight, x2.dtype)
        if ctx.needs_input_grad[1]:
            gw = gemm(gy.t(), x2, weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = gy.float().sum(0).to(gy.dtype)
        return gx, gw, gb


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Triton :func:`shared_numerics.linear.linear`: ``[..., K] x [N, K] -> [..., N]`` in ``x.dtype``."""
    lead = x.shape[:-1]
    y = _Linear.apply(x.reshape(-1, x.shape[-1]), weight, bias)
    return y.reshape(*lead, weight.shape[0])
