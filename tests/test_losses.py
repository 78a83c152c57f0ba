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


# A hand-made batch: two sequences (3 + 2 tokens), ratios inside and outside every clip range, both advantage signs.
L = [math.log(0.5), math.log(0.3), math.log(0.9), math.log(0.2), math.log(0.6)]
Q = [math.log(0.25), math.log(0.3), math.log(0.6), math.log(0.4), math.log(0.5)]  # r = 2.0, 1.0, 1.5, 0.5, 1.2
A = [1.0, -1.0, -0.5, -2.0, 0.7]
SEQ = [0, 0, 0, 1, 1]


def _run(fn, cfg):
    from shared_numerics.losses import LossBatch

    logp = torch.tensor(L, dtype=torch.float32, requires_grad=True)
    loss, flags = fn(logp, torch.tensor(Q), torch.tensor(A), cfg, LossBatch(torch.tensor(SEQ), 2))
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    return loss.detach().tolist(), grad.tolist(), {k: v.tolist() for k, v in flags.items()}


def _clip(x, lo, hi):
    return min(max(x, lo), hi)


def test_dapo_clip_higher():
    from shared_numerics.losses import DAPOConfig, ppo_loss

    loss, grad, flags = _run(ppo_loss, DAPOConfig())
    ref, ref_grad = [], []
    for lt, qt, at in zip(L, Q, A, strict=True):
        r = math.exp(lt - qt)
        un, cl = r * at, _clip(r, 0.8, 1.28) * at
        ref.append(-min(un, cl))
        ref_grad.append(-r * at if un <= cl else 0.0)  # d(r)/dl = r; the clipped branch has no gradient
    assert loss == pytest.approx(ref, rel=1e-6) and grad == pytest.approx(ref_grad, rel=1e-6, abs=1e-7)
    assert flags["clipped"] == [True, False, True, True, False]


def test_cispo_keeps_gradient_on_clipped_tokens():
    from shared_numerics.losses import CISPOConfig, cispo_loss

    cfg = CISPOConfig(clip_low_threshold=0.8, clip_high_threshold=1.3)
    loss, grad, flags = _run(cispo_loss, cfg)
    w = [_clip(math.exp(lt - qt), 0.8, 1.3) for lt, qt in zip(L, Q, strict=True)]
    assert loss == pytest.approx([-wi * at * lt for wi, at, lt in zip(w, A, L, strict=True)], rel=1e-6)
    assert grad == pytest.approx([-wi * at for wi, at in zip(w, A, strict=True)], rel=1e-6)  # never zero
    assert flags["clipped"] == [True, False, True, True, False]


def test_dro():
    from shared_numerics.losses import DROConfig, dro_loss

    loss, grad, _ = _run(dro_loss, DROConfig(beta=0.1))
    assert loss == pytest.approx(
        [-(lt * at - 0.05 * (lt - qt) ** 2) for lt, qt, at in zip(L, Q, A, strict=True)], rel=1e-6
    )
    assert grad == pytest.approx([-(at - 0.1 * (lt - qt)) for lt, qt, at in zip(L, Q, A, strict=True)], rel=1e-6)


def test_gspo_sequence_ratio():
    from shared_numerics.losses import GSPOConfig, gspo_loss

    loss, grad, flags = _run(gspo_loss, GSPOConfig(clip_low=0.2, clip_high=0.2))
    s = []
    for k in (0, 1):
        d = [lt - qt for lt, qt, sq in zip(L, Q, SEQ, strict=True) if sq == k]
        s.append(math.exp(sum(d) / len(d)))
    ref, ref_grad = [], []
    for at, sq in zip(A, SEQ, strict=True):
        si = s[sq]
        un, cl = si * at, _clip(si, 0.8, 1.2) * at
        ref.append(-min(un, cl))
        ref_grad.append(-si * at if un <= cl else 0.0)
    assert loss == pytest.approx(ref, rel=1e-6) and grad == pytest.approx(ref_grad, rel=1e-6, abs=1e-7)
    assert flags["clipped"] == [s[0] > 1.2 or s[0] < 0.8] * 3 + [s[1] > 1.2 or s[1] < 0.8] * 2


def test_dr_grpo_advantages_not_std_scaled():
    from shared_numerics.losses import dr_grpo_advantages

    assert dr_grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 4).tolist() == [0.5, -0.5, -0.5, 0.5]


@pytest.mark.titan
@pytest.mark.parametrize("normalization,divisor", [("token_mean", 5.0), ("sum", 1.0), ("constant", 8.0)])
def test_rlloss_masks_tokens_and_normalises(normalization, divisor):
    """RLLoss on logits: IGNORE_INDEX tokens contribute nothing and are not counted; the normaliser is named."""
    from torchtitan.components.loss import IGNORE_INDEX

    import shared_numerics as sn
    from titan_plugin.losses import RLLoss

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 4, 7, generator=g)
    labels = torch.tensor([[3, 1, IGNORE_INDEX, 2], [IGNORE_INDEX, 5, 6, IGNORE_INDEX]])
    adv = torch.tensor([[1.0, -1.0, 9.0, 0.5], [9.0, 2.0, -0.3, 9.0]])
    q = torch.full((2, 4), -2.0)
    loss_fn = RLLoss.Config(loss_fn="ppo", normalization=normalization, normalizer=8.0).build()
    loss_fn.set_rl_inputs(adv, q)
    loss, _ = loss_fn(logits, labels, torch.tensor(5))
    mask = labels != IGNORE_INDEX
    lp = sn.log_softmax(logits)[mask].gather(1, labels[mask].unsqueeze(1)).squeeze(1)
    r = torch.exp(lp + 2.0)
    ref = -torch.minimum(r * adv[mask], r.clamp(0.8, 1.2) * adv[mask])
    assert loss.item() == pytest.approx(ref.sum().item() / divisor, rel=1e-6)
    with pytest.raises(ValueError, match="normalization"):
        RLLoss.Config(normalization="per_sequence").build()


def test_corrections_k3_tis_mis():
    from shared_numerics.losses import CorrectionConfig, apply_corrections

    logp = torch.tensor([math.log(0.5), math.log(0.3), math.log(0.9)])
    q = torch.tensor([math.log(0.25), math.log(0.3), math.log(0.6)])  # ratios 2.0, 1.0, 1.5
    ref = torch.tensor([math.log(0.4), math.log(0.3), math.log(0.8)])
    base = torch.tensor([1.0, 2.0, 3.0])
    out, keep = apply_corrections(base, logp, q, CorrectionConfig(tis_cap=1.2))
    assert out.tolist() == pytest.approx([1.2, 2.0, 3.6]) and keep.all()
    out, keep = apply_corrections(base, logp, q, CorrectionConfig(mis_low=0.5, mis_high=1.6))
    assert out.tolist() == pytest.approx([0.0, 2.0, 3.0]) and keep.tolist() == [False, True, True]
    out, _ = apply_corrections(base, logp, q, CorrectionConfig(kl_beta=0.1), ref)
    k3 = [math.exp(r - lt) - (r - lt) - 1 for r, lt in zip(ref.tolist(), logp.tolist(), strict=True)]
    assert out.tolist() == pytest.approx([b + 0.1 * k for b, k in zip(base.tolist(), k3, strict=True)], rel=1e-6)
    with pytest.raises(ValueError, match="reference"):
        apply_corrections(base, logp, q, CorrectionConfig(kl_beta=0.1))


def test_dapo_helpers():
    from shared_numerics.losses import dapo_dynamic_sampling_keep, overlong_penalty

    keep = dapo_dynamic_sampling_keep(torch.tensor([1.0, 1.0, 0.1, 0.1, 1.0, 0.0]), group_size=2)
    assert keep.tolist() == [False, False, False, False, True, True]
    pen = overlong_penalty(torch.tensor([10, 80, 90, 100, 120]), max_length=100, cache_length=20)
    assert pen.tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0, -1.0])


@pytest.mark.titan
def test_rlloss_masked_is_leaves_the_normaliser():
    from torchtitan.components.loss import IGNORE_INDEX

    import shared_numerics as sn
    from titan_plugin.losses import RLLoss

    g = torch.Generator().manual_seed(4)
    logits = torch.randn(1, 4, 7, generator=g)
    labels = torch.tensor([[3, 1, 2, IGNORE_INDEX]])
    lp = sn.log_softmax(logits)[0, :3].gather(1, labels[0, :3, None]).squeeze(1)
    q = torch.cat([lp + torch.tensor([0.0, 0.0, -1.0]), torch.zeros(1)]).unsqueeze(0)  # token 2: ratio e > 2
    adv = torch.ones(1, 4)
    loss_fn = RLLoss.Config(loss_fn="importance_sampling", corrections={"mis_low": 0.5, "mis_high": 2.0}).build()
    loss_fn.set_rl_inputs(adv, q)
    loss, _ = loss_fn(logits, labels, torch.tensor(3))
    assert loss.item() == pytest.approx(-2.0 / 2)  # tokens 0, 1: -r*A = -1 each; token 2 dropped; divided by 2


def test_cross_entropy_weights():
    from shared_numerics.losses import NoConfig, cross_entropy_loss

    loss, grad, _ = _run(cross_entropy_loss, NoConfig())
    assert loss == pytest.approx([-a * lt for a, lt in zip(A, L, strict=True)], rel=1e-6)
    assert grad == pytest.approx([-a for a in A], rel=1e-6)


def test_segment_mean_is_exact_per_sequence_whatever_the_order():
    """GSPO's per-sequence mean: a float64 prefix sum over tokens grouped by a stable sort (no atomics, the same on
    CUDA as on CPU); unsorted ids and an empty sequence handled."""
    from shared_numerics.losses import segment_mean

    g = torch.Generator().manual_seed(0)
    d = torch.randn(50, generator=g)
    ids = torch.randint(0, 5, (50,), generator=g)
    ids[ids == 3] = 4  # sequence 3 has no tokens
    got = segment_mean(d, ids, 6)
    want = torch.stack(
        [d[ids == i].double().mean() if (ids == i).any() else torch.tensor(0.0, dtype=torch.float64) for i in range(6)]
    ).float()
    assert torch.allclose(got, want, atol=1e-7) and got[3] == 0 and got[5] == 0
    perm = torch.randperm(50, generator=g)  # tokens interleaved in another order: the same means
    assert torch.allclose(segment_mean(d[perm], ids[perm], 6), got, atol=1e-7)
