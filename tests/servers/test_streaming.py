"""Streaming trainer input: micro-batches fed to ``forward_backward`` as they arrive accumulate exactly the gradients
of one call on their concatenation, whatever the grouping — both ways ``RLTrainer.forward_backward`` has: batched
passes whose gradients are float32 chains in token order (``titan_plugin.exact_accumulation``, where the machine's
kernels cover the dtype) and one rollout at a time (everywhere else) — for the fused loss, Tinker's two-pass custom
loss and a ``token_mean`` loss whose normaliser is known only when the stream ends. Negative control: TorchTitan's own
accumulation (``forward_backward_step`` per micro-batch, one batched backward each) gives other gradient bits for
another grouping."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from shared_numerics.grad_chain import chain_available
from shared_numerics.rollout import RolloutBatch
from titan_plugin import TrainingClient, trainer_logprobs
from titan_plugin.models import hf_state_dict
from zerokld_testing.controls import stock_differs

pytestmark = [pytest.mark.titan, pytest.mark.timeout(600)]

GROUPINGS = {"one call": [8], "3+1+4": [3, 1, 4], "one by one": [1] * 8}


def _rollouts(ckpt: str, dtype: str, seed: int = 41) -> RolloutBatch:
    """8 rollouts (prompt 2-10 tokens, completion 20-60), sampler log-probs = the trainer's + noise (ratios around
    1, some clipped), one advantage per rollout."""
    rng = random.Random(seed)
    seqs = [[1] + [rng.randrange(3, 100) for _ in range(rng.randrange(22, 70))] for _ in range(8)]
    plens = [rng.randrange(2, 10) for _ in seqs]
    ref = trainer_logprobs(ckpt, seqs, plens, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    return RolloutBatch(
        seqs, plens, [rng.uniform(-1, 1) for _ in seqs], [r + 0.05 * torch.randn(r.shape, generator=g) for r in ref]
    )


def _micro_batches(batch: RolloutBatch, sizes: list[int]) -> list[RolloutBatch]:
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [batch.select(range(s, s + n)) for s, n in zip(starts, sizes, strict=True)]


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _custom_loss(batch: RolloutBatch, lps: list[torch.Tensor]):
    """A per-rollout additive policy-gradient loss (importance ratio against the sampler, times the advantage)."""
    loss = sum(
        -(a * torch.exp(lp - q)).sum() for a, lp, q in zip(batch.advantages, lps, batch.sampler_logprobs, strict=True)
    )
    return loss, {}


def _titan_accumulate(trainer, batch: RolloutBatch, sizes: list[int]) -> None:
    """TorchTitan's own accumulation of ``batch`` cut as ``sizes``: ``forward_backward_step`` per micro-batch (one
    batched backward each; an MoE counts every padded position for load balancing)."""
    for mb in _micro_batches(batch, sizes):
        tokens, labels, adv, q, _ = mb.pack()
        trainer.loss_fn.set_rl_inputs(adv, q)
        trainer.forward_backward_step(input_dict={"input": tokens}, labels=labels, global_valid_tokens=None)


def _titan_accumulation_depends_on_the_grouping(client: TrainingClient, batch: RolloutBatch) -> None:
    """TorchTitan's own accumulation (:func:`_titan_accumulate`): the whole batch and 3 + 1 + 4 give other gradient
    bits."""
    trainer = client.trainer

    def titan(sizes):
        _titan_accumulate(trainer, batch, sizes)
        grads = _grads(trainer.model)
        client.optim_step({"learning_rate": 0.0})
        return grads

    whole, split = titan([8]), titan([3, 1, 4])
    assert whole.keys() == split.keys()
    stock_differs(
        sum(not torch.equal(whole[k], split[k]) for k in whole) > 0,
        "TorchTitan's gradient accumulation over micro-batches [8] vs [3, 1, 4]",
        "the groupings",
    )


def _chained(*values, dtype: str):
    """A parameter set whose test needs this machine's exact accumulation for ``dtype`` (tests/conftest.py's
    capabilities: the float32 kernel; for bf16, AMX or no bf16 units)."""
    return pytest.param(
        *values, marks=pytest.mark.requires_bf16_grad_chain if dtype == "bfloat16" else pytest.mark.requires_f32_kernel
    )


@pytest.mark.parametrize(
    "family,dtype,way",
    [
        _chained("qwen3", "float32", "batched", dtype="float32"),
        _chained("qwen3", "bfloat16", "batched", dtype="bfloat16"),
        ("qwen3", "float32", "one rollout at a time"),
        ("qwen3", "bfloat16", "one rollout at a time"),
        # q/k/v biases and tied embeddings: two chains summed into one .grad
        _chained("qwen2", "bfloat16", "batched", dtype="bfloat16"),
        _chained("qwen3_tied", "float32", "batched", dtype="float32"),
    ],
)
def test_streamed_micro_batches_accumulate_the_concatenated_batch_gradient(
    checkpoint_factory, tmp_path, family, dtype, way
):
    ckpt = checkpoint_factory(family, dtype)
    client = TrainingClient.from_checkpoint(ckpt, dtype=dtype, learning_rate=1e-3, dump_folder=str(tmp_path / "c"))
    try:
        batch = dataclasses.replace(_rollouts(ckpt, dtype), numerics=client.trainer.numerics)
        trainer = client.trainer
        # the batched way wherever this machine's kernels cover the dtype (a dense zerokld model)
        assert (trainer.exact_accumulation is not None) == chain_available(getattr(torch, dtype)), (
            trainer.exact_accumulation_off
        )
        if way == "one rollout at a time":
            trainer.exact_accumulation = None
        for mode in ("fused", "custom"):
            seen = {}
            for name, sizes in GROUPINGS.items():
                outs = []
                for mb in _micro_batches(batch, sizes):
                    if mode == "fused":
                        outs.append(client.forward_backward(mb, "ppo"))
                    else:
                        outs.append(client.forward_backward_custom(mb, _custom_loss))
                lps = [o["logprobs"] for out in outs for o in out["loss_fn_outputs"]]
                seen[name] = (_grads(trainer.model), lps)
                client.optim_step({"learning_rate": 0.0})  # zeroes the gradients, leaves the weights
            ref_grads, ref_lps = seen["one call"]
            assert ref_grads
            for name, (grads, lps) in seen.items():
                assert len(lps) == len(ref_lps) == len(batch)
                assert all(torch.equal(a, b) for a, b in zip(lps, ref_lps, strict=True)), (mode, name)
                assert grads.keys() == ref_grads.keys()
                assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads), (mode, name)

        _titan_accumulation_depends_on_the_grouping(client, batch)  # negative control
    finally:
        client.close()


def _grads_by_grouping(client: TrainingClient, batch: RolloutBatch) -> dict[str, dict[str, torch.Tensor]]:
    """The gradients ``forward_backward`` leaves for ``batch`` cut as each of :data:`GROUPINGS` (``"ppo"``; an
    ``optim_step`` at learning rate 0 between groupings clears them)."""
    seen = {}
    for name, sizes in GROUPINGS.items():
        for mb in _micro_batches(batch, sizes):
            client.forward_backward(mb, "ppo")
        seen[name] = _grads(client.trainer.model)
        client.optim_step({"learning_rate": 0.0})
    return seen


def _check_batched_gradients(client: TrainingClient, batch: RolloutBatch, dtype: str) -> dict[str, torch.Tensor]:
    """The batched way's gradients of ``batch`` (``client.trainer.exact_accumulation`` set): every trainable
    parameter has one, not all zero; every grouping of :data:`GROUPINGS` gives one call's bits; and they are the
    gradient — close to the one-rollout-at-a-time way's (other bits: autograd's sums per rollout; float32 1e-5, bf16
    2e-2 of the largest element). Returns one call's gradients."""
    trainer = client.trainer
    seen = _grads_by_grouping(client, batch)
    ref = seen["one call"]
    assert sorted(ref) == sorted(n for n, p in trainer.model.named_parameters() if p.requires_grad)
    assert not [k for k, g in ref.items() if bool((g == 0).all())]  # every parameter has a gradient
    for name, grads in seen.items():
        assert grads.keys() == ref.keys()
        assert all(torch.equal(grads[k], ref[k]) for k in ref), name
    exact, trainer.exact_accumulation = trainer.exact_accumulation, None
    try:
        client.forward_backward(batch, "ppo")
        per_rollout = _grads(trainer.model)
        client.optim_step({"learning_rate": 0.0})
    finally:
        trainer.exact_accumulation = exact
    tol = 1e-5 if dtype == "float32" else 2e-2
    for k in ref:
        a, b = _full(ref[k]), _full(per_rollout[k])
        assert float((a - b).abs().max()) <= tol * float(b.abs().max()), k
    return ref


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _with_replayed_routes(trainer, batch: RolloutBatch) -> RolloutBatch:
    """``batch`` with replayed routes (R3): random distinct experts per token for every MoE layer, one row per input
    position."""
    from titan_plugin.routing import moe_layers

    layers = moe_layers(trainer.model)
    n_exp, top_k = layers[0].router.gate.weight.shape[0], layers[0].router.top_k
    g = torch.Generator().manual_seed(5)
    routes = [
        torch.stack([torch.stack([torch.randperm(n_exp, generator=g)[:top_k] for _ in layers]) for _ in seq[:-1]]).to(
            torch.int16
        )
        for seq in batch.sequences
    ]
    return dataclasses.replace(batch, routed_experts=routes)


def _adapted_client(ckpt: str, dtype: str, variant: str, dump: str) -> TrainingClient:
    from titan_plugin.rl import RLTrainer, rl_trainer_config

    if variant == "lora":  # rank 4 zero-padded to the engine's 8, scaling 6 / 4 (not a power of two)
        return TrainingClient.create_lora(
            ckpt, rank=4, alpha=6.0, max_rank=8, dtype=dtype, learning_rate=1e-2, dump_folder=dump
        )
    fp8 = None if variant == "moe" else variant
    return TrainingClient(RLTrainer(rl_trainer_config(ckpt, dump, dtype=dtype, lr=1e-2, fp8=fp8)), dtype)


@pytest.mark.parametrize(
    "variant,dtype", [_chained(v, d, dtype=d) for v in ("lora", "per_channel", "moe") for d in ("float32", "bfloat16")]
)
def test_lora_fp8_qat_and_moe_stream_batched_with_the_concatenated_batch_gradient(
    checkpoint_factory, tmp_path, variant, dtype
):
    """LoRA (frozen base), FP8 QAT and MoE: their gradients are chains too — a LoRA adapter's the padded, scaling-folded
    operand's sums (the parameter's rows / columns of them, ``B``'s times the scaling), an FP8 linear's the
    straight-through ``dW`` of the dequantized operands, an MoE expert's over the tokens routed to it (float32
    products; here the routes are replayed, R3) and the router's over all tokens — so ``forward_backward`` runs batched
    and any grouping gives one call's bits. The chains' gradient is the gradient: close to the one-rollout-at-a-time
    way's (other bits: autograd's sums per rollout). Negative control: TorchTitan's accumulation differs between
    groupings."""
    ckpt = checkpoint_factory("qwen3_moe" if variant == "moe" else "qwen3", dtype)
    client = _adapted_client(ckpt, dtype, variant, str(tmp_path / "c"))
    try:
        trainer = client.trainer
        assert trainer.exact_accumulation is not None, trainer.exact_accumulation_off
        batch = dataclasses.replace(_rollouts(ckpt, dtype), numerics=trainer.numerics)
        if variant == "moe":
            batch = _with_replayed_routes(trainer, batch)
        client.forward_backward(batch, "ppo")
        client.optim_step({"learning_rate": 1e-2})  # lora_B leaves 0, so lora_A's gradients are not all 0
        ref = _check_batched_gradients(client, batch, dtype)
        if variant == "lora":
            assert len(ref) == 28 and all(".lora_" in k for k in ref)  # 7 projections x 2 layers x (A, B)
        _titan_accumulation_depends_on_the_grouping(client, batch)  # negative control
    finally:
        client.close()


def test_streamed_token_mean_step_equals_the_concatenated_batch_step(checkpoint_factory, tmp_path):
    """``token_mean`` (the trainer's configured GRPO loss): the normaliser is the kept tokens of the whole stream,
    applied at ``optim_step``; the weights after the step are the same bits for one call and for 3 + 1 + 4, and the
    gradient norm is the summed loss's divided by the stream's completion tokens (the division happens, once)."""
    ckpt = checkpoint_factory("qwen3", "float32")
    batch = _rollouts(ckpt, "float32", seed=43)
    after = {}
    for name in ("one call", "3+1+4"):
        client = TrainingClient.from_checkpoint(
            ckpt, dtype="float32", learning_rate=1e-3, dump_folder=str(tmp_path / name.replace(" ", "_"))
        )
        try:
            assert client.trainer.loss_fn.config.normalization == "token_mean"
            batch = dataclasses.replace(batch, numerics=client.trainer.numerics)
            client.forward_backward(batch, "ppo")  # Tinker's sum, for the norm below; lr 0 leaves the weights
            summed = client.optim_step({"learning_rate": 0.0})["grad_norm"]
            for mb in _micro_batches(batch, GROUPINGS[name]):
                client.trainer.forward_backward(mb)
            mean = client.optim_step({"learning_rate": 1e-3})["grad_norm"]
            tokens = sum(len(x) - p for x, p in zip(batch.sequences, batch.prompt_lengths, strict=True))
            assert mean * tokens == pytest.approx(summed, rel=1e-5)
            t = client.trainer
            after[name] = hf_state_dict(t.model, t.model_config, t._hf)
            with pytest.raises(ValueError, match="token_mean"):  # no sum loss into a token_mean step
                client.trainer.forward_backward(batch)
                client.forward_backward(batch, "ppo")
        finally:
            client.close()
    a, b = after["one call"], after["3+1+4"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_select_is_a_micro_batch_of_the_same_rollouts():
    batch = RolloutBatch(
        [[1, 5, 6, 7], [1, 8, 9], [1, 4, 4, 4, 4]],
        [2, 1, 3],
        [0.5, -1.0, torch.tensor([1.0, 2.0])],
        [torch.tensor([-0.5, -0.25]), torch.tensor([-1.0, -2.0]), torch.tensor([-0.1, -0.2])],
        snapshot_identity="step-00003",
        loss_weights=[torch.ones(2)] * 3,
    )
    sub = batch.select([2, 0])
    assert sub.sequences == [[1, 4, 4, 4, 4], [1, 5, 6, 7]] and sub.prompt_lengths == [3, 2]
    assert sub.advantages[1] == 0.5 and torch.equal(sub.advantages[0], torch.tensor([1.0, 2.0]))
    assert torch.equal(sub.sampler_logprobs[1], batch.sampler_logprobs[0]) and len(sub.loss_weights) == 2
    assert sub.snapshot_identity == "step-00003" and sub.routed_experts is None
    with pytest.raises(IndexError):
        batch.select([3])
    with pytest.raises(ValueError, match="empty"):
        batch.select([])


def test_importance_sampling_corrections_reach_the_trainer_loss(checkpoint_factory, tmp_path):
    """Stale rollouts (``--async``) can be corrected with truncated / masked importance sampling: the
    ``corrections`` of ``rl_trainer_config`` reach the configured loss (formulas: ``tests/test_losses.py``); masked
    tokens leave the deferred ``token_mean`` normaliser, so the step's loss is the kept tokens' mean."""
    from shared_numerics.losses import CorrectionConfig
    from titan_plugin.rl import RLTrainer, rl_trainer_config

    ckpt = checkpoint_factory("qwen3", "float32")
    trainer = RLTrainer(
        rl_trainer_config(ckpt, str(tmp_path / "d"), dtype="float32", corrections={"mis_low": 0.97, "mis_high": 1.03})
    )
    try:
        assert trainer.loss_fn.corrections == CorrectionConfig(mis_low=0.97, mis_high=1.03)
        batch = dataclasses.replace(_rollouts(ckpt, "float32", seed=45), numerics=trainer.numerics)
        res = trainer.forward_backward(batch)
        ratio = torch.exp(torch.cat(res["train_logprobs"]) - torch.cat(batch.sampler_logprobs))
        kept = int(((ratio >= 0.97) & (ratio <= 1.03)).sum())
        assert 0 < kept < ratio.numel() and trainer._pending == (True, kept)
    finally:
        trainer.close()


@pytest.mark.parametrize(
    "family,batch_invariant,fp8,reason",
    [
        ("qwen3", True, None, None),
        ("qwen3_tied", True, None, None),
        ("qwen2", True, None, None),
        ("qwen3_moe", True, None, None),
        ("qwen3", True, "per_channel", None),
        ("qwen3", False, None, "belongs to a"),
    ],
)
@pytest.mark.requires_f32_kernel
def test_batched_way_covers_dense_zerokld_models(checkpoint_factory, family, batch_invariant, fp8, reason):
    """Which models ``forward_backward`` runs batched (every parameter in a module that routes its gradient into a
    chain; tied embeddings and biases included) and which one rollout at a time, with the reason."""
    from titan_plugin.exact_accumulation import unsupported_reason
    from titan_plugin.models import build_titan_model

    model = build_titan_model(checkpoint_factory(family, "float32"), batch_invariant=batch_invariant, fp8=fp8)[0]
    got = unsupported_reason(model, torch.float32)
    assert got is None if reason is None else reason in got, got


@pytest.mark.requires_f32_kernel
@pytest.mark.parametrize("fp8", [None, "block"])
def test_deepseek_streams_batched_with_the_concatenated_batch_gradient(tmp_path, fp8):
    """DeepSeek-V3 (MLA + DeepSeekMoE, float32; also with FP8 block QAT): MLA reads ``kv_norm`` and ``wkv_b`` as
    tensors (absorbed into the latent attention, one linear per head for ``W_UK`` and for ``W_UV``), and their
    gradients go into chains too — ``wkv_b``'s one block per head and linear, laid out as the weight when written —
    as do DeepSeekMoE's router and experts, so ``forward_backward`` runs batched: every parameter has a gradient, the
    groupings of :data:`GROUPINGS` give one call's bits, close to the one-rollout-at-a-time way's. Routes are replayed
    (R3): ``optim_step``'s aux-loss-free bias update (DeepSeek-V3's load balancing) would otherwise change the routes
    between the groupings. Negative control: TorchTitan's accumulation differs between groupings. (Before MLA had
    chains, batched passes wrote ``kv_norm`` / ``wkv_b`` from empty chains: all zero, which this test catches.)"""
    from titan_plugin.rl import RLTrainer, rl_trainer_config
    from zerokld_testing.deepseek import DeepSeekSpec, make_deepseek_checkpoint

    ckpt = str(make_deepseek_checkpoint(tmp_path / "ds", DeepSeekSpec(), seed=3, dtype="float32"))
    config = rl_trainer_config(ckpt, str(tmp_path / "c"), dtype="float32", fp8=fp8)
    client = TrainingClient(RLTrainer(config), "float32")
    try:
        trainer = client.trainer
        assert trainer.exact_accumulation is not None, trainer.exact_accumulation_off
        batch = dataclasses.replace(_rollouts(ckpt, "float32"), numerics=trainer.numerics)
        batch = _with_replayed_routes(trainer, batch)
        ref = _check_batched_gradients(client, batch, "float32")
        assert any(".wkv_b." in k for k in ref) and any(".kv_norm." in k for k in ref)
        _titan_accumulation_depends_on_the_grouping(client, batch)  # negative control
    finally:
        client.close()


def _taken_counts(trainer) -> torch.Tensor:
    """The MoE layers' load-balancing counts (``tokens_per_expert_E``, ``[layers, E]``), then zeroed."""
    from titan_plugin.routing import moe_layers

    layers = moe_layers(trainer.model)
    counts = torch.stack([_full(m.tokens_per_expert_E).clone() for m in layers])
    for m in layers:
        m.tokens_per_expert_E.zero_()
    return counts


def test_moe_load_balancing_counts_the_rollouts_tokens_whatever_the_grouping(tmp_path):
    """DeepSeek-V3's auxiliary-loss-free load balancing (TorchTitan's optimizer hook moves ``expert_bias_E`` by the
    sign of each expert's count against the mean) counts the routes of the rollouts' tokens alone
    (:func:`titan_plugin.routing.counted_positions`): after ``forward_backward`` of the batch in each grouping of
    :data:`GROUPINGS` the counts are the same, ``top_k`` per input token of each MoE layer, and scoring
    (``forward_logprobs``) counts nothing — so the bias a step leaves does not depend on the grouping, nor on the
    data-parallel split (``test_expert_parallel_2_on_deepseek_trains_like_one_rank``). Negative control:
    TorchTitan's accumulation (``forward_backward_step`` per micro-batch, every padded position counted) gives other
    counts for another grouping."""
    from titan_plugin.rl import RLTrainer, rl_trainer_config
    from zerokld_testing.deepseek import DeepSeekSpec, make_deepseek_checkpoint

    ckpt = str(make_deepseek_checkpoint(tmp_path / "ds", DeepSeekSpec(), seed=3, dtype="float32"))
    client = TrainingClient(RLTrainer(rl_trainer_config(ckpt, str(tmp_path / "c"), dtype="float32")), "float32")
    try:
        trainer = client.trainer
        batch = dataclasses.replace(_rollouts(ckpt, "float32"), numerics=trainer.numerics)
        _taken_counts(trainer)
        trainer.forward_logprobs(batch)
        assert not _taken_counts(trainer).any()  # scoring counts nothing
        seen = {}
        for name, sizes in GROUPINGS.items():
            for mb in _micro_batches(batch, sizes):
                client.forward_backward(mb, "ppo")
            seen[name] = _taken_counts(trainer)
        ref = seen["one call"]
        top_k = trainer.model_config.layers[-1].moe.router.top_k
        inputs = sum(len(s) - 1 for s in batch.sequences)
        assert ref.sum(dim=1).tolist() == [float(top_k * inputs)] * ref.shape[0]
        assert all(torch.equal(counts, ref) for counts in seen.values())

        def titan(sizes):  # TorchTitan's own accumulation: every position of each padded micro-batch counted
            _titan_accumulate(trainer, batch, sizes)
            return _taken_counts(trainer)

        stock_differs(not torch.equal(titan([8]), titan([3, 1, 4])), "TorchTitan's MoE token counts", "the groupings")
    finally:
        client.close()
