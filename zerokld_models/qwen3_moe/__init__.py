"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3 attention, a routed MoE block (softmax router, top-k, no shared
expert) in every layer. Sources: HF ``modeling_qwen3_moe.py``; vLLM ``models/qwen3_moe.py``; TorchTitan
``models/qwen3`` (MoE flavours)."""

from zerokld_plugins import ModelAdapterSpec

ADAPTER = ModelAdapterSpec(
    architecture="Qwen3MoeForCausalLM",
    vllm_base="vllm.model_executor.models.qwen3_moe:Qwen3MoeForCausalLM",
    titan_model="torchtitan.models.qwen3.model:Qwen3Model",
    titan_block="torchtitan.models.qwen3.model:Qwen3TransformerBlock",
    titan_state_dict_adapter="torchtitan.models.qwen3.state_dict_adapter:Qwen3StateDictAdapter",
    titan_parallelize="torchtitan.models.qwen3:parallelize_qwen3",
    qk_norm=True,
    moe=True,
)
