"""The ``torch`` numerics backend: the op table registered (``shared_numerics.hooks``) under the name ``torch``."""

from __future__ import annotations

from .activation import silu_and_mul
from .attention import dense_causal_attention, paged_causal_attention
from .fp8 import fp8_linear, fp8_linear_qat, quantize_fp8_weight
from .fused_logprobs import fused_selected_logprobs
from .linear import linear
from .logprobs import log_softmax, selected_logprobs
from .lora import add_lora, lora_linear
from .norm import add_rms_norm, rms_norm
from .op_names import op_table
from .rope import apply_rope, rms_norm_rope, rope_cos_sin

OPS = op_table(globals())  # every name of shared_numerics.op_names.OP_NAMES, in that order
