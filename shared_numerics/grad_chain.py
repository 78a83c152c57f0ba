"""Exact gradient accumulation: every parameter's gradient as one float32 chain over the tokens, in token order.

A parameter gradient is a sum over tokens (``dW = Σ_t dY_tᵀ X_t`` for a linear, ``Σ_t dY_t ⊙ x̂_t`` for a norm's gain,
``Σ_{t: id_t = v} dY_t`` for an embedding row, ``Σ_t dY_t`` for a bias). A GEMM library or ``Tensor.sum`` groups those
tokens by the call's shape, so gradients accumulated over micro-batches differ in their last bits from one batched
backward, and differ between groupings. Here each element of the gradient is one float32 accumulator that the
tokens enter one after another, in the batch's order (rollout by rollout, position by position), whatever call they
arrive in: the backward of micro-batch ``b`` continues the chains where micro-batch ``b - 1`` left them. So any split of
a batch into micro-batches — one rollout at a time, one GRPO group at a time, the whole batch — gives the same
gradient bits, at the speed of batched backward passes.

* GEMM gradients: :func:`shared_numerics.gemm_cpu.gemm_abt_accumulate` (the kernels' accumulators start from the
  chain's value; bf16 operands on AMX walk K = tokens in 32-token steps, so each call's tokens are a multiple of 32 —
  the trainer pads its micro-batch layout — and zero tokens (padding, masked positions: ``dY = 0``) add nothing).
* row sums (norm gains, biases, embedding rows): ``Tensor.index_add_`` on CPU adds source rows into the accumulator
  one index after another, in index order (``tests/test_grad_chain.py`` pins it, with a naive loop as reference).

Gradients of parameters wired to a chain are not returned to autograd (``None``): the owner of the chains
(:class:`titan_plugin.rl.RLTrainer`) writes them to ``.grad`` when a micro-batch's backward is done.

Source: the chain form of the float32 GEMM kernel (``csrc/gemm.cpp``); the same idea as a persistent float32 gradient
accumulation buffer (Megatron's ``main_grad``), with the additional rule that its sums run in token order.
"""

from __future__ import annotations

import torch

from .gemm_cpu import CHAIN_K_MULTIPLE, chain_available, gemm_abt_accumulate
from .linear import bf16_path

__all__ = ["CHAIN_K_MULTIPLE", "GradChain", "chain_available", "chained_embedding", "chained_weight_grad", "replay"]


class GradChain:
    """One parameter's gradient as float32 chains in token order.

    Attributes:
        acc: float32, the parameter's shape, contiguous: the running sums (zeros at construction).
        float32_products: :meth:`add_gemm` multiplies on the float32 kernel whatever the operands' dtype (bf16
            values are widened exactly; their products are exact in float32), so a call may have any number of
            tokens — for gradients whose tokens are not a fixed layout, e.g. an MoE expert's (the tokens routed to
            it). A chain keeps its arithmetic for its whole life.

    Source: see the module.
    """

    def __init__(
        self,
        shape: torch.Size | tuple[int, ...],
        float32_products: bool = False,
        acc: torch.Tensor | None = None,
        log: list | None = None,
    ):
        self.acc = torch.zeros(tuple(shape), dtype=torch.float32) if acc is None else acc
        if self.acc.shape != tuple(shape) or self.acc.dtype != torch.float32 or not self.acc.is_contiguous():
            raise ValueError(f"grad chain: acc must be contiguous float32 of {tuple(shape)}")
        self.float32_products = float32_products
        #: ``None``: additions run at once; a list: they are recorded in call order, to be run later by
        #: :func:`replay` (a data-parallel rank whose chains continue where the previous rank's ended)
        self.log = log
        #: set by a feeder whose rows are this rank's share of a sum over ranks (a tensor-parallel replica of a
        #: norm's gain fed one head shard): the owner of the chains sums the ranks' chains into the gradient
        self.partial = False

    def part(self, index, shape: tuple[int, ...] | None = None) -> GradChain:
        """The chains of ``acc[index]`` (e.g. one expert of a stacked ``[E, I, H]`` weight), viewed as ``shape`` if
        given (e.g. one head's block of MLA's ``kv_b_proj``, :func:`shared_numerics.mla.kv_b_chain_shape`), sharing
        the storage, the arithmetic and the log.

        Raises:
            ValueError: the part is not contiguous (``acc[index]`` must be one block of the storage)."""
        acc = self.acc[index]
        if not acc.is_contiguous():
            raise ValueError(f"grad chain: part {index!r} of {tuple(self.acc.shape)} is not contiguous")
        sub = GradChain.__new__(GradChain)
        sub.acc = acc if shape is None else acc.view(shape)
        sub.float32_products, sub.log, sub.partial = self.float32_products, self.log, False
        return sub

    def add(self, fn, *args) -> None:
        """``fn(acc, *args)``, an addition into the chains (e.g. a norm's backward kernel accumulating ``dweight``):
        now, or recorded when :attr:`log` is set — with copies of the tensor operands (strides kept): a pipeline
        stage receives each micro-batch's activations and gradients into the same buffers, FSDP frees the unsharded
        weights."""
        if self.log is None:
            fn(self.acc, *args)
        else:
            self.log.append((fn, self.acc, tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)))

    def add_gemm(self, a: torch.Tensor, b: torch.Tensor) -> None:
        """``acc += a · bᵀ``, K = tokens: ``a [I, T]`` (e.g. ``dY.t()``), ``b [J, T]`` (e.g. ``X.t()``), one dtype
        (bf16 on AMX without :attr:`float32_products`: ``T`` a multiple of :data:`CHAIN_K_MULTIPLE`). bf16 operands
        where :func:`shared_numerics.linear.linear` takes bf16 to the float32 path (no AMX) are widened to the float32
        kernel, as that linear's own chain is. Raises as
        :func:`shared_numerics.gemm_cpu.gemm_abt_accumulate`."""
        if self.float32_products or (a.dtype == torch.bfloat16 and bf16_path() != "amx"):
            a, b = a.float(), b.float()
        self.add(gemm_abt_accumulate, a, b)

    def add_rows(self, src: torch.Tensor, index: torch.Tensor | None = None) -> None:
        """Add the rows of ``src [T, H]`` (any float dtype, used as float32) in order: into ``acc[index[t]]``
        (``acc [V, H]``, ``index [T]`` int64) or, ``index=None``, into ``acc`` itself (``[H]``).

        Raises:
            ValueError: ``src``'s row length is not the accumulator's.
        """
        rows = self.acc.view(1, -1) if index is None else self.acc
        if src.shape[-1] != rows.shape[-1]:
            raise ValueError(f"grad chain: rows of {src.shape[-1]} into an accumulator of {tuple(self.acc.shape)}")
        src = src.reshape(-1, rows.shape[-1]).float()
        if index is None:
            index = torch.zeros(src.shape[0], dtype=torch.long)
        self.add(_index_add_rows, index.reshape(-1).long(), src, rows.shape)


def _index_add_rows(acc: torch.Tensor, index: torch.Tensor, src: torch.Tensor, rows: torch.Size) -> None:
    """``acc`` viewed as ``rows`` (``[V, H]``, or ``[1, H]`` for a vector) gets ``src``'s rows at ``index``, in
    index order (``Tensor.index_add_`` on CPU)."""
    acc.view(rows).index_add_(0, index, src)


def replay(log: list) -> None:
    """Run the additions :class:`GradChain` s recorded in ``log`` (their :attr:`~GradChain.log`), in call order, into
    their accumulators as they are now — the chains continue from there — and empty the log."""
    for fn, acc, args in log:
        fn(acc, *args)
    log.clear()


class _ChainedEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, chain: GradChain) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.chain = chain
        return torch.nn.functional.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ids,) = ctx.saved_tensors
        ctx.chain.add_rows(grad, ids)
        return None, None, None


def chained_embedding(ids: torch.Tensor, weight: torch.Tensor, chain: GradChain) -> torch.Tensor:
    """``F.embedding(ids, weight)`` whose weight gradient goes into ``chain`` (rows in ``ids``' order; none is
    returned to autograd).

    Args:
        ids: int64, any shape ``[...]``. weight: ``[V, H]``. chain: a :class:`GradChain` of ``[V, H]``.

    Returns:
        ``[..., H]`` in ``weight.dtype``.
    """
    return _ChainedEmbedding.apply(ids, weight, chain)


class _ChainedWeightGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor, x: torch.Tensor, chain: GradChain) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.chain = chain
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        dy = grad.reshape(-1, grad.shape[-1])
        if not ctx.chain.float32_products:  # the GEMM takes one dtype: dY as the linear's backward has it
            dy = dy.to(x.dtype)
        ctx.chain.add_gemm(dy.contiguous().t(), x.reshape(-1, x.shape[-1]).contiguous().t())
        return grad, None, None


def chained_weight_grad(y: torch.Tensor, x: torch.Tensor, chain: GradChain) -> torch.Tensor:
    """``y`` unchanged, whose backward also adds ``dYᵀ X`` into ``chain`` (K = tokens, in row order): the weight
    gradient of a product ``y = X Wᵀ`` computed some other way, whose ``W`` is then passed detached — summed over
    ``K`` blocks in the TP-invariant tree (:func:`shared_numerics.tensor_parallel.k_block_partials`: a whole MoE
    expert's down projection under TP x EP; a row-parallel linear's local columns,
    :func:`titan_plugin.tensor_parallel.row_parallel_dtensor`). The weight gradient of a product does not depend on
    how the forward blocked its sum.

    Args:
        y: ``[..., N]``. x: ``[..., K]`` with ``y``'s leading dimensions, detached or not (its gradient is the
            forward's). chain: ``[N, K]``; without :attr:`GradChain.float32_products`, ``dY`` is taken in
            ``x.dtype`` (as a linear's backward has it).

    Returns:
        ``y`` (a view), differentiable: its gradient passes through.
    """
    return _ChainedWeightGrad.apply(y, x.detach(), chain)
