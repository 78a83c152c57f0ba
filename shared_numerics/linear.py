"""Batch-invariant linear layer (``y = x @ W^T + b``) on CPU.

A BLAS ``gemm`` chooses its algorithm (gemv for one row, packing, blocking, threading) from the problem shape, so the
same row of ``x`` can come out different bits depending on how many other rows are in the call. Here every call is
cut into fixed ``ROW_TILE``-row tiles (zero-padded) and the tiles go through one batched matmul whose per-tile shape
``[ROW_TILE, K] x [K, N]`` never changes: a row's result depends only on the row, ``W`` and ``b``.

Precision: inputs and weights are upcast to float32, accumulation is float32, the result is rounded once to the input
dtype (bf16 in, bf16 out). This is also the fast path on CPUs without native bf16.

Source: fixed-tile approach of vLLM's batch-invariant mode (``vllm/model_executor/layers/batch_invariant.py``) and of
Thinking Machines' persistent matmul (one fixed tile config); the tile size 16 was measured invariant for 1 and 2
threads on AVX2 (see ``tests/test_numerics.py``).
"""
from __future__ import annotations

import torch

__all__ = ["ROW_TILE", "linear", "matmul_rows"]

ROW_TILE = 16


def matmul_rows(x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """Row-invariant ``x @ w_t`` in float32.

    Args:
        x: ``[M, K]`` float32.
        w_t: ``[K, N]`` float32 (may be a transposed view).

    Returns:
        ``[M, N]`` float32; row ``i`` depends only on ``x[i]`` and ``w_t``.
    """
    m, k = x.shape
    n_tiles = (m + ROW_TILE - 1) // ROW_TILE
    pad = n_tiles * ROW_TILE - m
    if pad:
        x = torch.cat([x, x.new_zeros(pad, k)], dim=0)
    tiles = x.reshape(n_tiles, ROW_TILE, k)
    out = torch.bmm(tiles, w_t.unsqueeze(0).expand(n_tiles, *w_t.shape))
    return out.reshape(n_tiles * ROW_TILE, -1)[:m]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Batch-invariant ``torch.nn.functional.linear``.

    Args:
        x: ``[..., K]``, float32 or bfloat16.
        weight: ``[N, K]`` (HF / ``nn.Linear`` layout), any float dtype.
        bias: optional ``[N]``.

    Returns:
        ``[..., N]`` in ``x.dtype``. Differentiable; the backward is deterministic (fixed-shape CPU ops, no atomics).
    """
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).float()
    y = matmul_rows(x2, weight.float().t())
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*lead, weight.shape[0])
