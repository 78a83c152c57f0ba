"""Qwen3 (``Qwen3ForCausalLM``): GQA with per-head RMSNorm of q and k, rotate-half RoPE, SwiGLU MLP.
Sources: HF ``modeling_qwen3.py``; vLLM ``models/qwen3.py``; TorchTitan ``models/qwen3``."""
from zerokld_plugins import ModelAdapterSpec

ADAPTER = ModelAdapterSpec(
    architecture="Qwen3ForCausalLM",
    vllm_model="zerokld_models.qwen3.vllm:ZeroKLDQwen3ForCausalLM",
    titan_config="zerokld_models.qwen3.titan:titan_config",
    titan_state_dict_adapter="torchtitan.models.qwen3.state_dict_adapter:Qwen3StateDictAdapter",
    titan_parallelize="torchtitan.models.qwen3:parallelize_qwen3",
    qk_norm=True,
)
