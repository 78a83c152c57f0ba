"""The one check of what the zerokld model definitions implement, shared by vLLM (at engine start) and the trainer.

:func:`unsupported_features` lists every feature of a checkpoint's config that the architecture's zerokld
definition does not implement; vLLM adds its engine settings (parallelism, LoRA, quantization) and refuses at start
(:func:`vllm_plugin.models.dense.check_supported`), the trainer refuses when it builds the model
(:func:`titan_plugin.models.titan_model_config`). Nothing is ever silently served or trained with stock numerics.
"""

from __future__ import annotations

from zerokld_plugins.errors import ZeroKLDClientError

from .config import ModelConfig

__all__ = ["UnsupportedModelError", "check_supported", "unsupported_features"]


class UnsupportedModelError(ZeroKLDClientError, ValueError):
    """A checkpoint uses a feature zerokld's definition of its architecture does not implement."""


def unsupported_features(cfg: ModelConfig, adapter) -> list[str]:
    """Human-readable list of the unsupported features of ``cfg`` for ``adapter``
    (:class:`zerokld_plugins.ModelAdapterSpec`); empty when the model is supported."""
    from shared_numerics.rope import YarnScaling

    problems = []
    mla = adapter.attention == "mla"
    if cfg.unsupported_rope:
        problems.append(f"rope_scaling {cfg.unsupported_rope} (supported: none, llama3{', yarn' if mla else ''})")
    if isinstance(cfg.rope_scaling, YarnScaling) and not mla:
        problems.append("rope_scaling yarn (supported on MLA models)")
    if mla and (not cfg.kv_lora_rank or not cfg.qk_rope_head_dim or not cfg.qk_nope_head_dim or not cfg.v_head_dim):
        problems.append("MLA without kv_lora_rank / qk_rope_head_dim / qk_nope_head_dim / v_head_dim")
    if cfg.index_topk is not None:
        problems += _dsa_problems(cfg, mla)
    if cfg.attention_bias and not adapter.qkv_bias:
        problems.append("attention bias")
    if cfg.mlp_bias:
        problems.append("MLP bias")
    if cfg.sliding_window:
        problems.append("sliding-window attention")
    if cfg.partial_rotary_factor != 1.0:
        problems.append(f"partial_rotary_factor {cfg.partial_rotary_factor} (supported: 1, every rope dimension)")
    if cfg.hidden_act != "silu":
        problems.append(f"activation {cfg.hidden_act}")
    if cfg.quant_method not in (None, "zerokld_fp8"):
        problems.append(f"quantization {cfg.quant_method} (zerokld serves its own FP8)")
    if adapter.moe and adapter.moe_routing in DEEPSEEK_ROUTINGS:
        if (cfg.scoring_func, cfg.topk_method) not in DEEPSEEK_ROUTINGS[adapter.moe_routing]:
            problems.append(
                f"DeepSeekMoE routing scoring_func={cfg.scoring_func!r} topk_method={cfg.topk_method!r} "
                f"(supported for {adapter.architecture}: "
                + ", ".join(f"{a} with {b}" for a, b in DEEPSEEK_ROUTINGS[adapter.moe_routing])
                + ")"
            )
        if cfg.moe_layer_freq != 1:
            problems.append(f"moe_layer_freq {cfg.moe_layer_freq}")
        k, n = cfg.first_k_dense_replace, cfg.num_hidden_layers
        if cfg.mlp_layer_types and cfg.mlp_layer_types != ("dense",) * k + ("sparse",) * (n - k):
            problems.append(
                f"mlp_layer_types {list(cfg.mlp_layer_types)} (supported: {n} layers, the dense ones first, then"
                " sparse)"
            )
        stated = cfg.raw.get("first_k_dense_replace")
        if cfg.mlp_layer_types and stated is not None and stated != k:
            problems.append(f"first_k_dense_replace {stated} where mlp_layer_types has {k} dense layers first")
        if not cfg.num_experts or cfg.num_experts % cfg.n_group or not 1 <= cfg.topk_group <= cfg.n_group:
            problems.append(
                f"n_routed_experts {cfg.num_experts} in n_group {cfg.n_group} groups, topk_group {cfg.topk_group}"
            )
    elif adapter.moe:
        if cfg.mlp_only_layers:
            problems.append(f"mlp_only_layers {list(cfg.mlp_only_layers)} (every layer must be MoE)")
        if cfg.decoder_sparse_step != 1:
            problems.append(f"decoder_sparse_step {cfg.decoder_sparse_step}")
        if cfg.shared_expert_intermediate_size:
            problems.append("shared experts")
    return problems


def _dsa_problems(cfg: ModelConfig, mla: bool) -> list[str]:
    """What zerokld's DeepSeek Sparse Attention (:mod:`shared_numerics.dsa`) needs of a config with ``index_topk``."""
    if cfg.index_topk is None:
        return []
    if not mla:
        return ["index_topk (DeepSeek Sparse Attention) on an architecture without MLA"]
    problems = []
    if not cfg.q_lora_rank:
        problems.append("DeepSeek Sparse Attention without q_lora_rank (the indexer reads MLA's q_a_layernorm output)")
    if cfg.index_topk < 1 or cfg.index_n_heads < 1 or not cfg.qk_rope_head_dim < cfg.index_head_dim:
        problems.append(
            f"index_topk {cfg.index_topk}, index_n_heads {cfg.index_n_heads}, index_head_dim {cfg.index_head_dim} "
            f"(needs at least 1 token and 1 head, and qk_rope_head_dim {cfg.qk_rope_head_dim} < index_head_dim)"
        )
    types = cfg.indexer_types
    if len(types) != cfg.num_hidden_layers or set(types) - {"full", "shared"} or (types and types[0] != "full"):
        problems.append(f"indexer_types {list(types)} (one 'full' / 'shared' per layer, the first 'full')")
    return problems


#: the (``scoring_func``, ``topk_method``) pairs each DeepSeekMoE routing trait implements
#: (:func:`shared_numerics.moe.route_grouped_topk`): DeepSeek-V3's and DeepSeek-V2's
DEEPSEEK_ROUTINGS = {
    "grouped_sigmoid": (("sigmoid", "noaux_tc"),),
    "grouped_softmax": (("softmax", "greedy"), ("softmax", "group_limited_greedy")),
}


def check_supported(cfg: ModelConfig, adapter) -> None:
    """Raise :class:`UnsupportedModelError` naming every unsupported feature (see :func:`unsupported_features`)."""
    problems = unsupported_features(cfg, adapter)
    if problems:
        raise UnsupportedModelError(f"zerokld {adapter.architecture} does not support: " + "; ".join(problems))
