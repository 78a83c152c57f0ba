"""Batch-invariant RMSNorm.

``y = (x * rsqrt(mean(x^2) + eps)) * w``, statistics in float32 with the fixed-tree sum of
:func:`shared_numerics.reduce.tree_sum`; one rounding to the input dtype at the end.

Source: Zhang & Sennrich, "Root Mean Square Layer Normalization" (2019); HF ``Qwen3RMSNorm`` / ``LlamaRMSNorm``
(statistics in float32). ``rsqrt`` and division are correctly rounded in both SIMD and scalar ATen paths, so they
need no float64 detour.

On CPU without autograd (vLLM's forward, the trainer's log-prob passes) the compiled kernel ``csrc/pointwise.cpp``
runs the same operations in the same order in one pass (the same bits: ``tests/test_numerics.py`` compares them);
with autograd the torch ops below.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from .cpu_kernels import DTYPE_CODES
from .reduce import tree_sum



@functools.lru_cache(maxsize=1)
def _lib():
    from .cpu_kernels import load

    lib = load("pointwise")
    lib.zk_rms_norm.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
    lib.zk_rms_norm.restype = None
    return lib


def _rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.shape[-1]
    x2 = x.reshape(-1, h)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = weight.float().contiguous()
    y = torch.empty(x2.shape, dtype=torch.float32)
    _lib().zk_rms_norm(DTYPE_CODES[x.dtype], x2.data_ptr(), x2.shape[0], h, x2.stride(0), w.data_ptr(),
                       float(eps), y.data_ptr(), torch.get_num_threads())
    return y.reshape(x.shape).to(x.dtype)

__all__ = ["add_rms_norm", "rms_norm"]


class _ChainedGain(torch.autograd.Function):
    """``x̂ * w`` (float32) whose gain gradient ``Σ_t dY_t ⊙ x̂_t`` goes into a
    :class:`shared_numerics.grad_chain.GradChain` (the products rounded to float32, then added in token order);
    ``dx̂ = dY * w`` as autograd computes it."""

    @staticmethod
    def forward(ctx, xhat: torch.Tensor, w32: torch.Tensor, chain) -> torch.Tensor:
        ctx.save_for_backward(xhat, w32)
        ctx.chain = chain
        return xhat * w32

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        xhat, w32 = ctx.saved_tensors
        ctx.chain.add_rows(grad * xhat)
        return grad * w32, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, weight_chain=None) -> torch.Tensor:
    """RMS-normalise the last dimension.

    Args:
        x: ``[..., H]`` float32 or bfloat16.
        weight: ``[H]`` gain.
        eps: added to the mean square (HF ``rms_norm_eps``).
        weight_chain: a :class:`shared_numerics.grad_chain.GradChain` that takes the gain's gradient (exact
            accumulation; none is returned to autograd). The forward bits do not change.

    Returns:
        ``[..., H]`` in ``x.dtype``; each row depends only on itself.
    """
    if (weight_chain is None and x.device.type == "cpu" and x.dtype in DTYPE_CODES and x.numel() and not (
            torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        from .cpu_kernels import plain

        xp, wp = plain(x), plain(weight)
        if xp is not None and wp is not None:  # otherwise (DTensors, fake tensors) the torch ops: the same bits
            return _rms_norm_cpu(xp, wp, eps)
    x32 = x.float()
    ms = tree_sum(x32 * x32, dim=-1, keepdim=True) / x.shape[-1]
    if weight_chain is not None:
        y = _ChainedGain.apply(x32 * torch.rsqrt(ms + eps), weight.detach().float(), weight_chain)
    else:
        y = x32 * torch.rsqrt(ms + eps) * weight.float()
    return y.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm, the pattern between two decoder sub-blocks.

    Args:
        x: ``[..., H]`` float32 or bfloat16 (the residual stream).
        residual: same shape: the sub-block output added to it.
        weight: ``[H]`` gain; eps: as :func:`rms_norm`.

    Returns:
        ``(s, y)``: ``s = x + residual`` rounded to ``x.dtype`` (the new residual stream) and ``y = rms_norm(s)`` —
        by definition bitwise the unfused composition, so a model that fuses it (vLLM side) and one that does not
        (TorchTitan's ``h + attn(...)`` then ``RMSNorm``) agree. Backends may fuse it into one pass (Triton does).
        Source: vLLM ``RMSNorm.forward(x, residual)`` (which, unlike this op, normalises the unrounded fp32 sum).
    """
    s = x + residual.to(x.dtype)
    return s, rms_norm(s, weight, eps)
