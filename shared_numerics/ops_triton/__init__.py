"""The ``triton`` numerics backend: the same op table as :mod:`shared_numerics.ops_torch`, as Triton kernels.

Selected automatically for CUDA tensors, or everywhere with ``ZEROKLD_BACKEND=triton``; on CPU it runs under
Triton's interpreter (``TRITON_INTERPRET=1``, set before the first kernel is imported; :mod:`.interpreter` fills the
interpreter's gaps), which is how CI proves these kernels' logic without a GPU. Each kernel has one fixed
configuration (no autotuning: a shape-dependent choice would break batch invariance); a row's result depends only on
the row:

=========================  ==========================================================================================
op                         kernel
=========================  ==========================================================================================
``linear``                 persistent GEMM, bf16/fp16 operands into tensor cores with fp32 accumulation (fp32:
                           ``ieee`` dots), K in fixed 64-wide blocks in order; a decode-size path (64-row tiles,
                           width by N) for small M — the same bits (:mod:`.matmul`)
``rms_norm``,              one kernel: rows reduced on their own (rows per program fixed by the row length), the
``add_rms_norm``,          residual add and the QK-norm's rotation as runtime variants, so fused == unfused bitwise
``rms_norm_rope``          (:mod:`.pointwise`)
``apply_rope``             rotate-half with explicit fma, (token, head) rows packed per program
``silu_and_mul``           elementwise
``log_softmax`` /          one row per program, vocabulary in fixed 1024-wide blocks (max, then sum of exp, fp32)
``selected_logprobs``
``*_causal_attention``     FlashAttention-2 on tensor cores with fixed 512-key splits and 64-key chunks; decodes run
                           one program per split + an ordered combine, prefill and the trainer merge the splits in
                           the program — the same bits (:mod:`.attention`)
``fp8_linear`` (+ QAT)     the FP8 quantizer of :mod:`shared_numerics.fp8` (row per program) and a persistent FP8
                           GEMM, e4m3 straight into tensor cores where the GPU has them (:mod:`.fp8`)
=========================  ==========================================================================================

Backward passes (training): Triton kernels too (the input gradient of linear on the same GEMM, row kernels for the
norm, rope, SiLU and log-softmax, FlashAttention-2 dQ and dK/dV kernels for dense attention, no atomics); reductions
over rows for weight gradients — linear's ``dW`` as one ``torch.mm`` (cuBLAS), the others fixed-shape ``torch.sum`` —
are deterministic for their shapes (:mod:`shared_numerics.gemm_autograd`).
"""

from __future__ import annotations

import os

from .interpreter import install as _install_interpreter_fixes

__all__ = ["OPS", "available", "unavailable_reason"]

_install_interpreter_fixes()  # a no-op unless TRITON_INTERPRET=1


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
        return (
            "TRITON_INTERPRET=1 was set after Triton was first imported in this process (by vLLM, TorchTitan, "
            "...); set it in the environment before starting Python"
        )
    return None


def available() -> bool:
    return unavailable_reason() is None


def __getattr__(name: str):
    if name == "OPS":
        from .table import OPS

        return OPS
    raise AttributeError(name)
