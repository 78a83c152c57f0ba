"""The one check of what the zerokld model definitions implement, shared by vLLM (at engine start) and the trainer.

:func:`unsupported_features` lists every feature of a checkpoint's config that the architecture's zerokld
definition does not implement; vLLM adds its engine settings (parallelism, LoRA, quantization) and refuses at start
(:func:`vllm_plugin.support.check_supported`), the trainer refuses when it builds the model
(:func:`titan_plugin.models.titan_model_config`). Nothing is ever silently served or trained with stock numerics.
"""

from __future__ import annotations

from .config import ModelConfig, UnsupportedModelError
from .mlps import routed_component
from .plan import layer_plan

__all__ = ["UnsupportedModelError", "check_supported", "unsupported_features"]


def unsupported_features(cfg: ModelConfig, adapter) -> list[str]:
    """Human-readable list of the unsupported features of ``cfg`` for ``adapter``
    (:class:`zerokld_plugins.ModelAdapterSpec`); empty when the model is supported. Each component of the
    checkpoint's plan (:func:`zerokld_models.layer_plan`; a MoE architecture's declared routed MLP too) answers for
    itself (:meth:`zerokld_models.mixers.GQA.problems`, :meth:`zerokld_models.mlps.SwiGLU.problems`, ...); the
    checkpoint's quantization is the model's."""
    components: list = []
    for layer in layer_plan(cfg, adapter):
        for c in (layer.mixer.component, layer.mlp.component):
            if c not in components:
                components.append(c)
    if adapter.moe and routed_component(adapter) not in components:
        components.append(routed_component(adapter))
    problems: list[str] = []
    for c in components:
        problems += [p for p in c.problems(cfg, adapter) if p not in problems]
    if cfg.quant_method not in (None, "zerokld_fp8"):
        problems.append(f"quantization {cfg.quant_method} (zerokld serves its own FP8)")
    return problems


def check_supported(cfg: ModelConfig, adapter) -> None:
    """Raise :class:`UnsupportedModelError` naming every unsupported feature (see :func:`unsupported_features`)."""
    problems = unsupported_features(cfg, adapter)
    if problems:
        raise UnsupportedModelError(f"zerokld {adapter.architecture} does not support: " + "; ".join(problems))
