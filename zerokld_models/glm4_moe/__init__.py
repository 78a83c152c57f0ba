"""GLM-4.5 / 4.6 / 4.7 (``Glm4MoeForCausalLM``): grouped-query attention with partial RoPE (rotate-half on the first
``head_dim * partial_rotary_factor`` dimensions of each head, 0.5 unless the config says otherwise), per-head QK
RMSNorm when ``use_qk_norm``, q/k/v biases when ``attention_bias`` (``o_proj`` never), and GLM's DeepSeekMoE
(``Glm4MoeTopkRouter``: float32 sigmoid scores, a selection bias, group-limited top-k, normalised weights times
``routed_scaling_factor``; shared experts) after ``first_k_dense_replace`` dense layers. Components: the plan's
``gqa`` and ``swiglu`` / ``deepseek_moe`` (:mod:`zerokld_models.mixers`, :mod:`zerokld_models.mlps`). TorchTitan has
no GLM-4.5: the trainer composes TorchTitan's Qwen3 blocks with TorchTitan's DeepSeekMoE and partial RoPE
(:class:`titan_plugin.rope.PartialCosSinRoPE`), and loads HF weights with the Qwen3 state-dict adapter extended by
the biases, shared experts and selection biases. Sources: HF ``modeling_glm4_moe.py``; vLLM ``models/glm4_moe.py``.
"""

from zerokld_plugins import ModelAdapterSpec

ADAPTER = ModelAdapterSpec(
    architecture="Glm4MoeForCausalLM",
    vllm_base="vllm.model_executor.models.glm4_moe:Glm4MoeForCausalLM",
    titan_model="torchtitan.models.qwen3.model:Qwen3Model",
    titan_block="torchtitan.models.qwen3.model:Qwen3TransformerBlock",
    titan_state_dict_adapter="torchtitan.models.qwen3.state_dict_adapter:Qwen3StateDictAdapter",
    titan_parallelize="torchtitan.models.qwen3:parallelize_qwen3",
    extra_hf_names=(
        *(
            (f"model.layers.{{}}.self_attn.{hf}_proj.bias", f"layers.{{}}.attention.qkv_linear.{tt}.bias")
            for hf, tt in (("q", "wq"), ("k", "wk"), ("v", "wv"))
        ),
        *(
            (f"model.layers.{{}}.mlp.shared_experts.{hf}_proj.weight", f"layers.{{}}.moe.shared_experts.{tt}.weight")
            for hf, tt in (("gate", "w1"), ("up", "w3"), ("down", "w2"))
        ),
        ("model.layers.{}.mlp.gate.e_score_correction_bias", "layers.{}.moe.expert_bias_E"),
    ),
    qkv_bias_from_config=True,
    moe=True,
    moe_routing="grouped_sigmoid",
    # HF's Glm4MoeTopkRouter (sigmoid scores with the selection bias); HF's and vLLM's default rotary fraction
    config_defaults=(("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("partial_rotary_factor", 0.5)),
)
