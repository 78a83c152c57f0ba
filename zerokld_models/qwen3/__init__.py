"""Qwen3 (``Qwen3ForCausalLM``): GQA with per-head RMSNorm of q and k, rotate-half RoPE, SwiGLU MLP.
Sources: HF ``modeling_qwen3.py``; vLLM ``models/qwen3.py``; TorchTitan ``models/qwen3``."""

from zerokld_plugins import ModelAdapterSpec

ADAPTER = ModelAdapterSpec(
    architecture="Qwen3ForCausalLM",
    vllm_base="vllm.model_executor.models.qwen3:Qwen3ForCausalLM",
    titan_model="torchtitan.models.qwen3.model:Qwen3Model",
    titan_block="torchtitan.models.qwen3.model:Qwen3TransformerBlock",
    titan_state_dict_adapter="torchtitan.models.qwen3.state_dict_adapter:Qwen3StateDictAdapter",
    titan_parallelize="torchtitan.models.qwen3:parallelize_qwen3",
    qk_norm=True,
)
