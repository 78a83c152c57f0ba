"""Exact gradient accumulation for the trainer's streamed ``forward_backward``: batched passes, token-order chains.

:meth:`titan_plugin.rl.RLTrainer.forward_backward` promises that calls on consecutive micro-batches leave exactly the
``.grad`` bits of one call on their concatenation. The general way (any model) runs one rollout at a time and lets
autograd add each rollout's gradient — exact, and ~6-10x slower than one batched step. Where every parameter belongs to
a zerokld module that can route its gradient into a :class:`shared_numerics.grad_chain.GradChain` (zerokld linear,
lm_head with or without fused log-probs, FP8 QAT linear, RMSNorm, embedding, the LoRA adapters of
:class:`titan_plugin.lora.ZeroKLDLoRALinear`, the router and experts of :class:`titan_plugin.overrides.ZeroKLDMoE`) and
the machine's kernels cover the forward dtype (:func:`shared_numerics.grad_chain.chain_available`), a call instead runs
**one batched forward and backward** of its rollouts, and each gradient element is one float32 chain over the tokens in
batch order that the next call continues. The per-token quantities (``dY``, ``X``) are batch-invariant, so the chains
see the same numbers in the same order whatever the grouping.

A LoRA adapter's chain is the gradient of the operand the op sees (``A`` zero-padded to the engine's rank ``R``,
``B * scaling`` padded likewise); its parameter's gradient is the first ``r`` rows or columns of the sums, ``B``'s
times the scaling — applied once to the step's sums, so every grouping gets the same bits.

An MoE expert's chain runs over the tokens routed to it, in token order; their number is any, so its products are
float32 (:attr:`shared_numerics.grad_chain.GradChain.float32_products`: bf16 values widened exactly) where the
dense chains of a bf16 model use the AMX kernel's 32-token steps.

Not covered (the general way runs): tensor parallelism (``tp_k_block``: the row-parallel trees, the vocab-parallel
lm_head, TP experts), more than one data-parallel rank, bf16 on CPUs whose bf16 GEMMs go through oneDNN (AVX-512
without AMX).

Source: :mod:`shared_numerics.grad_chain`; TorchTitan's FSDP2 gradient path (``fully_shard``: a parameter whose
unsharded gradient is ``None`` is skipped by the post-backward reduce-scatter, so the chains' sums are written to the
sharded parameters' ``.grad`` directly).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shared_numerics.grad_chain import CHAIN_K_MULTIPLE, GradChain, chain_available

from .lora import ZeroKLDLoRALinear
from .overrides import ZeroKLDEmbedding, ZeroKLDFp8Linear, ZeroKLDLinear, ZeroKLDLMHead, ZeroKLDMoE, ZeroKLDRMSNorm

__all__ = ["CHAIN_MODULES", "ExactAccumulation", "unsupported_reason"]

#: module types (exact) whose parameters' gradients go into chains
CHAIN_MODULES = (ZeroKLDLinear, ZeroKLDFp8Linear, ZeroKLDLMHead, ZeroKLDRMSNorm, ZeroKLDEmbedding)


def _params(model: torch.nn.Module | list[torch.nn.Module]):
    for mod_name, module in (m for part in _parts(model) for m in part.named_modules()):
        for name, p in module._parameters.items():
            if p is not None and p.requires_grad:
                yield mod_name, module, name, p


def _parts(model: torch.nn.Module | list[torch.nn.Module]) -> list[torch.nn.Module]:
    """A model, or the model parts of this rank's pipeline stages (TorchTitan's ``model_parts``)."""
    return list(model) if isinstance(model, list) else [model]


def _own_class(module: torch.nn.Module) -> type:
    """The module's class, under the subclass FSDP2's ``fully_shard`` gives it (``FSDP<Class>``)."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))


@dataclass(frozen=True)
class _Site:
    """Where one parameter's chain is fed: ``feeder``'s forward reads it as ``grad_chains(feeder)[name]``; the chain
    has ``shape`` (and :attr:`~shared_numerics.grad_chain.GradChain.float32_products`); ``finish`` turns its sums
    (float32) into the parameter's gradient."""

    feeder: torch.nn.Module
    name: str
    param: torch.nn.Parameter
    shape: tuple[int, ...]
    finish: Callable[[torch.Tensor], torch.Tensor] | None = None
    float32_products: bool = False


def _adapter_site(lora: torch.nn.Module, which: str, name: str, p: torch.nn.Parameter) -> _Site | None:
    """A LoRA adapter's chain: the gradient of the padded, scaling-folded operand the op sees
    (:class:`titan_plugin.lora.ZeroKLDLoRALinear`: ``A`` zero-padded to ``[R, K]``, ``B * scaling`` to ``[N, R]``);
    the parameter's gradient is its first ``r`` rows (``A``) or columns (``B``, times the scaling: the chain rule of
    the fold, applied once to the sums)."""
    if name != "weight":
        return None
    r, rank = lora.lora_a.weight.shape[0], lora.max_rank
    if which == "lora_a":
        return _Site(lora, "lora_a.weight", p, (rank, p.shape[1]), lambda acc: acc[:r])
    scaling = lora._lora_scaling
    return _Site(lora, "lora_b.weight", p, (p.shape[0], rank), lambda acc: acc[:, :r] * scaling)


def _expert_site(moe: torch.nn.Module, name: str, p: torch.nn.Parameter) -> _Site | None:
    """An MoE block's stacked expert weight: fed by :class:`titan_plugin.overrides.ZeroKLDMoE` (expert ``e``'s tokens
    are any number: float32 products). Its router's gate is a :class:`ZeroKLDLinear` of its own."""
    if name not in ("w1_EFD", "w2_EDF", "w3_EFD"):
        return None
    return _Site(moe, name, p, tuple(p.shape), float32_products=True)


def _fed_by_another(
    model: torch.nn.Module | list[torch.nn.Module],
) -> dict[int, Callable[[str, torch.nn.Parameter], _Site | None]]:
    """``id(module) -> site of (name, param)`` for modules whose parameters another module's forward uses: the
    adapters of a :class:`ZeroKLDLoRALinear`, the experts of a :class:`ZeroKLDMoE`."""
    out = {}
    for m in (m for part in _parts(model) for m in part.modules()):
        if _own_class(m) is ZeroKLDLoRALinear:
            for which in ("lora_a", "lora_b"):
                out[id(getattr(m, which))] = functools.partial(_adapter_site, m, which)
        elif _own_class(m) is ZeroKLDMoE:
            out[id(m.routed_experts.inner_experts)] = functools.partial(_expert_site, m)
    return out


def _sites(model: torch.nn.Module | list[torch.nn.Module]):
    """``(mod_name, module, name, site)`` for every trainable parameter (``site`` ``None``: no module feeds a
    chain)."""
    others = _fed_by_another(model)
    for mod_name, module, name, p in _params(model):
        if id(module) in others:
            yield mod_name, module, name, others[id(module)](name, p)
        elif _own_class(module) in CHAIN_MODULES:
            yield mod_name, module, name, _Site(module, name, p, tuple(p.shape))
        else:
            yield mod_name, module, name, None


def unsupported_reason(model: torch.nn.Module | list[torch.nn.Module], dtype: torch.dtype) -> str | None:
    """Why exact accumulation cannot chain this model's gradients (``None``: it can): a parameter outside
    :data:`CHAIN_MODULES`, the LoRA adapters and the MoE experts, a vocab-parallel lm_head, MoE experts with
    ``tp_k_block``, a parameter sharded over more than one rank, or no kernel coverage for ``dtype`` on this
    machine."""
    from torch.distributed.tensor import DTensor

    if not chain_available(dtype):
        return f"this machine's kernels do not cover {dtype} gradients (shared_numerics.grad_chain.chain_available)"
    for mod_name, module, name, site in _sites(model):
        if site is None:
            return f"{mod_name}.{name} belongs to a {_own_class(module).__name__}"
        if isinstance(module, ZeroKLDLMHead) and module.vocab_parallel:
            return "the vocab-parallel lm_head (tp_k_block)"
        if isinstance(site.feeder, ZeroKLDMoE) and site.feeder.k_block is not None:
            return f"{mod_name}.{name}: MoE experts with tp_k_block"
        p = site.param
        if isinstance(p, DTensor) and p.device_mesh.size() != 1:
            return f"{mod_name}.{name} is sharded over {p.device_mesh.size()} ranks"
    return None


class ExactAccumulation:
    """The chains of one model's parameters between two optimizer steps.

    :meth:`attach` before a micro-batch's forward (the zerokld modules read their chains from it,
    :func:`titan_plugin.overrides.grad_chains`), :meth:`detach` after its backward: it writes each parameter's
    ``.grad`` (float32; the chain's accumulator itself, or for a tied parameter the sum of its modules' chains in
    module order). :meth:`reset` starts the next step's chains from zero.

    Attributes:
        token_multiple: the micro-batch layout's sequence length must be a multiple of this (bf16: the AMX
            kernel's 32-token K steps; float32: 1).
    """

    def __init__(self, model: torch.nn.Module | list[torch.nn.Module], dtype: torch.dtype):
        reason = unsupported_reason(model, dtype)
        if reason is not None:
            raise ValueError(f"exact accumulation with batched passes: {reason}")
        self._sites = [site for *_, site in _sites(model)]
        self.token_multiple = CHAIN_K_MULTIPLE if dtype == torch.bfloat16 else 1
        self._chains: list[GradChain] | None = None

    def attach(self) -> None:
        """Give every module its chains (created from zero at the first micro-batch of a step)."""
        if self._chains is None:
            self._chains = [GradChain(site.shape, site.float32_products) for site in self._sites]
        for site, chain in zip(self._sites, self._chains, strict=True):
            site.feeder.__dict__.setdefault("_zerokld_grad_chains", {})[site.name] = chain

    def detach(self) -> None:
        """Take the chains back from the modules and write the parameters' ``.grad``."""
        from torch.distributed.tensor import DTensor

        for site in self._sites:
            site.feeder.__dict__.pop("_zerokld_grad_chains", None)
        if self._chains is None:
            return
        sums: dict[int, tuple[torch.nn.Parameter, torch.Tensor]] = {}
        for site, chain in zip(self._sites, self._chains, strict=True):
            p, g = site.param, chain.acc if site.finish is None else site.finish(chain.acc)
            if id(p) in sums:  # tied (embedding and lm_head): the chains' sum, in module order
                sums[id(p)] = (p, sums[id(p)][1] + g)
            else:
                sums[id(p)] = (p, g)
        for p, g in sums.values():
            g = g.to(p.dtype)  # float32 master weights: the accumulator itself
            p.grad = (
                DTensor.from_local(g, p.device_mesh, p.placements, run_check=False) if isinstance(p, DTensor) else g
            )

    def reset(self) -> None:
        """The next :meth:`attach` starts new chains from zero (after an optimizer step zeroed the gradients)."""
        self._chains = None
