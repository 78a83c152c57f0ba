"""Qwen3-MoE on real vLLM engines and TorchTitan's Trainer: the deterministic sampler, routing capture and routing
replay (issue 5). The Qwen3-MoE parity matrix (fp32, bf16, router-tie checkpoint) is in ``test_vllm_parity.py``.

Engines here chunk prefills at 64 tokens (prompts up to 150 tokens), keep prefix caching on (vLLM requires it for
routed experts) and return routes (``enable_return_routed_experts=True``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shared_numerics.rollout import RolloutBatch
from titan_plugin import trainer_logprobs
from vllm_plugin.engines import completion_logprobs, reload_weights, start_llm
from zerokld_testing import mixed_sampling_params, random_prompts
from zerokld_testing.controls import stock_differs
from zerokld_testing.engines import load_delta_offline

pytestmark = [pytest.mark.vllm, pytest.mark.titan]

FAMILY, DTYPE = "qwen3_moe", "float32"


def _prompts(n: int, seed: int, lo: int = 4, hi: int = 150) -> list[list[int]]:
    return random_prompts(n, seed, lo, hi)


def _gen(llm, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _same(a, b) -> bool:
    """Same tokens, bitwise-equal logprobs and equal routes of two completions."""
    ca, cb = a.outputs[0], b.outputs[0]
    return (
        ca.token_ids == cb.token_ids
        and torch.equal(completion_logprobs(a), completion_logprobs(b))
        and np.array_equal(ca.routed_experts, cb.routed_experts)
    )


@pytest.fixture(scope="module")
def moe(engine_slot, checkpoint_factory):
    ckpt = checkpoint_factory(FAMILY, DTYPE)
    llm = engine_slot.get(
        ("zerokld-moe-routes", FAMILY, DTYPE),
        lambda: start_llm(
            ckpt, dtype=DTYPE, batch_invariant=True, max_num_batched_tokens=64, enable_return_routed_experts=True
        ),
    )
    return llm, ckpt


@pytest.fixture(scope="module")
def batch40(moe):
    """40 seeded requests with mixed sampling settings, one of them a 150-token run of a single character (so
    layer-0 experts receive very different token counts), sampled in one batch."""
    llm, _ = moe
    prompts = _prompts(39, seed=11)
    prompts.insert(7, [1] + [42] * 150)
    params = [mixed_sampling_params(i, seed=1000 + i) for i in range(len(prompts))]
    llm.reset_prefix_cache()
    return prompts, params, _gen(llm, prompts, params)


def test_seeded_sampling_alone_equals_batch_of_40_with_chunked_prefill(moe, batch40):
    llm, _ = moe
    prompts, params, outs = batch40
    assert max(len(p) for p in prompts) > 64  # chunked prefill happened (and seeded requests did not crash it)
    for i in (0, 7, 21, 39):
        llm.reset_prefix_cache()
        alone = _gen(llm, [prompts[i]], [params[i]])[0]
        assert _same(alone, outs[i]), f"request {i} differs alone vs in the batch"


def test_routes_cover_every_forwarded_token_and_load_is_skewed(moe, batch40):
    llm, _ = moe
    prompts, _, outs = batch40
    hf_layers, top_k, experts = 2, 2, 8
    for p, o in zip(prompts, outs, strict=True):
        r = o.outputs[0].routed_experts
        assert r.dtype == np.int16 and r.shape == (len(p) + len(o.outputs[0].token_ids) - 1, hf_layers, top_k)
        assert r.min() >= 0 and r.max() < experts
        assert all(len(set(row)) == top_k for row in r.reshape(-1, top_k).tolist())  # k distinct experts per token
    # the repeated-character prompt (index 7) sends its prefill to the same two layer-0 experts, while the rest of
    # the batch spreads: per-expert token counts of one step differ by far more than the tie-free noise
    skewed = np.bincount(outs[7].outputs[0].routed_experts[: len(prompts[7]), 0].reshape(-1), minlength=experts)
    assert np.sort(skewed)[-2:].sum() >= 0.9 * 2 * len(prompts[7]), f"not skewed: {skewed}"
    assert (skewed == 0).sum() >= experts // 2, f"not skewed: {skewed}"


def test_trainer_replaying_routes_equals_rollout(moe, batch40):
    """R3 parity: the trainer's forward with the rollout's routes, and without (recomputed), equal vLLM's logprobs."""
    _, ckpt = moe
    prompts, _, outs = batch40
    seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs, strict=True)]
    routes = [o.outputs[0].routed_experts for o in outs]
    replayed = trainer_logprobs(ckpt, seqs, [len(p) for p in prompts], dtype=DTYPE, routed_experts=routes)
    recomputed = trainer_logprobs(ckpt, seqs, [len(p) for p in prompts], dtype=DTYPE)
    for i, o in enumerate(outs):
        assert torch.equal(replayed[i], completion_logprobs(o)), f"sequence {i}"
        assert torch.equal(recomputed[i], completion_logprobs(o)), f"sequence {i}"


def test_sampled_tokens_are_the_counter_based_function_of_the_trainer_logits(moe, batch40):
    """Every sampled token is ``sample_tokens(logits, T, seed, position, top_k, top_p)`` of the trainer's logits —
    computed here in another process, with 2 threads: nothing but (seed, position, logits) decides it."""
    import shared_numerics as sn
    from shared_numerics.sampling import sample_tokens
    from titan_plugin.models import build_titan_model

    _, ckpt = moe
    prompts, params, outs = batch40
    model, _, _ = build_titan_model(ckpt, dtype=DTYPE)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for i in (1, 2, 3, 7):  # top-k, top-p, both, the skewed prompt
            p, sp, comp = prompts[i], params[i], outs[i].outputs[0]
            seq = torch.tensor([p + list(comp.token_ids)])
            with torch.no_grad():
                logits = model(seq)[0, len(p) - 1 : -1].float()
            n = logits.shape[0]
            vocab = logits.shape[1]
            got = sample_tokens(
                logits,
                torch.full((n,), sp.temperature),
                torch.full((n,), sp.seed),
                torch.arange(n),
                torch.full((n,), sp.top_k if sp.top_k > 0 else vocab),
                torch.full((n,), sp.top_p, dtype=torch.float64),
            )
            assert got.tolist() == list(comp.token_ids), f"request {i}"
            assert torch.equal(sn.selected_logprobs(logits, got), completion_logprobs(outs[i]))
    finally:
        torch.set_num_threads(threads)


def test_unseeded_requests_get_a_seed_that_reproduces_them(moe):
    from vllm import SamplingParams

    llm, _ = moe
    prompt = _prompts(1, seed=12)[0]
    first = _gen(llm, [prompt], [SamplingParams(n=4, max_tokens=16, temperature=1.0, logprobs=0, ignore_eos=True)])[0]
    seeds = [c.zerokld_seed for c in first.outputs]
    assert all(isinstance(s, int) for s in seeds) and len(set(seeds)) == 4
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1  # the four samples are not copies
    again = _gen(llm, [prompt] * 4, [mixed_sampling_params(0, seed=s, max_tokens=16) for s in seeds])
    for c, a in zip(first.outputs, again, strict=True):
        assert c.token_ids == a.outputs[0].token_ids
        assert a.outputs[0].zerokld_seed == c.zerokld_seed


def test_sampler_honours_top_k_and_top_p(moe):
    from vllm import SamplingParams

    llm, _ = moe
    prompts = _prompts(8, seed=13)
    greedy = _gen(llm, prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    top1 = _gen(llm, prompts, SamplingParams(max_tokens=12, temperature=1.5, top_k=1, seed=3, ignore_eos=True))
    tiny_p = _gen(llm, prompts, SamplingParams(max_tokens=12, temperature=1.5, top_p=1e-6, seed=3, ignore_eos=True))
    for g, a, b in zip(greedy, top1, tiny_p, strict=True):
        assert a.outputs[0].token_ids == g.outputs[0].token_ids == b.outputs[0].token_ids
    top5 = _gen(
        llm, prompts, SamplingParams(max_tokens=12, temperature=2.0, top_k=5, seed=4, logprobs=5, ignore_eos=True)
    )
    for o in top5:
        comp = o.outputs[0]
        for tok, lp in zip(comp.token_ids, comp.logprobs, strict=True):
            ranked = sorted(lp.values(), key=lambda x: x.rank)
            assert lp[tok].rank <= 5, f"token outside the top 5: {lp[tok]} of {ranked}"


def test_routes_of_a_prefix_cache_hit(moe):
    llm, _ = moe
    base = _prompts(1, seed=14, lo=300, hi=301)[0]  # several full KV blocks
    llm.reset_prefix_cache()
    cold = _gen(llm, [base + [5, 6, 7]], [mixed_sampling_params(0, seed=9)])[0]
    llm.reset_prefix_cache()
    _gen(llm, [base], [mixed_sampling_params(0, seed=9, max_tokens=1)])
    warm = _gen(llm, [base + [5, 6, 7]], [mixed_sampling_params(0, seed=9)])[0]
    assert (warm.num_cached_tokens or 0) > 0, "no prefix-cache hit"
    assert _same(cold, warm)


def test_replay_through_an_optimizer_step_and_a_hot_reload(moe, tmp_path):
    """Rollout at W0 → GRPO step replaying its routes (training forward == rollout logprobs) → W1 hot-loaded into
    the engine (a delta applied in place, per-expert tensors written into the stacked expert parameters) → rollout
    at W1 (routing of the same prompts flipped) → the trainer replaying the W1 routes equals the
    W1 rollout bit for bit; replaying the stale W0 routes gives other logprobs (the replay is really used)."""
    from titan_plugin.rl import RLTrainer, rl_trainer_config
    from titan_plugin.routing import captured_routes

    llm, ckpt = moe
    prompts = _prompts(8, seed=15, lo=20, hi=90)
    plens = [len(p) for p in prompts]
    params = [mixed_sampling_params(i, seed=2000 + i, max_tokens=16) for i in range(8)]
    trainer = RLTrainer(rl_trainer_config(ckpt, str(tmp_path / "dump"), dtype=DTYPE, lr=3e-3))
    try:
        llm.reset_prefix_cache()
        outs0 = _gen(llm, prompts, params)
        seqs0 = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs0, strict=True)]
        routes0 = [o.outputs[0].routed_experts for o in outs0]
        q0 = [completion_logprobs(o) for o in outs0]
        step = trainer.rl_step(
            RolloutBatch(seqs0, plens, [1.0, -1.0] * 4, [q.clone() for q in q0], routes0, numerics=trainer.numerics)
        )
        assert all(torch.equal(a, b) for a, b in zip(step["train_logprobs"], q0, strict=True))
        assert step["clipped"] == 0

        # W1 reaches the engine as a delta applied in place on its worker: stacked expert rows included
        from deltasync import read_snapshot_tensors

        w1 = trainer.save_hf(tmp_path / "w1", DTYPE)
        row = load_delta_offline(llm, ckpt, read_snapshot_tensors(w1), tmp_path, identity="w1")
        assert row["applied"] == "in_place" and row["tensors_changed"] > 0
        outs1 = _gen(llm, prompts, params)
        seqs1 = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs1, strict=True)]
        routes1 = [o.outputs[0].routed_experts for o in outs1]
        q1 = [completion_logprobs(o) for o in outs1]
        flipped = sum(
            int((r1[: len(p)] != r0[: len(p)]).any(axis=-1).sum())
            for p, r0, r1 in zip(prompts, routes0, routes1, strict=True)
        )
        assert flipped > 0, "one optimizer step changed no prompt token's routing; raise the learning rate"

        replayed = trainer.forward_logprobs(RolloutBatch(seqs1, plens, routed_experts=routes1))
        assert all(torch.equal(a, b) for a, b in zip(replayed, q1, strict=True))
        tokens = torch.tensor([seqs1[0]])
        with torch.no_grad():
            trainer.model(tokens)
        assert np.array_equal(captured_routes(trainer.model)[0, :-1].numpy(), routes1[0])
        stale = trainer.forward_logprobs(RolloutBatch(seqs0, plens, routed_experts=routes0))
        fresh = trainer.forward_logprobs(RolloutBatch(seqs0, plens))
        assert any(not torch.equal(a, b) for a, b in zip(stale, fresh, strict=True))
        step2 = trainer.rl_step(
            RolloutBatch(seqs1, plens, [1.0, -1.0] * 4, [q.clone() for q in q1], routes1, numerics=trainer.numerics)
        )
        assert all(torch.equal(a, b) for a, b in zip(step2["train_logprobs"], q1, strict=True))
    finally:
        trainer.close()
        reload_weights(llm, ckpt)  # leave the shared engine on W0


def _num_threads(worker) -> int:
    return torch.get_num_threads()


def test_same_tokens_across_preemption_and_thread_count(engine_slot, checkpoint_factory, monkeypatch):
    """A second engine with room for 6 KV blocks of 32 tokens (32 concurrent requests are preempted and recomputed)
    and 2 OpenMP threads samples exactly what the first engine (1 thread, no preemption) samples."""
    ckpt = checkpoint_factory(FAMILY, DTYPE)
    prompts = _prompts(32, seed=16, lo=20, hi=60)
    params = [mixed_sampling_params(i, seed=3000 + i, max_tokens=40) for i in range(32)]
    ref_llm = engine_slot.get(
        ("zerokld-moe-routes", FAMILY, DTYPE),
        lambda: start_llm(
            ckpt, dtype=DTYPE, batch_invariant=True, max_num_batched_tokens=64, enable_return_routed_experts=True
        ),
    )
    ref_llm.reset_prefix_cache()
    reference = _gen(ref_llm, prompts, params)

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc of a function (thread count)
    llm = engine_slot.get(
        ("zerokld-moe-preempt", FAMILY, DTYPE),
        lambda: start_llm(
            ckpt,
            dtype=DTYPE,
            batch_invariant=True,
            max_num_batched_tokens=64,
            enable_return_routed_experts=True,
            num_gpu_blocks_override=6,
            block_size=32,
            max_model_len=128,
            disable_log_stats=False,
        ),
    )
    assert llm.collective_rpc(_num_threads) == [2]
    outs = _gen(llm, prompts, params)
    preemptions = sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
    assert preemptions > 0, "the small KV cache preempted nothing"
    for i, (a, b) in enumerate(zip(reference, outs, strict=True)):
        assert _same(a, b), f"request {i} differs"


@pytest.fixture(scope="module")
def stock_moe(engine_slot, checkpoint_factory):
    ckpt = checkpoint_factory(FAMILY, DTYPE)
    llm = engine_slot.get(("stock", FAMILY, DTYPE), lambda: start_llm(ckpt, dtype=DTYPE, batch_invariant=False))
    return llm, ckpt


def test_negative_control_stock_unseeded_sampling_depends_on_the_batch(stock_moe):
    """Stock vLLM-CPU: the same unseeded request gets other tokens depending on what else is batched (its per-row
    seed comes from a global generator); and stock FusedMoE logprobs differ from the trainer's."""
    from vllm import SamplingParams

    llm, ckpt = stock_moe
    target = _prompts(1, seed=17)[0]
    others = _prompts(15, seed=18)
    sp = SamplingParams(max_tokens=24, temperature=1.0, logprobs=0, ignore_eos=True)
    first = _gen(llm, [target] + others, sp)[0]
    last = _gen(llm, others[:7] + [target], sp)[-1]
    assert first.outputs[0].token_ids != last.outputs[0].token_ids
    outs = _gen(llm, others, sp)
    seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(others, outs, strict=True)]
    train = trainer_logprobs(ckpt, seqs, [len(p) for p in others], dtype=DTYPE)
    assert len(train) == len(outs)
    stock_differs(
        sum(not torch.equal(t, completion_logprobs(o)) for t, o in zip(train, outs, strict=True)) > 0,
        "vLLM's MoE log-probs vs the trainer's",
        "the prompts or the load",
    )


def test_fp8_experts_served_online_equal_the_qat_trainer(engine_slot, checkpoint_factory):
    """FP8 on Qwen3-MoE (the shared FP8 GEMM on every projection and on each expert's own weight; the router in
    high precision): a bf16 engine with online per-channel FP8 samples a batch (chunked prefill) whose log-probs equal
    TorchTitan's FP8 QAT trainer bit for bit, with and without routing replay; a request alone equals itself in the
    batch. Negative control: the high-precision trainer differs (the experts' FP8 is real)."""
    from vllm import SamplingParams

    ckpt = checkpoint_factory(FAMILY, "bfloat16")
    llm = engine_slot.get(
        ("zerokld-moe-fp8", ckpt),
        lambda: start_llm(
            ckpt, dtype="bfloat16", fp8="per_channel", max_num_batched_tokens=64, enable_return_routed_experts=True
        ),
    )
    prompts = _prompts(16, seed=31)
    params = [SamplingParams(max_tokens=8, temperature=1.0, seed=300 + i, logprobs=0) for i in range(16)]
    llm.reset_prefix_cache()
    outs = _gen(llm, prompts, params)
    seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs, strict=True)]
    lens = [len(p) for p in prompts]
    served = torch.cat([completion_logprobs(o) for o in outs])
    routes = [o.outputs[0].routed_experts for o in outs]
    assert torch.equal(torch.cat(trainer_logprobs(ckpt, seqs, lens, dtype="bfloat16", fp8="per_channel")), served)
    assert torch.equal(
        torch.cat(trainer_logprobs(ckpt, seqs, lens, dtype="bfloat16", fp8="per_channel", routed_experts=routes)),
        served,
    )
    alone = _gen(llm, [prompts[5]], [params[5]])[0]
    assert _same(alone, outs[5])
    assert not torch.equal(torch.cat(trainer_logprobs(ckpt, seqs, lens, dtype="bfloat16")), served)
