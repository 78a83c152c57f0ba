"""MoE numerics (shared_numerics.moe): lowest-id tie-break, batch invariance, invariance to expert load, replay."""
from __future__ import annotations

import pytest
import torch

from shared_numerics.moe import gather_route_weights, moe_experts, route_topk

DTYPES = [torch.float32, torch.bfloat16]


def _experts(e=6, h=32, i=48, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*s, generator=g) * 0.1).to(dtype) for s in ((e, i, h), (e, i, h), (e, h, i))]


def test_exact_ties_go_to_the_lowest_expert_id():
    logits = torch.tensor([[0.5, 2.0, 2.0, 1.0, 2.0], [3.0, 3.0, 3.0, 3.0, 3.0]])
    ids, w = route_topk(logits, k=2)
    assert ids.tolist() == [[1, 2], [0, 1]]
    assert torch.equal(w[1], torch.tensor([0.5, 0.5]))
    with pytest.raises(ValueError, match="top-k"):
        route_topk(logits, k=6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_routing_and_experts_are_batch_and_load_invariant(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 32, generator=g).to(dtype)
    router = (torch.randn(6, 32, generator=g) * 0.5).to(dtype)
    router[4] = router[1]  # duplicated expert rows: exact ties in every token's scores
    wg, wu, wd = _experts(dtype=dtype)
    logits = x.float() @ router.float().t()
    ids, w = route_topk(logits, k=2)
    assert not bool(((ids == 4).any(1) & ~(ids == 1).any(1)).any())  # 4 never wins over its twin 1
    y = moe_experts(x, ids, w, wg, wu, wd)
    assert y.dtype == dtype
    for sl in (slice(0, 1), slice(7, 8), slice(3, 30)):
        i2, w2 = route_topk(logits[sl], k=2)
        assert torch.equal(i2, ids[sl]) and torch.equal(w2, w[sl])
        assert torch.equal(moe_experts(x[sl], i2, w2, wg, wu, wd), y[sl])
    # one expert receives 200 more tokens: the first 40 rows do not move
    crowd = torch.cat([x, x[:1].repeat(200, 1)])
    crowd_ids = torch.cat([ids, torch.tensor([[0, 3]]).repeat(200, 1)])
    crowd_w = torch.cat([w, w[:1].repeat(200, 1)])
    assert torch.equal(moe_experts(crowd, crowd_ids, crowd_w, wg, wu, wd)[:40], y)


def test_matches_a_per_token_reference_and_replay_keeps_gradients():
    from shared_numerics import linear, silu_and_mul

    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, 32, generator=g)
    wg, wu, wd = _experts()
    logits = torch.randn(9, 6, generator=g, requires_grad=True)
    ids, w = route_topk(logits, k=3)
    y = moe_experts(x, ids, w, wg, wu, wd)
    for n in range(9):
        acc = None
        for j in range(3):
            e = int(ids[n, j])
            xe = x[n: n + 1]
            part = linear(silu_and_mul(linear(xe, wg[e]), linear(xe, wu[e])), wd[e]).float() * w[n, j]
            acc = part if acc is None else acc + part
        assert torch.equal(acc[0], y[n])
    # replay: recorded ids, weights from the current scores; gradients reach the router logits
    scores = torch.softmax(logits.float(), -1)
    y2 = moe_experts(x, ids, gather_route_weights(scores, ids), wg, wu, wd)
    y2.sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0
