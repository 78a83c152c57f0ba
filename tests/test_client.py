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


def _datums(seqs, plens, adv, sampler):
    out = []
    for s, p, a, q in zip(seqs, plens, adv, sampler):
        n = len(s) - 1
        w = [0.0] * (p - 1) + [1.0] * (n - p + 1)
        out.append({"model_input": s[:-1], "loss_fn_inputs": {
            "target_tokens": s[1:], "weights": w, "advantages": [a * x for x in w],
            "logprobs": [0.0] * (p - 1) + q.tolist()}})
    return out


def _state(client):
    t = client.trainer
    return hf_state_dict(t.model, t.model_config, t._hf)


LOSS_CASES = [("cross_entropy", "qwen3", "float32"), ("ppo", "qwen3", "float32"), ("ppo", "llama", "bfloat16"), ("importance_sampling", "qwen3", "float32"),
              ("dapo", "qwen3", "float32"), ("dr_grpo", "qwen3", "float32"), ("gspo", "qwen3", "float32"),
              ("cispo", "qwen3", "float32"), ("dro", "llama", "bfloat16")]


@pytest.mark.parametrize("loss_name,family,dtype", LOSS_CASES)
def test_fused_and_two_pass_custom_agree_bitwise(checkpoint_factory, tmp_path, loss_name, family, dtype):
    """For every loss: same loss value, same per-token log-probs (== trainer_logprobs, hence vLLM's) and the same
    parameters after one optim_step, bit for bit, between the fused loss and the two-pass custom path running the
    same registered formula: pass 2 back-propagates exactly the dL/dl the fused loss's autograd produces."""
    from shared_numerics.losses import LossBatch
    from zerokld_plugins import get_loss, resolve

    spec = get_loss(loss_name)
    formula, cfg = resolve(spec.token_loss), resolve(spec.config_schema)()
    ckpt = checkpoint_factory(family, dtype)
    seqs, plens, adv = _batch(31)
    ref = trainer_logprobs(ckpt, seqs, plens, dtype=dtype)
    sampler = [r + 0.05 * torch.randn(r.shape, generator=torch.Generator().manual_seed(i)) for i, r in
               enumerate(ref)]  # ratios around 1, some outside the clip ranges
    results = {}
    for mode in ("fused", "custom"):
        client = TrainingClient.from_checkpoint(ckpt, dtype=dtype, learning_rate=1e-3,
                                                dump_folder=str(tmp_path / mode))
        try:
            data = _datums(seqs, plens, adv, sampler)
            if mode == "fused":
                out = client.forward_backward(data, loss_name)
            else:
                def loss_fn(batch, lps):  # the registered formula over all tokens, summed once (as the fused loss)
                    key = "weights" if loss_name == "cross_entropy" else "advantages"  # Tinker: CE uses the weights
                    adv_t = torch.cat([torch.tensor(d["loss_fn_inputs"][key][-lp.numel():], dtype=torch.float32)
                                       for d, lp in zip(batch, lps)])
                    seq_ids = torch.cat([torch.full((lp.numel(),), i) for i, lp in enumerate(lps)])
                    tok, _ = formula(torch.cat(lps), torch.cat(sampler), adv_t, cfg, LossBatch(seq_ids, len(lps)))
                    return tok.sum(), {"custom": True}

                out = client.forward_backward_custom(data, loss_fn)
                assert out["metrics"] == {"custom": True}
            assert all(torch.equal(o["logprobs"], r) for o, r in zip(out["loss_fn_outputs"], ref))
            client.optim_step({"learning_rate": 1e-3})
            results[mode] = (out["loss"], _state(client))
        finally:
            client.close()
    assert results["fused"][0] == results["custom"][0]
    a, b = results["fused"][1], results["custom"][1]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_forward_state_and_sampler_weights(checkpoint_factory, tmp_path):
    ckpt = checkpoint_factory("qwen3", "float32")
    seqs, plens, adv = _batch(32)
    client = TrainingClient.from_checkpoint(ckpt, dtype="float32", learning_rate=1e-3, dump_folder=str(tmp_path / "c"))
    try:
        fwd = client.forward(_datums(seqs, [1] * len(seqs), adv, trainer_logprobs(ckpt, seqs, [1] * len(seqs),
                                                                                   dtype="float32")))
        assert all(torch.equal(o["logprobs"], r) for o, r in
                   zip(fwd["loss_fn_outputs"], trainer_logprobs(ckpt, seqs, [1] * len(seqs), dtype="float32")))
        data = _datums(seqs, plens, [1.0] * len(seqs), trainer_logprobs(ckpt, seqs, plens, dtype="float32"))
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
        assert all(torch.equal(a, b) for a, b in zip(trainer_logprobs(snap, seqs, plens, dtype="float32"),
                                                       client.trainer.forward_logprobs(RolloutBatch(seqs, plens))))
        with pytest.raises(ValueError, match="shifted by one"):
            client.forward([{"model_input": [1, 2, 3], "loss_fn_inputs": {"target_tokens": [9, 9, 9]}}])
        with pytest.raises(ValueError, match="advantages"):
            client.forward_backward([{"model_input": [1, 5, 6], "loss_fn_inputs": {"target_tokens": [5, 6, 7],
                                                                                  "weights": [0, 1, 1]}}], "ppo")
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
        plain = client.forward(_datums(seqs, plens, adv, [torch.zeros(len(s) - p) for s, p in zip(seqs, plens)]))
        routes = captured_routes(client.trainer.model)  # [B, T, layers, k] of that forward (full sequences)
        data = _datums(seqs, plens, adv, [torch.zeros(len(s) - p) for s, p in zip(seqs, plens)])
        for d, s, r in zip(data, seqs, routes):
            d["loss_fn_inputs"]["routed_experts"] = r[: len(s) - 1].numpy()
        same = client.forward(data)
        assert all(torch.equal(a["logprobs"], b["logprobs"]) for a, b in zip(plain["loss_fn_outputs"],
                                                                              same["loss_fn_outputs"]))
        for d in data:
            d["loss_fn_inputs"]["routed_experts"] = (d["loss_fn_inputs"]["routed_experts"] + 1) % 8
        other = client.forward(data)
        assert any(not torch.equal(a["logprobs"], b["logprobs"]) for a, b in zip(plain["loss_fn_outputs"],
                                                                                  other["loss_fn_outputs"]))
        out = client.forward_backward(data, "cross_entropy")
        assert out["loss_fn_outputs"][0]["logprobs"].numel() == len(seqs[0]) - plens[0]
    finally:
        client.close()
