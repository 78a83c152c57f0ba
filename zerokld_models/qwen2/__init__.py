"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``): GQA whose q, k and v projections carry a bias (o does not), rotate-half
RoPE, SwiGLU MLP. TorchTitan has no qwen2: the trainer builds TorchTitan's Qwen3 model without QK-norm and with
biased wq/wk/wv, and loads HF weights with the Qwen3 state-dict adapter extended by the three biases.
Sources: HF ``modeling_qwen2.py``; vLLM ``models/qwen2.py``."""

from zerokld_plugins import ModelAdapterSpec

ADAPTER = ModelAdapterSpec(
    architecture="Qwen2ForCausalLM",
    vllm_base="vllm.model_executor.models.qwen2:Qwen2ForCausalLM",
    titan_model="torchtitan.models.qwen3.model:Qwen3Model",
    titan_block="torchtitan.models.qwen3.model:Qwen3TransformerBlock",
    titan_state_dict_adapter="torchtitan.models.qwen3.state_dict_adapter:Qwen3StateDictAdapter",
    titan_parallelize="torchtitan.models.qwen3:parallelize_qwen3",
    extra_hf_names=tuple(
        (f"model.layers.{{}}.self_attn.{hf}_proj.bias", f"layers.{{}}.attention.qkv_linear.{tt}.bias")
        for hf, tt in (("q", "wq"), ("k", "wk"), ("v", "wv"))
    ),
    qkv_bias=True,
)
