"""The ``additional_config["zerokld"]`` schema read by the vLLM plugin.

Pass it as ``--additional-config '{"zerokld": {"batch_invariant": true}}'`` to the OpenAI server or
``LLM(..., additional_config={"zerokld": {...}})`` offline. Absent or ``batch_invariant: false`` leaves vLLM as it is.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

__all__ = ["ZeroKLDConfig", "ZeroKLDConfigError", "from_vllm_config"]


class ZeroKLDConfigError(ValueError):
    """Raised when the ``zerokld`` section is malformed or asks for something unsupported."""


class ZeroKLDConfig(BaseModel):
    """Fields of ``additional_config["zerokld"]``.

    Attributes:
        batch_invariant: run supported models on ``shared_numerics`` (bitwise equal to the trainer).
    """

    model_config = ConfigDict(extra="forbid")

    batch_invariant: bool = False


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
