"""vLLM's multi-LoRA serving (``enable_lora``, ``LoRARequest``, ``--lora-modules``, ``/v1/load_lora_adapter``) on the
zerokld decoder, with the adapters applied by :func:`shared_numerics.add_lora` instead of the punica kernels.

vLLM's own machinery stays in charge: ``LoRAModelManager`` loads PEFT adapters, folds each adapter's scaling into its
``lora_B`` (``LoRALayerWeights.optimize``), stacks them into per-layer slots zero-padded to ``max_lora_rank``
(``lora_a_stacked [max_loras, 1, R, K]``, ``lora_b_stacked [max_loras, 1, N, R]``) and keeps the per-token slot map
(``punica_wrapper.token_lora_indices``, ``-1``: no adapter) up to date every step. The zerokld decoder's projections
are :class:`LoRAProj` (a ``ReplicatedLinear`` by type, so the manager finds and wraps them); they are wrapped by
:class:`ZeroKLDLinearWithLoRA`, vLLM's ``ReplicatedLinearWithLoRA`` with one change: ``_apply_lora_to_output`` (the
step that calls ``punica_wrapper.add_lora_linear``) runs :func:`shared_numerics.add_lora` on the slot tensors and the
token map. Each request's rows therefore depend only on the request and its adapter — not on which adapters (or
none) share the batch — and equal the trainer's :class:`titan_plugin.lora.ZeroKLDLoRALinear`.

:func:`install` puts :class:`ZeroKLDLinearWithLoRA` first in ``vllm.lora.utils._all_lora_classes`` (the list
``from_layer`` tries in order; vLLM has no registry for LoRA layer classes); it only ever claims :class:`LoRAProj`,
so stock models in the same process are untouched. Source: ``vllm/lora/layers/{base_linear,replicated_linear}.py``,
``vllm/lora/model_manager.py``, ``vllm/lora/punica_wrapper/punica_base.py`` (vLLM 0.32).
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.lora.layers.replicated_linear import ReplicatedLinearWithLoRA
from vllm.model_executor.layers.linear import ReplicatedLinear

import shared_numerics as sn

__all__ = ["LoRAProj", "ZeroKLDLinearWithLoRA", "install"]


class LoRAProj(ReplicatedLinear):
    """A zerokld decoder projection that vLLM's LoRA manager wraps: ``weight [N, K]`` (and ``bias [N]``) under the
    HF names, forward :func:`shared_numerics.linear`. Built without ``LinearBase.__init__`` (no quant method: the
    projection computes itself; FP8 projections are not LoRA targets)."""

    def __init__(self, out_features: int, in_features: int, bias: bool, make_param, prefix: str = "") -> None:
        nn.Module.__init__(self)
        self.input_size, self.output_size = in_features, out_features
        self.output_size_per_partition, self.input_size_per_partition = out_features, in_features
        self.skip_bias_add, self.return_bias, self.prefix = False, False, prefix
        self.tp_size, self.tp_rank, self.quant_method, self.quant_config = 1, 0, None, None
        self.weight = make_param(out_features, in_features)
        self.bias = make_param(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sn.linear(x, self.weight, self.bias)


class ZeroKLDLinearWithLoRA(ReplicatedLinearWithLoRA):
    """vLLM's ``ReplicatedLinearWithLoRA`` around a :class:`LoRAProj`, adding the adapters with
    :func:`shared_numerics.add_lora` (scaling already folded into ``lora_B`` by vLLM: scaling 1)."""

    @classmethod
    def can_replace_layer(cls, source_layer, lora_config, packed_modules_list, model_config=None) -> bool:
        return isinstance(source_layer, LoRAProj)

    def _apply_lora_to_output(self, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        ids = self.punica_wrapper.token_lora_indices[:n]
        if ids.numel() < n:  # padded rows beyond the scheduled tokens: no adapter
            ids = torch.nn.functional.pad(ids, (0, n - ids.numel()), value=-1)
        lora_a, lora_b = self.lora_a_stacked[0][:, 0], self.lora_b_stacked[0][:, 0]
        ones = torch.ones(lora_a.shape[0], dtype=torch.float32)
        return sn.add_lora(output, x, lora_a, lora_b, ones, ids)


def install() -> None:
    """Make vLLM's ``from_layer`` wrap :class:`LoRAProj` with :class:`ZeroKLDLinearWithLoRA` (a seam,
    :mod:`vllm_plugin.seams`, installed at registration; it matches zerokld projections only, so stock models'
    layers get vLLM's own LoRA classes)."""
    from .seams import replace

    replace("vllm.lora.utils:_all_lora_classes", lambda original: (ZeroKLDLinearWithLoRA, *original))
