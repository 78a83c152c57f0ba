"""What each ``zerokld`` hook returns. All fields are plain Python; ``"module:attr"`` strings are imported on use so
that listing plugins never imports vLLM or TorchTitan."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BackendSpec", "CodecSpec", "LossSpec", "ModelAdapterSpec", "StorageSpec", "resolve"]


def resolve(target: Any) -> Any:
    """Return ``target``, importing it first if it is a ``"module:attr"`` string."""
    if isinstance(target, str) and ":" in target:
        mod, _, attr = target.partition(":")
        obj = importlib.import_module(mod)
        for part in attr.split("."):
            obj = getattr(obj, part)
        return obj
    return target


@dataclass(frozen=True)
class LossSpec:
    """``token_loss(logp [N], sampler_logp [N], advantages [N], config, batch) -> (loss [N], flags)``: ``batch`` is a
    :class:`shared_numerics.losses.LossBatch` (``seq_ids [N]``, ``num_seqs``) for losses with per-sequence terms;
    ``flags`` maps names such as ``clipped`` / ``grad_zeroed`` to bool ``[N]``. The per-token losses are summed; the
    normalisation is the trainer's named choice. ``config_schema`` is a pydantic model validating ``loss_fn_config``;
    ``reference`` states the formula and source."""

    name: str
    token_loss: Callable | str
    config_schema: type | str
    reference: str = ""


@dataclass(frozen=True)
class CodecSpec:
    """``encode(base: bytes, new: bytes) -> bytes`` and ``decode(base: bytes, payload: bytes) -> bytes`` (raw tensor
    bytes); ``name`` is what snapshots advertise in ``compression_format``."""

    name: str
    encode: Callable | str
    decode: Callable | str
    reference: str = ""


@dataclass(frozen=True)
class StorageSpec:
    """``filesystem(url) -> fsspec.AbstractFileSystem`` for URLs of ``scheme`` (``"file"`` for plain paths)."""

    scheme: str
    filesystem: Callable | str


@dataclass(frozen=True)
class BackendSpec:
    """``ops``: op name → function, same signatures as ``shared_numerics`` (or a ``"module:attribute"`` path to
    such a table, resolved on first use); ``available()`` says whether it can run
    here, ``unavailable_reason()`` (optional) why not, for the error message."""

    name: str
    ops: Mapping[str, Callable | str] | str
    available: Callable[[], bool] | str = field(default=lambda: True)
    unavailable_reason: Callable[[], str | None] | str | None = None


#: ``ModelAdapterSpec.moe_routing`` values
MOE_ROUTINGS = ("softmax", "grouped_sigmoid", "grouped_softmax")
#: ``ModelAdapterSpec.attention`` values: the token-mixer components an architecture declares
ATTENTIONS = ("gqa", "mla")
#: the token mixers ``ModelAdapterSpec.layer_mixers`` may name per HF layer type (the recurrent one too)
LAYER_MIXERS = ("gqa", "mla", "gated_deltanet")


@dataclass(frozen=True)
class ModelAdapterSpec:
    """One HF architecture, declared (a ``zerokld_models/<arch>/`` folder registers one; each plugin builds its model
    from the declaration, so the folder imports neither plugin nor any host library).

    Where the stock pieces are (``"module:attr"`` strings, imported only by the plugin that uses them):
    ``vllm_base``: vLLM's own model class for ``architecture`` (vLLM's plugin derives the class it registers with
    ``ModelRegistry``: stock unless the zerokld switch is on); ``titan_model`` / ``titan_block``: TorchTitan's
    decoder and transformer-block classes whose ``Config`` the trainer fills from the HF config;
    ``titan_state_dict_adapter``: TorchTitan's ``StateDictAdapter`` between that model and HF weights, extended by
    ``extra_hf_names`` (``(HF name, TorchTitan name)`` pairs, ``{}`` = the layer index, for weights the stock adapter
    lacks);
    ``titan_parallelize``: TorchTitan's ``parallelize_fn``; ``titan_pipelining``: its ``pipelining_fn`` (every
    decoder folder of TorchTitan's uses ``pipeline_llm``).

    Traits every side reads: ``rope`` (``"cos_sin"``: rotate-half RoPE, TorchTitan's ``CosSinRoPE``; ``"complex"``:
    TorchTitan's ``ComplexRoPE``, with Llama 3.x scaling when the checkpoint has it), ``interleaved_rope`` (TorchTitan
    holds q/k rows interleaved: llama3's adapter permutes them, the RoPE override undoes it), ``derived_head_dim``
    (TorchTitan's model derives the head size as ``hidden_size / num_attention_heads``: llama3), ``qk_norm`` (per-head
    RMSNorm of q and k, Qwen3), ``qkv_bias`` (q/k/v projections with bias, Qwen2), ``qkv_bias_from_config``
    (the config's ``attention_bias`` biases q/k/v only, never ``o_proj``: GLM-4.5), ``moe`` (a routed MoE block in
    every layer, Qwen3-MoE), ``attention`` (the token mixer component: ``"gqa"`` grouped-query attention over
    per-head K/V, ``"mla"`` DeepSeek's multi-head latent attention over a latent cache, :mod:`shared_numerics.mla`;
    its spec is :mod:`zerokld_models.mixers`), ``moe_routing``
    (``"softmax"``: softmax top-k, Qwen3-MoE; ``"grouped_sigmoid"``: DeepSeekMoE's group-limited sigmoid top-k with a
    selection bias, shared experts and dense first layers, :func:`shared_numerics.moe.route_grouped_topk`, DeepSeek-V3;
    ``"grouped_softmax"``: the same block with softmax scores, a group scored by its best expert and no selection
    bias, DeepSeek-V2).

    How the architecture's HF modeling file reads its config, where the config does not say or is ignored:
    ``config_defaults`` (``(HF config key, value)`` pairs used when the key is absent or null, e.g. GLM's router is
    ``scoring_func="sigmoid"``) and ``config_fixed`` (``(ModelConfig field, value)`` pairs the modeling file holds
    whatever the config says, e.g. GLM-5's MLA always rotates interleaved pairs);
    :func:`zerokld_models.read_model_config` applies both.

    Hybrids: ``layer_mixers`` (``(HF layer type, token mixer)`` pairs): layer ``i``'s token mixer is the one its
    ``layer_types[i]`` names (Qwen3-Next: ``"linear_attention"`` -> ``"gated_deltanet"``, ``"full_attention"`` ->
    ``"gqa"``); empty: every layer's is ``attention``."""

    architecture: str
    vllm_base: str
    titan_model: str
    titan_block: str
    titan_state_dict_adapter: str
    titan_parallelize: str = ""
    titan_pipelining: str = "torchtitan.distributed.pipeline_parallel:pipeline_llm"
    extra_hf_names: tuple[tuple[str, str], ...] = ()
    rope: str = "cos_sin"
    interleaved_rope: bool = False
    derived_head_dim: bool = False
    qk_norm: bool = False
    qkv_bias: bool = False
    qkv_bias_from_config: bool = False
    moe: bool = False
    attention: str = "gqa"
    moe_routing: str = "softmax"
    config_defaults: tuple[tuple[str, Any], ...] = ()
    config_fixed: tuple[tuple[str, Any], ...] = ()
    layer_mixers: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        if any(kind not in LAYER_MIXERS for _, kind in self.layer_mixers):
            raise ValueError(
                f"ModelAdapterSpec {self.architecture}: layer_mixers names a token mixer outside {LAYER_MIXERS}: "
                f"{self.layer_mixers!r}"
            )
        if self.attention not in ATTENTIONS or self.moe_routing not in MOE_ROUTINGS:
            raise ValueError(
                f"ModelAdapterSpec {self.architecture}: attention must be one of {ATTENTIONS} and moe_routing "
                f"one of {MOE_ROUTINGS}, got {self.attention!r}, {self.moe_routing!r}"
            )
        if self.rope not in ("cos_sin", "complex"):
            raise ValueError(
                f"ModelAdapterSpec {self.architecture}: rope must be 'cos_sin' or 'complex', got {self.rope!r}"
            )
