"""Trainer (TorchTitan + zerokld overrides) vs real vLLM engines (zerokld plugin on): exact equality everywhere.

Every engine here runs with ``max_num_batched_tokens=64``, so long prompts are prefilled in chunks and big batches
mix prefill chunks with decodes; prefix caching is on.
"""
from __future__ import annotations

import random

import pytest
import torch

from titan_plugin import trainer_logprobs
from zerokld_testing.engines import completion_logprobs, prompt_logprobs, start_llm

pytestmark = pytest.mark.vllm

CONFIGS = [("qwen3", "float32"), ("qwen3", "bfloat16"), ("llama", "float32"), ("llama", "bfloat16")]
VOCAB_LO, VOCAB_HI = 3, 100  # printable characters of the tiny tokenizer


def random_prompts(n: int, seed: int, lo: int = 4, hi: int = 120) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="module", params=CONFIGS, ids=[f"{f}-{d}" for f, d in CONFIGS])
def env(request, engine_slot, checkpoint_factory):
    family, dtype = request.param
    ckpt = checkpoint_factory(family, dtype)
    llm = engine_slot.get(("zerokld", family, dtype),
                          lambda: start_llm(ckpt, dtype=dtype, zerokld=True, max_num_batched_tokens=64))
    return llm, ckpt, dtype


def greedy(max_tokens: int = 12, **kw):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, ignore_eos=True, **kw)


def test_alone_vs_batch_of_40(env):
    llm, _, _ = env
    prompts = random_prompts(40, seed=1)
    batch = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
    for i in (0, 17, 39):
        llm.reset_prefix_cache()
        alone = llm.generate([{"prompt_token_ids": prompts[i]}], greedy(), use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == batch[i].outputs[0].token_ids
        assert torch.equal(completion_logprobs(alone), completion_logprobs(batch[i]))


def test_prefix_cache_hit_is_bitwise(env):
    llm, _, _ = env
    base = random_prompts(1, seed=2, lo=130, hi=131)[0]
    longer = base + [5, 6, 7, 8]
    llm.reset_prefix_cache()
    cold = llm.generate([{"prompt_token_ids": longer}], greedy(), use_tqdm=False)[0]
    llm.reset_prefix_cache()
    llm.generate([{"prompt_token_ids": base}], greedy(), use_tqdm=False)
    warm = llm.generate([{"prompt_token_ids": longer}], greedy(), use_tqdm=False)[0]
    assert (warm.num_cached_tokens or 0) > 0, "the second request did not hit the prefix cache"
    assert cold.outputs[0].token_ids == warm.outputs[0].token_ids
    assert torch.equal(completion_logprobs(cold), completion_logprobs(warm))


def test_decode_logprobs_equal_prompt_logprobs(env):
    llm, _, _ = env
    prompts = random_prompts(6, seed=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(max_tokens=20), use_tqdm=False)
    full = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
    llm.reset_prefix_cache()
    scored = llm.generate([{"prompt_token_ids": s} for s in full], greedy(max_tokens=1, prompt_logprobs=0),
                          use_tqdm=False)
    for p, o, s in zip(prompts, outs, scored):
        assert torch.equal(completion_logprobs(o), prompt_logprobs(s, start=len(p)))


def test_chunked_prefill_matches_trainer(env):
    llm, ckpt, dtype = env
    long_prompt = random_prompts(1, seed=4, lo=230, hi=231)[0]  # 231 tokens: 4 chunks of <= 64
    llm.reset_prefix_cache()
    out = llm.generate([{"prompt_token_ids": long_prompt}], greedy(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    ref = trainer_logprobs(ckpt, [long_prompt], [1], dtype=dtype)[0]
    assert torch.equal(prompt_logprobs(out, start=1), ref)


def test_trainer_logprobs_equal_sampled_logprobs(env):
    """>= 50 sequences sampled at temperature 1 in one batch; the trainer scores them in one padded batch."""
    from vllm import SamplingParams

    llm, ckpt, dtype = env
    prompts = random_prompts(56, seed=5, lo=4, hi=60)
    sp = SamplingParams(max_tokens=24, temperature=1.0, logprobs=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
    train = trainer_logprobs(ckpt, seqs, [len(p) for p in prompts], dtype=dtype)
    mismatched = [i for i, (t, o) in enumerate(zip(train, outs)) if not torch.equal(t, completion_logprobs(o))]
    assert mismatched == []
    fused = trainer_logprobs(ckpt, seqs, [len(p) for p in prompts], dtype=dtype, fused=True)  # fused lm_head path
    assert all(torch.equal(f, completion_logprobs(o)) for f, o in zip(fused, outs))


@pytest.fixture(scope="module")
def stock_env(engine_slot, checkpoint_factory):
    ckpt = checkpoint_factory("qwen3", "float32")
    llm = engine_slot.get(("stock", "qwen3", "float32"), lambda: start_llm(ckpt, dtype="float32", zerokld=False))
    return llm, ckpt


def test_negative_control_stock_vllm_differs(stock_env):
    """With the plugin off, vLLM's own kernels do not reproduce the trainer's logprobs: the parity tests can fail."""
    llm, ckpt = stock_env
    from vllm import SamplingParams

    prompts = random_prompts(16, seed=6)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=16, temperature=1.0, logprobs=0, ignore_eos=True), use_tqdm=False)
    seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
    train = trainer_logprobs(ckpt, seqs, [len(p) for p in prompts], dtype="float32")
    differing = sum(not torch.equal(t, completion_logprobs(o)) for t, o in zip(train, outs))
    assert differing > 0
    # ...while still being the same model (a sanity bound, not a parity claim)
    assert max((t - completion_logprobs(o)).abs().max().item() for t, o in zip(train, outs)) < 1e-2
