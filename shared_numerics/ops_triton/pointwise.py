"""Row and elementwise Triton kernels: RMSNorm, rotate-half RoPE, SiLU-and-mul — forward and backward.

Semantics are those of :mod:`shared_numerics.norm`, :mod:`shared_numerics.rope`, :mod:`shared_numerics.activation`
(fp32 arithmetic, one rounding to the input dtype). Against the torch backend they agree to a few fp32 ulps: the
norm's sum of squares is a Triton tree reduction (not ``tree_sum``'s tree), exp is fp32 (not the float64 detour the
CPU SIMD/tail split needs). One row (token) per program, so rows never influence each other.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import next_pow2

__all__ = ["apply_rope", "rms_norm", "silu_and_mul"]


@triton.jit
def _rms_fwd(x_ptr, w_ptr, y_ptr, rstd_ptr, H, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
    ms = tl.sum(x * x, axis=0) / H
    rstd = 1.0 / tl.sqrt_rn(ms + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * H + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _rms_bwd(x_ptr, w_ptr, gy_ptr, rstd_ptr, gx_ptr, gw_rows_ptr, H, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
    gy = tl.load(gy_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + row)
    xhat = x * rstd
    g = gy * w
    c = tl.sum(g * xhat, axis=0) / H
    tl.store(gx_ptr + row * H + cols, (rstd * (g - xhat * c)).to(gx_ptr.dtype.element_ty), mask=mask)
    tl.store(gw_rows_ptr + row * H + cols, gy * xhat, mask=mask)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight, eps):
        m, h = x2.shape
        y = torch.empty_like(x2)
        rstd = torch.empty(m, dtype=torch.float32, device=x2.device)
        if m:
            _rms_fwd[(m,)](x2, weight, y, rstd, h, eps, BLOCK=next_pow2(h))
        ctx.save_for_backward(x2, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, gy):
        x2, weight, rstd = ctx.saved_tensors
        m, h = x2.shape
        gx = torch.empty_like(x2)
        gw_rows = torch.empty((m, h), dtype=torch.float32, device=x2.device)
        if m:
            _rms_bwd[(m,)](x2, weight, gy.contiguous(), rstd, gx, gw_rows, h, BLOCK=next_pow2(h))
        return gx, gw_rows.sum(0).to(weight.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton :func:`shared_numerics.norm.rms_norm` (``[..., H]``, one program per row)."""
    return _RMSNorm.apply(x.reshape(-1, x.shape[-1]).contiguous(), weight, float(eps)).reshape(x.shape)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, NH, HALF, sign, BH: tl.constexpr, BD: tl.constexpr):
    t = tl.program_id(0)
    h = tl.arange(0, BH)
    d = tl.arange(0, BD)
    mask = (h[:, None] < NH) & (d[None, :] < HALF)
    base = t * NH * 2 * HALF + h[:, None] * 2 * HALF + d[None, :]
    x1 = tl.load(x_ptr + base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + base + HALF, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t * HALF + d, mask=d < HALF, other=0.0)[None, :]
    s = tl.load(sin_ptr + t * HALF + d, mask=d < HALF, other=0.0)[None, :] * sign
    tl.store(y_ptr + base, (x1 * c - x2 * s).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_ptr + base + HALF, (x2 * c + x1 * s).to(y_ptr.dtype.element_ty), mask=mask)


def _rope_launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    n, nh, d = x.shape
    x = x.contiguous()
    y = torch.empty_like(x)
    if n:
        _rope_kernel[(n,)](x, cos.contiguous(), sin.contiguous(), y, nh, d // 2, sign, BH=next_pow2(nh, 1),
                           BD=next_pow2(d // 2))
    return y


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rope_launch(x, cos, sin, 1.0)

    @staticmethod
    def backward(ctx, gy):  # the transpose of a rotation is the rotation by -angle
        cos, sin = ctx.saved_tensors
        return _rope_launch(gy, cos, sin, -1.0), None, None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Triton :func:`shared_numerics.rope.apply_rope` (``x [N, heads, D]``, one program per token)."""
    return _Rope.apply(x, cos, sin)


@triton.jit
def _silu_fwd(g_ptr, u_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, (g / (1.0 + tl.exp(-g)) * u).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_bwd(g_ptr, u_ptr, gy_ptr, gg_ptr, gu_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    gy = tl.load(gy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g))
    tl.store(gu_ptr + offs, (gy * g * sig).to(gu_ptr.dtype.element_ty), mask=mask)
    tl.store(gg_ptr + offs, (gy * u * sig * (1.0 + g * (1.0 - sig))).to(gg_ptr.dtype.element_ty), mask=mask)


_EW_BLOCK = 1024


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        gate, up = gate.contiguous(), up.contiguous()
        y = torch.empty_like(gate)
        n = gate.numel()
        if n:
            _silu_fwd[(triton.cdiv(n, _EW_BLOCK),)](gate, up, y, n, BLOCK=_EW_BLOCK)
        ctx.save_for_backward(gate, up)
        return y

    @staticmethod
    def backward(ctx, gy):
        gate, up = ctx.saved_tensors
        gg, gu = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        if n:
            _silu_bwd[(triton.cdiv(n, _EW_BLOCK),)](gate, up, gy.contiguous(), gg, gu, n, BLOCK=_EW_BLOCK)
        return gg, gu


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Triton :func:`shared_numerics.activation.silu_and_mul` (elementwise; result in ``gate.dtype``)."""
    return _SiluMul.apply(gate, up)
