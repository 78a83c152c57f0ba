"""Row and elementwise Triton kernels: RMSNorm (alone, fused with the residual add, fused with RoPE), rotate-half
RoPE, SiLU-and-mul — forward and backward.

Semantics are those of :mod:`shared_numerics.norm`, :mod:`shared_numerics.rope`, :mod:`shared_numerics.activation`
and their compositions (fp32 arithmetic, one rounding to the input dtype per op). Each row is reduced on its own; how
many rows share a program and how many warps run it are functions of the row length only, never of the row count.

Fusions keep the unfused bits by construction: RMSNorm, residual-add + RMSNorm (``add_rms_norm``) and per-head
RMSNorm + RoPE (``rms_norm_rope``, Qwen3's QK-norm) are *one* compiled kernel (:func:`_norm_row`) whose variants are
runtime flags, so the statistics of a row are computed by the same instructions whichever op asked (rows are packed
into a program by a count that depends on the row length only); the residual sum is
rounded to the activation dtype before it is normalised (as ``x + r`` then ``rms_norm`` does); the rotation is written
with explicit ``fma`` (``x1*c - x2*s = fma(x1, c, -(x2*s))``) in both the fused kernel and :func:`_rope_kernel`, so no
compiler contraction choice can differ between them. Against the torch backend they agree to a few fp32 ulps (the
norm's sum of squares is a Triton tree, not ``tree_sum``'s; exp is fp32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import next_pow2

__all__ = ["add_rms_norm", "apply_rope", "rms_norm", "rms_norm_rope", "silu_and_mul"]


def _row_warps(block: int) -> int:
    return 1 if block <= 256 else 4 if block <= 2048 else 8


_TILE_ELEMS = 2048


def _norm_tile(h: int) -> tuple[int, int, int]:
    """``(BLOCK, rows per program, warps)`` for rows of ``h``: a function of ``h`` alone (never of the row count), so
    a row is reduced by the same instructions whichever call it is in. Short rows (per-head norms, ``h`` = head_dim)
    are packed ``2048 // BLOCK`` to a program."""
    block = next_pow2(h)
    rows = max(1, _TILE_ELEMS // block)
    return block, rows, _row_warps(block * rows)


@triton.jit
def _rotate(x1, x2, c, s):
    """Rotate-half on fp32 halves: ``(x1*c - x2*s, x2*c + x1*s)`` with explicit fma (no contraction choice)."""
    return tl.fma(x1, c, -(x2 * s)), tl.fma(x2, c, x1 * s)


@triton.jit(do_not_specialize=["M", "has_res", "rope", "heads"])
def _norm_row(
    x_ptr,
    r_ptr,
    w_ptr,
    y_ptr,
    sum_ptr,
    rstd_ptr,
    cos_ptr,
    sin_ptr,
    M,
    H,
    eps,
    has_res,
    rope,
    heads,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    BHALF: tl.constexpr,
):
    """Program = ``ROWS`` contiguous rows of ``H``. ``has_res``: ``x <- round(x + r)`` (stored to ``sum_ptr``)
    first. ``rope``: the normalised row (rounded) is rotated by table row ``row // heads`` before it is stored."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    rmask = row < M
    cols = tl.arange(0, BLOCK)
    mask = rmask[:, None] & (cols[None, :] < H)
    offs = row[:, None] * H + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if has_res:
        s = (x + tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)).to(y_ptr.dtype.element_ty)
        tl.store(sum_ptr + offs, s, mask=mask)
        x = s.to(tl.float32)
    ms = tl.sum(x * x, axis=1) / H
    rstd = 1.0 / tl.sqrt_rn(ms + eps)
    tl.store(rstd_ptr + row, rstd, mask=rmask)
    if rope:
        half = H // 2
        hc = tl.arange(0, BHALF)
        hm = rmask[:, None] & (hc[None, :] < half)
        ho = row[:, None] * H + hc[None, :]
        if has_res:
            x1 = tl.load(sum_ptr + ho, mask=hm, other=0.0).to(tl.float32)
            x2 = tl.load(sum_ptr + ho + half, mask=hm, other=0.0).to(tl.float32)
        else:
            x1 = tl.load(x_ptr + ho, mask=hm, other=0.0).to(tl.float32)
            x2 = tl.load(x_ptr + ho + half, mask=hm, other=0.0).to(tl.float32)
        w1 = tl.load(w_ptr + hc, mask=hc < half, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + half + hc, mask=hc < half, other=0.0).to(tl.float32)[None, :]
        n1 = (x1 * rstd[:, None] * w1).to(y_ptr.dtype.element_ty).to(tl.float32)
        n2 = (x2 * rstd[:, None] * w2).to(y_ptr.dtype.element_ty).to(tl.float32)
        t = (row // heads)[:, None] * half + hc[None, :]
        c = tl.load(cos_ptr + t, mask=hm, other=0.0)
        sn = tl.load(sin_ptr + t, mask=hm, other=0.0)
        o1, o2 = _rotate(n1, n2, c, sn)
        tl.store(y_ptr + ho, o1.to(y_ptr.dtype.element_ty), mask=hm)
        tl.store(y_ptr + ho + half, o2.to(y_ptr.dtype.element_ty), mask=hm)
    else:
        w = tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs, (x * rstd[:, None] * w).to(y_ptr.dtype.element_ty), mask=mask)


def _launch_norm(x2, weight, eps, residual=None, cos=None, sin=None, heads=1):
    m, h = x2.shape
    y = torch.empty_like(x2)
    s = torch.empty_like(x2) if residual is not None else y
    rstd = torch.empty(m, dtype=torch.float32, device=x2.device)
    if m:
        block, rows, warps = _norm_tile(h)
        _norm_row[(triton.cdiv(m, rows),)](
            x2,
            residual if residual is not None else x2,
            weight,
            y,
            s,
            rstd,
            cos if cos is not None else rstd,
            sin if sin is not None else rstd,
            m,
            h,
            float(eps),
            int(residual is not None),
            int(cos is not None),
            heads,
            BLOCK=block,
            ROWS=rows,
            BHALF=next_pow2(max(h // 2, 1)),
            num_warps=warps,
        )
    return y, s, rstd


@triton.jit
def _rms_bwd(x_ptr, w_ptr, gy_ptr, rstd_ptr, gx_ptr, gw_rows_ptr, H, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
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
        y, _, rstd = _launch_norm(x2, weight, eps)
        ctx.save_for_backward(x2, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, gy):
        x2, weight, rstd = ctx.saved_tensors
        m, h = x2.shape
        gx = torch.empty_like(x2)
        gw_rows = torch.empty((m, h), dtype=torch.float32, device=x2.device)
        if m:
            block = next_pow2(h)
            _rms_bwd[(m,)](x2, weight, gy.contiguous(), rstd, gx, gw_rows, h, BLOCK=block, num_warps=_row_warps(block))
        return gx, gw_rows.sum(0).to(weight.dtype), None


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton :func:`shared_numerics.norm.rms_norm` (``[..., H]``, one program per row; differentiable)."""
    return _RMSNorm.apply(x.reshape(-1, x.shape[-1]).contiguous(), weight, float(eps)).reshape(x.shape)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton :func:`shared_numerics.norm.add_rms_norm`: ``s = x + residual`` (rounded to ``x.dtype``) and
    ``rms_norm(s)`` in one pass; bitwise ``(x + residual, rms_norm(x + residual))`` of this backend. With gradients
    required it runs exactly that composition (differentiable)."""
    if _needs_grad(x, residual, weight):
        s = x + residual
        return s, rms_norm(s, weight, eps)
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    y, s, _ = _launch_norm(x2, weight, eps, residual=residual.reshape(x2.shape).to(x.dtype).contiguous())
    return s.reshape(x.shape), y.reshape(x.shape)


def rms_norm_rope(
    x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Triton :func:`shared_numerics.rope.rms_norm_rope`: per-head ``rms_norm`` of ``x [N, heads, D]`` then RoPE with
    ``cos, sin [N, D/2]``, one pass; bitwise ``apply_rope(rms_norm(x), cos, sin)`` of this backend. With gradients
    required it runs exactly that composition (differentiable)."""
    if _needs_grad(x, weight):
        return apply_rope(rms_norm(x, weight, eps), cos, sin)
    n, heads, d = x.shape
    y, _, _ = _launch_norm(
        x.reshape(n * heads, d).contiguous(),
        weight,
        eps,
        cos=cos.float().contiguous(),
        sin=sin.float().contiguous(),
        heads=heads,
    )
    return y.reshape(x.shape)


@triton.jit(do_not_specialize=["M", "heads"])
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, M, heads, HALF, sign, ROWS: tl.constexpr, BD: tl.constexpr):
    """Program = ``ROWS`` (token, head) rows of ``2 * HALF``; row ``r`` uses table row ``r // heads``."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, BD)
    mask = (row < M)[:, None] & (d[None, :] < HALF)
    base = row[:, None] * 2 * HALF + d[None, :]
    x1 = tl.load(x_ptr + base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + base + HALF, mask=mask, other=0.0).to(tl.float32)
    t = (row // heads)[:, None] * HALF + d[None, :]
    c = tl.load(cos_ptr + t, mask=mask, other=0.0)
    s = tl.load(sin_ptr + t, mask=mask, other=0.0) * sign
    o1, o2 = _rotate(x1, x2, c, s)
    tl.store(y_ptr + base, o1.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_ptr + base + HALF, o2.to(y_ptr.dtype.element_ty), mask=mask)


def _rope_launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    n, nh, d = x.shape
    x = x.contiguous()
    y = torch.empty_like(x)
    if n:
        bd = next_pow2(d // 2)
        rows = max(1, _TILE_ELEMS // bd)
        _rope_kernel[(triton.cdiv(n * nh, rows),)](
            x,
            cos.float().contiguous(),
            sin.float().contiguous(),
            y,
            n * nh,
            nh,
            d // 2,
            sign,
            ROWS=rows,
            BD=bd,
            num_warps=4,
        )
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
    """Triton :func:`shared_numerics.rope.apply_rope` (``x [N, heads, D]``; elementwise, rows packed per program)."""
    return _Rope.apply(x, cos, sin)


@triton.jit
def _silu_fwd(g_ptr, u_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, (g / (1.0 + tl.exp(-g)) * u).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_bwd(g_ptr, u_ptr, gy_ptr, gg_ptr, gu_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    gy = tl.load(gy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g))
    tl.store(gu_ptr + offs, (gy * g * sig).to(gu_ptr.dtype.element_ty), mask=mask)
    tl.store(gg_ptr + offs, (gy * u * sig * (1.0 + g * (1.0 - sig))).to(gg_ptr.dtype.element_ty), mask=mask)


_EW_BLOCK = 2048  # elements per program (vectorised: 8 per thread with 8 warps)


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        gate, up = gate.contiguous(), up.contiguous()
        y = torch.empty_like(gate)
        n = gate.numel()
        if n:
            _silu_fwd[(triton.cdiv(n, _EW_BLOCK),)](gate, up, y, n, BLOCK=_EW_BLOCK, num_warps=8)
        ctx.save_for_backward(gate, up)
        return y

    @staticmethod
    def backward(ctx, gy):
        gate, up = ctx.saved_tensors
        gg, gu = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        if n:
            _silu_bwd[(triton.cdiv(n, _EW_BLOCK),)](gate, up, gy.contiguous(), gg, gu, n, BLOCK=_EW_BLOCK, num_warps=8)
        return gg, gu


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Triton :func:`shared_numerics.activation.silu_and_mul` (elementwise; result in ``gate.dtype``)."""
    return _SiluMul.apply(gate, up)
