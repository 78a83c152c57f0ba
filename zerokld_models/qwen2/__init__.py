"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``): GQA whose q, k and v projections carry a bias (o does not), rotate-half
RoPE, SwiGLU MLP. TorchTitan has no qwen2: the trainer builds TorchTitan's Qwen3 model without QK-norm and with
biased wq/wk/wv, and loads HF weights with the Qwen3 state-dict adapter extended by the three biases.
Sources: HF ``modeling_qwen2.py``; vLLM ``models/qwen2.py``."""
from zerokld_plugins import ModelAdapterSpec

ADAPTER = ModelAdapterSpec(
    architecture="Qwen2ForCausalLM",
    vllm_model="zerokld_models.qwen2.vllm:ZeroKLDQwen2ForCausalLM",
    titan_config="zerokld_models.qwen2.titan:titan_config",
    titan_state_dict_adapter="zerokld_models.qwen2.titan:Qwen2StateDictAdapter",
    titan_parallelize="torchtitan.models.qwen3:parallelize_qwen3",
    qkv_bias=True,
)
