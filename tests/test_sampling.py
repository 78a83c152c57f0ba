"""Counter-based sampler (shared_numerics.sampling): a pure function of (logits row, seed, position)."""

from __future__ import annotations

import pytest
import torch

from shared_numerics.sampling import sample_tokens, uniform_noise


def test_noise_is_a_pure_function_of_seed_position_and_index():
    seeds = torch.tensor([0, 1, 2**62 + 5, 7])
    pos = torch.tensor([0, 0, 3, 10**6])
    u = uniform_noise(seeds, pos, 1000)
    assert u.dtype == torch.float64 and bool(((u > 0) & (u < 1)).all())
    assert torch.equal(u, uniform_noise(seeds, pos, 1000))
    for i in range(4):  # row i alone == row i in the batch; a prefix of the vocabulary is a prefix of the noise
        assert torch.equal(uniform_noise(seeds[i : i + 1], pos[i : i + 1], 1000)[0], u[i])
        assert torch.equal(uniform_noise(seeds[i : i + 1], pos[i : i + 1], 10)[0], u[i, :10])
    assert not torch.equal(u[0], u[1])  # seed matters
    assert not torch.equal(uniform_noise(seeds[:1], torch.tensor([1]), 1000)[0], u[0])  # position matters
    assert len(set(u[0].tolist())) == 1000
    assert abs(float(u.mean()) - 0.5) < 0.02
    with pytest.raises(ValueError, match="non-negative"):
        uniform_noise(seeds[:1], torch.tensor([-1]), 4)


def test_every_int64_seed_is_a_seed():
    """vLLM takes any int64 ``seed`` (``CompletionRequest.seed``: ``ge=-2**63``); a negative one is its 64 bits, not an
    error. Before this, a request with ``seed: -1377816`` raised inside the engine's step and stopped the engine
    (found by tests/servers/test_server_fuzz.py)."""
    seeds = torch.tensor([-1, -(2**63), 2**63 - 1, -1377816, 1])
    pos = torch.tensor([0, 5, 5, 2, 0])
    u = uniform_noise(seeds, pos, 512)
    assert bool(((u > 0) & (u < 1)).all()) and torch.equal(u, uniform_noise(seeds, pos, 512))
    for i in range(len(seeds)):
        assert torch.equal(uniform_noise(seeds[i : i + 1], pos[i : i + 1], 512)[0], u[i])
    assert len({tuple(row.tolist()) for row in u}) == len(seeds)  # -1 is not 1, -2**63 is not 2**63 - 1
    assert abs(float(u.mean()) - 0.5) < 0.02


def test_samples_follow_the_softmax():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5, 1.5])
    n = 40000
    probs = torch.softmax(logits / 0.8, -1)
    toks = sample_tokens(logits.repeat(n, 1), torch.full((n,), 0.8), torch.full((n,), 123), torch.arange(n))
    freq = torch.bincount(toks, minlength=6).double() / n
    assert (freq - probs.double()).abs().max() < 0.01, (freq, probs)


def test_batch_and_thread_invariance_and_top_k_top_p():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 500, generator=g) * 3
    logits[5, 7] = -200.0  # a tail token with probability ~0: p = 1.0 must still keep it
    temp = torch.rand(64, generator=g) + 0.5
    seeds = torch.randint(0, 2**62, (64,), generator=g)
    pos = torch.randint(0, 1000, (64,), generator=g)
    top_k = torch.where(torch.arange(64) % 3 == 0, torch.tensor(500), torch.tensor(10))
    top_p = torch.where(
        torch.arange(64) % 2 == 0, torch.tensor(1.0, dtype=torch.float64), torch.tensor(0.7, dtype=torch.float64)
    )
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batch = sample_tokens(logits, temp, seeds, pos, top_k, top_p)
        torch.set_num_threads(1)
        for i in range(64):
            k = top_k[i : i + 1] if int(top_k[i]) < 500 else None
            p = top_p[i : i + 1] if float(top_p[i]) < 1.0 else None
            alone = sample_tokens(logits[i : i + 1], temp[i : i + 1], seeds[i : i + 1], pos[i : i + 1], k, p)
            assert int(alone) == int(batch[i]), f"row {i}"
    finally:
        torch.set_num_threads(threads)
    for i in range(64):
        if int(top_k[i]) == 10:
            assert int(batch[i]) in torch.topk(logits[i], 10).indices.tolist()
    # top-p 0.7: the token lies in the smallest set of most likely tokens holding 70% of the mass
    z = logits / temp.unsqueeze(1)
    for i in range(1, 64, 2):
        if int(top_k[i]) == 500:
            p = torch.softmax(z[i].double(), -1)
            order = torch.argsort(p, descending=True)
            keep = int((torch.cumsum(p[order], 0) - p[order] < 0.7).sum())
            assert int(batch[i]) in order[:keep].tolist()
    with pytest.raises(ValueError, match="temperature"):
        sample_tokens(logits[:1], torch.zeros(1), seeds[:1], pos[:1])


def test_negative_control_stock_vllm_sampler_depends_on_the_batch():
    """vLLM's own ``random_sample`` (v1/sample/ops/topk_topp_sampler.py) draws an unseeded batch's exponential noise
    from one global generator: the same row gets another token alone than in the batch. Measured on this machine
    (2 cores): stock is thread-count invariant too (1 vs 2 threads, seeded and unseeded: 0/64 differ), and seeded
    stock requests (one torch.Generator each) are batch-invariant; what stock lacks there is a noise that is a pure
    function of (seed, position), which the trainer can recompute and a preempted request resumes without state."""
    from vllm.v1.sample.ops.topk_topp_sampler import random_sample

    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(64, 500, generator=g) * 3, -1)
    torch.manual_seed(5)
    batch = random_sample(probs.clone(), {})
    differing = 0
    for i in range(64):
        torch.manual_seed(5)
        differing += int(random_sample(probs[i : i + 1].clone(), {})) != int(batch[i])
    assert differing > 0
    # ours, same rows, alone vs batch: see test_batch_and_thread_invariance_and_top_k_top_p
    seeds, pos = torch.full((64,), 5), torch.arange(64)
    ours = sample_tokens(probs.log(), torch.ones(64), seeds, pos)
    assert all(
        int(sample_tokens(probs[i : i + 1].log(), torch.ones(1), seeds[i : i + 1], pos[i : i + 1])) == int(ours[i])
        for i in range(64)
    )


def test_unseeded_requests_draw_seeds_from_the_engine_seed():
    """A request without ``seed`` gets one from a stream seeded with the engine's ``--seed`` (vLLM samples unseeded
    requests from its seeded generator: same seed, same order, same tokens); another engine seed gives another
    stream; an engine without a seed draws from ``secrets`` (control: two such engines differ)."""
    from types import SimpleNamespace

    from vllm_plugin.sampler import unseeded_request_seed

    def engine(seed):
        return SimpleNamespace(vllm_config=SimpleNamespace(model_config=SimpleNamespace(seed=seed)))

    def draws(owner):
        return [unseeded_request_seed(owner) for _ in range(6)]

    a, b = draws(engine(0)), draws(engine(0))
    assert a == b and len(set(a)) == 6 and all(0 <= x < 2**62 for x in a)
    assert draws(engine(1)) != a
    assert draws(engine(None)) != draws(engine(None))
