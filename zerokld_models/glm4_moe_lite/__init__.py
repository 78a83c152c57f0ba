"""GLM-4.7-Flash (``Glm4MoeLiteForCausalLM``): DeepSeek-V3's multi-head latent attention (``q_lora_rank``, a latent of
``kv_lora_rank + qk_rope_head_dim`` per token, the rope part stored interleaved, ``v_head_dim`` wider than
``qk_nope_head_dim``) and GLM's DeepSeekMoE (``Glm4MoeTopkRouter``: float32 sigmoid scores, a selection bias,
group-limited top-k, normalised weights times ``routed_scaling_factor``; shared experts), the layers'
dense / sparse MLPs named by ``mlp_layer_types`` (the dense ones first). The same layers as
``zerokld_models/deepseek_v3`` on every side: vLLM's ``glm4_moe_lite.py`` (which builds on ``deepseek_v2.py``'s MLA and
``glm4_moe.py``'s MoE) with the switch off, zerokld's MLA decoder with it on; TorchTitan's ``deepseek_v3`` model trains
it. Sources: HF ``modeling_glm4_moe_lite.py``; vLLM ``models/glm4_moe_lite.py``; TorchTitan ``models/deepseek_v3``."""

import dataclasses

from .. import deepseek_v3

ADAPTER = dataclasses.replace(
    deepseek_v3.ADAPTER,  # the same TorchTitan model, state-dict adapter (HF names) and parallelize
    architecture="Glm4MoeLiteForCausalLM",
    vllm_base="vllm.model_executor.models.glm4_moe_lite:Glm4MoeLiteForCausalLM",
    config_defaults=(("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")),  # HF's Glm4MoeTopkRouter
)
