"""Batch-invariant linear layer (``y = x @ W^T + b``) on CPU: fixed-shape vendor GEMM calls.

A BLAS ``gemm`` chooses its algorithm (gemv for one row, small-matrix kernels, packing, blocking, how the threads
split the work) from the problem shape, so the same row of ``x`` can come out different bits depending on how many
other rows are in the call. Here every call is cut into fixed ``ROW_TILE``-row tiles (zero-padded) and all tiles go
through one batched matmul (``torch.bmm``: MKL's batched ``sgemm`` on CPU) whose per-tile shape
``[ROW_TILE, K] x [K, N]`` never changes: a row's result depends only on the row, ``W`` and ``b`` — not on ``M``, not on
which tile the row lands in, and (the tests check it at 1 and 2 threads) not on the thread count.

Tile size: the batched GEMM packs ``W`` once per tile, so small tiles pay that copy ``M / ROW_TILE`` times, while a
decode step of a few rows computes a whole tile; ``benchmarks/linear.py`` measures the trade-off (``--row-tiles``).
32 rows (measured on a 2-core AMD EPYC, AVX2, float32, ``K = N = 1024``, ours ÷ ``F.linear`` forward): 0.19x at
``M = 1``, 0.67x at 16, 0.94x at 32, 0.77x at 256, 0.85x at 2048 (16 rows: 0.23x, 0.95x, 0.93x, 0.59x, 0.67x); an RL
step decodes a group of tens to hundreds of sequences at once and trains on thousands of tokens.

Precision: inputs and weights are upcast to float32, accumulation is float32, the result is rounded once to the input
dtype (bf16 in, bf16 out). On a CPU without bf16 matrix units (AVX2) this is also the fast path: torch's bf16 GEMM
there has no vendor kernel.

bf16 on a CPU with bf16 matrix units (AMX-BF16 or AVX512-BF16, :func:`native_bf16_gemm`): ``x`` and ``W`` both
bf16 go straight to oneDNN (``torch.mm`` / ``torch.addmm``: bf16 operands, fp32 accumulation, bias added in fp32,
one rounding) as calls of exactly ``ONEDNN_ROWS`` rows (the last one zero-padded). oneDNN picks its kernel, K
blocking and whether to split K across threads (a parallel reduction: other bits) from the call's shape and the
number of OpenMP threads, so both are pinned: every call has the same shape, and runs on
:data:`ONEDNN_THREADS` threads (``ZEROKLD_GEMM_THREADS``, default the machine's CPU count, set for the call only, on
the calling thread's OpenMP state) whatever ``torch.get_num_threads()`` the process uses. Both are part of the
numerics contract (:data:`shared_numerics.mode.CONTRACT`), so a trainer and an engine that pinned different
counts are refused before anything runs. A ``torch.bmm`` over row tiles with an expanded bf16 weight is not used:
oneDNN repacks the weight per tile (measured 60x slower than ``F.linear`` on AMX).

Backward (:class:`_RowTiledLinear`): ``dX = dY W`` through the same row tiles (so the gradient of a row is row
invariant too) and ``dW = dY^T X`` as one float32 GEMM over the call's rows (deterministic for a given shape and
thread count; the trainer's exact streaming accumulates one rollout per backward, so its shape is that rollout's).

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
#: OpenMP threads of every oneDNN call of the native bf16 path (``ZEROKLD_GEMM_THREADS``; default ``os.cpu_count()``,
#: the same in every process of a machine, unlike the affinity a vLLM worker or a torchrun rank gets)
ONEDNN_THREADS = int(os.environ.get("ZEROKLD_GEMM_THREADS") or os.cpu_count() or 1)


@functools.lru_cache(maxsize=1)
def _openmp():
    """torch's OpenMP runtime (``libgomp``) or ``None``: the native bf16 path needs it to pin oneDNN's threads."""
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
    ``_is_mkldnn_bf16_supported``: AVX512-BF16 or AMX) and torch's OpenMP runtime is reachable to pin the threads.
    ``ZEROKLD_NATIVE_BF16=0`` turns it off (float32 tiles everywhere). A machine property: the same in the trainer
    and in the engine on one machine; it is part of :data:`GEMM_PARTITION`."""
    if os.environ.get("ZEROKLD_NATIVE_BF16", "1") == "0":
        return False
    return (torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
            and _openmp() is not None)


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
        everything else float32 row tiles.
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
