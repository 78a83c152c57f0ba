"""Batch-invariant linear layer (``y = x @ W^T + b``) on CPU: vendor GEMM calls of one fixed shape at a pinned
thread count.

A GEMM library chooses its kernel, its K blocking and whether to split K across threads (a parallel reduction: other
bits) from the problem shape and the number of threads, so the same row of ``x`` can come out different bits depending
on how many other rows share the call or how many threads the process runs (measured on a 2-core Xeon with AMX:
``F.linear`` of one row ≠ the same row in 300 at K 1024–4096; one fixed 128-row oneDNN call differs between 1 and 2
threads at K 3072–8192; MKL's batched ``sgemm`` over 32-row tiles — this module's earlier path — splits a lone tile
across two threads, so a decode row differed from its prefill). Here both are pinned:

* every call is exactly ``rows`` rows (``ROW_TILE`` = 32 for float32, ``ONEDNN_ROWS`` = 128 for native bf16; the last
  one zero-padded), issued to oneDNN through ``torch.ops.mkldnn._linear_pointwise`` (torch's CPU linear op);
* every call runs on :data:`ONEDNN_THREADS` OpenMP threads (``ZEROKLD_GEMM_THREADS``, default 1, see there), set on
  the calling thread's OpenMP state for the calls only, whatever ``torch.get_num_threads()`` the process uses (a vLLM
  worker, a torchrun rank with ``OMP_NUM_THREADS=1``, the trainer).

So a row's result depends only on the row, ``W`` and ``b``: not on ``M``, not on which call it lands in, not on the
process's thread count. The thread count and the bf16 path are in the numerics contract
(:data:`shared_numerics.mode.CONTRACT` via :data:`GEMM_PARTITION`): a trainer and an engine that pinned different
counts are refused before anything runs.

Precision: float32 operands (bf16 inputs on a CPU without bf16 matrix units are upcast, exactly) with float32
accumulation, the result rounded once to the input dtype. bf16 on a CPU with bf16 matrix units (AMX-BF16 or
AVX512-BF16, :func:`native_bf16_gemm`): bf16 operands go straight in, fp32 accumulation, the bias added in fp32, one
rounding — torch's own bf16 linear arithmetic, on the matrix units. A ``torch.bmm`` over row tiles with an expanded
bf16 weight is not used: oneDNN repacks the weight per tile (measured 60x slower than ``F.linear`` on AMX).

Call size: a decode step of a few rows computes one whole call, prefill/training issue ``M / rows`` calls;
``benchmarks/linear.py`` measures the trade-off (``--row-tiles`` for float32). Measured ours ÷ ``F.linear`` (stock on 2
torch threads), forward, ``K = N = 1024``, M = 1 / 16 / 256 / 2048, 2-core Xeon with AMX: one pinned thread (the
default, ``benchmarks/results/linear_cpu2_amx.json``) bf16 0.20x / 0.25x / 0.29x / 0.26x, float32 0.07x / 0.39x /
0.33x / 0.30x; two pinned threads (``linear_cpu2_amx_gemm2threads.json``) bf16 0.30x / 0.25x / 0.66x / 0.40x, float32
0.08x / 0.55x / 0.53x / 0.46x. The float32-upcast bf16 path this replaces measured 0.07x at M = 2048.

Backward (:class:`_RowTiledLinear`, :class:`_OneDnnLinear`): ``dX = dY W`` through the same fixed calls (the gradient
of a row is row invariant too) and ``dW = dY^T X`` as one GEMM over the call's rows (deterministic for a given shape
and thread count; the trainer's exact streaming accumulates one rollout per backward, so its shape is that rollout's).

Source: fixed-tile approach of vLLM's batch-invariant mode (``vllm/model_executor/layers/batch_invariant.py``) and of
Thinking Machines' persistent matmul (one fixed tile config); the closed-form backward is the one of
``torch.nn.functional.linear``.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import os

import torch

__all__ = ["GEMM_PARTITION", "ONEDNN_ROWS", "ONEDNN_THREADS", "ROW_TILE", "linear", "matmul_rows", "native_bf16_gemm"]

ROW_TILE = 32
#: rows of every oneDNN call of the native bf16 path (decode pads to one call; prefill/training issue M / 128 calls)
ONEDNN_ROWS = 128
#: OpenMP threads of every oneDNN call (``ZEROKLD_GEMM_THREADS``, default 1; both sides must set the same value, the
#: numerics contract checks it). 1 because every process of an RL loop must be able to run it without oversubscribing
#: the cores: vLLM's CPU worker shares them with its engine-core process, torchrun ranks each get one. Measured on a
#: 2-core Xeon (AMX), countdown demo steps 2-50: rollout 159.5 s at 2 pinned threads vs 18.9 s at 1 (stock 7.1 s);
#: training 26.1 s vs 30.8 s. Set it to the cores a process owns where trainer and engine do not share them.
ONEDNN_THREADS = int(os.environ.get("ZEROKLD_GEMM_THREADS") or 1)


@functools.lru_cache(maxsize=1)
def _openmp():
    """torch's OpenMP runtime (``libgomp``) or ``None``: every call of this module pins oneDNN's threads through it
    (:func:`_pinned_threads` raises without it)."""
    for name in (os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp.so.1"), "libgomp.so.1"):
        try:
            lib = ctypes.CDLL(name)
            lib.omp_get_max_threads.restype = ctypes.c_int
            return lib
        except OSError:
            continue
    return None


@functools.lru_cache(maxsize=1)
def native_bf16_gemm() -> bool:
    """Whether bf16 GEMMs take the native oneDNN path (see the module): the CPU has bf16 matrix units (oneDNN's
    ``_is_mkldnn_bf16_supported``: AVX512-BF16 or AMX). ``ZEROKLD_NATIVE_BF16=0`` turns it off (bf16 upcast to the
    float32 calls). A machine property: the same in the trainer and in the engine on one machine; it is part of
    :data:`GEMM_PARTITION`."""
    if os.environ.get("ZEROKLD_NATIVE_BF16", "1") == "0":
        return False
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def gemm_partition() -> str:
    """What decides a GEMM's bits here, for the numerics contract: the pinned thread count and the bf16 path
    (``"threads=T,bf16=native:rows=128"`` or ``"threads=T,bf16=fp32_tiles"``); the float32 call rows are
    :data:`ROW_TILE`."""
    bf16 = f"native:rows={ONEDNN_ROWS}" if native_bf16_gemm() else "fp32_tiles"
    return f"threads={ONEDNN_THREADS},bf16={bf16}"


GEMM_PARTITION = gemm_partition()


def _onednn_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> torch.Tensor:
    """``x @ weight^T (+ bias)`` as oneDNN calls (``torch.ops.mkldnn._linear_pointwise``, the op of torch's own
    CPU linear) of exactly ``rows`` rows (the last zero-padded) at :data:`ONEDNN_THREADS` OpenMP threads.

    Args:
        x: ``[M, K]`` float32 or bf16. weight: ``[N, K]``, ``x.dtype``. bias: ``[N]``, ``x.dtype``, or ``None``.

    Returns:
        ``[M, N]`` in ``x.dtype`` (fp32 accumulation, bias added in fp32, one rounding); row ``i`` depends only on
        ``x[i]``, ``weight`` and ``bias``: every call has the same shape and thread count.
    """
    m, k = x.shape
    n_calls = (m + rows - 1) // rows
    out = x.new_empty(n_calls * rows, weight.shape[0])
    x, weight = x.contiguous(), weight.contiguous()
    with _pinned_threads():
        for i in range(n_calls):
            lo = i * rows
            if lo + rows <= m:
                src = x[lo: lo + rows]
            else:
                src = x.new_zeros(rows, k)
                src[: m - lo] = x[lo:]
            out[lo: lo + rows] = torch.ops.mkldnn._linear_pointwise(src, weight, bias, "none", [], "")
    return out[:m]


@contextlib.contextmanager
def _pinned_threads():
    """oneDNN calls inside run on :data:`ONEDNN_THREADS` OpenMP threads (the calling thread's OpenMP state only;
    ``torch.set_num_threads`` would also change MKL's and torch's process-wide counts)."""
    omp = _openmp()
    if omp is None:
        raise RuntimeError("shared_numerics.linear needs torch's OpenMP runtime (libgomp) to pin oneDNN's thread "
                           "count; this torch build has none")
    before = omp.omp_get_max_threads()
    omp.omp_set_num_threads(ONEDNN_THREADS)
    try:
        yield
    finally:
        omp.omp_set_num_threads(before)


def matmul_rows(x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """Row-invariant ``x @ w_t`` in float32 (no autograd of its own: :func:`linear` is the differentiable form).

    Args:
        x: ``[M, K]`` float32.
        w_t: ``[K, N]`` float32 (may be a transposed view).

    Returns:
        ``[M, N]`` float32; row ``i`` depends only on ``x[i]`` and ``w_t``: oneDNN calls of exactly ``ROW_TILE``
        rows at :data:`ONEDNN_THREADS` threads (:func:`_onednn_rows`).
    """
    return _onednn_rows(x, w_t.t(), None, ROW_TILE)


class _RowTiledLinear(torch.autograd.Function):
    """``x [M, K] @ w [N, K]^T`` in float32 with :func:`matmul_rows`; closed-form backward (see the module)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return matmul_rows(x, w.t())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = matmul_rows(grad, w) if ctx.needs_input_grad[0] else None
        grad_w = grad.t().mm(x) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w


class _OneDnnLinear(torch.autograd.Function):
    """bf16 ``x [M, K] @ w [N, K]^T + b`` with :func:`_onednn_rows`. Backward: ``dX = dY W`` through the same fixed
    calls (row invariant); ``dW = dY^T X`` as one bf16 oneDNN GEMM over the call's rows (fp32 accumulation, one
    rounding; deterministic for the call's shape at the pinned thread count) and ``db = sum(dY)`` in float32."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.has_bias = bias is not None
        return _onednn_rows(x, w, bias, ONEDNN_ROWS)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = _onednn_rows(grad, w.t(), None, ONEDNN_ROWS) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            with _pinned_threads():  # one bf16 oneDNN GEMM over the call's rows: fixed shape, pinned threads
                grad_w = grad.t().mm(x)
        grad_b = grad.float().sum(0).to(w.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Batch-invariant ``torch.nn.functional.linear``.

    Args:
        x: ``[..., K]``, float32 or bfloat16.
        weight: ``[N, K]`` (HF / ``nn.Linear`` layout), any float dtype.
        bias: optional ``[N]``.

    Returns:
        ``[..., N]`` in ``x.dtype``. Differentiable; the backward is deterministic (fixed-shape CPU ops, no atomics).
        bf16 ``x`` and ``weight`` on a CPU with bf16 matrix units take the native oneDNN path (module docstring);
        everything else the float32 ``ROW_TILE``-row calls.
    """
    lead = x.shape[:-1]
    if (x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.device.type == "cpu"
            and native_bf16_gemm()):
        b = None if bias is None else bias.to(torch.bfloat16)
        x2 = x.reshape(-1, x.shape[-1])
        if torch.is_grad_enabled() and (x2.requires_grad or weight.requires_grad
                                        or (b is not None and b.requires_grad)):
            y = _OneDnnLinear.apply(x2, weight, b)
        else:
            y = _onednn_rows(x2, weight, b, ONEDNN_ROWS)
        return y.reshape(*lead, weight.shape[0])
    x2 = x.reshape(-1, x.shape[-1]).float()
    w = weight.float()
    if torch.is_grad_enabled() and (x2.requires_grad or w.requires_grad):
        y = _RowTiledLinear.apply(x2, w)
    else:
        y = matmul_rows(x2, w.t())
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*lead, weight.shape[0])
