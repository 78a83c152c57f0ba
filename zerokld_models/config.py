"""The one reader of a Hugging Face ``config.json``: vLLM's model classes, TorchTitan's config builders, the trainer
and the support check all read a checkpoint's architecture through :func:`read_model_config`.

It accepts the parsed JSON (a dict), a checkpoint directory, or a ``transformers.PretrainedConfig`` (what vLLM hands a
model: ``vllm_config.model_config.hf_config``), and resolves the places HF versions disagree on:

* the RoPE base: ``rope_theta``, else ``rope_parameters["rope_theta"]`` (transformers >= 4.56 moved it there), else
  10000;
* RoPE scaling: ``rope_scaling``, else ``rope_parameters``; ``rope_type`` (or the older ``type``) ``"default"`` /
  absent = none, ``"llama3"`` = :class:`shared_numerics.rope.RopeScaling`, ``"yarn"`` =
  :class:`shared_numerics.rope.YarnScaling` (the support check admits it for MLA models only); any other type is kept as
  ``unsupported_rope`` for the support check (:mod:`zerokld_models.support`) to refuse;
* ``head_dim``: explicit, else ``hidden_size // num_attention_heads``; MoE expert count: ``num_experts`` or
  ``num_local_experts``;
* the dense layers of a DeepSeekMoE model: ``mlp_layer_types`` (GLM-4.7-Flash's ``"dense"`` / ``"sparse"`` per layer,
  what HF's ``Glm4MoeLite`` reads), else ``first_k_dense_replace`` (DeepSeek's; what vLLM reads for both);
* what an architecture's HF modeling file assumes where its config is silent, or holds whatever the config says (GLM's
  router is always sigmoid scores with a selection bias; GLM-5's MLA always rotates interleaved pairs): the
  architecture folder declares it (``ModelAdapterSpec.config_defaults`` / ``config_fixed``), the reader applies it;
* DeepSeek Sparse Attention (``index_topk`` set: GLM-5, DeepSeek-V3.2): the indexer's sizes, each layer's
  ``indexer_types`` (stated, or HF's ``index_topk_pattern`` / ``index_topk_freq`` schedule), its RoPE layout (GLM-5
  interleaved pairs, DeepSeek-V3.2 halves); both models' MLA rotates interleaved pairs;
* the rotated fraction of the rope dimensions: ``partial_rotary_factor`` (top level or in ``rope_parameters``), 1.

Source: HF ``transformers`` ``PretrainedConfig`` and ``modeling_rope_utils`` (``rope_parameters`` standardisation).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared_numerics.rope import RopeScaling, YarnScaling
from zerokld_plugins import registered
from zerokld_plugins.errors import ZeroKLDClientError

__all__ = [
    "ModelConfig",
    "UnsupportedModelError",
    "indexer_dims",
    "mla_dims",
    "mla_softmax_scale",
    "read_model_config",
    "topk_sources",
]


class UnsupportedModelError(ZeroKLDClientError, ValueError):
    """A checkpoint uses a feature zerokld's definition of its architecture does not implement."""


@dataclass(frozen=True)
class ModelConfig:
    """Everything the zerokld model definitions read from an HF config (names as in HF)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | YarnScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    hidden_act: str = "silu"
    attention_bias: bool = False
    use_qk_norm: bool = False  # GLM-4.5: per-head RMSNorm of q and k when the config says so
    mlp_bias: bool = False
    sliding_window: bool = False  # sliding-window attention actually in use
    unsupported_rope: str | None = None  # a rope_scaling type zerokld does not implement
    quant_method: str | None = None
    # Qwen3-MoE
    num_experts: int | None = None
    num_experts_per_tok: int | None = None
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = True
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False  # Qwen3-Next: the shared expert's output times sigmoid(shared_expert_gate(x))
    # RMSNorm gains stored centred on zero: the norm multiplies by 1 + w (Qwen3-Next's Qwen3NextRMSNorm)
    zero_centred_norm: bool = False
    # gated attention: q_proj gives each head's query and an output gate, o * sigmoid(gate) (Qwen3-Next, Qwen3.5)
    attn_output_gate: bool = False
    # DeepSeek-V2/V3 family: multi-head latent attention (MLA) and DeepSeekMoE
    q_lora_rank: int | None = None  # None: q is one projection (q_proj), as DeepSeek-V2-Lite
    kv_lora_rank: int | None = None  # set: the model uses MLA
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # the rope part's dimensions are stored interleaved (pairs 2i, 2i+1)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    mlp_layer_types: tuple[str, ...] = ()  # GLM-4.7-Flash: "dense" / "sparse" per layer (empty: not in the config)
    moe_layer_freq: int = 1
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    partial_rotary_factor: float = 1.0
    # DeepSeek Sparse Attention (DSA: GLM-5, DeepSeek-V3.2): the lightning indexer (shared_numerics.dsa)
    index_topk: int | None = None  # set: MLA over each query's index_topk selected tokens
    index_n_heads: int = 0
    index_head_dim: int = 0
    indexer_types: tuple[str, ...] = ()  # per layer: "full" runs the indexer, "shared" reuses the previous full one's
    index_rope_interleave: bool = False  # the indexer's rotated dimensions stored as pairs (GLM-5), not halves
    # per-layer token mixers: HF's layer_types (Qwen3-Next / Qwen3.5: "linear_attention" / "full_attention")
    layer_types: tuple[str, ...] = ()
    # Gated DeltaNet (Qwen3-Next, Qwen3.5): its heads, head sizes and causal conv1d kernel
    linear_num_key_heads: int = 0
    linear_key_head_dim: int = 0
    linear_num_value_heads: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    raw: dict = field(default_factory=dict, compare=False, repr=False)


def _as_dict(src: Any) -> dict:
    if isinstance(src, dict):
        return src
    if isinstance(src, (str, Path)):
        return json.loads((Path(src) / "config.json").read_text())
    if hasattr(src, "to_dict"):
        d = src.to_dict()
        for key in ("rope_theta", "rope_scaling", "rope_parameters", "head_dim"):  # attributes to_dict may drop
            if key not in d and getattr(src, key, None) is not None:
                d[key] = getattr(src, key)
        return d
    raise TypeError(
        f"read_model_config needs a config dict, a checkpoint directory or a PretrainedConfig, got {type(src).__name__}"
    )


def _rope(d: dict) -> tuple[float, RopeScaling | YarnScaling | None, str | None]:
    params = d.get("rope_parameters") or {}
    theta = d.get("rope_theta")
    if theta is None:
        theta = params.get("rope_theta", 10000.0)
    scaling = d.get("rope_scaling") or params or {}
    kind = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    if kind == "default":
        return float(theta), None, None
    if kind == "llama3":
        return (
            float(theta),
            RopeScaling(
                float(scaling["factor"]),
                float(scaling["low_freq_factor"]),
                float(scaling["high_freq_factor"]),
                int(scaling["original_max_position_embeddings"]),
            ),
            None,
        )
    if kind == "yarn" and scaling.get("factor") and scaling.get("original_max_position_embeddings"):

        def opt(key):
            return None if scaling.get(key) is None else float(scaling[key])

        return (
            float(theta),
            YarnScaling(
                float(scaling["factor"]),
                int(scaling["original_max_position_embeddings"]),
                float(scaling.get("beta_fast") or 32),
                float(scaling.get("beta_slow") or 1),
                opt("mscale"),
                opt("mscale_all_dim"),
                opt("attention_factor"),
                bool(scaling.get("truncate", True)),
            ),
            None,
        )
    return float(theta), None, f"{kind} {dict(scaling)}"


def _indexer_types(d: dict) -> tuple[str, ...]:
    """Each layer's indexer mode (HF ``GlmMoeDsaConfig.indexer_types``): stated, else from ``index_topk_pattern``
    (``"F"`` / ``"S"`` per layer), else from ``index_topk_freq`` / ``index_skip_topk_offset`` (HF's defaults 1 and 2:
    every layer ``"full"``)."""
    if d.get("indexer_types"):
        return tuple(d["indexer_types"])
    n = d["num_hidden_layers"]
    pattern = d.get("index_topk_pattern")
    if pattern is not None:
        return tuple({"F": "full", "S": "shared"}.get(c, c) for c in pattern)
    freq = max(d.get("index_topk_freq") or 1, 1)
    offset = d.get("index_skip_topk_offset", 2)
    return tuple("full" if (max(i - offset + 1, 0) % freq) == 0 else "shared" for i in range(n))


def read_model_config(src: Any) -> ModelConfig:
    """Parse an HF model config (dict, checkpoint directory, or ``PretrainedConfig``).

    Raises:
        TypeError: ``src`` is none of those; KeyError: a required field (``hidden_size``, ...) is missing.
    """
    raw = _as_dict(src)
    adapter = _declared((raw.get("architectures") or [""])[0])
    d = raw if adapter is None else {**raw, **{k: v for k, v in adapter.config_defaults if raw.get(k) is None}}
    nq = d["num_attention_heads"]
    theta, scaling, unsupported = _rope(d)
    window = d.get("sliding_window")
    quant = d.get("quantization_config") or {}
    layer_types = tuple(d.get("mlp_layer_types") or ())
    if layer_types:  # HF's Glm4MoeLite builds layer i's MLP from mlp_layer_types[i]: the leading dense ones count
        first_dense = next((i for i, t in enumerate(layer_types) if t != "dense"), len(layer_types))
    else:
        first_dense = d.get("first_k_dense_replace") or 0
    # transformers keeps it in rope_parameters (and at the top level, where older configs have it only)
    rotary = (d.get("rope_parameters") or {}).get("partial_rotary_factor") or d.get("partial_rotary_factor") or 1.0
    cfg = ModelConfig(
        architecture=(d.get("architectures") or [""])[0],
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        intermediate_size=d.get("intermediate_size", 0),
        num_hidden_layers=d["num_hidden_layers"],
        num_attention_heads=nq,
        num_key_value_heads=d.get("num_key_value_heads") or nq,
        head_dim=d.get("head_dim") or d["hidden_size"] // nq,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        unsupported_rope=unsupported,
        max_position_embeddings=d.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        hidden_act=d.get("hidden_act", "silu"),
        attention_bias=bool(d.get("attention_bias", False)),
        use_qk_norm=bool(d.get("use_qk_norm", False)),
        mlp_bias=bool(d.get("mlp_bias", False)),
        sliding_window=bool(window) and bool(d.get("use_sliding_window", True)),
        quant_method=quant.get("quant_method"),
        num_experts=d.get("num_experts") or d.get("num_local_experts") or d.get("n_routed_experts"),
        num_experts_per_tok=d.get("num_experts_per_tok"),
        moe_intermediate_size=d.get("moe_intermediate_size"),
        norm_topk_prob=bool(d.get("norm_topk_prob", True)),
        mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
        decoder_sparse_step=d.get("decoder_sparse_step", 1) or 1,
        shared_expert_intermediate_size=d.get("shared_expert_intermediate_size") or 0,
        attn_output_gate=bool(d.get("attn_output_gate", False)),
        q_lora_rank=d.get("q_lora_rank"),
        kv_lora_rank=d.get("kv_lora_rank"),
        qk_nope_head_dim=d.get("qk_nope_head_dim") or 0,
        qk_rope_head_dim=d.get("qk_rope_head_dim") or 0,
        v_head_dim=d.get("v_head_dim") or 0,
        rope_interleave=bool(d.get("rope_interleave", False)),
        # DeepSeek-V2's "greedy" top-k ignores n_group / topk_group: one group of every expert
        n_group=1 if d.get("topk_method") == "greedy" else d.get("n_group") or 1,
        topk_group=1 if d.get("topk_method") == "greedy" else d.get("topk_group") or 1,
        routed_scaling_factor=float(d.get("routed_scaling_factor") or 1.0),
        n_shared_experts=d.get("n_shared_experts") or 0,
        first_k_dense_replace=first_dense,
        mlp_layer_types=layer_types,
        moe_layer_freq=d.get("moe_layer_freq") or 1,
        scoring_func=d.get("scoring_func") or "softmax",
        topk_method=d.get("topk_method") or "greedy",
        partial_rotary_factor=float(rotary),
        index_topk=d.get("index_topk"),
        index_n_heads=d.get("index_n_heads") or 0,
        index_head_dim=d.get("index_head_dim") or 0,
        indexer_types=_indexer_types(d) if d.get("index_topk") else (),
        layer_types=tuple(d.get("layer_types") or ()),
        linear_num_key_heads=d.get("linear_num_key_heads") or 0,
        linear_key_head_dim=d.get("linear_key_head_dim") or 0,
        linear_num_value_heads=d.get("linear_num_value_heads") or 0,
        linear_value_head_dim=d.get("linear_value_head_dim") or 0,
        linear_conv_kernel_dim=d.get("linear_conv_kernel_dim") or 0,
        raw=raw,
    )
    return cfg if adapter is None else dataclasses.replace(cfg, **dict(adapter.config_fixed))


def _declared(architecture: str):
    """The registered declaration of ``architecture`` (:class:`zerokld_plugins.ModelAdapterSpec`), else ``None``."""
    reg = registered("model").get(architecture)
    return None if reg is None else reg.spec


def mla_dims(cfg: ModelConfig):
    """The :class:`shared_numerics.mla.MLADims` of an MLA checkpoint's config.

    Raises:
        ValueError: ``cfg`` is not an MLA config (no ``kv_lora_rank``)."""
    from shared_numerics.mla import MLADims

    if cfg.kv_lora_rank is None:
        raise ValueError(f"{cfg.architecture} has no kv_lora_rank: not a multi-head latent attention model")

    return MLADims(
        cfg.num_attention_heads,
        cfg.kv_lora_rank,
        cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim,
        cfg.v_head_dim,
        cfg.rope_interleave,
        cfg.rms_norm_eps,
    )


def mla_softmax_scale(cfg: ModelConfig) -> float:
    """MLA's softmax scale: ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``, with DeepSeek's YaRN correction
    (:meth:`shared_numerics.rope.YarnScaling.softmax_scale`) when the checkpoint has YaRN."""
    d = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    return cfg.rope_scaling.softmax_scale(d) if isinstance(cfg.rope_scaling, YarnScaling) else d**-0.5


def indexer_dims(cfg: ModelConfig):
    """The :class:`shared_numerics.dsa.IndexerDims` of a DSA checkpoint's config (``index_topk`` set), else ``None``."""
    from shared_numerics.dsa import IndexerDims

    if not cfg.index_topk:
        return None
    return IndexerDims(
        cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim, cfg.index_topk, cfg.index_rope_interleave
    )


def topk_sources(cfg: ModelConfig) -> tuple[int, ...]:
    """Each DSA layer's selection source: its own index for a ``"full"`` layer, the nearest earlier full layer's for
    a ``"shared"`` one (HF ``GlmMoeDsaModel`` passes the previous full layer's top-k on); ``()`` without DSA."""
    out: list[int] = []
    for i, kind in enumerate(cfg.indexer_types):
        out.append(i if kind == "full" or not out else out[-1])
    return tuple(out)
