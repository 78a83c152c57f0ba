"""Context parallelism for the zerokld trainer: the sequence split over the ``cp`` ranks, attention over all keys.

TorchTitan's own CP (``torchtitan/distributed/context_parallel``) wraps SDPA (ring attention through DTensor's
dispatcher, whose partial results merge in ring order) or FlexAttention (an all-gather of K/V), and shards the inputs
with a head-tail load balancer. The zerokld trainer's attention (:func:`shared_numerics.dense_causal_attention`) walks
each query's keys in fixed 32-position chunks from position 0 with one online softmax; a query's result depends only
on its keys. So under CP each rank holds one contiguous slice of every sequence (positions ``[r * T/cp, (r+1) *
T/cp)``), all-gathers the keys and values of the ``cp`` mesh dimension as a DTensor (``Shard(1)`` → whole;
its backward sums the ranks' K/V gradients, ``Partial`` → ``Shard(1)``), and runs the same attention for its
queries over the whole prefix — every query sees its keys in the single-rank chunk order, so each log-prob is CP
1's (and vLLM's) bit for bit. Everything else in a decoder is per token.

What this costs: each rank computes attention for the rows before its slice too (zero queries, results dropped), so
CP splits the per-token work (projections, MLP, lm_head), not the attention's. Training: each rank runs the whole
sequences' attention and its backward and keeps its slices of the gradients (:class:`_WholeAttention`: each key's
gradient summed over all its queries in one order, one rank's bits); the parameter gradients are one rank's through
exact accumulation, one rollout per pass, the passes replayed in one rank's token order
(:class:`titan_plugin.exact_accumulation.ExactAccumulation` ``context_parallel``).

Source: ``torchtitan/distributed/context_parallel/api.py`` (``apply_cp_to_forward``, the K/V all-gather for
FlexAttention); the DeviceMesh ``cp`` dimension of ``torchtitan/distributed/parallel_dims.py``.
"""

from __future__ import annotations

import functools

import torch

__all__ = [
    "ContextParallelAttention",
    "cp_attention",
    "gather_sequence",
    "local_positions",
    "shard_sequence",
    "with_context_parallel",
]


class ContextParallelAttention:
    """What :func:`with_context_parallel` hands the ``cp`` mesh to: an inner attention that runs :func:`cp_attention`
    when ``cp_mesh`` is set (:class:`titan_plugin.overrides.ZeroKLDAttention`)."""

    #: the ``cp`` DeviceMesh under context parallelism, else ``None``
    cp_mesh = None


class _WithoutTitanCP:
    """``parallel_dims`` as TorchTitan's ``parallelize_fn`` should see it when zerokld runs CP itself: the same
    meshes (FSDP still shards over ``dp_shard x cp``), but ``cp_enabled`` false, so TorchTitan does not wrap the
    inner attention with its own CP (which refuses the zerokld attention)."""

    cp_enabled = False

    def __init__(self, parallel_dims) -> None:
        self._dims = parallel_dims

    def __getattr__(self, name):
        return getattr(self._dims, name)


def with_context_parallel(parallelize_fn):
    """Wrap a TorchTitan ``parallelize_fn``: under context parallelism, give every zerokld inner attention the ``cp``
    mesh (:class:`ContextParallelAttention`) and run TorchTitan's parallelisms without its CP."""

    @functools.wraps(parallelize_fn)
    def wrapped(model, *, parallel_dims, **kwargs):
        if not parallel_dims.cp_enabled:
            return parallelize_fn(model, parallel_dims=parallel_dims, **kwargs)
        mesh = parallel_dims.get_mesh("cp")
        attention = [m for m in model.modules() if isinstance(m, ContextParallelAttention)]
        if not attention:
            raise NotImplementedError("zerokld context parallelism needs the zerokld attention (not MLA yet)")
        for m in attention:
            m.cp_mesh = mesh
        return parallelize_fn(model, parallel_dims=_WithoutTitanCP(parallel_dims), **kwargs)

    return wrapped


class _GatherKeys(torch.autograd.Function):
    """The ranks' ``Shard(1)`` slices whole (forward), and the backward the sum over the ranks of each rank's
    gradient for the whole, sliced back (``Partial`` → ``Shard(1)``): every rank's queries read every rank's keys.
    (``DTensor.full_tensor``'s own backward treats the whole's gradient as replicated, identical on every rank, and
    would drop the other ranks' contributions.)"""

    @staticmethod
    def forward(ctx, local: torch.Tensor, mesh) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Shard

        ctx.mesh = mesh
        return DTensor.from_local(local.contiguous(), mesh, [Shard(1)], run_check=False).full_tensor()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        from torch.distributed.tensor import DTensor, Partial, Shard

        whole = DTensor.from_local(grad.contiguous(), ctx.mesh, [Partial()], run_check=False)
        return whole.redistribute(ctx.mesh, [Shard(1)]).to_local(), None


class _WholeAttention(torch.autograd.Function):
    """Training: the whole sequences' attention on every ``cp`` rank (queries, keys and values all-gathered), this
    rank's rows returned. Backward: every rank's output gradients gathered, the whole sequences' backward (the
    single-rank kernel on the single-rank inputs: each key's gradient summed over all its queries in one order), this
    rank's slices of ``dq``, ``dk``, ``dv`` — one rank's bits, where summing the ranks' partial key gradients would
    not be."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mesh) -> torch.Tensor:
        import shared_numerics as sn

        whole = [gather_sequence(a, mesh) for a in (q, k, v)]
        ctx.save_for_backward(*whole)
        start = mesh.get_local_rank() * q.shape[1]
        ctx.scale, ctx.mesh, ctx.rows = scale, mesh, slice(start, start + q.shape[1])
        return sn.dense_causal_attention(*whole, scale)[:, ctx.rows].contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        import shared_numerics as sn

        whole = [a.detach().requires_grad_() for a in ctx.saved_tensors]
        with torch.enable_grad():
            out = sn.dense_causal_attention(*whole, ctx.scale)
        dq, dk, dv = torch.autograd.grad(out, whole, gather_sequence(grad, ctx.mesh))
        return dq[:, ctx.rows], dk[:, ctx.rows], dv[:, ctx.rows], None, None


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mesh) -> torch.Tensor:
    """Causal attention of this rank's contiguous slice of the sequences over all their keys.

    Args:
        q: ``[B, T/cp, Hq, D]``, k, v: ``[B, T/cp, Hkv, D]``: this rank's positions ``[r * T/cp, (r + 1) * T/cp)``
            (``r`` its rank on ``mesh``, the ``cp`` DeviceMesh dimension). scale: softmax scale.

    Returns:
        ``[B, T/cp, Hq, D]``: rows bitwise those of :func:`shared_numerics.dense_causal_attention` on the whole
        sequences (differentiable: when a gradient is wanted every rank runs the whole sequences' attention and its
        backward, :class:`_WholeAttention`, so ``dq``, ``dk`` and ``dv`` are one rank's bits; scoring computes only
        the rows up to this rank's slice).
    """
    import shared_numerics as sn

    if torch.is_grad_enabled() and any(a.requires_grad for a in (q, k, v)):
        return _WholeAttention.apply(q, k, v, scale, mesh)
    rank, t = mesh.get_local_rank(), q.shape[1]
    end = (rank + 1) * t  # keys past this rank's last query are never read: gather all, keep the prefix
    k_all = _GatherKeys.apply(k, mesh)[:, :end]
    v_all = _GatherKeys.apply(v, mesh)[:, :end]
    q_all = torch.nn.functional.pad(q, (0, 0, 0, 0, rank * t, 0))  # zero queries before this rank's slice
    return sn.dense_causal_attention(q_all, k_all, v_all, scale)[:, rank * t :]


def shard_sequence(t: torch.Tensor, mesh, value=0) -> torch.Tensor:
    """This rank's contiguous slice of ``[B, T, ...]`` along dim 1, ``T`` right-padded with ``value`` to a multiple
    of the ``cp`` size."""
    rank, size = mesh.get_local_rank(), mesh.size()
    n = -(-t.shape[1] // size)
    pad = [0, 0] * (t.dim() - 2) + [0, n * size - t.shape[1]]
    return torch.nn.functional.pad(t, pad, value=value)[:, rank * n : (rank + 1) * n]


def local_positions(length: int, mesh) -> torch.Tensor:
    """``[1, length]`` int64: the global positions of this rank's slice of :func:`shard_sequence` (RoPE's
    ``positions``)."""
    start = mesh.get_local_rank() * length
    return torch.arange(start, start + length).unsqueeze(0)


def gather_sequence(t: torch.Tensor, mesh) -> torch.Tensor:
    """The ranks' slices ``[B, T/cp, ...]`` of :func:`shard_sequence`, whole again (``[B, T_padded, ...]``)."""
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(t.contiguous(), mesh, [Shard(1)], run_check=False).full_tensor()
