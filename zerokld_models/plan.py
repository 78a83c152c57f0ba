"""A model as a per-layer plan: each decoder layer is a token mixer and an MLP, named in the field's terms, so that
"dense first, MoE after", "3 Gated DeltaNet : 1 attention" or "sliding / full alternating" are data that every host
reads, not code paths.

:func:`layer_plan` is the one place a checkpoint's per-layer structure is decided: it asks the components the
architecture declares (:mod:`zerokld_models.mixers`, :mod:`zerokld_models.mlps`), which read the HF config as HF's
decoder layers do (``Qwen3MoeDecoderLayer``: ``mlp_only_layers`` and ``decoder_sparse_step``;
``DeepseekV2DecoderLayer`` / ``DeepseekV3DecoderLayer``: ``first_k_dense_replace``; ``Glm4MoeLiteDecoderLayer``,
``GlmMoeDsaDecoderLayer``, ``DeepseekV32DecoderLayer``: ``mlp_layer_types``; DSA's ``indexer_types``) through the
architecture's declaration (:class:`zerokld_plugins.ModelAdapterSpec`). A plan says what a layer *is*; whether
zerokld implements that layer is the support check's answer (:mod:`zerokld_models.support`).

A token mixer declares its cache: ``"paged_kv"`` (per-token K and V of each KV head: grouped-query attention),
``"latent"`` (one per-token latent row: MLA, and DSA's indexer key beside it) or ``"recurrent"`` (a fixed per-sequence
state, for Gated DeltaNet and Mamba-2 layers), and the shapes of what it keeps (per token, or per sequence for a
recurrent state).

Sources: HF ``transformers`` ``modeling_qwen3_moe.py``, ``modeling_deepseek_v3.py``, ``modeling_deepseek_v2.py``,
``modeling_glm4_moe_lite.py``, ``modeling_glm_moe_dsa.py``, ``modeling_deepseek_v32.py`` (each decoder layer's
``__init__``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from .config import ModelConfig
from .mixers import CACHE_KINDS, MIXER_KINDS, TokenMixer, layer_mixer
from .mlps import MLP, MLP_KINDS, MLPS, routed_component

__all__ = [
    "CACHE_KINDS",
    "MLP",
    "MLP_KINDS",
    "MIXER_KINDS",
    "Layer",
    "TokenMixer",
    "dense_prefix",
    "latent_cache",
    "layer_plan",
]


@dataclass(frozen=True)
class Layer:
    """Decoder layer ``index``: ``h = h + mixer(norm(h)); h = h + mlp(norm(h))``."""

    index: int
    mixer: TokenMixer
    mlp: MLP


@functools.lru_cache(maxsize=64)
def layer_plan(cfg: ModelConfig, adapter) -> tuple[Layer, ...]:
    """Every decoder layer of ``cfg`` as its token mixer and MLP, in order (``cfg.num_hidden_layers`` of them); one
    plan per ``(cfg, adapter)`` in a process (both frozen: the engine's start checks, its model and the trainer's
    builder read the same tuple).

    Args:
        cfg: the checkpoint's config (:func:`zerokld_models.read_model_config`).
        adapter: its architecture's :class:`zerokld_plugins.ModelAdapterSpec` (``attention`` or ``layer_mixers``,
            ``moe``, ``moe_routing``, ``qk_norm``, ``qkv_bias``).

    Raises:
        UnsupportedModelError: a hybrid's ``layer_types`` does not give every layer a declared mixer
            (:func:`zerokld_models.mixers.layer_mixer`).
    """
    routed = routed_component(adapter) if adapter.moe and cfg.num_experts else None
    return tuple(
        Layer(
            i,
            layer_mixer(cfg, adapter, i).layer(cfg, adapter, i),
            (routed if routed is not None and routed.routed_at(cfg, i) else MLPS["swiglu"]).layer(cfg, adapter),
        )
        for i in range(cfg.num_hidden_layers)
    )


def latent_cache(plan: tuple[Layer, ...]) -> bool:
    """Whether any layer's token mixer keeps a ``"latent"`` cache (MLA, DSA): the question vLLM-CPU's MLA scheduling
    and TorchTitan's model choice ask."""
    return any(layer.mixer.cache == "latent" for layer in plan)


def dense_prefix(plan: tuple[Layer, ...]) -> int | None:
    """How many layers lead with the dense MLP when every later one is routed ("dense first, MoE after": the layout
    TorchTitan's ``build_mla_moe_layers`` builds, ``n_dense_layers``); ``None`` for any other layout."""
    k = next((layer.index for layer in plan if layer.mlp.routed), len(plan))
    return k if all(layer.mlp.routed for layer in plan[k:]) else None
