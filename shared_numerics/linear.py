"""Batch-invariant linear layer (``y = x @ W^T + b``) on CPU: compiled GEMM kernels whose per-element arithmetic is
fixed by their source, or — on CPUs without their units — vendor GEMM calls of one fixed shape at a pinned thread
count.

A GEMM library chooses its kernel, its K blocking and whether to split K across threads (a parallel reduction: other
bits) from the problem shape and the number of threads, so the same row of ``x`` can come out different bits depending
on how many other rows share the call or how many threads the process runs (measured on a 2-core Xeon with AMX:
``F.linear`` of one row ≠ the same row in 300 at K 1024–4096; one fixed 128-row oneDNN call differs between 1 and 2
threads at K 3072–8192). Paths, chosen per machine (:func:`gemm_partition`, in the numerics contract):

* **bf16 on AMX** (:func:`shared_numerics.gemm_cpu.amx_available`): ``csrc/gemm.cpp``'s AMX kernel, ``A = W``,
  ``B = x``: K in 32-element ``TDPBF16PS`` steps into one float32 accumulator per element, bias in float32, one
  rounding — torch's bf16 linear arithmetic on the matrix unit. Every element is computed whole by one thread of
  torch's OpenMP team, so the bits depend on neither ``M`` nor the thread count, and no Python loop runs per tile.
* **float32 on FMA units** (:func:`~shared_numerics.gemm_cpu.f32_available`: AVX-512, or AVX2 + FMA): the same
  kernel file's FMA kernel (one fused multiply-add chain per element in K order, register tiles of the BLIS/MKL
  micro-kernel form; the same bits on both ISAs), likewise whole per element.
* **bf16 without AMX** (AVX-512 with or without AVX512-BF16, AVX2): the float32 path on the operands' exact upcasts,
  one rounding of the float32 result to bf16. The FMA kernel reads the bf16 operands and widens each element as it
  loads it (nothing upcast in memory, forward and backward; the same bits). So bf16 runs the same bits on every FMA
  CPU without AMX (a Zen 4 and an AVX2 EPYC agree). Until 2026-11-30 bf16 took
  pinned 32-row oneDNN bf16 calls on AVX-512 CPUs; the float32 chains are faster at every size measured and give
  bf16 exact gradient accumulation there (2-core Xeon, AVX512-BF16, no AMX, K = N = 1024, bf16 ÷ ``F.linear``,
  oneDNN calls -> FMA kernel: forward M = 1 0.20x -> 1.07x, M = 32 0.71x -> 1.09x, M = 2048 0.42x -> 1.60x; forward +
  backward M = 2048 0.45x -> 1.61x; ``benchmarks/results/linear_xeon_avx512_cpu2.json``).
* CPUs without FMA: oneDNN float32 calls through ``torch.ops.mkldnn._linear_pointwise`` of exactly ``ROW_TILE`` = 32
  rows (the last zero-padded), each on :data:`ONEDNN_THREADS` OpenMP threads (``ZEROKLD_GEMM_THREADS``, default 1)
  set on the calling thread for the calls only; bf16 upcast to them.

So a row's result depends only on the row, ``W`` and ``b``. Trainer and engine on one machine take the same path; a
trainer and an engine whose contracts differ are refused before anything runs.

Speed, ours ÷ ``F.linear`` per dtype, M and direction: ``benchmarks/linear.py``; the committed run's figures are in
the docs' Benchmarks page (generated from ``benchmarks/results/linear_*.json``).

Backward (:class:`_Bf16KernelLinear`, :class:`_RowTiledLinear`): ``dX = dY W`` (a row of ``dX``
depends only on its row of ``dY``: row invariant too) and ``dW = dY^T X`` as one GEMM over the call's rows
(deterministic for a given shape; on the kernels at any thread count). With ``weight_chain`` / ``bias_chain``
(exact accumulation over micro-batches, :mod:`shared_numerics.grad_chain`) ``dW`` and ``db`` instead continue
float32 chains over the tokens and nothing is returned to autograd for them.

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

from zerokld_plugins import envs

from .gemm_cpu import amx_available, chain_available, f32_available, gemm_abt

__all__ = [
    "ONEDNN_THREADS",
    "ROW_TILE",
    "bf16_path",
    "gemm_partition",
    "linear",
    "matmul_rows",
]

#: rows of every oneDNN float32 call on a CPU without FMA units (a decode step pads to one call)
ROW_TILE = 32
#: OpenMP threads of every oneDNN call (``ZEROKLD_GEMM_THREADS``, default 1; both sides must set the same value, the
#: numerics contract checks it). 1 because every process of an RL loop must be able to run it without oversubscribing
#: the cores: vLLM's CPU worker shares them with its engine-core process, torchrun ranks each get one. Measured on a
#: 2-core Xeon (AMX), countdown demo steps 2-50: rollout 159.5 s at 2 pinned threads vs 18.9 s at 1 (stock 7.1 s);
#: training 26.1 s vs 30.8 s. Set it to the cores a process owns where trainer and engine do not share them.
ONEDNN_THREADS = envs.ZEROKLD_GEMM_THREADS


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


def bf16_path() -> str:
    """The kernel a bf16 :func:`linear` takes on this machine: ``"amx"`` (``csrc/gemm.cpp``'s AMX kernel) or
    ``"fp32"`` (the float32 path on the exact upcasts: the FMA kernel, reading bf16 in place). The one
    decision :func:`linear`, :func:`gemm_partition` and the weight-gradient chains (:mod:`shared_numerics.grad_chain`)
    all follow."""
    return "amx" if amx_available() else "fp32"


@functools.lru_cache(maxsize=1)
def gemm_partition() -> str:
    """What decides a GEMM's bits here, for the numerics contract: the pinned oneDNN thread count, the float32 path
    (``fmachain``: the kernel of :mod:`shared_numerics.gemm_cpu`, the same bits on AVX-512 and AVX2;
    ``onednn:rows=32``) and the bf16 path (``amx``; ``fp32``: the float32 path on the exact upcasts), e.g.
    ``"threads=1,f32=fmachain,bf16=amx"``. Computed on first call, not at import: it builds the GEMM kernel
    (:mod:`shared_numerics.cpu_kernels`; RuntimeError without a C++ compiler)."""
    f32 = "fmachain" if f32_available() else f"onednn:rows={ROW_TILE}"
    return f"threads={ONEDNN_THREADS},f32={f32},bf16={bf16_path()}"


def _onednn_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> torch.Tensor:
    """``x @ weight^T (+ bias)`` as oneDNN calls (``torch.ops.mkldnn._linear_pointwise``, the op of torch's own
    CPU linear) of exactly ``rows`` rows (the last zero-padded) at :data:`ONEDNN_THREADS` OpenMP threads.

    Args:
        x: ``[M, K]`` float32. weight: ``[N, K]`` float32. bias: ``[N]`` float32, or ``None``.

    Returns:
        ``[M, N]`` float32; row ``i`` depends only on ``x[i]``, ``weight`` and ``bias``: every call has the same shape
        and thread count.
    """
    m, k = x.shape
    n_calls = (m + rows - 1) // rows
    out = x.new_empty(n_calls * rows, weight.shape[0])
    x, weight = x.contiguous(), weight.contiguous()
    with _pinned_threads():
        for i in range(n_calls):
            lo = i * rows
            if lo + rows <= m:
                src = x[lo : lo + rows]
            else:
                src = x.new_zeros(rows, k)
                src[: m - lo] = x[lo:]
            out[lo : lo + rows] = torch.ops.mkldnn._linear_pointwise(src, weight, bias, "none", [], "")
    return out[:m]


@contextlib.contextmanager
def _pinned_threads():
    """oneDNN calls inside run on :data:`ONEDNN_THREADS` OpenMP threads (the calling thread's OpenMP state only;
    ``torch.set_num_threads`` would also change MKL's and torch's process-wide counts)."""
    omp = _openmp()
    if omp is None:
        raise RuntimeError(
            "shared_numerics.linear needs torch's OpenMP runtime (libgomp) to pin oneDNN's thread "
            "count; this torch build has none"
        )
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
        ``[M, N]`` float32; row ``i`` depends only on ``x[i]`` and ``w_t``: the AVX-512 kernel
        (:func:`shared_numerics.gemm_cpu.gemm_abt`, every element whole on one thread) where the CPU has it, else
        oneDNN calls of exactly ``ROW_TILE`` rows at :data:`ONEDNN_THREADS` threads (:func:`_onednn_rows`).
    """
    if f32_available() and x.device.type == "cpu":
        return gemm_abt(w_t.t(), x, transpose=True)
    return _onednn_rows(x, w_t.t(), None, ROW_TILE)


class _RowTiledLinear(torch.autograd.Function):
    """``x [M, K] @ w [N, K]^T`` in float32 with :func:`matmul_rows`; closed-form backward (see the module)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, chain=None) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.chain = chain
        return matmul_rows(x, w.t())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = matmul_rows(grad, w) if ctx.needs_input_grad[0] else None  # a row of dX: its row of dY only
        grad_w = None
        if ctx.chain is not None:  # dW's chains over the tokens go on (shared_numerics.grad_chain)
            ctx.chain.add_gemm(grad.t(), x.t())
        elif ctx.needs_input_grad[1]:  # dW = dY^T X: the kernel (thread invariant) where the CPU has it
            kernel = f32_available() and x.device.type == "cpu"
            grad_w = gemm_abt(grad.t(), x.t()) if kernel else grad.t().mm(x)
        return grad_x, grad_w, None


class _ChainedBias(torch.autograd.Function):
    """``y + bias`` (float32) whose bias gradient goes into a :class:`shared_numerics.grad_chain.GradChain`."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, bias: torch.Tensor, chain) -> torch.Tensor:
        ctx.chain = chain
        return y + bias.float()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.chain.add_rows(grad)
        return grad, None, None


class _Bf16KernelLinear(torch.autograd.Function):
    """bf16 ``x [M, K] @ w [N, K]^T + b`` on the AMX kernel, or without AMX on the FMA kernel reading bf16 in place
    (:func:`shared_numerics.gemm_cpu.gemm_abt`, ``A = w``, ``B = x``): row invariant at any thread count; the bits of
    the inference call, and on the FMA kernel those of the float32 path on the upcasts, without upcast copies of the
    weight or the activations (saved for backward as bf16). Backward: ``dX = dY W`` as ``gemm_abt(dY, Wᵀ)`` (a row of dX
    depends only on its row of dY: row invariant too), ``dW = dYᵀ X`` as ``gemm_abt(dYᵀ, Xᵀ)`` (K of that GEMM = the
    call's rows, so deterministic for the call's rows at any thread count), ``db = sum(dY)`` in float32; bf16
    results, one rounding each (on the FMA kernel the float32 chains of the upcast operands, then torch's rounding:
    the bits the upcast path's casts gave). Transposed operands are read in place (k-major), never copied by torch."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, chains=None) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.has_bias = bias is not None
        ctx.chains = chains
        return gemm_abt(w, x, bias, transpose=True)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = gemm_abt(grad, w.t()) if ctx.needs_input_grad[0] else None  # [M, K]; w.t() read k-major
        if ctx.chains is not None:  # the chains over the tokens go on (shared_numerics.grad_chain)
            w_chain, b_chain = ctx.chains
            w_chain.add_gemm(grad.t(), x.t())
            if b_chain is not None:
                b_chain.add_rows(grad)
            return grad_x, None, None, None
        grad_w = gemm_abt(grad.t(), x.t()) if ctx.needs_input_grad[1] else None  # [N, K]; both k-major
        grad_b = grad.float().sum(0).to(w.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, weight_chain=None, bias_chain=None
) -> torch.Tensor:
    """Batch-invariant ``torch.nn.functional.linear``.

    Args:
        x: ``[..., K]``, float32 or bfloat16.
        weight: ``[N, K]`` (HF / ``nn.Linear`` layout), any float dtype.
        bias: optional ``[N]``.
        weight_chain, bias_chain: :class:`shared_numerics.grad_chain.GradChain` s that take the weight's and the
            bias's gradients (exact accumulation; then none is returned to autograd). Only where
            :func:`shared_numerics.grad_chain.chain_available` holds for ``x.dtype`` (ValueError otherwise); a bf16
            ``x`` then has a multiple of 32 tokens.

    Returns:
        ``[..., N]`` in ``x.dtype``. Differentiable; the backward is deterministic (fixed-shape CPU ops, no atomics).
        bf16 ``x`` and ``weight`` take the AMX kernel where the CPU has it, everything else the float32 path (module
        docstring).
    """
    lead = x.shape[:-1]
    chained = weight_chain is not None
    if chained and (x.device.type != "cpu" or weight.dtype != x.dtype or not chain_available(x.dtype)):
        raise ValueError(f"exact gradient accumulation: no kernel path for a {x.dtype} linear on {x.device} here")
    if (
        x.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and x.is_cpu
        and (bf16_path() == "amx" or f32_available())
    ):
        # a bf16 kernel: AMX, or the FMA kernel reading bf16 in place (the float32 chains of the exact upcasts); the
        # bias as bf16 on both, added in float32 to each finished chain, one rounding
        b = None if bias is None else bias.to(torch.bfloat16)
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if chained:
            y = _Bf16KernelLinear.apply(x2, weight, b, (weight_chain, bias_chain))
        elif torch.is_grad_enabled() and (
            x2.requires_grad or weight.requires_grad or (b is not None and b.requires_grad)
        ):
            y = _Bf16KernelLinear.apply(x2, weight, b)
        else:
            y = gemm_abt(weight, x2, b, transpose=True)
        return y if x.dim() == 2 else y.reshape(*lead, weight.shape[0])
    # (no call where none is needed: at decode sizes this Python is a measurable share of a call, run with the caches
    # cold after the previous GEMM)
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    inference = not chained and not (
        torch.is_grad_enabled()
        and (x2.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
    )
    if x2.dtype != torch.float32:
        x2 = x2.float()
    w = weight if weight.dtype == torch.float32 else weight.float()
    if inference and f32_available() and x2.is_cpu:
        # inference: one kernel call, the bias added in float32 to each finished chain (the bits of ``y + b``)
        y = gemm_abt(w, x2, bias, transpose=True)
        if y.dtype == x.dtype and x.dim() == 2:
            return y
        return y.to(x.dtype).reshape(*lead, weight.shape[0])
    if chained:
        y = _RowTiledLinear.apply(x2, w, weight_chain)
    elif torch.is_grad_enabled() and (x2.requires_grad or w.requires_grad):
        y = _RowTiledLinear.apply(x2, w)
    else:
        y = matmul_rows(x2, w.t())
    if bias is not None:
        y = _ChainedBias.apply(y, bias, bias_chain) if bias_chain is not None else y + bias.float()
    return y.to(x.dtype).reshape(*lead, weight.shape[0])
