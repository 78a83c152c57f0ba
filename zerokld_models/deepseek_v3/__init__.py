"""DeepSeek-V3 (``DeepseekV3ForCausalLM``; Kimi K2 shares its layers): multi-head latent attention
(low-rank q — or one ``q_proj`` without ``q_lora_rank`` —, a latent KV of ``kv_lora_rank + qk_rope_head_dim`` per
token, a decoupled rope part stored interleaved, YaRN with ``mscale`` / ``mscale_all_dim``) and DeepSeekMoE (float32
sigmoid router with a selection bias, group-limited top-k, normalised weights times ``routed_scaling_factor``, shared
experts, the first ``first_k_dense_replace`` layers dense). Sources: HF ``modeling_deepseek_v3.py``; vLLM
``models/deepseek_v2.py``; TorchTitan ``models/deepseek_v3``."""

from zerokld_plugins import ModelAdapterSpec

ADAPTER = ModelAdapterSpec(
    architecture="DeepseekV3ForCausalLM",
    vllm_base="vllm.model_executor.models.deepseek_v2:DeepseekV3ForCausalLM",
    titan_model="torchtitan.models.deepseek_v3.model:DeepSeekV3Model",
    titan_block="torchtitan.models.deepseek_v3.model:DeepSeekV3TransformerBlock",
    titan_state_dict_adapter="torchtitan.models.deepseek_v3.state_dict_adapter:DeepSeekV3StateDictAdapter",
    titan_parallelize="torchtitan.models.deepseek_v3.parallelize:parallelize_deepseekv3",
    moe=True,
    attention="mla",
    moe_routing="grouped_sigmoid",
)
