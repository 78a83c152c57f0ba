"""The per-layer plan (:func:`zerokld_models.layer_plan`, issue 77 point 1) of every registered architecture against
what Hugging Face ``transformers`` builds from the same config (the reference definition): each decoder layer's token
mixer (grouped-query attention with or without QK norm and q/k/v bias, MLA, DSA with its indexer mode), its cache's
per-token state and its MLP (dense, routed, DeepSeekMoE with shared experts). The configs mix layer kinds — dense and
routed layers interleaved, ``mlp_only_layers`` with a ``decoder_sparse_step``, "full" and "shared" indexer layers — so
a plan read from one model-wide trait (one mixer, "every layer MoE") fails here: the negative control asserts that.
GLM-4.5's QK norm and q/k/v biases are the config's (``use_qk_norm``, ``attention_bias``), not the architecture's."""

from __future__ import annotations

import pytest
import torch

from zerokld_models import adapter_for, dense_prefix, layer_plan, read_model_config

pytestmark = pytest.mark.timeout(300)

SMALL = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)
MLA = dict(
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
)


def _configs():
    import transformers as tf

    yield "LlamaForCausalLM", tf.LlamaConfig(**SMALL, num_hidden_layers=2)
    yield "Qwen2ForCausalLM", tf.Qwen2Config(**SMALL, num_hidden_layers=2)
    yield "Qwen3ForCausalLM", tf.Qwen3Config(**SMALL, head_dim=16, num_hidden_layers=2)
    yield (
        "Qwen3MoeForCausalLM",
        tf.Qwen3MoeConfig(
            **SMALL,
            head_dim=16,
            num_hidden_layers=6,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            mlp_only_layers=[3],
            decoder_sparse_step=2,
        ),
    )
    yield "DeepseekV3ForCausalLM", tf.DeepseekV3Config(**SMALL, **MLA, num_hidden_layers=4, first_k_dense_replace=2)
    v2 = {**MLA, "q_lora_rank": None, "topk_method": "greedy"}
    yield "DeepseekV2ForCausalLM", tf.DeepseekV2Config(**SMALL, **v2, num_hidden_layers=3, first_k_dense_replace=1)
    yield (
        "Glm4MoeLiteForCausalLM",
        tf.Glm4MoeLiteConfig(
            **SMALL, **MLA, num_hidden_layers=4, mlp_layer_types=["dense", "sparse", "dense", "sparse"]
        ),
    )
    dsa = dict(
        index_topk=4, index_n_heads=2, index_head_dim=16, mlp_layer_types=["dense", "sparse", "sparse", "sparse"]
    )
    yield (
        "GlmMoeDsaForCausalLM",
        tf.GlmMoeDsaConfig(
            **SMALL, **MLA, **dsa, num_hidden_layers=4, indexer_types=["full", "shared", "full", "shared"]
        ),
    )
    yield "DeepseekV32ForCausalLM", tf.DeepseekV32Config(**SMALL, **MLA, **dsa, num_hidden_layers=4)
    glm = {k: MLA[k] for k in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts")}
    yield (
        "Glm4MoeForCausalLM",
        tf.Glm4MoeConfig(
            **SMALL,
            **glm,
            head_dim=16,
            num_hidden_layers=3,
            first_k_dense_replace=1,
            use_qk_norm=True,
            attention_bias=True,
        ),
    )
    yield (
        "Qwen3NextForCausalLM",
        tf.Qwen3NextConfig(
            **SMALL,
            head_dim=16,
            num_hidden_layers=4,
            layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
            linear_num_key_heads=2,
            linear_key_head_dim=16,
            linear_num_value_heads=4,
            linear_value_head_dim=24,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            mlp_only_layers=[2],
        ),
    )


CONFIGS = list(_configs())


def _hf_layers(hf_config):
    """HF's decoder layers for ``hf_config``, built on the meta device (shapes, no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return list(model.model.layers)


def _hf_mixer(layer) -> str:
    if hasattr(layer, "linear_attn"):
        return "gated_deltanet"
    attn = layer.self_attn
    if hasattr(attn, "kv_a_proj_with_mqa"):
        return "dsa" if hasattr(attn, "indexer") else "mla"
    return "gqa"


def _hf_routed(layer) -> bool:
    return hasattr(layer.mlp, "experts")


def test_every_architecture_is_covered():
    from zerokld_plugins import registered

    assert {arch for arch, _ in CONFIGS} == set(registered("model"))


@pytest.mark.parametrize("arch,hf_config", CONFIGS, ids=[a for a, _ in CONFIGS])
def test_the_plan_is_what_hf_builds(arch, hf_config):
    hf_config.architectures = [arch]
    cfg = read_model_config(hf_config)
    plan = layer_plan(cfg, adapter_for(cfg))
    hf = _hf_layers(hf_config)
    assert len(plan) == len(hf) == hf_config.num_hidden_layers
    for layer, ref in zip(plan, hf, strict=True):
        assert layer.mixer.kind == _hf_mixer(ref), (layer.index, layer.mixer, type(ref.self_attn).__name__)
        assert layer.mlp.routed == _hf_routed(ref), (layer.index, layer.mlp, type(ref.mlp).__name__)
        attn, state = getattr(ref, "self_attn", None), dict(layer.mixer.state)
        if layer.mixer.kind == "gqa":
            assert layer.mixer.cache == "paged_kv"
            assert state["k"] == state["v"] == (cfg.num_key_value_heads, cfg.head_dim)
            assert attn.k_proj.out_features == state["k"][0] * state["k"][1]
            assert layer.mixer.qk_norm == hasattr(attn, "q_norm")
            assert layer.mixer.qkv_bias == (attn.q_proj.bias is not None)
            gate = 2 if layer.mixer.output_gate else 1  # Qwen3-Next's q_proj: each head's query and its output gate
            assert attn.q_proj.out_features == cfg.num_attention_heads * cfg.head_dim * gate
        elif layer.mixer.kind == "gated_deltanet":  # the conv1d's K - 1 inputs and the [Hv, d_k, d_v] state
            gdn = ref.linear_attn
            c, _, k = gdn.conv1d.weight.shape
            assert layer.mixer.cache == "recurrent"
            assert state == {"conv": (k - 1, c), "recurrent": (gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim)}
        else:  # the latent: kv_a_proj_with_mqa's output, c_kv and the shared rope key
            assert layer.mixer.cache == "latent"
            assert state["latent"] == (attn.kv_a_proj_with_mqa.out_features,)
        if layer.mixer.kind == "dsa":  # HF's shared layers have no indexer (GLM-5); DeepSeek-V3.2's are all full
            assert layer.mixer.indexer == getattr(hf_config, "indexer_types", ["full"] * len(plan))[layer.index]
            if attn.indexer is None:
                assert layer.mixer.indexer == "shared" and "indexer_key" not in state
            else:
                assert state["indexer_key"] == (attn.indexer.wk.out_features,)
        if layer.mlp.routed:
            experts = ref.mlp.experts
            assert layer.mlp.num_experts == getattr(experts, "num_experts", None) or len(experts)
            assert layer.mlp.kind == (
                "moe" if arch in ("Qwen3MoeForCausalLM", "Qwen3NextForCausalLM") else "deepseek_moe"
            )
            assert (layer.mlp.shared_experts > 0) == hasattr(ref.mlp, "shared_experts")
            assert layer.mlp.shared_expert_gate == hasattr(ref.mlp, "shared_expert_gate")
        else:
            assert layer.mlp.kind == "swiglu" and layer.mlp.intermediate_size == ref.mlp.down_proj.in_features


def test_layer_kinds_vary_within_these_models_and_dense_prefix_reads_them():
    """The negative control: in these configs the layers differ within a model (a plan from one model-wide trait
    would be wrong somewhere), and :func:`dense_prefix` gives TorchTitan's ``n_dense_layers`` only for "dense first,
    MoE after"."""
    plans = {}
    for arch, hf_config in CONFIGS:
        hf_config.architectures = [arch]
        cfg = read_model_config(hf_config)
        plans[arch] = layer_plan(cfg, adapter_for(cfg))
    assert [layer.mlp.routed for layer in plans["Qwen3MoeForCausalLM"]] == [False, True, False, False, False, True]
    assert [layer.mixer.indexer for layer in plans["GlmMoeDsaForCausalLM"]] == ["full", "shared", "full", "shared"]
    assert dense_prefix(plans["DeepseekV3ForCausalLM"]) == 2
    assert dense_prefix(plans["DeepseekV2ForCausalLM"]) == 1
    assert dense_prefix(plans["GlmMoeDsaForCausalLM"]) == 1
    assert dense_prefix(plans["Qwen3ForCausalLM"]) == 2  # every layer dense
    assert dense_prefix(plans["Glm4MoeLiteForCausalLM"]) is None  # dense, sparse, dense, sparse
    assert dense_prefix(plans["Qwen3MoeForCausalLM"]) is None
