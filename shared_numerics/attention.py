"""Causal attention with one fixed key-chunk reduction order, over a dense sequence or a paged KV cache.

Every query attends to its keys in chunks of ``KEY_CHUNK`` absolute positions (``[0, 32)``, ``[32, 64)``, ...), in
increasing order, with the online-softmax update of FlashAttention (running max ``m``, normaliser ``l``, accumulator
``acc``). Inside a chunk, the q·k scores and the p·v sums are batched matmuls of one fixed tile shape (``Q_TILE``
query rows per tile); the softmax statistics are elementwise, with the normaliser summed by the fixed tree of
:func:`shared_numerics.reduce.tree_sum` and exponentials through :func:`shared_numerics.reduce.exp64`. Keys past the
query's position get an exact ``-inf`` score (probability exactly 0), and chunks wholly past it are exact no-ops
(``alpha = exp(0) = 1``, ``p = 0``), so a query's output depends only on its own keys — not on the batch, the number
of chunks the longest sequence needs, chunked prefill, prefix-cache hits, or where the keys live.

On CPU tensors both layouts run the compiled kernel of :mod:`shared_numerics.attention_cpu` (one loop nest per
(query block, kv head); its arithmetic per (query, head) is fixed in ``csrc/attention.cpp``: scores summed in head-dim
order, Cephes' exp as plain arithmetic, sums in key order). On other devices both layouts go through one core of torch
ops, :func:`attention_over_chunks`, which asks a ``gather_chunk`` callback for key chunk
``j`` of given sequences as a head-major ``[n, kv_heads, 32, head_dim]`` tensor: the dense path slices its padded
``[batch, kv_heads, seq, head_dim]`` keys; vLLM's path slices the paged cache (a block of ``block_size`` tokens, a
multiple of 32, holds whole chunks: chunk ``j`` of sequence ``s`` is rows ``(32j mod bs) .. +32`` of block
``block_table[s, 32j // bs]``; smaller blocks, e.g. vLLM's default 16, are gathered position by position).

Source: Dao et al., "FlashAttention" (2022) online softmax; fixed split-KV size as in SGLang's deterministic mode and
vLLM's batch-invariant attention; paged layout of Kwon et al., "PagedAttention" (2023).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .reduce import exp64, tree_sum
from .tiles import KEY_CHUNK, Q_TILE

__all__ = ["KEY_CHUNK", "Q_TILE", "attention_over_chunks", "dense_causal_attention", "paged_causal_attention"]

# keys per split of the Triton backend's FlashAttention (absolute positions; :mod:`.ops_triton.attention`): part of
# the numerics contract (:func:`shared_numerics.mode.contract`)
SPLIT = 512


def attention_over_chunks(
    q: torch.Tensor,
    q_seq: torch.Tensor,
    q_pos: torch.Tensor,
    gather_chunk: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]],
    num_kv_heads: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each query over positions ``0..q_pos`` of its sequence.

    Queries are packed into tiles of ``Q_TILE`` consecutive queries of one sequence (zero-padded); for every key chunk
    ``[32j, 32j+32)`` the scores and the value sums are one batched matmul of fixed tile shape
    (``[32, D] x [D, G*Q_TILE]`` and ``[G*Q_TILE, 32] x [32, D]``, ``G`` query heads per kv head), so a query's result
    depends neither on which other queries share its tile nor on how many tiles there are (the invariance the
    :mod:`shared_numerics.linear` tiles rely on, checked by the tests). The softmax statistics are computed on the real
    query rows only. Masked keys get an exact ``-inf`` score; keys past the tile's last position a zero key/value
    (never-written cache slots may hold garbage); chunks past a query's position are skipped (they would be exact
    no-ops).

    Args:
        q: ``[Nq, Hq, D]`` queries (float32 or bfloat16), grouped by sequence (each sequence's queries contiguous).
        q_seq: ``[Nq]`` int64 sequence id of each query (whatever ``gather_chunk`` understands).
        q_pos: ``[Nq]`` int64, the query's absolute position; it sees keys at positions ``<= q_pos``.
        gather_chunk: ``(seq_ids [n] int64, j) -> (keys, values)``, each ``[n, Hkv, KEY_CHUNK, D]`` contiguous: the
            keys at positions ``32j .. 32j+31`` of each sequence (any finite or non-finite values past its length).
        num_kv_heads: ``Hkv``; ``Hq`` must be a multiple of it (grouped-query attention).
        scale: softmax scale (``head_dim ** -0.5``).

    Returns:
        ``[Nq, Hq, D]`` in ``q.dtype``. Differentiable (the running max is detached, which leaves gradients exact).

    Raises:
        ValueError: if the head counts are incompatible.
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

    # Tile layout: runs of consecutive queries of one sequence, cut into Q_TILE rows.
    seqs, counts = torch.unique_consecutive(q_seq, return_counts=True)
    tiles_per_run = (counts + Q_TILE - 1) // Q_TILE
    n_tiles = int(tiles_per_run.sum())
    run_of_query = torch.repeat_interleave(torch.arange(counts.numel(), device=dev), counts)
    rank = torch.arange(n_q, device=dev) - (torch.cumsum(counts, 0) - counts)[run_of_query]
    tile_of_query = (torch.cumsum(tiles_per_run, 0) - tiles_per_run)[run_of_query] + rank // Q_TILE
    row_of_query = rank % Q_TILE
    tile_seq = torch.repeat_interleave(seqs, tiles_per_run)
    tile_last = torch.zeros(n_tiles, dtype=torch.long, device=dev).scatter_reduce(0, tile_of_query, q_pos, "amax")
    rows = g * Q_TILE
    qt = q.new_zeros((n_tiles, Q_TILE, h_q, d), dtype=torch.float32)
    qt = qt.index_put((tile_of_query, row_of_query), q.float())
    # [tiles, Hkv, D, G*Q_TILE]: the G query heads of a kv head stacked as the columns of one matmul
    qt = qt.reshape(n_tiles, Q_TILE, h_kv, g, d).permute(0, 2, 4, 3, 1).reshape(n_tiles, h_kv, d, rows)

    # Softmax statistics live on the real query rows only ([Nq, Hkv, G]); the matmuls run on whole tiles.
    row_idx = torch.arange(g, device=dev).unsqueeze(0) * Q_TILE + row_of_query.unsqueeze(1)  # [Nq, G]
    m = q.new_full((n_q, h_kv, g), float("-inf"), dtype=torch.float32)
    l = q.new_zeros((n_q, h_kv, g), dtype=torch.float32)
    acc = q.new_zeros((n_q, h_kv, g, d), dtype=torch.float32)
    offs = torch.arange(KEY_CHUNK, device=dev)
    neg_inf = torch.tensor(float("-inf"), device=dev)
    slot_in_act = torch.empty(n_tiles, dtype=torch.long, device=dev)
    for j in range(n_chunks):
        start = j * KEY_CHUNK
        act = torch.nonzero(tile_last >= start).squeeze(1)  # tiles that see at least one key of this chunk
        a_n = act.numel()
        slot_in_act[act] = torch.arange(a_n, device=dev)
        qa = torch.nonzero(q_pos >= start).squeeze(1)  # queries that see at least one key of this chunk
        ta = slot_in_act[tile_of_query[qa]]  # their tile's index among the active tiles
        key_pos = start + offs
        all_tiles, all_queries = a_n == n_tiles, qa.numel() == n_q  # fast paths: same values, fewer copies
        k, v = gather_chunk(tile_seq if all_tiles else tile_seq[act], j)  # [A, Hkv, C, D]
        if not bool((tile_last[act] >= start + KEY_CHUNK - 1).all()):  # some keys lie past a tile's last query
            real = (key_pos.unsqueeze(0) <= tile_last[act].unsqueeze(1))[:, None, :, None]  # [A, 1, C, 1]
            k = torch.where(real, k, torch.zeros((), dtype=k.dtype))
            v = torch.where(real, v, torch.zeros((), dtype=v.dtype))
        k, v = k.float(), v.float()
        q_act = qt if all_tiles else qt[act]
        s_t = torch.bmm(k.reshape(a_n * h_kv, KEY_CHUNK, d), q_act.reshape(a_n * h_kv, d, rows))
        s_t = s_t.reshape(a_n, h_kv, KEY_CHUNK, rows)
        s = s_t[ta.unsqueeze(1), :, :, row_idx[qa]] * scale  # [Qa, G, Hkv, C]
        valid = key_pos.view(1, KEY_CHUNK) <= q_pos[qa].unsqueeze(1)  # [Qa, C]
        s = torch.where(valid[:, None, None, :], s, neg_inf).transpose(1, 2)  # [Qa, Hkv, G, C]
        m_a = m if all_queries else m[qa]
        m_new = torch.maximum(m_a, s.amax(dim=-1)).detach()
        alpha = exp64(m_a - m_new)
        p = exp64(s - m_new.unsqueeze(-1))  # [Qa, Hkv, G, C]
        p_t = s_t.new_zeros((a_n, rows, h_kv, KEY_CHUNK))
        p_t = p_t.index_put((ta.unsqueeze(1), row_idx[qa]), p.transpose(1, 2)).transpose(1, 2)  # [A, Hkv, rows, C]
        pv_t = torch.bmm(p_t.reshape(a_n * h_kv, rows, KEY_CHUNK), v.reshape(a_n * h_kv, KEY_CHUNK, d))
        pv = pv_t.reshape(a_n, h_kv, rows, d)[ta.unsqueeze(1), :, row_idx[qa]].transpose(1, 2)  # [Qa, Hkv, G, D]
        if all_queries:
            l = l * alpha + tree_sum(p, dim=-1)
            acc = acc * alpha.unsqueeze(-1) + pv
            m = m_new
        else:
            l = l.index_copy(0, qa, l[qa] * alpha + tree_sum(p, dim=-1))
            acc = acc.index_copy(0, qa, acc[qa] * alpha.unsqueeze(-1) + pv)
            m = m.index_copy(0, qa, m_new)
    out = acc / l.unsqueeze(-1)  # [Nq, Hkv, G, D]
    return out.reshape(n_q, h_q, d).to(q.dtype)


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal self-attention over right-padded dense sequences (the trainer's layout).

    Args:
        q: ``[B, T, Hq, D]``; k, v: ``[B, T, Hkv, D]``. Position of token ``t`` is ``t``.
        scale: softmax scale.

    Returns:
        ``[B, T, Hq, D]`` in ``q.dtype``; row ``(b, t)`` is bitwise what vLLM's paged path gives for the same
        sequence prefix. CPU tensors: :func:`shared_numerics.attention_cpu.dense_attention_cpu`.
    """
    if q.device.type == "cpu":
        from .attention_cpu import dense_attention_cpu

        return dense_attention_cpu(q, k, v, scale)
    b, t, h_q, d = q.shape
    h_kv = k.shape[2]
    dev = q.device
    t_pad = (t + KEY_CHUNK - 1) // KEY_CHUNK * KEY_CHUNK
    pad = (0, 0, 0, 0, 0, t_pad - t)
    k_chunks = torch.nn.functional.pad(k, pad).permute(0, 2, 1, 3).reshape(b, h_kv, t_pad // KEY_CHUNK, KEY_CHUNK, d)
    v_chunks = torch.nn.functional.pad(v, pad).permute(0, 2, 1, 3).reshape(b, h_kv, t_pad // KEY_CHUNK, KEY_CHUNK, d)

    def gather(seq_ids: torch.Tensor, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        return k_chunks[seq_ids, :, j], v_chunks[seq_ids, :, j]

    q_seq = torch.arange(b, device=dev).repeat_interleave(t)
    q_pos = torch.arange(t, device=dev).repeat(b)
    return attention_over_chunks(q.reshape(b * t, h_q, d), q_seq, q_pos, gather, h_kv, scale).reshape(b, t, h_q, d)


def paged_causal_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """Causal attention of a vLLM batch (prefill chunks and decodes mixed) over the paged KV cache.

    Args:
        q: ``[Nq, Hq, D]`` the scheduled tokens, request after request.
        key_cache, value_cache: ``[num_blocks, Hkv, block_size, D]`` views (any strides: vLLM's layouts, K and V
            halves of one cache), any ``block_size``; the new tokens' keys must already be written.
        query_start_loc: ``[num_reqs + 1]`` int, offsets of each request's tokens in ``q``.
        seq_lens: ``[num_reqs]`` int, context length of each request including its scheduled tokens.
        block_table: ``[num_reqs, max_blocks]`` int physical block ids.
        scale: softmax scale.
        max_query_len, max_seq_len: accepted for the op table's signature (the Triton backend sizes its launch
            with them); unused here.

    Returns:
        ``[Nq, Hq, D]`` in ``q.dtype``, bitwise equal to :func:`dense_causal_attention` on the same prefix. CPU
        tensors: :func:`shared_numerics.attention_cpu.paged_attention_cpu`.
    """
    if q.device.type == "cpu":
        from .attention_cpu import paged_attention_cpu

        return paged_attention_cpu(q, key_cache, value_cache, query_start_loc, seq_lens, block_table, scale)
    n_q = q.shape[0]
    nb, h_kv, block_size, d = key_cache.shape
    qsl = query_start_loc.long().cpu()
    q_lens = qsl[1:] - qsl[:-1]
    q_seq = torch.repeat_interleave(torch.arange(q_lens.numel()), q_lens)
    starts = (seq_lens.long().cpu() - q_lens)[q_seq]
    q_pos = starts + (torch.arange(n_q) - qsl[:-1][q_seq])
    bt = block_table.long()
    offs = torch.arange(KEY_CHUNK)

    if block_size % KEY_CHUNK == 0:  # a block holds whole chunks: slice them
        per_block = block_size // KEY_CHUNK
        k_chunks = key_cache.unflatten(2, (per_block, KEY_CHUNK))
        v_chunks = value_cache.unflatten(2, (per_block, KEY_CHUNK))

        def gather(seq_ids: torch.Tensor, j: int) -> tuple[torch.Tensor, torch.Tensor]:
            col = min(j // per_block, bt.shape[1] - 1)  # past the table: masked anyway
            blocks = bt[seq_ids, col]
            return (k_chunks[blocks, :, j % per_block].contiguous(), v_chunks[blocks, :, j % per_block].contiguous())
    else:  # a chunk spans several blocks: gather its 32 positions (the same values, so the same bits)

        def gather(seq_ids: torch.Tensor, j: int) -> tuple[torch.Tensor, torch.Tensor]:
            pos = j * KEY_CHUNK + offs
            col = torch.clamp(pos // block_size, max=bt.shape[1] - 1)  # past the table: masked anyway
            blocks = bt[seq_ids][:, col]  # [n, 32]
            slots = (pos % block_size).expand_as(blocks)
            k = key_cache.permute(0, 2, 1, 3)[blocks, slots]  # [n, 32, Hkv, D]
            v = value_cache.permute(0, 2, 1, 3)[blocks, slots]
            return k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()

    return attention_over_chunks(q, q_seq, q_pos, gather, h_kv, scale)
