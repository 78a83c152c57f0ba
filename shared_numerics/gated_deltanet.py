"""Gated DeltaNet (Qwen3-Next, Qwen3.5): the recurrent token mixer's arithmetic, one definition for prefill, decode
and the trainer.

A layer's projections (``sn.linear``) give, per token, the mixed ``q|k|v`` channels, the output gate ``z`` and the
gate inputs ``b`` (update rate) and ``a`` (decay); this module does the rest:

1. **Causal depthwise conv1d** over the mixed channels (kernel ``K``, 4 in every released config) with the ``K - 1``
   previous inputs as its state: ``y[t, c] = silu(sum_j w[c, j] x[t - K + 1 + j, c])``, the sum in float32 in the
   order ``j = 0 .. K-1`` (one multiply and one add per term, elementwise), SiLU in float32 as the SwiGLU's
   (:func:`shared_numerics.silu_and_mul` with a unit ``up``: on CPU one formula per element, Cephes' expf as plain
   arithmetic), rounded once to the activations' dtype.
2. **Gates** (float32): ``beta = sigmoid(b)``, ``g = -exp(A_log) * softplus(a + dt_bias)`` (softplus with torch's
   threshold 20; exp, sigmoid and log1p in float64, rounded once).
3. **q, k**: L2-normalised per head (``x * rsqrt(sum x^2 + 1e-6)``, the sum a fixed pairwise tree:
   :func:`shared_numerics.reduce.tree_sum`), ``q`` divided by ``sqrt(d_k)``; key heads repeated to the value heads.
4. **The gated delta rule**, token by token, the state ``S`` ``[value heads, d_k, d_v]`` in float32 whatever the
   model's dtype: ``S = exp(g_t) S``; ``u = sum_i S[i, :] k_t[i]``; ``S = S + k_t (beta_t (v_t - u))^T``;
   ``o_t = sum_i S[i, :] q_t[i]``, both sums over ``d_k`` in the fixed pairwise tree.
5. **Gated RMSNorm** per value head: ``o`` rounded to the activations' dtype, normalised by
   :func:`shared_numerics.rms_norm` with a unit gain (rounded), scaled by the weight in the activations' dtype, times
   ``silu(z)`` in float32 (``silu_and_mul(z, w x)``), rounded once.

Every step is elementwise IEEE arithmetic or a fixed-order sum, so a token's output depends only on its sequence's
earlier tokens: the same bits whatever the batch, wherever a prefill chunk ends and whether the token is prefilled or
decoded — prefill over ``T`` tokens is ``T`` decode steps, by construction (the recurrent form everywhere; a chunked
form's intra-chunk matrix products would tie a token's bits to its chunk's extent). What a sequence's cache holds
between steps: the conv state ``[K - 1, conv channels]`` in the activations' dtype and ``S`` in float32.

Source: Yang, Kautz, Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta Rule" (ICLR 2025); HF
``transformers`` ``modeling_qwen3_next.py`` (``Qwen3NextGatedDeltaNet.forward``, ``torch_recurrent_gated_delta_rule``,
``causal_conv1d_fn``, ``l2norm``, ``Qwen3NextRMSNormGated``), which this follows operation for operation up to the
summation orders.
"""

from __future__ import annotations

import itertools

import torch

from .reduce import exp64, sigmoid64, tree_sum, true_divide

__all__ = [
    "causal_conv1d",
    "causal_conv1d_varlen",
    "gated_delta_rule",
    "gated_delta_rule_varlen",
    "gated_deltanet_core",
    "gated_deltanet_varlen",
    "gated_rms_norm",
    "gdn_gates",
    "l2_normalize",
    "softplus64",
]

#: HF ``l2norm``'s epsilon (FLA's ``use_qk_l2norm_in_kernel``)
L2_EPS = 1e-6
#: torch's ``F.softplus`` threshold (beta 1): above it softplus(x) is x
SOFTPLUS_THRESHOLD = 20.0


def softplus64(x: torch.Tensor) -> torch.Tensor:
    """``F.softplus(x)`` (beta 1, threshold 20) with ``log1p(exp(x))`` evaluated in float64 and rounded once to
    float32 (position independent, :mod:`shared_numerics.reduce`). ``x``: float32, any shape. Differentiable."""
    soft = torch.log1p(torch.exp(x.double().clamp(max=SOFTPLUS_THRESHOLD))).float()
    return torch.where(x > SOFTPLUS_THRESHOLD, x, soft)


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv1d with SiLU over one sequence's new tokens (HF ``causal_conv1d_fn`` /
    ``causal_conv1d_update`` with ``activation="silu"`` and no bias, Qwen3-Next's).

    Args:
        x: ``[T, C]`` (``T >= 0``), float32 or bfloat16: the mixed ``q|k|v`` channels of the new tokens.
        weight: ``[C, K]``: ``conv1d.weight[:, 0, :]``.
        state: ``[K - 1, C]`` in ``x.dtype``: the sequence's previous ``K - 1`` inputs, oldest first (zeros before its
            first token); ``None``: a fresh sequence. Not modified.

    Returns:
        ``(y, state)``: ``y`` ``[T, C]`` in ``x.dtype`` and the new ``[K - 1, C]`` state (the last ``K - 1`` inputs).
        Differentiable (torch ops and :func:`shared_numerics.silu_and_mul`); without autograd on CPU the compiled
        kernel (:func:`causal_conv1d_varlen`), the same bits.
    """
    t, c = x.shape
    k = weight.shape[1]
    if state is None:
        state = x.new_zeros((k - 1, c))
    if state.shape != (k - 1, c):
        raise ValueError(f"conv state {tuple(state.shape)}, expected {(k - 1, c)}")
    cu = torch.tensor([0, t], dtype=torch.int64)
    y, states = causal_conv1d_varlen(x, weight, cu, state[None])
    return y, states[0]


def causal_conv1d_varlen(
    x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, states: torch.Tensor, inplace: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`causal_conv1d` over ``N`` sequences at once, each sequence's bits those of the one-sequence call.

    Args:
        x: ``[T, C]``, the tokens of every sequence (rows ``cu_seqlens[n] .. cu_seqlens[n + 1] - 1`` sequence
            ``n``'s). weight: ``[C, K]``.
        cu_seqlens: ``[N + 1]`` int64, from 0 to ``T``, nondecreasing.
        states: ``[N, K - 1, C]`` in ``x.dtype``, each sequence's previous inputs; modified only with ``inplace``.
        inplace: write the new states into ``states`` (contiguous, CPU, no autograd: a serving cache) and return it.

    Returns:
        ``(y, states)``: ``y`` ``[T, C]`` in ``x.dtype`` and every sequence's new state.

    On CPU without autograd the compiled kernel (``csrc/gdn.cpp``: these operations in this order); otherwise torch
    ops, per sequence.
    """
    from .activation import silu_and_mul

    t, c = x.shape
    k = weight.shape[1]
    cu_seqlens = cu_seqlens.to(torch.int64)
    n = cu_seqlens.numel() - 1
    if states.shape != (n, k - 1, c):
        raise ValueError(f"conv states {tuple(states.shape)}, expected {(n, k - 1, c)}")
    if inplace and (states.dtype != x.dtype or not states.is_contiguous()):
        raise ValueError("causal_conv1d_varlen(inplace=True) needs a contiguous states tensor in x's dtype")
    compiled = x.dtype in (torch.float32, torch.bfloat16) and all(z.device.type == "cpu" for z in (x, weight, states))
    if compiled and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        from . import cpu_ops

        s = states if inplace else states.to(x.dtype).clone().contiguous()
        y = torch.empty((t, c), dtype=x.dtype)
        cpu_ops.causal_conv1d_silu(cu_seqlens.contiguous(), x.contiguous(), weight.float().contiguous(), s, y)
        return y, s
    if inplace:
        raise ValueError("causal_conv1d_varlen(inplace=True) runs the compiled CPU kernel only (no autograd)")
    w = weight.float()
    ys, finals = [], []
    for i, (lo, hi) in enumerate(itertools.pairwise(cu_seqlens.tolist())):
        xx = torch.cat([states[i].to(x.dtype), x[lo:hi]], dim=0).float()
        acc = xx[0 : hi - lo] * w[:, 0]
        for j in range(1, k):
            acc = acc + xx[j : j + hi - lo] * w[:, j]
        ys.append(silu_and_mul(acc, torch.ones_like(acc)).to(x.dtype))
        finals.append(xx[hi - lo :].to(x.dtype))
    y = torch.cat(ys) if ys else x.new_zeros((0, c))
    return y, torch.stack(finals) if finals else states.clone()


def gdn_gates(
    a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decay and the update rate (HF ``Qwen3NextGatedDeltaNet.forward``).

    Args:
        a, b: ``[T, H]`` (the ``in_proj_ba`` / ``in_proj_a``, ``in_proj_b`` outputs), any float dtype.
        a_log, dt_bias: ``[H]``: the layer's ``A_log`` and ``dt_bias``.

    Returns:
        ``(g, beta)``, float32 ``[T, H]``: ``g = -exp(A_log) * softplus(a + dt_bias)`` (the log decay, ``<= 0``) and
        ``beta = sigmoid(b)``.
    """
    g = -exp64(a_log.float()) * softplus64(a.float() + dt_bias.float())
    return g, sigmoid64(b.float())


def l2_normalize(x: torch.Tensor, eps: float = L2_EPS, divisor: float = 1.0) -> torch.Tensor:
    """``x * rsqrt(sum(x^2, -1) + eps)`` in float32 (HF ``l2norm``), then divided by ``divisor`` (``true_divide``;
    q's ``sqrt(d_k)``), the sum the pairwise tree of :func:`shared_numerics.reduce.tree_sum`; ``rsqrt`` as
    :func:`shared_numerics.norm.rms_norm` takes it (ATen's ``torch.sqrt`` goes through oneMKL's VML, whose float32
    square root is not the correctly rounded one).

    Args:
        x: ``[..., D]``, any float dtype. eps: added to the sum of squares. divisor: a Python number.

    Returns:
        float32, ``x``'s shape. Differentiable; without autograd on CPU, for float32 / bfloat16 ``[T, heads, D]``
        rows with contiguous heads (a head-major slice of the conv's output), the compiled kernel
        (``csrc/gdn.cpp``), the same bits.
    """
    if (
        x.device.type == "cpu"
        and x.dim() == 3
        and x.dtype in (torch.float32, torch.bfloat16)
        and x.stride(2) == 1
        and (x.shape[1] == 1 or x.stride(1) == x.shape[2])
        and not (torch.is_grad_enabled() and x.requires_grad)
    ):
        from . import cpu_ops

        y = torch.empty(x.shape, dtype=torch.float32)
        cpu_ops.l2_normalize(x, eps, divisor, y)
        return y
    x = x.float()
    y = x * torch.rsqrt(tree_sum(x * x, dim=-1, keepdim=True) + eps)
    return y if divisor == 1.0 else true_divide(y, divisor)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one sequence's new tokens, token by token (HF ``torch_recurrent_gated_delta_rule``
    with the sums over ``d_k`` in the fixed pairwise tree).

    Args:
        q, k: ``[T, H, d_k]`` float32, L2-normalised, ``q`` already divided by ``sqrt(d_k)``, key heads already
            repeated to the ``H`` value heads.
        v: ``[T, H, d_v]``, any float dtype (used in float32).
        g, beta: ``[T, H]`` float32 (:func:`gdn_gates`).
        state: ``[H, d_k, d_v]`` float32, the sequence's state after its earlier tokens; ``None``: zeros. Not
            modified.

    Returns:
        ``(o, state)``: ``o`` ``[T, H, d_v]`` float32 and the state after the last token (float32).
    """
    t, h, dk = k.shape
    dv = v.shape[-1]
    s = torch.zeros((h, dk, dv), dtype=torch.float32) if state is None else state.float()
    if s.shape != (h, dk, dv):
        raise ValueError(f"recurrent state {tuple(s.shape)}, expected {(h, dk, dv)}")
    cu = torch.tensor([0, t], dtype=torch.int64)
    o, s = gated_delta_rule_varlen(q, k, v, g, beta, cu, s[None])
    return o, s[0]


def gated_delta_rule_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    states: torch.Tensor,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gated_delta_rule` over ``N`` sequences at once (what a serving step holds: decodes and prefill
    chunks), each sequence's bits those of the one-sequence call.

    Args:
        q, k, v, g, beta: the tokens of every sequence, rows ``cu_seqlens[n] .. cu_seqlens[n + 1] - 1`` sequence
            ``n``'s (shapes as :func:`gated_delta_rule`'s with ``T`` the total).
        cu_seqlens: ``[N + 1]`` int64, from 0 to ``T``, nondecreasing.
        states: ``[N, H, d_k, d_v]`` float32, each sequence's state; modified only with ``inplace``.
        inplace: write the new states into ``states`` (float32, contiguous, CPU, no autograd: a serving cache) and
            return it, instead of copying them first.

    Returns:
        ``(o, states)``: ``o`` ``[T, H, d_v]`` float32 and every sequence's state after its last token.

    On CPU the compiled kernel (``csrc/gdn.cpp``: these operations in this order; one thread per sequence, head and
    block of 16 value columns, each column its own recurrence), under autograd with its compiled backward; on other
    devices these torch ops, token by token.
    """
    expected = (cu_seqlens.numel() - 1, *k.shape[1:], v.shape[-1])
    if tuple(states.shape) != expected:
        raise ValueError(f"recurrent states {tuple(states.shape)}, expected {expected}")
    if inplace and (states.dtype != torch.float32 or not states.is_contiguous()):
        raise ValueError("gated_delta_rule_varlen(inplace=True) needs a contiguous float32 states tensor")
    decay, v, beta = exp64(g.float()), v.float(), beta.float()
    cu_seqlens = cu_seqlens.to(torch.int64)
    tensors = (q, k, v, decay, beta, states)
    if all(x.device.type == "cpu" for x in tensors):
        args = (q.float(), k.float(), v, decay, beta, cu_seqlens)
        if torch.is_grad_enabled() and any(x.requires_grad for x in tensors):
            if inplace:
                raise ValueError("gated_delta_rule_varlen(inplace=True) takes no autograd (a serving cache)")
            return _GatedDeltaRuleCpu.apply(*args, states.float())
        return _rule_cpu(*args, states if inplace else states.float().clone().contiguous())
    if inplace:
        raise ValueError("gated_delta_rule_varlen(inplace=True) runs the compiled CPU kernel only")
    return _rule_torch(q, k, v, decay, beta, cu_seqlens, states.float())


def _rule_cpu(q, k, v, decay, beta, cu_seqlens, states):
    """The compiled recurrence; ``states`` (float32, contiguous) updated in place and returned."""
    from . import cpu_ops

    t, h, _ = k.shape
    o = torch.empty((t, h, v.shape[-1]), dtype=torch.float32)
    cpu_ops.gated_delta_rule(cu_seqlens.contiguous(), *(x.contiguous() for x in (q, k, v, decay, beta)), states, o)
    return o, states


def _rule_torch(q, k, v, decay, beta, cu_seqlens, states):
    """The definition as torch ops, token by token (devices without the compiled kernel; the tests' reference)."""
    t, h, dk = k.shape
    dv = v.shape[-1]
    outs, finals = [], []
    for n, (lo, hi) in enumerate(itertools.pairwise(cu_seqlens.tolist())):
        s = states[n]
        for i in range(lo, hi):
            s = s * decay[i, :, None, None]
            kt = k[i, :, :, None]
            u = tree_sum(s * kt, dim=-2)
            s = s + kt * ((v[i] - u) * beta[i, :, None])[:, None, :]
            outs.append(tree_sum(s * q[i, :, :, None], dim=-2))
        finals.append(s)
    o = torch.stack(outs) if outs else v.new_zeros((0, h, dv))
    return o, torch.stack(finals) if finals else states.clone()


class _GatedDeltaRuleCpu(torch.autograd.Function):
    """The compiled recurrence with its compiled backward (``zk_gated_delta_rule_bwd``: states checkpointed every 32
    tokens and recomputed; float32, every sum in a fixed order, one thread per sequence and head: deterministic)."""

    @staticmethod
    def forward(ctx, q, k, v, decay, beta, cu_seqlens, states):
        q, k, v, decay, beta = (x.contiguous() for x in (q, k, v, decay, beta))
        states = states.contiguous()
        ctx.save_for_backward(q, k, v, decay, beta, cu_seqlens, states)
        return _rule_cpu(q, k, v, decay, beta, cu_seqlens, states.clone())

    @staticmethod
    def backward(ctx, dout, dfinal):
        from . import cpu_ops

        q, k, v, decay, beta, cu, states = ctx.saved_tensors
        dout = torch.zeros_like(v) if dout is None else dout.float().contiguous()
        dfinal = torch.zeros_like(states) if dfinal is None else dfinal.float().contiguous()
        grads = [torch.empty_like(x) for x in (q, k, v, decay, beta, states)]
        cpu_ops.gated_delta_rule_backward(cu, q, k, v, decay, beta, states, dout, dfinal, *grads)
        dq, dk, dv, ddecay, dbeta, dstates = grads
        return dq, dk, dv, ddecay, dbeta, None, dstates


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, dtype) -> torch.Tensor:
    """HF ``Qwen3NextRMSNormGated`` on ``[..., d_v]`` rows: ``o`` rounded to ``dtype`` and normalised
    (:func:`shared_numerics.rms_norm` with a unit gain: HF rounds before it applies the gain), times ``weight`` in
    ``dtype``, times ``silu(z)`` in float32, rounded once to ``dtype``.

    Args:
        o: ``[..., d_v]`` float32 (:func:`gated_delta_rule`). z: the output gate, same shape, ``dtype``.
        weight: ``[d_v]``. eps: ``rms_norm_eps``. dtype: the activations' dtype.
    """
    from . import rms_norm
    from .activation import silu_and_mul

    x = rms_norm(o.to(dtype), torch.ones(o.shape[-1], dtype=torch.float32, device=o.device), eps)
    return silu_and_mul(z.to(dtype), weight.to(dtype) * x)  # (z s) (w x): the product of HF's (w x) silu(z)


def gated_deltanet_core(
    mixed_qkv: torch.Tensor,
    z: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    params: dict[str, torch.Tensor],
    dims: tuple[int, int, int, int],
    eps: float,
    conv_state: torch.Tensor | None = None,
    recurrent_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Gated DeltaNet layer between its input and output projections, over one sequence's new tokens.

    Args:
        mixed_qkv: ``[T, 2 * Hk * d_k + Hv * d_v]`` in the activations' dtype: ``q | k | v`` (each head-major).
        z: ``[T, Hv * d_v]``; a, b: ``[T, Hv]``.
        params: ``conv1d_weight`` ``[C, K]``, ``A_log`` ``[Hv]``, ``dt_bias`` ``[Hv]``, ``norm_weight`` ``[d_v]``.
        dims: ``(Hk, d_k, Hv, d_v)``: ``linear_num_key_heads``, ``linear_key_head_dim``, ``linear_num_value_heads``,
            ``linear_value_head_dim``. eps: ``rms_norm_eps``.
        conv_state, recurrent_state: the sequence's cache (:func:`causal_conv1d`, :func:`gated_delta_rule`);
            ``None``: a fresh sequence.

    Returns:
        ``(out, conv_state, recurrent_state)``: ``out`` ``[T, Hv * d_v]`` in the activations' dtype (the input of
        ``out_proj``) and the cache after the last token.

    Raises:
        ValueError: ``Hv`` is not a multiple of ``Hk``, or a shape does not match ``dims``.
    """
    hk, dk, hv, dv = dims
    t = mixed_qkv.shape[0]
    k = params["conv1d_weight"].shape[1]
    conv = mixed_qkv.new_zeros((1, k - 1, mixed_qkv.shape[1])) if conv_state is None else conv_state[None]
    rec = torch.zeros((1, hv, dk, dv)) if recurrent_state is None else recurrent_state[None]
    cu = torch.tensor([0, t], dtype=torch.int64)
    out, conv, rec = gated_deltanet_varlen(mixed_qkv, z, a, b, params, dims, eps, cu, conv, rec)
    return out, conv[0], rec[0]


def gated_deltanet_varlen(
    mixed_qkv: torch.Tensor,
    z: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    params: dict[str, torch.Tensor],
    dims: tuple[int, int, int, int],
    eps: float,
    cu_seqlens: torch.Tensor,
    conv_states: torch.Tensor,
    recurrent_states: torch.Tensor,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`gated_deltanet_core` over ``N`` sequences at once (a serving step's decodes and prefill chunks, or a
    trainer's packed batch), each sequence's bits those of the one-sequence call.

    Args:
        mixed_qkv, z, a, b, params, dims, eps: as :func:`gated_deltanet_core`, ``T`` the tokens of every sequence
            (rows ``cu_seqlens[n] .. cu_seqlens[n + 1] - 1`` sequence ``n``'s).
        cu_seqlens: ``[N + 1]`` int64, from 0 to ``T``, nondecreasing.
        conv_states: ``[N, K - 1, C]`` in the activations' dtype; recurrent_states: ``[N, Hv, d_k, d_v]`` float32.
        inplace: write the new states into the two tensors given (contiguous, CPU, no autograd: a serving cache).

    Returns:
        ``(out, conv_states, recurrent_states)``: ``out`` ``[T, Hv * d_v]`` in the activations' dtype and the
        states after each sequence's last token.

    Raises:
        ValueError: ``Hv`` is not a multiple of ``Hk``, or a shape does not match ``dims``.
    """
    hk, dk, hv, dv = dims
    if hv % hk:
        raise ValueError(f"linear_num_value_heads {hv} is not a multiple of linear_num_key_heads {hk}")
    t, dtype = mixed_qkv.shape[0], mixed_qkv.dtype
    if mixed_qkv.shape[1] != 2 * hk * dk + hv * dv:
        raise ValueError(f"mixed q|k|v width {mixed_qkv.shape[1]}, expected {2 * hk * dk + hv * dv}")
    y, conv_states = causal_conv1d_varlen(mixed_qkv, params["conv1d_weight"], cu_seqlens, conv_states, inplace)
    q, k, v = torch.split(y, [hk * dk, hk * dk, hv * dv], dim=-1)
    q = l2_normalize(q.reshape(t, hk, dk), divisor=dk**0.5)
    k = l2_normalize(k.reshape(t, hk, dk))
    if hv != hk:
        q, k = q.repeat_interleave(hv // hk, dim=1), k.repeat_interleave(hv // hk, dim=1)
    g, beta = gdn_gates(a, b, params["A_log"], params["dt_bias"])
    o, recurrent_states = gated_delta_rule_varlen(
        q, k, v.reshape(t, hv, dv), g, beta, cu_seqlens, recurrent_states, inplace
    )
    out = gated_rms_norm(o, z.reshape(t, hv, dv), params["norm_weight"], eps, dtype)
    return out.reshape(t, hv * dv), conv_states, recurrent_states
