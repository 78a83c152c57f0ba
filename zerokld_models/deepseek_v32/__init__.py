"""DeepSeek-V3.2 (``DeepseekV32ForCausalLM``): DeepSeek-V3's layers (``zerokld_models/deepseek_v3``: MLA, DeepSeekMoE
with sigmoid scores and the selection bias) with DeepSeek Sparse Attention in every layer — the lightning indexer of
``zerokld_models/glm_moe_dsa`` (:mod:`shared_numerics.dsa`) whose RoPE rotates the two halves of its first
``qk_rope_head_dim`` dimensions (GLM-5's rotates interleaved pairs). vLLM's ``DeepseekV32ForCausalLM`` (on CPU its
generic ``deepseek_v2`` class; stock vLLM-CPU refuses DSA) with the switch on, TorchTitan's ``deepseek_v3`` with the
indexer (:class:`titan_plugin.overrides.ZeroKLDDSAAttention`). Sources: HF ``modeling_deepseek_v32.py``; vLLM
``models/deepseek_v32``; DeepSeek-AI, "DeepSeek-V3.2" (2025)."""

import dataclasses

from .. import glm_moe_dsa

ADAPTER = dataclasses.replace(
    glm_moe_dsa.ADAPTER,
    architecture="DeepseekV32ForCausalLM",
    vllm_base="vllm.models.deepseek_v32:DeepseekV32ForCausalLM",
    config_defaults=(("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")),  # HF's DeepseekV32TopkRouter
    # HF's DeepseekV32Attention rotates MLA's rope part as interleaved pairs, its indexer's as halves
    config_fixed=(("rope_interleave", True), ("index_rope_interleave", False)),
)
