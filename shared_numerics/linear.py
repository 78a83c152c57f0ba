"""Batch-invariant linear layer (``y = x @ W^T + b``) on CPU: fixed-shape vendor GEMM calls.

A BLAS ``gemm`` chooses its algorithm (gemv for one row, small-matrix kernels, packing, blocking, how the threads
split the work) from the problem shape, so the same row of ``x`` can come out different bits depending on how many
other rows are in the call. Here every call is cut into fixed ``ROW_TILE``-row tiles (zero-padded) and all tiles go
through one batched matmul (``torch.bmm``: MKL's batched ``sgemm`` on CPU) whose per-tile shape
``[ROW_TILE, K] x [K, N]`` never changes: a row's result depends only on the row, ``W`` and ``b`` — not on ``M``, not on
which tile the row lands in, and (the tests check it at 1 and 2 threads) not on the thread count.

Tile size: the batched GEMM packs ``W`` once per tile, so small tiles pay that copy ``M / ROW_TILE`` times, while a
decode step of a few rows computes a whole tile; ``benchmarks/linear.py`` measures the trade-off (``--row-tiles``).
32 rows (measured on a 2-core AMD EPYC, AVX2, float32, ``K = N = 1024``, ours ÷ ``F.linear`` forward): 0.19x at
``M = 1``, 0.67x at 16, 0.94x at 32, 0.77x at 256, 0.85x at 2048 (16 rows: 0.23x, 0.95x, 0.93x, 0.59x, 0.67x); an RL
step decodes a group of tens to hundreds of sequences at once and trains on thousands of tokens.

Precision: inputs and weights are upcast to float32, accumulation is float32, the result is rounded once to the input
dtype (bf16 in, bf16 out). On a CPU without bf16 matrix units (AVX2) this is also the fast path: torch's bf16 GEMM
there has no vendor kernel.

Backward (:class:`_RowTiledLinear`): ``dX = dY W`` through the same row tiles (so the gradient of a row is row
invariant too) and ``dW = dY^T X`` as one float32 GEMM over the call's rows (deterministic for a given shape and
thread count; the trainer's exact streaming accumulates one rollout per backward, so its shape is that rollout's).

Source: fixed-tile approach of vLLM's batch-invariant mode (``vllm/model_executor/layers/batch_invariant.py``) and of
Thinking Machines' persistent matmul (one fixed tile config); the closed-form backward is the one of
``torch.nn.functional.linear``.
"""
from __future__ import annotations

import torch

__all__ = ["ROW_TILE", "linear", "matmul_rows"]

ROW_TILE = 32


def matmul_rows(x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """Row-invariant ``x @ w_t`` in float32 (no autograd of its own: :func:`linear` is the differentiable form).

    Args:
        x: ``[M, K]`` float32.
        w_t: ``[K, N]`` float32 (may be a transposed view).

    Returns:
        ``[M, N]`` float32; row ``i`` depends only on ``x[i]`` and ``w_t``.
    """
    m, k = x.shape
    tile = ROW_TILE
    n_tiles = (m + tile - 1) // tile
    if n_tiles * tile != m:
        padded = x.new_zeros(n_tiles * tile, k)
        padded[:m] = x
        x = padded
    out = torch.bmm(x.reshape(n_tiles, tile, k), w_t.unsqueeze(0).expand(n_tiles, *w_t.shape))
    return out.view(n_tiles * tile, -1)[:m]


class _RowTiledLinear(torch.autograd.Function):
    """``x [M, K] @ w [N, K]^T`` in float32 with :func:`matmul_rows`; closed-form backward (see the module)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return matmul_rows(x, w.t())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = matmul_rows(grad, w) if ctx.needs_input_grad[0] else None
        grad_w = grad.t().mm(x) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w


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
    w = weight.float()
    if torch.is_grad_enabled() and (x2.requires_grad or w.requires_grad):
        y = _RowTiledLinear.apply(x2, w)
    else:
        y = matmul_rows(x2, w.t())
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*lead, weight.shape[0])
