"""DeepSeek-V2 (``DeepseekV2ForCausalLM``; DeepSeek-V2-Lite, DeepSeek-Coder-V2): DeepSeek-V3's multi-head latent
attention (``q_lora_rank`` null in V2-Lite: one ``q_proj``; the rope part applied as interleaved pairs; YaRN with
``mscale`` / ``mscale_all_dim``) and DeepSeekMoE with softmax scores: ``topk_method`` ``"greedy"`` (top-k over every
expert) or ``"group_limited_greedy"`` (a group scores its best expert; top ``topk_group`` groups, then top-k), no
selection bias, weights times ``routed_scaling_factor`` (normalised only with ``norm_topk_prob``), shared experts,
the first ``first_k_dense_replace`` layers dense. The same layers as ``zerokld_models/deepseek_v3`` on every side
(vLLM's ``deepseek_v2.py`` serves both; TorchTitan's ``deepseek_v3`` model with a softmax router trains it); only the
routing trait differs. Sources: HF ``modeling_deepseek_v2.py``; vLLM ``models/deepseek_v2.py``; TorchTitan
``models/deepseek_v3``."""

import dataclasses

from .. import deepseek_v3

ADAPTER = dataclasses.replace(
    deepseek_v3.ADAPTER,  # the same vLLM file, TorchTitan model, state-dict adapter and parallelize
    architecture="DeepseekV2ForCausalLM",
    vllm_base="vllm.model_executor.models.deepseek_v2:DeepseekV2ForCausalLM",
    moe_routing="grouped_softmax",
    config_defaults=(("rope_interleave", True),),  # HF's DeepSeek-V2 applies its rope part as interleaved pairs
)
