"""TorchTitan tensor parallelism with the zerokld numerics: the linears run on their local shards.

TorchTitan 0.3 shards a decoder by each module's ``ShardingConfig`` (``torchtitan/models/common/decoder_sharding.py``):
column-parallel ``wq/wk/wv/w1/w3`` and the lm_head hold weight ``Shard(0)``, row-parallel ``wo/w2`` ``Shard(1)`` and
declare a ``Partial`` output that an all-reduce (or a reduce-scatter, with sequence parallelism) resolves. Stock, the
all-reduce adds the ranks' rounded partials, so the bits depend on the TP size. The zerokld linears instead:

* column-parallel: :func:`shared_numerics.linear` of the local shard, output ``Shard(-1)`` (each column is the full-K
  dot product: the unsharded bits);
* row-parallel: :func:`shared_numerics.tensor_parallel.row_parallel_linear` on the local shard with the fixed K-block
  tree, the ranks' float32 subtree roots all-gathered over the TP mesh, output ``Replicate`` (the module's
  ``out_src_shardings`` is changed to match: no all-reduce runs).
* the lm_head's ``Shard(-1)`` logits stay sharded: :func:`vocab_shard` hands this rank's slice to
  :func:`shared_numerics.vocab_parallel.selected_logprobs` (:func:`titan_plugin.logprobs.logprob_scorer`).

Source: torch ``distributed/tensor/parallel/style.py`` (``ColwiseParallel`` / ``RowwiseParallel``, the layouts
TorchTitan declares); vLLM ``model_executor/layers/linear.py`` for the same split on the serving side.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

import shared_numerics as sn
import shared_numerics.tensor_parallel as sn_tp
from shared_numerics.grad_chain import chained_weight_grad

__all__ = [
    "column_parallel_dtensor",
    "head_gather",
    "moe_dtensor",
    "per_row_dtensor",
    "replicate_output_sharding",
    "row_parallel_dtensor",
    "vocab_rows",
    "vocab_shard",
]


class _GatherRoots(torch.autograd.Function):
    """All-gather of each rank's float32 subtree root ``[1, M, N]`` into ``[TP, M, N]`` (rank order).

    Backward: this rank's slice of the incoming gradient. Every rank runs the same reduction on the gathered roots
    and gets the same (``Replicate``) output and gradient, so the gradient of its own root is already complete
    (``all_gather``'s usual backward, a reduce-scatter, would count it ``TP`` times)."""

    @staticmethod
    def forward(ctx, root: torch.Tensor, group) -> torch.Tensor:
        ctx.rank = dist.get_rank(group)
        parts = [torch.empty_like(root) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, root.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[ctx.rank : ctx.rank + 1], None


def _gather_over(mesh):
    """The ``gather`` of :func:`shared_numerics.tensor_parallel.row_parallel_linear` over the TP mesh's group."""
    group = mesh.get_group()
    return lambda root: _GatherRoots.apply(root, group)


def head_gather(x: DTensor):
    """The ``gather`` of :func:`shared_numerics.norm.rms_norm` ``head_tree`` for ``x [B, L, heads, D]`` sharded on
    its heads over the 1-D TP mesh: the heads' subtree roots all-gathered in rank order.

    Raises:
        NotImplementedError: a multi-dimensional mesh."""
    if x.device_mesh.ndim != 1:
        raise NotImplementedError(f"zerokld per-head norm: a {x.device_mesh.ndim}-D mesh (the TP mesh only)")
    return _gather_over(x.device_mesh)


def per_row_dtensor(fn, x: DTensor, *params) -> DTensor:
    """``fn(x, *params)`` for an op on each row of the last dimension alone (norms, RoPE) when ``x`` is a DTensor
    sharded on another dimension (heads, sequence) or replicated: the op runs on the local shard with the
    (replicated) parameters' local tensors, and the result keeps ``x``'s placements, shape and stride (uneven
    sequence shards included). A replicated parameter's local gradient then sums this rank's rows only: ``Partial``
    when ``x`` is sharded.

    Raises:
        NotImplementedError: ``x`` sharded along its last dimension."""
    if any(p.is_shard() and p.dim % x.ndim == x.ndim - 1 for p in x.placements):
        raise NotImplementedError(
            f"zerokld: a per-row op on a DTensor sharded along its last dimension ({x.placements})"
        )
    grad = [Partial() if any(p.is_shard() for p in x.placements) else Replicate()]
    local = [q.to_local(grad_placements=grad) if isinstance(q, DTensor) else q for q in params]
    out = fn(x.to_local(), *local)
    return DTensor.from_local(out, x.device_mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride())


def vocab_rows(weight: DTensor) -> tuple[torch.Tensor, dict]:
    """This rank's rows of a vocab-parallel lm_head weight ``[V, H]`` (``Shard(0)`` on the 1-D TP mesh, or
    ``Replicate``), for :func:`shared_numerics.vocab_parallel.fused_selected_logprobs`: ``(local [V_local, H],
    kwargs)`` as :func:`vocab_shard` gives for logits.

    Raises:
        NotImplementedError: another placement or a multi-dimensional mesh."""
    return _vocab_slice(weight, 0)


def vocab_shard(logits: DTensor) -> tuple[torch.Tensor, dict]:
    """This rank's slice of vocab-parallel logits, for :func:`shared_numerics.vocab_parallel.selected_logprobs`.

    Args:
        logits: ``[..., V]`` DTensor on the 1-D TP mesh, ``Shard(-1)`` (the column-parallel lm_head's output, uneven
            shards allowed) or ``Replicate``.

    Returns:
        ``(local [..., V_local], kwargs)``: ``kwargs`` holds ``vocab_start``, ``vocab_size`` and ``gather`` (an
        all-gather over the TP group whose backward keeps this rank's slice). ``local``'s gradient is this rank's
        slice of the logits' gradient.

    Raises:
        NotImplementedError: another placement or a multi-dimensional mesh."""
    return _vocab_slice(logits, logits.ndim - 1)


def _vocab_slice(t: DTensor, dim: int) -> tuple[torch.Tensor, dict]:
    """``(local, {vocab_start, vocab_size[, gather]})`` of a DTensor whose dimension ``dim`` is the vocabulary."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = t.device_mesh
    if mesh.ndim != 1:
        raise NotImplementedError(f"zerokld vocab-parallel log-softmax: a {mesh.ndim}-D mesh (the TP mesh only)")
    (placement,) = t.placements
    vocab = t.shape[dim]
    if placement.is_replicate():
        return t.to_local(), {"vocab_start": 0, "vocab_size": vocab}
    if placement != Shard(dim):
        raise NotImplementedError(
            f"zerokld vocab-parallel log-softmax: placements {t.placements} (vocabulary on dimension {dim})"
        )
    _, offset = compute_local_shape_and_global_offset(t.shape, mesh, t.placements)
    return t.to_local(), {"vocab_start": int(offset[dim]), "vocab_size": vocab, "gather": _gather_over(mesh)}


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.to_local() if isinstance(t, DTensor) else t


def _mesh_1d(weight: DTensor):
    mesh = weight.device_mesh
    if mesh.ndim != 1:
        raise NotImplementedError(f"zerokld tensor parallelism: weight on a {mesh.ndim}-D mesh (the TP mesh only)")
    return mesh


def column_parallel_dtensor(
    x: torch.Tensor, weight: DTensor, bias: torch.Tensor | None, weight_chain=None, bias_chain=None, k_block: int = 0
) -> DTensor:
    """``linear(x, W, b)`` for a ``Shard(0)`` (column-parallel) or ``Replicate`` weight DTensor; ``x`` replicated.
    ``weight_chain`` / ``bias_chain``: exact accumulation (:mod:`shared_numerics.grad_chain`) of the local shards'
    gradients (``dW_local = dY_localᵀ X`` over the tokens in order). ``k_block`` (nonzero: it divides the local
    rows, which split evenly): ``x``'s gradient is whole on every rank, the TP-aligned tree over the output rows
    (:func:`shared_numerics.tensor_parallel.column_parallel_input_grad`, the ranks' float32 subtree roots
    all-gathered); else the ranks' partial input gradients, which DTensor all-reduces.

    Returns:
        ``[..., N]`` DTensor: ``Shard(-1)`` for a sharded weight, else ``Replicate``.

    Raises:
        NotImplementedError: another weight placement, a multi-dimensional mesh, or a sharded ``x``."""
    mesh = _mesh_1d(weight)
    (placement,) = weight.placements
    if isinstance(x, DTensor) and not all(p.is_replicate() for p in x.placements):
        raise NotImplementedError(f"zerokld column-parallel linear: input placements {x.placements} (Replicate only)")
    # x's gradient from this rank's columns is a partial sum over the output columns: Partial, reduced by DTensor;
    # with k_block the fixed tree gives every rank the whole of it
    grad = [Replicate() if k_block else Partial()]
    x_local = x.to_local(grad_placements=grad) if isinstance(x, DTensor) else x
    x_in = x_local.detach() if k_block else x_local
    if weight_chain is not None:
        from shared_numerics.linear import linear as chained_linear

        out = chained_linear(x_in, weight.to_local(), _local(bias), weight_chain=weight_chain, bias_chain=bias_chain)
    else:
        out = sn.linear(x_in, weight.to_local(), _local(bias))
    if k_block:
        gather = _gather_over(mesh) if placement == Shard(0) else None
        out = sn_tp.column_parallel_input_grad(out, x_local, weight.to_local(), k_block=k_block, gather=gather)
    if placement == Shard(0):  # the global width is the weight's (uneven shards, e.g. an odd vocabulary)
        shape = (*out.shape[:-1], weight.shape[0])
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(out, mesh, [Shard(out.ndim - 1)], run_check=False, shape=shape, stride=stride)
    if placement.is_replicate():
        return DTensor.from_local(out, mesh, [Replicate()], run_check=False)
    raise NotImplementedError(f"zerokld column-parallel linear: weight placement {placement}")


def row_parallel_dtensor(
    x: torch.Tensor, weight: DTensor, bias: torch.Tensor | None, k_block: int, weight_chain=None
) -> DTensor:
    """``linear(x, W, b)`` for a ``Shard(1)`` (row-parallel) weight DTensor with the TP-size-invariant sum.

    Args:
        x: ``[..., K]`` DTensor ``Shard(-1)`` (this rank's ``K / TP`` columns).
        weight: ``[N, K]`` DTensor ``Shard(1)`` on the 1-D TP mesh.
        bias: ``[N]`` replicated or ``None``.
        k_block: :attr:`shared_numerics.NumericsMode.tp_k_block`.
        weight_chain: exact accumulation of the local shard's gradient, ``dW_local = dYᵀ X_local`` over the tokens
            in order (:mod:`shared_numerics.grad_chain`; bias-free only).

    Returns:
        ``[..., N]`` DTensor ``Replicate``, bitwise :func:`shared_numerics.tensor_parallel.row_parallel_linear` of
        the unsharded ``x`` and ``W``.

    Raises:
        NotImplementedError: other placements. ValueError: see ``row_parallel_linear``."""
    mesh = _mesh_1d(weight)
    if weight.placements != (Shard(1),):
        raise NotImplementedError(f"zerokld row-parallel linear: weight placements {weight.placements} (Shard(1))")
    if isinstance(x, DTensor) and x.placements != (Shard(x.ndim - 1),):
        raise NotImplementedError(f"zerokld row-parallel linear: input placements {x.placements} (Shard(-1))")
    x_local, w_local = _local(x), weight.to_local()
    if weight_chain is not None:
        if bias is not None:
            raise NotImplementedError("zerokld row-parallel linear: exact accumulation with a bias")
        w_local = w_local.detach()  # its gradient goes into the chain (chained_weight_grad)
    out = sn_tp.row_parallel_linear(x_local, w_local, _local(bias), k_block=k_block, gather=_gather_over(mesh))
    if weight_chain is not None:
        out = chained_weight_grad(out, x_local, weight_chain)
    return DTensor.from_local(out, mesh, [Replicate()], run_check=False)


def moe_dtensor(
    x: DTensor,
    router_weight: DTensor,
    w_gate: DTensor,
    w_up: DTensor,
    w_down: DTensor,
    top_k: int,
    renormalize: bool,
    expert_ids: torch.Tensor | None,
    k_block: int | None,
    chains: dict | None = None,
):
    """:func:`shared_numerics.moe.moe_forward` under TorchTitan tensor parallelism: ``x [B, L, D]`` replicated, the
    router replicated, each expert's ``w1/w3 [E, I, D]`` ``Shard(1)`` and ``w2 [E, D, I]`` ``Shard(2)``; the experts'
    down projections sum with the fixed tree (subtree roots all-gathered before the routing weights). ``chains``:
    exact accumulation (``moe_forward``'s: the router's whole, the experts' this rank's shards).

    Returns:
        ``(out [B*L, D] DTensor Replicate, expert_ids [B*L, top_k])``, bitwise the unsharded block with ``k_block``.

    Raises:
        NotImplementedError: no ``k_block`` (the stock sum would depend on TP) or other placements."""
    import shared_numerics.moe as sn_moe

    mesh = _mesh_1d(w_gate)
    if k_block is None:
        raise NotImplementedError("zerokld MoE under tensor parallelism needs tp_k_block")
    if (w_gate.placements, w_up.placements, w_down.placements) != ((Shard(1),), (Shard(1),), (Shard(2),)):
        raise NotImplementedError(f"zerokld MoE experts: placements {w_gate.placements}/{w_down.placements}")
    if isinstance(x, DTensor) and not all(p.is_replicate() for p in x.placements):
        raise NotImplementedError(f"zerokld MoE: input placements {x.placements} (Replicate only)")
    b, seq, d = x.shape
    # the router's gradient is complete on every rank; the experts' (this rank's I columns) is a partial sum
    x_router = _local(x).reshape(b * seq, d)
    x_experts = x.to_local(grad_placements=[Partial()]).reshape(b * seq, d) if isinstance(x, DTensor) else x_router
    out, ids = sn_moe.moe_forward(
        x_router,
        _local(router_weight),
        w_gate.to_local(),
        w_up.to_local(),
        w_down.to_local(),
        top_k,
        renormalize,
        expert_ids,
        k_block=k_block,
        gather=_gather_over(mesh),
        experts_x=x_experts,
        chains=chains,
    )
    return DTensor.from_local(out, mesh, [Replicate()], run_check=False), ids


def replicate_output_sharding(sharding_config):
    """A row-parallel module's ``ShardingConfig`` with its output declared ``Replicate`` instead of ``Partial``
    (the fixed tree already summed the ranks; ``out_dst_shardings`` is kept: replicated, or a sequence shard that
    is then a local slice — but a ``Partial`` destination, DeepSeekMoE's shared experts' ``w2`` whose partial sum
    stock TorchTitan adds to the routed experts' before one all-reduce, becomes ``Replicate`` too). ``None`` stays
    ``None``."""
    if sharding_config is None or sharding_config.out_src_shardings is None:
        return sharding_config
    import dataclasses

    import spmd_types as spmd
    from torchtitan.models.common.decoder_sharding import dense_activation_placement

    replicated = dense_activation_placement(tp=spmd.R)
    changes = {"out_src_shardings": replicated}
    if sharding_config.out_dst_shardings == dense_activation_placement(tp=spmd.P):
        changes["out_dst_shardings"] = replicated
    return dataclasses.replace(sharding_config, **changes)
