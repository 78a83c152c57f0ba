"""Exact gradient accumulation for the trainer's streamed ``forward_backward``: batched passes, token-order chains.

:meth:`titan_plugin.rl.RLTrainer.forward_backward` promises that calls on consecutive micro-batches leave exactly the
``.grad`` bits of one call on their concatenation. The general way (any model) runs one rollout at a time and lets
autograd add each rollout's gradient — exact, and ~6-10x slower than one batched step. Where every parameter belongs to
a zerokld module that can route its gradient into a :class:`shared_numerics.grad_chain.GradChain` (zerokld linear,
lm_head with or without fused log-probs, FP8 QAT linear, RMSNorm, embedding, the LoRA adapters of
:class:`titan_plugin.lora.ZeroKLDLoRALinear`, the router and experts of :class:`titan_plugin.overrides.ZeroKLDMoE`,
MLA's absorbed ``kv_norm`` and ``wkv_b`` in :class:`titan_plugin.overrides.ZeroKLDMLAAttention`) and
the machine's kernels cover the forward dtype (:func:`shared_numerics.grad_chain.chain_available`), a call instead runs
**one batched forward and backward** of its rollouts, and each gradient element is one float32 chain over the tokens in
batch order that the next call continues. The per-token quantities (``dY``, ``X``) are batch-invariant, so the chains
see the same numbers in the same order whatever the grouping.

A LoRA adapter's chain is the gradient of the operand the op sees (``A`` zero-padded to the engine's rank ``R``,
``B * scaling`` padded likewise); its parameter's gradient is the first ``r`` rows or columns of the sums, ``B``'s
times the scaling — applied once to the step's sums, so every grouping gets the same bits.

MLA's ``wkv_b`` is read as a tensor, one linear per head for the absorbed queries (``W_UK[h]ᵀ``) and one for the
latent output (``W_UV[h]``): its chain holds one block per head and linear
(:func:`shared_numerics.mla.kv_b_chain_shape`), laid out as the weight when written; ``kv_norm``'s gain chain is the
norm module's, fed by the attention.

An MoE expert's chain runs over the tokens routed to it, in token order; their number is any, so its products are
float32 (:attr:`shared_numerics.grad_chain.GradChain.float32_products`: bf16 values widened exactly) where the
dense chains of a bf16 model use the AMX kernel's 32-token steps.

Data parallelism (FSDP2 over TorchTitan's ``dp_shard`` / ``dp_replicate`` ranks): the chains are handed from rank to
rank in rank order, so the gradients are one rank's on the concatenation of the ranks' rollouts (see
:class:`ExactAccumulation`).

Expert parallelism: each rank's experts keep chains of their own (the EP exchange delivers an expert's rows in one
rank's order). Tensor parallelism (``tp_k_block``): each rank's shards keep chains of their own — column- and
row-parallel weights, the vocab-parallel embedding and lm_head (fused or not), each MoE expert's rows / columns
(TP-split experts: the down projection's chain takes ``dYᵀ act`` of this rank's subtree root, whose gradient is the
output's), the norm gains over the replicated activations; a gain fed a head shard (Qwen3's q/k norms,
:class:`titan_plugin.overrides.ZeroKLDRMSNorm` ``head_tree``) keeps one chain per head, the heads added with the
TP-aligned tree when written — so any grouping of a TP run's micro-batches gives the same bits, and the same as TP 1's.
With FSDP as well, each TP rank's chains are handed between its data-parallel ranks like the rest, and each rank takes
its FSDP block of its TP shard's sums.

Context parallelism (with data parallelism or not, HSDP's replicas included): each pass is one rollout's slice, recorded
on every rank; the passes are replayed in one rank's token order — data-parallel group by group, rollout by rollout,
``cp`` rank by rank (rank 0's positions come first) — the chains travelling between the ranks (:meth:`ExactAccumulation.
_hand_off_passes`).

Under TP x EP (``tp_k_block``: TorchTitan borrows the TP ranks for EP, every rank holds every token) each rank's whole
experts keep chains of their own too: each rank exchanges its share of the tokens, so an expert receives every
token's rows in token order; their down projections' chains take ``dYᵀ act`` of the TP-invariant tree's root. With
FSDP as well (FSDP x TP x EP: each data-parallel group's TP ranks hold that group's tokens) the experts' chains are
handed between the data-parallel ranks of each EP rank like the TP shards', and each rank takes its FSDP block over
``efsdp``.

Not covered (the general way runs): bf16 on CPUs whose bf16 GEMMs go through oneDNN (AVX-512 without AMX). MLA under
tensor parallelism is covered: ``wkv_b``'s per-head chain holds this rank's heads.

Source: :mod:`shared_numerics.grad_chain`; TorchTitan's FSDP2 gradient path (``fully_shard``: a parameter whose
unsharded gradient is ``None`` is skipped by the post-backward reduce-scatter, so the chains' sums are written to the
sharded parameters' ``.grad`` directly).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shared_numerics.grad_chain import CHAIN_K_MULTIPLE, GradChain, chain_available

from .lora import ZeroKLDLoRALinear
from .overrides import (
    ZeroKLDEmbedding,
    ZeroKLDFp8Linear,
    ZeroKLDLinear,
    ZeroKLDLMHead,
    ZeroKLDMLAAttention,
    ZeroKLDMoE,
    ZeroKLDRMSNorm,
    ZeroKLDRowParallelLinear,
)

__all__ = [
    "CHAIN_MODULES",
    "DATA_PARALLEL_DIMS",
    "EXPERT_DATA_PARALLEL_DIMS",
    "ExactAccumulation",
    "unsupported_reason",
]

#: module types (exact) whose parameters' gradients go into chains
CHAIN_MODULES = (
    ZeroKLDLinear,
    ZeroKLDFp8Linear,
    ZeroKLDLMHead,
    ZeroKLDRMSNorm,
    ZeroKLDEmbedding,
    ZeroKLDRowParallelLinear,
)


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
    (float32) into the parameter's gradient. ``local``: the chain is this rank's model-parallel shard's (``shape``
    the local tensor's: TP shards and TP-replicated weights, EP's experts — the EP exchange feeds them in one rank's
    order), never handed between ranks. ``tp``: a tensor-parallel site (``shape``: this rank's TP shard, what the
    module computes with once FSDP has all-gathered it); with data parallelism its chain is handed between the
    data-parallel ranks of this TP rank (:class:`ExactAccumulation`)."""

    feeder: torch.nn.Module
    name: str
    param: torch.nn.Parameter
    shape: tuple[int, ...]
    finish: Callable[[torch.Tensor], torch.Tensor] | None = None
    float32_products: bool = False
    local: bool = False
    tp: bool = False


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
    if not _model_parallel(p):
        return _Site(moe, name, p, tuple(p.shape), float32_products=True)
    names = p.device_mesh.mesh_dim_names or ()
    if "ep" in names and p.device_mesh["ep"].size() > 1:  # TorchTitan EP: this rank's E / EP experts
        return _Site(moe, name, p, _mesh_dim_shape(p, "ep"), float32_products=True, local=True)
    # TP: this rank's shard of every expert (the I rows / columns it holds)
    return _Site(moe, name, p, _tp_shape(p), float32_products=True, local=True, tp=True)


#: DeviceMesh dimensions whose shards (or replicas) keep chains of their own: tensor and expert parallelism
MODEL_PARALLEL_DIMS = ("tp", "ep")


def _model_parallel(p) -> bool:
    """Whether ``p`` is a DTensor over TorchTitan's ``tp`` or ``ep`` mesh dimension (of more than one rank)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return False
    names = p.device_mesh.mesh_dim_names or ()
    return any(d in names and p.device_mesh[d].size() > 1 for d in MODEL_PARALLEL_DIMS)


def _fed_by_another(
    model: torch.nn.Module | list[torch.nn.Module],
) -> dict[int, Callable[[str, torch.nn.Parameter], _Site | None]]:
    """``id(module) -> site of (name, param)`` for modules whose parameters another module's forward uses: the
    adapters of a :class:`ZeroKLDLoRALinear`, the experts of a :class:`ZeroKLDMoE`, MLA's ``wkv_b`` (absorbed per
    head by :class:`ZeroKLDMLAAttention`; its ``kv_norm`` is an ordinary norm site, whose chain the attention
    feeds)."""
    out = {}
    for m in (m for part in _parts(model) for m in part.modules()):
        if _own_class(m) is ZeroKLDLoRALinear:
            for which in ("lora_a", "lora_b"):
                out[id(getattr(m, which))] = functools.partial(_adapter_site, m, which)
        elif _own_class(m) is ZeroKLDMoE:
            out[id(m.routed_experts.inner_experts)] = functools.partial(_expert_site, m)
        elif issubclass(_own_class(m), ZeroKLDMLAAttention) and _own_class(m.wkv_b) in CHAIN_MODULES:
            out[id(m.wkv_b)] = functools.partial(_kv_b_site, m)
        for norm, heads in ((getattr(m, "q_norm", None), "n_heads"), (getattr(m, "k_norm", None), "n_kv_heads")):
            if norm is not None and _own_class(norm) is ZeroKLDRMSNorm and norm.head_tree:
                out[id(norm)] = functools.partial(_head_norm_site, norm, getattr(m, heads))
    return out


def _head_norm_site(norm: torch.nn.Module, heads: int, name: str, p: torch.nn.Parameter) -> _Site | None:
    """A per-head norm's gain (:class:`ZeroKLDRMSNorm` ``head_tree``, Qwen3's q/k norms over ``heads`` heads): its
    chain holds one sum per head of this rank's ``heads / TP`` (``[heads / TP, D]``); written, the heads are added
    with the TP-aligned tree and the TP ranks' subtree roots gathered (:func:`shared_numerics.norm.
    head_tree_gain_grad`): the gradient TP 1 has."""
    from shared_numerics.norm import head_tree_gain_grad

    from .tensor_parallel import _gather_over

    if name != "weight":
        return None
    tp, gather = 1, None
    if _model_parallel(p):  # the gain replicated over the TP ranks, each fed its own heads
        mesh = p.device_mesh["tp"]
        tp, gather = mesh.size(), _gather_over(mesh)
    shape = (heads // tp, p.shape[-1])
    return _Site(norm, name, p, shape, lambda acc: head_tree_gain_grad(acc, gather), local=tp > 1, tp=tp > 1)


def _kv_b_site(mla: torch.nn.Module, name: str, p: torch.nn.Parameter) -> _Site | None:
    """MLA's ``kv_b_proj`` weight ``[H (Dn + Dv), R]``: its chain is one block per head
    (:func:`shared_numerics.mla.kv_b_chain_shape`: ``W_UK[h]ᵀ``'s gradient, then ``W_UV[h]``'s), fed by
    :class:`ZeroKLDMLAAttention`'s absorbed linears; the sums are laid out as the weight when written
    (:func:`shared_numerics.mla.kv_b_grad_from_chain`). Under tensor parallelism (the weight ``Shard(0)`` by head on
    the ``tp`` mesh dimension) the chain holds this rank's heads. None (unsupported) for a bias."""
    from shared_numerics.mla import kv_b_chain_shape, kv_b_grad_from_chain

    if name != "weight":
        return None
    d = mla.zerokld.dims
    tp = _model_parallel(p)
    rows = _tp_shape(p)[0] if tp else p.shape[0]  # this rank's heads' rows under TP
    heads, rest = divmod(rows, d.qk_nope_head_dim + d.v_head_dim)
    shape = kv_b_chain_shape(heads, d.qk_nope_head_dim, d.v_head_dim, d.kv_lora_rank)
    if rest or p.shape[1] != d.kv_lora_rank:
        return None
    return _Site(
        mla.wkv_b,
        name,
        p,
        shape,
        lambda acc: kv_b_grad_from_chain(acc, d.qk_nope_head_dim, d.v_head_dim),
        local=tp,
        tp=tp,
    )


def _sites(model: torch.nn.Module | list[torch.nn.Module]):
    """``(mod_name, module, name, site)`` for every trainable parameter (``site`` ``None``: no module feeds a
    chain)."""
    others = _fed_by_another(model)
    for mod_name, module, name, p in _params(model):
        if id(module) in others:
            yield mod_name, module, name, others[id(module)](name, p)
        elif _own_class(module) in CHAIN_MODULES:
            if _model_parallel(p):  # TP: this rank's shard (or replica), its own chain
                yield mod_name, module, name, _Site(module, name, p, _tp_shape(p), local=True, tp=True)
            else:
                yield mod_name, module, name, _Site(module, name, p, tuple(p.shape))
        else:
            yield mod_name, module, name, None


def _expert_parallel_site(site: _Site) -> bool:
    """An MoE block's experts split over TorchTitan's ``ep`` mesh dimension (more than one rank)."""
    from torch.distributed.tensor import DTensor

    p = site.param
    if not (isinstance(site.feeder, ZeroKLDMoE) and isinstance(p, DTensor)):
        return False
    dims = p.device_mesh.mesh_dim_names or ()
    return "ep" in dims and p.device_mesh["ep"].size() > 1


def _tp_x_ep(site: _Site) -> bool:
    """Experts under TP x EP (``tp_k_block``; TorchTitan's EP over the TP ranks): every rank holds its data-parallel
    group's tokens, and its experts' chains run over that group's tokens; with data parallelism they are handed
    between the data-parallel ranks of each EP rank like the TP shards' chains."""
    return _expert_parallel_site(site) and site.feeder.k_block is not None


def _tp_placement(p):
    """DTensor ``p``'s placement over TorchTitan's ``tp`` mesh dimension."""
    return p.placements[p.device_mesh.mesh_dim_names.index("tp")]


def _tp_shape(p) -> tuple[int, ...]:
    """This rank's tensor-parallel shard of DTensor ``p`` (on the ``tp`` mesh dimension alone; FSDP's sharding over
    data-parallel ranks on top of it left out): the shape the zerokld TP modules compute with."""
    return _mesh_dim_shape(p, "tp")


def _mesh_dim_shape(p, dim: str) -> tuple[int, ...]:
    """This rank's shard of DTensor ``p`` over mesh dimension ``dim`` alone (``tp``: a TP shard; ``ep``: this EP
    rank's experts), FSDP's sharding over the data-parallel ranks on top of it left out; ``p``'s local shape where
    its mesh has no ``dim``."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    names = p.device_mesh.mesh_dim_names or ()
    if dim not in names:
        return tuple(p.to_local().shape)
    placement = p.placements[names.index(dim)]
    shape, _ = compute_local_shape_and_global_offset(p.shape, p.device_mesh[dim], [placement])
    return tuple(shape)


#: DeviceMesh dimensions over which FSDP2 shards or replicates parameters (TorchTitan's ``ParallelDims``): data
#: parallelism, which the chains' hand-off between data-parallel ranks covers
DATA_PARALLEL_DIMS = frozenset({"dp_replicate", "dp_shard", "fsdp"})
#: the same for the experts' mesh (TorchTitan's sparse mesh: FSDP over ``efsdp``, the data-parallel ranks of each
#: EP rank when EP borrows the TP ranks)
EXPERT_DATA_PARALLEL_DIMS = frozenset({"dp_replicate", "efsdp"})


def unsupported_reason(
    model: torch.nn.Module | list[torch.nn.Module],
    dtype: torch.dtype,
    data_parallel: bool = False,
) -> str | None:
    """Why exact accumulation cannot chain this model's gradients (``None``: it can): a parameter no zerokld module
    feeds into a chain (outside :data:`CHAIN_MODULES`, the LoRA adapters, the MoE experts and MLA's ``wkv_b``), a
    parameter sharded over more than one
    rank — but over the data-parallel mesh dimensions :data:`DATA_PARALLEL_DIMS` when ``data_parallel`` (the chains
    are handed from rank to rank), experts over TorchTitan's ``ep`` dimension alone when ``data_parallel``, TP x EP
    experts over ``ep`` (with FSDP over :data:`EXPERT_DATA_PARALLEL_DIMS` too when ``data_parallel``), or a
    tensor-parallel shard over ``tp`` (its own chain; with FSDP too when ``data_parallel``) — or no kernel coverage
    for ``dtype`` on this machine."""
    from torch.distributed.tensor import DTensor

    if not chain_available(dtype):
        return f"this machine's kernels do not cover {dtype} gradients (shared_numerics.grad_chain.chain_available)"
    for mod_name, module, name, site in _sites(model):
        if site is None:
            return f"{mod_name}.{name} belongs to a {_own_class(module).__name__}"
        p = site.param
        expert_parallel = _expert_parallel_site(site)
        if isinstance(p, DTensor) and p.device_mesh.size() != 1:
            mesh = p.device_mesh
            dims = set(mesh.mesh_dim_names or ())
            if expert_parallel:
                others = sorted(d for d in dims - {"ep"} if mesh[d].size() > 1)
                if site.feeder.k_block is not None:  # TP x EP: EP over the TP ranks, every rank every token
                    # with FSDP (efsdp: the data-parallel ranks of each EP rank) the chains are handed on like TP's
                    if others and not (data_parallel and set(others) <= EXPERT_DATA_PARALLEL_DIMS):
                        return f"{mod_name}.{name}: TP x EP experts sharded over {', '.join(others)}"
                elif not data_parallel or others:  # EP borrows the data-parallel ranks
                    return f"{mod_name}.{name}: experts sharded over {', '.join(others) or 'ep'} without the hand-off"
            elif site.local:  # tensor parallelism (with FSDP: the chains handed between data-parallel ranks)
                others = sorted(d for d in dims - {"tp"} if mesh[d].size() > 1)
                if others and not (data_parallel and set(others) <= DATA_PARALLEL_DIMS):
                    return f"{mod_name}.{name}: tensor parallelism with {', '.join(others)} (not covered yet)"
            elif not (data_parallel and dims <= DATA_PARALLEL_DIMS):
                return f"{mod_name}.{name} is sharded over {mesh.size()} ranks ({', '.join(sorted(dims))})"
    return None


class ExactAccumulation:
    """The chains of one model's parameters between two optimizer steps.

    :meth:`attach` before a micro-batch's forward (the zerokld modules read their chains from it,
    :func:`titan_plugin.overrides.grad_chains`), :meth:`detach` after its backward, :meth:`write_grads` at the end of
    each ``forward_backward`` call: it writes each parameter's ``.grad`` (float32; the chain's accumulator itself, or
    for a tied parameter the sum of its modules' chains in module order). :meth:`reset` starts the next step's chains
    from zero.

    **Data parallelism** (``data_parallel``: TorchTitan's ``batch`` DeviceMesh, FSDP2 sharding the parameters): the
    one-rank batch is the concatenation of the data-parallel ranks' rollouts in rank order, so each chain must pass
    through rank 0's tokens, then rank 1's, and so on. Each rank runs its forward and backward at once; rank 0 adds
    into the chains as it goes, the other ranks record their additions (:attr:`shared_numerics.grad_chain.GradChain.
    log`: the operands, ``dY`` and ``X``, kept until then — memory of the order of the activations). At
    :meth:`write_grads`, rank ``r`` receives the chains (one flat float32 buffer) from rank ``r - 1``, replays its
    additions into them, sends them to ``r + 1``; the last rank broadcasts the sums, so every rank holds the whole
    gradients — the next call continues from them on rank 0, :meth:`full_grads` gives the one-rank gradient norm —
    and takes its FSDP shard as ``.grad``. The weight-gradient GEMMs of ranks ``1..n-1`` thus run one after another;
    forward, ``dX`` and the optimizer step run in parallel. Traffic per call: ``n`` times the gradients' size.

    Attributes:
        token_multiple: the micro-batch layout's sequence length must be a multiple of this (bf16: the AMX
            kernel's 32-token K steps; float32: 1).
        data_parallel: the data-parallel DeviceMesh (1-D) the chains are handed over, or ``None`` (one rank).
    """

    def __init__(
        self,
        model: torch.nn.Module | list[torch.nn.Module],
        dtype: torch.dtype,
        data_parallel=None,
        context_parallel=None,
    ) -> None:
        if data_parallel is not None and data_parallel.size() == 1:
            data_parallel = None
        #: under context parallelism: ``(cp mesh, batch mesh or None)``; every pass is one rollout and a segment of
        #: its own (:meth:`_hand_off_passes`)
        self.context_parallel = context_parallel
        self._segments: list[list] = []
        reason = unsupported_reason(model, dtype, data_parallel is not None)
        if reason is not None:
            raise ValueError(f"exact accumulation with batched passes: {reason}")
        self._sites = [site for *_, site in _sites(model)]
        if data_parallel is not None:  # FSDP x TP (x EP): the TP shards' and experts' chains are handed on
            self._sites = [dataclasses.replace(s, local=False) if s.tp or _tp_x_ep(s) else s for s in self._sites]
        self.token_multiple = CHAIN_K_MULTIPLE if dtype == torch.bfloat16 else 1
        self.data_parallel = data_parallel
        self._flat: torch.Tensor | None = None  # every chain's accumulator, one float32 buffer (the hand-off's)
        self._chains: list[GradChain] | None = None
        self._log: list | None = None  # a data-parallel rank > 0: the additions to replay at write_grads
        self._full: dict[int, torch.Tensor] = {}  # id(param) -> its whole gradient (data parallelism)
        self._tp_ids = {id(site.param) for site in self._sites if site.tp}  # tensor-parallel parameters

    def attach(self) -> None:
        """Give every module its chains (created from zero at the first micro-batch of a step)."""
        if self._chains is None:
            sizes = [math.prod(site.shape) for site in self._sites if not site.local]
            self._flat = torch.zeros(sum(sizes), dtype=torch.float32)
            accs = iter(torch.split(self._flat, sizes))
            self._chains = [
                GradChain(
                    site.shape,
                    site.float32_products,
                    acc=None if site.local else next(accs).view(site.shape),
                )
                for site in self._sites
            ]
        if self.context_parallel is not None:  # every rank records each pass (one rollout's slice) on its own
            self._log = []
            self._segments.append(self._log)
        elif self.data_parallel is not None and self.data_parallel.get_local_rank() > 0 and self._log is None:
            self._log = []
        for site, chain in zip(self._sites, self._chains, strict=True):
            chain.log = None if site.local else self._log
            site.feeder.__dict__.setdefault("_zerokld_grad_chains", {})[site.name] = chain

    def detach(self) -> None:
        """Take the chains back from the modules (after a micro-batch's backward)."""
        for site in self._sites:
            site.feeder.__dict__.pop("_zerokld_grad_chains", None)

    def write_grads(self) -> None:
        """After a ``forward_backward`` call's micro-batches (every data-parallel rank calls it, also one without
        rollouts): the hand-off between data-parallel ranks, then every parameter's ``.grad`` (a DTensor parameter:
        its shard of the sums)."""
        from torch.distributed.tensor import DTensor

        self.detach()
        if self.data_parallel is not None:
            if self._chains is None:
                self.attach()
                self.detach()
            self._hand_off()
        if self._chains is None:
            return
        sums: dict[int, tuple[_Site, torch.Tensor]] = {}
        for site, chain in zip(self._sites, self._chains, strict=True):
            p, g = site.param, chain.acc if site.finish is None else site.finish(chain.acc)
            if chain.partial:  # this rank's share: the ranks' chains summed (a copy: the chain goes on)
                g = _sum_over_mesh(g, p)
            if id(p) in sums:  # tied (embedding and lm_head): the chains' sum, in module order
                sums[id(p)] = (site, sums[id(p)][1] + g)
            else:
                sums[id(p)] = (site, g)
        self._full = {}
        for site, g in sums.values():
            p = site.param
            g = g.to(p.dtype)  # float32 master weights: the accumulator itself
            if isinstance(p, DTensor):
                if self.data_parallel is not None and not site.local and _tp_x_ep(site):
                    g = _efsdp_shard_of_ep_shard(g, p).clone()  # its whole: .grad.full_tensor() (full_grads)
                elif self.data_parallel is not None and not site.local:
                    self._full[id(p)] = g
                    shard = _fsdp_shard_of_tp_shard(g, p) if site.tp else _local_shard(g, p)
                    g = shard.clone()  # optim_step divides .grad in place: not the whole one's storage
                p.grad = DTensor.from_local(
                    g, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
                )
            else:
                p.grad = g

    def full_grads(self, params: list[torch.nn.Parameter], divisor: int | None = None) -> list[torch.Tensor] | None:
        """Under data parallelism, the whole gradients of ``params`` (those with a ``.grad``, in order) after the last
        :meth:`write_grads`, divided by ``divisor`` as ``.grad`` was in place (``optim_step``'s ``token_mean``) —
        every rank's the same, one rank's bits; EP-sharded experts all-gathered; under TP, DTensors on the ``tp``
        mesh dimension, the gradients TP alone has — else ``None``."""
        from torch.distributed.tensor import DTensor

        if self.data_parallel is None:
            return None
        out = []
        for p in (p for p in params if p.grad is not None):
            if id(p) in self._full:
                g = self._full[id(p)]
                g = g if divisor is None else g.div(divisor)
                # this rank's TP shard: a DTensor on the TP mesh, as the gradient is at TP alone
                if id(p) in self._tp_ids:
                    g = DTensor.from_local(
                        g, p.device_mesh["tp"], [_tp_placement(p)], run_check=False, shape=p.shape, stride=p.stride()
                    )
                out.append(g)
            else:  # already divided in place (an expert's local sums are its .grad)
                out.append(p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
        return out

    def _hand_off(self) -> None:
        import torch.distributed as dist

        from shared_numerics.grad_chain import replay

        if self.context_parallel is not None:
            self._hand_off_passes()
            return
        mesh = self.data_parallel
        group, rank, size = mesh.get_group(), mesh.get_local_rank(), mesh.size()
        if rank > 0:  # continue the chains where rank - 1 left them
            dist.recv(self._flat, group=group, group_src=rank - 1)
            replay(self._log)
        if rank < size - 1:
            dist.send(self._flat, group=group, group_dst=rank + 1)
        dist.broadcast(self._flat, group=group, group_src=size - 1)

    def _hand_off_passes(self) -> None:
        """Context parallelism: the recorded passes replayed in one rank's token order — data-parallel group by
        group, within a group rollout by rollout, within a rollout cp rank by rank (its slices in position order) —
        the chains travelling between the ranks of :attr:`data_parallel` (every cp and data-parallel rank) from
        each segment's owner to the next; the last owner broadcasts the sums."""
        import torch.distributed as dist

        from shared_numerics.grad_chain import replay

        cp, batch = self.context_parallel
        group, me = self.data_parallel.get_group(), self.data_parallel.get_local_rank()
        mine = (0 if batch is None else batch.get_local_rank(), cp.get_local_rank(), len(self._segments))
        every: list = [None] * self.data_parallel.size()
        dist.all_gather_object(every, mine, group=group)
        owner = {(d, c): r for r, (d, c, _) in enumerate(every)}
        order = sorted({(d, i, c) for d, c, n in every for i in range(n)})
        previous = None
        for d, i, c in order:
            rank = owner[(d, c)]
            if previous is not None and previous != rank:
                if me == previous:
                    dist.send(self._flat, group=group, group_dst=rank)
                elif me == rank:
                    dist.recv(self._flat, group=group, group_src=previous)
            if me == rank:
                replay(self._segments[i])
            previous = rank
        if previous is not None:
            dist.broadcast(self._flat, group=group, group_src=previous)
        self._segments = []

    def reset(self) -> None:
        """The next :meth:`attach` starts new chains from zero (after an optimizer step zeroed the gradients)."""
        self._chains = self._flat = None
        self._log = None
        self._segments = []
        self._full = {}


def _sum_over_mesh(g: torch.Tensor, p) -> torch.Tensor:
    """``g`` summed over the ranks of DTensor ``p``'s tensor-parallel mesh dimension (a copy; gloo's all-reduce:
    at TP 2 one commutative addition, the same bits on both ranks)."""
    import torch.distributed as dist

    total = g.clone()
    dist.all_reduce(total, group=p.device_mesh.get_group("tp"))
    return total


def _local_shard(full: torch.Tensor, p) -> torch.Tensor:
    """This rank's block of ``full`` (the whole of DTensor ``p``), as ``p``'s placements (FSDP2: ``Shard(0)``,
    ``torch.chunk`` blocks) lay it out."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(full.shape, p.device_mesh, p.placements)
    block = full[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
    if block.shape != p.to_local().shape:
        raise RuntimeError(
            f"exact accumulation: shard {tuple(block.shape)} of {tuple(full.shape)} is not the parameter's"
        )
    return block


def _efsdp_shard_of_ep_shard(ep_shard: torch.Tensor, p) -> torch.Tensor:
    """This rank's block of ``ep_shard`` (its EP rank's experts' gradient ``[E / EP, ...]``, whole over the
    data-parallel ranks) as FSDP2 lays it out over TorchTitan's ``efsdp`` mesh dimension: ``torch.chunk`` blocks of
    the dimension the expert placement names (``Shard(0)``, or ``Shard(1)`` when ``efsdp x ep`` exceeds the expert
    count: ``torchtitan/distributed/fsdp.py`` ``apply_fsdp_to_decoder``).

    Raises:
        RuntimeError: the block is not the shape of ``p``'s local tensor (another layout)."""
    return _fsdp_block(ep_shard, p, _fsdp_split(p, {"efsdp"}), "the experts")


def _fsdp_block(whole: torch.Tensor, p, split, what: str) -> torch.Tensor:
    """This rank's FSDP block of ``whole`` (``p``'s model-parallel shard, whole over the data-parallel ranks):
    ``split = (dim, mesh)``: ``torch.chunk`` blocks of ``dim`` over ``mesh``, this rank's (FSDP2's layout); ``None``:
    ``whole`` itself.

    Raises:
        RuntimeError: the block is not the shape of ``p``'s local tensor (another layout)."""
    block = whole
    if split is not None:
        dim, mesh = split
        blocks = torch.chunk(whole, mesh.size(), dim=dim)
        rank = mesh.get_local_rank()
        block = blocks[rank] if rank < len(blocks) else whole.narrow(dim, 0, 0)
    if block.shape != p.to_local().shape:
        raise RuntimeError(
            f"exact accumulation: FSDP block {tuple(block.shape)} of {what} {tuple(whole.shape)} is not the "
            f"parameter's {tuple(p.to_local().shape)}"
        )
    return block


def _fsdp_shard_of_tp_shard(tp_shard: torch.Tensor, p) -> torch.Tensor:
    """This rank's block of ``tp_shard`` (its TP shard of DTensor ``p``, whole over the data-parallel ranks) as FSDP2
    lays it out: ``torch.chunk`` blocks of the dimension its data-parallel placement names (``Shard(0)``, or FSDP2's
    ``_StridedShard(0)`` over a column-parallel shard), over that mesh dimension alone — under HSDP the
    ``dp_replicate`` dimension replicates, so a replica's ranks split the shard among themselves, not over the whole
    ``batch`` mesh (``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``: FSDP2 shards a DTensor parameter's
    local tensor on dimension 0).

    Raises:
        RuntimeError: the block is not the shape of ``p``'s local tensor (another layout)."""
    return _fsdp_block(tp_shard, p, _fsdp_split(p, DATA_PARALLEL_DIMS), "the TP shard")


def _fsdp_split(p, dims) -> tuple[int, object] | None:
    """``(dim, mesh)`` of the one mesh dimension among ``dims`` over which FSDP2 shards DTensor ``p`` (its placement
    ``Shard``, or FSDP2's ``_StridedShard``, which is not ``is_shard()``: read by its ``dim``), for
    :func:`_fsdp_block`; ``None`` when ``p`` is only replicated there.

    Raises:
        RuntimeError: ``p`` sharded over more than one of ``dims``."""
    names = p.device_mesh.mesh_dim_names or ()
    splits = [
        (dim, p.device_mesh[name])
        for name, placement in zip(names, p.placements, strict=True)
        if name in dims and (dim := getattr(placement, "dim", None)) is not None
    ]
    if len(splits) > 1:
        raise RuntimeError(f"exact accumulation: a parameter sharded over {len(splits)} data-parallel dimensions")
    return splits[0] if splits else None
