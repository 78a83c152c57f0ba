"""Llama 2/3/3.1/3.2/3.3 (``LlamaForCausalLM``): GQA, rotate-half RoPE with optional Llama 3.x frequency scaling
(``rope_scaling.rope_type == "llama3"``), SwiGLU MLP. TorchTitan's llama3 adapter stores q/k rows interleaved.
Sources: HF ``modeling_llama.py`` / ``modeling_rope_utils.py``; vLLM ``models/llama.py``; TorchTitan
``models/llama3``."""
from zerokld_plugins import ModelAdapterSpec

ADAPTER = ModelAdapterSpec(
    architecture="LlamaForCausalLM",
    vllm_model="zerokld_models.llama.vllm:ZeroKLDLlamaForCausalLM",
    titan_config="zerokld_models.llama.titan:titan_config",
    titan_state_dict_adapter="torchtitan.models.llama3.state_dict_adapter:Llama3StateDictAdapter",
    titan_parallelize="torchtitan.models.llama3.parallelize:parallelize_llama",
    interleaved_rope=True,
)
