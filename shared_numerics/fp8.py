"""One FP8 (e4m3fn) quantizer and a batch-invariant FP8 GEMM, shared by vLLM serving and TorchTitan QAT.

Definition (every step in float32, in this order):

* **Activations**, dynamic, per token (``"per_channel"`` granularity) or per 1×128 group of a token (``"block"``):
  ``amax = max|x|`` over the token (group); ``s = max(amax / 448, 1 / (448 * 512))``; ``q = e4m3(clamp(x / s, ±448))``.
* **Weights** ``[N, K]``, per output channel (``"per_channel"``) or per 128×128 block (``"block"``), same formula with
  the amax over the channel (block).
* ``e4m3`` is PyTorch's float32 → ``float8_e4m3fn`` conversion: round to nearest, ties to even. ``amax / s`` can
  round to just above 448; the clamp is explicit because saturation differs between implementations (PyTorch 2.13's
  CPU cast saturates, e4m3fn itself has no infinity and non-saturating conversions such as CUDA's ``__NV_NOSAT``
  give NaN), so the definition does not depend on the cast's overflow behaviour.
* The floor ``1 / (448 * 512)`` is vLLM's ``_FP8_MIN_SCALING_FACTOR``: an all-zero token gets a finite scale and
  all-zero codes instead of ``0 / 0``. ``x / s`` is a true division (vLLM's CUDA per-token kernel and DeepSeek-V3's
  ``act_quant`` divide; vLLM's native per-token path multiplies by ``1 / s``, which gives different codes).
* Non-finite inputs (±inf, NaN) are refused: :class:`Fp8QuantizationError`.
* **GEMM** (``fp8_linear``): on a CPU with AMX the codes, as bf16 values (exact: every e4m3fn value is a bf16 value),
  go through the AMX bf16 kernel with float32 output (:func:`shared_numerics.gemm_cpu.gemm_abt`; exact products,
  float32 accumulation in fixed 32-element K steps); elsewhere they are widened to float32 (exact) and multiplied with
  the fixed-tile matmul of :mod:`shared_numerics.linear` (float32 accumulation). Either way each row is independent
  of the others (the machine decides which: ``gemm_partition()`` in the numerics contract); epilogue
  ``(acc * s_x) * s_w``. ``"block"``: one such product per 128-wide K block, scaled, then summed over the K blocks in
  increasing order — DeepSeek-V3's recipe (fp32 promotion every 128 K elements, arXiv 2412.19437 §3.3.2).
  The result is rounded once to the activation dtype.

Other recipes differ on purpose: torchao's ``Float8FakeQuantizer`` computes ``amax / 448`` in the input dtype (bf16)
with no floor (an all-zero row gives NaN); ``torch._scaled_mm`` on CPU rounds differently from this GEMM (see
``tests/test_fp8.py`` for all three negative controls).

On CPU the activation quantizer and the widening of codes run compiled (``csrc/fp8.cpp``: the same steps in one pass,
c10's e4m3fn rounding; torch's float8 conversions are scalar loops), bitwise the torch definition above.

Sources: vLLM ``model_executor/layers/quantization/input_quant_fp8.py`` (per-token scale, floor) and
``utils/fp8_utils.py`` (block shapes); DeepSeek-V3 ``inference/kernel.py`` (``act_quant``, 128×128 weight blocks).
"""

from __future__ import annotations

from typing import Literal

import torch

from zerokld_plugins.errors import ZeroKLDClientError

from . import cpu_ops
from .cpu_kernels import plain
from .gemm_cpu import amx_available, gemm_abt
from .linear import matmul_rows
from .reduce import true_divide

__all__ = [
    "BLOCK",
    "FP8_DTYPE",
    "FP8_MAX",
    "FP8_MIN_SCALE",
    "Fp8QuantizationError",
    "Granularity",
    "fp8_values",
    "dequantize_fp8_weight",
    "fp8_linear",
    "fp8_linear_qat",
    "fp8_weight_qat",
    "quantize_fp8_activation",
    "quantize_fp8_weight",
    "served_fp8_weight",
    "weight_scale_shape",
]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
BLOCK = 128
Granularity = Literal["per_channel", "block"]
GRANULARITIES = ("per_channel", "block")


class Fp8QuantizationError(ZeroKLDClientError, ValueError):
    """Raised for input the FP8 quantizer refuses (non-finite values, unknown granularity, bad shapes)."""


def _dequantize_activation_bf16(v: torch.Tensor, s: torch.Tensor, granularity: Granularity) -> torch.Tensor:
    """``(values.float() * scale).to(torch.bfloat16)`` for an activation's bf16 code values ``v [M, K]`` (plain CPU),
    compiled."""
    v = v.contiguous()
    m, k = v.shape
    out = torch.empty((m, k), dtype=torch.bfloat16)
    if v.numel():
        cpu_ops.fp8_dequantize_bf16(v, s.contiguous(), k if granularity == "per_channel" else BLOCK, out)
    return out


def _compiled(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` as a plain CPU float32/bf16 tensor the compiled kernels may read, else ``None``."""
    p = plain(x)
    return p if p is not None and p.dtype in (torch.float32, torch.bfloat16) else None


def _quantize_compiled(x: torch.Tensor, granularity: Granularity, codes: bool, values: bool):
    """``csrc/fp8.cpp``'s quantizer on ``x [M, K]`` (plain CPU): ``(codes fp8 or None, values bf16 or None,
    scales)``."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    group = k if granularity == "per_channel" else BLOCK
    q = torch.empty((m, k), dtype=torch.uint8) if codes else None
    v = torch.empty((m, k), dtype=torch.bfloat16) if values else None
    s = torch.empty((m, max(1, -(-k // group))), dtype=torch.float32)
    if m and k:
        if not cpu_ops.fp8_quantize(x, group, q, v, s):
            raise Fp8QuantizationError("FP8 quantization of activations: input contains inf or NaN")
    elif m:
        s.fill_(FP8_MIN_SCALE)
    return None if q is None else q.view(FP8_DTYPE), v, s


def fp8_values(codes: torch.Tensor) -> torch.Tensor:
    """The values of ``float8_e4m3fn`` codes as bf16 (exact), same shape: what the AMX GEMM multiplies. Compiled
    table lookup on CPU (``csrc/fp8.cpp``), ``codes.to(torch.bfloat16)`` elsewhere; bitwise equal."""
    p = plain(codes)
    if p is None or codes.dtype != FP8_DTYPE:
        return codes.to(torch.bfloat16)
    p = p.contiguous()
    out = torch.empty(p.shape, dtype=torch.bfloat16)
    if p.numel():
        cpu_ops.fp8_to_bf16(p, out)
    return out


def _check_granularity(granularity: Granularity) -> None:
    if granularity not in GRANULARITIES:
        raise Fp8QuantizationError(f"unknown FP8 granularity {granularity!r}; expected one of {GRANULARITIES}")


def _scales(amax: torch.Tensor, what: str) -> torch.Tensor:
    if not bool(torch.isfinite(amax).all()):
        raise Fp8QuantizationError(f"FP8 quantization of {what}: input contains inf or NaN")
    return torch.clamp(true_divide(amax, FP8_MAX), min=FP8_MIN_SCALE)  # IEEE division on CUDA too


def _encode(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return torch.clamp(x / s, -FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _pad_k(x: torch.Tensor) -> torch.Tensor:
    pad = (-x.shape[-1]) % BLOCK
    return torch.nn.functional.pad(x, (0, pad)) if pad else x


def quantize_fp8_activation(
    x: torch.Tensor, granularity: Granularity = "per_channel"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic FP8 quantization of activations.

    Args:
        x: ``[M, K]`` float32 or bfloat16.
        granularity: ``"per_channel"`` (one scale per token) or ``"block"`` (one per token per 128-wide K group).

    Returns:
        ``(codes, scales)``: ``[M, K]`` ``float8_e4m3fn`` and float32 scales ``[M, 1]`` (per token) or
        ``[M, ceil(K / 128)]`` (block). Row ``i`` depends only on ``x[i]``.

    Raises:
        Fp8QuantizationError: ``x`` has inf/NaN, or the granularity is unknown.
    """
    _check_granularity(granularity)
    if (p := _compiled(x)) is not None and x.dim() == 2:
        q, _, s = _quantize_compiled(p, granularity, codes=True, values=False)
        return q, s
    return _quantize_activation_torch(x, granularity)


def _quantize_activation_torch(x: torch.Tensor, granularity: Granularity) -> tuple[torch.Tensor, torch.Tensor]:
    """The activation quantizer's definition as torch ops (GPUs and the reference the compiled one is tested on)."""
    xf = x.float()
    if granularity == "per_channel":
        s = _scales(xf.abs().amax(dim=-1, keepdim=True), "activations")
        return _encode(xf, s), s
    m, k = xf.shape
    g = _pad_k(xf).view(m, -1, BLOCK)
    s = _scales(g.abs().amax(dim=-1), "activations")  # [M, KB]
    q = _encode(g, s.unsqueeze(-1)).view(m, -1)[:, :k]
    return q, s


def weight_scale_shape(n: int, k: int, granularity: Granularity) -> tuple[int, ...]:
    """The shape of :func:`quantize_fp8_weight`'s scales for an ``[n, k]`` weight: ``(n,)`` per channel,
    ``(ceil(n / 128), ceil(k / 128))`` per block (what a ``zerokld_fp8`` checkpoint's ``weight_scale`` holds)."""
    _check_granularity(granularity)
    return (n,) if granularity == "per_channel" else (-(-n // BLOCK), -(-k // BLOCK))


def quantize_fp8_weight(w: torch.Tensor, granularity: Granularity = "per_channel") -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 quantization of a weight in ``nn.Linear`` layout.

    Args:
        w: ``[N, K]`` float32 or bfloat16 — the weight *as served* (a bf16 model is quantized from its bf16 values).
        granularity: ``"per_channel"`` (one scale per output row) or ``"block"`` (one per 128×128 block).

    Returns:
        ``(codes, scales)``: ``[N, K]`` ``float8_e4m3fn`` and float32 scales ``[N]`` or ``[ceil(N/128), ceil(K/128)]``.

    Raises:
        Fp8QuantizationError: non-finite weights, unknown granularity, or ``w`` not 2-D.
    """
    _check_granularity(granularity)
    if w.dim() != 2:
        raise Fp8QuantizationError(f"FP8 weight quantization expects [N, K], got shape {tuple(w.shape)}")
    wf = w.float()
    if granularity == "per_channel":
        s = _scales(wf.abs().amax(dim=1), "weights")
        return _encode(wf, s.unsqueeze(1)), s
    n, k = wf.shape
    pn = (-n) % BLOCK
    blocks = _pad_k(torch.nn.functional.pad(wf, (0, 0, 0, pn)) if pn else wf)
    nb, kb = blocks.shape[0] // BLOCK, blocks.shape[1] // BLOCK
    blocks = blocks.view(nb, BLOCK, kb, BLOCK)
    s = _scales(blocks.abs().amax(dim=(1, 3)), "weights")  # [NB, KB]
    q = _encode(blocks, s[:, None, :, None]).view(nb * BLOCK, kb * BLOCK)[:n, :k]
    return q.contiguous(), s


def _expand_block_scales(s: torch.Tensor, n: int, k: int) -> torch.Tensor:
    return s.repeat_interleave(BLOCK, dim=0)[:n].repeat_interleave(BLOCK, dim=1)[:, :k]


def dequantize_fp8_weight(q: torch.Tensor, s: torch.Tensor, granularity: Granularity = "per_channel") -> torch.Tensor:
    """``codes * scale`` in float32, ``[N, K]`` (used by the QAT backward and by tests; not by the GEMM). ``q``: the
    ``float8_e4m3fn`` codes or their bf16 values (:func:`fp8_values`), the same result."""
    _check_granularity(granularity)
    if granularity == "per_channel":
        return q.float() * s.unsqueeze(1)
    return q.float() * _expand_block_scales(s, *q.shape)


def served_fp8_weight(q: torch.Tensor, s: torch.Tensor, granularity: Granularity, dtype: torch.dtype) -> torch.Tensor:
    """The high-precision weight an FP8 checkpoint serves where a projection's weight is used as a tensor, not
    through :func:`fp8_linear` (MLA's ``kv_b_proj``, absorbed per head: :mod:`shared_numerics.mla`):
    ``dequantize_fp8_weight(q, s)`` rounded once to the model dtype ``dtype``. vLLM does the same for DeepSeek's FP8
    checkpoints (its MLA ``process_weights_after_loading`` dequantizes ``kv_b_proj`` before splitting W_UK / W_UV).

    Returns:
        ``[N, K]`` in ``dtype``.
    """
    return dequantize_fp8_weight(q, s, granularity).to(dtype)


class _Fp8WeightSTE(torch.autograd.Function):
    """Forward: :func:`served_fp8_weight` of ``quantize_fp8_weight(weight)`` in ``weight.dtype``; backward: the
    identity (straight-through estimator)."""

    @staticmethod
    def forward(ctx, weight, granularity):
        return served_fp8_weight(*quantize_fp8_weight(weight.detach(), granularity), granularity, weight.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def fp8_weight_qat(weight: torch.Tensor, granularity: Granularity = "per_channel") -> torch.Tensor:
    """FP8 fake-quantized weight for a projection used as a tensor (MLA's absorbed ``kv_b_proj``): bit for bit what
    the server uses — :func:`served_fp8_weight` of the weight's codes — with a straight-through gradient.

    Args:
        weight: ``[N, K]`` float32 or bfloat16, in the dtype it is served from.
        granularity: ``"per_channel"`` or ``"block"``.

    Returns:
        ``[N, K]`` in ``weight.dtype``. Differentiable (identity gradient).

    Raises:
        Fp8QuantizationError: non-finite weights, unknown granularity, not 2-D.
    """
    _check_granularity(granularity)
    return _Fp8WeightSTE.apply(weight, granularity)


def _dequantize_activation(q: torch.Tensor, s: torch.Tensor, granularity: Granularity) -> torch.Tensor:
    if granularity == "per_channel":
        return q.float() * s
    m, k = q.shape
    return (_pad_k(q.float()).view(m, -1, BLOCK) * s.unsqueeze(-1)).view(m, -1)[:, :k]


def _fma_product(qx: torch.Tensor, qw: torch.Tensor) -> torch.Tensor:
    """``qx @ qw.T`` in float32 on the FMA kernel (the codes widened to float32, exact)."""
    return matmul_rows(qx.float(), qw.float().t())


def _amx_product(vx: torch.Tensor, vw: torch.Tensor) -> torch.Tensor:
    """``vx @ vw.T`` with float32 output on the AMX kernel (``vx``, ``vw``: the codes' bf16 values)."""
    return gemm_abt(vw, vx, transpose=True, out_dtype=torch.float32)


def _gemm(
    qx: torch.Tensor,
    sx: torch.Tensor,
    qw: torch.Tensor,
    sw: torch.Tensor,
    granularity: Granularity,
    product=_fma_product,
) -> torch.Tensor:
    """float32 ``[M, N]`` product of FP8 operands: fixed tiles, fixed K-block order, fixed epilogue
    ``(acc * s_x) * s_w`` (in place on a fresh accumulator: the same roundings). ``product``: the row-invariant GEMM
    of one K range (:func:`_fma_product`, or :func:`_amx_product` on the codes' bf16 values)."""
    n, k = qw.shape
    if granularity == "per_channel":
        return product(qx, qw).mul_(sx).mul_(sw.unsqueeze(0))
    out: torch.Tensor | None = None
    sw_rows = sw.repeat_interleave(BLOCK, dim=0)[:n]  # [N, KB]
    for b in range((k + BLOCK - 1) // BLOCK):
        lo, hi = b * BLOCK, min(k, (b + 1) * BLOCK)
        part = product(qx[:, lo:hi], qw[:, lo:hi]).mul_(sx[:, b : b + 1]).mul_(sw_rows[:, b])
        out = part if out is None else out.add_(part)
    assert out is not None  # k >= 1
    return out


def _gemm_amx(
    vx: torch.Tensor, sx: torch.Tensor, vw: torch.Tensor, sw: torch.Tensor, granularity: Granularity
) -> torch.Tensor:
    """:func:`_gemm` on the AMX kernel: ``vx [M, K]``, ``vw [N, K]`` the codes' bf16 values."""
    return _gemm(vx, sx, vw, sw, granularity, _amx_product)


def _quantized_product(x2: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor, granularity: Granularity, amx: bool):
    """``(y float32 [M, N], activation operand, its scales, weight operand)`` of the FP8 GEMM of ``x2 [M, K]`` with
    the codes ``qw``: on AMX the operands are the codes' bf16 values, else the codes."""
    if amx:
        plain_x = _compiled(x2)
        assert plain_x is not None  # amx: only chosen for a plain CPU tensor
        _, qx, sx = _quantize_compiled(plain_x, granularity, codes=False, values=True)
        qw = fp8_values(qw)
        return _gemm_amx(qx, sx, qw, sw, granularity), qx, sx, qw
    qx, sx = quantize_fp8_activation(x2, granularity)
    return _gemm(qx, sx, qw, sw, granularity), qx, sx, qw


def _on_amx(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Does this product take the AMX path (a CPU with AMX, plain CPU operands)?"""
    return amx_available() and _compiled(x) is not None and all(plain(w) is not None for w in weights)


def check_fp8_weight(x: torch.Tensor, qweight: torch.Tensor) -> None:
    """Raise :class:`Fp8QuantizationError` unless ``qweight`` is ``float8_e4m3fn [N, K]`` with ``K = x.shape[-1]``."""
    if qweight.dtype != FP8_DTYPE or qweight.dim() != 2 or qweight.shape[1] != x.shape[-1]:
        raise Fp8QuantizationError(
            f"fp8_linear: weight must be float8_e4m3fn [N, {x.shape[-1]}], got {qweight.dtype} {tuple(qweight.shape)}"
        )


def fp8_linear(
    x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor, granularity: Granularity = "per_channel"
) -> torch.Tensor:
    """Batch-invariant FP8 ``linear`` with a pre-quantized weight (the serving path).

    Args:
        x: ``[..., K]`` float32 or bfloat16 activations (quantized here, dynamically).
        qweight: ``[N, K]`` ``float8_e4m3fn`` codes from :func:`quantize_fp8_weight`.
        weight_scale: its float32 scales.
        granularity: must match the weight's.

    Returns:
        ``[..., N]`` in ``x.dtype``; each row depends only on its own input row.

    Raises:
        Fp8QuantizationError: non-finite activations, unknown granularity, or a K mismatch.
    """
    check_fp8_weight(x, qweight)
    _check_granularity(granularity)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    y = _quantized_product(x2, qweight, weight_scale.float(), granularity, _on_amx(x2, qweight))[0]
    return y.to(x.dtype).reshape(*lead, qweight.shape[0])


class _Fp8LinearSTE(torch.autograd.Function):
    """Forward: exactly :func:`fp8_linear` of the quantized weight. Backward: straight-through estimator — the
    gradients of ``y = fq(x) @ fq(W)^T`` with respect to ``fq(x)`` and ``fq(W)``, passed through the quantizers as the
    identity (Jacob et al. 2018; Bengio et al. 2013)."""

    @staticmethod
    def forward(ctx, x, weight, granularity, chain=None):
        ctx.chain = chain
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        qw, sw = quantize_fp8_weight(weight.detach(), granularity)
        ctx.amx = _on_amx(x2, weight)
        # the operands the GEMM used (on AMX the codes' bf16 values) are what the backward dequantizes
        y, qx, sx, qw = _quantized_product(x2, qw, sw, granularity, ctx.amx)
        ctx.save_for_backward(qx, sx, qw, sw)
        ctx.granularity, ctx.x_dtype, ctx.w_dtype, ctx.x_shape = granularity, x.dtype, weight.dtype, x.shape
        return y.to(x.dtype).reshape(*lead, weight.shape[0])

    @staticmethod
    def backward(ctx, gy):
        qx, sx, qw, sw = ctx.saved_tensors
        grad_x = grad_w = None
        if ctx.amx and gy.dtype == torch.bfloat16 and plain(gy) is not None:
            # a bf16 model on AMX: both GEMMs on the AMX kernel with bf16 operands — dY as given, the dequantized
            # codes rounded to bf16 (what a bf16 trainer's backward multiplies) — float32 accumulation
            g = gy.reshape(-1, gy.shape[-1])
            if ctx.needs_input_grad[0]:
                w_dq = dequantize_fp8_weight(qw, sw, ctx.granularity).to(torch.bfloat16)
                grad_x = gemm_abt(w_dq.t(), g, transpose=True, out_dtype=torch.float32)
                grad_x = grad_x.to(ctx.x_dtype).reshape(ctx.x_shape)
            if ctx.needs_input_grad[1]:
                x_dq = _dequantize_activation_bf16(qx, sx, ctx.granularity)
                if ctx.chain is not None:  # dW's chains over the tokens go on (shared_numerics.grad_chain)
                    ctx.chain.add_gemm(g.t(), x_dq.t())
                else:
                    grad_w = gemm_abt(g.t(), x_dq.t(), out_dtype=torch.float32).to(ctx.w_dtype)
            return grad_x, grad_w, None, None
        g = gy.reshape(-1, gy.shape[-1]).float()
        if ctx.needs_input_grad[0]:
            w_dq = dequantize_fp8_weight(qw, sw, ctx.granularity)
            grad_x = matmul_rows(g, w_dq).to(ctx.x_dtype).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            x_dq = _dequantize_activation(qx, sx, ctx.granularity)
            if ctx.chain is not None:
                ctx.chain.add_gemm(g.t(), x_dq.t())
            else:
                grad_w = (g.t() @ x_dq).to(ctx.w_dtype)
        return grad_x, grad_w, None, None


def fp8_linear_qat(
    x: torch.Tensor, weight: torch.Tensor, granularity: Granularity = "per_channel", *, weight_chain=None
) -> torch.Tensor:
    """FP8 fake-quant ``linear`` for quantization-aware training: the forward is bit for bit :func:`fp8_linear` of
    ``quantize_fp8_weight(weight)``; the backward is the straight-through estimator (deterministic): float32 GEMMs
    of the dequantized operands, or for bf16 activations on an AMX CPU the AMX kernel's bf16 GEMMs (the dequantized
    operands rounded to bf16, float32 accumulation — a bf16 trainer's backward precision).

    Args:
        x: ``[..., K]`` float32 or bfloat16.
        weight: ``[N, K]`` high-precision weight in the dtype it is served from (bf16 under mixed precision).
        granularity: ``"per_channel"`` or ``"block"``.
        weight_chain: a :class:`shared_numerics.grad_chain.GradChain` of ``[N, K]`` that the straight-through
            ``dW`` (the same operands) continues over the tokens instead of returning it to autograd (exact
            accumulation over micro-batches); on a CPU where :func:`shared_numerics.grad_chain.chain_available`
            holds for ``x.dtype`` (bf16 on AMX: tokens a multiple of
            :data:`~shared_numerics.grad_chain.CHAIN_K_MULTIPLE`).

    Returns:
        ``[..., N]`` in ``x.dtype``.

    Raises:
        Fp8QuantizationError: non-finite input or weight, unknown granularity.
        ValueError: ``weight_chain`` off a CPU whose kernels cover ``x.dtype``.
    """
    _check_granularity(granularity)
    if weight_chain is not None:
        from .grad_chain import chain_available

        if x.device.type != "cpu" or not chain_available(x.dtype):
            raise ValueError(
                f"an FP8 weight chain needs a CPU whose kernels cover {x.dtype} gradients "
                f"(shared_numerics.grad_chain.chain_available)"
            )
    return _Fp8LinearSTE.apply(x, weight, granularity, weight_chain)
