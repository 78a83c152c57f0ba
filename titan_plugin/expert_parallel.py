"""TorchTitan expert parallelism (``parallelism.expert_parallel_degree``) on the zerokld MoE.

TorchTitan shards each MoE's routed experts over its ``ep`` mesh (``w1_EFD`` / ``w3_EFD`` / ``w2_EDF`` as DTensors
``Shard(0)``: rank ``r`` holds experts ``[r E/EP, (r + 1) E/EP)``) and, in stock TorchTitan, moves tokens with its
``AllToAllTokenDispatcher``. :class:`titan_plugin.overrides.ZeroKLDMoE` never calls TorchTitan's experts module, so
the exchange is :class:`shared_numerics.moe.ExpertParallel` over the same mesh, with torch's differentiable
functional all-to-all: each (token, slot) row goes to its expert's rank and comes back, and the combine runs on the
token's rank in slot order — a rank's log-probs are the same bits at any EP size. The router is replicated.
Source: ``torchtitan/models/common/token_dispatcher.py`` (``AllToAllTokenDispatcher``), ``moe.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

__all__ = [
    "ExpertParallelInputs",
    "expert_parallel_inputs",
    "expert_shards",
    "is_expert_parallel",
    "moe_expert_parallel",
]


def is_expert_parallel(weight) -> bool:
    """Whether a stacked expert weight is TorchTitan's expert-parallel shard (a DTensor ``Shard(0)`` on one mesh
    dimension)."""
    return isinstance(weight, DTensor) and tuple(weight.placements) == (Shard(0),)


def _all_to_all(mesh):
    from torch.distributed import _functional_collectives as funcol

    def exchange(t: torch.Tensor, output_splits, input_splits) -> torch.Tensor:
        if output_splits is None:  # the split sizes themselves: integers, no gradient
            out = funcol.all_to_all_single(t, None, None, group=mesh)
        else:
            out = funcol.all_to_all_single_autograd(t, output_splits, input_splits, group=mesh)
        return funcol.wait_tensor(out)

    return exchange


def moe_expert_parallel(
    x_BLD: torch.Tensor,
    router_weight: torch.Tensor,
    w_gate: DTensor,
    w_up: DTensor,
    w_down: DTensor,
    top_k: int,
    renormalize: bool,
    expert_ids: torch.Tensor | None,
    fp8: str | None = None,
    chains: dict | None = None,
    k_block: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`shared_numerics.moe.moe_forward` with the experts split over TorchTitan's EP mesh.

    Args:
        x_BLD: ``[B, L, D]`` this rank's tokens (plain tensors: EP borrows the data-parallel ranks), or under
            tensor parallelism a ``Replicate`` DTensor on the TP mesh, whose ranks must be the EP ranks (TP x EP:
            each rank exchanges its share of the tokens, the outputs all-gathered; ``out`` then a ``Replicate``
            DTensor too).
        router_weight: ``[E, D]`` (replicated).
        w_gate, w_up, w_down: the stacked experts, DTensors ``Shard(0)`` on the EP mesh.
        top_k, renormalize, expert_ids, fp8: as :func:`~shared_numerics.moe.moe_forward` (replayed ids are global).
        chains: exact accumulation (:mod:`titan_plugin.exact_accumulation`): the router's chain and this rank's
            experts' (``[E / EP, ...]``), as :func:`~shared_numerics.moe.moe_forward` takes them. Under TP x EP each
            rank's experts receive every token's rows (each rank's share, rank 0's first: token order).
        k_block: :attr:`shared_numerics.NumericsMode.tp_k_block` (TP x EP): each whole expert's down projection sums
            with TP 1's tree.

    Returns:
        ``(out [B*L, D], expert_ids [B*L, top_k])``, bitwise what one rank holding every expert computes.

    Raises:
        ValueError: the experts do not split evenly over the EP ranks (``E % EP``). NotImplementedError: TP x EP
            with other EP ranks than the TP ranks.
    """
    import shared_numerics.moe as sn_moe

    e = expert_parallel_inputs(x_BLD, (w_gate, w_up, w_down), router_weight.shape[0])
    router = router_weight.to_local() if isinstance(router_weight, DTensor) else router_weight
    b, seq, d = e.x.shape
    x = e.x.reshape(b * seq, d)
    out, ids = sn_moe.moe_forward(
        x,
        router,
        *e.weights,
        top_k,
        renormalize,
        expert_ids,
        k_block=k_block,
        experts_x=None if e.experts_input is None else e.experts_input(x),
        chains=chains,
        fp8=fp8,
        expert_parallel=e.ep,
    )
    return e.output(out), ids


@dataclass(frozen=True)
class ExpertParallelInputs:
    """What an MoE block under TorchTitan EP (or TP x EP) hands :mod:`shared_numerics.moe`: ``x`` ``[B, L, D]`` this
    rank's tokens (a plain tensor), ``weights`` this rank's ``E / EP`` stacked experts, ``ep`` the
    :class:`shared_numerics.moe.ExpertParallel` exchange over their mesh, ``experts_input`` (TP x EP only, else
    ``None``) the identity the experts' input goes through, whose backward sums x's gradient over the TP ranks (each
    rank's experts see its share of the tokens: exact, ``x + 0``; a ``Partial`` gradient added to the router's
    ``Replicate`` one would split the latter over the ranks), and ``tp_mesh`` (TP x EP) the mesh the output is
    ``Replicate`` on (:meth:`output`)."""

    x: torch.Tensor
    weights: list
    ep: object
    experts_input: Callable[[torch.Tensor], torch.Tensor] | None
    tp_mesh: object | None

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """``out`` (``[B * L, D]``, whole on every rank) as the block returns it: a ``Replicate`` DTensor on the TP
        mesh under TP x EP, else unchanged."""
        if self.tp_mesh is None:
            return out
        return DTensor.from_local(out, self.tp_mesh, [Replicate()], run_check=False)


def expert_parallel_inputs(x_BLD: torch.Tensor, experts: tuple, num_experts: int) -> ExpertParallelInputs:
    """The EP (or TP x EP) inputs of an MoE block (Qwen3-MoE's :func:`moe_expert_parallel`, DeepSeekMoE's
    :class:`titan_plugin.overrides.ZeroKLDMoE`).

    Args:
        x_BLD: ``[B, L, D]`` this rank's tokens (plain tensors: EP borrows the data-parallel ranks), or under tensor
            parallelism a ``Replicate`` DTensor on the TP mesh (TP x EP: each rank exchanges its share of the tokens).
        experts: ``(w_gate, w_up, w_down)`` DTensors ``Shard(0)`` on the EP mesh.
        num_experts: ``E``.

    Raises:
        ValueError: ``E % EP`` (:func:`expert_shards`). NotImplementedError: TP x EP with other EP ranks than the TP
            ranks.
    """
    tp_mesh = x_BLD.device_mesh if isinstance(x_BLD, DTensor) else None
    if tp_mesh is not None:
        _check_same_ranks(tp_mesh, experts[0].device_mesh)
    weights, ep = expert_shards(*experts, num_experts, replicated_tokens=tp_mesh is not None)
    experts_input = None
    if tp_mesh is not None:
        group = tp_mesh.get_group()

        def experts_input(x: torch.Tensor) -> torch.Tensor:
            return _SharesGradient.apply(x, group)

    x = x_BLD.to_local() if tp_mesh is not None else x_BLD
    return ExpertParallelInputs(x, weights, ep, experts_input, tp_mesh)


class _SharesGradient(torch.autograd.Function):
    """Identity whose backward sums the gradient over ``group``: each rank's is nonzero only on its share of the
    tokens, so the sum is exact (``x + 0``) and every rank gets the whole gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        import torch.distributed as dist

        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None


def _check_same_ranks(tp_mesh, ep_mesh) -> None:
    """TP x EP runs where the EP group is the TP group (TorchTitan borrows the TP ranks for EP: ``efsdp`` 1).

    Raises:
        NotImplementedError: other groups (e.g. EP across data-parallel ranks as well as TP ones)."""
    import torch.distributed as dist

    tp = dist.get_process_group_ranks(tp_mesh.get_group())
    ep = dist.get_process_group_ranks(ep_mesh.get_group())
    if tp != ep:
        raise NotImplementedError(f"zerokld TP x EP: the EP ranks {ep} must be the TP ranks {tp}")


def _gather_rows(rows: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    return _GatherRows.apply(rows, sizes, group)


class _GatherRows(torch.autograd.Function):
    """All-gather of each rank's rows ``[sizes[rank], H]`` into ``[sum(sizes), H]`` in rank order (gloo's all-gather
    takes equal sizes: padded to the largest). Backward: this rank's slice of the gradient — every rank computes the
    same (replicated) result from the gathered rows, so its slice is already complete."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
        import torch.distributed as dist

        rank = dist.get_rank(group)
        ctx.start, ctx.stop = sum(sizes[:rank]), sum(sizes[: rank + 1])
        width = max(sizes)
        padded = rows.new_zeros((width, *rows.shape[1:]))
        padded[: rows.shape[0]] = rows
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([part[:n] for part, n in zip(parts, sizes, strict=True)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[ctx.start : ctx.stop], None, None


def expert_shards(w_gate: DTensor, w_up: DTensor, w_down: DTensor, num_experts: int, replicated_tokens: bool = False):
    """``([w_gate, w_up, w_down] this rank's E / EP experts, ExpertParallel over their EP mesh)``: what
    :func:`shared_numerics.moe.moe_experts` (and the MoE blocks that call it, Qwen3-MoE's and DeepSeekMoE's) takes to
    split the routed experts over TorchTitan's ``ep`` mesh; ``replicated_tokens``: every EP rank holds the same
    tokens (TP x EP), see :class:`shared_numerics.moe.ExpertParallel`'s ``gather_rows``.

    Raises:
        ValueError: the experts do not split evenly over the EP ranks (``E % EP``)."""
    from shared_numerics.moe import ExpertParallel

    mesh = w_gate.device_mesh
    size = mesh.size()
    if num_experts % size:  # then Shard(0) splits the experts evenly: E / EP on every rank
        raise ValueError(f"zerokld expert parallelism: {num_experts} experts do not split over {size} EP ranks")
    local = [w.to_local() for w in (w_gate, w_up, w_down)]
    gather_rows = None
    if replicated_tokens:  # every EP rank holds the same tokens (TP x EP): each exchanges its share
        group = mesh.get_group()
        gather_rows = functools.partial(_gather_rows, group=group)
    return local, ExpertParallel(mesh.get_local_rank(), size, _all_to_all(mesh), gather_rows)
