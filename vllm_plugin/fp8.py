"""``zerokld_fp8`` in vLLM's quantization registry, so vLLM accepts checkpoints exported with
:func:`zerokld_models.fp8_export.export_fp8_checkpoint` (``quantization_config.quant_method == "zerokld_fp8"``).

The config only carries the granularity: the zerokld model classes (:mod:`vllm_plugin.models.dense`) read it and run
every projection through :func:`shared_numerics.fp8_linear`; vLLM's own linear layers are never built for these
models, so :meth:`ZeroKLDFp8Config.get_quant_method` has nothing to return.
Source: ``vllm/model_executor/layers/quantization/__init__.py`` (``register_quantization_config``),
``base_config.py`` (the interface).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

from shared_numerics.fp8_checkpoint import QUANT_METHOD, parse_quantization_config

__all__ = ["ZeroKLDFp8Config", "register"]


class ZeroKLDFp8Config(QuantizationConfig):
    """vLLM view of a ``zerokld_fp8`` ``quantization_config``.

    Raises (``from_config``):
        shared_numerics.fp8.Fp8QuantizationError: a malformed block.
    """

    def __init__(self, granularity: str = "per_channel") -> None:
        super().__init__()
        self.granularity = granularity

    def get_name(self) -> str:
        return QUANT_METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ZeroKLDFp8Config:
        return cls(parse_quantization_config(config))

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        return None


def register() -> None:
    register_quantization_config(QUANT_METHOD)(ZeroKLDFp8Config)
