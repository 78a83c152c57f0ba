"""The ``additional_config["zerokld"]`` schema read by the vLLM plugin.

Pass it as ``--additional-config '{"zerokld": {"batch_invariant": true}}'`` to the OpenAI server or
``LLM(..., additional_config={"zerokld": {...}})`` offline. Absent or ``batch_invariant: false`` leaves vLLM as it is.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

__all__ = ["ZeroKLDConfig", "ZeroKLDConfigError", "from_vllm_config", "config_or_off"]


class ZeroKLDConfigError(ValueError):
    """Raised when the ``zerokld`` section is malformed or asks for something unsupported."""


class HotLoadConfig(BaseModel):
    """``additional_config["zerokld"]["hot_load"]``: read by the ``zerokld_hotload`` endpoint plugin
    (:mod:`vllm_plugin.hotload.endpoint`).

    Attributes:
        snapshot_root: directory of ``<identity>/`` snapshots (full HF layout, or ``arc_v2`` deltas).
        state_dir: ledger + materialized snapshots; default ``<snapshot_root>/.zerokld_state``.
        initial_identity: identity of the ``--model`` weights.
        keep_materialized: decoded snapshots kept on disk (bases of the next deltas).
    """

    model_config = ConfigDict(extra="forbid")

    snapshot_root: str
    state_dir: str | None = None
    initial_identity: str = "initial"
    keep_materialized: int = 2


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
        hot_load: switch on the hot-load HTTP API (:class:`HotLoadConfig`).
        deterministic_sampler: with ``batch_invariant``, sample with :mod:`shared_numerics.sampling` (noise a pure
            function of seed, output position and vocabulary index; :mod:`vllm_plugin.sampler`). Requests without a
            ``seed`` get one drawn, returned as ``CompletionOutput.zerokld_seed``. Default on.
    """

    model_config = ConfigDict(extra="forbid")

    batch_invariant: bool = False
    fp8: bool = False
    fp8_granularity: Literal["per_channel", "block"] | None = None
    hot_load: HotLoadConfig | None = None
    deterministic_sampler: bool = True

    @property
    def sampler_enabled(self) -> bool:
        return self.batch_invariant and self.deterministic_sampler

    @model_validator(mode="after")
    def _fp8_needs_batch_invariant(self) -> "ZeroKLDConfig":
        if (self.fp8 or self.fp8_granularity) and not self.batch_invariant:
            raise ValueError("fp8 needs batch_invariant: true (the FP8 math is the shared_numerics one)")
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
