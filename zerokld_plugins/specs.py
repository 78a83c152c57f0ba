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
    """``ops``: op name → function, same signatures as ``shared_numerics``; ``available()`` says whether it can run
    here, ``unavailable_reason()`` (optional) why not, for the error message."""

    name: str
    ops: Mapping[str, Callable | str]
    available: Callable[[], bool] | str = field(default=lambda: True)
    unavailable_reason: Callable[[], str | None] | str | None = None


@dataclass(frozen=True)
class ModelAdapterSpec:
    """One HF architecture on both sides (an ``zerokld_models/<arch>/`` folder registers one).

    ``vllm_model``: the class registered with vLLM's ``ModelRegistry`` for ``architecture`` (stock unless the zerokld
    switch is on); ``titan_config``: ``(zerokld_models.ModelConfig) -> TorchTitan model config``;
    ``titan_state_dict_adapter``: the TorchTitan ``StateDictAdapter`` class between that model and HF weights;
    ``titan_parallelize``: TorchTitan's ``parallelize_fn`` for it. Traits every side reads: ``qk_norm`` (per-head
    RMSNorm of q and k, Qwen3), ``qkv_bias`` (q/k/v projections with bias, Qwen2), ``moe`` (a routed MoE block in
    every layer, Qwen3-MoE), ``interleaved_rope`` (TorchTitan holds q/k rows interleaved: llama3's adapter permutes
    them, the RoPE override undoes it)."""

    architecture: str
    vllm_model: str
    titan_config: Callable | str
    titan_state_dict_adapter: type | str
    titan_parallelize: Callable | str = ""
    qk_norm: bool = False
    qkv_bias: bool = False
    moe: bool = False
    interleaved_rope: bool = False
