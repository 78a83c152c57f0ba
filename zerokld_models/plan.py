"""A model as a per-layer plan: each decoder layer is a token mixer and an MLP, named in the field's terms, so that
"dense first, MoE after", "3 Gated DeltaNet : 1 attention" or "sliding / full alternating" are data that every host
reads, not code paths.

:func:`layer_plan` is the one place a checkpoint's per-layer structure is decided: it reads the HF config as HF's
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

from dataclasses import dataclass

from .config import ModelConfig

__all__ = ["CACHE_KINDS", "MLP", "MLP_KINDS", "MIXER_KINDS", "Layer", "TokenMixer", "dense_prefix", "layer_plan"]

#: token mixers: grouped-query attention, multi-head latent attention, DeepSeek Sparse Attention (MLA over each
#: query's selected tokens); the recurrent ones are the room Gated DeltaNet and Mamba-2 take
MIXER_KINDS = ("gqa", "mla", "dsa")
#: what a token mixer keeps between steps
CACHE_KINDS = ("paged_kv", "latent", "recurrent")
#: MLPs: the dense SwiGLU MLP, a softmax top-k routed MoE (Qwen3-MoE), DeepSeekMoE (group-limited routing, shared
#: experts)
MLP_KINDS = ("swiglu", "moe", "deepseek_moe")


@dataclass(frozen=True)
class TokenMixer:
    """A layer's token mixer.

    Attributes:
        kind: one of :data:`MIXER_KINDS`.
        cache: one of :data:`CACHE_KINDS`.
        state: ``(name, shape)`` of what the cache keeps per token (``paged_kv``: ``k`` and ``v``, ``[kv_heads,
            head_dim]`` each; ``latent``: ``latent`` ``[kv_lora_rank + qk_rope_head_dim]``, DSA's ``indexer_key``
            ``[index_head_dim]`` on its "full" layers) or per sequence (``recurrent``).
        qk_norm: per-head RMSNorm of q and k (Qwen3). qkv_bias: q/k/v projections with bias (Qwen2).
        partial_rotary_factor: the fraction of the rope dimensions rotated.
        indexer: DSA only: ``"full"`` (the layer runs its lightning indexer) or ``"shared"`` (reuses the previous
            full layer's selection).
    """

    kind: str
    cache: str
    state: tuple[tuple[str, tuple[int, ...]], ...]
    qk_norm: bool = False
    qkv_bias: bool = False
    partial_rotary_factor: float = 1.0
    indexer: str | None = None

    def __post_init__(self):
        if self.kind not in MIXER_KINDS or self.cache not in CACHE_KINDS:
            raise ValueError(f"token mixer {self.kind!r} with cache {self.cache!r}: not one of {MIXER_KINDS}")


@dataclass(frozen=True)
class MLP:
    """A layer's MLP.

    Attributes:
        kind: one of :data:`MLP_KINDS`.
        intermediate_size: the dense MLP's, or each routed expert's.
        num_experts, top_k: the routed experts and how many each token takes (0 for ``swiglu``).
        routing: the MoE's router (``zerokld_plugins.specs.MOE_ROUTINGS``), ``None`` for ``swiglu``.
        shared_experts: DeepSeekMoE's always-on experts.
    """

    kind: str
    intermediate_size: int
    num_experts: int = 0
    top_k: int = 0
    routing: str | None = None
    shared_experts: int = 0

    def __post_init__(self):
        if self.kind not in MLP_KINDS:
            raise ValueError(f"MLP {self.kind!r}: not one of {MLP_KINDS}")

    @property
    def routed(self) -> bool:
        return self.kind != "swiglu"


@dataclass(frozen=True)
class Layer:
    """Decoder layer ``index``: ``h = h + mixer(norm(h)); h = h + mlp(norm(h))``."""

    index: int
    mixer: TokenMixer
    mlp: MLP


def _mixer(cfg: ModelConfig, adapter, i: int) -> TokenMixer:
    if adapter.attention == "mla":
        latent = (("latent", (int(cfg.kv_lora_rank or 0) + cfg.qk_rope_head_dim,)),)
        if cfg.index_topk is None:
            return TokenMixer("mla", "latent", latent)
        indexer = cfg.indexer_types[i] if i < len(cfg.indexer_types) else "full"
        key = (("indexer_key", (cfg.index_head_dim,)),) if indexer == "full" else ()  # a shared layer has no indexer
        return TokenMixer("dsa", "latent", latent + key, indexer=indexer)
    kv = (cfg.num_key_value_heads, cfg.head_dim)
    return TokenMixer(
        "gqa",
        "paged_kv",
        (("k", kv), ("v", kv)),
        qk_norm=adapter.qk_norm,
        qkv_bias=adapter.qkv_bias or cfg.attention_bias,
        partial_rotary_factor=cfg.partial_rotary_factor,
    )


def _routed(cfg: ModelConfig, adapter, i: int) -> bool:
    """Whether HF's decoder layer ``i`` of this config builds its routed MLP."""
    if not adapter.moe or not cfg.num_experts:
        return False
    if adapter.moe_routing == "softmax":  # Qwen3MoeDecoderLayer
        return i not in cfg.mlp_only_layers and (i + 1) % cfg.decoder_sparse_step == 0
    if cfg.mlp_layer_types:  # Glm4MoeLiteDecoderLayer, GlmMoeDsaDecoderLayer, DeepseekV32DecoderLayer
        return i < len(cfg.mlp_layer_types) and cfg.mlp_layer_types[i] == "sparse"
    return i >= cfg.first_k_dense_replace  # DeepseekV2/V3DecoderLayer (vLLM also reads moe_layer_freq: support.py)


def _mlp(cfg: ModelConfig, adapter, i: int) -> MLP:
    if not _routed(cfg, adapter, i):
        return MLP("swiglu", cfg.intermediate_size)
    deepseek = adapter.moe_routing != "softmax"
    return MLP(
        "deepseek_moe" if deepseek else "moe",
        int(cfg.moe_intermediate_size or cfg.intermediate_size),
        int(cfg.num_experts or 0),
        int(cfg.num_experts_per_tok or 0),
        adapter.moe_routing,
        cfg.n_shared_experts if deepseek else 0,
    )


def layer_plan(cfg: ModelConfig, adapter) -> tuple[Layer, ...]:
    """Every decoder layer of ``cfg`` as its token mixer and MLP, in order (``cfg.num_hidden_layers`` of them).

    Args:
        cfg: the checkpoint's config (:func:`zerokld_models.read_model_config`).
        adapter: its architecture's :class:`zerokld_plugins.ModelAdapterSpec` (``attention``, ``moe``,
            ``moe_routing``, ``qk_norm``, ``qkv_bias``).
    """
    return tuple(Layer(i, _mixer(cfg, adapter, i), _mlp(cfg, adapter, i)) for i in range(cfg.num_hidden_layers))


def dense_prefix(plan: tuple[Layer, ...]) -> int | None:
    """How many layers lead with the dense MLP when every later one is routed ("dense first, MoE after": the layout
    TorchTitan's ``build_mla_moe_layers`` builds, ``n_dense_layers``); ``None`` for any other layout."""
    k = next((layer.index for layer in plan if layer.mlp.routed), len(plan))
    return k if all(layer.mlp.routed for layer in plan[k:]) else None
