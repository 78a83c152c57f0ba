"""The one list of op names: every numerics backend's table (``torch``, ``triton``, a plugin's) is built from it
(:func:`op_table`) and checked against it when selected (:func:`shared_numerics.active_ops`)."""

from __future__ import annotations

__all__ = ["OP_NAMES", "op_table"]

OP_NAMES = (
    "linear",
    "rms_norm",
    "add_rms_norm",
    "rms_norm_rope",
    "rope_cos_sin",
    "apply_rope",
    "silu_and_mul",
    "log_softmax",
    "selected_logprobs",
    "dense_causal_attention",
    "paged_causal_attention",
    "fp8_linear",
    "fp8_linear_qat",
    "quantize_fp8_weight",
    "fused_selected_logprobs",
    "lora_linear",
    "add_lora",
)


def op_table(namespace: dict) -> dict:
    """``{name: namespace[name] for name in OP_NAMES}`` — a backend module passes its ``globals()``.

    Raises:
        KeyError: naming the ops the namespace lacks.
    """
    missing = [n for n in OP_NAMES if not callable(namespace.get(n))]
    if missing:
        raise KeyError(f"numerics backend lacks ops {missing}")
    return {name: namespace[name] for name in OP_NAMES}
