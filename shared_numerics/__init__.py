"""zerokld shared numerics: one batch-invariant op set used by both the trainer and the rollout engine.

Every op returns, for a given row, the same bits whatever else is in the call and whatever the thread count; the
trainer (``titan_plugin``) and vLLM (``vllm_plugin``) both call these functions and nothing else for the forward that
produces log-probs. See ``DESIGN`` notes in each module for the source each op mirrors.
"""
from .activation import silu_and_mul
from .attention import (
    KEY_CHUNK, attention_over_slots, dense_causal_attention, paged_causal_attention, paged_slot_table,
)
from .linear import ROW_TILE, linear
from .logprobs import log_softmax, selected_logprobs
from .metrics import logprob_diff_metrics
from .norm import rms_norm
from .reduce import exp64, log64, tree_sum
from .rope import apply_rope, rope_cos_sin

__all__ = [
    "KEY_CHUNK", "ROW_TILE", "apply_rope", "attention_over_slots", "dense_causal_attention", "exp64", "paged_causal_attention", "linear",
    "log64", "log_softmax", "logprob_diff_metrics", "paged_slot_table", "rms_norm", "rope_cos_sin",
    "selected_logprobs", "silu_and_mul", "tree_sum",
]
