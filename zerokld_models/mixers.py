"""Token mixers, each a component with its host-free spec: the layer it makes of an HF config (:class:`TokenMixer`:
its cache kind and the shapes of what the cache keeps), the config fields it reads, why it refuses a config
(:meth:`GQA.problems`), how tensor parallelism splits it (:meth:`GQA.tp_split`) and whether the trainer runs it
under context parallelism. The hosts ask these questions of the component of each layer
(:attr:`TokenMixer.component`), never of an architecture or mixer name.

* :class:`GQA` — grouped-query attention over per-head K/V (``"paged_kv"`` cache), with its options: per-head QK
  RMSNorm (Qwen3), q/k/v bias (Qwen2), the rotated fraction of each head. HF ``modeling_llama.py``,
  ``modeling_qwen3.py``; vLLM ``models/llama.py``, ``models/qwen3.py``.
* :class:`MLA` — DeepSeek's multi-head latent attention over one latent row per token (``"latent"`` cache,
  :mod:`shared_numerics.mla`); with ``index_topk`` set the layer is DeepSeek Sparse Attention (``"dsa"``: MLA over the
  tokens its lightning indexer selects, :mod:`shared_numerics.dsa`, the indexer key cached beside the latent on its
  "full" layers). HF ``modeling_deepseek_v3.py``, ``modeling_glm_moe_dsa.py``; vLLM ``models/deepseek_v2.py``.

* :class:`GatedDeltaNet` — Qwen3-Next's and Qwen3.5's linear-attention recurrence (``"recurrent"`` cache: a conv
  state and a float32 ``[value heads, d_k, d_v]`` state per sequence, :mod:`shared_numerics.gated_deltanet`). HF
  ``modeling_qwen3_next.py``; vLLM ``models/qwen3_next.py``, ``layers/mamba/gdn/``.

A hybrid declares which mixer each of HF's ``layer_types`` takes (``ModelAdapterSpec.layer_mixers``,
:func:`layer_mixer`), so "three Gated DeltaNet layers : one attention layer" is the config's data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .config import ModelConfig, UnsupportedModelError

__all__ = [
    "CACHE_KINDS",
    "GQA",
    "MIXERS",
    "MIXER_KINDS",
    "MLA",
    "GatedDeltaNet",
    "TPSplit",
    "TokenMixer",
    "layer_mixer",
    "mixer_component",
]

#: token mixers: grouped-query attention, multi-head latent attention, DeepSeek Sparse Attention (MLA over each
#: query's selected tokens), Gated DeltaNet (recurrent; Mamba-2 takes the same room)
MIXER_KINDS = ("gqa", "mla", "dsa", "gated_deltanet")
#: what a token mixer keeps between steps
CACHE_KINDS = ("paged_kv", "latent", "recurrent")


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
        output_gate: gated attention (Qwen3-Next, Qwen3.5): ``q_proj`` gives each head's query and an output gate
            (``[q | gate]`` per head), the attention output times ``sigmoid(gate)`` before ``o_proj``.
    """

    kind: str
    cache: str
    state: tuple[tuple[str, tuple[int, ...]], ...]
    qk_norm: bool = False
    qkv_bias: bool = False
    partial_rotary_factor: float = 1.0
    indexer: str | None = None
    output_gate: bool = False

    def __post_init__(self):
        if self.kind not in MIXER_KINDS or self.cache not in CACHE_KINDS:
            raise ValueError(f"token mixer {self.kind!r} with cache {self.cache!r}: not one of {MIXER_KINDS}")

    @property
    def component(self) -> GQA | MLA | GatedDeltaNet:
        """The component that answers for this layer (:data:`MIXERS`)."""
        return MIXERS[self.kind]


@dataclass(frozen=True)
class TPSplit:
    """How tensor parallelism splits a component's layer over ``tp`` ranks.

    Attributes:
        shards: ``(config field, count)`` of what is split evenly over the ranks (heads); each count must divide.
        row_parallel: ``(projection, K)`` of each row-parallel linear: its input width ``K`` is summed over the ranks
            in the fixed K-block tree, so ``K`` must divide by ``tp * tp_k_block``
            (:func:`shared_numerics.tensor_parallel.row_parallel_linear`).
    """

    shards: tuple[tuple[str, int], ...] = ()
    row_parallel: tuple[tuple[str, int], ...] = ()


def _rope_problems(cfg: ModelConfig, yarn: bool) -> list[str]:
    from shared_numerics.rope import YarnScaling

    problems = []
    if cfg.unsupported_rope:
        problems.append(f"rope_scaling {cfg.unsupported_rope} (supported: none, llama3{', yarn' if yarn else ''})")
    if isinstance(cfg.rope_scaling, YarnScaling) and not yarn:
        problems.append("rope_scaling yarn (supported on MLA models)")
    return problems


class GQA:
    """Grouped-query attention: ``num_attention_heads`` query heads over ``num_key_value_heads`` K/V heads of
    ``head_dim``, rotate-half or interleaved RoPE (the architecture's declaration), optional QK norm and q/k/v bias.

    Config fields: ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``attention_bias``,
    ``use_qk_norm``, ``rope_theta`` / ``rope_scaling`` (none or llama3), ``partial_rotary_factor`` (rotate-half RoPE
    on the first ``head_dim * partial_rotary_factor`` dimensions of each head, the rest passed through: HF
    ``apply_rotary_pos_emb``), ``sliding_window``, ``attn_output_gate`` (the sigmoid output gate of Qwen3-Next's
    ``Qwen3NextAttention``)."""

    kind = "gqa"
    cache = "paged_kv"
    #: the trainer runs it under context parallelism (:mod:`titan_plugin.context_parallel`)
    context_parallel = True

    def layer(self, cfg: ModelConfig, adapter, i: int) -> TokenMixer:
        kv = (cfg.num_key_value_heads, cfg.head_dim)
        return TokenMixer(
            self.kind,
            self.cache,
            (("k", kv), ("v", kv)),
            qk_norm=adapter.qk_norm or cfg.use_qk_norm,
            qkv_bias=adapter.qkv_bias or cfg.attention_bias,
            partial_rotary_factor=cfg.partial_rotary_factor,
            output_gate=cfg.attn_output_gate,
        )

    @staticmethod
    def rotary_dim(cfg: ModelConfig) -> int:
        """The rotated dimensions of each head: ``int(head_dim * partial_rotary_factor)`` (HF's rope init)."""
        return int(cfg.head_dim * cfg.partial_rotary_factor)

    def problems(self, cfg: ModelConfig, adapter) -> list[str]:
        """What of ``cfg`` zerokld's grouped-query attention does not implement (empty: none)."""
        problems = _rope_problems(cfg, yarn=False)
        rotary = self.rotary_dim(cfg)
        if cfg.partial_rotary_factor != 1.0 and (adapter.rope != "cos_sin" or rotary < 2 or rotary % 2):
            problems.append(
                f"partial_rotary_factor {cfg.partial_rotary_factor} (supported: rotate-half RoPE over an even number"
                f" of dimensions; here {rotary} of {cfg.head_dim} with {adapter.rope} RoPE)"
            )
        if cfg.index_topk is not None:
            problems.append("index_topk (DeepSeek Sparse Attention) on an architecture without MLA")
        if cfg.attention_bias and not (adapter.qkv_bias or adapter.qkv_bias_from_config):
            problems.append("attention bias")
        if cfg.sliding_window:
            problems.append("sliding-window attention")
        return problems

    def tp_split(self, cfg: ModelConfig) -> TPSplit:
        """Heads (query and K/V) split over the ranks; ``o_proj`` row-parallel over ``H x head_dim``."""
        return TPSplit(
            (("num_attention_heads", cfg.num_attention_heads), ("num_key_value_heads", cfg.num_key_value_heads)),
            (("o_proj", cfg.num_attention_heads * cfg.head_dim),),
        )


class MLA:
    """Multi-head latent attention (``q_lora_rank`` or one ``q_proj``; a latent of ``kv_lora_rank +
    qk_rope_head_dim`` per token; YaRN), and with ``index_topk`` DeepSeek Sparse Attention over it.

    Config fields: ``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``,
    ``rope_interleave``, ``rope_scaling`` (none, llama3 or yarn); DSA: ``index_topk``, ``index_n_heads``,
    ``index_head_dim``, ``indexer_types``."""

    kind = "mla"
    cache = "latent"
    #: zerokld's context parallelism splits per-head K/V, not a latent cache
    context_parallel = False

    def layer(self, cfg: ModelConfig, adapter, i: int) -> TokenMixer:
        latent = (("latent", (int(cfg.kv_lora_rank or 0) + cfg.qk_rope_head_dim,)),)
        if cfg.index_topk is None:
            return TokenMixer("mla", self.cache, latent)
        indexer = cfg.indexer_types[i] if i < len(cfg.indexer_types) else "full"
        key = (("indexer_key", (cfg.index_head_dim,)),) if indexer == "full" else ()  # a shared layer has no indexer
        return TokenMixer("dsa", self.cache, latent + key, indexer=indexer)

    @staticmethod
    def rotary_dim(cfg: ModelConfig) -> int:
        """The rotated dimensions of each head's query and of the latent's key part: ``qk_rope_head_dim``."""
        return cfg.qk_rope_head_dim

    def problems(self, cfg: ModelConfig, adapter) -> list[str]:
        """What of ``cfg`` zerokld's MLA (and DSA) does not implement (empty: none)."""
        problems = _rope_problems(cfg, yarn=True)
        if cfg.partial_rotary_factor != 1.0:
            problems.append(f"partial_rotary_factor {cfg.partial_rotary_factor} (supported: 1, every rope dimension)")
        if not cfg.kv_lora_rank or not cfg.qk_rope_head_dim or not cfg.qk_nope_head_dim or not cfg.v_head_dim:
            problems.append("MLA without kv_lora_rank / qk_rope_head_dim / qk_nope_head_dim / v_head_dim")
        if cfg.index_topk is not None:
            problems += _dsa_problems(cfg)
        if cfg.attention_bias:
            problems.append("attention bias")
        if cfg.sliding_window:
            problems.append("sliding-window attention")
        return problems

    def tp_split(self, cfg: ModelConfig) -> TPSplit:
        """Heads split over the ranks, one whole latent per token on every rank; ``o_proj`` row-parallel over
        ``H x v_head_dim``."""
        return TPSplit(
            (("num_attention_heads", cfg.num_attention_heads),),
            (("o_proj", cfg.num_attention_heads * cfg.v_head_dim),),
        )


def _dsa_problems(cfg: ModelConfig) -> list[str]:
    """What zerokld's DeepSeek Sparse Attention (:mod:`shared_numerics.dsa`) needs of a config with ``index_topk``."""
    if cfg.index_topk is None:
        return []
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


class GatedDeltaNet:
    """Gated DeltaNet: ``linear_num_value_heads`` heads of ``linear_value_head_dim`` over
    ``linear_num_key_heads`` key heads of ``linear_key_head_dim`` (each repeated to the value heads), a causal depthwise
    conv1d of ``linear_conv_kernel_dim`` over the mixed ``q|k|v`` channels, no RoPE and no position limit.

    Config fields: ``linear_num_key_heads``, ``linear_key_head_dim``, ``linear_num_value_heads``,
    ``linear_value_head_dim``, ``linear_conv_kernel_dim``, ``rms_norm_eps`` (its gated RMSNorm)."""

    kind = "gated_deltanet"
    cache = "recurrent"
    #: a recurrence over the whole sequence: a context-parallel rank would need every earlier rank's state first
    context_parallel = False

    @staticmethod
    def conv_channels(cfg: ModelConfig) -> int:
        """The conv1d's channels: ``q | k | v``, ``2 * Hk * d_k + Hv * d_v``."""
        return 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + (
            cfg.linear_num_value_heads * cfg.linear_value_head_dim
        )

    @classmethod
    def _state(cls, cfg: ModelConfig) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """What a sequence's cache keeps: the conv state ``[K - 1, conv channels]`` and the ``[Hv, d_k, d_v]``
        recurrent state."""
        conv = (max(cfg.linear_conv_kernel_dim - 1, 0), cls.conv_channels(cfg))
        return (
            ("conv", conv),
            ("recurrent", (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)),
        )

    def layer(self, cfg: ModelConfig, adapter, i: int) -> TokenMixer:
        return TokenMixer(self.kind, self.cache, self._state(cfg))

    @staticmethod
    def rotary_dim(cfg: ModelConfig) -> None:
        """No RoPE: the recurrence carries the positions."""
        return None

    @classmethod
    def state_bytes(cls, cfg: ModelConfig, activation_bytes: int) -> int:
        """What one sequence's cache holds for one layer, in bytes: the conv state (``K - 1`` inputs of every conv
        channel, in the activations' dtype of ``activation_bytes`` bytes) and the float32 recurrent state."""
        (_, conv), (_, recurrent) = cls._state(cfg)
        return math.prod(conv) * activation_bytes + math.prod(recurrent) * 4

    def problems(self, cfg: ModelConfig, adapter) -> list[str]:
        """What of ``cfg`` zerokld's Gated DeltaNet (:mod:`shared_numerics.gated_deltanet`) does not implement
        (empty: none); what a host does not build yet is that host's answer (vLLM's engine settings,
        :func:`vllm_plugin.support.check_supported`; the trainer, :func:`titan_plugin.models.titan_model_config`)."""
        problems = []
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        if not (hk and hv and cfg.linear_key_head_dim and cfg.linear_value_head_dim and cfg.linear_conv_kernel_dim):
            problems.append("Gated DeltaNet without linear_num_*_heads / linear_*_head_dim / linear_conv_kernel_dim")
        elif hv % hk:
            problems.append(f"linear_num_value_heads {hv} not a multiple of linear_num_key_heads {hk}")
        if cfg.hidden_act != "silu":
            problems.append(f"Gated DeltaNet activation {cfg.hidden_act} (its conv1d and gated norm use silu)")
        return problems

    def tp_split(self, cfg: ModelConfig) -> TPSplit:
        """Key and value heads split over the ranks (a rank's value heads read its own key heads); ``out_proj``
        row-parallel over ``Hv x d_v``."""
        return TPSplit(
            (
                ("linear_num_key_heads", cfg.linear_num_key_heads),
                ("linear_num_value_heads", cfg.linear_num_value_heads),
            ),
            (("out_proj", cfg.linear_num_value_heads * cfg.linear_value_head_dim),),
        )


_GQA, _MLA, _GDN = GQA(), MLA(), GatedDeltaNet()
#: each layer kind's component (a DSA layer is MLA's: MLA with its indexer)
MIXERS: dict[str, GQA | MLA | GatedDeltaNet] = {"gqa": _GQA, "mla": _MLA, "dsa": _MLA, "gated_deltanet": _GDN}
#: the component of each value of ``ModelAdapterSpec.attention`` and ``layer_mixers``
_DECLARED: dict[str, GQA | MLA | GatedDeltaNet] = {"gqa": _GQA, "mla": _MLA, "gated_deltanet": _GDN}


def mixer_component(adapter) -> GQA | MLA | GatedDeltaNet:
    """The token-mixer component an architecture declares for every layer (``ModelAdapterSpec.attention``)."""
    return _DECLARED[adapter.attention]


def layer_mixer(cfg: ModelConfig, adapter, i: int) -> GQA | MLA | GatedDeltaNet:
    """Layer ``i``'s token-mixer component: with ``adapter.layer_mixers`` declared, the one ``cfg.layer_types[i]``
    names (HF's hybrids: ``Qwen3NextDecoderLayer`` builds its mixer from ``config.layer_types[layer_idx]``); else
    ``adapter.attention``'s.

    Raises:
        UnsupportedModelError: the config has no layer type for layer ``i``, or one the architecture does not declare.
    """
    if not adapter.layer_mixers:
        return mixer_component(adapter)
    declared = dict(adapter.layer_mixers)
    if len(cfg.layer_types) != cfg.num_hidden_layers or cfg.layer_types[i] not in declared:
        raise UnsupportedModelError(
            f"layer_types {list(cfg.layer_types)} ({cfg.num_hidden_layers} layers; the architecture's layer types: "
            f"{sorted(declared)})"
        )
    return _DECLARED[declared[cfg.layer_types[i]]]
