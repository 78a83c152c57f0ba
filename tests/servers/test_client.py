"""TrainingClient (Tinker-compatible) over the real TorchTitan trainer: fused vs two-pass custom path, state I/O."""

from __future__ import annotations

import random

import pytest
import torch

from shared_numerics.rollout import RolloutBatch
from titan_plugin import TrainingClient, trainer_logprobs
from titan_plugin.models import hf_state_dict

pytestmark = pytest.mark.titan


def _batch(seed: int):
    rng = random.Random(seed)
    seqs = [[1] + [rng.randrange(3, 100) for _ in range(rng.randrange(8, 40))] for _ in range(6)]
    plens = [rng.randrange(2, len(s) - 1) for s in seqs]
    adv = [rng.uniform(-1, 1) for _ in seqs]
    return seqs, plens, adv


def _weights(n: int, p: int) -> list[float]:
    """A multi-turn mask over the ``n`` targets: 0 on the prompt, then a first completion segment at 1, a tool
    output at 0, a second segment at 0.5 and the rest at 1 (not a suffix)."""
    w = [0.0] * (p - 1) + [1.0] * (n - p + 1)
    a, b = p - 1 + (n - p + 1) // 4, p - 1 + (n - p + 1) // 2
    w[a:b] = [0.0] * (b - a)
    w[b : b + 2] = [0.5] * len(w[b : b + 2])
    return w


def _datums(seqs, plens, adv, sampler):
    """Tinker datums: every per-token input has one value per target token; advantages and sampler log-probs are
    set on every position (the weights alone mask)."""
    out = []
    for s, p, a, q in zip(seqs, plens, adv, sampler, strict=True):
        n = len(s) - 1
        out.append(
            {
                "model_input": s[:-1],
                "loss_fn_inputs": {
                    "target_tokens": s[1:],
                    "weights": _weights(n, p),
                    "advantages": [a] * n,
                    "logprobs": q.tolist(),
                },
            }
        )
    return out


def _state(client):
    t = client.trainer
    return hf_state_dict(t.model, t.model_config, t._hf)


LOSS_CASES = [
    ("cross_entropy", "qwen3", "float32"),
    ("ppo", "qwen3", "float32"),
    ("ppo", "llama", "bfloat16"),
    ("importance_sampling", "qwen3", "float32"),
    ("dapo", "qwen3", "float32"),
    ("dr_grpo", "qwen3", "float32"),
    ("gspo", "qwen3", "float32"),
    ("cispo", "qwen3", "float32"),
    ("dro", "llama", "bfloat16"),
]


@pytest.mark.parametrize("loss_name,family,dtype", LOSS_CASES)
def test_fused_and_two_pass_custom_agree_bitwise(checkpoint_factory, tmp_path, loss_name, family, dtype):
    """For every loss, on Tinker datums with a multi-segment weight mask (prompt 0, tool output 0, a segment at 0.5):
    one log-prob per target token (== trainer_logprobs, hence vLLM's), and the same loss value and parameters after
    one optim_step, bit for bit, between the fused loss and a Tinker-style two-pass custom loss that reads
    ``loss_fn_inputs["advantages"]`` / ``["weights"]`` (one per target token) and runs the same registered formula:
    pass 2 back-propagates exactly the dL/dl the fused loss's autograd produces."""
    from shared_numerics.losses import LossBatch
    from zerokld_plugins import get_loss, resolve

    spec = get_loss(loss_name)
    formula, cfg = resolve(spec.token_loss), resolve(spec.config_schema)()
    ckpt = checkpoint_factory(family, dtype)
    seqs, plens, adv = _batch(31)
    ref = trainer_logprobs(ckpt, seqs, [1] * len(seqs), dtype=dtype)  # every target token
    sampler = [
        r + 0.05 * torch.randn(r.shape, generator=torch.Generator().manual_seed(i)) for i, r in enumerate(ref)
    ]  # ratios around 1, some outside the clip ranges
    results = {}
    for mode in ("fused", "custom"):
        client = TrainingClient.from_checkpoint(ckpt, dtype=dtype, learning_rate=1e-3, dump_folder=str(tmp_path / mode))
        try:
            data = _datums(seqs, plens, adv, sampler)
            if mode == "fused":
                out = client.forward_backward(data, loss_name)
            else:

                def loss_fn(batch, lps):  # the registered formula over all tokens, weighted, summed once
                    li = [d["loss_fn_inputs"] for d in batch]
                    assert [lp.numel() for lp in lps] == [len(x["target_tokens"]) for x in li]
                    w = torch.cat([torch.tensor(x["weights"]) for x in li])
                    adv_t = (
                        torch.ones(w.numel())
                        if loss_name == "cross_entropy"  # Tinker: -weights * logprobs
                        else torch.cat([torch.tensor(x["advantages"]) for x in li])
                    )
                    q = torch.cat([torch.tensor(x["logprobs"]) for x in li])
                    seq_ids = torch.cat([torch.full((lp.numel(),), i) for i, lp in enumerate(lps)])
                    tok, _ = formula(torch.cat(lps), q, adv_t, cfg, LossBatch(seq_ids, len(lps), w))
                    return (tok * w).sum(), {"custom": True}

                out = client.forward_backward_custom(data, loss_fn)
                assert out["metrics"] == {"custom": True}
            assert all(torch.equal(o["logprobs"], r) for o, r in zip(out["loss_fn_outputs"], ref, strict=True))
            client.optim_step({"learning_rate": 1e-3})
            results[mode] = (out["loss"], _state(client))
        finally:
            client.close()
    assert results["fused"][0] == results["custom"][0]
    a, b = results["fused"][1], results["custom"][1]
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("loss_name", ["ppo", "gspo"])
def test_weight_zero_tokens_contribute_nothing(checkpoint_factory, tmp_path, loss_name):
    """Whatever the advantages and sampler log-probs on weight-0 positions (prompt, tool output), the loss, the
    metrics and the parameters after a step are the same bits; weighting those positions (the control) changes them.
    GSPO included: its sequence ratio averages over the weighted tokens only."""
    ckpt = checkpoint_factory("qwen3", "float32")
    seqs, plens, adv = _batch(33)
    ref = trainer_logprobs(ckpt, seqs, [1] * len(seqs), dtype="float32")
    sampler = [r + 0.05 * torch.randn(r.shape, generator=torch.Generator().manual_seed(i)) for i, r in enumerate(ref)]
    base = _datums(seqs, plens, adv, sampler)
    noisy = _datums(seqs, plens, adv, sampler)
    for d in noisy:
        li = d["loss_fn_inputs"]
        li["advantages"] = [a if w > 0 else 7.0 for a, w in zip(li["advantages"], li["weights"], strict=True)]
        li["logprobs"] = [q if w > 0 else q - 3.0 for q, w in zip(li["logprobs"], li["weights"], strict=True)]
    weighted = [
        {**d, "loss_fn_inputs": {**d["loss_fn_inputs"], "weights": [1.0] * len(d["model_input"])}} for d in noisy
    ]
    results = []
    for i, data in enumerate((base, noisy, weighted)):
        client = TrainingClient.from_checkpoint(
            ckpt, dtype="float32", learning_rate=1e-3, dump_folder=str(tmp_path / str(i))
        )
        try:
            out = client.forward_backward(data, loss_name)
            client.optim_step({"learning_rate": 1e-3})
            results.append((out["loss"], out["metrics"], _state(client)))
        finally:
            client.close()
    (l0, m0, s0), (l1, m1, s1), (l2, m2, s2) = results
    assert l0 == l1 and m0 == m1 and all(torch.equal(s0[k], s1[k]) for k in s0)
    assert m0["num_tokens"] == sum(sum(w > 0 for w in d["loss_fn_inputs"]["weights"]) for d in base)
    assert l2 != l0 and any(not torch.equal(s0[k], s2[k]) for k in s0)


def test_forward_state_and_sampler_weights(checkpoint_factory, tmp_path):
    ckpt = checkpoint_factory("qwen3", "float32")
    seqs, plens, adv = _batch(32)
    client = TrainingClient.from_checkpoint(ckpt, dtype="float32", learning_rate=1e-3, dump_folder=str(tmp_path / "c"))
    try:
        every = trainer_logprobs(ckpt, seqs, [1] * len(seqs), dtype="float32")
        fwd = client.forward(_datums(seqs, plens, adv, every))  # Tinker: every target token, whatever its weight
        assert all(torch.equal(o["logprobs"], r) for o, r in zip(fwd["loss_fn_outputs"], every, strict=True))
        data = _datums(seqs, plens, [1.0] * len(seqs), every)
        client.forward_backward(data, "cross_entropy")
        client.optim_step()
        saved = client.save_state("after1")
        before = _state(client)
        client.forward_backward(data, "cross_entropy")
        client.optim_step()
        assert any(not torch.equal(before[k], v) for k, v in _state(client).items())
        client.load_state(saved)
        assert all(torch.equal(before[k], v) for k, v in _state(client).items())
        snap = client.save_weights_for_sampler("s1")
        assert all(
            torch.equal(a, b)
            for a, b in zip(
                trainer_logprobs(snap, seqs, plens, dtype="float32"),
                client.trainer.forward_logprobs(RolloutBatch(seqs, plens)),
                strict=True,
            )
        )
        with pytest.raises(ValueError, match="shifted by one"):
            client.forward([{"model_input": [1, 2, 3], "loss_fn_inputs": {"target_tokens": [9, 9, 9]}}])
        with pytest.raises(ValueError, match="non-negative"):  # an RL loss's weights are a mask
            client.forward_backward(
                [
                    {
                        "model_input": [1, 5, 6],
                        "loss_fn_inputs": {
                            "target_tokens": [5, 6, 7],
                            "weights": [0, 1, -1],
                            "advantages": [1, 1, 1],
                            "logprobs": [-1, -1, -1],
                        },
                    }
                ],
                "ppo",
            )
        with pytest.raises(ValueError, match="finite"):  # cross_entropy's are any finite coefficients (Tinker)
            client.forward_backward(
                [
                    {
                        "model_input": [1, 5, 6],
                        "loss_fn_inputs": {"target_tokens": [5, 6, 7], "weights": [0, 1, float("inf")]},
                    }
                ],
                "cross_entropy",
            )
        with pytest.raises(ValueError, match="2 values for 3 targets"):
            client.forward_backward(
                [{"model_input": [1, 5, 6], "loss_fn_inputs": {"target_tokens": [5, 6, 7], "weights": [1, 1]}}],
                "cross_entropy",
            )
        with pytest.raises(ValueError, match="advantages"):
            client.forward_backward(
                [{"model_input": [1, 5, 6], "loss_fn_inputs": {"target_tokens": [5, 6, 7], "weights": [0, 1, 1]}}],
                "ppo",
            )
    finally:
        client.close()


def test_datums_carry_routed_experts_for_moe_replay(checkpoint_factory, tmp_path):
    """MoE: ``loss_fn_inputs["routed_experts"]`` (vLLM's array, aligned with ``model_input``) is replayed in
    ``forward`` and ``forward_backward``; the trainer's own routes replayed give the same bits, other routes do not."""
    from titan_plugin.routing import captured_routes

    ckpt = checkpoint_factory("qwen3_moe", "float32")
    client = TrainingClient.from_checkpoint(ckpt, dtype="float32", learning_rate=1e-3, dump_folder=str(tmp_path))
    try:
        seqs, plens, adv = _batch(31)
        plain = client.forward(_datums(seqs, plens, adv, [torch.zeros(len(s) - 1) for s in seqs]))
        routes = captured_routes(client.trainer.model)  # [B, T, layers, k] of that forward (full sequences)
        data = _datums(seqs, plens, adv, [torch.zeros(len(s) - 1) for s in seqs])
        for d, s, r in zip(data, seqs, routes, strict=True):
            d["loss_fn_inputs"]["routed_experts"] = r[: len(s) - 1].numpy()
        same = client.forward(data)
        assert all(
            torch.equal(a["logprobs"], b["logprobs"])
            for a, b in zip(plain["loss_fn_outputs"], same["loss_fn_outputs"], strict=True)
        )
        for d in data:
            d["loss_fn_inputs"]["routed_experts"] = (d["loss_fn_inputs"]["routed_experts"] + 1) % 8
        other = client.forward(data)
        assert any(
            not torch.equal(a["logprobs"], b["logprobs"])
            for a, b in zip(plain["loss_fn_outputs"], other["loss_fn_outputs"], strict=True)
        )
        out = client.forward_backward(data, "cross_entropy")
        assert out["loss_fn_outputs"][0]["logprobs"].numel() == len(seqs[0]) - 1  # every target token
    finally:
        client.close()
