"""GRPO pieces against hand-computed values."""
from __future__ import annotations

import math

import pytest
import torch

from shared_numerics.losses import PPOConfig, grpo_advantages, importance_sampling_loss, ppo_loss


def test_grpo_advantages():
    a = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5]), group_size=4)
    assert a[:4].tolist() == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)
    assert a[4:].tolist() == [0.0, 0.0, 0.0, 0.0]


def test_ppo_loss_cases():
    lo, hi = 0.8, 1.2
    q = torch.zeros(4)
    logp = torch.tensor([math.log(1.5), math.log(1.5), math.log(0.5), math.log(1.0)])
    adv = torch.tensor([1.0, -1.0, -1.0, 2.0])
    loss, flags = ppo_loss(logp, q, adv, PPOConfig(clip_low_threshold=lo, clip_high_threshold=hi))
    clipped, zeroed = flags["clipped"], flags["grad_zeroed"]
    # r=1.5,A=+1 -> min(1.5, 1.2) = 1.2 (clipped branch, no gradient); r=1.5,A=-1 -> min(-1.5,-1.2) = -1.5
    # r=0.5,A=-1 -> min(-0.5,-0.8) = -0.8 (clipped branch); r=1,A=2 -> 2
    assert loss.tolist() == pytest.approx([-1.2, 1.5, 0.8, -2.0], abs=1e-6)
    assert clipped.tolist() == [True, True, True, False]
    assert zeroed.tolist() == [True, False, True, False]


def test_importance_sampling_loss():
    loss, flags = importance_sampling_loss(torch.tensor([math.log(2.0)]), torch.zeros(1), torch.tensor([3.0]), None)
    assert loss.tolist() == pytest.approx([-6.0])
    assert not flags["clipped"].any()
