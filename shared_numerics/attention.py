"""Causal attention with one fixed key-chunk reduction order, over a dense sequence or a paged KV cache.

Every query attends to its keys in chunks of ``KEY_CHUNK`` absolute positions (``[0, 32)``, ``[32, 64)``, ...), in
increasing order, with the online-softmax update of FlashAttention (running max ``m``, normaliser ``l``, accumulator
``acc``). Inside a chunk, the q·k scores and the p·v sums are batched matmuls of one fixed tile shape (``Q_TILE``
query rows per tile); the softmax statistics are elementwise, with the normaliser summed by the fixed tree of
:func:`shared_numerics.reduce.tree_sum` and exponentials through :func:`shared_numerics.reduce.exp64`. Keys past the
query's position get an exact ``-inf`` score (probability exactly 0), and chunks wholly past it are exact no-ops
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

__all__ = ["KEY_CHUNK", "Q_TILE", "attention_over_slots", "dense_causal_attention", "paged_causal_attention", "paged_slot_table"]

KEY_CHUNK = 32
Q_TILE = 16


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

    Queries are packed into tiles of ``Q_TILE`` consecutive queries of one sequence (zero-padded); for every key chunk
    ``[32j, 32j+32)`` the scores and the value sums are one batched matmul of fixed tile shape
    (``[G*Q_TILE, D] x [D, 32]`` and ``[G*Q_TILE, 32] x [32, D]``, ``G`` query heads per kv head), so a query's result
    depends neither on which other queries share its tile nor on how many tiles there are (the invariance the
    :mod:`shared_numerics.linear` tiles rely on, checked by the tests). Masked keys get an exact ``-inf`` score, keys
    past the tile's last position a zero key/value (never-written cache slots may hold garbage); chunks past a tile's
    last position are skipped (they would be exact no-ops).

    Args:
        q: ``[Nq, Hq, D]`` queries (float32 or bfloat16), grouped by sequence (each sequence's queries contiguous).
        q_seq: ``[Nq]`` int64, the row of ``slot_table`` each query belongs to.
        q_pos: ``[Nq]`` int64, the query's absolute position; it sees keys at positions ``<= q_pos``.
        gather_kv: maps a ``[N, C]`` int64 slot tensor to ``(keys, values)``, each ``[N, C, Hkv, D]``, read from
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
    dev = q.device
    n_chunks = int(q_pos.max().item()) // KEY_CHUNK + 1
    if slot_table.shape[1] < n_chunks * KEY_CHUNK:
        raise ValueError(f"slot_table covers {slot_table.shape[1]} positions, need {n_chunks * KEY_CHUNK}")

    # Tile layout: runs of consecutive queries of one sequence, cut into Q_TILE rows.
    seqs, counts = torch.unique_consecutive(q_seq, return_counts=True)
    tiles_per_run = (counts + Q_TILE - 1) // Q_TILE
    n_tiles = int(tiles_per_run.sum())
    run_of_query = torch.repeat_interleave(torch.arange(counts.numel(), device=dev), counts)
    rank = torch.arange(n_q, device=dev) - (torch.cumsum(counts, 0) - counts)[run_of_query]
    tile_of_query = (torch.cumsum(tiles_per_run, 0) - tiles_per_run)[run_of_query] + rank // Q_TILE
    row_of_query = rank % Q_TILE
    tile_seq = torch.repeat_interleave(seqs, tiles_per_run)
    tile_pos = torch.zeros(n_tiles, Q_TILE, dtype=torch.long, device=dev)  # padded rows sit at position 0
    tile_pos[tile_of_query, row_of_query] = q_pos
    tile_last = tile_pos.amax(dim=1)
    qt = q.new_zeros((n_tiles, Q_TILE, h_q, d), dtype=torch.float32)
    qt = qt.index_put((tile_of_query, row_of_query), q.float())
    # [tiles, Hkv, G*Q_TILE, D]: the G query heads of a kv head stacked as rows of one matmul
    qt = qt.reshape(n_tiles, Q_TILE, h_kv, g, d).permute(0, 2, 3, 1, 4).reshape(n_tiles, h_kv, g * Q_TILE, d)
    rows = g * Q_TILE
    pos_rows = tile_pos.unsqueeze(1).expand(n_tiles, g, Q_TILE).reshape(n_tiles, rows)  # position of each row

    m = q.new_full((n_tiles, h_kv, rows), float("-inf"), dtype=torch.float32)
    l = q.new_zeros((n_tiles, h_kv, rows), dtype=torch.float32)
    acc = q.new_zeros((n_tiles, h_kv, rows, d), dtype=torch.float32)
    offs = torch.arange(KEY_CHUNK, device=dev)
    neg_inf = torch.tensor(float("-inf"), device=dev)
    zero = torch.zeros((), device=dev)
    for j in range(n_chunks):
        start = j * KEY_CHUNK
        act = torch.nonzero(tile_last >= start).squeeze(1)  # tiles that see at least one key of this chunk
        key_pos = start + offs
        k, v = gather_kv(slot_table[tile_seq[act], start:start + KEY_CHUNK])  # [A, C, Hkv, D]
        real = (key_pos.unsqueeze(0) <= tile_last[act].unsqueeze(1))[:, :, None, None]  # [A, C, 1, 1]
        k = torch.where(real, k.float(), zero).permute(0, 2, 3, 1)  # [A, Hkv, D, C]
        v = torch.where(real, v.float(), zero).permute(0, 2, 1, 3)  # [A, Hkv, C, D]
        a_n = act.numel()
        s = torch.bmm(qt[act].reshape(a_n * h_kv, rows, d), k.reshape(a_n * h_kv, d, KEY_CHUNK))
        s = s.reshape(a_n, h_kv, rows, KEY_CHUNK) * scale
        valid = key_pos.view(1, 1, KEY_CHUNK) <= pos_rows[act].unsqueeze(-1)  # [A, rows, C]
        s = torch.where(valid.unsqueeze(1), s, neg_inf)
        m_a = m[act]
        m_new = torch.maximum(m_a, s.amax(dim=-1)).detach()
        alpha = exp64(m_a - m_new)
        p = exp64(s - m_new.unsqueeze(-1))
        l = l.index_copy(0, act, l[act] * alpha + tree_sum(p, dim=-1))
        pv = torch.bmm(p.reshape(a_n * h_kv, rows, KEY_CHUNK), v.reshape(a_n * h_kv, KEY_CHUNK, d))
        acc = acc.index_copy(0, act, acc[act] * alpha.unsqueeze(-1) + pv.reshape(a_n, h_kv, rows, d))
        m = m.index_copy(0, act, m_new)
    out = acc / l.unsqueeze(-1)  # [tiles, Hkv, G*Q_TILE, D]
    out = out.reshape(n_tiles, h_kv, g, Q_TILE, d).permute(0, 3, 1, 2, 4).reshape(n_tiles, Q_TILE, h_q, d)
    return out[tile_of_query, row_of_query].to(q.dtype)


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
