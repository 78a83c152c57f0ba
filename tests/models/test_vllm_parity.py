"""Trainer (TorchTitan + zerokld overrides) vs real vLLM engines (zerokld plugin on): exact equality everywhere.

Every engine here runs with ``max_num_batched_tokens=64``, so long prompts are prefilled in chunks and big batches
mix prefill chunks with decodes; prefix caching is on.
"""

from __future__ import annotations

import pytest
import torch

from titan_plugin import trainer_logprobs
from vllm_plugin.engines import completion_logprobs, prompt_logprobs, start_llm
from zerokld_testing import random_prompts
from zerokld_testing.controls import stock_differs

pytestmark = pytest.mark.vllm

# (family, dtype, fp8): fp8 is None, or (how vLLM gets FP8, granularity): "online" quantizes the high-precision
# checkpoint at load; "export" serves the trainer's exported zerokld_fp8 checkpoint. The trainer runs FP8 QAT.
CONFIGS = [
    ("qwen3", "float32", None),
    ("qwen3", "bfloat16", None),
    ("llama", "float32", None),
    ("llama", "bfloat16", None),
    ("qwen3", "bfloat16", ("online", "per_channel")),
    ("llama", "bfloat16", ("export", "per_channel")),
    ("qwen3", "float32", ("export", "block")),
    ("qwen3_moe", "float32", None),
    ("qwen3_moe", "bfloat16", None),
    ("qwen3_moe_ties", "bfloat16", None),
    ("qwen2", "bfloat16", None),
    ("llama31", "bfloat16", None),
    ("llama31", "float32", None),
]
#: the configurations `make test-extended` adds (marker ``extended``, docs/tests.md "Budgets"): each repeats a family,
#: dtype and FP8 path the default ones already serve (Llama 3.x covers Llama's layers, the tied MoE covers the MoE, the
#: block export covers the exported checkpoint and float32 Qwen3); one engine start is 20-45 s on 2 cores
EXTENDED = {
    ("qwen3", "float32", None),
    ("llama", "float32", None),
    ("llama", "bfloat16", None),
    ("llama", "bfloat16", ("export", "per_channel")),
    ("qwen3_moe", "float32", None),
    ("qwen3_moe", "bfloat16", None),
    ("llama31", "float32", None),
}


def _config_id(c) -> str:
    return "-".join([c[0], c[1]] + (["fp8", *c[2]] if c[2] else []))


def _params(configs, ids, extended) -> list:
    return [
        pytest.param(c, id=i, marks=[pytest.mark.extended] if c in extended else [])
        for c, i in zip(configs, ids, strict=True)
    ]


@pytest.fixture(scope="module", params=_params(CONFIGS, [_config_id(c) for c in CONFIGS], EXTENDED))
def env(request, engine_slot, checkpoint_factory, tmp_path_factory):
    """``(llm, trainer)``: a live engine and ``trainer(seqs, prompt_lens, **kw)`` = the matching trainer_logprobs."""
    family, dtype, fp8 = request.param
    ckpt = checkpoint_factory(family, dtype)
    granularity = fp8[1] if fp8 else None

    def factory():
        if fp8 and fp8[0] == "export":
            from zerokld_models.fp8_export import export_fp8_checkpoint

            served = export_fp8_checkpoint(ckpt, tmp_path_factory.mktemp("fp8") / "ckpt", granularity)
            return start_llm(str(served), dtype=dtype, batch_invariant=True, max_num_batched_tokens=64)
        return start_llm(ckpt, dtype=dtype, batch_invariant=True, max_num_batched_tokens=64, fp8=granularity)

    llm = engine_slot.get(("zerokld", family, dtype, fp8), factory)

    def trainer(seqs, prompt_lens, **kw):
        return trainer_logprobs(ckpt, seqs, prompt_lens, dtype=dtype, fp8=granularity, **kw)

    return llm, trainer


def greedy(max_tokens: int = 12, **kw):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, ignore_eos=True, **kw)


def test_alone_vs_batch_of_40(env):
    llm, _ = env
    prompts = random_prompts(40, seed=1)
    batch = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
    for i in (0, 17, 39):
        llm.reset_prefix_cache()
        alone = llm.generate([{"prompt_token_ids": prompts[i]}], greedy(), use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == batch[i].outputs[0].token_ids
        assert torch.equal(completion_logprobs(alone), completion_logprobs(batch[i]))


def test_prefix_cache_hit_is_bitwise(env):
    llm, _ = env
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
    llm, _ = env
    prompts = random_prompts(6, seed=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(max_tokens=20), use_tqdm=False)
    full = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs, strict=True)]
    llm.reset_prefix_cache()
    scored = llm.generate(
        [{"prompt_token_ids": s} for s in full], greedy(max_tokens=1, prompt_logprobs=0), use_tqdm=False
    )
    for p, o, s in zip(prompts, outs, scored, strict=True):
        assert torch.equal(completion_logprobs(o), prompt_logprobs(s, start=len(p)))


def test_chunked_prefill_matches_trainer(env):
    llm, trainer = env
    long_prompt = random_prompts(1, seed=4, lo=230, hi=231)[0]  # 231 tokens: 4 chunks of <= 64
    llm.reset_prefix_cache()
    out = llm.generate([{"prompt_token_ids": long_prompt}], greedy(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    ref = trainer([long_prompt], [1])[0]
    assert torch.equal(prompt_logprobs(out, start=1), ref)


def test_trainer_logprobs_equal_sampled_logprobs(env):
    """>= 50 sequences sampled at temperature 1 in one batch; the trainer scores them in one padded batch."""
    from vllm import SamplingParams

    llm, trainer = env
    prompts = random_prompts(56, seed=5, lo=4, hi=60)
    sp = SamplingParams(max_tokens=24, temperature=1.0, logprobs=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs, strict=True)]
    train = trainer(seqs, [len(p) for p in prompts])
    mismatched = [
        i for i, (t, o) in enumerate(zip(train, outs, strict=True)) if not torch.equal(t, completion_logprobs(o))
    ]
    assert mismatched == []
    fused = trainer(seqs, [len(p) for p in prompts], fused=True)  # fused lm_head path
    assert all(torch.equal(f, completion_logprobs(o)) for f, o in zip(fused, outs, strict=True))


MOE_CONFIGS = [c for c in CONFIGS if c[0].startswith("qwen3_moe")]


@pytest.mark.parametrize("env", _params(MOE_CONFIGS, [_config_id(c) for c in MOE_CONFIGS], EXTENDED), indirect=True)
def test_moe_skewed_expert_load_matches_trainer(env):
    """MoE configurations: a prompt of one repeated character sends all its tokens to the same experts while the
    rest of the batch spreads; alone == in the batch, and the trainer equals both."""
    llm, trainer = env
    prompts = random_prompts(12, seed=7)
    prompts.insert(3, [1] + [42] * 140)
    batch = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(max_tokens=16), use_tqdm=False)
    llm.reset_prefix_cache()
    alone = llm.generate([{"prompt_token_ids": prompts[3]}], greedy(max_tokens=16), use_tqdm=False)[0]
    assert torch.equal(completion_logprobs(alone), completion_logprobs(batch[3]))
    seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, batch, strict=True)]
    train = trainer(seqs, [len(p) for p in prompts])
    assert all(torch.equal(t, completion_logprobs(o)) for t, o in zip(train, batch, strict=True))


STOCK_CONFIGS = [("qwen3", "float32"), ("qwen3", "bfloat16"), ("llama", "bfloat16")]


@pytest.fixture(
    scope="module",
    params=_params(STOCK_CONFIGS, ["-".join(c) for c in STOCK_CONFIGS], {("qwen3", "float32"), ("llama", "bfloat16")}),
)
def stock_env(request, engine_slot, checkpoint_factory):
    family, dtype = request.param
    ckpt = checkpoint_factory(family, dtype)
    llm = engine_slot.get(("stock", family, dtype), lambda: start_llm(ckpt, dtype=dtype, batch_invariant=False))
    return llm, ckpt, dtype


def test_negative_control_stock_vllm_differs(stock_env):
    """With the plugin off, vLLM's own kernels do not reproduce the trainer's logprobs: the parity tests can fail
    (fp32 and bf16, Qwen3 and Llama; every architecture x dtype x FP8 is measured by ``benchmarks/kld_table.py``)."""
    llm, ckpt, dtype = stock_env
    from vllm import SamplingParams

    prompts = random_prompts(16, seed=6)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=16, temperature=1.0, logprobs=0, ignore_eos=True),
        use_tqdm=False,
    )
    seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs, strict=True)]
    train = trainer_logprobs(ckpt, seqs, [len(p) for p in prompts], dtype=dtype)
    assert len(train) == len(outs)
    stock_differs(
        sum(not torch.equal(t, completion_logprobs(o)) for t, o in zip(train, outs, strict=True)) > 0,
        f"vLLM's {dtype} log-probs vs the trainer's",
        "the prompts or the load",
    )
    # ...while still being the same model (a sanity bound, not a parity claim)
    bound = 1e-2 if dtype == "float32" else 1.0
    assert max((t - completion_logprobs(o)).abs().max().item() for t, o in zip(train, outs, strict=True)) < bound
