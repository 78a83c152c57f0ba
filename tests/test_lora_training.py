"""LoRA training on the real TorchTitan trainer (issue 18 points 3 and 5, trainer side): TorchTitan's LoRAConverter
with the adapted projections on shared_numerics.lora_linear, a frozen base, adapter-only optimizer state, PEFT export
that vLLM's own LoRA loader reads, base-only reference log-probs and the k3 KL term through RLTrainer and
TrainingClient."""

from __future__ import annotations

import pytest
import torch

from shared_numerics.rollout import RolloutBatch
from zerokld_models.checkpoint import read_config, read_tensors
from zerokld_testing import random_datums

pytestmark = [pytest.mark.titan, pytest.mark.timeout(600)]

DTYPE = "bfloat16"


def _lps(res) -> list[torch.Tensor]:
    return [o["logprobs"] for o in res["loss_fn_outputs"]]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _lora_client(ckpt: str, tmp_path, name: str, **kw):
    from titan_plugin import TrainingClient

    return TrainingClient.create_lora(
        ckpt, rank=4, alpha=8.0, dtype=DTYPE, learning_rate=1e-2, seed=3, dump_folder=str(tmp_path / name), **kw
    )


def test_lora_trains_the_adapters_only_and_base_only_is_the_full_model(checkpoint_factory, tmp_path):
    """Frozen base, adapter-only AdamW state; at initialisation (lora_B = 0) and, after training, with the adapter
    disabled, the log-probs are bitwise the full-parameter trainer's on the base checkpoint; the trained adapter
    changes them. Control: without keep_requires_grad, TorchTitan 0.3.0's parallelize unfreezes the base."""
    from titan_plugin import TrainingClient
    from titan_plugin.lora import ZeroKLDLoRALinear, lora_converter_config, lora_modules
    from titan_plugin.rl import RLTrainer, rl_trainer_config

    ckpt = checkpoint_factory("qwen3", DTYPE)
    data = random_datums(1)
    full = TrainingClient.from_checkpoint(ckpt, dtype=DTYPE, dump_folder=str(tmp_path / "full"))
    try:
        reference = _lps(full.forward(data))
    finally:
        full.close()

    client = _lora_client(ckpt, tmp_path, "lora", max_rank=8)
    try:
        t = client.trainer
        mods = lora_modules(t.model)
        assert client.is_lora and len(mods) == 2 * 7 and all(isinstance(m, ZeroKLDLoRALinear) for m in mods.values())
        trainable = {n for n, p in t.model.named_parameters() if p.requires_grad}
        assert trainable and all(".lora_a." in n or ".lora_b." in n for n in trainable)
        in_optimizer = {id(p) for opt in t.optimizers.optimizers for g in opt.param_groups for p in g["params"]}
        assert in_optimizer == {id(p) for n, p in t.model.named_parameters() if n in trainable}
        assert _equal(_lps(client.forward(data)), reference)  # lora_B starts at zero: the base model's bits

        base_before = t.hf_weights(DTYPE)
        for step in range(2):
            client.forward_backward(data, "cross_entropy")
            client.optim_step()
        base_after = t.hf_weights(DTYPE)
        assert base_before.keys() == base_after.keys()
        assert all(torch.equal(base_before[k], base_after[k]) for k in base_before)
        adapted = _lps(client.forward(data))
        assert not _equal(adapted, reference)
        assert _equal(_lps(client.forward(data, base_only=True)), reference)
        assert _equal(_lps(client.forward(data)), adapted)  # disable_adapter restored the adapter
    finally:
        client.close()

    # negative control: the same config with TorchTitan's parallelize_fn unwrapped
    cfg = rl_trainer_config(ckpt, str(tmp_path / "unwrapped"), dtype=DTYPE, lora=lora_converter_config(rank=4))
    cfg.model_spec.parallelize_fn = cfg.model_spec.parallelize_fn.__wrapped__
    bare = RLTrainer(cfg)
    try:
        assert bare.model.layers["0"].attention_norm.weight.requires_grad, (
            "TorchTitan keeps the base frozen by itself: keep_requires_grad is not needed"
        )
    finally:
        bare.close()


def test_lora_forward_is_batch_invariant_after_training(checkpoint_factory, tmp_path):
    """A trained adapter's log-probs for each datum alone equal its log-probs in the batch (bitwise), as the engine's
    co-batched multi-LoRA requests need; the same LoRA run on stock TorchTitan (its own LoRAConverter, F.linear
    adapters, SDPA) does not."""
    ckpt = checkpoint_factory("qwen3", DTYPE)
    data, probe = random_datums(2), random_datums(3, n=8)
    for batch_invariant in (True, False):
        from titan_plugin import TrainingClient
        from titan_plugin.lora import lora_converter_config
        from titan_plugin.rl import RLTrainer, rl_trainer_config

        cfg = rl_trainer_config(
            ckpt,
            str(tmp_path / f"bi{batch_invariant}"),
            dtype=DTYPE,
            lr=1e-2,
            batch_invariant=batch_invariant,
            lora=lora_converter_config(rank=4, alpha=8.0),
        )
        client = TrainingClient(RLTrainer(cfg), DTYPE)
        try:
            client.forward_backward(data, "cross_entropy")
            client.optim_step()
            together = _lps(client.forward(probe))
            alone = [_lps(client.forward([d]))[0] for d in probe]
        finally:
            client.close()
        if batch_invariant:
            assert _equal(alone, together)
        else:
            assert not _equal(alone, together), "stock TorchTitan LoRA is batch invariant here: proves nothing"


def test_peft_export_is_what_vllms_lora_loader_reads(checkpoint_factory, tmp_path):
    """save_weights_for_sampler on a LoRA client writes a PEFT adapter: vLLM 0.32's PEFTHelper and
    LoRAModel.from_local_checkpoint load it (HF module names q_proj..down_proj, rank, scaling alpha / r) with exactly
    the trainer's bf16 adapter weights. Llama: TorchTitan stores q/k rows interleaved; the exported lora_B rows are
    in HF order, so base + scaling * B @ A merges to to_hf of the trainer's merged weight, bit for bit (float64)."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    from titan_plugin.lora import lora_modules
    from titan_plugin.models import state_dict_adapter_class

    ckpt = checkpoint_factory("llama", DTYPE)
    client = _lora_client(ckpt, tmp_path, "lora")
    try:
        client.forward_backward(random_datums(4), "cross_entropy")
        client.optim_step()
        client.forward_backward(random_datums(5), "cross_entropy")  # lora_A moves too (its gradient is 0 while B = 0)
        client.optim_step()
        out = client.save_weights_for_sampler("step2")
        t = client.trainer
        sd_adapter = state_dict_adapter_class(t._hf)(t.model_config, None)
        mods = {
            fqn: (
                m.weight.full_tensor().double(),
                m.lora_a.weight.full_tensor(),
                m.lora_b.weight.full_tensor(),
                m._lora_scaling,
            )
            for fqn, m in lora_modules(t.model).items()
        }
    finally:
        client.close()

    helper = PEFTHelper.from_local_dir(out, max_position_embeddings=None)
    assert (helper.r, helper.lora_alpha, helper.vllm_lora_scaling_factor) == (4, 8.0, 2.0)
    expected = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert set(helper.target_modules) == expected
    lora = LoRAModel.from_local_checkpoint(out, expected, helper, lora_model_id=1, device="cpu", dtype=torch.bfloat16)
    assert len(lora.loras) == len(mods) == 2 * 7
    for fqn, (w, a, b, scaling) in mods.items():
        ((hf_key, w_hf),) = sd_adapter.to_hf({f"{fqn}.weight": w}).items()
        got = lora.loras[hf_key[: -len(".weight")]]
        a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
        assert torch.equal(got.lora_a, a16)  # vLLM keeps lora_a as [r, K]
        # bf16 products are exact in float64 and r = 4 of them sum exactly: row order cannot change the bits
        merged_titan = w + scaling * (b16.double() @ a16.double())
        merged_hf = w_hf + scaling * (got.lora_b.double() @ got.lora_a.double())
        (to_hf_merged,) = sd_adapter.to_hf({f"{fqn}.weight": merged_titan}).values()
        assert torch.equal(merged_hf, to_hf_merged), fqn
        if fqn.endswith(("wq", "wk")):  # the row permutation is real: exporting lora_B unpermuted breaks it
            assert not torch.equal(got.lora_b, b16), fqn


def test_k3_reference_kl_through_trainer_and_client(checkpoint_factory, tmp_path):
    """kl_beta with base-only reference log-probs: the k3 term is exactly 0 while the adapter is the identity
    (loss and gradients bitwise the no-KL ones), positive once the policy has moved; kl_beta without reference
    log-probs is refused. The same through RLTrainer.rl_step with RolloutBatch.ref_logprobs."""
    import dataclasses

    ckpt = checkpoint_factory("qwen3", DTYPE)
    client = _lora_client(ckpt, tmp_path, "kl")
    try:
        data = random_datums(6)
        lps = _lps(client.forward(data))

        def rl(ref):
            return [
                {
                    "model_input": d["model_input"],
                    "loss_fn_inputs": {
                        **d["loss_fn_inputs"],
                        "advantages": [0.5] * len(lp),
                        "logprobs": lp.tolist(),
                        **({"ref_logprobs": r.tolist()} if r is not None else {}),
                    },
                }
                for d, lp, r in zip(data, lps, ref, strict=True)
            ]

        ref = _lps(client.forward(data, base_only=True))
        with_kl = client.forward_backward(rl(ref), "importance_sampling", {"kl_beta": 0.5})
        grads_kl = [p.grad.full_tensor().clone() for p in client.trainer.model.parameters() if p.grad is not None]
        client.trainer.zero_grad()
        without = client.forward_backward(rl([None] * len(data)), "importance_sampling")
        grads = [p.grad.full_tensor().clone() for p in client.trainer.model.parameters() if p.grad is not None]
        assert with_kl["loss"] == without["loss"] and _equal(grads_kl, grads)
        with pytest.raises(ValueError, match="kl_beta > 0 needs reference log-probs"):
            client.forward_backward(rl([None] * len(data)), "importance_sampling", {"kl_beta": 0.5})
        client.optim_step()

        lps = _lps(client.forward(data))  # the adapter has moved: the policy differs from the base
        ref = _lps(client.forward(data, base_only=True))
        assert not _equal(lps, ref)
        with_kl = client.forward_backward(rl(ref), "importance_sampling", {"kl_beta": 0.5})["loss"]
        without = client.forward_backward(rl([None] * len(data)), "importance_sampling")["loss"]
        assert with_kl > without
        client.optim_step()

        # RLTrainer directly: RolloutBatch.ref_logprobs and the configured corrections
        t = client.trainer
        batch = RolloutBatch(
            [d["model_input"] + d["loss_fn_inputs"]["target_tokens"][-1:] for d in data],
            [4] * len(data),
            advantages=[0.5] * len(data),
        )
        ref = t.forward_logprobs(batch, base_only=True)
        loss = t.build_loss("importance_sampling", {"kl_beta": 0.5})
        kl = t.forward_backward(dataclasses.replace(batch, ref_logprobs=ref), loss=loss)["loss"]
        plain = t.forward_backward(batch, loss=t.build_loss("importance_sampling"))["loss"]
        assert kl > plain
        with pytest.raises(ValueError, match="rollout 0: .* ref logprobs"):
            dataclasses.replace(batch, ref_logprobs=[r[:-1] for r in ref])
    finally:
        client.close()


def test_lora_configuration_errors(checkpoint_factory, tmp_path):
    from titan_plugin import TrainingClient
    from titan_plugin.lora import lora_converter_config
    from titan_plugin.rl import rl_trainer_config

    ckpt = checkpoint_factory("qwen3", DTYPE)
    with pytest.raises(NotImplementedError, match="lm_head"):
        TrainingClient.create_lora(ckpt, rank=4, train_unembed=True, dump_folder=str(tmp_path / "u"))
    with pytest.raises(ValueError, match="non-empty subset"):
        lora_converter_config(train_attn=False, train_mlp=False)
    with pytest.raises(ValueError, match="k_proj and v_proj"):
        lora_converter_config(target_modules=["q_proj", "k_proj"])
    with pytest.raises(ValueError, match="FP8"):
        rl_trainer_config(ckpt, str(tmp_path / "f"), dtype=DTYPE, fp8="per_channel", lora=lora_converter_config())
    with pytest.raises(ValueError, match="max_rank"):
        rl_trainer_config(ckpt, str(tmp_path / "m"), dtype=DTYPE, lora=lora_converter_config(rank=8, max_rank=4))
    with pytest.raises(NotImplementedError, match="MoE"):
        rl_trainer_config(
            checkpoint_factory("qwen3_moe", DTYPE), str(tmp_path / "e"), dtype=DTYPE, lora=lora_converter_config()
        )
    with pytest.raises(ValueError, match="kv_b_proj: MLA absorbs"):
        lora_converter_config(target_modules=["q_a_proj", "kv_b_proj"])
    full = TrainingClient.from_checkpoint(ckpt, dtype=DTYPE, dump_folder=str(tmp_path / "full"))
    try:
        with pytest.raises(ValueError, match="no LoRA adapter"):
            full.forward(random_datums(7), base_only=True)
    finally:
        full.close()


def _hf_peft_logprobs(ckpt: str, adapter_dir: str, batch: RolloutBatch) -> tuple[list, list]:
    """HF ``transformers`` + the real ``peft`` (``PeftModel.from_pretrained`` of the exported adapter): completion
    log-probs with the adapter and inside ``disable_adapter()`` (the base model)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32), adapter_dir)
    model.eval()

    def score() -> list[torch.Tensor]:
        out = []
        for seq, p in zip(batch.sequences, batch.prompt_lengths, strict=True):
            logits = model(torch.tensor([seq])).logits[0, :-1].float()
            lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(seq[1:])[:, None])[:, 0]
            out.append(lp[p - 1 :])
        return out

    with torch.no_grad():
        adapted = score()
        with model.disable_adapter():
            base = score()
    return adapted, base


def _dedup_keep_requires_grad(parallelize_fn):
    """The wrapper before the tied-embedding fix: flags recorded by ``named_parameters()``, which lists a tied
    ``lm_head.weight`` only as ``tok_embeddings.weight``."""

    def wrapped(model, **kwargs):
        before = {name: p.requires_grad for name, p in model.named_parameters()}
        out = parallelize_fn(model, **kwargs)
        for name, p in model.named_parameters():
            if name in before:
                p.requires_grad_(before[name])
        return out

    return wrapped


@pytest.mark.parametrize("family", ["qwen3_tied", "qwen2", "qwen3"])
def test_lora_on_tied_and_untied_checkpoints_is_hf_peft(family, checkpoint_factory, tmp_path):
    """Held-out row 1: a trained LoRA model on a checkpoint with ``tie_word_embeddings`` (Qwen3-0.6B..4B, Qwen2.5
    tie) is HF transformers + PEFT of the exported adapter (tolerance: other kernels; fp32), with the adapter and
    base-only; its base weights never move and base-only is bitwise the full-parameter trainer on the checkpoint.
    Negative control (tied only): the old requires_grad wrapper left the shared embedding / lm_head trainable, so
    training moved the base and base-only drifts from the checkpoint far beyond the tolerance."""
    from titan_plugin import TrainingClient, trainer_logprobs
    from titan_plugin.lora import lora_converter_config
    from titan_plugin.rl import RLTrainer, rl_trainer_config

    ckpt = checkpoint_factory(family, "float32")
    batch = RolloutBatch(
        [d["model_input"] + d["loss_fn_inputs"]["target_tokens"][-1:] for d in random_datums(7, n=4)], [6] * 4
    )
    reference = trainer_logprobs(ckpt, batch.sequences, batch.prompt_lengths, dtype="float32")

    def train(name: str, wrap=None) -> TrainingClient:
        cfg = rl_trainer_config(
            ckpt, str(tmp_path / name), dtype="float32", lr=2e-2, lora=lora_converter_config(rank=4, alpha=8.0)
        )
        if wrap is not None:
            cfg.model_spec.parallelize_fn = wrap(cfg.model_spec.parallelize_fn.__wrapped__)
        client = TrainingClient(RLTrainer(cfg), "float32")
        for step in range(2):
            client.forward_backward(random_datums(20 + step), "cross_entropy")
            client.optim_step()
        return client

    client = train("lora")
    try:
        t = client.trainer
        trainable = {n for n, p in t.model.named_parameters(remove_duplicate=False) if p.requires_grad}
        assert trainable and all(".lora_a." in n or ".lora_b." in n for n in trainable), sorted(trainable)[:4]
        before = read_tensors(ckpt)
        after = t.hf_weights("float32")
        assert before.keys() >= after.keys() and all(torch.equal(before[k], after[k]) for k in after)
        adapted = t.forward_logprobs(batch)
        base_only = t.forward_logprobs(batch, base_only=True)
        adapter_dir = client.save_weights_for_sampler("adapter")
    finally:
        client.close()
    assert len(base_only) == len(reference) and all(
        torch.equal(a, b) for a, b in zip(base_only, reference, strict=True)
    )
    hf_adapted, hf_base = _hf_peft_logprobs(ckpt, adapter_dir, batch)
    tol = 1e-4
    assert max((a - b).abs().max().item() for a, b in zip(adapted, hf_adapted, strict=True)) < tol
    assert max((a - b).abs().max().item() for a, b in zip(base_only, hf_base, strict=True)) < tol
    assert (
        max((a - b).abs().max().item() for a, b in zip(adapted, base_only, strict=True)) > 10 * tol
    )  # the adapter is not inert

    if family != "qwen3" and read_config(ckpt).get("tie_word_embeddings"):
        old = train("dedup", _dedup_keep_requires_grad)
        try:
            drifted = old.trainer.forward_logprobs(batch, base_only=True)
        finally:
            old.close()
        assert max((a - b).abs().max().item() for a, b in zip(drifted, hf_base, strict=True)) > 10 * tol
