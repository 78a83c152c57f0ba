"""TorchTitan side: its own qwen3/llama3 models with the zerokld overrides, and the real ``Trainer`` (RLTrainer)."""

from __future__ import annotations

import random

import pytest
import torch
from torchtitan.config import ParallelismConfig

from shared_numerics.rollout import RolloutBatch
from titan_plugin import sequence_logprobs, trainer_logprobs
from titan_plugin.models import build_titan_model
from zerokld_testing.controls import stock_differs

pytestmark = pytest.mark.titan

CONFIGS = [
    ("qwen3", "float32"),
    ("qwen3", "bfloat16"),
    ("llama", "float32"),
    ("llama", "bfloat16"),
    ("qwen3_moe", "float32"),
    ("qwen3_moe", "bfloat16"),
]


def _seqs(n: int, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    seqs = [[1] + [rng.randrange(3, 100) for _ in range(rng.randrange(5, 90))] for _ in range(n)]
    return seqs, [rng.randrange(1, len(s)) for s in seqs]


@pytest.mark.parametrize("family,dtype", CONFIGS)
def test_trainer_batch_of_one_equals_batch_of_n(checkpoint_factory, family, dtype):
    ckpt = checkpoint_factory(family, dtype)
    model, cfg, _ = build_titan_model(ckpt, dtype=dtype)
    from titan_plugin.overrides import ZeroKLDAttention, ZeroKLDLinear

    assert any(isinstance(m, ZeroKLDLinear) for m in model.modules())
    assert any(isinstance(m, ZeroKLDAttention) for m in model.modules())
    seqs, plens = _seqs(12, seed=11)
    stock = _stock_titan_model(ckpt, dtype)
    with torch.no_grad():
        for m, name in ((model, "zerokld"), (stock, "stock")):
            batch = sequence_logprobs(m, seqs, plens)
            same = [torch.equal(sequence_logprobs(m, [seqs[i]], [plens[i]])[0], batch[i]) for i in range(12)]
            if name == "zerokld":
                assert all(same)
            else:  # negative control: TorchTitan's own kernels give other bits alone than in this batch
                assert not all(same), "stock TorchTitan is batch invariant here: the claim proves nothing"


def _stock_titan_model(ckpt: str, dtype: str = "float32"):
    """TorchTitan's own model with its stock components (``nn.Linear``, SDPA attention), same weights."""
    from titan_plugin.models import build_titan_model

    return build_titan_model(ckpt, dtype=dtype, batch_invariant=False)[0]


def test_stock_torchtitan_differs_from_zerokld(checkpoint_factory):
    """Negative control on the trainer side: TorchTitan's stock components (SDPA attention) give other bits."""
    ckpt = checkpoint_factory("qwen3", "float32")
    stock = _stock_titan_model(ckpt)
    seqs, plens = _seqs(8, seed=12)
    with torch.no_grad():
        ours = trainer_logprobs(ckpt, seqs, plens, dtype="float32")
        theirs = sequence_logprobs(stock, seqs, plens)
    assert len(ours) == len(theirs)
    stock_differs(
        any(not torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)),
        "TorchTitan's stock model vs ours",
        "the sequences",
    )
    assert max((a - b).abs().max().item() for a, b in zip(ours, theirs, strict=True)) < 1e-3


@pytest.fixture(scope="module", params=[("llama", "bfloat16"), ("qwen3", "float32")], ids=["llama-bf16", "qwen3-fp32"])
def rl_trainer(request, checkpoint_factory, tmp_path_factory):
    from titan_plugin.rl import RLTrainer, rl_trainer_config

    family, dtype = request.param
    ckpt = checkpoint_factory(family, dtype)
    trainer = RLTrainer(rl_trainer_config(ckpt, str(tmp_path_factory.mktemp("dump")), dtype=dtype, lr=1e-3))
    yield trainer, ckpt, dtype
    trainer.close()


def test_rl_trainer_forward_equals_trainer_logprobs_and_export_roundtrips(rl_trainer, tmp_path):
    """The training step's own forward gives trainer_logprobs' bits; after an optimizer step the exported HF
    checkpoint reproduces the trainer's forward bit for bit (the llama3 q/k permutation included)."""
    trainer, ckpt, dtype = rl_trainer
    seqs, plens = _seqs(6, seed=13)
    ref = trainer_logprobs(ckpt, seqs, plens, dtype=dtype)
    out = trainer.rl_step(
        RolloutBatch(seqs, plens, [1.0, -1.0, 0.5, -0.5, 2.0, 0.0], [r.clone() for r in ref], numerics=trainer.numerics)
    )
    assert all(torch.equal(a, b) for a, b in zip(out["train_logprobs"], ref, strict=True))
    assert out["clipped"] == 0  # ratio exactly 1 on-policy
    snap = trainer.save_hf(tmp_path / "step1", dtype)
    exported = trainer_logprobs(str(snap), seqs, plens, dtype=dtype)
    assert any(not torch.equal(a, b) for a, b in zip(exported, ref, strict=True)), "the optimizer step changed nothing"
    nxt = trainer.rl_step(
        RolloutBatch(seqs, plens, [0.0] * 6, [e.clone() for e in exported], numerics=trainer.numerics)
    )
    assert all(torch.equal(a, b) for a, b in zip(nxt["train_logprobs"], exported, strict=True))


def test_rollout_batch_validates_lengths():
    with pytest.raises(ValueError, match="sampler logprobs"):
        RolloutBatch([[1, 5, 6, 7]], [2], [1.0], [torch.zeros(5)])
    with pytest.raises(ValueError, match="prompt length 5 outside"):
        RolloutBatch([[1, 5, 6, 7]], [5])
    with pytest.raises(ValueError, match="advantages has 2 entries for 1 rollouts"):
        RolloutBatch([[1, 5, 6, 7]], [2], [1.0, 2.0])
    with pytest.raises(ValueError, match="1 loss weights for 2 completion tokens"):
        RolloutBatch([[1, 5, 6, 7]], [2], loss_weights=[torch.ones(1)])
    with pytest.raises(ValueError, match="finite and non-negative"):
        RolloutBatch([[1, 5, 6, 7]], [2], loss_weights=[torch.tensor([1.0, float("nan")])])
    w = RolloutBatch([[1, 5, 6, 7], [1, 5]], [2, 1], loss_weights=[torch.tensor([0.5, 0.0]), torch.ones(1)])
    assert torch.equal(w.pack()[4], torch.tensor([[0.0, 0.5, 0.0], [1.0, 0.0, 0.0]]))
    assert RolloutBatch([[1, 5, 6, 7]], [2]).pack()[4] is None


def test_rl_step_refuses_rollouts_from_another_numerics_mode(rl_trainer):
    """Trainer and engine in different modes: a clear error naming both, and nothing computed (the weights and the
    step counter do not move). Control: the same batch stamped with the trainer's mode trains."""
    import dataclasses

    from shared_numerics import NumericsMismatchError, NumericsMode

    trainer, _, dtype = rl_trainer
    seqs, plens = _seqs(3, seed=14)
    ref = trainer.forward_logprobs(RolloutBatch(seqs, plens))
    before = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    step = trainer.step
    other_dtype = "float32" if dtype == "bfloat16" else "bfloat16"
    engines = {
        "cuda engine": dataclasses.replace(trainer.numerics, backend="triton"),
        "other dtype": dataclasses.replace(trainer.numerics, dtype=other_dtype),
        "fp8 engine": dataclasses.replace(trainer.numerics, fp8="per_channel"),
        "stock engine": None,
        "old contract": dataclasses.replace(trainer.numerics, contract="0:split=256"),
    }
    for name, mode in engines.items():
        batch = RolloutBatch(seqs, plens, [1.0, -1.0, 0.5], [r.clone() for r in ref], numerics=mode)
        with pytest.raises(NumericsMismatchError) as e:
            trainer.rl_step(batch)
        assert str(trainer.numerics) in str(e.value), name
        if mode is not None:
            assert str(mode) in str(e.value), name
        with pytest.raises(NumericsMismatchError):
            trainer.forward_backward(batch)
    assert trainer.step == step
    assert all(torch.equal(v, before[k]) for k, v in trainer.model.state_dict().items())
    assert isinstance(trainer.numerics, NumericsMode) and trainer.numerics.batch_invariant
    out = trainer.rl_step(
        RolloutBatch(seqs, plens, [1.0, -1.0, 0.5], [r.clone() for r in ref], numerics=trainer.numerics.to_dict())
    )
    assert all(torch.equal(a, b) for a, b in zip(out["train_logprobs"], ref, strict=True))


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_moe"])
def test_training_backward_is_deterministic(checkpoint_factory, family):
    """Two backward passes of the whole model on the same batch give bitwise equal gradients."""
    model, _, _ = build_titan_model(checkpoint_factory(family, "float32"), dtype="float32")
    seqs, plens = _seqs(4, seed=14)
    grads = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        loss = sum(-lp.sum() for lp in sequence_logprobs(model, seqs, plens))
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 0
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


def test_fused_and_unfused_training_steps_agree(checkpoint_factory, tmp_path):
    """Fused lm_head log-probs: the training forward's log-probs are trainer_logprobs' bits (hence vLLM's) and the
    loss value is the same bits as unfused. Parameters after one AdamW step: the gradients differ only in float32
    summation order (closed-form vs autograd backward), which AdamW's normalised first step can amplify for
    near-zero gradients; measured max |diff| / max |param| = 2.9e-5 on this model, bounded here by 1e-3."""
    from titan_plugin.models import hf_state_dict
    from titan_plugin.rl import RLTrainer, rl_trainer_config

    ckpt = checkpoint_factory("llama", "float32")
    seqs, plens = _seqs(8, seed=15)
    adv = [0.5, -1.0, 1.5, -0.2, 0.0, 1.0, -0.7, 0.3]
    ref = trainer_logprobs(ckpt, seqs, plens, dtype="float32")
    results = {}
    for fused in (False, True):
        trainer = RLTrainer(rl_trainer_config(ckpt, str(tmp_path / f"d{fused}"), dtype="float32", lr=1e-3, fused=fused))
        try:
            out = trainer.rl_step(RolloutBatch(seqs, plens, adv, [r.clone() for r in ref], numerics=trainer.numerics))
            assert all(torch.equal(a, b) for a, b in zip(out["train_logprobs"], ref, strict=True))
            results[fused] = (out["loss"], hf_state_dict(trainer.model, trainer.model_config, trainer._hf))
        finally:
            trainer.close()
    assert results[False][0] == results[True][0]
    a, b = results[False][1], results[True][1]
    assert max(((a[k] - b[k]).abs().max() / a[k].abs().max()).item() for k in a) < 1e-3
    with pytest.raises(ValueError, match="zerokld"):
        rl_trainer_config(ckpt, str(tmp_path / "x"), batch_invariant=False, fused=True)


def test_moe_load_balancing_bias_never_changes_the_selection(checkpoint_factory):
    """TorchTitan's auxiliary-loss-free load balancing keeps updating ``expert_bias_E`` (the trainer registers its
    hook), but ZeroKLDMoE routes without it — serving has no such bias — so logprobs and routes stay put."""
    from titan_plugin.overrides import ZeroKLDMoE
    from titan_plugin.routing import captured_routes

    model, _, _ = build_titan_model(checkpoint_factory("qwen3_moe", "float32"), dtype="float32")
    layers = [m for m in model.modules() if isinstance(m, ZeroKLDMoE)]
    assert len(layers) == 2 and all(m.expert_bias_E is not None for m in layers)
    seqs, plens = _seqs(4, seed=15)
    with torch.no_grad():
        before = sequence_logprobs(model, seqs, plens)
        routes = captured_routes(model)
        for m in layers:
            m.expert_bias_E.copy_(torch.linspace(-5, 5, m.expert_bias_E.numel()))
        after = sequence_logprobs(model, seqs, plens)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert torch.equal(captured_routes(model), routes)


def test_torchtitans_own_qwen3_moe_flavour_runs_the_shared_moe():
    """The overrides apply to TorchTitan's registered Qwen3-MoE flavour (``qwen3_moe_debug``) as they do to models
    built from HF configs: every MoE block becomes ZeroKLDMoE and a batch row equals the row alone."""
    from torchtitan.models.qwen3.config_registry import qwen3_moe_debug

    from titan_plugin.overrides import ZeroKLDMoE, apply_zerokld_overrides

    cfg = qwen3_moe_debug()
    apply_zerokld_overrides(cfg)
    with torch.device("cpu"):
        model = cfg.model_spec.model.build()
    model.init_states(buffer_device=torch.device("cpu"))
    assert sum(isinstance(m, ZeroKLDMoE) for m in model.modules()) == len(cfg.model_spec.model.layers)
    tokens = torch.randint(0, 1000, (3, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        batch = model(tokens)
        alone = model(tokens[1:2])
    assert torch.equal(alone[0], batch[1])


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_optimizer_state_offload_is_bitwise_the_resident_run(checkpoint_factory, tmp_path, family):
    """Issue 56 point 7: TorchTitan's ``training.enable_cpu_offload`` (FSDP2's ``CPUOffloadPolicy``: sharded float32
    parameters, gradients and AdamW state in host memory, the optimizer step there) gives, after three RL steps,
    exactly the weights and optimizer state of the resident run. On this CPU-only machine host memory is the device,
    so the test covers the code path (every FSDP group runs with the offload policy); a GPU adds the host/device
    copies and a host AdamW step, whose bits must equal the device's (not measured here)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    from titan_plugin.rl import RLTrainer, rl_trainer_config

    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    ckpt = checkpoint_factory(family, "bfloat16")
    seqs, plens = _seqs(6, seed=16)
    results = {}
    for offload in (False, True):
        trainer = RLTrainer(
            rl_trainer_config(ckpt, str(tmp_path / f"d{offload}"), dtype="bfloat16", lr=1e-3, cpu_offload=offload)
        )
        try:
            groups = [
                m._get_fsdp_state()._fsdp_param_group for m in trainer.model.modules() if isinstance(m, FSDPModule)
            ]
            groups = [g for g in groups if g is not None]
            assert len(groups) > 1 and all(isinstance(g.offload_policy, CPUOffloadPolicy) == offload for g in groups)
            before = {k: full(v).clone() for k, v in trainer.model.state_dict().items()}
            for _ in range(3):
                ref = trainer.forward_logprobs(RolloutBatch(seqs, plens))
                trainer.rl_step(
                    RolloutBatch(
                        seqs,
                        plens,
                        [1.0, -0.5, 0.25, -1.0, 0.75, -0.25],
                        [r.clone() for r in ref],
                        numerics=trainer.numerics,
                    )
                )
            weights = {k: full(v) for k, v in trainer.model.state_dict().items()}
            state = [
                full(t)
                for opt in trainer.optimizers.optimizers
                for s in opt.state.values()
                for t in s.values()
                if torch.is_tensor(t)
            ]
            assert any(not torch.equal(before[k], weights[k]) for k in weights)  # the steps moved the weights
            results[offload] = (weights, state)
        finally:
            trainer.close()
    (w0, s0), (w1, s1) = results[False], results[True]
    assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)
    assert len(s0) == len(s1) > 0 and all(torch.equal(a, b) for a, b in zip(s0, s1, strict=True))


def test_context_parallel_layouts_not_run_yet_are_refused(tmp_path):
    """Issue 56: ``rl_trainer_config(context_parallel_degree=2)`` is refused before any process starts on an MLA model
    (DeepSeek-V3: zerokld's CP gathers the keys and values of its own attention, ``titan_plugin.context_parallel``,
    not MLA's latent ones yet) and combined with PP or TP (not run yet). Qwen3 alone is accepted
    (``tests/layouts/test_context_parallel.py``: CP 2 == one rank)."""
    from titan_plugin.rl import rl_trainer_config
    from zerokld_testing import DeepSeekSpec, TinyModelSpec, make_deepseek_checkpoint, make_tiny_checkpoint

    ds = make_deepseek_checkpoint(tmp_path / "ds", DeepSeekSpec(), seed=1)
    with pytest.raises(ValueError, match="context_parallel_degree 2: not yet on MLA attention"):
        rl_trainer_config(str(ds), str(tmp_path / "a"), parallelism=ParallelismConfig(context_parallel_degree=2))
    qwen3 = make_tiny_checkpoint(tmp_path / "q", TinyModelSpec(num_hidden_layers=4), seed=1)
    for other, k_block in (({"pipeline_parallel_degree": 2}, None), ({"tensor_parallel_degree": 2}, 16)):
        with pytest.raises(ValueError, match="context_parallel_degree 2 with TP, EP or PP: not yet"):
            rl_trainer_config(
                str(qwen3),
                str(tmp_path / "b"),
                parallelism=ParallelismConfig(context_parallel_degree=2, **other),
                tp_k_block=k_block,
            )


def test_pipeline_layouts_the_trainer_cannot_keep_exact_are_refused(checkpoint_factory, tmp_path):
    """``rl_trainer_config(pipeline_parallel_degree=...)`` refuses, before any process starts: a schedule that does not
    back-propagate each stage's micro-batches in order (zero-bubble schedules defer weight gradients), tied
    embeddings (one weight on the first and the last stage), fewer layers than stages. Accepted layouts: 1F1B, GPipe,
    Interleaved1F1B (``tests/layouts/test_pipeline_parallel.py``: the same bits as one rank); the stock trainer takes
    any schedule TorchTitan does."""
    from titan_plugin.rl import rl_trainer_config

    qwen3 = checkpoint_factory("qwen3", "float32")  # two layers
    with pytest.raises(ValueError, match="zero-bubble"):
        rl_trainer_config(
            qwen3,
            str(tmp_path / "a"),
            parallelism=ParallelismConfig(pipeline_parallel_degree=2, pipeline_parallel_schedule="ZBVZeroBubble"),
        )
    with pytest.raises(ValueError, match="tied embeddings"):
        rl_trainer_config(
            checkpoint_factory("qwen3_tied", "float32"),
            str(tmp_path / "b"),
            parallelism=ParallelismConfig(pipeline_parallel_degree=2),
        )
    with pytest.raises(ValueError, match="2 layers for 4 stages"):
        rl_trainer_config(
            qwen3,
            str(tmp_path / "c"),
            parallelism=ParallelismConfig(pipeline_parallel_degree=2, pipeline_parallel_schedule="Interleaved1F1B"),
        )
    config = rl_trainer_config(
        qwen3, str(tmp_path / "d"), parallelism=ParallelismConfig(pipeline_parallel_degree=2), seq_len=128
    )
    assert config.parallelism.pipeline_parallel_degree == 2 and config.training.local_batch_size == 4  # 2 x stages
    assert config.training.seq_len == 128
    stock = rl_trainer_config(
        qwen3,
        str(tmp_path / "e"),
        batch_invariant=False,
        parallelism=ParallelismConfig(pipeline_parallel_degree=2, pipeline_parallel_schedule="ZBVZeroBubble"),
    )
    assert stock.parallelism.pipeline_parallel_schedule == "ZBVZeroBubble"


def test_expert_parallel_degrees_the_model_cannot_take_are_refused(checkpoint_factory, tmp_path):
    """``rl_trainer_config(expert_parallel_degree=...)`` refuses, before any process starts, a dense model, an expert
    count the degree does not divide (TorchTitan's sharding would fail inside DTensor: "Not supported split"), Qwen3-MoE
    and DeepSeekMoE alike. The working layouts, EP 2 == one rank, are in ``tests/layouts/test_expert_parallel.py``."""
    from titan_plugin.rl import rl_trainer_config
    from zerokld_testing import DeepSeekSpec, TinyModelSpec, make_deepseek_checkpoint, make_tiny_checkpoint

    with pytest.raises(ValueError, match="no MoE experts"):
        rl_trainer_config(
            checkpoint_factory("qwen3", "float32"),
            str(tmp_path / "a"),
            parallelism=ParallelismConfig(expert_parallel_degree=2),
        )
    odd = make_tiny_checkpoint(tmp_path / "odd", TinyModelSpec(family="qwen3_moe", num_experts=5), seed=1)
    with pytest.raises(ValueError, match="5 experts do not split evenly over 2 ranks"):
        rl_trainer_config(str(odd), str(tmp_path / "b"), parallelism=ParallelismConfig(expert_parallel_degree=2))
    rl_trainer_config(
        str(odd), str(tmp_path / "c"), parallelism=ParallelismConfig(expert_parallel_degree=5)
    )  # 5 / 5: accepted
    ds = make_deepseek_checkpoint(tmp_path / "ds", DeepSeekSpec(n_routed_experts=6, n_group=2, topk_group=1), seed=1)
    with pytest.raises(ValueError, match="6 experts do not split evenly over 4 ranks"):
        rl_trainer_config(str(ds), str(tmp_path / "d"), parallelism=ParallelismConfig(expert_parallel_degree=4))
    rl_trainer_config(
        str(ds), str(tmp_path / "e"), parallelism=ParallelismConfig(expert_parallel_degree=2)
    )  # DeepSeekMoE: 6 / 2, accepted
