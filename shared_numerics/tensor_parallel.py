"""Tensor-parallel-size invariance: a row-parallel linear whose sum over K is one fixed tree at every TP size.

A row-parallel layer (``o_proj``, ``down_proj``: the weight is sharded along its input dimension ``K``) ends in a sum
over ranks. Stock (vLLM's ``RowParallelLinear``, DTensor's ``RowwiseParallel``), each rank runs one GEMM over its
``K/TP`` columns, rounds it to the activation dtype, and the all-reduce adds the ``TP`` partials in the communication
library's order, so the bits depend on the TP size. Here the sum over ``K`` is defined once, without ``TP`` in it:

* ``K`` is cut into blocks of ``k_block`` columns (:attr:`shared_numerics.NumericsMode.tp_k_block`, the same on both
  sides). Block ``b``'s partial product ``P_b = x[:, Kb] @ W[:, Kb]^T`` is one float32 batch-invariant GEMM
  (:func:`shared_numerics.linear` on float32 operands). On CPUs with the float32 FMA kernel the blocks and their
  tree are one kernel pass (:func:`k_block_tree`: the same bits, ``benchmarks/k_block_tree.py``).
* The ``n = odd * 2^t`` partials are added in one fixed tree (:func:`block_tree_sum`): each run of ``odd``
  consecutive blocks left to right, then adjacent pairs, level by level, until one remains.
* With ``TP = 2^s`` ranks each holding ``n / TP`` consecutive blocks, a rank's blocks are exactly one subtree. Each
  rank reduces its own subtree; the ``TP`` subtree roots (float32 ``[M, N]``, one per rank) are all-gathered, and
  every rank adds them with the top ``s`` levels of the same tree. TP 1, 2, 4, ... give the same bits.
* The bias is added to the root in float32 and the result rounded once to the activation dtype.

Column-parallel layers (``q/k/v_proj``, ``gate/up_proj``, the vocab-parallel ``lm_head``) need nothing in the
forward: each output column is the full-``K`` dot product of :func:`shared_numerics.linear`, which does not depend on
which other columns share the call (tested), so gathering the column shards gives the unsharded bits. The log-softmax
over the vocab-parallel logits is :mod:`shared_numerics.vocab_parallel` (exact sum: any vocabulary split).

Their backward is a row-parallel product: the input gradient ``dX = dY W`` sums over the output dimension ``N``,
which TP splits. Stock (DTensor's ``ColwiseParallel``: a ``Partial`` input gradient) each rank multiplies its ``N / TP``
columns and an all-reduce adds the partials, so a trainer's updates depend on the TP size.
:func:`column_parallel_input_grad` gives ``dX`` the same fixed tree over ``k_block``-wide blocks of ``N`` (the
trainer's TP 1 with ``tp_k_block`` too), so TP 1, 2, 4, ... train with the same bits.

Communication: the all-gather brings ``(TP - 1) * M * N`` float32 values into each rank, ``4 (TP - 1) M N`` bytes,
where a bf16 ring all-reduce moves ``2 * 2 (TP - 1) / TP * M N`` bytes: ``TP`` times as many (``benchmarks/
tp_reduction.py`` measures it and tabulates the 8-GPU case).

Source: the fixed cross-device reduction tree of tree-based invariant kernels (TBIK, arXiv 2511.17826) and Fireworks'
"a single fixed cross-GPU reduction path"; vLLM ``model_executor/layers/linear.py`` (``RowParallelLinear``) and torch
``distributed/tensor/parallel/style.py`` (``RowwiseParallel``) for the stock behaviour replaced.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = [
    "block_tree_sum",
    "column_parallel_dx",
    "column_parallel_input_grad",
    "k_block_partials",
    "k_block_tree",
    "reduce_over_ranks",
    "row_parallel_linear",
]


def block_tree_sum(partials: torch.Tensor) -> torch.Tensor:
    """Sum ``partials`` over dim 0 with the fixed TP-aligned tree.

    Args:
        partials: ``[n, ...]`` floating, ``n >= 1``; block ``b`` is ``partials[b]``.

    Returns:
        ``[...]`` in ``partials.dtype``: with ``n = odd * 2^t``, each run of ``odd`` consecutive blocks summed left to
        right, then adjacent pairs ``(0+1), (2+3), ...`` level by level. For ``n = 2^s * m`` the sum of the ``2^s``
        subtree roots over consecutive runs of ``m`` blocks, added with this function, is bitwise the sum of all
        ``n`` (what makes TP ``2^s`` equal TP 1). Differentiable.

    Raises:
        ValueError: ``n == 0``.
    """
    n = partials.shape[0]
    if n == 0:
        raise ValueError("block_tree_sum of zero blocks")
    odd = n
    while odd % 2 == 0:
        odd //= 2
    groups = partials.reshape(n // odd, odd, *partials.shape[1:])
    acc = groups[:, 0]
    for j in range(1, odd):
        acc = acc + groups[:, j]
    while acc.shape[0] > 1:
        acc = acc[0::2] + acc[1::2]
    return acc[0]


def _check_k_blocks(x: torch.Tensor, weight: torch.Tensor, k_block: int) -> int:
    """``K`` of ``x [M, K]`` and ``weight [N, K]``, or the ValueError of a weight of another ``K`` or a ``k_block``
    that does not divide it."""
    k = x.shape[-1]
    if weight.shape[-1] != k:
        raise ValueError(f"row-parallel linear: x has K={k}, weight {tuple(weight.shape)}")
    if k_block <= 0 or k % k_block:
        raise ValueError(f"row-parallel linear: K={k} (this rank's shard) is not a multiple of tp_k_block={k_block}")
    return k


def k_block_partials(x: torch.Tensor, weight: torch.Tensor, k_block: int) -> torch.Tensor:
    """The float32 partial products of ``x @ weight^T`` over consecutive ``k_block``-column blocks of ``K``.

    Args:
        x: ``[M, K]`` float32 or bfloat16.
        weight: ``[N, K]`` (``nn.Linear`` layout), any float dtype.
        k_block: block width; must divide ``K``.

    Returns:
        ``[K / k_block, M, N]`` float32; block ``b`` is :func:`shared_numerics.linear` of the float32 operands' columns
        ``[b * k_block, (b + 1) * k_block)`` (row invariant, like every ``linear``).

    Raises:
        ValueError: ``K`` not a multiple of ``k_block``, or ``weight`` of another ``K``.
    """
    import shared_numerics as sn

    k = _check_k_blocks(x, weight, k_block)
    xf = x.float()
    return torch.stack(
        [
            sn.linear(xf[:, s : s + k_block].contiguous(), weight[:, s : s + k_block].float().contiguous())
            for s in range(0, k, k_block)
        ]
    )


def k_block_tree(x: torch.Tensor, weight: torch.Tensor, k_block: int) -> torch.Tensor:
    """``block_tree_sum(k_block_partials(x, weight, k_block))``, forward and backward the same bits: this rank's float32
    subtree root ``[M, N]`` of ``x @ weight^T`` summed over ``k_block``-wide blocks of ``K`` in the fixed tree.

    On a CPU with the float32 FMA kernel (:func:`shared_numerics.gemm_cpu.f32_available`) it is one autograd node:
    the forward one kernel pass that keeps each register tile's tree in a small stack
    (:func:`shared_numerics.gemm_cpu.gemm_f32_k_tree`; nothing of size ``K / k_block x M x N`` is stored), the
    backward one ``dX = dY W`` and one ``dW = dYᵀ X`` over all of ``K`` — every leaf of the tree receives the same
    ``dY``, and an element of ``dX`` (``dW``) is one FMA chain over ``N`` (``M``) from zero whichever ``K`` block it
    sits in, so the block-by-block backward's bits (a chain from zero is never ``-0``, so adding the blocks'
    zero-padded slice gradients changes nothing either). Elsewhere (GPU, CPUs without the kernel): the blocks.

    Args / Raises: as :func:`k_block_partials`.
    """
    from .gemm_cpu import f32_available

    _check_k_blocks(x, weight, k_block)
    if not (x.is_cpu and weight.is_cpu and f32_available()):
        return block_tree_sum(k_block_partials(x, weight, k_block))
    return _KBlockTree.apply(x.float(), weight.float(), k_block)


class _KBlockTree(torch.autograd.Function):
    """:func:`k_block_tree` on the float32 FMA kernel (float32 operands: the casts stay outside, in autograd)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, k_block: int) -> torch.Tensor:
        from .gemm_cpu import gemm_f32_k_tree

        ctx.save_for_backward(x, w)
        return gemm_f32_k_tree(w, x, k_block)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        from .gemm_cpu import gemm_abt

        x, w = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = gemm_abt(w.t(), grad, transpose=True)  # [M, K]: each element a chain over N (matmul_rows)
        if ctx.needs_input_grad[1]:
            grad_w = gemm_abt(grad.t(), x.t())  # [N, K]: each element a chain over M (_RowTiledLinear's dW)
        return grad_x, grad_w, None


def reduce_over_ranks(root: torch.Tensor, gather: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
    """The top of the fixed tree: this rank's float32 subtree root ``[...]`` gathered with every rank's (``gather``:
    ``[1, ...] -> [TP, ...]`` in rank order) and summed with :func:`block_tree_sum`; ``root`` itself at TP 1
    (``gather is None``).

    Raises:
        ValueError: a gathered TP size that is not a power of two (the rank subtrees would not align)."""
    if gather is None:
        return root
    roots = gather(root.unsqueeze(0))
    tp = roots.shape[0]
    if tp & (tp - 1):
        raise ValueError(
            f"row-parallel sum: TP size {tp} is not a power of two (the rank subtrees of the fixed "
            "reduction tree would not align)"
        )
    return block_tree_sum(roots)


def row_parallel_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    k_block: int,
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``linear(x, W, b)`` with the sum over ``K`` in the fixed TP-aligned tree (see the module docstring).

    Args:
        x: ``[..., K_local]`` float32 or bfloat16: this rank's input columns (all of ``K`` at TP 1).
        weight: ``[N, K_local]``: this rank's shard of the weight, the ``K_local`` consecutive columns
            ``[rank * K_local, (rank + 1) * K_local)``.
        bias: optional ``[N]``, not sharded; added once after the cross-rank sum.
        k_block: the fixed block width (:attr:`NumericsMode.tp_k_block`); must divide ``K_local``.
        gather: ``None`` at TP 1; else a function taking this rank's float32 subtree root ``[1, M, N]`` and returning
            every rank's, stacked in rank order ``[TP, M, N]`` (an all-gather over the TP group; the plugins pass
            vLLM's ``tensor_model_parallel_all_gather`` or, in the trainer, an autograd all-gather whose backward
            keeps this rank's slice, :mod:`titan_plugin.tensor_parallel`).

    Returns:
        ``[..., N]`` in ``x.dtype``, the same bits at every TP size (power of two) for the same full ``x`` and ``W``.

    Raises:
        ValueError: ``K_local`` not a multiple of ``k_block``; a gathered TP size that is not a power of two.
    """
    lead = x.shape[:-1]
    root = reduce_over_ranks(k_block_tree(x.reshape(-1, x.shape[-1]), weight, k_block), gather)
    if bias is not None:
        root = root + bias.float()
    return root.to(x.dtype).reshape(*lead, weight.shape[0])


def column_parallel_dx(
    dy: torch.Tensor, weight: torch.Tensor, k_block: int, gather: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> torch.Tensor:
    """``dX = dY W`` of a column-parallel product ``Y = X Wᵀ``, summed over ``N`` in the fixed TP-aligned tree: ``N``
    cut into ``k_block``-wide blocks (:func:`k_block_partials`), the blocks added with :func:`block_tree_sum`, the
    ranks' subtree roots gathered and added (:func:`reduce_over_ranks`) — the whole sum on every rank, the same bits
    at every TP size.

    Args:
        dy: ``[M, N_local]`` this rank's output columns' gradient. weight: ``[N_local, K]`` this rank's rows.
        k_block: must divide ``N_local``. gather: ``None`` at TP 1; else as :func:`reduce_over_ranks`'.

    Returns:
        ``[M, K]`` float32 (the caller rounds it to the input's dtype).

    Raises:
        ValueError: as :func:`k_block_partials` and :func:`reduce_over_ranks`."""
    return reduce_over_ranks(k_block_tree(dy, weight.t(), k_block), gather)


class _ColumnParallelInputGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, k_block: int, gather) -> torch.Tensor:
        ctx.save_for_backward(weight)
        ctx.k_block, ctx.gather, ctx.x_dtype, ctx.x_shape = k_block, gather, x.dtype, x.shape
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        dx = None
        if ctx.needs_input_grad[1]:
            (weight,) = ctx.saved_tensors
            dy = grad.reshape(-1, grad.shape[-1])
            dx = column_parallel_dx(dy, weight, ctx.k_block, ctx.gather).to(ctx.x_dtype).reshape(ctx.x_shape)
        return grad, dx, None, None, None


def column_parallel_input_grad(
    y: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    k_block: int,
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``y`` unchanged, whose backward gives ``x`` the gradient of ``y = x Wᵀ`` summed over ``N`` in the fixed
    TP-aligned tree: for a column-parallel linear ``y = linear(x.detach(), W, b)`` computed without ``x``'s gradient.

    ``dX = dY W`` is :func:`row_parallel_linear`'s sum with the roles swapped: ``N`` cut into ``k_block``-wide blocks,
    each block's ``dY[:, Nb] W[Nb, :]`` a float32 :func:`k_block_partials` GEMM, the blocks added with
    :func:`block_tree_sum`, the ranks' subtree roots gathered (``gather``) and added with the tree's top levels,
    rounded once to ``x.dtype``. Every rank gets the whole ``dX`` (a replicated input's gradient, no all-reduce).

    Args:
        y: ``[..., N_local]``, the linear's output (its gradient passes through unchanged).
        x: ``[..., K]``, the linear's input (replicated under TP): it gets ``dX``.
        weight: ``[N_local, K]``, this rank's consecutive output rows ``[rank N_local, (rank + 1) N_local)``
            (detached: its gradient is the linear's).
        k_block: :attr:`shared_numerics.NumericsMode.tp_k_block`; must divide ``N_local``.
        gather: ``None`` at TP 1; else as :func:`row_parallel_linear`'s (``[1, M, K] -> [TP, M, K]``, rank order).

    Returns:
        ``y`` (a view), differentiable.

    Raises:
        ValueError (in the backward): ``N_local`` not a multiple of ``k_block``; a TP size that is not a power of two.

    Source: the TP-aligned tree of this module's docstring applied to the backward; torch
    ``distributed/tensor/parallel/style.py`` (``ColwiseParallel``: the ``Partial`` input gradient replaced).
    """
    return _ColumnParallelInputGrad.apply(y, x, weight.detach(), k_block, gather)
