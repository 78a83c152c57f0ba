"""zerokld shared numerics: one batch-invariant op set used by both the trainer and the rollout engine.

Every op returns, for a given row, the same bits whatever else is in the call and whatever the thread count; the
trainer (``titan_plugin``) and vLLM (``vllm_plugin``) both call these functions and nothing else for the forward that
produces log-probs. Each module's docstring names the source its op mirrors.

The public ops below dispatch to a numerics backend registered through the ``zerokld`` plugin hooks
(:mod:`zerokld_plugins`): by default ``torch`` (:mod:`shared_numerics.ops_torch`) for CPU tensors and ``triton``
(:mod:`shared_numerics.ops_triton`) for CUDA tensors; ``cublas`` (:mod:`shared_numerics.ops_cublas`: Triton's table
with fixed-shape cuBLAS GEMMs) on request; ``ZEROKLD_BACKEND=<name>`` forces one backend for every call (on both
sides: trainer and vLLM must use the same one). ``ZEROKLD_BACKEND=triton`` on CPU needs Triton's interpreter
(``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch

from .attention import KEY_CHUNK, Q_TILE, attention_over_chunks
from .linear import ROW_TILE
from .metrics import logprob_diff_metrics
from .mkl_vml import settle_vml_dispatch
from .mode import NumericsMismatchError, NumericsMode, backend_for_device, check_same_numerics
from .op_names import OP_NAMES
from .reduce import exp64, tree_sum
from .rollout import RolloutBatch

# before any op of this package can run (importing its modules computes nothing): oneMKL's first-call dispatch race
# (shared_numerics.mkl_vml) would otherwise give the process's first multi-threaded exp / cos / log ... low-accuracy
# bits on one thread's chunk
settle_vml_dispatch()

__all__ = [
    "KEY_CHUNK",
    "NumericsMismatchError",
    "NumericsMode",
    "OP_NAMES",
    "Q_TILE",
    "ROW_TILE",
    "RolloutBatch",
    "active_ops",
    "add_rms_norm",
    "apply_rope",
    "attention_over_chunks",
    "backend_for_device",
    "backend_name",
    "check_same_numerics",
    "dense_causal_attention",
    "exp64",
    "fp8_linear",
    "fp8_linear_qat",
    "fused_selected_logprobs",
    "linear",
    "log_softmax",
    "lora_linear",
    "add_lora",
    "logprob_diff_metrics",
    "paged_causal_attention",
    "quantize_fp8_weight",
    "rms_norm",
    "rms_norm_rope",
    "rope_cos_sin",
    "selected_logprobs",
    "silu_and_mul",
    "tree_sum",
]


_OPS_CACHE: dict[str, dict] = {}


def backend_name(*tensors) -> str:
    """The backend a call on ``tensors`` uses: ``ZEROKLD_BACKEND`` if set, else ``triton`` for CUDA tensors, else
    ``torch`` (:func:`shared_numerics.mode.backend_for_device`, the rule :class:`NumericsMode` records)."""
    return backend_for_device("cuda" if any(getattr(t, "is_cuda", False) for t in tensors) else "cpu")


def active_ops(*tensors) -> dict:
    """The op table of the backend for ``tensors`` (see :func:`backend_name`).

    Raises:
        zerokld_plugins.UnknownNameError: no such backend is registered.
        RuntimeError: the backend is registered but cannot run here (the message says why), or its op table does
            not have exactly the ops of :data:`OP_NAMES`.
    """
    name = backend_name(*tensors)
    ops = _OPS_CACHE.get(name)
    if ops is None:
        from zerokld_plugins import get_backend, resolve

        from .hooks import zerokld_numerics_backends

        # the built-in backends resolve without scanning third-party entry points; any other name is a plugin's
        builtin = {b.name: b for b in zerokld_numerics_backends()}
        spec = builtin[name] if name in builtin else get_backend(name)
        if not resolve(spec.available)():
            reason = resolve(spec.unavailable_reason)() if spec.unavailable_reason else "not available"
            raise RuntimeError(f"numerics backend {name!r} cannot run on this machine: {reason}")
        table = resolve(spec.ops)
        if set(table) != set(OP_NAMES):
            missing, extra = sorted(set(OP_NAMES) - set(table)), sorted(set(table) - set(OP_NAMES))
            raise RuntimeError(
                f"numerics backend {name!r}: op table differs from shared_numerics.OP_NAMES "
                f"(missing {missing}, unknown {extra})"
            )
        ops = _OPS_CACHE[name] = {k: resolve(v) for k, v in table.items()}
    return ops


def linear(x, weight, bias=None):
    """See :func:`shared_numerics.linear.linear`."""
    return active_ops(x)["linear"](x, weight, bias)


def lora_linear(x, weight, bias, lora_a, lora_b, scaling, adapter_ids):
    """See :func:`shared_numerics.lora.lora_linear`."""
    return active_ops(x)["lora_linear"](x, weight, bias, lora_a, lora_b, scaling, adapter_ids)


def add_lora(y, x, lora_a, lora_b, scaling, adapter_ids):
    """See :func:`shared_numerics.lora.add_lora`."""
    return active_ops(x)["add_lora"](y, x, lora_a, lora_b, scaling, adapter_ids)


def rms_norm(x, weight, eps):
    """See :func:`shared_numerics.norm.rms_norm`."""
    return active_ops(x)["rms_norm"](x, weight, eps)


def add_rms_norm(x, residual, weight, eps):
    """See :func:`shared_numerics.norm.add_rms_norm`."""
    return active_ops(x)["add_rms_norm"](x, residual, weight, eps)


def rms_norm_rope(x, weight, eps, cos, sin):
    """See :func:`shared_numerics.rope.rms_norm_rope`; with tables narrower than ``x`` (partial RoPE, see
    :func:`apply_rope`) the unfused composition ``apply_rope(rms_norm(x, weight, eps), cos, sin)``."""
    if 2 * cos.shape[-1] < x.shape[-1]:
        return apply_rope(rms_norm(x, weight, eps), cos, sin)
    return active_ops(x)["rms_norm_rope"](x, weight, eps, cos, sin)


def rope_cos_sin(positions, head_dim, theta, scaling=None):
    """See :func:`shared_numerics.rope.rope_cos_sin`."""
    return active_ops(positions)["rope_cos_sin"](positions, head_dim, theta, scaling)


def apply_rope(x, cos, sin):
    """See :func:`shared_numerics.rope.apply_rope`. Partial RoPE: with ``cos`` / ``sin`` ``[N, R/2]`` for ``R`` below
    ``x``'s last dimension ``D``, the first ``R`` dimensions rotate (their two halves) and the other ``D - R`` pass
    through unchanged (HF ``apply_rotary_pos_emb`` with ``partial_rotary_factor = R / D``, e.g. GLM-4.5's 0.5).

    Raises:
        ValueError: tables wider than ``x`` (``R > D``)."""
    r = 2 * cos.shape[-1]
    if r == x.shape[-1]:
        return active_ops(x)["apply_rope"](x, cos, sin)
    if r > x.shape[-1]:
        raise ValueError(f"apply_rope: tables for {r} dimensions, x has {x.shape[-1]}")
    rotated = active_ops(x)["apply_rope"](x[..., :r].contiguous(), cos, sin)
    return torch.cat([rotated, x[..., r:]], dim=-1)


def silu_and_mul(gate, up):
    """See :func:`shared_numerics.activation.silu_and_mul`."""
    return active_ops(gate)["silu_and_mul"](gate, up)


def log_softmax(logits):
    """See :func:`shared_numerics.logprobs.log_softmax`."""
    return active_ops(logits)["log_softmax"](logits)


def selected_logprobs(logits, token_ids):
    """See :func:`shared_numerics.logprobs.selected_logprobs`."""
    return active_ops(logits)["selected_logprobs"](logits, token_ids)


def dense_causal_attention(q, k, v, scale):
    """See :func:`shared_numerics.attention.dense_causal_attention`."""
    return active_ops(q)["dense_causal_attention"](q, k, v, scale)


def paged_causal_attention(
    q, key_cache, value_cache, query_start_loc, seq_lens, block_table, scale, max_query_len=None, max_seq_len=None
):
    """See :func:`shared_numerics.attention.paged_causal_attention`."""
    return active_ops(q)["paged_causal_attention"](
        q, key_cache, value_cache, query_start_loc, seq_lens, block_table, scale, max_query_len, max_seq_len
    )


def fp8_linear(x, qweight, weight_scale, granularity="per_channel"):
    """See :func:`shared_numerics.fp8.fp8_linear`."""
    return active_ops(x)["fp8_linear"](x, qweight, weight_scale, granularity)


def fp8_linear_qat(x, weight, granularity="per_channel"):
    """See :func:`shared_numerics.fp8.fp8_linear_qat`."""
    return active_ops(x)["fp8_linear_qat"](x, weight, granularity)


def quantize_fp8_weight(weight, granularity="per_channel"):
    """See :func:`shared_numerics.fp8.quantize_fp8_weight`."""
    return active_ops(weight)["quantize_fp8_weight"](weight, granularity)


def fused_selected_logprobs(hidden, weight, targets, chunk=None):
    """See :func:`shared_numerics.fused_logprobs.fused_selected_logprobs`."""
    return active_ops(hidden)["fused_selected_logprobs"](hidden, weight, targets, chunk)
