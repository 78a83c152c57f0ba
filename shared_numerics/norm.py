"""Batch-invariant RMSNorm.

``y = (x * rsqrt(mean(x^2) + eps)) * w``, statistics in float32 with the fixed-tree sum of
:func:`shared_numerics.reduce.tree_sum`; one rounding to the input dtype at the end.

Source: Zhang & Sennrich, "Root Mean Square Layer Normalization" (2019); HF ``Qwen3RMSNorm`` / ``LlamaRMSNorm``
(statistics in float32). ``rsqrt`` and division are correctly rounded in both SIMD and scalar ATen paths, so they
need no float64 detour.

On CPU the compiled kernel ``csrc/pointwise.cpp`` runs the same operations in the same order in one pass (the same
bits: ``tests/test_numerics.py`` compares them). With autograd (the trainer) its backward is compiled too, one pass per
row: ``g = dy * w``, ``dx = r * (g - x̂ * (tree_sum(g * x̂) / H))`` (``x̂ = x * r``, ``r = rsqrt(ms + eps)``: a row's
``dx`` depends only on that row), and the gain's gradient ``Σ_rows dy * x̂`` summed in row order — or continuing an
exact-accumulation chain (:mod:`shared_numerics.grad_chain`). Elsewhere (other devices, DTensors) the torch ops below
and autograd.
"""

from __future__ import annotations

import torch

from . import cpu_ops
from .cpu_kernels import DTYPE_CODES
from .reduce import tree_sum


def _rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float, want_r: bool = False):
    """``y`` in ``x.dtype`` (and, ``want_r``, each row's ``rsqrt(ms + eps)`` float32 ``[rows]``)."""
    h = x.shape[-1]
    x2 = x.reshape(-1, h)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = weight.detach().float().contiguous()
    direct = x.dtype in (torch.float32, torch.bfloat16)  # written in x.dtype by the kernel (float16: rounded here)
    y = torch.empty(x2.shape, dtype=x.dtype if direct else torch.float32)
    r = torch.empty(x2.shape[0], dtype=torch.float32) if want_r else None
    cpu_ops.rms_norm(x2, w, float(eps), y, r)
    y = y.reshape(x.shape).to(x.dtype)
    return (y, r) if want_r else y


class _RmsNormCpu(torch.autograd.Function):
    """Training RMSNorm on CPU: the forward kernel (saving ``r``) and the compiled backward (see the module)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, chain) -> torch.Tensor:
        y, r = _rms_norm_cpu(x, weight, eps, want_r=True)
        ctx.save_for_backward(x, weight, r)
        ctx.chain, ctx.eps = chain, eps
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        from .cpu_kernels import plain

        x, weight, r = ctx.saved_tensors
        g = plain(grad)  # an AsyncCollectiveTensor (tensor parallelism) is waited for
        if g is None:  # another tensor subclass: autograd of the torch ops (the same definition)
            if ctx.chain is not None:
                raise TypeError(
                    f"rms_norm: an exact-accumulation chain needs plain gradients, got {type(grad).__name__}"
                )
            with torch.enable_grad():
                xr, wr = x.detach().requires_grad_(), weight.detach().requires_grad_()
                dx, dw_ref = torch.autograd.grad(_rms_norm_ops(xr, wr, ctx.eps), (xr, wr), grad)
            return dx, dw_ref if ctx.needs_input_grad[1] else None, None, None
        grad = g
        h = x.shape[-1]
        x2 = x.reshape(-1, h).contiguous()
        dy = grad.to(x.dtype).reshape(-1, h).contiguous()
        direct = x.dtype in (torch.float32, torch.bfloat16)
        dx = torch.empty(x2.shape, dtype=x.dtype if direct else torch.float32)
        chain = ctx.chain
        dw = None
        if chain is not None:
            dw = chain.acc
        elif ctx.needs_input_grad[1]:
            dw = torch.zeros(h, dtype=torch.float32)
        w = weight.detach().float().contiguous()
        if chain is not None and chain.log is not None:  # a recorded chain: dx now, the gain's additions later
            cpu_ops.rms_norm_backward(x2, dy, w, r, dx, None)
            chain.add(_chain_rms_norm_gain, x2, dy, w, r, dx.dtype)
        else:
            cpu_ops.rms_norm_backward(x2, dy, w, r, dx, dw)
        grad_w = None if chain is not None or dw is None else dw.to(weight.dtype)
        return dx.reshape(x.shape).to(x.dtype), grad_w, None, None


def _chain_rms_norm_gain(acc, x2, dy, w, r, dx_dtype) -> None:
    """The gain's gradient of :class:`_RmsNormCpu`'s backward added into ``acc`` (the same kernel; its ``dx`` is
    discarded)."""
    cpu_ops.rms_norm_backward(x2, dy, w, r, torch.empty(x2.shape, dtype=dx_dtype), acc)


class _HeadRmsNormCpu(torch.autograd.Function):
    """:class:`_RmsNormCpu` on ``x [..., heads, D]`` whose gain's gradient is one float32 sum per head (over the rows
    in order), the heads then added with the TP-aligned tree (:func:`head_tree_gain_grad`) — or, with a chain, the
    per-head sums kept in the chain's ``[heads, D]`` accumulator, to be added so when the gradient is written."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, chain, gather) -> torch.Tensor:
        ctx.gather = gather
        return _RmsNormCpu.forward(ctx, x, weight, eps, chain)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        from .cpu_kernels import plain

        x, weight, r = ctx.saved_tensors
        g = plain(grad)
        if g is None:
            raise TypeError(f"rms_norm(head_tree=True): plain gradients only, got {type(grad).__name__}")
        heads, d = x.shape[-2:]
        x3 = x.reshape(-1, heads, d)
        dy3 = g.to(x.dtype).reshape(-1, heads, d)
        r2 = r.view(-1, heads)
        w = weight.detach().float().contiguous()
        dx = torch.empty(x3.shape, dtype=x.dtype if x.dtype in (torch.float32, torch.bfloat16) else torch.float32)
        chain = ctx.chain
        if chain is None:  # the per-head sums of this call, if the gain's gradient is wanted
            acc = torch.zeros(heads, d) if ctx.needs_input_grad[1] else None
        else:  # the chain's (a recorded chain: its additions later, dx now)
            acc = chain.acc if chain.log is None else None
        _head_rows_backward(acc, x3, dy3, w, r2, dx)
        if chain is not None and chain.log is not None:
            chain.add(_head_rows_backward, x3, dy3, w, r2, torch.empty_like(dx))
        grad_w = None if chain is not None or acc is None else head_tree_gain_grad(acc, ctx.gather).to(weight.dtype)
        return dx.reshape(x.shape).to(x.dtype), grad_w, None, None, None


def _head_rows_backward(acc, x3, dy3, w, r2, dx) -> None:
    """The backward kernel on each head's rows of ``x3 [rows, heads, D]``: ``dx`` written, each head's gain
    gradient added into ``acc[h]`` (``acc [heads, D]`` float32, or ``None``)."""
    for h in range(x3.shape[1]):
        dxh = torch.empty(x3.shape[0], x3.shape[2], dtype=dx.dtype)
        cpu_ops.rms_norm_backward(
            x3[:, h].contiguous(),
            dy3[:, h].contiguous(),
            w,
            r2[:, h].contiguous(),
            dxh,
            None if acc is None else acc[h],
        )
        dx[:, h] = dxh


def head_tree_gain_grad(per_head: torch.Tensor, gather=None) -> torch.Tensor:
    """A per-head norm gain's gradient from its per-head sums ``[heads, D]`` float32: the heads added with the fixed
    TP-aligned tree (:func:`shared_numerics.tensor_parallel.block_tree_sum`), the TP ranks' subtree roots gathered
    (``gather``, :func:`shared_numerics.tensor_parallel.reduce_over_ranks`; ``None`` at TP 1). ``[D]`` float32, the
    same bits at every TP size (a power of two dividing the head count)."""
    from .tensor_parallel import block_tree_sum, reduce_over_ranks

    return reduce_over_ranks(block_tree_sum(per_head), gather)


__all__ = ["add_rms_norm", "head_tree_gain_grad", "rms_norm"]


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, weight_chain=None, head_tree: bool = False, gather=None
) -> torch.Tensor:
    """RMS-normalise the last dimension.

    Args:
        x: ``[..., H]`` float32 or bfloat16.
        weight: ``[H]`` gain.
        eps: added to the mean square (HF ``rms_norm_eps``).
        weight_chain: a :class:`shared_numerics.grad_chain.GradChain` that takes the gain's gradient (exact
            accumulation; none is returned to autograd; plain CPU tensors only: TypeError otherwise). The forward
            bits do not change.
        head_tree: ``x`` is ``[..., heads, D]`` (Qwen3's q/k norms, one gain for every head) and the gain's gradient
            is the TP-size-invariant one: a float32 sum per head over the rows in order, the heads added with the
            fixed TP-aligned tree (:func:`head_tree_gain_grad`); a ``weight_chain`` then has ``[heads, D]`` (the
            per-head sums; the tree runs when the gradient is written). Training on CPU (plain tensors) only; the
            forward and ``x``'s gradient keep their bits.
        gather: with ``head_tree`` under tensor parallelism (``x`` this rank's consecutive heads): the all-gather of
            the heads' subtree roots ``[1, D] -> [TP, D]``
            (:func:`shared_numerics.tensor_parallel.row_parallel_linear`'s); ``None`` at TP 1.

    Returns:
        ``[..., H]`` in ``x.dtype``; each row depends only on itself.
    """
    if x.device.type == "cpu" and x.dtype in DTYPE_CODES and x.numel():
        from .cpu_kernels import plain

        xp, wp = plain(x), plain(weight)
        if (
            head_tree
            and xp is not None
            and wp is not None
            and torch.is_grad_enabled()
            and (weight_chain is not None or x.requires_grad or weight.requires_grad)
        ):
            if weight_chain is not None and weight_chain.acc.shape != tuple(x.shape[-2:]):
                raise ValueError(
                    f"rms_norm: a per-head gain chain of {tuple(weight_chain.acc.shape)} for x {tuple(x.shape)}"
                )
            return _HeadRmsNormCpu.apply(xp, wp, eps, weight_chain, gather)
        if xp is not None and wp is not None:  # otherwise (DTensors, fake tensors) the torch ops: the same bits
            if weight_chain is not None:
                if weight_chain.acc.shape != (x.shape[-1],):
                    raise ValueError(
                        f"rms_norm: a gain chain of {tuple(weight_chain.acc.shape)} for rows of {x.shape[-1]}"
                    )
                return _RmsNormCpu.apply(xp, wp, eps, weight_chain)
            if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
                return _RmsNormCpu.apply(xp, wp, eps, None)
            return _rms_norm_cpu(xp, wp, eps)
    if weight_chain is not None:
        raise TypeError(
            f"rms_norm: an exact-accumulation chain needs plain CPU tensors, got {type(x).__name__} on {x.device}"
        )
    return _rms_norm_ops(x, weight, eps)


def _rms_norm_ops(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`rms_norm` as torch ops (any device; autograd differentiates them): the definition the CPU kernel
    reproduces bit for bit."""
    x32 = x.float()
    ms = tree_sum(x32 * x32, dim=-1, keepdim=True) / x.shape[-1]
    y = x32 * torch.rsqrt(ms + eps) * weight.float()
    return y.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
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
