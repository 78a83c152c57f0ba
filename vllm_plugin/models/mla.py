"""Multi-head latent attention for vLLM on ``shared_numerics`` (:mod:`shared_numerics.mla`, :mod:`shared_numerics.dsa`):
:class:`MLALayer` is the :class:`zerokld_models.mixers.MLA` component's vLLM face (DeepSeek-V3/V2, GLM-4.7-Flash,
GLM-5, DeepSeek-V3.2), the residual stream of :class:`vllm_plugin.models.dense.ResidualLayer` over a latent cache, with
the MLP the layer's plan names (dense SwiGLU or DeepSeekMoE, :func:`vllm_plugin.models.moe.mlp_module`). Per layer::

    a = rms_norm(h)
    q = q_b_proj(rms_norm(q_a_proj(a)))  (or q_proj(a) without q_lora_rank);  q_nope, q_pe = split(q per head)
    c_kv, k_pe = split(kv_a_proj_with_mqa(a));  c_kv = rms_norm(c_kv)
    q_pe, k_pe = rope(deinterleave(q_pe)), rope(deinterleave(k_pe))       (YaRN tables, rotate-half)
    latent = [c_kv ‖ k_pe]  -> the cache (kv_lora_rank + qk_rope_head_dim values per token)
    o = o_proj(latent_output(MQA([absorb_query(q_nope) ‖ q_pe], latent)))
    h = h + o;  f = rms_norm(h);  h = h + (DeepSeekMoE if the layer plan's MLP is routed else dense SwiGLU MLP)(f)

FP8 (online or a ``zerokld_fp8`` checkpoint, DeepSeek's 1x128 x 128x128 ``block`` granularity or per channel): every
projection above, the dense MLPs and each routed and shared expert run :func:`shared_numerics.fp8_linear`;
``kv_b_proj``, absorbed per head, is its codes dequantized to the model dtype
(:func:`shared_numerics.fp8.served_fp8_weight`, as vLLM's MLA does with DeepSeek's FP8 checkpoints); the router and
its selection bias stay high precision.

The cache is vLLM's ``MLAAttentionSpec`` page (:class:`vllm_plugin.attention_backend.LatentAttention`): the same bytes
per token as vLLM's own MLA backends. With DeepSeek Sparse Attention (GLM-5, DeepSeek-V3.2: ``index_topk`` in the
config) each row is ``[latent ‖ indexer key]`` and the layer runs :mod:`shared_numerics.dsa` over it (its full layers
hold the indexer, ``self_attn.indexer.*``, high precision; its shared layers reuse their full layer's selection).
Weights keep HF names (``self_attn.kv_a_proj_with_mqa.weight``,
``mlp.gate.e_score_correction_bias``, ``mlp.experts.{e}.*``, ``mlp.shared_experts.*``).
Sources: HF ``modeling_deepseek_v3.py``; vLLM ``models/deepseek_v2.py``.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

import shared_numerics as sn
import shared_numerics.dsa as sn_dsa
import shared_numerics.mla as sn_mla
from zerokld_models import indexer_dims, mla_dims, mla_softmax_scale, topk_sources
from zerokld_models.mixers import MLA, TokenMixer

from ..attention_backend import LatentAttention, write_slots
from .dense import Fp8Mode, ResidualLayer, TensorParallel, _norm, _param, _proj

__all__ = ["MLALayer"]


class MLALayer(ResidualLayer):
    """One MLA decoder layer. With LoRA on (``lora``), every projection that is applied to activations —
    ``q_a_proj`` / ``q_b_proj`` (or ``q_proj``), ``kv_a_proj_with_mqa``, ``o_proj`` — is a LoRA target;
    ``kv_b_proj`` is not: its weight is absorbed per head (:mod:`shared_numerics.mla`), so an adapter naming it is
    refused by vLLM's LoRA manager (not a module it can adapt).

    Under tensor parallelism (``tp``, as vLLM's ``DeepseekV2MLAAttention`` splits it) each rank holds ``H / TP``
    heads: ``q_b_proj`` (or ``q_proj``) and ``kv_b_proj`` are column-parallel by head, ``o_proj`` row-parallel (the
    fixed TP-aligned sum over ``H Dv``), ``q_a_proj``, ``kv_a_proj_with_mqa`` and the two norms replicated, and every
    rank caches the whole latent of each token (vLLM's MLA cache is not split by TP either). Every per-head operation
    (absorption, attention, ``W_UV``) is the single rank's on that head, so only ``o_proj``'s sum crosses ranks."""

    def __init__(
        self,
        cfg,
        mixer: TokenMixer,
        vllm_config,
        prefix: str,
        fp8: Fp8Mode,
        mlp: nn.Module,
        lora: bool = False,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__(cfg.hidden_size, cfg.rms_norm_eps, mlp)
        h, nh = cfg.hidden_size, cfg.num_attention_heads
        self.cfg = cfg
        self.rotary_dim = MLA.rotary_dim(cfg)
        dn, dr, dv, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        sa = self.self_attn = nn.Module()
        if cfg.q_lora_rank:
            sa.q_a_proj = _proj(cfg.q_lora_rank, h, fp8, lora=lora)
            sa.q_a_layernorm = _norm(cfg.q_lora_rank)
            sa.q_b_proj = _proj(nh * (dn + dr), cfg.q_lora_rank, fp8, lora=lora, shard="column", tp=tp)
        else:
            sa.q_proj = _proj(nh * (dn + dr), h, fp8, lora=lora, shard="column", tp=tp)
        sa.kv_a_proj_with_mqa = _proj(r + dr, h, fp8, lora=lora)
        sa.kv_a_layernorm = _norm(r)
        sa.kv_b_proj = _proj(nh * (dn + dv), r, fp8, shard="column", tp=tp)
        sa.o_proj = _proj(h, nh * dv, fp8, lora=lora, shard="row", tp=tp)
        local = nh // (tp.size if tp is not None else 1)  # this rank's heads
        self.index = indexer_dims(cfg)  # DeepSeek Sparse Attention (GLM-5): each cache row = [latent ‖ indexer key]
        width = r + dr + (self.index.head_dim if self.index is not None else 0)
        self.scale = mla_softmax_scale(cfg)
        sa.attn = LatentAttention(local, width, self.scale, vllm_config.cache_config, f"{prefix}.self_attn.attn")
        self.dims = dataclasses.replace(mla_dims(cfg), num_heads=local)
        if self.index is not None:
            self.layer_id = int(prefix.rpartition(".")[2])
            self.topk_source = topk_sources(cfg)[self.layer_id]
            self.full = self.topk_source == self.layer_id
            self.selections: dict = {}  # the decoder's: {full layer: (rows, idx, slots)} of the current forward
            if self.full:
                d = self.index
                ix = sa.indexer = nn.Module()  # high precision, not LoRA targets (HF names: self_attn.indexer.*)
                ix.wq_b, ix.k_norm = nn.Module(), nn.Module()
                ix.wq_b.weight = _param(d.n_heads * d.head_dim, cfg.q_lora_rank)
                ix.wk, ix.weights_proj = nn.Module(), nn.Module()
                ix.wk.weight = _param(d.head_dim, h)
                ix.k_norm.weight, ix.k_norm.bias = _param(d.head_dim), _param(d.head_dim)
                ix.weights_proj.weight = _param(d.n_heads, h)

    def attention(self, a: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c, sa, n = self.cfg, self.self_attn, a.shape[0]
        q_resid = None
        if c.q_lora_rank:
            q_resid = sn.rms_norm(sa.q_a_proj(a), sa.q_a_layernorm.weight, self.eps)
            q = sa.q_b_proj(q_resid)
        else:
            q = sa.q_proj(a)
        kv_b = sa.kv_b_proj.dense_weight(a.dtype)  # under FP8: its codes dequantized, as vLLM's MLA does
        qc, latent = sn_mla.mla_query_latent(
            q, sa.kv_a_proj_with_mqa(a), sa.kv_a_layernorm.weight, kv_b, cos, sin, self.dims
        )
        if self.index is None:
            o = sa.attn(qc.reshape(n, -1), latent, latent).view(n, self.dims.num_heads, -1)
        else:
            o = self._sparse_attention(a, q_resid, qc.view(n, self.dims.num_heads, -1), latent, cos, sin)
        return sa.o_proj(sn_mla.mla_output(o, kv_b, self.dims))

    def _sparse_attention(self, a, q_resid, qc, latent, cos, sin) -> torch.Tensor:
        """DeepSeek Sparse Attention over the paged cache (:mod:`shared_numerics.dsa`): the tokens' rows
        ``[latent ‖ indexer key]`` written at their slots, the selections of the queries at positions ``>=
        index_topk`` (a full layer's own, a shared layer's from its full layer), then
        :func:`shared_numerics.dsa.dsa_paged_attention`. The layer's cache and metadata are read as vLLM's own
        attention op reads them (``get_attention_context``)."""
        from vllm.model_executor.layers.attention.attention import get_attention_context

        sa, d, w = self.self_attn, self.index, latent.shape[-1]
        md, _, kv_cache, _ = get_attention_context(sa.attn.layer_name)
        o = qc.new_zeros(qc.shape)
        if md is None:  # memory profiling / warm-up: no cache yet
            return o
        n = md.num_actual_tokens
        if self.full:
            ix = sa.indexer
            iq, ik, iw = sn_dsa.indexer_query_key(
                a[:n], q_resid[:n], ix.wq_b.weight, ix.wk.weight, ix.k_norm.weight, ix.k_norm.bias,
                ix.weights_proj.weight, cos[:n], sin[:n], d,
            )  # fmt: skip
            write_slots(kv_cache, torch.cat([latent[:n], ik], dim=-1).unsqueeze(1), md.slot_mapping)
            self.selections[self.layer_id] = sn_dsa.paged_selection(
                iq, iw, kv_cache[:, 0, :, w:], md.query_start_loc, md.seq_lens, md.block_table, d.topk
            )
        else:  # a shared layer: its own latents, the full layer's selection
            write_slots(kv_cache[..., :w], latent[:n].unsqueeze(1), md.slot_mapping)
        rows, _, slots = self.selections[self.topk_source]
        o[:n] = sn_dsa.dsa_paged_attention(
            qc[:n], kv_cache[..., :w], md.query_start_loc, md.seq_lens, md.block_table, rows, slots, self.scale
        )
        return o
