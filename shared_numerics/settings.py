"""zerokld's settings, one object for both sides: :class:`ZeroKLDSettings`.

The engine reads it from vLLM's ``additional_config["zerokld"]`` (:func:`vllm_plugin.config.from_vllm_config`: a
:class:`vllm_plugin.config.ZeroKLDConfig`, these settings plus the engine-only ``hot_load`` section), the trainer holds
it as ``RLTrainer.Config.zerokld`` (:func:`titan_plugin.rl.rl_trainer_config` builds it from its keyword arguments of
the same names). One spelling and one default per setting; the rules on which settings combine live here only; the
:class:`NumericsMode` each side stamps is derived from it (:meth:`ZeroKLDSettings.mode`).

Settings:

* ``batch_invariant`` (default ``True``): the zerokld numerics (``shared_numerics``) instead of the host library's.
  vLLM is untouched while ``additional_config`` has no ``zerokld`` section at all.
* ``fp8``: ``"per_channel"`` (per-token activations, per-channel weights) or ``"block"`` (1x128 activation groups,
  128x128 weight blocks) FP8 of the decoder projections — online FP8 serving on the engine, FP8 QAT on the trainer —
  or ``None`` (default). Needs ``batch_invariant``. (A ``zerokld_fp8`` checkpoint is served in its own granularity.)
* ``tp_k_block``: ``o_proj`` / ``down_proj`` summed over fixed K blocks of this width in the TP-aligned tree
  (:mod:`shared_numerics.tensor_parallel`) and log-probs from the vocab-parallel log-softmax: the same bits at every
  tensor-parallel size; ``None`` (default). Needs ``batch_invariant``, excludes ``fp8``; required above TP 1.
* ``deterministic_sampler`` (default ``True``): the engine samples with :mod:`shared_numerics.sampling` (noise a pure
  function of seed, output position and vocabulary index). Engine only; needs ``batch_invariant`` to act.

Raises: :class:`ZeroKLDSettingsError` (a ``ValueError``) naming the setting for unknown names, wrong types, a
combination the rules refuse, or an old spelling (``fp8: true`` / ``fp8_granularity``: now ``fp8: "per_channel"``).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, PositiveInt, ValidationError, model_validator

from zerokld_plugins.errors import ZeroKLDClientError

from .mode import NumericsMode

__all__ = ["ZeroKLDSettings", "ZeroKLDSettingsError"]


class ZeroKLDSettingsError(ZeroKLDClientError, ValueError):
    """Settings that are malformed or that do not combine (the message names the setting)."""


class ZeroKLDSettings(BaseModel):
    """See the module. Immutable; compare with ``==``."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    #: what :meth:`parse` raises (a subclass names the side that read the settings)
    error_class: ClassVar[type[ZeroKLDSettingsError]] = ZeroKLDSettingsError

    batch_invariant: bool = True
    fp8: Literal["per_channel", "block"] | None = None
    tp_k_block: PositiveInt | None = None
    deterministic_sampler: bool = True

    @model_validator(mode="before")
    @classmethod
    def _old_fp8_spelling(cls, data: Any) -> Any:
        if isinstance(data, dict) and ("fp8_granularity" in data or isinstance(data.get("fp8"), bool)):
            raise ValueError(
                "fp8 takes the granularity: fp8: 'per_channel' or 'block' (or null); fp8: true and "
                f"fp8_granularity are the old spelling (got fp8={data.get('fp8')!r}, "
                f"fp8_granularity={data.get('fp8_granularity')!r})"
            )
        return data

    @model_validator(mode="after")
    def _rules(self) -> ZeroKLDSettings:
        if self.fp8 is not None and not self.batch_invariant:
            raise ValueError("fp8 needs batch_invariant (the FP8 math is the shared_numerics one)")
        if self.tp_k_block is not None and not self.batch_invariant:
            raise ValueError("tp_k_block needs batch_invariant")
        if self.tp_k_block is not None and self.fp8 is not None:
            raise ValueError("tp_k_block with fp8 is not supported (the FP8 GEMM has no K-blocked row-parallel sum)")
        return self

    @classmethod
    def parse(cls, data: dict[str, Any] | None, where: str = "zerokld settings") -> ZeroKLDSettings:
        """Validate ``data`` (``None`` = every default).

        Raises:
            ZeroKLDSettingsError (:attr:`error_class`): ``where`` and pydantic's account of every bad field.
        """
        try:
            return cls.model_validate(data or {})
        except ValidationError as e:
            raise cls.error_class(f"invalid {where}: {e}") from e

    @property
    def sampler_enabled(self) -> bool:
        """Whether the engine samples with :mod:`shared_numerics.sampling`."""
        return self.batch_invariant and self.deterministic_sampler

    def mode(self, dtype: str, device_type: str = "cpu", fp8: str | None = None) -> NumericsMode:
        """The :class:`NumericsMode` of a process running these settings in ``dtype`` on ``device_type``; ``fp8``:
        the granularity a quantized checkpoint imposes (it wins over :attr:`fp8`)."""
        return NumericsMode.build(
            self.batch_invariant, dtype, fp8 or self.fp8, device_type=device_type, tp_k_block=self.tp_k_block
        )
