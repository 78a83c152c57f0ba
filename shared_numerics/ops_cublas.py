"""The ``cublas`` numerics backend: the Triton op table with every GEMM issued to cuBLAS as calls of one fixed shape.

The second CUDA backend (``ZEROKLD_BACKEND=cublas`` on both sides): ``linear``, ``lora_linear`` / ``add_lora`` and
the fused lm_head log-probs run :func:`shared_numerics.gemm_cublas.linear` (cuBLAS GEMMs of exactly
:data:`~shared_numerics.gemm_cublas.CUBLAS_ROWS` rows: invariant by construction, the library's own kernels and
speed); attention, norms, RoPE, SiLU, log-softmax and the FP8 GEMM are the Triton backend's kernels
(:mod:`shared_numerics.ops_triton`). Its bits differ from the ``triton`` backend's GEMM (another kernel, another
accumulation order), so :class:`shared_numerics.mode.NumericsMode` names the backend and a trainer and an engine on
different backends are refused.
"""

from __future__ import annotations

__all__ = ["OPS", "available", "unavailable_reason"]  # noqa: F822 - OPS: built on first use by __getattr__


def unavailable_reason() -> str | None:
    """Why this backend cannot run here, or ``None``: it needs a CUDA device (cuBLAS) and the Triton backend."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device (cuBLAS is the GPU's library; on CPU use the torch backend)"
    from . import ops_triton

    reason = ops_triton.unavailable_reason()
    return None if reason is None else f"its non-GEMM ops are the Triton backend's: {reason}"


def available() -> bool:
    return unavailable_reason() is None


def _table() -> dict:
    from .gemm_cublas import linear
    from .lora import add_lora_with, lora_linear_with
    from .ops_triton.table import OPS as TRITON
    from .ops_triton.table import fused_selected_logprobs_with

    def lora_linear(x, weight, bias, lora_a, lora_b, scaling, adapter_ids):
        return lora_linear_with(linear, x, weight, bias, lora_a, lora_b, scaling, adapter_ids)

    def add_lora(y, x, lora_a, lora_b, scaling, adapter_ids):
        return add_lora_with(linear, y, x, lora_a, lora_b, scaling, adapter_ids)

    def fused_selected_logprobs(hidden, weight, targets, chunk=None):
        return fused_selected_logprobs_with(linear, hidden, weight, targets, chunk)

    gemms = {
        "linear": linear,
        "lora_linear": lora_linear,
        "add_lora": add_lora,
        "fused_selected_logprobs": fused_selected_logprobs,
    }
    return {name: gemms.get(name, op) for name, op in TRITON.items()}


def __getattr__(name: str):
    if name == "OPS":
        ops = globals()["OPS"] = _table()
        return ops
    raise AttributeError(name)
