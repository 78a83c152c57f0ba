"""GLM-4.5 (``Glm4MoeForCausalLM``) at zero KLD, the proof that an architecture is a folder of components (issue 77
point 7): grouped-query attention with partial RoPE (half of each head rotated), QK norm and q/k/v biases, and GLM's
DeepSeekMoE after one dense layer — the plan's ``gqa``, ``swiglu`` and ``deepseek_moe`` — served by vLLM's zerokld
engine and trained by a TorchTitan model composed from TorchTitan's Qwen3 blocks, DeepSeekMoE and partial RoPE.

Checkpoints are made by transformers' own ``Glm4MoeForCausalLM`` (:func:`make_glm4_moe_checkpoint`): 8 experts in 2
groups of which a token may use 1, top-2, with exact ties between expert pairs (their router rows and selection biases
copied), the selection biases in float32 as GLM ships them. Engines chunk prefills at 64 tokens (prompts up to 150)
with prefix caching on. Negative controls: stock vLLM and the stock trainer (TorchTitan's components) give other
log-probs than each other and than zerokld.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from zerokld_testing import make_tokenizer
from zerokld_testing.controls import stock_differs

#: the tiny model's shape (HF ``Glm4MoeConfig`` names)
SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    n_routed_experts=8,
    n_group=2,
    topk_group=1,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    use_qk_norm=True,
    attention_bias=True,
    partial_rotary_factor=0.5,
    max_position_embeddings=512,
)
#: what :func:`tests.models.test_deepseek.served_is_the_trainers` reads of a shape (its routes: one row per MoE layer)
SPEC = SimpleNamespace(**{k: SHAPE[k] for k in ("num_hidden_layers", "first_k_dense_replace", "num_experts_per_tok")})


def make_glm4_moe_checkpoint(out: Path, dtype: str, seed: int = 3, **changes) -> Path:
    """A tiny ``Glm4MoeForCausalLM`` of :data:`SHAPE` (``changes`` override fields) saved with ``save_pretrained``:
    normal init of std 0.08, the embedding std 1, norms 1, selection biases std 0.1 kept in float32, experts ``2j``
    and ``2j + 1`` tied (router rows and biases), and the character tokenizer."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    with tempfile.TemporaryDirectory(prefix="zerokld-tokenizer-") as tok:
        cfg = Glm4MoeConfig(
            vocab_size=make_tokenizer(tok),
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
            **{**SHAPE, **changes},
        )
        cfg.architectures = ["Glm4MoeForCausalLM"]
        model = Glm4MoeForCausalLM(cfg)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * (1.0 if name == "model.embed_tokens.weight" else 0.08))
            for layer in model.model.layers:
                gate = getattr(layer.mlp, "gate", None)
                if gate is not None:
                    gate.e_score_correction_bias.copy_(
                        torch.randn(gate.e_score_correction_bias.shape, generator=g) * 0.1
                    )
                    for t in (gate.weight, gate.e_score_correction_bias):
                        t[1::2] = t[0::2].clone()
        model.to(getattr(torch, dtype))
        for layer in model.model.layers:  # the selection bias stays float32, as GLM ships it
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.e_score_correction_bias.data = gate.e_score_correction_bias.data.float()
        model.config.torch_dtype = dtype
        model.save_pretrained(out)
        for f in Path(tok).iterdir():
            (out / f.name).write_bytes(f.read_bytes())
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    cache: dict = {}

    def get(dtype: str, **changes) -> str:
        key = (dtype, tuple(sorted(changes.items())))
        if key not in cache:
            cache[key] = str(make_glm4_moe_checkpoint(tmp_path_factory.mktemp(f"glm4_moe_{dtype}"), dtype, **changes))
        return cache[key]

    return get


def test_the_plan_reads_glm_4_5s_config(ckpts):
    """Partial RoPE, QK norm and q/k/v biases come from the config (``o_proj`` has none), GLM's sigmoid router from
    the folder's defaults; the support check admits it, and refuses what zerokld does not implement by name."""
    import dataclasses

    from zerokld_models import UnsupportedModelError, adapter_for, check_supported, layer_plan, read_model_config

    cfg = read_model_config(ckpts("float32"))
    adapter = adapter_for(cfg)
    plan = layer_plan(cfg, adapter)
    assert [(layer.mixer.kind, layer.mlp.kind) for layer in plan] == [
        ("gqa", "swiglu"),
        ("gqa", "deepseek_moe"),
        ("gqa", "deepseek_moe"),
    ]
    assert all(layer.mixer.qk_norm and layer.mixer.qkv_bias for layer in plan)
    assert (cfg.partial_rotary_factor, cfg.scoring_func, cfg.topk_method) == (0.5, "sigmoid", "noaux_tc")
    check_supported(cfg, adapter)
    odd = dataclasses.replace(cfg, partial_rotary_factor=0.3)  # 9 of 32 dimensions: no rotate-half pairs
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor 0.3"):
        check_supported(odd, adapter)


@pytest.mark.titan
@pytest.mark.parametrize("changes", [{}, {"use_qk_norm": False, "attention_bias": False}], ids=["qk_norm", "plain"])
def test_trainer_is_the_transformers_model(ckpts, changes):
    """The composed TorchTitan model with zerokld computes HF's ``Glm4MoeForCausalLM``: float32 log-probs within 1e-5
    (with QK norm and biases, and without)."""
    from transformers import AutoModelForCausalLM

    from titan_plugin.models import build_titan_model

    ckpt = ckpts("float32", **changes)
    ids = torch.tensor([[1] + list(range(10, 90))])
    model, _, _ = build_titan_model(ckpt, dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    with torch.no_grad():
        ours = torch.log_softmax(model(ids).float(), -1)
        ref = torch.log_softmax(hf(ids).logits.float(), -1)
    assert (ours - ref).abs().max().item() < 1e-5


def _engine(engine_slot, ckpt: str, dtype: str, zerokld: bool = True):
    from vllm_plugin.engines import start_llm

    if not zerokld:
        return engine_slot.get(("stock-glm4_moe", dtype), lambda: start_llm(ckpt, dtype=dtype, batch_invariant=False))
    return engine_slot.get(
        ("zerokld-glm4_moe", dtype),
        lambda: start_llm(
            ckpt, dtype=dtype, max_num_batched_tokens=64, block_size=16, enable_return_routed_experts=True
        ),
    )


@pytest.mark.vllm
@pytest.mark.titan
@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float32", marks=pytest.mark.extended)])
def test_served_logprobs_are_the_trainers_bitwise(engine_slot, ckpts, dtype):
    """vLLM's zerokld engine (paged KV cache, chunked prefill at 64 tokens, prefix caching) samples 24 requests; each
    completion's log-probs equal the composed TorchTitan trainer's bit for bit (whole stacked tensors), also when the
    trainer replays the engine's routed experts (R3); a request alone, and again from the prefix cache, equals itself
    in the batch; the stock trainer differs (the negative control)."""
    from tests.models.test_deepseek import served_is_the_trainers
    from titan_plugin import trainer_logprobs

    ckpt = ckpts(dtype)
    seqs, lens, served = served_is_the_trainers(_engine(engine_slot, ckpt, dtype), ckpt, SPEC, dtype)
    stock = trainer_logprobs(ckpt, seqs, lens, dtype=dtype, batch_invariant=False)
    stock_differs(not torch.equal(torch.cat(stock), torch.cat(served)), "TorchTitan's components", f"GLM-4.5 {dtype}")


@pytest.mark.vllm
@pytest.mark.titan
def test_stock_vllm_and_the_stock_trainer_differ(engine_slot, ckpts):
    """The negative control with stock on both sides: stock vLLM (its ``glm4_moe.py``: fused QKV, its rotary
    embedding, FusedMoE's routing) samples the batch, and its log-probs differ from the stock trainer's and from
    zerokld's trainer's on the same tokens — while staying the same model (mean |difference| below 0.5 nats)."""
    from tests.models.test_deepseek import _served_batch
    from titan_plugin import trainer_logprobs
    from vllm_plugin.engines import completion_logprobs

    ckpt = ckpts("bfloat16")
    llm = _engine(engine_slot, ckpt, "bfloat16", zerokld=False)
    prompts, params = _served_batch()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    served = [completion_logprobs(o) for o in outs]
    seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs, strict=True)]
    lens = [len(p) for p in prompts]
    stock = trainer_logprobs(ckpt, seqs, lens, dtype="bfloat16", batch_invariant=False)
    ours = trainer_logprobs(ckpt, seqs, lens, dtype="bfloat16")
    assert len(stock) == len(ours) == len(served) == 24
    stock_differs(not torch.equal(torch.cat(stock), torch.cat(served)), "vLLM vs the stock trainer", "the prompts")
    stock_differs(not torch.equal(torch.cat(ours), torch.cat(served)), "vLLM vs zerokld's trainer", "the prompts")
    assert (torch.cat(stock) - torch.cat(served)).abs().mean().item() < 0.5
