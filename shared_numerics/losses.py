"""Per-token RL loss formulas (Tinker semantics: per token, summed; normalisation is the caller's named choice).

Every loss here depends only on per-token quantities — the trainer's log-prob ``l`` of the target token (from
:func:`shared_numerics.selected_logprobs`, bitwise what vLLM reported), the sampler's log-prob ``q``, the advantage
``A`` — and returns ``(loss [N], flags)`` where ``flags`` holds boolean ``[N]`` tensors such as ``clipped`` (ratio
outside the bounds) and ``grad_zeroed`` (the clipped branch was taken: no gradient). ``r = exp(l - q)``.

| name                  | per-token loss                         | source                                       |
|-----------------------|----------------------------------------|----------------------------------------------|
| ``cross_entropy``     | ``-w * l`` (``w`` = the advantages)    | SFT                                          |
| ``importance_sampling`` | ``-r * A``                           | Tinker ``importance_sampling``               |
| ``ppo``               | ``-min(r A, clip(r, lo, hi) A)``       | Schulman et al. 2017; GRPO (Shao et al. 2024) |

The registrations (name, formula, config schema) go through the ``zerokld`` pluggy hooks
(:mod:`zerokld_plugins.builtin`).
"""
from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict

__all__ = ["NoConfig", "PPOConfig", "cross_entropy_loss", "grpo_advantages", "importance_sampling_loss", "ppo_loss"]


class NoConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PPOConfig(BaseModel):
    """Absolute ratio bounds (Tinker's names)."""

    model_config = ConfigDict(extra="forbid")
    clip_low_threshold: float = 0.8
    clip_high_threshold: float = 1.2


def grpo_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """Group-normalised advantages ``(R - mean_group) / (std_group + eps)`` (population std).

    Args:
        rewards: ``[N]``, ``N`` a multiple of ``group_size``; consecutive rows form a group (same prompt).

    Returns:
        ``[N]`` float32; a group whose rewards are all equal gets zeros.
    """
    r = rewards.float().reshape(-1, group_size)
    a = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, unbiased=False, keepdim=True) + eps)
    return a.reshape(-1)


def _no_flags(x: torch.Tensor) -> dict[str, torch.Tensor]:
    z = torch.zeros_like(x, dtype=torch.bool)
    return {"clipped": z, "grad_zeroed": z}


def cross_entropy_loss(logp, sampler_logp, adv, cfg: NoConfig):
    """``-w * l`` with the per-token weights passed as advantages."""
    return -adv * logp, _no_flags(logp)


def importance_sampling_loss(logp, sampler_logp, adv, cfg: NoConfig):
    """``-exp(l - q) * A``."""
    return -torch.exp(logp - sampler_logp) * adv, _no_flags(logp)


def ppo_loss(logp, sampler_logp, adv, cfg: PPOConfig):
    """``-min(r A, clip(r, lo, hi) A)`` with ``r = exp(l - q)``; flags ``clipped`` and ``grad_zeroed``."""
    lo, hi = cfg.clip_low_threshold, cfg.clip_high_threshold
    ratio = torch.exp(logp - sampler_logp)
    unclipped = ratio * adv
    clipped = ratio.clamp(lo, hi) * adv
    outside = (ratio < lo) | (ratio > hi)
    return -torch.minimum(unclipped, clipped), {"clipped": outside, "grad_zeroed": outside & (clipped < unclipped)}
