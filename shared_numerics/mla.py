"""Multi-head latent attention (MLA, DeepSeek-V2/V3, Kimi K2, GLM-MoE) with one definition for every path: the
trainer's dense sequences, vLLM's prefill and its decode over a latent cache.

Per token the cache holds the **latent** ``c = [kv_a_layernorm(c_kv) (kv_lora_rank R) ‖ rope(k_pe) (rope dim P)]``:
``R + P`` values (DeepSeek-V3: 576), the same for every head — not per-head K/V. Attention runs in the absorbed form
on every path, as vLLM's MLA decode does:

* queries: ``q_lat[h] = q_nope[h] · W_UK[h]`` (``W_UK[h]`` = rows ``h (Dn + Dv) .. + Dn`` of ``kv_b_proj.weight``,
  ``[Dn, R]``), one :func:`shared_numerics.linear` per head (:func:`absorb_query`), then ``[q_lat[h] ‖ rope(q_pe[h])]``;
* scores and sums: multi-query attention of the ``H`` query heads over the one latent "head" of width ``R + P``, the
  latent serving as keys and values (:func:`shared_numerics.dense_causal_attention` /
  :func:`shared_numerics.paged_causal_attention`: fixed 32-key chunks), the output's first ``R`` columns kept;
* output: ``o[h] = o_lat[h] · W_UV[h]ᵀ`` (``W_UV[h]`` = the next ``Dv`` rows, ``[Dv, R]``), one linear per head
  (:func:`latent_output`), then ``o_proj``.

In exact arithmetic this is HF's decompressed attention (``k_nope = W_UK c_kv``, ``v = W_UV c_kv``); in floating point
it is its own definition, computed the same way on every path, so the trainer's log-probs equal the server's bit for
bit. The softmax scale is ``(Dn + P) ** -0.5`` times DeepSeek's YaRN ``mscale_all_dim`` correction
(:meth:`shared_numerics.rope.YarnScaling.softmax_scale`). The rope part is rotate-half after undoing the checkpoint's
interleave (:func:`deinterleave`, HF ``apply_rotary_pos_emb_interleave``; ``rope_interleave`` in the config).

Source: DeepSeek-AI, "DeepSeek-V2" (2024) §2.1 (MLA, weight absorption); HF ``modeling_deepseek_v3.py``; vLLM
``model_executor/layers/attention/mla_attention.py`` (absorbed decode over ``kv_c ‖ k_pe``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "MLADims",
    "absorb_query",
    "deinterleave",
    "kv_b_chain_shape",
    "kv_b_grad_from_chain",
    "latent_output",
    "mla_dense_attention",
    "mla_output",
    "mla_query_latent",
]


def _linear(x: torch.Tensor, weight: torch.Tensor, chain=None) -> torch.Tensor:
    if chain is None:
        from . import linear

        return linear(x, weight)
    from .linear import linear as chained_linear  # the same forward bits; dW into the chain

    return chained_linear(x, weight, weight_chain=chain)


def kv_b_chain_shape(num_heads: int, qk_nope_head_dim: int, v_head_dim: int, kv_lora_rank: int) -> tuple[int, int]:
    """The shape of ``kv_b_proj.weight``'s exact-accumulation chain (:class:`shared_numerics.grad_chain.GradChain`):
    ``(H, (Dn + Dv) R)``, one row per head — first ``W_UK[h]ᵀ``'s gradient ``[R, Dn]`` (what :func:`absorb_query`'s
    linear computes with), then ``W_UV[h]``'s ``[Dv, R]`` (:func:`latent_output`'s), each flattened row-major. Two
    disjoint blocks of the weight, each a plain token-order chain; :func:`kv_b_grad_from_chain` lays the sums out as
    the weight."""
    return num_heads, (qk_nope_head_dim + v_head_dim) * kv_lora_rank


def kv_b_grad_from_chain(acc: torch.Tensor, qk_nope_head_dim: int, v_head_dim: int) -> torch.Tensor:
    """``kv_b_proj.weight``'s gradient ``[H (Dn + Dv), R]`` from its chain's sums ``acc`` (:func:`kv_b_chain_shape`,
    float32): ``W_UK[h]``'s block transposed back, ``W_UV[h]``'s as it is. Data movement only (the same bits).

    Raises:
        ValueError: ``acc``'s row is not ``(Dn + Dv) R`` long."""
    h, width = acc.shape
    r, rest = divmod(width, qk_nope_head_dim + v_head_dim)
    if rest:
        raise ValueError(f"kv_b chain rows of {width} are not (Dn + Dv) R with Dn={qk_nope_head_dim}, Dv={v_head_dim}")
    uk = acc[:, : r * qk_nope_head_dim].reshape(h, r, qk_nope_head_dim).transpose(1, 2)
    uv = acc[:, r * qk_nope_head_dim :].reshape(h, v_head_dim, r)
    return torch.cat([uk, uv], dim=1).reshape(h * (qk_nope_head_dim + v_head_dim), r)


def _head_chains(chain, heads: int, part: str, qk_nope_head_dim: int, v_head_dim: int, r: int) -> list:
    """Each head's chain of ``W_UK[h]ᵀ`` (``part`` ``"uk"``, ``[R, Dn]``) or ``W_UV[h]`` (``"uv"``, ``[Dv, R]``) in
    the kv_b chain's layout (:func:`kv_b_chain_shape`); ``[None] * heads`` without a chain."""
    if chain is None:
        return [None] * heads
    if tuple(chain.acc.shape) != kv_b_chain_shape(heads, qk_nope_head_dim, v_head_dim, r):
        raise ValueError(f"a kv_b chain of {tuple(chain.acc.shape)} for {heads} heads of (Dn + Dv) R")
    uk = r * qk_nope_head_dim
    if part == "uk":
        return [chain.part((h, slice(0, uk)), (r, qk_nope_head_dim)) for h in range(heads)]
    return [chain.part((h, slice(uk, None)), (v_head_dim, r)) for h in range(heads)]


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """The rope dimensions of an interleaved checkpoint (pairs ``2i, 2i+1``) in rotate-half order (``i, i + P/2``):
    the even dimensions, then the odd ones (HF ``apply_rotary_pos_emb_interleave``'s reordering). Data movement only."""
    *lead, p = x.shape
    return x.reshape(*lead, p // 2, 2).transpose(-1, -2).reshape(*lead, p)


def absorb_query(
    q_nope: torch.Tensor, kv_b_weight: torch.Tensor, qk_nope_head_dim: int, v_head_dim: int, *, kv_b_chain=None
) -> torch.Tensor:
    """``q_lat[:, h] = linear(q_nope[:, h], W_UK[h]ᵀ)`` for every head.

    Args:
        q_nope: ``[N, H, Dn]``.
        kv_b_weight: ``kv_b_proj.weight`` ``[H (Dn + Dv), R]`` (all ``H`` heads of ``q_nope``).
        kv_b_chain: the weight's exact-accumulation chain (:func:`kv_b_chain_shape`): each head's ``W_UK[h]ᵀ``
            gradient goes into its block (none to autograd); ``None``: autograd's gradient.

    Returns:
        ``[N, H, R]`` in ``q_nope.dtype``; row ``n`` depends only on ``q_nope[n]``. Differentiable.

    Raises:
        ValueError: a chain of another shape, or (:func:`shared_numerics.linear`) no kernel path for the chain.
    """
    n, h, dn = q_nope.shape
    heads = kv_b_weight.view(h, dn + v_head_dim, -1).unbind(0)  # unbind: one stack in backward, not H zero-fills
    chains = _head_chains(kv_b_chain, h, "uk", dn, v_head_dim, kv_b_weight.shape[-1])
    return torch.stack(
        [_linear(q, w[:dn].t().contiguous(), c) for q, w, c in zip(q_nope.unbind(1), heads, chains, strict=True)],
        dim=1,
    )


def latent_output(
    o_lat: torch.Tensor, kv_b_weight: torch.Tensor, qk_nope_head_dim: int, v_head_dim: int, *, kv_b_chain=None
) -> torch.Tensor:
    """``o[:, h] = linear(o_lat[:, h], W_UV[h])`` for every head, flattened for ``o_proj``.

    Args:
        o_lat: ``[N, H, R]`` the attention's latent output.
        kv_b_weight: ``[H (Dn + Dv), R]``.
        kv_b_chain: as :func:`absorb_query`'s; each head's ``W_UV[h]`` gradient goes into its block.

    Returns:
        ``[N, H Dv]`` in ``o_lat.dtype``. Differentiable.

    Raises:
        ValueError: as :func:`absorb_query`.
    """
    n, h, r = o_lat.shape
    heads = kv_b_weight.view(h, qk_nope_head_dim + v_head_dim, -1).unbind(0)
    chains = _head_chains(kv_b_chain, h, "uv", qk_nope_head_dim, v_head_dim, r)
    return torch.cat(
        [_linear(o, w[qk_nope_head_dim:], c) for o, w, c in zip(o_lat.unbind(1), heads, chains, strict=True)],
        dim=-1,
    )


def mla_dense_attention(
    q: torch.Tensor, latent: torch.Tensor, scale: float, *, head_tree: bool = False, gather=None
) -> torch.Tensor:
    """Causal MLA over dense sequences (the trainer's path).

    Args:
        q: ``[B, T, H, R + P]`` absorbed queries ``[q_lat ‖ rope(q_pe)]``.
        latent: ``[B, T, R + P]`` the tokens' latents ``[c_kv ‖ rope(k_pe)]``.
        scale: the softmax scale.
        head_tree: the latent's gradient — the keys' and values' gradients summed over the heads — adds the heads
            with the fixed TP-aligned tree (:func:`shared_numerics.tensor_parallel.block_tree_sum` of each head's
            float32 gradient, rounded once), so tensor parallelism, which gives each rank ``H / TP`` consecutive heads,
            keeps one rank's bits (``tp_k_block`` set); else the attention's own sum over the query heads sharing
            the latent. The forward is the same bits either way.
        gather: with ``head_tree`` under tensor parallelism (``q`` this rank's heads): the all-gather of the ranks'
            float32 subtree roots (:func:`shared_numerics.tensor_parallel.reduce_over_ranks`); ``None`` at TP 1.

    Returns:
        ``[B, T, H, R + P]``: the attention output (:func:`mla_output` keeps its first ``R`` columns), the same bits
        as :func:`shared_numerics.paged_causal_attention` over a cache holding these latents.
    """
    from . import dense_causal_attention

    kv = _HeadTreeLatent.apply(latent, q.shape[2], gather) if head_tree else latent.unsqueeze(2)
    return dense_causal_attention(q, kv, kv, scale)


class _HeadTreeLatent(torch.autograd.Function):
    """``latent [B, T, D] -> [B, T, H, D]``, one key/value head per query head (the attention's per-head bits are the
    shared head's); backward: the ``H`` heads' gradients added in float32 with the fixed TP-aligned tree, the ranks'
    subtree roots gathered (``gather``), rounded once to the latent's dtype — complete on every rank."""

    @staticmethod
    def forward(ctx, latent: torch.Tensor, heads: int, gather) -> torch.Tensor:
        ctx.gather, ctx.dtype = gather, latent.dtype
        b, t, d = latent.shape
        return latent.unsqueeze(2).expand(b, t, heads, d).contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        from .tensor_parallel import block_tree_sum, reduce_over_ranks

        root = block_tree_sum(grad.float().movedim(2, 0))
        return reduce_over_ranks(root, ctx.gather).to(ctx.dtype), None, None


@dataclass(frozen=True)
class MLADims:
    """An MLA layer's sizes (HF ``DeepseekV3Config`` names): ``H`` heads, latent rank ``R`` (``kv_lora_rank``), ``Dn``
    (``qk_nope_head_dim``), ``P`` (``qk_rope_head_dim``), ``Dv`` (``v_head_dim``); ``rope_interleave``: the rope part
    is stored interleaved; ``eps``: the latent RMSNorm's epsilon."""

    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    eps: float


def mla_query_latent(
    q: torch.Tensor,
    ckv: torch.Tensor,
    kv_norm_weight: torch.Tensor,
    kv_b_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    dims: MLADims,
    *,
    kv_norm_chain=None,
    kv_b_chain=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The absorbed queries and the latents of ``N`` tokens, from their projections.

    Args:
        q: ``[N, H (Dn + P)]`` the query projection's output (``q_b_proj(rms_norm(q_a_proj(a)))`` or ``q_proj(a)``).
        ckv: ``[N, R + P]`` ``kv_a_proj_with_mqa(a)``.
        kv_norm_weight: ``[R]`` ``kv_a_layernorm.weight``; kv_b_weight: ``[H (Dn + Dv), R]``.
        cos, sin: ``[N, P/2]`` (:func:`shared_numerics.rope_cos_sin` of the tokens' positions, rope dim ``P``).
        kv_norm_chain, kv_b_chain: exact accumulation (:mod:`shared_numerics.grad_chain`): the latent norm's gain
            gradient (``[R]``, :func:`shared_numerics.norm.rms_norm` ``weight_chain``) and ``kv_b_weight``'s
            ``W_UK`` blocks (:func:`absorb_query`); ``None``: autograd's. The forward bits do not change.

    Returns:
        ``(q [N, H, R + P], latent [N, R + P])``: ``[absorb_query(q_nope) ‖ rope(q_pe)]`` and
        ``[rms_norm(c_kv) ‖ rope(k_pe)]`` (what the cache holds), in the activations' dtype; row ``n`` depends only on
        row ``n`` of the inputs. Differentiable.
    """
    from . import apply_rope, rms_norm
    from .norm import rms_norm as chained_rms_norm

    n, d = q.shape[0], dims
    r, dn, dr = d.kv_lora_rank, d.qk_nope_head_dim, d.qk_rope_head_dim
    q = q.reshape(n, d.num_heads, dn + dr)
    q_nope, q_pe = q[..., :dn], q[..., dn:]
    c_kv = ckv[:, :r].contiguous()
    if kv_norm_chain is None:
        c = rms_norm(c_kv, kv_norm_weight, d.eps)
    else:
        c = chained_rms_norm(c_kv, kv_norm_weight, d.eps, weight_chain=kv_norm_chain)
    k_pe = ckv[:, r:].reshape(n, 1, dr)
    if d.rope_interleave:
        q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
    q_pe = apply_rope(q_pe.contiguous(), cos, sin)
    k_pe = apply_rope(k_pe.contiguous(), cos, sin)
    q_lat = absorb_query(q_nope.contiguous(), kv_b_weight, dn, d.v_head_dim, kv_b_chain=kv_b_chain)
    return torch.cat([q_lat, q_pe], dim=-1), torch.cat([c, k_pe.reshape(n, dr)], dim=-1)


def mla_output(o: torch.Tensor, kv_b_weight: torch.Tensor, dims: MLADims, *, kv_b_chain=None) -> torch.Tensor:
    """``[N, H Dv]`` from the attention's ``[N, H, R + P]`` output (its first ``R`` columns: :func:`latent_output`,
    ``kv_b_chain`` as there), ready for ``o_proj``."""
    r = dims.kv_lora_rank
    return latent_output(
        o[..., :r].contiguous(), kv_b_weight, dims.qk_nope_head_dim, dims.v_head_dim, kv_b_chain=kv_b_chain
    )
