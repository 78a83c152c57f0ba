"""The differentiable linear layer of the GPU backends, over any row-invariant GEMM.

``y = x W^T (+ b)`` with the forward and ``dX = dY W`` on the backend's row-invariant GEMM (a row of ``dX`` depends
only on its row of ``dY``) and ``dW = dY^T X`` — a reduction over the call's tokens, which needs determinism, not row
invariance — as one ``torch.mm`` of that shape (cuBLAS is bitwise reproducible for a given shape and GPU); the bias
gradient a float32 column sum. The Triton backend (:mod:`shared_numerics.ops_triton.matmul`) and the cuBLAS one
(:mod:`shared_numerics.gemm_cublas`) differ only in the GEMM they pass.

Source: the closed-form backward of ``torch.nn.functional.linear``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["linear_with"]

#: ``matmul(a [M, K], b [K, N], bias [N] | None) -> [M, N]`` in ``a.dtype``, row ``i`` depending only on ``a[i]``
RowGemm = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, matmul: RowGemm, x2, weight, bias):
        ctx.save_for_backward(x2, weight)
        ctx.matmul, ctx.has_bias = matmul, bias is not None
        return matmul(x2, weight.t(), bias)

    @staticmethod
    def backward(ctx, gy):
        x2, weight = ctx.saved_tensors
        gx = gw = gb = None
        gy = gy.to(x2.dtype)
        if ctx.needs_input_grad[1]:
            gx = ctx.matmul(gy, weight, None)
        if ctx.needs_input_grad[2]:
            gw = torch.mm(gy.t(), x2)
        if ctx.has_bias and ctx.needs_input_grad[3]:
            gb = gy.float().sum(0).to(gy.dtype)
        return None, gx, gw, gb


def linear_with(
    matmul: RowGemm, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``[..., K] x [N, K] (+ [N]) -> [..., N]`` in ``x.dtype`` on ``matmul`` (see the module). The weight and bias
    are used in ``x.dtype`` (rounded if they arrive in another: tensor-core operands share one dtype; under FSDP
    mixed precision the weight already arrives in the compute dtype); ``dW`` comes back in the weight's dtype."""
    lead = x.shape[:-1]
    w = weight if weight.dtype == x.dtype else weight.to(x.dtype)
    b = bias if bias is None or bias.dtype == x.dtype else bias.to(x.dtype)
    y = _Linear.apply(matmul, x.reshape(-1, x.shape[-1]), w, b)
    return y.reshape(*lead, weight.shape[0])
