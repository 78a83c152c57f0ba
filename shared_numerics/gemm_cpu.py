"""Batch-invariant GEMMs on the CPU's matrix and vector units: the compiled kernels of ``csrc/gemm.cpp``.

``C = A · Bᵀ`` for ``A [I, K]`` and ``B [J, K]`` (K contiguous), float32 accumulation, ``bias[i]`` added in float32,
one rounding to the output dtype:

* bf16 on AMX (:func:`amx_available`): K zero-padded to a multiple of 32, walked in 32-element ``TDPBF16PS`` steps
  from step 0 into one float32 accumulator;
* float32 on FMA units (:func:`f32_available`: AVX-512, or AVX2 + FMA): one fused multiply-add chain per element in
  K order from zero (``acc = fma(a[i][k], b[j][k], acc)``, k = 0, 1, ...; K blocks store and reload the float32
  partial sum, losslessly), register tiles of the BLIS/MKL micro-kernel form (48 rows of A x 8 of B on AVX-512,
  16 x 6 on AVX2) on operands packed once per call — the same bits on AVX-512 and AVX2. Without a bias, A and B may
  trade places (``fma(a, b, c) = fma(b, a, c)``: the same chains), so that a few rows of A take the few-rows paths
  and an ``[I, J]`` output is written as ``[J, I]`` in place: ``dX = dY W`` of one token and ``dW = dYᵀ X`` of a short
  micro-batch no longer pack the whole weight;
* bf16 without AMX: the same FMA kernel reading the bf16 operands and widening each element exactly as it loads it,
  so the bits are those of the float32 kernel on the operands' float32 upcasts (a bf16 output: that result rounded
  by torch, as ``.to(torch.bfloat16)``), without an upcast copy in memory.

Either way an element is computed whole by one thread, so its bits depend only on row ``i`` of ``A`` and row ``j`` of
``B``: not on ``I`` or ``J``, the tile it falls in or the thread count. :func:`shared_numerics.linear.linear` uses it
with ``A`` = the weight and ``B`` = the tokens, so a token's outputs are the same bits at decode (one row) and in a
2048-row prefill, on any number of threads.

Threads: torch's own OpenMP team, ``torch.get_num_threads()``. Inputs: plain CPU tensors (an ``AsyncCollectiveTensor``
is waited).

Speed ÷ ``F.linear``: ``benchmarks/linear.py`` (figures in the docs' Benchmarks page, generated from
``benchmarks/results/linear_*.json``). At decode sizes the Python around the kernel is a large share: it runs with
the caches cold after the previous GEMM has streamed its weight through them, so the common cases take the fewest
calls (``_operand``'s first test; :func:`shared_numerics.linear.linear`'s float32 path). 1 to 8 tokens stream the
weight in 16-row blocks turned in registers (at M = 1 the kernel is bound by the 16x16 transposes' shuffles, which
the per-element K chain needs: lanes are outputs), 9 to 48 tokens a path that broadcasts the weight's rows in place,
and a k-major weight (``Wᵀ`` in ``dX``) is streamed in place for up to 48 tokens (1 or 2 row after row, faster than
in column strips).
``gemm_abt_accumulate`` continues chains (exact gradient accumulation, :mod:`shared_numerics.grad_chain`).

Source: Intel 64 and IA-32 Architectures Software Developer's Manual, vol. 2 (``TDPBF16PS``, ``LDTILECFG``); the VNNI
operand layout of oneDNN's AMX kernels.
"""

from __future__ import annotations

import torch

from . import cpu_ops
from .cpu_kernels import plain
from .cpu_ops import amx_available, f32_available

__all__ = ["CHAIN_K_MULTIPLE", "amx_available", "chain_available", "f32_available", "gemm_abt", "gemm_abt_accumulate"]

#: K of every :func:`gemm_abt_accumulate` call on bf16 operands must be a multiple of this (the AMX kernel's K step),
#: so that consecutive calls walk the same 32-element steps as one call on their concatenation
CHAIN_K_MULTIPLE = 32


def chain_available(dtype: torch.dtype) -> bool:
    """Whether this machine's kernels run exact accumulation (:mod:`shared_numerics.grad_chain`) for a forward in
    ``dtype``: every GEMM gradient on a kernel of ``csrc/gemm.cpp`` — bf16 linears on AMX (or, without AMX, on the
    float32 kernel, as their forward), float32 linears and the fused lm_head's float32 gradient on the float32 kernel.
    CPUs without FMA units are not covered."""
    if not f32_available():
        return False
    return dtype in (torch.bfloat16, torch.float32)


def _operand(t: torch.Tensor, name: str, dtype: torch.dtype) -> torch.Tensor:
    """A ``[rows, K]`` operand the kernel reads in place (:func:`shared_numerics.cpu_ops.gemm_layout`: K contiguous,
    or a transposed view such as ``w.t()`` or ``grad.t()`` read k-major from its storage) as is; anything else
    copied."""
    # the common cases first, with the fewest calls (a decode-sized GEMM's Python runs with its caches cold: ~10 us a
    # call less at M = 1)
    if (
        (type(t) is torch.Tensor or type(t) is torch.nn.Parameter)
        and t.dtype == dtype
        and t.dim() == 2
        and t.is_cpu
        and cpu_ops.gemm_layout(t) is not None
    ):
        return t
    p = plain(t)
    if p is None or p.dtype != dtype or p.dim() != 2:
        raise TypeError(
            f"zerokld GEMM: {name} must be a 2-d {dtype} plain CPU tensor, got "
            f"{type(t).__name__} {tuple(t.shape)} {t.dtype} on {t.device}"
        )
    return p if cpu_ops.gemm_layout(p) is not None else p.contiguous()


def gemm_abt(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    transpose: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``A · Bᵀ (+ bias[:, None])``, or its transpose, on the AMX (bf16) or FMA (float32; bf16 without AMX) kernel
    (see the module).

    Args:
        a: ``[I, K]`` bf16 or float32 (K contiguous, or a transposed view such as ``w.t()``: read in place).
        b: ``[J, K]``, ``a.dtype``, likewise. bias: ``[I]`` (any float dtype, used as float32)
            or ``None``.
        transpose: return ``[J, I]`` (``B · Aᵀ + bias``: a linear layer's ``x Wᵀ + b`` with ``a = W``, ``b = x``).
        out_dtype: ``torch.bfloat16`` or ``torch.float32`` for bf16 inputs (default bf16); float32 inputs give
            float32.

    Returns:
        ``[I, J]`` (or ``[J, I]``) in ``out_dtype``; element ``(i, j)`` depends only on ``a[i]``, ``b[j]``,
        ``bias[i]``.

    Raises:
        TypeError: inputs not 2-d plain CPU tensors of one dtype (bf16 or float32). ValueError: K differs.
        RuntimeError: no kernel for the dtype here (check :func:`amx_available` / :func:`f32_available` first).
    """
    dtype = a.dtype if a.dtype in (torch.bfloat16, torch.float32) else torch.bfloat16
    a, b = _operand(a, "A", dtype), _operand(b, "B", dtype)
    out_dtype = out_dtype or dtype
    if dtype == torch.float32 and out_dtype != torch.float32:
        raise TypeError(f"zerokld GEMM: float32 inputs give float32, got out_dtype={out_dtype}")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"zerokld GEMM: A is {tuple(a.shape)} and B {tuple(b.shape)}: K differs")
    i_rows, k = a.shape
    j_rows = b.shape[0]
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"zerokld GEMM: out_dtype must be bf16 or float32, got {out_dtype}")
    out = torch.empty((j_rows, i_rows) if transpose else (i_rows, j_rows), dtype=out_dtype)
    if out.numel() == 0:
        return out
    if k == 0:
        if bias is None:
            return out.zero_()
        return out.copy_(bias.float().unsqueeze(0 if transpose else 1).expand_as(out))
    b32 = None if bias is None else bias.detach().float().contiguous()
    cpu_ops.gemm_abt(a, b, b32, out, transpose, False)
    return out


def gemm_f32_k_tree(a: torch.Tensor, b: torch.Tensor, k_block: int) -> torch.Tensor:
    """``B · Aᵀ`` summed over ``k_block``-wide blocks of ``K`` in the fixed TP-aligned tree, in one kernel pass:
    bitwise :func:`shared_numerics.tensor_parallel.block_tree_sum` of the blocks' :func:`gemm_abt` partials (each
    element's FMA chain from zero over its block), without storing them (``csrc/gemm.cpp`` ``gemm_f32_ktree``).

    Args:
        a: ``[I, K]`` float32 (a weight ``[N, K]``); b: ``[J, K]`` float32 (the tokens ``[M, K]``); K contiguous or
            transposed views, as :func:`gemm_abt`. k_block: divides ``K``.

    Returns:
        ``[J, I]`` float32.

    Raises:
        TypeError: operands not 2-d float32 plain CPU tensors. ValueError: K differs, or ``k_block`` does not divide
        it. RuntimeError: no float32 kernel here (check :func:`f32_available` first).
    """
    a, b = _operand(a, "A", torch.float32), _operand(b, "B", torch.float32)
    k = a.shape[1]
    if b.shape[1] != k:
        raise ValueError(f"zerokld GEMM: A is {tuple(a.shape)} and B {tuple(b.shape)}: K differs")
    if k_block <= 0 or k % k_block:
        raise ValueError(f"zerokld GEMM: k_block {k_block} does not divide K = {k}")
    out = torch.empty((b.shape[0], a.shape[0]), dtype=torch.float32)
    if out.numel() == 0:
        return out
    if k == 0:
        return out.zero_()
    cpu_ops.gemm_f32_ktree(a, b, out, k_block)
    return out


def gemm_abt_accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``acc += A · Bᵀ`` as the continuation of each element's chain: the kernel's accumulator starts from ``acc``'s
    float32 value instead of zero and walks K exactly as :func:`gemm_abt` does, so calls on consecutive K ranges leave
    the bits of one call on their concatenation (for bf16 operands each range a multiple of
    :data:`CHAIN_K_MULTIPLE`: the AMX kernel zero-pads K to its 32-element steps). What exact gradient accumulation
    over micro-batches needs: with ``K`` = tokens, ``dW = dYᵀ X`` summed over any grouping of the tokens is one chain
    per weight element.

    Args:
        acc: ``[I, J]`` float32, contiguous (updated in place and returned).
        a: ``[I, K]``, b: ``[J, K]`` — bf16 or float32, one dtype, layouts as :func:`gemm_abt` (``dY.t()`` and
            ``X.t()`` are read k-major in place).

    Raises:
        TypeError: ``acc`` not a contiguous float32 ``[I, J]`` plain CPU tensor, or the operands as in
            :func:`gemm_abt`. ValueError: K differs, or bf16 K not a multiple of :data:`CHAIN_K_MULTIPLE`.
        RuntimeError: no kernel for the dtype here.
    """
    dtype = a.dtype if a.dtype in (torch.bfloat16, torch.float32) else torch.bfloat16
    a, b = _operand(a, "A", dtype), _operand(b, "B", dtype)
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"zerokld GEMM: A is {tuple(a.shape)} and B {tuple(b.shape)}: K differs")
    target = plain(acc)
    if (
        target is None
        or target.dtype != torch.float32
        or not target.is_contiguous()
        or tuple(target.shape) != (a.shape[0], b.shape[0])
    ):
        raise TypeError(
            f"zerokld GEMM: the accumulator must be a contiguous float32 [{a.shape[0]}, {b.shape[0]}] "
            f"plain CPU tensor, got {type(acc).__name__} {tuple(acc.shape)} {acc.dtype}"
        )
    k = a.shape[1]
    if dtype == torch.bfloat16 and k % CHAIN_K_MULTIPLE:
        raise ValueError(f"zerokld GEMM: a bf16 chain's K ranges must be multiples of {CHAIN_K_MULTIPLE}, got {k}")
    if k == 0 or target.numel() == 0:
        return acc
    cpu_ops.gemm_abt(a, b, None, target, False, True)
    return acc
