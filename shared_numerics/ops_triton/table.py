"""The ``triton`` backend's op table (same names and signatures as :data:`shared_numerics.ops_torch.OPS`)."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from ..fused_logprobs import auto_chunk
from ..lora import add_lora_with, lora_linear_with
from ..op_names import op_table
from ..rope import rope_cos_sin
from .attention import dense_causal_attention, paged_causal_attention
from .fp8 import fp8_linear, fp8_linear_qat, quantize_fp8_weight
from .logprobs import log_softmax, selected_logprobs
from .matmul import linear
from .pointwise import add_rms_norm, apply_rope, rms_norm, rms_norm_rope, silu_and_mul

__all__ = ["OPS", "fused_selected_logprobs_with"]


def _head_chunk(linear_fn, hidden, weight, targets):
    return selected_logprobs(linear_fn(hidden, weight), targets)


def fused_selected_logprobs_with(
    linear_fn, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int | None = None
) -> torch.Tensor:
    """:func:`fused_selected_logprobs` on a GPU backend's row-invariant ``linear_fn`` (each table binds its own)."""
    chunk = chunk or auto_chunk(weight.shape[0])
    outs = []
    for s in range(0, hidden.shape[0], chunk):
        h, t = hidden[s : s + chunk], targets[s : s + chunk]
        outs.append(
            checkpoint(_head_chunk, linear_fn, h, weight, t, use_reentrant=False)
            if torch.is_grad_enabled()
            else _head_chunk(linear_fn, h, weight, t)
        )
    return torch.cat(outs) if outs else hidden.new_zeros(0, dtype=torch.float32)


def fused_selected_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int | None = None
) -> torch.Tensor:
    """Triton :func:`shared_numerics.fused_logprobs.fused_selected_logprobs`: ``selected_logprobs(linear(h, W), t)``
    chunk by chunk, each chunk's logits recomputed in the backward (activation checkpointing), so at most one chunk of
    ``[rows, vocab]`` logits is alive. Same bits as the unfused Triton path."""
    return fused_selected_logprobs_with(linear, hidden, weight, targets, chunk)


def lora_linear(x, weight, bias, lora_a, lora_b, scaling, adapter_ids):
    """Triton :func:`shared_numerics.lora.lora_linear`: the same gathering and float32 scale/add around the Triton
    GEMM (each adapter's rows: shrink, then expand, each one persistent-GEMM call)."""
    return lora_linear_with(linear, x, weight, bias, lora_a, lora_b, scaling, adapter_ids)


def add_lora(y, x, lora_a, lora_b, scaling, adapter_ids):
    """Triton :func:`shared_numerics.lora.add_lora` (the adapter half of :func:`lora_linear`)."""
    return add_lora_with(linear, y, x, lora_a, lora_b, scaling, adapter_ids)


OPS = op_table(globals())  # every name of shared_numerics.op_names.OP_NAMES, in that order
