"""Qwen3-Next (``Qwen3NextForCausalLM``): a hybrid of Gated DeltaNet layers (``layer_types`` ``"linear_attention"``,
three for every attention layer in the released configs) and gated full attention (``"full_attention"``: QK norm,
partial RoPE on a quarter of each head, a sigmoid output gate from ``q_proj``), each with Qwen3-Next's MoE (softmax
top-k and a sigmoid-gated shared expert; dense where ``num_experts`` is 0). Every RMSNorm but the DeltaNet's gated one
is zero-centred (``x̂ (1 + w)``). Sources: HF ``modeling_qwen3_next.py``; vLLM ``models/qwen3_next.py``,
``layers/mamba/gdn/qwen_gdn_linear_attn.py``; TorchTitan ``models/qwen3_5`` (the family's TorchTitan model, which
needs FLA: the trainer refuses the Gated DeltaNet layers until zerokld's own TorchTitan-style model lands)."""

from zerokld_plugins import ModelAdapterSpec

ADAPTER = ModelAdapterSpec(
    architecture="Qwen3NextForCausalLM",
    vllm_base="vllm.model_executor.models.qwen3_next:Qwen3NextForCausalLM",
    titan_model="torchtitan.models.qwen3_5.model:Qwen35Model",
    titan_block="torchtitan.models.qwen3_5.model:Qwen35TransformerBlock",
    titan_state_dict_adapter="torchtitan.models.qwen3_5.state_dict_adapter:Qwen35StateDictAdapter",
    titan_parallelize="torchtitan.models.qwen3_5:parallelize_qwen3_5",
    qk_norm=True,
    moe=True,
    layer_mixers=(("linear_attention", "gated_deltanet"), ("full_attention", "gqa")),
    # HF's Qwen3NextAttention always gates; its norms are Qwen3NextRMSNorm; its MoE block always has the gated
    # shared expert (0 wide: none)
    config_fixed=(("attn_output_gate", True), ("zero_centred_norm", True), ("shared_expert_gate", True)),
)
