"""Llama 2/3/3.1/3.2/3.3 (``LlamaForCausalLM``): GQA, rotate-half RoPE with optional Llama 3.x frequency scaling
(``rope_scaling.rope_type == "llama3"``), SwiGLU MLP. TorchTitan's llama3 model uses its interleaved ``ComplexRoPE``
(its adapter stores q/k rows interleaved) and derives the head size (``hidden_size / num_attention_heads``).
Sources: HF ``modeling_llama.py`` / ``modeling_rope_utils.py``; vLLM ``models/llama.py``; TorchTitan
``models/llama3``."""

from zerokld_plugins import ModelAdapterSpec

ADAPTER = ModelAdapterSpec(
    architecture="LlamaForCausalLM",
    vllm_base="vllm.model_executor.models.llama:LlamaForCausalLM",
    titan_model="torchtitan.models.llama3.model:Llama3Model",
    titan_block="torchtitan.models.llama3.model:Llama3TransformerBlock",
    titan_state_dict_adapter="torchtitan.models.llama3.state_dict_adapter:Llama3StateDictAdapter",
    titan_parallelize="torchtitan.models.llama3.parallelize:parallelize_llama",
    rope="complex",
    interleaved_rope=True,
    derived_head_dim=True,
)
