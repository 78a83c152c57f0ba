"""vLLM's ``additional_config["zerokld"]``: :class:`shared_numerics.settings.ZeroKLDSettings` (the settings the
trainer holds too: one spelling, one default, one set of rules) plus the engine-only ``hot_load`` section.

Pass it as ``--additional-config '{"zerokld": {"batch_invariant": true}}'`` to the OpenAI server or
``LLM(..., additional_config={"zerokld": {...}})`` offline. No ``zerokld`` section leaves vLLM as it is; a section
takes the settings' defaults (``batch_invariant`` on). :func:`from_vllm_config` is the one reader: each distinct
section is parsed once per process and every caller gets that object.
"""

from __future__ import annotations

import functools
import json
from typing import Any, ClassVar

from deltasync.protocol import HotLoadConfig
from shared_numerics.settings import ZeroKLDSettings, ZeroKLDSettingsError

__all__ = ["ZeroKLDConfig", "ZeroKLDConfigError", "from_vllm_config", "numerics_mode", "numerics_stamp"]


class ZeroKLDConfigError(ZeroKLDSettingsError):
    """Raised when the ``zerokld`` section is malformed or asks for something unsupported."""


class ZeroKLDConfig(ZeroKLDSettings):
    """``additional_config["zerokld"]``: every :class:`~shared_numerics.settings.ZeroKLDSettings` field, plus

    Attributes:
        hot_load: switch on the hot-load HTTP API (:class:`deltasync.HotLoadConfig`, the replica's config).
    """

    error_class: ClassVar[type[ZeroKLDSettingsError]] = ZeroKLDConfigError

    hot_load: HotLoadConfig | None = None

    @property
    def settings(self) -> ZeroKLDSettings:
        """The numerics settings alone (what the trainer's side holds)."""
        return ZeroKLDSettings(**self.model_dump(exclude={"hot_load"}))


_STOCK = ZeroKLDConfig(batch_invariant=False)


@functools.lru_cache(maxsize=64)
def _parse(section_json: str) -> ZeroKLDConfig:
    return _validate(json.loads(section_json))


def _validate(section: Any) -> ZeroKLDConfig:
    return ZeroKLDConfig.parse(section, "additional_config['zerokld']")


def from_vllm_config(vllm_config: Any) -> ZeroKLDConfig:
    """The engine's settings from a ``VllmConfig`` (or anything with ``additional_config``): no ``zerokld`` section =
    stock (``batch_invariant`` off).

    Raises:
        ZeroKLDConfigError: unknown keys, wrong types or refused combinations in ``additional_config["zerokld"]``
            (pydantic names each field).
    """
    extra = getattr(vllm_config, "additional_config", None) or {}
    section = extra.get("zerokld") if isinstance(extra, dict) else None
    if section is None:
        return _STOCK
    try:
        key = json.dumps(section, sort_keys=True)
    except TypeError:  # objects in the section (e.g. a HotLoadConfig): validated as given
        return _validate(section)
    return _parse(key)


def numerics_mode(vllm_config: Any):
    """The engine's :class:`shared_numerics.NumericsMode`: :meth:`ZeroKLDSettings.mode` of its settings, with dtype
    from ``model_config.dtype``, the FP8 granularity of a ``zerokld_fp8`` checkpoint's ``quantization_config`` (it
    wins over ``fp8``), backend from the device (``device_config.device_type``).

    Raises:
        ZeroKLDConfigError: malformed ``zerokld`` section.
    """
    model_config = vllm_config.model_config
    quant = getattr(model_config.hf_config, "quantization_config", None) or {}
    stored = None
    if isinstance(quant, dict) and quant.get("quant_method") == "zerokld_fp8":
        stored = quant.get("granularity", "per_channel")
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", "cpu") or "cpu"
    return from_vllm_config(vllm_config).mode(str(model_config.dtype), str(device), fp8=stored)


def numerics_stamp(vllm_config: Any) -> dict | None:
    """What the engine stamps into rollouts and checks snapshots against: :func:`numerics_mode` as a dict with
    ``batch_invariant`` on, ``None`` (stock numerics) otherwise.

    Raises:
        ZeroKLDConfigError: malformed ``zerokld`` section.
    """
    mode = numerics_mode(vllm_config)
    return mode.to_dict() if mode.batch_invariant else None
