"""Fused lm_head + selected-token log-probs: ``l_i = log_softmax(h_i @ W^T)[t_i]`` without ``[N, V]`` logits in memory.

Forward: rows are processed in chunks of ``chunk`` rows (a multiple of :data:`shared_numerics.linear.ROW_TILE`); each
chunk computes its logits with :func:`shared_numerics.linear.linear` (rounded to the hidden states' dtype, exactly as
the unfused model's lm_head does) and its log-probs with :func:`shared_numerics.logprobs.selected_logprobs`. Both ops
are row-invariant, so the result is bitwise the unfused ``selected_logprobs(lm_head(h), t)`` — and therefore bitwise
what vLLM reports.

Backward (closed form, recomputing each chunk's logits): with ``p = softmax(z)`` and upstream gradient ``g_i``,
``dz = g * (onehot(t) - p)``, ``dh = dz @ W``, ``dW = sum_chunks dz^T @ h`` (float32, fixed chunk order, so
deterministic). Peak extra memory is ``O(chunk * V)``. This matches autograd of the unfused path up to the order of
float32 sums (the tests state the tolerance).

Source: the chunked cross-entropy of Liger-Kernel (``fused_linear_cross_entropy``) and TorchTitan's
``ChunkedLossWrapper``, specialised to selected-token log-probs for RL losses.
"""

from __future__ import annotations

import torch

from .linear import ROW_TILE, linear, matmul_rows
from .logprobs import selected_logprobs
from .reduce import exp64

__all__ = ["CHUNK_LOGITS", "auto_chunk", "fused_selected_logprobs", "rows_per_chunk"]

CHUNK_LOGITS = 1 << 24  # logits per chunk by default (64 MiB in float32; the backward's float64 exp doubles it)


def auto_chunk(vocab_size: int) -> int:
    """Rows per chunk so that a chunk holds about :data:`CHUNK_LOGITS` logits (16..1024 rows)."""
    return max(ROW_TILE, min(1024, CHUNK_LOGITS // max(vocab_size, 1) // ROW_TILE * ROW_TILE))


def rows_per_chunk(chunk: int | None, vocab_size: int) -> int:
    """A fused path's rows per chunk: ``chunk`` rounded up to a multiple of ``ROW_TILE`` (at least one tile), or
    :func:`auto_chunk` of ``vocab_size`` for ``None``."""
    return auto_chunk(vocab_size) if chunk is None else max(ROW_TILE, (chunk + ROW_TILE - 1) // ROW_TILE * ROW_TILE)


class _FusedSelectedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int, chain=None
    ) -> torch.Tensor:
        out = hidden.new_empty(hidden.shape[0], dtype=torch.float32)
        for s in range(0, hidden.shape[0], chunk):
            out[s : s + chunk] = selected_logprobs(linear(hidden[s : s + chunk], weight), targets[s : s + chunk])
        ctx.save_for_backward(hidden, weight, targets)
        ctx.chunk = chunk
        ctx.chain = chain
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        hidden, weight, targets = ctx.saved_tensors
        w32 = weight.float()
        grad_h = torch.empty_like(hidden, dtype=torch.float32)
        chain = ctx.chain
        grad_w = None if chain is not None else torch.zeros_like(w32)
        for s in range(0, hidden.shape[0], ctx.chunk):
            h = hidden[s : s + ctx.chunk]
            z = linear(h, weight).float()
            z = z - z.amax(dim=-1, keepdim=True)
            e = exp64(z)
            p = e / e.sum(dim=-1, keepdim=True)
            dz = -p
            dz[torch.arange(z.shape[0], device=z.device), targets[s : s + ctx.chunk]] += 1.0
            dz = dz * grad_out[s : s + ctx.chunk].float().unsqueeze(1)
            grad_h[s : s + ctx.chunk] = matmul_rows(dz, w32)
            if chain is not None:  # the float32 kernel's chains over the tokens go on (shared_numerics.grad_chain)
                chain.add_gemm(dz.t(), h.float().t())
            else:
                grad_w += dz.t() @ h.float()
        return grad_h.to(hidden.dtype), None if grad_w is None else grad_w.to(weight.dtype), None, None, None


def fused_selected_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int | None = None, *, weight_chain=None
) -> torch.Tensor:
    """Log-prob of ``targets`` under ``softmax(hidden @ weight^T)``, chunked, with a closed-form backward.

    Args:
        hidden: ``[N, H]`` final hidden states (float32 or bfloat16).
        weight: ``[V, H]`` lm_head weight.
        targets: ``[N]`` int64 token ids.
        chunk: rows per chunk (rounded up to a multiple of ``ROW_TILE``); ``None``: :func:`auto_chunk` of the
            vocabulary size. The result does not depend on it (row-invariant ops); memory and speed do.
        weight_chain: a :class:`shared_numerics.grad_chain.GradChain` that takes the weight's gradient, as chains
            over the rows in order on the float32 kernel (exact accumulation; none is returned to autograd).

    Returns:
        ``[N]`` float32, bitwise equal to ``selected_logprobs(linear(hidden, weight), targets)``.

    Raises:
        ValueError: shape mismatch.
    """
    if (
        hidden.dim() != 2
        or weight.dim() != 2
        or hidden.shape[1] != weight.shape[1]
        or targets.shape != (hidden.shape[0],)
    ):
        raise ValueError(
            f"expected hidden [N, H], weight [V, H], targets [N]; got {tuple(hidden.shape)}, "
            f"{tuple(weight.shape)}, {tuple(targets.shape)}"
        )
    return _FusedSelectedLogprobs.apply(
        hidden, weight, targets.long(), rows_per_chunk(chunk, weight.shape[0]), weight_chain
    )
