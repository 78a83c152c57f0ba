"""The ``triton`` numerics backend: the same op table as :mod:`shared_numerics.ops_torch`, as Triton kernels.

Selected automatically for CUDA tensors, or everywhere with ``ZEROKLD_BACKEND=triton``; on CPU it runs under
Triton's interpreter (``TRITON_INTERPRET=1``, set before the first kernel is imported), which is how CI proves these
kernels without a GPU. Each kernel has one fixed configuration (no autotuning: a shape-dependent choice would break
batch invariance) and computes every output row in one program whose work does not depend on the number of rows:

=========================  ==========================================================================================
op                         kernel
=========================  ==========================================================================================
``linear``                 tiled GEMM, BLOCK 32x64x32, fp32 ``tl.dot`` (``input_precision="ieee"``), K in fixed order
``rms_norm``               one row per program, fp32 statistics
``apply_rope``             one token per program (all heads), rotate-half
``silu_and_mul``           elementwise
``log_softmax`` /          one row per program, vocabulary in fixed 1024-wide blocks (max, then sum of exp, fp32)
``selected_logprobs``
``*_causal_attention``     one program per (16-query tile of one sequence, kv head), keys in 32-position chunks in
                           increasing order with the online softmax; dense and paged layouts share the kernel
``fp8_linear`` (+ QAT)     the FP8 quantizer of :mod:`shared_numerics.fp8` (row per program) and the FP8 GEMM
=========================  ==========================================================================================

Backward passes (training): Triton kernels too (GEMMs for linear, row kernels for the norm, rope, SiLU and
log-softmax, FlashAttention-2-style dQ and dK/dV kernels for dense attention); reductions over rows for weight
gradients use fixed-shape ``torch.sum`` (deterministic).
"""
from __future__ import annotations

import os

__all__ = ["OPS", "available", "unavailable_reason"]


def unavailable_reason() -> str | None:
    """Why this backend cannot run here, or ``None``."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "the triton package is not installed"
    import torch

    if torch.cuda.is_available():
        return None
    if os.environ.get("TRITON_INTERPRET") != "1":
        return "no CUDA device, and TRITON_INTERPRET=1 (Triton's CPU interpreter) is not set"
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(standard.sum, InterpretedFunction):  # triton.language was imported before the variable was set
        return ("TRITON_INTERPRET=1 was set after Triton was first imported in this process (by vLLM, TorchTitan, "
                "...); set it in the environment before starting Python")
    return None


def available() -> bool:
    return unavailable_reason() is None


def __getattr__(name: str):
    if name == "OPS":
        from .table import OPS

        return OPS
    raise AttributeError(name)
