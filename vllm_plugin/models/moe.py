"""The MLP components' vLLM faces (:func:`mlp_module`): the dense SwiGLU MLP, :class:`MoEBlock` (softmax top-k,
Qwen3-MoE: ``out, ids = shared_numerics.moe.moe_forward(f, gate, experts..., top_k, norm_topk_prob)``) and
:class:`DeepSeekMoEBlock` on ``shared_numerics.moe`` (router, top-k with lowest-id ties, row-invariant experts, fixed
combine order), plus the per-KV-slot record of routed experts that serves vLLM's own ``enable_return_routed_experts``.

Routing capture: when ``enable_return_routed_experts`` is on, the model writes each computed token's expert ids
(``[MoE layers, top_k]``, int16) into :class:`RouteCache` at the token's KV-cache slot (the attention metadata's
``slot_mapping``), exactly where its keys and values go. A prefix-cache hit reuses blocks, so the routes of cached
tokens are still there; a block that is recycled is rewritten together with its KV. :mod:`vllm_plugin.routing` reads
the rows per request after each step. Source: HF ``modeling_qwen3_moe.py``; vLLM ``models/qwen3_moe.py``.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch
from torch import nn

import shared_numerics as sn
import shared_numerics.fp8 as sn_fp8
import shared_numerics.moe as sn_moe
from zerokld_models.mlps import DeepSeekMoE, MoE, SwiGLU

from .dense import Fp8Mode, TensorParallel, _DenseMLP, _param

__all__ = [
    "DeepSeekMoEBlock",
    "ExpertTensor",
    "MoEBlock",
    "RouteCache",
    "StackedExperts",
    "expert_tensor",
    "mlp_module",
]

_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale)$")
_STACKED = {"gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}


class ExpertTensor(NamedTuple):
    """Where one routed expert's checkpoint tensor lives: ``stacked`` (the stacked parameter, ``...experts.w_gate``;
    ``...experts.w_gate_scale`` for an FP8 checkpoint's ``weight_scale``), row ``expert`` of it, ``module`` (the
    :class:`StackedExperts` module's name) and ``weight`` (the stacked weight's name, ``None`` for a scale)."""

    stacked: str
    expert: int
    module: str
    weight: str | None


def expert_tensor(name: str) -> ExpertTensor | None:
    """The :class:`ExpertTensor` of a per-expert checkpoint name (HF ``...mlp.experts.{e}.{gate,up,down}_proj.
    weight`` or ``.weight_scale``); ``None`` for any other name."""
    m = _EXPERT.match(name)
    if m is None:
        return None
    weight = _STACKED[m.group(3)]
    scale = m.group(4) == "weight_scale"
    return ExpertTensor(f"{m.group(1)}.{weight}" + ("_scale" if scale else ""), int(m.group(2)), m.group(1),
                        None if scale else weight)  # fmt: skip


def expert_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor, expert_id: int) -> None:
    """Copy one expert's HF tensor into row ``expert_id`` of a stacked parameter. Loading goes through a
    ``weight_loader`` (not a direct copy) so vLLM's in-place ``reload_weights`` — which swaps parameters for meta
    tensors and replays the loader calls per layer (``model_loader/reload/layerwise.py``) — reloads experts too."""
    param.data[expert_id].copy_(loaded_weight)


def _stacked(*shape: int, tp: TensorParallel | None, inter_dim: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    """A stacked expert parameter ``[E, ...]`` holding this rank's slice of dimension ``inter_dim`` of each expert's
    tensor (the intermediate size ``I``; all of it without tensor parallelism); its loader takes an expert's full
    checkpoint tensor and keeps the slice."""
    local = list(shape)
    full = shape[1 + inter_dim]
    start, width = tp.split(full) if tp is not None else (0, full)
    local[1 + inter_dim] = width
    p = _param(*local, dtype=dtype)
    p.weight_loader = lambda param, w, e: expert_weight_loader(param, w.narrow(inter_dim, start, width), e)
    p.checkpoint_shape = tuple(shape)  # type: ignore[attr-defined]
    return p


class StackedExperts(nn.Module):
    """The routed experts' weights, stacked: ``w_gate``, ``w_up [E, I, H]`` and ``w_down [E, H, I]`` (HF
    ``experts.{e}.{gate,up,down}_proj.weight``; under tensor parallelism this rank's ``I / TP`` of each).

    FP8 (``fp8``, :class:`vllm_plugin.models.dense.Fp8Mode`; single rank): each expert's projection is one FP8 weight
    of its own, as DeepSeek's checkpoints store it. ``online``: the stacked weights are high precision and
    :meth:`quantize` (after every load and hot-load of an expert) computes each expert's codes and scales with
    :func:`shared_numerics.quantize_fp8_weight`; ``serialized`` (a ``zerokld_fp8`` checkpoint): the stacked
    weights are the ``float8_e4m3fn`` codes and ``w_gate_scale`` / ``w_up_scale`` / ``w_down_scale`` (``[E, I]``,
    ``[E, H]`` per channel; ``[E, ceil(rows/128), ceil(cols/128)]`` per block) hold each expert's
    ``weight_scale``."""

    def __init__(
        self, num_experts: int, hidden: int, inter: int, fp8: Fp8Mode | None = None, tp: TensorParallel | None = None
    ) -> None:
        super().__init__()
        self.fp8 = fp8 or Fp8Mode()
        serialized = self.fp8.kind == "serialized"
        codes = sn_fp8.FP8_DTYPE if serialized else None
        shapes = {"w_gate": (inter, hidden), "w_up": (inter, hidden), "w_down": (hidden, inter)}
        for name, (rows, cols) in shapes.items():
            setattr(
                self,
                name,
                _stacked(num_experts, rows, cols, tp=tp, inter_dim=0 if name != "w_down" else 1, dtype=codes),
            )
            if serialized:
                shape = sn_fp8.weight_scale_shape(rows, cols, self.fp8.granularity)
                setattr(self, f"{name}_scale", _stacked(num_experts, *shape, tp=None, inter_dim=0, dtype=torch.float32))
        self._codes: dict[str, torch.Tensor] = {}
        self._scales: dict[str, torch.Tensor] = {}

    def quantize(self, name: str | None = None, expert: int | None = None) -> None:
        """Online FP8: (re)compute the codes and scales of expert ``expert`` of stacked weight ``name`` (``None``:
        every weight / every expert) from the current high-precision values."""
        for n in (name,) if name else ("w_gate", "w_up", "w_down"):
            w = getattr(self, n).data
            experts = range(w.shape[0]) if expert is None else (expert,)
            for e in experts:
                q, s = sn.quantize_fp8_weight(w[e], self.fp8.granularity)
                if n not in self._codes:
                    self._codes[n] = torch.empty((w.shape[0], *q.shape), dtype=q.dtype)
                    self._scales[n] = torch.empty((w.shape[0], *s.shape), dtype=s.dtype)
                self._codes[n][e].copy_(q)
                self._scales[n][e].copy_(s)

    def operands(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...] | None, str | None]:
        """``((w_gate, w_up, w_down), scales, fp8)`` for :func:`shared_numerics.moe.moe_experts`: the weights (FP8:
        the codes), the per-expert scales (``None`` off FP8) and the FP8 granularity (``None`` off FP8)."""
        names = ("w_gate", "w_up", "w_down")
        kind = self.fp8.kind
        if kind == "off":
            return tuple(getattr(self, n) for n in names), None, None
        if kind == "serialized":
            return (
                tuple(getattr(self, n) for n in names),
                tuple(getattr(self, f"{n}_scale") for n in names),
                self.fp8.granularity,
            )
        if len(self._codes) != 3:
            raise RuntimeError("zerokld fp8: experts were not quantized after loading")
        return tuple(self._codes[n] for n in names), tuple(self._scales[n] for n in names), self.fp8.granularity


class MoEBlock(nn.Module):
    """Qwen3-MoE sparse block. Parameters: ``gate.weight [E, H]``; ``experts.w_gate|w_up [E, I, H]`` and
    ``experts.w_down [E, H, I]`` (HF ``experts.{e}.{gate,up,down}_proj.weight`` stacked by the loader; under tensor
    parallelism each rank holds ``I / TP`` of every expert and the down projections sum with the fixed tree,
    :func:`shared_numerics.moe.moe_experts` ``k_block``). With ``shared_gate`` the sigmoid-gated shared expert beside
    them (Qwen3-Next), ``shared_size`` wide: ``shared_expert.{gate,up,down}_proj`` and ``shared_expert_gate.weight
    [1, H]`` (:func:`shared_numerics.moe.moe_forward` ``shared``; 0 wide, as HF builds it for
    ``shared_expert_intermediate_size`` 0: loaded, adding nothing, not computed).
    ``last_ids`` holds the ``[N, top_k]`` expert ids of the latest forward."""

    def __init__(
        self,
        hidden: int,
        inter: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        tp: TensorParallel | None = None,
        fp8: Fp8Mode | None = None,
        shared_gate: bool = False,
        shared_size: int = 0,
    ) -> None:
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.k_block = tp.k_block if tp is not None else None
        self.gather = tp.gather() if tp is not None else None
        self.gate = nn.Module()
        self.gate.weight = _param(num_experts, hidden)  # the router is replicated, never quantized
        self.experts = StackedExperts(num_experts, hidden, inter, fp8, tp=tp)
        self.shared_expert = _DenseMLP(hidden, shared_size, fp8 or Fp8Mode(), tp=tp) if shared_gate else None
        self.shared_size = shared_size
        if shared_gate:
            self.shared_expert_gate = nn.Module()
            self.shared_expert_gate.weight = _param(1, hidden)  # one gate per token, like the router never quantized
        self.last_ids: torch.Tensor | None = None

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        (wg, wu, wd), scales, fp8 = self.experts.operands()
        shared = {}
        if self.shared_expert is not None and self.shared_size:
            shared = dict(shared=self.shared_expert, shared_gate=self.shared_expert_gate.weight)
        out, self.last_ids = sn_moe.moe_forward(
            f,
            self.gate.weight,
            wg,
            wu,
            wd,
            self.top_k,
            self.renormalize,
            k_block=self.k_block,
            gather=self.gather,
            fp8=fp8,
            scales=scales,
            **shared,
        )
        return out


class RouteCache:
    """Expert ids per KV-cache slot: ``[num_slots, layers, top_k]`` int16, grown on demand."""

    def __init__(self, num_layers: int, top_k: int) -> None:
        self.rows = torch.zeros((0, num_layers, top_k), dtype=torch.int16)

    def write(self, slots: torch.Tensor, ids: torch.Tensor) -> None:
        """Store ``ids [n, layers, top_k]`` at ``slots [n]`` (int; negative slots = padding, skipped)."""
        slots, ids = slots.cpu(), ids.cpu()  # the record lives in host memory, next to the scheduler's view
        keep = slots >= 0
        slots, ids = slots[keep].long(), ids[keep]
        if slots.numel() == 0:
            return
        need = int(slots.max()) + 1
        if need > self.rows.shape[0]:
            grown = torch.zeros((max(need, 2 * self.rows.shape[0]), *self.rows.shape[1:]), dtype=torch.int16)
            grown[: self.rows.shape[0]] = self.rows
            self.rows = grown
        self.rows[slots] = ids.to(torch.int16)

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """``[n, layers, top_k]`` int16 rows of ``slots``.

        Raises:
            IndexError: a slot that was never written.
        """
        if slots.numel() and int(slots.max()) >= self.rows.shape[0]:
            raise IndexError("zerokld routing capture: a requested KV slot holds no routes")
        return self.rows[slots.long()]


class DeepSeekMoEBlock(nn.Module):
    """DeepSeekMoE (HF ``DeepseekV3MoE`` / ``DeepseekV2Moe``): ``gate.weight [E, H]``, ``gate.e_score_correction_bias
    [E]`` (float32; DeepSeek-V3's sigmoid routing only), ``experts.w_gate|w_up [E, I, H]``, ``experts.w_down [E, H,
    I]`` (stacked by the loader, :class:`vllm_plugin.models.moe.StackedExperts`: FP8 codes under FP8),
    ``shared_experts.{gate,up,down}_proj`` (``I * n_shared_experts`` wide). The scores are the config's
    ``scoring_func`` (:func:`shared_numerics.moe.route_grouped_topk`). ``last_ids``: the latest ``[N, top_k]`` expert
    ids. Under tensor parallelism (``tp`` with ``tp_k_block``) the router and its bias are replicated, each rank holds
    ``I / TP`` of every routed expert and of the shared experts, and both down projections sum over ``I`` in the fixed
    TP-aligned tree (:func:`shared_numerics.moe.moe_experts` ``k_block``; the shared experts' ``down_proj`` a
    row-parallel projection), as Qwen3-MoE's :class:`vllm_plugin.models.moe.MoEBlock` does."""

    def __init__(self, cfg, fp8: Fp8Mode, tp: TensorParallel | None = None) -> None:
        super().__init__()
        h, e, inter = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        self.cfg = cfg
        self.k_block = tp.k_block if tp is not None else None
        self.gather = tp.gather() if tp is not None else None
        self.gate = nn.Module()
        self.gate.weight = _param(e, h)  # the router stays high precision (DeepSeek's FP8 checkpoints too)
        self.gate.e_score_correction_bias = _param(e, dtype=torch.float32) if cfg.scoring_func == "sigmoid" else None
        self.experts = StackedExperts(e, h, inter, fp8, tp=tp)
        self.shared_experts = _DenseMLP(h, inter * cfg.n_shared_experts, fp8, tp=tp) if cfg.n_shared_experts else None
        self.last_ids: torch.Tensor | None = None

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        (wg, wu, wd), scales, fp8 = self.experts.operands()
        out, self.last_ids = sn_moe.deepseek_moe_forward(
            f,
            self.gate.weight,
            self.gate.e_score_correction_bias,
            wg,
            wu,
            wd,
            self.shared_experts,
            c.num_experts_per_tok,
            c.n_group,
            c.topk_group,
            c.norm_topk_prob,
            c.routed_scaling_factor,
            scoring=c.scoring_func,
            fp8=fp8,
            scales=scales,
            k_block=self.k_block,
            gather=self.gather,
        )
        return out


#: each MLP component's vLLM module: ``(plan MLP, ModelConfig, Fp8Mode, lora, TensorParallel) -> nn.Module``
_MODULES = {
    SwiGLU: lambda mlp, cfg, fp8, lora, tp: _DenseMLP(cfg.hidden_size, mlp.intermediate_size, fp8, lora=lora, tp=tp),
    MoE: lambda mlp, cfg, fp8, lora, tp: MoEBlock(
        cfg.hidden_size,
        mlp.intermediate_size,
        mlp.num_experts,
        mlp.top_k,
        cfg.norm_topk_prob,
        tp=tp,
        fp8=fp8,
        shared_gate=mlp.shared_expert_gate,
        shared_size=mlp.shared_expert_size,
    ),
    DeepSeekMoE: lambda mlp, cfg, fp8, lora, tp: DeepSeekMoEBlock(cfg, fp8, tp=tp),
}


def mlp_module(mlp, cfg, fp8: Fp8Mode, lora: bool = False, tp: TensorParallel | None = None) -> nn.Module:
    """The vLLM module of one layer's MLP (a :class:`zerokld_models.mlps.MLP` of the plan): the dense SwiGLU MLP
    (a LoRA target when ``lora``), :class:`MoEBlock` or :class:`DeepSeekMoEBlock`, chosen by its component."""
    return _MODULES[type(mlp.component)](mlp, cfg, fp8, lora, tp)
