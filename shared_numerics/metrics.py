"""Train-inference mismatch metrics (k1, k3, max |Δ|, bitwise-different tokens, clipped fraction).

Definitions (``docs/design.md`` §2; Schulman, "Approximating KL Divergence", 2020): with
``d = logp_train - logp_infer`` over sampled completion tokens, ``k1 = mean(d)``, ``k3 = mean(exp(d) - d - 1)``,
each averaged per sequence first, then over sequences. The clipped fraction counts tokens whose ratio
``r = exp(-d)`` ... is computed by the loss, not here.
"""

from __future__ import annotations

import math

import torch

__all__ = ["logprob_diff_metrics"]


def logprob_diff_metrics(
    train: list[torch.Tensor], infer: list[torch.Tensor], clip_low: float = 0.8, clip_high: float = 1.2
) -> dict[str, float]:
    """Compare trainer and sampler log-probs.

    Args:
        train, infer: per sequence, ``[L_i]`` float32 log-probs of the same completion tokens.
        clip_low, clip_high: absolute bounds on the ratio ``r = exp(train - infer)`` for ``clipped_fraction``.

    Returns:
        ``k1``, ``k3`` (float, nats), ``max_abs_logprob_diff``, ``tokens_bitwise_different`` (count),
        ``clipped_fraction`` (share of tokens with ``r`` outside ``[clip_low, clip_high]``), ``num_tokens``.

    Raises:
        ValueError: on a length mismatch.
    """
    if len(train) != len(infer):
        raise ValueError(f"{len(train)} trainer sequences vs {len(infer)} sampler sequences")
    k1s, k3s, max_abs, n_diff, n_clip, n_tok = [], [], 0.0, 0, 0, 0
    for a, b in zip(train, infer, strict=True):
        a = a.double().reshape(-1)
        b = b.double().reshape(-1)
        if a.shape != b.shape:
            raise ValueError(f"sequence length mismatch {tuple(a.shape)} vs {tuple(b.shape)}")
        if a.numel() == 0:
            continue
        d = a - b
        k1s.append(d.mean().item())
        k3s.append((torch.expm1(d) - d).mean().item())  # exp(d) - d - 1 without cancellation at tiny d
        max_abs = max(max_abs, d.abs().max().item())
        n_diff += int((a.float() != b.float()).sum().item())
        r = torch.exp(d)
        n_clip += int(((r < clip_low) | (r > clip_high)).sum().item())
        n_tok += a.numel()
    mean = lambda xs: sum(xs) / len(xs) if xs else math.nan
    return {
        "k1": mean(k1s),
        "k3": mean(k3s),
        "max_abs_logprob_diff": max_abs,
        "tokens_bitwise_different": n_diff,
        "clipped_fraction": n_clip / n_tok if n_tok else 0.0,
        "num_tokens": n_tok,
    }
