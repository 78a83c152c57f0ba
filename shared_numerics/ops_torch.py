"""The ``torch`` numerics backend: the op table registered (``zerokld_plugins.builtin``) under the name ``torch``."""
from __future__ import annotations

from .activation import silu_and_mul
from .attention import dense_causal_attention, paged_causal_attention
from .fp8 import fp8_linear, fp8_linear_qat, quantize_fp8_weight
from .fused_logprobs import fused_selected_logprobs
from .linear import linear
from .logprobs import log_softmax, selected_logprobs
from .norm import add_rms_norm, rms_norm
from .rope import apply_rope, rms_norm_rope, rope_cos_sin

OPS = {
    "linear": linear,
    "rms_norm": rms_norm,
    "add_rms_norm": add_rms_norm,
    "rms_norm_rope": rms_norm_rope,
    "rope_cos_sin": rope_cos_sin,
    "apply_rope": apply_rope,
    "silu_and_mul": silu_and_mul,
    "log_softmax": log_softmax,
    "selected_logprobs": selected_logprobs,
    "dense_causal_attention": dense_causal_attention,
    "paged_causal_attention": paged_causal_attention,
    "fp8_linear": fp8_linear,
    "fp8_linear_qat": fp8_linear_qat,
    "quantize_fp8_weight": quantize_fp8_weight,
    "fused_selected_logprobs": fused_selected_logprobs,
}
