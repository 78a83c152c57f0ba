"""A vLLM attention backend that runs :func:`shared_numerics.paged_causal_attention` over the paged KV cache.

It keeps the CPU backend's KV-cache shape and layout (``[num_blocks, num_kv_heads, block_size, 2 * head_size]``,
LBHNC, from ``vllm/v1/attention/backends/cpu_attn.py``) so vLLM's CPU worker allocates and manages blocks as usual;
only the read (attention) and the write (``do_kv_cache_update``) are ours, both plain torch. The metadata is the
common per-batch metadata (``query_start_loc``, ``seq_lens``, ``block_table_tensor``, ``slot_mapping``) of
``vllm/v1/attention/backend.py``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.v1.attention.backend import AttentionImpl, AttentionMetadataBuilder, AttentionType, CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

from shared_numerics import paged_causal_attention

BACKEND_NAME = "ZEROKLD_ATTN"

__all__ = ["BACKEND_NAME", "ZeroKLDAttentionBackend", "ZeroKLDAttentionMetadata"]


@dataclass
class ZeroKLDAttentionMetadata:
    """Per-batch metadata (CPU tensors). ``query_start_loc``: ``[num_reqs+1]``; ``seq_lens``: ``[num_reqs]``;
    ``block_table``: ``[num_reqs, max_blocks]``; ``slot_mapping``: ``[num_actual_tokens]``."""

    num_actual_tokens: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor


class ZeroKLDAttentionMetadataBuilder(AttentionMetadataBuilder[ZeroKLDAttentionMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> ZeroKLDAttentionMetadata:
        m = common_attn_metadata
        if not (m.causal is True):
            raise NotImplementedError("zerokld attention supports causal decoder attention only")
        n = m.num_reqs
        return ZeroKLDAttentionMetadata(
            num_actual_tokens=m.num_actual_tokens,
            query_start_loc=m.query_start_loc_cpu[: n + 1],
            seq_lens=m.seq_lens[:n].cpu(),
            block_table=m.block_table_tensor[:n],
            slot_mapping=m.slot_mapping[: m.num_actual_tokens],
        )


class ZeroKLDAttentionImpl(AttentionImpl):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None, kv_cache_dtype: str,
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, sinks: torch.Tensor | None = None) -> None:
        unsupported = {
            "alibi_slopes": alibi_slopes is not None,
            "sliding_window": sliding_window not in (None, -1),
            "logits_soft_cap": bool(logits_soft_cap),
            "attn_type": attn_type != AttentionType.DECODER,
            "kv_sharing": kv_sharing_target_layer_name is not None,
            "sinks": sinks is not None,
            "kv_cache_dtype": kv_cache_dtype not in ("auto",),
        }
        bad = [k for k, v in unsupported.items() if v]
        if bad:
            raise NotImplementedError(f"zerokld attention does not support: {', '.join(bad)}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_sharing_target_layer_name = None
        self.attn_type = attn_type

    @staticmethod
    def _split(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        nb, h, bs, _ = kv_cache.shape
        key_cache, value_cache = kv_cache.view(nb, h, bs * 2, -1).chunk(2, dim=2)
        return key_cache, value_cache

    def do_kv_cache_update(self, layer: torch.nn.Module, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        key_cache, value_cache = self._split(kv_cache)
        bs = key_cache.shape[2]
        slots = slot_mapping.long()
        n = slots.shape[0]
        valid = slots >= 0
        slots = slots[valid]
        blk, off = slots // bs, slots % bs
        key_cache[blk, :, off] = key[:n][valid].to(key_cache.dtype)
        value_cache[blk, :, off] = value[:n][valid].to(value_cache.dtype)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by zerokld attention")
        if attn_metadata is None:  # memory profiling / warm-up
            return output
        n = attn_metadata.num_actual_tokens
        key_cache, value_cache = self._split(kv_cache)
        out = paged_causal_attention(
            query[:n], key_cache, value_cache, attn_metadata.query_start_loc, attn_metadata.seq_lens,
            attn_metadata.block_table, self.scale,
        )
        output[:n].copy_(out.reshape(output[:n].shape))
        return output


class ZeroKLDAttentionBackend(CPUAttentionBackend):
    """CPU KV layout, batch-invariant attention. Registered under :data:`BACKEND_NAME`."""

    supported_kv_cache_dtypes = ["auto"]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[ZeroKLDAttentionImpl]:
        return ZeroKLDAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[ZeroKLDAttentionMetadataBuilder]:
        return ZeroKLDAttentionMetadataBuilder

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return False

    @classmethod
    def supports_non_causal(cls) -> bool:
        return False
