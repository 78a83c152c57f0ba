"""The Gated DeltaNet token mixer's vLLM face (:class:`GatedDeltaNetLayer`, the
:class:`zerokld_models.mixers.GatedDeltaNet` component's): Qwen3-Next's ``linear_attn`` on
:func:`shared_numerics.gated_deltanet.gated_deltanet_varlen`, its per-sequence state in vLLM's mamba cache.

Per serving step: ``in_proj_qkvz`` and ``in_proj_ba`` (HF's layout, interleaved per key-head group: ``[q | k | v |
z]`` and ``[b | a]`` of each group, unpacked by slicing as HF's ``fix_query_key_value_ordering``), then the shared
definition over every scheduled sequence at once — decodes and prefill chunks alike, each sequence's tokens one
recurrence step after another from the state its cache slot holds (zeros for a sequence's first chunk) — and
``out_proj``. A token's bits are those of its sequence's earlier tokens only: the same whatever the batch, wherever
the scheduler cut a prefill into chunks and whether the token was prefilled or decoded.

The cache (vLLM's ``MambaSpec``, ``GDN_ATTN`` metadata; the shapes and dtypes stock's ``QwenGatedDeltaNetAttention``
declares, so vLLM sizes the pages as for the stock model): per sequence the conv state (``K - 1`` inputs of the
``2 Hk d_k + Hv d_v`` conv channels, model dtype; vLLM's ``SD`` or ``DS`` orientation) and the float32 recurrent state
(stock's ``[Hv, d_v, d_k]`` bytes, read as the definition's ``[Hv, d_k, d_v]``). With prefix caching vLLM keeps a
state per block (``mamba_cache_mode="align"``, prefill chunks cut at block boundaries) and copies it forward between
steps; the layer reads and writes the slot the metadata names.

Sources: vLLM ``model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py`` (the stock layer and its cache),
``ops/cpu/gdn_attention.py`` (its CPU path: decodes first, then prefills), ``v1/attention/backends/gdn_attn.py``
(``GDNAttentionMetadata``); HF ``modeling_qwen3_next.py`` (``Qwen3NextGatedDeltaNet``).
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
    is_conv_state_dim_first,
)
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from shared_numerics.gated_deltanet import gated_deltanet_varlen
from zerokld_models import ModelConfig
from zerokld_models.mixers import GatedDeltaNet, TokenMixer

from .dense import Fp8Mode, ResidualLayer, TensorParallel, _param, _proj

__all__ = ["GatedDeltaNetLayer", "GatedDeltaNetMixer", "unpack_qkvz_ba"]


def unpack_qkvz_ba(
    qkvz: torch.Tensor, ba: torch.Tensor, dims: tuple[int, int, int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Qwen3-Next's interleaved projections as the definition takes them (HF ``fix_query_key_value_ordering``:
    slicing, no arithmetic).

    Args:
        qkvz: ``[T, Hk * (2 d_k + 2 r d_v)]`` (``r = Hv / Hk``): per key-head group ``q [d_k] | k [d_k] | v [r d_v] |
            z [r d_v]``. ba: ``[T, Hk * 2 r]``: per group ``b [r] | a [r]``. dims: ``(Hk, d_k, Hv, d_v)``.

    Returns:
        ``(mixed_qkv [T, 2 Hk d_k + Hv d_v], z [T, Hv d_v], a [T, Hv], b [T, Hv])``, contiguous, each head-major (a
        group's value heads consecutive).
    """
    hk, dk, hv, dv = dims
    t, r = qkvz.shape[0], hv // hk
    g = qkvz.view(t, hk, 2 * dk + 2 * r * dv)
    q, k = g[..., :dk].reshape(t, hk * dk), g[..., dk : 2 * dk].reshape(t, hk * dk)
    v = g[..., 2 * dk : 2 * dk + r * dv].reshape(t, hv * dv)
    z = g[..., 2 * dk + r * dv :].reshape(t, hv * dv)
    gba = ba.view(t, hk, 2 * r)
    b, a = gba[..., :r].reshape(t, hv), gba[..., r:].reshape(t, hv)
    return torch.cat([q, k, v], dim=-1), z.contiguous(), a.contiguous(), b.contiguous()


class GatedDeltaNetMixer(nn.Module, MambaBase):
    """Qwen3-Next's ``linear_attn`` (HF parameter names): ``in_proj_qkvz [Hk (2 d_k + 2 r d_v), H]``, ``in_proj_ba
    [2 Hv, H]``, ``conv1d.weight [C, 1, K]``, ``A_log [Hv]``, ``dt_bias [Hv]``, ``norm.weight [d_v]``, ``out_proj
    [H, Hv d_v]``; a ``MambaBase`` layer of vLLM's (registered in the static forward context under ``prefix``, its
    cache bound by vLLM as ``kv_cache = (conv, recurrent)``). ``forward(a [n, H]) -> [n, H]`` in the model dtype."""

    def __init__(self, cfg: ModelConfig, vllm_config, prefix: str, fp8: Fp8Mode) -> None:
        super().__init__()
        self.prefix = prefix
        self.dims = (cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_num_value_heads,
                     cfg.linear_value_head_dim)  # fmt: skip
        hk, dk, hv, dv = self.dims
        h, k = cfg.hidden_size, cfg.linear_conv_kernel_dim
        self.channels = GatedDeltaNet.conv_channels(cfg)
        self.kernel, self.eps, self.hidden = k, cfg.rms_norm_eps, h
        self.in_proj_qkvz = _proj(2 * hk * dk + 2 * hv * dv, h, fp8)
        self.in_proj_ba = _proj(2 * hv, h, fp8)
        self.conv1d = nn.Module()
        self.conv1d.weight = _param(self.channels, 1, k)
        self.A_log = _param(hv)
        self.dt_bias = _param(hv)
        self.norm = nn.Module()
        self.norm.weight = _param(dv)
        self.out_proj = _proj(h, hv * dv, fp8)
        self.model_config, self.cache_config = vllm_config.model_config, vllm_config.cache_config
        self.kv_cache = (torch.tensor([]), torch.tensor([]))
        contexts = vllm_config.compilation_config.static_forward_context
        if prefix in contexts:
            raise ValueError(f"Duplicate layer name: {prefix}")
        contexts[prefix] = self

    # ---- vLLM's MambaBase -------------------------------------------------------------------------------------------
    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.GDN_ATTN

    def get_state_shape(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Stock's shapes (``MambaStateShapeCalculator.gated_delta_net_state_shape`` at TP 1, no speculation)."""
        hk, dk, hv, dv = self.dims
        return MambaStateShapeCalculator.gated_delta_net_state_shape(1, hk, hv, dk, dv, self.kernel, 0)

    def get_state_dtype(self) -> tuple[torch.dtype, torch.dtype]:
        """``(conv, recurrent)``: the model dtype and float32 (the start checks refuse any other
        ``mamba_ssm_cache_dtype``, :func:`vllm_plugin.support.check_supported`)."""
        return MambaStateDtypeCalculator.gated_delta_net_state_dtype(
            self.model_config.dtype, self.cache_config.mamba_cache_dtype, self.cache_config.mamba_ssm_cache_dtype
        )

    # ---- the layer ---------------------------------------------------------------------------------------------------
    def params(self) -> dict[str, torch.Tensor]:
        """The definition's parameters (:func:`shared_numerics.gated_deltanet.gated_deltanet_core`)."""
        return {
            "conv1d_weight": self.conv1d.weight[:, 0, :],
            "A_log": self.A_log,
            "dt_bias": self.dt_bias,
            "norm_weight": self.norm.weight,
        }

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        from vllm.forward_context import get_forward_context

        meta = get_forward_context().attn_metadata
        m = meta.get(self.prefix) if isinstance(meta, dict) else None
        n = a.shape[0]
        if m is None or m.num_actual_tokens == 0:  # vLLM's profiling and dummy runs: no cache, nothing to keep
            return a.new_zeros((n, self.hidden))
        if m.spec_sequence_masks is not None:
            raise RuntimeError("zerokld Gated DeltaNet: speculative decoding is not supported")
        t = m.num_actual_tokens
        mixed, z, ga, gb = unpack_qkvz_ba(self.in_proj_qkvz(a[:t]), self.in_proj_ba(a[:t]), self.dims)
        seqs = m.num_decodes + m.num_prefills
        cu = m.non_spec_query_start_loc[: seqs + 1].to(torch.int64)
        slots = m.non_spec_state_indices_tensor[:seqs].to(torch.int64)
        conv_cache, rec_cache = self.kv_cache
        if is_conv_state_dim_first():  # vLLM's "DS" orientation: [slots, C, K - 1]
            conv = conv_cache.index_select(0, slots).transpose(1, 2).contiguous()
        else:
            conv = conv_cache.index_select(0, slots).contiguous()
        hk, dk, hv, dv = self.dims
        rec = rec_cache.index_select(0, slots).view(seqs, hv, dk, dv).contiguous()  # stock's [Hv, d_v, d_k] bytes
        if m.has_initial_state is not None:  # a sequence's first chunk starts from zeros (its slot may be recycled)
            fresh = ~m.has_initial_state[:seqs].to(torch.bool)
            conv[fresh] = 0
            rec[fresh] = 0
        out, conv, rec = gated_deltanet_varlen(mixed, z, ga, gb, self.params(), self.dims, self.eps, cu, conv, rec,
                                               inplace=True)  # fmt: skip
        conv_cache.index_copy_(0, slots, conv.transpose(1, 2) if is_conv_state_dim_first() else conv)
        rec_cache.index_copy_(0, slots, rec.view(seqs, *rec_cache.shape[1:]))
        y = self.out_proj(out)
        if t < n:  # vLLM's padding rows: zeros
            y = torch.cat([y, y.new_zeros((n - t, y.shape[1]))])
        return y


class GatedDeltaNetLayer(ResidualLayer):
    """One Gated DeltaNet decoder layer (the :class:`zerokld_models.mixers.GatedDeltaNet` component's vLLM face):
    ``linear_attn`` (:class:`GatedDeltaNetMixer`) on the residual stream of :class:`ResidualLayer` (zero-centred norm
    gains as the config says); no RoPE (``rotary_dim`` ``None``). The start checks refuse TP, LoRA and FP8 with these
    layers (:func:`vllm_plugin.support.check_supported`)."""

    rotary_dim = None

    def __init__(
        self,
        cfg: ModelConfig,
        mixer: TokenMixer,
        vllm_config,
        prefix: str,
        fp8: Fp8Mode,
        mlp: nn.Module,
        lora: bool = False,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__(cfg.hidden_size, cfg.rms_norm_eps, mlp, zero_centred=cfg.zero_centred_norm)
        self.linear_attn = GatedDeltaNetMixer(cfg, vllm_config, f"{prefix}.linear_attn", fp8)

    def attention(self, a: torch.Tensor, cos, sin) -> torch.Tensor:
        return self.linear_attn(a)
