"""RL losses as TorchTitan ``BaseLoss`` subclasses (unfused: they read the model's ``[B, T, V]`` logits).

``GRPOLoss`` is PPO-clip with absolute ratio bounds anchored on the sampler's log-probs (Shao et al., "DeepSeekMath",
2024, GRPO; Schulman et al., 2017, PPO), per token, summed, divided by the global number of completion tokens
(TorchTitan's ``global_valid_tokens``, i.e. a token mean over the batch)::

    l_t = selected_logprobs(logits_t, target_t)          # shared_numerics: bitwise what vLLM reports
    r_t = exp(l_t - q_t)                                  # q_t: sampler (vLLM) log-prob of target_t
    loss_t = -min(r_t * A_t, clip(r_t, lo, hi) * A_t)

The RL inputs (advantages, sampler log-probs) are not labels, so the trainer hands them over with
:meth:`GRPOLoss.set_rl_inputs` right before each step; the loss keeps the training forward's log-probs and a few
metrics in :attr:`GRPOLoss.last`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torchtitan.components.loss import IGNORE_INDEX, BaseLoss

import shared_numerics as sn

__all__ = ["GRPOLoss", "grpo_advantages", "ppo_clip_token_loss"]


def grpo_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """Group-normalised advantages ``(R - mean_group) / (std_group + eps)``.

    Args:
        rewards: ``[N]`` float, ``N`` a multiple of ``group_size``; consecutive rows form a group (same prompt).
        group_size: completions per prompt.

    Returns:
        ``[N]`` float32. A group whose rewards are all equal gets zeros. ``std`` is the population std.
    """
    r = rewards.float().reshape(-1, group_size)
    a = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, unbiased=False, keepdim=True) + eps)
    return a.reshape(-1)


def ppo_clip_token_loss(logp: torch.Tensor, sampler_logp: torch.Tensor, adv: torch.Tensor, clip_low: float,
                        clip_high: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip loss with absolute ratio bounds.

    Args:
        logp, sampler_logp, adv: ``[N]`` float32 trainer log-probs, sampler log-probs, advantages.
        clip_low, clip_high: ratio bounds (e.g. 0.8, 1.2).

    Returns:
        ``(loss [N], clipped [N] bool: ratio outside the bounds, grad_zeroed [N] bool: the clipped branch was taken so
        the token's gradient is zero)``.
    """
    ratio = torch.exp(logp - sampler_logp)
    unclipped = ratio * adv
    clipped = ratio.clamp(clip_low, clip_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    outside = (ratio < clip_low) | (ratio > clip_high)
    grad_zeroed = outside & (clipped < unclipped)
    return loss, outside, grad_zeroed


class GRPOLoss(BaseLoss):
    @dataclass(kw_only=True, slots=True)
    class Config(BaseLoss.Config):
        clip_low_threshold: float = 0.8
        clip_high_threshold: float = 1.2

    def __init__(self, config: Config, *, compile_config=None):
        self.config = config
        self._adv: torch.Tensor | None = None
        self._sampler_logp: torch.Tensor | None = None
        self.last: dict = {}

    def set_rl_inputs(self, advantages: torch.Tensor, sampler_logprobs: torch.Tensor | None) -> None:
        """Advantages and sampler log-probs for the next step, both ``[B, T]`` aligned with the labels.

        ``sampler_logprobs=None`` means on-policy (``q = stop_gradient(l)``, ratio 1): the loss is then plain
        advantage-weighted log-likelihood, and with advantages 1 it is SFT cross-entropy (token mean).
        """
        self._adv, self._sampler_logp = advantages, sampler_logprobs

    def __call__(self, pred: torch.Tensor, labels: torch.Tensor, global_valid_tokens=None, **kwargs):
        if self._adv is None:
            raise RuntimeError("GRPOLoss needs set_rl_inputs(advantages, sampler_logprobs) before each step")
        mask = labels != IGNORE_INDEX
        logp = sn.selected_logprobs(pred[mask], labels[mask])
        q = logp.detach() if self._sampler_logp is None else self._sampler_logp.to(pred.device)[mask]
        adv = self._adv.to(pred.device)[mask]
        tok_loss, outside, zeroed = ppo_clip_token_loss(
            logp, q, adv, self.config.clip_low_threshold, self.config.clip_high_threshold
        )
        loss = tok_loss.sum()
        if global_valid_tokens is not None:
            loss = loss / global_valid_tokens
        self.last = {"train_logprobs": logp.detach(), "mask": mask, "clipped": outside, "grad_zeroed": zeroed}
        self._adv = self._sampler_logp = None
        return loss, {}
