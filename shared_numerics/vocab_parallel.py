"""Vocab-parallel log-softmax: the same log-probs from the whole vocabulary or from any split of it over ranks.

Under tensor parallelism the lm_head is column-parallel: each rank holds the logits of a contiguous slice of the
vocabulary. The log-softmax needs two reductions over ``V``, a max and a sum. The max is exact in any order (an
all-reduce ``MAX`` of the ranks' maxima). A float sum is not: stock (Megatron's ``vocab_parallel_cross_entropy``,
torch's ``loss_parallel``) each rank sums its slice and an all-reduce adds the ``TP`` partials, so the bits depend on
the TP size, and the gathered-logits path (vLLM's sampler) sums in yet another order. Here the sum is *exact*, so
there is no order to fix:

* ``m = max(z)`` (exact); ``e_i = exp(z_i - m)`` in float64, ``0 <= e_i <= 1``.
* Each ``e_i`` is cut into two 40-bit fixed-point limbs, ``e_i 2^40 = a_i + b_i 2^-40 + r_i`` with integers
  ``0 <= a_i <= 2^40``, ``0 <= b_i < 2^40`` and ``0 <= r_i < 2^-40`` (dropped): every step (a power-of-two scaling,
  ``floor``, subtracting an integer part) is exact float64 arithmetic.
* The limbs are summed in int64 — exact, so the same integers whatever the order, the thread count, the shard
  boundaries or the TP size (even or uneven shards, power of two or not); across ranks the ``[TP, N, 2]`` limb sums
  are all-gathered and added. With ``V < 2^23`` (:data:`MAX_VOCAB`) no limb sum overflows.
* ``S = (A + B 2^-40) 2^-40`` after carrying ``B -> A`` (a fixed float64 formula of exact integers),
  ``lse = log(S)`` in float64, ``log p_i = float32(float64(z_i - m) - lse)``. A NaN or ``+inf`` logit gives NaN.

The dropped ``r_i`` total below ``V 2^-80`` against ``S >= 1`` (the max's own term is 1), under float64's resolution:
about as accurate as the float64 tree of :func:`shared_numerics.logprobs.log_softmax` (same float32 bits for almost
every row, measured), but not the same definition, so it is part of the numerics
contract: both sides use it when :attr:`shared_numerics.NumericsMode.tp_k_block` is set (vLLM's sampler on the
gathered logits, the trainer on its vocab shard). Gradient: ``d lse / d z_i = e_i / S`` on each rank's own slice (no
communication: every rank holds the same ``S`` and the same upstream gradient).

The one residual risk is :mod:`shared_numerics.reduce`'s: float64 ``exp`` of the same input may differ by one float64
ulp between ATen's SIMD body and scalar tail, and a shard moves an element between them; after the float32 rounding
that shows with probability about ``2^-29`` per token (never seen in the tests).

Source: Megatron-LM ``tensor_parallel/cross_entropy.py`` (``_VocabParallelCrossEntropy``: local max and sum, then
all-reduces) and torch ``distributed/tensor/parallel/loss.py`` (``loss_parallel``) for the vocab-parallel layout;
exact fixed-point accumulation as in reproducible BLAS summation (Demmel & Nguyen, "Parallel reproducible summation",
IEEE TC 2015), here with plain integer limbs since ``0 <= e_i <= 1``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["MAX_VOCAB", "fused_selected_logprobs", "log_softmax", "logsumexp", "selected_logprobs"]

LIMB_BITS = 40
MAX_VOCAB = 1 << (63 - LIMB_BITS)  # a limb sum is at most V * 2^40 < 2^63
_SCALE = float(1 << LIMB_BITS)
_MASK = (1 << LIMB_BITS) - 1

Gather = Callable[[torch.Tensor], torch.Tensor]


def _limb_sums(shifted: torch.Tensor) -> torch.Tensor:
    """``[N, V]`` float32 ``z - m`` -> ``[N, 2]`` int64: the two limb sums of ``exp`` (float64). In place on one
    float64 temporary; a non-finite ``e_i`` gives garbage limbs, and :func:`_value` is told by the max instead."""
    x = torch.exp(shifted.double()).mul_(_SCALE)
    a = torch.floor(x)
    hi = a.to(torch.int64).sum(dim=-1)
    lo = torch.floor_(x.sub_(a).mul_(_SCALE)).to(torch.int64).sum(dim=-1)
    return torch.stack([hi, lo], dim=-1)


def _value(sums: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    """``[N, 2]`` int64 limb sums -> ``[N]`` float64 ``S``; NaN where ``bad`` (a NaN or ``+inf`` logit)."""
    hi, lo = sums.unbind(-1)
    hi = hi + (lo >> LIMB_BITS)
    lo = lo & _MASK
    s = (hi.double() + lo.double() / _SCALE) / _SCALE
    return torch.where(bad, torch.full_like(s, float("nan")), s)


def _sum_exp(shifted: torch.Tensor, bad: torch.Tensor, gather: Gather | None) -> torch.Tensor:
    """``[N]`` float64 ``S = sum exp(z - m)`` over every rank's slice: this rank's limb sums, gathered and added
    (int64: exact in any order), then :func:`_value`."""
    sums = _limb_sums(shifted)
    if gather is not None:
        sums = gather(sums.unsqueeze(0)).sum(dim=0)
    return _value(sums, bad)


def _check_vocab(vocab_size: int) -> None:
    if vocab_size >= MAX_VOCAB:
        raise ValueError(f"vocab-parallel log-softmax: a vocabulary of {vocab_size} (at most {MAX_VOCAB - 1})")


class _LogSumExp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shifted: torch.Tensor, bad: torch.Tensor, gather: Gather | None) -> torch.Tensor:
        s = _sum_exp(shifted, bad, gather)
        ctx.save_for_backward(shifted, s)
        return torch.log(s)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shifted, s = ctx.saved_tensors
        p = torch.exp(shifted.double()) / s.unsqueeze(-1)
        return (grad.double().unsqueeze(-1) * p).to(shifted.dtype), None, None


def _shift(logits: torch.Tensor, gather: Gather | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(z - m [N, V_local] float32, m [N], bad [N] bool)``: ``m`` the max over every rank's slice (exact); a
    non-finite max is taken as 0, and a NaN or ``+inf`` one marks the row bad (its sum is NaN)."""
    z = logits.float()
    m = z.amax(dim=-1).detach()
    if gather is not None:
        m = gather(m.unsqueeze(0)).detach().amax(dim=0)
    bad = torch.isnan(m) | (m == float("inf"))
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    return z - m.unsqueeze(-1), m, bad


def logsumexp(
    logits: torch.Tensor, gather: Gather | None = None, vocab_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(z - max z, log sum exp(z - max z))`` over the whole vocabulary, from this rank's slice.

    Args:
        logits: ``[N, V_local]`` any float dtype: this rank's contiguous vocabulary slice (all of ``V`` without
            ``gather``).
        gather: ``None`` (one rank), else an all-gather over the TP group ``[1, ...] -> [TP, ...]`` in rank order,
            for float32 maxima and int64 limb sums (what :func:`shared_numerics.tensor_parallel.row_parallel_linear`
            takes).
        vocab_size: the global ``V`` (default: this slice's width).

    Returns:
        ``shifted [N, V_local]`` float32 and ``lse [N]`` float64; the same ``lse`` bits on every rank and at every
        TP size and split. Differentiable in ``logits``.

    Raises:
        ValueError: a vocabulary of :data:`MAX_VOCAB` or more (the int64 limb sums could overflow).
    """
    _check_vocab(max(logits.shape[-1], vocab_size or 0))
    shifted, _, bad = _shift(logits, gather)
    return shifted, _LogSumExp.apply(shifted, bad, gather)


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """The vocab-parallel definition on full logits (vLLM's sampler ``compute_logprobs`` under ``tp_k_block``).

    Args:
        logits: ``[N, V]`` any float dtype.

    Returns:
        ``[N, V]`` float32; entry ``[i, t]`` is bitwise :func:`selected_logprobs` of any vocabulary split.
    """
    shifted, lse = logsumexp(logits)
    return (shifted.double() - lse.unsqueeze(-1)).float()


def selected_logprobs(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    *,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    gather: Gather | None = None,
) -> torch.Tensor:
    """Log-prob of one token per row from this rank's vocabulary slice.

    Args:
        logits: ``[N, V_local]`` this rank's logits for vocabulary ids ``[vocab_start, vocab_start + V_local)``.
        token_ids: ``[N]`` int64 global vocabulary ids (the same on every rank).
        vocab_start: the slice's first id.
        vocab_size: the global ``V`` (default ``vocab_start + V_local``, i.e. the whole vocabulary on one rank).
        gather: as for :func:`logsumexp`; it also brings the owning rank's picked logit to every rank.

    Returns:
        ``[N]`` float32, the same bits on every rank, bitwise ``log_softmax(full_logits)[i, token_ids[i]]`` at every
        TP size. Differentiable (each rank's gradient lands on its own slice).

    Raises:
        ValueError: a token id outside ``[0, vocab_size)``; see :func:`logsumexp`.
    """
    ids = _check_ids(token_ids, vocab_start + logits.shape[-1] if vocab_size is None else vocab_size)
    shifted, lse = logsumexp(logits, gather, vocab_size)
    return (_picked(shifted, ids, vocab_start, gather).double() - lse).float()


def _check_ids(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    ids = token_ids.reshape(-1).long()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"token ids outside [0, {vocab_size}): min {int(ids.min())}, max {int(ids.max())}")
    return ids


def _owned(ids: torch.Tensor, vocab_start: int, v_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(owned [N] bool, local index [N])``: which rows' tokens lie in this slice, and where (clamped)."""
    local = ids - vocab_start
    return (local >= 0) & (local < v_local), local.clamp(0, max(v_local - 1, 0))


def _picked(shifted: torch.Tensor, ids: torch.Tensor, vocab_start: int, gather: Gather | None) -> torch.Tensor:
    """``shifted[i, ids[i]]`` from the rank that owns it (float32 ``[N]``, differentiable)."""
    owned, local = _owned(ids, vocab_start, shifted.shape[-1])
    picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1)
    picked = torch.where(owned, picked, torch.zeros_like(picked))
    if gather is not None:  # one owner per row, every other rank contributes an exact 0
        picked = gather(picked.unsqueeze(0)).sum(dim=0)
    return picked


class _FusedSelectedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, ids, vocab_start, vocab_size, gather, chunk, chain, k_block):
        from .linear import linear

        n = hidden.shape[0]
        out = hidden.new_empty(n, dtype=torch.float32)
        m_all, s_all = hidden.new_empty(n, dtype=torch.float32), hidden.new_empty(n, dtype=torch.float64)
        for a in range(0, n, chunk):
            shifted, m, bad = _shift(linear(hidden[a : a + chunk], weight), gather)
            s = _sum_exp(shifted, bad, gather)
            m_all[a : a + chunk], s_all[a : a + chunk] = m, s
            picked = _picked(shifted, ids[a : a + chunk], vocab_start, gather)
            out[a : a + chunk] = (picked.double() - torch.log(s)).float()
        ctx.save_for_backward(hidden, weight, ids, m_all, s_all)
        ctx.vocab_start, ctx.chunk, ctx.gather, ctx.chain, ctx.k_block = vocab_start, chunk, gather, chain, k_block
        return out

    @staticmethod
    def backward(ctx, grad_out):
        from .linear import linear, matmul_rows
        from .tensor_parallel import column_parallel_dx

        hidden, weight, ids, m_all, s_all = ctx.saved_tensors
        w32 = weight.float()
        grad_h = torch.empty_like(hidden, dtype=torch.float32)
        chain = ctx.chain
        grad_w = None if chain is not None else torch.zeros_like(w32)
        for a in range(0, hidden.shape[0], ctx.chunk):
            h = hidden[a : a + ctx.chunk]
            g = grad_out[a : a + ctx.chunk].double().unsqueeze(-1)
            shifted = linear(h, weight).float() - m_all[a : a + ctx.chunk].unsqueeze(-1)
            dz = -(g * torch.exp(shifted.double()) / s_all[a : a + ctx.chunk].unsqueeze(-1))
            owned, local = _owned(ids[a : a + ctx.chunk], ctx.vocab_start, shifted.shape[-1])
            rows = torch.nonzero(owned).squeeze(-1)
            dz[rows, local[rows]] += g[rows, 0]
            dz = dz.float()
            if ctx.k_block:  # dh over V in the TP-aligned tree: the whole of it on every rank
                grad_h[a : a + ctx.chunk] = column_parallel_dx(dz, w32, ctx.k_block, ctx.gather)
            else:  # this rank's partial sum (the caller reduces it over the ranks)
                grad_h[a : a + ctx.chunk] = matmul_rows(dz, w32)
            if chain is not None:  # the float32 kernel's chains over the tokens go on (shared_numerics.grad_chain)
                chain.add_gemm(dz.t(), h.float().t())
            else:
                grad_w += dz.t() @ h.float()
        grad_w = None if grad_w is None else grad_w.to(weight.dtype)
        return grad_h.to(hidden.dtype), grad_w, None, None, None, None, None, None, None


def fused_selected_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    token_ids: torch.Tensor,
    *,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    gather: Gather | None = None,
    chunk: int | None = None,
    weight_chain=None,
    k_block: int = 0,
) -> torch.Tensor:
    """Fused lm_head + vocab-parallel selected log-probs: :func:`selected_logprobs` of ``linear(hidden, weight)``
    without the ``[N, V_local]`` logits in memory (chunks of rows), with a closed-form backward.

    Args:
        hidden: ``[N, H]`` final hidden states (float32 or bfloat16), the same on every rank.
        weight: ``[V_local, H]`` this rank's lm_head rows, vocabulary ids ``[vocab_start, vocab_start + V_local)``.
        token_ids: ``[N]`` int64 global vocabulary ids.
        vocab_start, vocab_size, gather: as for :func:`selected_logprobs`.
        chunk: rows per chunk (rounded up to a multiple of :data:`shared_numerics.linear.ROW_TILE`); ``None``:
            :func:`shared_numerics.fused_logprobs.auto_chunk` of ``V_local``. The result does not depend on it.
        weight_chain: a :class:`shared_numerics.grad_chain.GradChain` of ``[V_local, H]`` that takes the weight's
            gradient, chains over the rows in order on the float32 kernel (exact accumulation: any split of the rows
            into calls or chunks gives the same sums; none is returned to autograd).
        k_block: :attr:`shared_numerics.NumericsMode.tp_k_block`, nonzero: ``dh`` sums over the vocabulary in the
            TP-aligned tree (:func:`shared_numerics.tensor_parallel.column_parallel_dx`: ``V_local`` cut
            into ``k_block`` blocks, the ranks' float32 subtree roots gathered with ``gather``), so every rank holds
            the whole ``dh``, the same bits at every TP size; it must divide ``V_local``, and the ranks' slices must
            be equal (a power-of-two TP size).

    Returns:
        ``[N]`` float32, bitwise ``selected_logprobs(linear(hidden, weight), ...)`` (and the full-vocabulary bits at
        every split). Backward (recomputing each chunk's logits; the forward's max and sum are kept):
        ``dz = g (onehot(t) - e / S)`` on this rank's slice (float32, the same bits at every split and for every
        grouping of the rows), ``dh = dz @ W_local`` (``k_block`` 0: a partial sum over the ranks, which the caller
        reduces, e.g. a ``Partial`` DTensor gradient; else the tree's whole sum) and
        ``dW_local = sum_chunks dz^T h``, float32 (or into ``weight_chain``).

    Raises:
        ValueError: shape mismatch; see :func:`selected_logprobs`; in the backward, ``k_block`` not dividing
        ``V_local`` or a gathered TP size that is not a power of two.

    Source: :mod:`shared_numerics.fused_logprobs` (the TP 1 fused path; Liger-Kernel's
    ``fused_linear_cross_entropy``) with Megatron's vocab-parallel layout.
    """
    from .fused_logprobs import rows_per_chunk

    if (
        hidden.dim() != 2
        or weight.dim() != 2
        or hidden.shape[1] != weight.shape[1]
        or token_ids.shape != (hidden.shape[0],)
    ):
        raise ValueError(
            f"expected hidden [N, H], weight [V_local, H], token_ids [N]; got {tuple(hidden.shape)}, "
            f"{tuple(weight.shape)}, {tuple(token_ids.shape)}"
        )
    vocab_size = vocab_start + weight.shape[0] if vocab_size is None else vocab_size
    _check_vocab(max(weight.shape[0], vocab_size))
    ids = _check_ids(token_ids, vocab_size)
    return _FusedSelectedLogprobs.apply(
        hidden,
        weight,
        ids,
        vocab_start,
        vocab_size,
        gather,
        rows_per_chunk(chunk, weight.shape[0]),
        weight_chain,
        k_block,
    )
