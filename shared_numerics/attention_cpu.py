"""Batch-invariant causal attention on CPU tensors: the compiled kernel of ``csrc/attention.cpp``.

The arithmetic of one (query, head) is fixed by construction (the kernel's header says it in full): keys in chunks of
:data:`~shared_numerics.attention.KEY_CHUNK` absolute positions, chunk 0 first; scores summed in
head-dim order (vectorised across the chunk's keys); FlashAttention's online softmax per chunk (Cephes' exp as plain
arithmetic, sums in key order); ``out = acc / l`` in float32, rounded once to the input dtype. A query's result depends
only on its own keys and position: not on the batch, the query blocks (``Q_TILE`` queries of one sequence per work
unit), the thread count, chunked prefill, prefix-cache hits or where the paged cache put the keys. The dense (trainer)
and paged (vLLM) layouts are one address computation: dense ``[B, T, Hkv, D]`` keys are a cache of one block of ``T``
slots per sequence.

The backward (dense layout) is FlashAttention-2's, recomputing the probabilities from the saved ``m`` and ``l``; each
(sequence, kv head) is one unit that owns its keys' gradients, so a sequence's gradients are the same bits alone or in
any batch (the trainer's exact streaming relies on it).

Threads: units are spread over ``torch.get_num_threads()`` OpenMP threads of torch's own runtime (a unit never
splits). Inputs: plain CPU tensors (an ``AsyncCollectiveTensor`` is waited); ``DTensor`` inputs (tensor parallelism)
run on their local shards when sharded by heads or sequences.

Rows of a unit (and, in the backward, keys) are processed four side by side so that their independent sums overlap
in the pipeline; each row's operations stay the same as alone (the results are bitwise the one-row-at-a-time loop's).

Speed vs ATen's SDPA (not batch invariant) and vs the torch-op core this replaced on CPU: ``benchmarks/attention.py``
(figures in the docs' Benchmarks page, generated from ``benchmarks/results/attention_*.json``).

Source: Dao et al., "FlashAttention" (2022) and "FlashAttention-2" (2023); Kwon et al., "PagedAttention" (2023).
"""

from __future__ import annotations

import torch

from . import cpu_ops
from .cpu_kernels import DTYPE_CODES, on_local_shards, plain
from .tiles import Q_TILE

__all__ = ["dense_attention_cpu", "gathered_attention_cpu", "paged_attention_cpu"]


def _blocks(q_row: torch.Tensor):
    """Query blocks: runs of consecutive queries of one sequence cut into ``Q_TILE`` queries. Returns
    ``(block_q0, block_nq, seq_b0, seq_b1)`` int64 (first query and size of each block; each run's block range)."""
    _, counts = torch.unique_consecutive(q_row, return_counts=True)
    tiles = (counts + Q_TILE - 1) // Q_TILE
    n_blocks = int(tiles.sum())
    run_start = torch.cumsum(counts, 0) - counts
    seq_b1 = torch.cumsum(tiles, 0)
    seq_b0 = seq_b1 - tiles
    run_of_block = torch.repeat_interleave(torch.arange(counts.numel()), tiles)
    rank = torch.arange(n_blocks) - seq_b0[run_of_block]
    block_q0 = run_start[run_of_block] + rank * Q_TILE
    block_nq = torch.clamp(counts[run_of_block] - rank * Q_TILE, max=Q_TILE)
    return block_q0.contiguous(), block_nq.contiguous(), seq_b0.contiguous(), seq_b1.contiguous()


def _plain(*tensors):
    out = tuple(plain(t) for t in tensors)
    if any(t is None for t in out):
        raise TypeError(
            "zerokld CPU attention: inputs must be plain CPU tensors (or DTensors sharded by heads), got "
            + ", ".join(type(t).__name__ for t in tensors)
        )
    return out


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, h_kv: int) -> None:
    if q.dtype not in DTYPE_CODES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(
            f"zerokld CPU attention: q, k, v must share one of {list(DTYPE_CODES)}; got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if q.shape[1] % h_kv:
        raise ValueError(f"query heads {q.shape[1]} not a multiple of kv heads {h_kv}")


def _forward(q, k, v, h_kv, strides, bs, block_table, q_row, q_pos, scale, blocks):
    """Run the forward kernel. ``q`` ``[Nq, Hq, D]`` contiguous; ``k``/``v`` element strides ``strides`` (block,
    head, slot). Returns ``(out [Nq, Hq, D], m [Nq, Hq], l [Nq, Hq])`` float32."""
    n_q, h_q, d = q.shape
    out = torch.empty(n_q, h_q, d, dtype=torch.float32)
    m = torch.empty(n_q, h_q, dtype=torch.float32)
    l = torch.empty(n_q, h_q, dtype=torch.float32)
    block_q0, block_nq = blocks[0], blocks[1]
    rc = cpu_ops.attention_forward(
        q, k, v, h_kv, strides[0], strides[1], strides[2], bs, block_table, q_row, q_pos, block_q0, block_nq,
        float(scale), out, m, l,
    )  # fmt: skip
    if rc:
        raise ValueError(f"zerokld CPU attention refused its arguments (code {rc})")
    return out, m, l


def paged_attention_cpu(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of a vLLM batch over the paged cache (the signature of
    :func:`shared_numerics.attention.paged_causal_attention`, which calls this for CPU tensors).

    Args:
        q: ``[Nq, Hq, D]`` float32 / bfloat16 / float16. key_cache, value_cache: ``[num_blocks, Hkv, block_size, D]``
            views of ``q.dtype`` with equal strides and a contiguous last dim (vLLM's K and V halves of one cache).
        query_start_loc: ``[num_reqs + 1]`` (0 .. Nq); seq_lens: ``[num_reqs]``; block_table: ``[num_reqs, max_blocks]``
            (or more rows); int32 (vLLM's) or int64, read in place (the block table's rows may lie further apart than
            its columns, as in vLLM's persistent table).

    Returns:
        ``[Nq, Hq, D]`` in ``q.dtype``. No autograd (inference).

    Raises:
        TypeError / ValueError: dtypes or head counts that do not fit; metadata that does not describe ``Nq`` queries
            in order, or a sequence longer than its block-table row.
    """
    nb, h_kv, bs, d = key_cache.shape
    q, key_cache, value_cache = _plain(q, key_cache, value_cache)
    _check(q, key_cache, value_cache, h_kv)
    if key_cache.stride() != value_cache.stride() or key_cache.stride(-1) != 1:
        key_cache, value_cache = key_cache.contiguous(), value_cache.contiguous()
    # vLLM's metadata as it lies (int32 or int64): the kernel cuts the queries into blocks itself (a few dozen torch
    # calls a layer before, ~0.13 ms at decode; the same units)
    idx = _index_dtype(query_start_loc, seq_lens, block_table)
    qsl, lens, bt = (_index(t, idx) for t in (query_start_loc, seq_lens, block_table))
    if (
        qsl.dim() != 1
        or lens.dim() != 1
        or bt.dim() != 2
        or qsl.shape[0] != lens.shape[0] + 1
        or bt.shape[0] < lens.shape[0]
    ):
        raise ValueError(
            f"zerokld CPU attention: query_start_loc {tuple(qsl.shape)}, seq_lens {tuple(lens.shape)} and "
            f"block_table {tuple(bt.shape)} do not fit one batch"
        )
    if bt.stride(-1) != 1:
        bt = bt.contiguous()
    q = q.contiguous()
    n_q, h_q, _ = q.shape
    out = torch.empty(n_q, h_q, d, dtype=torch.float32)
    rc = cpu_ops.paged_attention_forward(q, key_cache, value_cache, bt, qsl, lens, Q_TILE, float(scale), out)
    if rc == 2:
        raise ValueError(
            f"zerokld CPU attention: query_start_loc {query_start_loc.tolist()} and seq_lens "
            f"{seq_lens.tolist()} do not describe {n_q} queries in order"
        )
    if rc == 3:
        raise ValueError(
            f"zerokld CPU attention: seq_lens {seq_lens.tolist()} reach past the block table "
            f"({bt.shape[1]} blocks of {bs})"
        )
    if rc:
        raise ValueError(f"zerokld CPU attention refused its arguments (code {rc})")
    return out.to(q.dtype)


def _index_dtype(*tensors) -> torch.dtype:
    """int32 when every metadata tensor is int32 (vLLM's), else int64."""
    return torch.int32 if all(t.dtype == torch.int32 for t in tensors) else torch.int64


def _index(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` as a CPU tensor of ``dtype`` whose storage holds its values from ``data_ptr`` on (1-d: contiguous)."""
    p = t if type(t) is torch.Tensor else plain(t)
    if p is None:
        raise TypeError(f"zerokld CPU attention: metadata must be plain tensors, got {type(t).__name__}")
    if p.device.type != "cpu" or p.dtype != dtype:
        p = p.to("cpu", dtype)
    return p if p.dim() != 1 or p.is_contiguous() else p.contiguous()


class _DenseAttention(torch.autograd.Function):
    """Dense causal attention through the kernel; backward through the kernel's FlashAttention-2 pass. ``lens``
    (``[B]`` int64, gathered attention): one query per sequence (``q`` ``[B, 1, Hq, D]``) at position ``lens[b] - 1``
    of its own ``T`` keys; ``None``: every row ``t`` of ``q`` at position ``t``."""

    @staticmethod
    def forward(ctx, q, k, v, scale, lens=None):
        b, t, h_q, d = k.shape[0], k.shape[1], q.shape[2], q.shape[3]
        h_kv = k.shape[2]
        q2 = q.reshape(-1, h_q, d).contiguous()
        k, v = k.contiguous(), v.contiguous()
        if lens is None:
            q_row = torch.arange(b).repeat_interleave(t)
            q_pos = torch.arange(t).repeat(b)
        else:
            q_row = torch.arange(b)
            q_pos = lens.to(torch.long) - 1
        bt = torch.arange(b, dtype=torch.long).unsqueeze(1)
        strides = (t * h_kv * d, d, h_kv * d)
        blocks = _blocks(q_row)
        out, m, l = _forward(q2, k, v, h_kv, strides, t, bt, q_row, q_pos, scale, blocks)
        ctx.save_for_backward(q2, k, v, out, m, l)
        ctx.meta = (q.shape, h_q, h_kv, d, scale, strides, t, bt, q_row, q_pos, blocks)
        return out.reshape(q.shape)

    @staticmethod
    def backward(ctx, grad):
        q2, k, v, out, m, l = ctx.saved_tensors
        q_shape, h_q, h_kv, d, scale, strides, t, bt, q_row, q_pos, blocks = ctx.meta
        n_q = q2.shape[0]
        dout = grad.reshape(n_q, h_q, d).float().contiguous()
        dq = torch.zeros(n_q, h_q, d, dtype=torch.float32)
        dk = torch.zeros(k.shape, dtype=torch.float32)
        dv = torch.zeros(v.shape, dtype=torch.float32)
        block_q0, block_nq, seq_b0, seq_b1 = blocks
        rc = cpu_ops.attention_backward(
            q2, k, v, h_kv, strides[0], strides[1], strides[2], t, bt, q_row, q_pos, block_q0, block_nq, seq_b0,
            seq_b1, float(scale), out, dout, m, l, dq, dk, dv,
        )  # fmt: skip
        if rc:
            raise ValueError(f"zerokld CPU attention backward refused its arguments (code {rc})")
        return (dq.reshape(q_shape).to(q2.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None)


def dense_attention_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal self-attention over right-padded dense sequences (the trainer's layout; the signature of
    :func:`shared_numerics.attention.dense_causal_attention`, which calls this for CPU tensors).

    Args:
        q: ``[B, T, Hq, D]``; k, v: ``[B, T, Hkv, D]``, one dtype (float32 / bfloat16 / float16). Token ``t`` is at
            position ``t``.

    Returns:
        ``[B, T, Hq, D]`` in ``q.dtype``, row ``(b, t)`` bitwise what :func:`paged_attention_cpu` gives for the same
        prefix. Differentiable (float32 gradients rounded to the inputs' dtypes).
    """
    sharded = on_local_shards(lambda a, b, c: dense_attention_cpu(a, b, c, scale), (q, k, v), (0, 2))
    if sharded is not None:  # tensor parallelism: heads (or sequences) sharded, each rank attends its own
        return sharded
    q, k, v = _plain(q, k, v)
    _check(q.reshape(-1, q.shape[2], q.shape[3]), k, v, k.shape[2])
    return _DenseAttention.apply(q, k, v, float(scale), None).to(q.dtype)


def gathered_attention_cpu(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """One query per sequence over the first ``lens[n]`` keys of its own gathered key sequence (DeepSeek Sparse
    Attention's selected tokens, :mod:`shared_numerics.dsa`): the query sits at position ``lens[n] - 1``, so it is
    bitwise the row ``lens[n] - 1`` of :func:`dense_attention_cpu` over those keys (the same kernel and units).

    Args:
        q: ``[N, Hq, D]``; k, v: ``[N, L, Hkv, D]`` (one dtype: float32 / bfloat16 / float16); lens: ``[N]`` int,
            ``1 <= lens[n] <= L`` (keys past ``lens[n]`` are never read into the result).

    Returns:
        ``[N, Hq, D]`` in ``q.dtype``. Differentiable (float32 gradients rounded to the inputs' dtypes; keys past
        ``lens[n]`` get zero gradients).

    Raises:
        TypeError / ValueError: as :func:`dense_attention_cpu`; a length outside ``1 .. L``.
    """
    q, k, v = _plain(q, k, v)
    _check(q, k, v, k.shape[2])
    lens = lens.to("cpu", torch.long)
    if lens.numel() and (int(lens.min()) < 1 or int(lens.max()) > k.shape[1]):
        raise ValueError(f"gathered attention: lengths must lie in 1 .. {k.shape[1]}, got {lens.tolist()}")
    n, h_q, d = q.shape
    return _DenseAttention.apply(q.reshape(n, 1, h_q, d), k, v, float(scale), lens).reshape(n, h_q, d).to(q.dtype)
