"""Log-softmax and selected-token log-probs, batch invariant.

``log_softmax(z) = z - max(z) - log(sum(exp(z - max(z))))`` with the exponentials in float64, the vocabulary sum by
the fixed tree of :func:`shared_numerics.reduce.tree_sum` (float64) and one rounding to float32. Both the trainer
and vLLM's sampler call these functions, so a token's log-prob is the same bits on both sides.

Source: vLLM ``v1/sample/sampler.py`` (``compute_logprobs``: ``logits.log_softmax(dim=-1, dtype=torch.float32)``),
which this replaces when the plugin is on.
"""

from __future__ import annotations

import torch

from .reduce import tree_sum

__all__ = ["log_softmax", "selected_logprobs"]


def _logsumexp(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(shifted, lse)``: ``z - max`` (float32) and ``log(sum(exp(z - max)))`` (float64), both ``[...,
    1]``-keepdim."""
    m = z.amax(dim=-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    shifted = z - m
    lse = torch.log(tree_sum(torch.exp(shifted.double()), dim=-1, keepdim=True))
    return shifted, lse


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """Batch-invariant ``log_softmax`` over the last dimension.

    Args:
        logits: ``[..., V]``, any float dtype (upcast to float32).

    Returns:
        ``[..., V]`` float32 log-probabilities. Differentiable.
    """
    shifted, lse = _logsumexp(logits.float())
    return (shifted.double() - lse).float()


def selected_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Log-prob of one chosen token per row, without materialising the full float32 log-softmax.

    Args:
        logits: ``[N, V]`` any float dtype.
        token_ids: ``[N]`` int64 vocabulary ids.

    Returns:
        ``[N]`` float32, bitwise equal to ``log_softmax(logits)[i, token_ids[i]]``.
    """
    shifted, lse = _logsumexp(logits.float())
    picked = shifted.gather(-1, token_ids.reshape(-1, 1).long())
    return (picked.double() - lse).float().reshape(-1)
