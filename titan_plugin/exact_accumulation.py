"""Exact gradient accumulation for the trainer's streamed ``forward_backward``: batched passes, token-order chains.

:meth:`titan_plugin.rl.RLTrainer.forward_backward` promises that calls on consecutive micro-batches leave exactly the
``.grad`` bits of one call on their concatenation. The general way (any model) runs one rollout at a time and lets
autograd add each rollout's gradient — exact, and ~6-10x slower than one batched step. Where every parameter belongs
to a zerokld module that can route its gradient into a :class:`shared_numerics.grad_chain.GradChain` (zerokld linear,
lm_head with or without fused log-probs, RMSNorm, embedding) and the machine's kernels cover the forward dtype
(:func:`shared_numerics.grad_chain.chain_available`), a call instead runs **one batched forward and backward** of its
rollouts, and each gradient element is one float32 chain over the tokens in batch order that the next call continues.
The per-token quantities (``dY``, ``X``) are batch-invariant, so the chains see the same numbers in the same order
whatever the grouping.

Not covered (the general way runs): MoE layers, LoRA adapters, FP8 QAT, tensor parallelism or the vocab-parallel
lm_head, more than one data-parallel rank, bf16 on CPUs whose bf16 GEMMs go through oneDNN (AVX512-BF16 without AMX).

Source: :mod:`shared_numerics.grad_chain`; TorchTitan's FSDP2 gradient path (``fully_shard``: a parameter whose
unsharded gradient is ``None`` is skipped by the post-backward reduce-scatter, so the chains' sums are written to the
sharded parameters' ``.grad`` directly).
"""
from __future__ import annotations

import torch

from shared_numerics.grad_chain import CHAIN_K_MULTIPLE, GradChain, chain_available

from .overrides import ZeroKLDEmbedding, ZeroKLDLinear, ZeroKLDLMHead, ZeroKLDRMSNorm

__all__ = ["CHAIN_MODULES", "ExactAccumulation", "unsupported_reason"]

#: module types (exact) whose parameters' gradients go into chains
CHAIN_MODULES = (ZeroKLDLinear, ZeroKLDLMHead, ZeroKLDRMSNorm, ZeroKLDEmbedding)


def _params(model: torch.nn.Module):
    for mod_name, module in model.named_modules():
        for name, p in module._parameters.items():
            if p is not None and p.requires_grad:
                yield mod_name, module, name, p


def _own_class(module: torch.nn.Module) -> type:
    """The module's class, under the subclass FSDP2's ``fully_shard`` gives it (``FSDP<Class>``)."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))


def unsupported_reason(model: torch.nn.Module, dtype: torch.dtype) -> str | None:
    """Why exact accumulation cannot chain this model's gradients (``None``: it can): a parameter outside
    :data:`CHAIN_MODULES`, a vocab-parallel lm_head, a parameter sharded over more than one rank, or no kernel
    coverage for ``dtype`` on this machine."""
    from torch.distributed.tensor import DTensor

    if not chain_available(dtype):
        return f"this machine's kernels do not cover {dtype} gradients (shared_numerics.grad_chain.chain_available)"
    for mod_name, module, name, p in _params(model):
        if _own_class(module) not in CHAIN_MODULES:
            return f"{mod_name}.{name} belongs to a {_own_class(module).__name__}"
        if isinstance(module, ZeroKLDLMHead) and module.vocab_parallel:
            return "the vocab-parallel lm_head (tp_k_block)"
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

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype):
        reason = unsupported_reason(model, dtype)
        if reason is not None:
            raise ValueError(f"exact accumulation with batched passes: {reason}")
        self._owners = [(module, name, p) for _, module, name, p in _params(model)]
        self.token_multiple = CHAIN_K_MULTIPLE if dtype == torch.bfloat16 else 1
        self._chains: list[GradChain] | None = None

    def attach(self) -> None:
        """Give every module its chains (created from zero at the first micro-batch of a step)."""
        if self._chains is None:
            self._chains = [GradChain(p.shape) for _, _, p in self._owners]
        for (module, name, _), chain in zip(self._owners, self._chains, strict=True):
            module.__dict__.setdefault("_zerokld_grad_chains", {})[name] = chain

    def detach(self) -> None:
        """Take the chains back from the modules and write the parameters' ``.grad``."""
        from torch.distributed.tensor import DTensor

        for module, _, _ in self._owners:
            module.__dict__.pop("_zerokld_grad_chains", None)
        if self._chains is None:
            return
        sums: dict[int, tuple[torch.nn.Parameter, torch.Tensor]] = {}
        for (_, _, p), chain in zip(self._owners, self._chains, strict=True):
            if id(p) in sums:  # tied (embedding and lm_head): the chains' sum, in module order
                sums[id(p)] = (p, sums[id(p)][1] + chain.acc)
            else:
                sums[id(p)] = (p, chain.acc)
        for p, g in sums.values():
            g = g.to(p.dtype)  # float32 master weights: the accumulator itself
            p.grad = DTensor.from_local(g, p.device_mesh, p.placements, run_check=False) if isinstance(
                p, DTensor) else g

    def reset(self) -> None:
        """The next :meth:`attach` starts new chains from zero (after an optimizer step zeroed the gradients)."""
        self._chains = None
