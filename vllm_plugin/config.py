"""The ``additional_config["zerokld"]`` schema read by the vLLM plugin.

Pass it as ``--additional-config '{"zerokld": {"batch_invariant": true}}'`` to the OpenAI server or
``LLM(..., additional_config={"zerokld": {...}})`` offline. Absent or ``batch_invariant: false`` leaves vLLM as it is.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, PositiveInt, ValidationError, model_validator

from deltasync.protocol import HotLoadConfig

__all__ = ["ZeroKLDConfig", "ZeroKLDConfigError", "config_or_off", "from_vllm_config", "numerics_mode",
           "numerics_stamp"]


class ZeroKLDConfigError(ValueError):
    """Raised when the ``zerokld`` section is malformed or asks for something unsupported."""


class ZeroKLDConfig(BaseModel):
    """Fields of ``additional_config["zerokld"]``.

    Attributes:
        batch_invariant: run supported models on ``shared_numerics`` (bitwise equal to the trainer).
        fp8: serve the decoder projections in FP8 (:mod:`shared_numerics.fp8`): a high-precision checkpoint is
            quantized online at every (re)load; a ``zerokld_fp8`` checkpoint (``shared_numerics.fp8_checkpoint``) is
            served as stored whether or not this is set. Needs ``batch_invariant``.
        fp8_granularity: ``"per_channel"`` (per-token activations, per-channel weights; default) or ``"block"``
            (1x128 activation groups, 128x128 weight blocks). A quantized checkpoint's own granularity wins; naming
            a different one is an error.
        hot_load: switch on the hot-load HTTP API (:class:`deltasync.HotLoadConfig`, the replica's config).
        deterministic_sampler: with ``batch_invariant``, sample with :mod:`shared_numerics.sampling` (noise a pure
            function of seed, output position and vocabulary index; :mod:`vllm_plugin.sampler`). Requests without a
            ``seed`` get one drawn, returned as ``CompletionOutput.zerokld_seed``. Default on.
        tp_k_block: ``o_proj`` / ``down_proj`` sum over fixed ``K`` blocks of this width in the TP-aligned tree
            (:mod:`shared_numerics.tensor_parallel`; :attr:`shared_numerics.NumericsMode.tp_k_block`): the same bits
            at every ``--tensor-parallel-size`` (a power of two), and the trainer at any TP size with the same value.
            Required for ``--tensor-parallel-size`` > 1; needs ``batch_invariant``.
    """

    model_config = ConfigDict(extra="forbid")

    batch_invariant: bool = False
    fp8: bool = False
    fp8_granularity: Literal["per_channel", "block"] | None = None
    hot_load: HotLoadConfig | None = None
    deterministic_sampler: bool = True
    tp_k_block: PositiveInt | None = None

    @property
    def sampler_enabled(self) -> bool:
        return self.batch_invariant and self.deterministic_sampler

    @model_validator(mode="after")
    def _fp8_needs_batch_invariant(self) -> "ZeroKLDConfig":
        if (self.fp8 or self.fp8_granularity) and not self.batch_invariant:
            raise ValueError("fp8 needs batch_invariant: true (the FP8 math is the shared_numerics one)")
        if self.tp_k_block is not None and not self.batch_invariant:
            raise ValueError("tp_k_block needs batch_invariant: true")
        return self


def from_vllm_config(vllm_config: Any) -> ZeroKLDConfig:
    """Parse the plugin's section out of a ``VllmConfig`` (or anything with ``additional_config``).

    Raises:
        ZeroKLDConfigError: unknown keys or wrong types in ``additional_config["zerokld"]``.
    """
    extra = getattr(vllm_config, "additional_config", None) or {}
    section = extra.get("zerokld", {}) if isinstance(extra, dict) else {}
    try:
        return ZeroKLDConfig.model_validate(section)
    except ValidationError as e:
        raise ZeroKLDConfigError(f"invalid additional_config['zerokld']: {e}") from e


def config_or_off(vllm_config: Any) -> ZeroKLDConfig:
    """:func:`from_vllm_config`, with a malformed section read as the default (everything off).

    For hooks that must not fail where vLLM calls them (config checks, request processing, the sampler); the model
    constructor parses strictly and reports the error at start."""
    try:
        return from_vllm_config(vllm_config)
    except ZeroKLDConfigError:
        return ZeroKLDConfig()


def numerics_mode(vllm_config: Any):
    """The engine's :class:`shared_numerics.NumericsMode`: ``batch_invariant`` from ``additional_config["zerokld"]``,
    dtype from ``model_config.dtype``, FP8 granularity from the section (online FP8) or the checkpoint's
    ``zerokld_fp8`` ``quantization_config``, backend from the device (``device_config.device_type``).

    Raises:
        ZeroKLDConfigError: malformed ``zerokld`` section.
    """
    from shared_numerics.mode import NumericsMode

    cfg = from_vllm_config(vllm_config)
    model_config = vllm_config.model_config
    quant = getattr(model_config.hf_config, "quantization_config", None) or {}
    fp8 = None
    if isinstance(quant, dict) and quant.get("quant_method") == "zerokld_fp8":
        fp8 = quant.get("granularity", "per_channel")
    elif cfg.fp8:
        fp8 = cfg.fp8_granularity or "per_channel"
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", "cpu") or "cpu"
    return NumericsMode.build(cfg.batch_invariant, str(model_config.dtype), fp8, device_type=str(device),
                              tp_k_block=cfg.tp_k_block)


def numerics_stamp(vllm_config: Any) -> dict | None:
    """What the engine stamps into rollouts and checks snapshots against: :func:`numerics_mode` as a dict with
    ``batch_invariant`` on, ``None`` (stock numerics) otherwise.

    Raises:
        ZeroKLDConfigError: malformed ``zerokld`` section.
    """
    mode = numerics_mode(vllm_config)
    return mode.to_dict() if mode.batch_invariant else None
