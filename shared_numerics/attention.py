"""Causal attention with one fixed key-chunk reduction order, over a dense sequence or a paged KV cache.

Every query attends to its keys in chunks of ``KEY_CHUNK`` absolute positions (``[0, 32)``, ``[32, 64)``, ...), in
increasing order, with the online-softmax update of FlashAttention (running max ``m``, normaliser ``l``, accumulator
``acc``). Inside a chunk, the q·k dot products and the p·v sums use the fixed tree of
:func:`shared_numerics.reduce.tree_sum`; exponentials go through :func:`shared_numerics.reduce.exp64`. Keys past the
query's position are masked to an exact ``-inf`` score and a zero value, and chunks wholly past it are exact no-ops
(``alpha = exp(0) = 1``, ``p = 0``), so a query's output depends only on its own keys — not on the batch, the number
of chunks the longest sequence needs, chunked prefill, prefix-cache hits, or where the keys live.

Both layouts go through one core, :func:`attention_over_slots`: keys live in a flat ``[slots, kv_heads, head_dim]``
store and a ``slot_table`` maps (sequence, position) → slot. The dense path builds that table for a padded
``[batch, seq]`` block; vLLM's path builds it from the block table (``slot = block_table[s, p // bs] * bs + p % bs``).

Source: Dao et al., "FlashAttention" (2022) online softmax; fixed split-KV size as in SGLang's deterministic mode and
vLLM's batch-invariant attention; paged layout of Kwon et al., "PagedAttention" (2023).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from .reduce import exp64, tree_sum

__all__ = ["KEY_CHUNK", "attention_over_slots", "dense_causal_attention", "paged_causal_attention", "paged_slot_table"]

KEY_CHUNK = 32


def attention_over_slots(
    q: torch.Tensor,
    q_seq: torch.Tensor,
    q_pos: torch.Tensor,
    gather_kv: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    num_kv_heads: int,
    slot_table: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each query over positions ``0..q_pos`` of its sequence.

    Args:
        q: ``[Nq, Hq, D]`` queries (float32 or bfloat16).
        q_seq: ``[Nq]`` int64, the row of ``slot_table`` each query belongs to.
        q_pos: ``[Nq]`` int64, the query's absolute position; it sees keys at positions ``<= q_pos``.
        gather_kv: maps a ``[Nq, C]`` int64 slot tensor to ``(keys, values)``, each ``[Nq, C, Hkv, D]``, read from
            wherever the keys live (a dense tensor, vLLM's paged cache). Only the values it returns matter.
        num_kv_heads: ``Hkv``; ``Hq`` must be a multiple of it (grouped-query attention).
        slot_table: ``[num_seqs, L]`` int64 slot of each position, ``L`` ≥ ``(max(q_pos)//KEY_CHUNK + 1) * KEY_CHUNK``;
            entries past a sequence's length must still be valid indices (they are masked).
        scale: softmax scale (``head_dim ** -0.5``).

    Returns:
        ``[Nq, Hq, D]`` in ``q.dtype``. Differentiable (the running max is detached, which leaves gradients exact).

    Raises:
        ValueError: if the head counts are incompatible or the slot table is too short.
    """
    n_q, h_q, d = q.shape
    h_kv = num_kv_heads
    if h_q % h_kv:
        raise ValueError(f"query heads {h_q} not a multiple of kv heads {h_kv}")
    if n_q == 0:
        return q.new_zeros(q.shape)
    g = h_q // h_kv
    n_chunks = int(q_pos.max().item()) // KEY_CHUNK + 1
    if slot_table.shape[1] < n_chunks * KEY_CHUNK:
        raise ValueError(f"slot_table covers {slot_table.shape[1]} positions, need {n_chunks * KEY_CHUNK}")
    qf = q.float().reshape(n_q, h_kv, g, 1, d)
    m = q.new_full((n_q, h_kv, g), float("-inf"), dtype=torch.float32)
    l = q.new_zeros((n_q, h_kv, g), dtype=torch.float32)
    acc = q.new_zeros((n_q, h_kv, g, d), dtype=torch.float32)
    offs = torch.arange(KEY_CHUNK, device=q.device)
    neg_inf = torch.tensor(float("-inf"), device=q.device)
    for j in range(n_chunks):
        start = j * KEY_CHUNK
        slots = slot_table[:, start:start + KEY_CHUNK][q_seq]  # [Nq, C]
        valid = (start + offs).unsqueeze(0) <= q_pos.unsqueeze(1)  # [Nq, C]
        k, v = gather_kv(slots)
        k = k.float().permute(0, 2, 1, 3).unsqueeze(2)  # [Nq, Hkv, 1, C, D]
        v = v.float().permute(0, 2, 1, 3).unsqueeze(2)
        vmask = valid[:, None, None, :, None]
        v = torch.where(vmask, v, torch.zeros((), dtype=v.dtype))
        s = tree_sum(qf * k, dim=-1) * scale  # [Nq, Hkv, G, C]
        s = torch.where(valid[:, None, None, :], s, neg_inf)
        m_new = torch.maximum(m, s.amax(dim=-1)).detach()
        alpha = exp64(m - m_new)
        p = exp64(s - m_new.unsqueeze(-1))
        l = l * alpha + tree_sum(p, dim=-1)
        pv = tree_sum(p.unsqueeze(-1) * v, dim=-2)  # [Nq, Hkv, G, D]
        acc = acc * alpha.unsqueeze(-1) + pv
        m = m_new
    out = acc / l.unsqueeze(-1)
    return out.reshape(n_q, h_q, d).to(q.dtype)


def _padded_len(n: int) -> int:
    return max(1, (n + KEY_CHUNK - 1) // KEY_CHUNK) * KEY_CHUNK


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal self-attention over right-padded dense sequences (the trainer's layout).

    Args:
        q: ``[B, T, Hq, D]``; k, v: ``[B, T, Hkv, D]``. Position of token ``t`` is ``t``.
        scale: softmax scale.

    Returns:
        ``[B, T, Hq, D]`` in ``q.dtype``; row ``(b, t)`` is bitwise what vLLM's paged path gives for the same
        sequence prefix.
    """
    b, t, h_q, d = q.shape
    dev = q.device
    length = _padded_len(t)
    pos = torch.arange(length, device=dev).clamp(max=t - 1)
    slot_table = torch.arange(b, device=dev).unsqueeze(1) * t + pos.unsqueeze(0)
    q_seq = torch.arange(b, device=dev).repeat_interleave(t)
    q_pos = torch.arange(t, device=dev).repeat(b)
    k_flat = k.reshape(b * t, k.shape[2], d)
    v_flat = v.reshape(b * t, v.shape[2], d)
    out = attention_over_slots(
        q.reshape(b * t, h_q, d), q_seq, q_pos, lambda s: (k_flat[s], v_flat[s]), k.shape[2], slot_table, scale
    )
    return out.reshape(b, t, h_q, d)


def paged_slot_table(block_table: torch.Tensor, block_size: int, max_pos: int) -> torch.Tensor:
    """Slot of every position ``0..L-1`` of every sequence from a vLLM block table.

    Args:
        block_table: ``[num_seqs, max_blocks]`` int32/int64 physical block ids.
        block_size: tokens per block.
        max_pos: the largest query position in the batch.

    Returns:
        ``[num_seqs, L]`` int64 with ``L`` = ``max_pos`` rounded up to a whole key chunk; positions beyond the table are
        clamped to its last block (they are masked by the caller).
    """
    length = _padded_len(max_pos + 1)
    pos = torch.arange(length, device=block_table.device)
    blk_idx = (pos // block_size).clamp(max=block_table.shape[1] - 1)
    blocks = block_table.long()[:, blk_idx]
    return blocks * block_size + (pos % block_size).unsqueeze(0)


def paged_causal_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of a vLLM batch (prefill chunks and decodes mixed) over the paged KV cache.

    Args:
        q: ``[Nq, Hq, D]`` the scheduled tokens, request after request.
        key_cache, value_cache: ``[num_blocks, Hkv, block_size, D]`` (vLLM CPU layout, head-major inside a block);
            the new tokens' keys must already be written.
        query_start_loc: ``[num_reqs + 1]`` int, offsets of each request's tokens in ``q``.
        seq_lens: ``[num_reqs]`` int, context length of each request including its scheduled tokens.
        block_table: ``[num_reqs, max_blocks]`` int physical block ids.
        scale: softmax scale.

    Returns:
        ``[Nq, Hq, D]`` in ``q.dtype``, bitwise equal to :func:`dense_causal_attention` on the same prefix.
    """
    n_q = q.shape[0]
    qsl = query_start_loc.long().cpu()
    q_lens = qsl[1:] - qsl[:-1]
    q_seq = torch.repeat_interleave(torch.arange(q_lens.numel()), q_lens)
    starts = (seq_lens.long().cpu() - q_lens)[q_seq]
    q_pos = starts + (torch.arange(n_q) - qsl[:-1][q_seq])
    block_size = key_cache.shape[2]
    slot_table = paged_slot_table(block_table, block_size, int(q_pos.max().item()) if n_q else 0)

    def gather(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        blk, off = slots // block_size, slots % block_size
        return key_cache[blk, :, off], value_cache[blk, :, off]

    return attention_over_slots(q, q_seq, q_pos, gather, key_cache.shape[1], slot_table, scale)
