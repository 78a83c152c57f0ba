"""FP8 activation quantizer and FP8 GEMM as Triton kernels, with the definition of :mod:`shared_numerics.fp8`.

The quantizer rounds explicitly: scale and ``x / s`` use ``tl.div_rn`` (IEEE division; plain ``/`` may be approximate
on GPUs), and the e4m3 rounding is done in fp32 arithmetic — ties to even on the 3 mantissa bits (``2^-9`` steps in the
subnormal range) — before an exact conversion to ``float8e4nv``. Hardware and interpreter conversions therefore never
round (Triton's CPU interpreter does not round to nearest even, GPUs saturate or not depending on the instruction), and
the codes equal the torch backend's bit for bit; inf/NaN are flagged by the kernel and refused. Weights are quantized
by the torch definition (a once-per-load op on any device).

The GEMM is persistent with ``BLOCK_K`` = 128 and a tile picked by M (:func:`fp8_config`; the tile changes which
program computes an element, never its sum — checked bitwise across the tiles on an H200 by
``benchmarks/gpu_gemm.py``): e4m3 codes go straight into
``tl.dot`` where the GPU has FP8 tensor cores (sm89+; elsewhere widened to bf16, exactly), fp32 accumulation over K
in increasing order, epilogue ``(acc * s_x) * s_w`` — per 128-wide K block for ``"block"``, the blocks' scaled
products added in increasing order — exactly the order :mod:`shared_numerics.fp8` defines. Rows are independent, so
the result is batch invariant; against the torch backend (exact fp32 products of widened codes on CPU) it agrees to
fp32 rounding. The QAT backward (straight-through) runs two GEMMs of :mod:`.matmul` in the gradient's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import fp8 as ref
from ._common import next_pow2
from .matmul import SPLIT_FILL, gemm, num_programs, tile_offsets

__all__ = ["fp8_linear", "fp8_linear_qat", "quantize_fp8_activation", "quantize_fp8_weight"]

quantize_fp8_weight = ref.quantize_fp8_weight


@triton.jit
def _e4m3_round(y):
    """fp32 ``y`` with ``|y| <= 448`` -> the nearest e4m3 value (ties to even), as fp32."""
    a = tl.abs(y)
    bits = a.to(tl.int32, bitcast=True)
    # normal range (a >= 2^-6): keep 3 of 23 mantissa bits, round half to even on the 20 dropped bits
    lsb = (bits >> 20) & 1
    rounded = ((bits + 0x7FFFF + lsb) & ~0xFFFFF).to(tl.float32, bitcast=True)
    # subnormal range: multiples of 2^-9; 2^23 forces an integer fraction, fp32 addition rounds to even
    sub = ((a * 512.0 + 8388608.0) - 8388608.0) * 0.001953125
    r = tl.where(a < 0.015625, sub, rounded)
    return tl.where(y < 0, -r, r)


@triton.jit
def _quant_act(x_ptr, q_ptr, s_ptr, bad_ptr, K, NG, GROUP: tl.constexpr, BG: tl.constexpr):
    """Program (row, group): one scale for ``GROUP`` consecutive elements of a row; ``bad`` flags inf/NaN."""
    row = tl.program_id(0)
    grp = tl.program_id(1)
    offs = grp * GROUP + tl.arange(0, BG)
    mask = (tl.arange(0, BG) < GROUP) & (offs < K)
    x = tl.load(x_ptr + row * K + offs, mask=mask, other=0.0).to(tl.float32)
    a = tl.abs(x)
    nonfinite = tl.sum(tl.where((a == float("inf")) | (x != x), 1, 0), axis=0)
    amax = tl.max(a, axis=0)
    s = tl.maximum(tl.div_rn(amax, 448.0), 1.0 / (448.0 * 512.0))
    y = tl.minimum(tl.maximum(tl.div_rn(x, s), -448.0), 448.0)
    tl.store(q_ptr + row * K + offs, _e4m3_round(y).to(tl.float8e4nv), mask=mask)
    tl.store(s_ptr + row * NG + grp, s)
    tl.store(bad_ptr + row * NG + grp, nonfinite)


def quantize_fp8_activation(x: torch.Tensor, granularity: str = "per_channel") -> tuple[torch.Tensor, torch.Tensor]:
    """Triton :func:`shared_numerics.fp8.quantize_fp8_activation` (``[M, K]``; same codes and scales).

    Raises:
        Fp8QuantizationError: inf or NaN in ``x`` (flagged by the kernel; one small device-to-host read).
    """
    ref._check_granularity(granularity)  # type: ignore[arg-type]  # (its message names a bad value)
    x = x.contiguous()
    m, k = x.shape
    group = k if granularity == "per_channel" else ref.BLOCK
    ng = triton.cdiv(k, group)
    q = torch.empty((m, k), dtype=ref.FP8_DTYPE, device=x.device)
    s = torch.empty((m, ng), dtype=torch.float32, device=x.device)
    bad = torch.zeros((m, ng), dtype=torch.int32, device=x.device)
    if m and k:
        _quant_act[(m, ng)](x, q, s, bad, k, ng, GROUP=group, BG=next_pow2(group))
        if bool(bad.any()):
            raise ref.Fp8QuantizationError("FP8 quantization of activations: input contains inf or NaN")
    return q, s


# The bits depend on BLOCK_K = 128 (the granularity's K block) and the dot's input type, not on the tile. The
# blockwise kernel takes the 64-row tile only: at 128 x 256 Triton 3.9 spills it (zerokld_testing.triton_aot).
#: tiles of the FP8 GEMM (``BK`` = 128 in every one: it defines the bits). Measured on an H200 (4096 -> 12288,
#: ``benchmarks/results/gpu_gemm_h200.json`` ``fp8_configs``): at M = 4096 per-channel 128x256 ran 0.31 ms (cuBLAS
#: ``_scaled_mm`` 0.31, the former 128x128 / 2 stages 0.71); 64x128 ran M <= 64 at 0.02 ms and the blockwise GEMM
#: fastest at every M (0.74 ms at M = 4096 against 1.05 for 128x256)
FP8_CONFIGS = {
    "decode": dict(BM=64, BN=128, BK=128, GROUP_M=8, num_stages=4, num_warps=4),
    "prefill": dict(BM=128, BN=256, BK=128, GROUP_M=8, num_stages=3, num_warps=8),
}


def fp8_config(m: int, n: int, granularity: str, device: torch.device) -> dict:
    """The FP8 GEMM's tile for ``m`` rows: 64-row tiles for blockwise scales and for per-channel calls whose
    128 x 256 tiles would fill less than :data:`~.matmul.SPLIT_FILL` of the SMs, else 128 x 256. The bits are the
    same for either."""
    big = FP8_CONFIGS["prefill"]
    if granularity == "block" or triton.cdiv(m, big["BM"]) * triton.cdiv(n, big["BN"]) < SPLIT_FILL * num_programs(
        device
    ):
        return FP8_CONFIGS["decode"]
    return big


@triton.jit
def _fp8_gemm(
    qx_ptr,
    sx_ptr,
    qw_ptr,
    sw_ptr,
    y_ptr,
    M,
    N,
    K,
    NGX,
    NGW,
    BLOCKWISE: tl.constexpr,
    NATIVE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
):
    """Persistent FP8 GEMM. ``NATIVE``: e4m3 operands straight into ``tl.dot`` (sm89+); else widened to bf16
    (exact: every e4m3 value is a bf16 value). ``BLOCKWISE``: ``BK`` = 128 = one K block per dot, each block's
    product scaled and added in increasing block order (DeepSeek-V3's fp32 promotion)."""
    rk0 = tl.arange(0, BK)
    for tile_id in tl.range(tl.program_id(0), tl.cdiv(M, BM) * tl.cdiv(N, BN), NUM_PROGRAMS, flatten=True):
        rm, rn = tile_offsets(tile_id, M, N, BM, BN, GROUP_M)
        # rows past M are not read (a clamped row read by every program was a hot spot at M = 1); columns past N
        # read column 0 (never stored)
        ra = rm
        rb = tl.where(rn < N, rn, 0)
        out = tl.zeros((BM, BN), dtype=tl.float32)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + rk0
            a = tl.load(qx_ptr + ra[:, None] * K + kk[None, :], mask=(ra[:, None] < M) & (kk[None, :] < K), other=0.0)
            b = tl.load(qw_ptr + rb[None, :] * K + kk[:, None], mask=kk[:, None] < K, other=0.0)
            if not NATIVE:
                a = a.to(tl.bfloat16)
                b = b.to(tl.bfloat16)
            if BLOCKWISE:
                part = tl.dot(a, b, tl.zeros((BM, BN), dtype=tl.float32))
                g = k0 // BK
                sx = tl.load(sx_ptr + ra * NGX + g, mask=ra < M, other=0.0)
                sw = tl.load(sw_ptr + (rb // BK) * NGW + g)
                out = out + (part * sx[:, None]) * sw[None, :]
            else:
                acc = tl.dot(a, b, acc)
        if not BLOCKWISE:
            sx = tl.load(sx_ptr + ra, mask=ra < M, other=0.0)
            sw = tl.load(sw_ptr + rb)
            out = (acc * sx[:, None]) * sw[None, :]
        tl.store(
            y_ptr + rm[:, None] * N + rn[None, :],
            out.to(y_ptr.dtype.element_ty),
            mask=(rm[:, None] < M) & (rn[None, :] < N),
        )


def _native_fp8(device: torch.device) -> bool:
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


def _gemm(qx, sx, qw, sw, granularity, out_dtype, config=None):
    m, k = qx.shape
    n = qw.shape[0]
    y = torch.empty((m, n), dtype=out_dtype, device=qx.device)
    if m and n:
        sw = sw.float().contiguous()
        cfg = config or fp8_config(m, n, granularity, qx.device)
        programs = min(num_programs(qx.device), triton.cdiv(m, cfg["BM"]) * triton.cdiv(n, cfg["BN"]))
        _fp8_gemm[(programs,)](
            qx,
            sx.contiguous(),
            qw.contiguous(),
            sw,
            y,
            m,
            n,
            k,
            sx.shape[1],
            sw.shape[1] if sw.dim() == 2 else 1,
            BLOCKWISE=granularity == "block",
            NATIVE=_native_fp8(qx.device),
            NUM_PROGRAMS=programs,
            **cfg,
        )
    return y


def fp8_linear(x, qweight, weight_scale, granularity="per_channel"):
    """Triton :func:`shared_numerics.fp8.fp8_linear`."""
    ref.check_fp8_weight(x, qweight)
    lead = x.shape[:-1]
    qx, sx = quantize_fp8_activation(x.reshape(-1, x.shape[-1]), granularity)
    return _gemm(qx, sx, qweight, weight_scale, granularity, x.dtype).reshape(*lead, qweight.shape[0])


class _Fp8LinearSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, granularity):
        x2 = x.reshape(-1, x.shape[-1])
        qx, sx = quantize_fp8_activation(x2, granularity)
        qw, sw = ref.quantize_fp8_weight(weight.detach(), granularity)
        ctx.save_for_backward(qx, sx, qw, sw)
        ctx.granularity, ctx.x_dtype, ctx.w_dtype, ctx.x_shape = granularity, x.dtype, weight.dtype, x.shape
        return _gemm(qx, sx, qw, sw, granularity, x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, gy):
        qx, sx, qw, sw = ctx.saved_tensors
        g = gy.reshape(-1, gy.shape[-1])
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            w_dq = ref.dequantize_fp8_weight(qw, sw, ctx.granularity).to(g.dtype)
            grad_x = gemm(g, w_dq, ctx.x_dtype).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            x_dq = ref._dequantize_activation(qx, sx, ctx.granularity).to(g.dtype)
            grad_w = gemm(g.t(), x_dq, ctx.w_dtype)
        return grad_x, grad_w, None


def fp8_linear_qat(x, weight, granularity="per_channel"):
    """Triton :func:`shared_numerics.fp8.fp8_linear_qat` (forward == :func:`fp8_linear`, straight-through
    backward)."""
    ref._check_granularity(granularity)
    return _Fp8LinearSTE.apply(x, weight, granularity)
