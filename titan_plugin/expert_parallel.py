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

import torch
from torch.distributed.tensor import DTensor, Shard

__all__ = ["expert_shards", "is_expert_parallel", "moe_expert_parallel"]


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`shared_numerics.moe.moe_forward` with the experts split over TorchTitan's EP mesh.

    Args:
        x_BLD: ``[B, L, D]`` this rank's tokens (plain tensors: EP borrows the data-parallel ranks).
        router_weight: ``[E, D]`` (replicated).
        w_gate, w_up, w_down: the stacked experts, DTensors ``Shard(0)`` on the EP mesh.
        top_k, renormalize, expert_ids, fp8: as :func:`~shared_numerics.moe.moe_forward` (replayed ids are global).
        chains: exact accumulation (:mod:`titan_plugin.exact_accumulation`): the router's chain and this rank's
            experts' (``[E / EP, ...]``), as :func:`~shared_numerics.moe.moe_forward` takes them.

    Returns:
        ``(out [B*L, D], expert_ids [B*L, top_k])``, bitwise what one rank holding every expert computes.

    Raises:
        ValueError: the experts do not split evenly over the EP ranks (``E % EP``).
    """
    import shared_numerics.moe as sn_moe

    local, ep = expert_shards(w_gate, w_up, w_down, router_weight.shape[0])
    router = router_weight.to_local() if isinstance(router_weight, DTensor) else router_weight
    x = x_BLD.to_local() if isinstance(x_BLD, DTensor) else x_BLD
    b, seq, d = x.shape
    return sn_moe.moe_forward(
        x.reshape(b * seq, d),
        router,
        *local,
        top_k,
        renormalize,
        expert_ids,
        chains=chains,
        fp8=fp8,
        expert_parallel=ep,
    )


def expert_shards(w_gate: DTensor, w_up: DTensor, w_down: DTensor, num_experts: int):
    """``([w_gate, w_up, w_down] this rank's E / EP experts, ExpertParallel over their EP mesh)``: what
    :func:`shared_numerics.moe.moe_experts` (and the MoE blocks that call it, Qwen3-MoE's and DeepSeekMoE's) takes to
    split the routed experts over TorchTitan's ``ep`` mesh.

    Raises:
        ValueError: the experts do not split evenly over the EP ranks (``E % EP``)."""
    from shared_numerics.moe import ExpertParallel

    mesh = w_gate.device_mesh
    size = mesh.size()
    if num_experts % size:  # then Shard(0) splits the experts evenly: E / EP on every rank
        raise ValueError(f"zerokld expert parallelism: {num_experts} experts do not split over {size} EP ranks")
    local = [w.to_local() for w in (w_gate, w_up, w_down)]
    return local, ExpertParallel(mesh.get_local_rank(), size, _all_to_all(mesh))
