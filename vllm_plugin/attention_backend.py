"""A vLLM attention backend that runs :func:`shared_numerics.paged_causal_attention` over the paged KV cache, on CPU
and CUDA alike.

What it declares (``vllm/v1/attention/backend.py`` ``AttentionBackend``):

* **KV cache**: vLLM 0.32 gives every layer a logical ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` view
  (``v1/kv_cache_interface.py``, content = K then V per token); this backend reads it as the two
  ``[num_blocks, num_kv_heads, block_size, head_size]`` halves (``kv_cache.split(head_size, -1)``, as vLLM's Triton
  backend does) and prefers the head-major layout ``LBHNC`` (each head's tokens of a block contiguous: the keys of one
  chunk are one strided load). The kernels take any strides, so another negotiated layout still works.
* **Block sizes**: multiples of 16 (vLLM's CUDA default 16, its CPU default 128); both numerics backends take any
  block size.
* **dtypes**: float32, bfloat16, float16; ``kv_cache_dtype="auto"`` only (the cache holds the model dtype's bits).

The metadata builder keeps vLLM's device tensors (``query_start_loc``, ``seq_lens``, ``block_table_tensor``,
``slot_mapping``) and the two host ints that size the kernel launch (``max_query_len``, ``max_seq_len``), so the
forward performs no device-to-host copy (CUDA-graph capturable: decode-only full graphs,
``UNIFORM_SINGLE_TOKEN_DECODE``). What only CUDA needs is in :mod:`vllm_plugin.cuda`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from shared_numerics import paged_causal_attention

from . import cuda

BACKEND_NAME = "ZEROKLD_ATTN"
LATENT_BACKEND_NAME = "ZEROKLD_LATENT_ATTN"

__all__ = [
    "BACKEND_NAME",
    "LATENT_BACKEND_NAME",
    "LatentAttention",
    "ZeroKLDAttentionBackend",
    "ZeroKLDAttentionMetadata",
    "ZeroKLDLatentAttentionBackend",
    "split_kv_cache",
    "write_slots",
]


def split_kv_cache(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's per-layer ``[blocks, kv_heads, block_size, 2 * head_size]`` view -> its K and V halves (strided views,
    ``[blocks, kv_heads, block_size, head_size]`` each)."""
    key_cache, value_cache = kv_cache.split(head_size, dim=-1)
    return key_cache, value_cache


@dataclass
class ZeroKLDAttentionMetadata:
    """Per-batch metadata. Tensors live on the model's device: ``query_start_loc`` ``[num_reqs+1]``, ``seq_lens``
    ``[num_reqs]``, ``block_table`` ``[num_reqs, max_blocks]``, ``slot_mapping`` ``[num_actual_tokens]`` (all int).
    ``max_query_len`` / ``max_seq_len`` are host ints that size the launch (never the arithmetic)."""

    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor


class ZeroKLDAttentionMetadataBuilder(AttentionMetadataBuilder[ZeroKLDAttentionMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.max_model_len = vllm_config.model_config.max_model_len

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> ZeroKLDAttentionMetadata:
        m = common_attn_metadata
        if m.causal is not True:
            raise NotImplementedError("zerokld attention supports causal decoder attention only")
        n = m.num_reqs
        return ZeroKLDAttentionMetadata(
            num_actual_tokens=m.num_actual_tokens,
            max_query_len=int(m.max_query_len),
            max_seq_len=int(m.max_seq_len),
            query_start_loc=m.query_start_loc[: n + 1],
            seq_lens=m.seq_lens[:n],
            block_table=m.block_table_tensor[:n],
            slot_mapping=m.slot_mapping[: m.num_actual_tokens],
        )

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> ZeroKLDAttentionMetadata:
        return cuda.capture_metadata(self.build(0, common_attn_metadata), self.max_model_len)


def write_slots(cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``cache[block, :, offset] = rows`` at each token's slot (``slot = block * block_size + offset``; negative slots
    are padding). ``cache``: ``[blocks, heads, block_size, width]``; rows: ``[tokens, heads, width]``."""
    bs = cache.shape[2]
    slots = slot_mapping.long()
    n = slots.shape[0]
    valid = slots >= 0
    slots = slots[valid]
    cache[slots // bs, :, slots % bs] = rows[:n][valid].to(cache.dtype)


class ZeroKLDAttentionImpl(AttentionImpl):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
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

    def do_kv_cache_update(
        self,
        layer: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write the scheduled tokens' keys and values at their slots (``slot = block * block_size + offset``;
        negative slots are padding). Data movement only: the same bits on every device."""
        key_cache, value_cache = split_kv_cache(kv_cache, self.head_size)
        if key_cache.is_cuda:
            cuda.write_kv_cache(layer, key, value, key_cache, value_cache, slot_mapping)
            return
        write_slots(key_cache, key, slot_mapping)
        write_slots(value_cache, value, slot_mapping)

    def caches(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``[blocks, kv_heads, block_size, head_size]`` key and value views of a layer's cache."""
        return split_kv_cache(kv_cache, self.head_size)

    def forward(
        self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, output_block_scale=None
    ):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by zerokld attention")
        if attn_metadata is None:  # memory profiling / warm-up
            return output
        md = attn_metadata
        n = md.num_actual_tokens
        key_cache, value_cache = self.caches(kv_cache)
        out = paged_causal_attention(
            query[:n],
            key_cache,
            value_cache,
            md.query_start_loc,
            md.seq_lens,
            md.block_table,
            self.scale,
            md.max_query_len,
            md.max_seq_len,
        )
        output[:n].copy_(out.reshape(output[:n].shape))
        return output


class ZeroKLDAttentionBackend(AttentionBackend):
    """Batch-invariant attention over vLLM's paged cache. Registered under :data:`BACKEND_NAME`; models hand it to
    ``Attention(..., attn_backend=ZeroKLDAttentionBackend)``, so it is used whatever the platform would pick."""

    forward_includes_kv_cache_update = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float32, torch.bfloat16, torch.float16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[ZeroKLDAttentionImpl]:
        return ZeroKLDAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[ZeroKLDAttentionMetadataBuilder]:
        return ZeroKLDAttentionMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(16)]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return False

    @classmethod
    def supports_non_causal(cls) -> bool:
        return False


class ZeroKLDLatentAttentionImpl(ZeroKLDAttentionImpl):
    """Multi-query attention over a latent cache (MLA, :mod:`shared_numerics.mla`): one cache row of ``head_size``
    values per token (``kv_lora_rank + qk_rope_head_dim``), serving as the keys and the values of every query head;
    the layer's output has ``head_size`` columns per head (the model keeps the first ``kv_lora_rank``)."""

    def do_kv_cache_update(
        self,
        layer: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write the scheduled tokens' latents (``key``; ``value`` is the same tensor) at their slots (torch
        indexing on every device; not CUDA-graph capturable)."""
        write_slots(kv_cache, key, slot_mapping)

    def caches(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return kv_cache, kv_cache  # the latent is the keys and the values


class ZeroKLDLatentAttentionBackend(ZeroKLDAttentionBackend):
    """:class:`ZeroKLDAttentionBackend` over a latent cache: the per-layer view is ``[num_blocks, 1, block_size,
    head_size]`` (vLLM's ``MLAAttentionSpec`` page: one latent per token, no separate values), read as keys and
    values alike. Registered under :data:`LATENT_BACKEND_NAME`; used by :class:`LatentAttention` layers only."""

    @staticmethod
    def get_name() -> str:
        return LATENT_BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[ZeroKLDLatentAttentionImpl]:
        return ZeroKLDLatentAttentionImpl


@functools.lru_cache(maxsize=1)
def _latent_attention_class():
    """The layer class, made once (vLLM's ``Attention`` is imported on first use, not at registration)."""
    from vllm.model_executor.layers.attention import Attention

    class _LatentAttention(Attention):
        """vLLM's ``Attention`` layer whose KV cache is a latent cache: its spec is vLLM's own ``MLAAttentionSpec``
        (``head_size`` values per token, ``num_kv_heads`` 1), so the cache holds what vLLM's MLA backends hold;
        attention runs :class:`ZeroKLDLatentAttentionBackend`."""

        def get_kv_cache_spec(self, vllm_config):
            from vllm.v1.kv_cache_interface import MLAAttentionSpec

            return MLAAttentionSpec(
                block_size=vllm_config.cache_config.block_size,
                num_kv_heads=1,
                head_size=self.head_size,
                dtype=self.kv_cache_torch_dtype,
            )

    return _LatentAttention


def LatentAttention(num_heads: int, head_size: int, scale: float, cache_config, prefix: str):
    """A latent-cache attention layer (see :class:`ZeroKLDLatentAttentionBackend`): ``num_heads`` query heads of
    ``head_size`` over one latent of ``head_size`` per token; ``forward(q [n, H * head_size], latent [n, head_size],
    latent)`` returns ``[n, H * head_size]``."""
    return _latent_attention_class()(
        num_heads,
        head_size,
        scale,
        num_kv_heads=1,
        cache_config=cache_config,
        prefix=prefix,
        attn_backend=ZeroKLDLatentAttentionBackend,
    )
