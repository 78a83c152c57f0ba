"""The vLLM layers every architecture's plan is built from, on ``shared_numerics`` ops: the projections (dense, FP8,
LoRA targets, tensor-parallel shards), the dense SwiGLU MLP, the residual stream of a decoder layer and the
grouped-query attention layer (:class:`GQALayer`, the :class:`zerokld_models.mixers.GQA` component's vLLM face).
:class:`vllm_plugin.models.model.ZeroKLDForCausalLM` assembles them per layer as the plan says.

A grouped-query attention layer is the op sequence the TorchTitan side runs through ``titan_plugin`` overrides:
``a = rms_norm(h)``; ``q, k, v = linear(a, Wq|Wk|Wv)``; (QK norm: per-head ``rms_norm`` of q and k); rotate-half
RoPE; paged causal attention; ``h = h + linear(o, Wo)``; ``f = rms_norm(h)``; ``h = h + mlp(f)`` (dense:
``linear(silu_and_mul(linear(f, Wg), linear(f, Wu)), Wd)``). Each residual add runs fused with the norm after it
(:func:`shared_numerics.add_rms_norm`) and the QK norm with the rotation (:func:`shared_numerics.rms_norm_rope`): by
definition the same bits as the unfused sequence TorchTitan runs, one pass fewer over the activations each.

FP8 (``additional_config={"zerokld": {"batch_invariant": true, "fp8": "per_channel" | "block"}}``, or a
``zerokld_fp8`` checkpoint): the projections run :func:`shared_numerics.fp8_linear` (embeddings, norms and lm_head
stay in the model dtype, as in vLLM's FP8 and the trainer's QAT).

Parameters keep HF names (``model.layers.N.self_attn.q_proj.weight`` ...) and load through their ``weight_loader``,
so ``reload_weights`` works in place. Sources: HF ``modeling_qwen3.py`` / ``modeling_llama.py``; vLLM
``model_executor/models/qwen3.py`` / ``llama.py``.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.model_loader.weight_utils import default_weight_loader

import shared_numerics as sn
import shared_numerics.fp8 as sn_fp8
import shared_numerics.tensor_parallel as sn_tp
from shared_numerics.activation import sigmoid_gate
from zerokld_models import ModelConfig
from zerokld_models.mixers import GQA, TokenMixer

from ..attention_backend import ZeroKLDAttentionBackend
from ..config import from_vllm_config

__all__ = ["Fp8Mode", "GQALayer", "ResidualLayer", "TensorParallel", "norm_gain"]


def _param(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    p.weight_loader = default_weight_loader  # type: ignore[attr-defined]
    return p


class TensorParallel:
    """This worker's place in vLLM's tensor-parallel group and the fixed K-block of the row-parallel sum.

    Column-parallel projections (q/k/v, gate/up, the vocab-parallel lm_head) hold ``out / size`` rows; row-parallel
    ones (o_proj, down_proj) ``in / size`` columns and sum over ``K`` with
    :func:`shared_numerics.tensor_parallel.row_parallel_linear` (all-gather of the float32 subtree roots through
    vLLM's ``tensor_model_parallel_all_gather``) when ``k_block`` is set; the embedding and norms are replicated.
    """

    def __init__(self, vllm_config) -> None:
        self.size = vllm_config.parallel_config.tensor_parallel_size
        self.k_block = from_vllm_config(vllm_config).tp_k_block
        if self.size > 1:
            from vllm.distributed import get_tensor_model_parallel_rank

            self.rank = get_tensor_model_parallel_rank()
        else:
            self.rank = 0

    def gather(self) -> callable | None:
        """The all-gather over the TP group that :func:`row_parallel_linear` takes (``None`` at TP 1)."""
        if self.size == 1:
            return None
        from vllm.distributed import tensor_model_parallel_all_gather

        return lambda root: tensor_model_parallel_all_gather(root, dim=0)

    def vocab_rows(self, vocab_size: int) -> tuple[int, int, int]:
        """``(start, rows, per_rank)``: this rank's vocabulary rows ``[start, start + rows)`` of the vocab-parallel
        lm_head; each rank's share is ``per_rank = ceil(V / size)`` rows, the last rank's may be shorter."""
        per = -(-vocab_size // self.size)
        start = min(self.rank * per, vocab_size)
        return start, min(vocab_size, start + per) - start, per

    def split(self, length: int) -> tuple[int, int]:
        """This rank's ``(start, length)`` in an even split of ``length`` over the TP ranks."""
        return self.rank * (length // self.size), length // self.size

    def param(
        self,
        full_shape: tuple[int, ...],
        dim: int | None,
        dtype: torch.dtype | None = None,
        rows: tuple[int, int] | None = None,
    ) -> nn.Parameter:
        """A parameter holding this rank's slice of a checkpoint tensor of ``full_shape`` along ``dim`` (``None``:
        replicated; ``rows``: the ``(start, length)`` slice, else an even split); its ``weight_loader`` takes the
        full checkpoint tensor and keeps the slice."""
        if dim is None or self.size == 1:
            return _param(*full_shape, dtype=dtype)
        start, local = rows if rows is not None else self.split(full_shape[dim])
        shape = list(full_shape)
        shape[dim] = local
        p = _param(*shape, dtype=dtype)
        p.weight_loader = lambda param, t: default_weight_loader(param, t.narrow(dim, start, local))  # type: ignore
        p.checkpoint_shape = tuple(full_shape)  # type: ignore[attr-defined]
        return p


class Fp8Mode:
    """How the decoder projections run: ``off`` (``sn.linear``), ``online`` (high-precision weights, FP8 codes
    recomputed at every (re)load) or ``serialized`` (a ``zerokld_fp8`` checkpoint's codes and scales)."""

    def __init__(self, kind: str = "off", granularity: str = "per_channel") -> None:
        self.kind, self.granularity = kind, granularity


class _Proj(nn.Module):
    """One decoder projection ``[out, in]`` with HF parameter names (``weight``; FP8 checkpoints add
    ``weight_scale``). ``shard``: ``"column"`` / ``"row"`` under tensor parallelism (``tp``), else ``None``."""

    def __init__(
        self,
        out_features: int,
        in_features: int,
        fp8: Fp8Mode,
        bias: bool = False,
        shard: str | None = None,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.fp8 = fp8
        self.row_parallel = shard == "row" and tp is not None and tp.k_block is not None
        self.k_block = tp.k_block if tp is not None else None
        self.gather = tp.gather() if self.row_parallel else None
        if tp is not None and tp.size > 1 and shard is not None:  # FP8 and LoRA refuse TP (vllm_plugin.support)
            self.bias = tp.param((out_features,), 0 if shard == "column" else None) if bias else None
            self.weight = tp.param((out_features, in_features), 0 if shard == "column" else 1)
            self._codes: torch.Tensor | None = None
            self._scales: torch.Tensor | None = None
            self._served: torch.Tensor | None = None
            return
        self.bias = _param(out_features) if bias else None
        if fp8.kind == "serialized":
            self.weight = _param(out_features, in_features, dtype=sn_fp8.FP8_DTYPE)
            self.weight_scale = _param(
                *sn_fp8.weight_scale_shape(out_features, in_features, fp8.granularity), dtype=torch.float32
            )
        else:
            self.weight = _param(out_features, in_features)
        self._codes: torch.Tensor | None = None
        self._scales: torch.Tensor | None = None
        self._served: torch.Tensor | None = None  # online FP8: dense_weight's result for the current codes

    def quantize(self) -> None:
        """Online FP8: (re)compute codes and scales from the current high-precision weight."""
        self._codes, self._scales = sn.quantize_fp8_weight(self.weight.data, self.fp8.granularity)
        self._served = None

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The ``[out, in]`` weight as a tensor in the model dtype ``dtype``, for a projection whose weight is used
        directly (MLA's absorbed ``kv_b_proj``): the weight itself, or under FP8 its codes dequantized
        (:func:`shared_numerics.fp8.served_fp8_weight`, what the trainer's QAT uses:
        :func:`shared_numerics.fp8.fp8_weight_qat`)."""
        kind = self.fp8.kind
        if kind == "off":
            return self.weight
        if kind == "serialized":  # per call: a delta hot-load rewrites the codes in place, with no hook here
            return sn_fp8.served_fp8_weight(self.weight, self.weight_scale, self.fp8.granularity, dtype)
        if self._codes is None:
            raise RuntimeError("zerokld fp8: weights were not quantized after loading")
        if self._served is None or self._served.dtype != dtype:  # once per (re)quantization, not per step
            self._served = sn_fp8.served_fp8_weight(self._codes, self._scales, self.fp8.granularity, dtype)
        return self._served

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kind = self.fp8.kind
        if self.row_parallel:
            return sn_tp.row_parallel_linear(x, self.weight, self.bias, k_block=self.k_block, gather=self.gather)
        if kind == "off":
            return sn.linear(x, self.weight, self.bias)
        if kind == "serialized":
            return sn.fp8_linear(x, self.weight, self.weight_scale, self.fp8.granularity)
        if self._codes is None:
            raise RuntimeError("zerokld fp8: weights were not quantized after loading")
        return sn.fp8_linear(x, self._codes, self._scales, self.fp8.granularity)


def _proj(
    out_features: int,
    in_features: int,
    fp8: Fp8Mode,
    bias: bool = False,
    lora: bool = False,
    shard: str | None = None,
    tp: TensorParallel | None = None,
) -> nn.Module:
    """A decoder projection: :class:`vllm_plugin.lora.LoRAProj` when the engine serves LoRA adapters (vLLM's
    LoRA manager wraps it), else :class:`_Proj` (``shard``: its tensor-parallel split, see :class:`_Proj`)."""
    if lora:
        from ..lora import LoRAProj

        return LoRAProj(out_features, in_features, bias, _param)
    return _Proj(out_features, in_features, fp8, bias=bias, shard=shard, tp=tp)


class _DenseMLP(nn.Module):
    """``down(silu_and_mul(gate f, up f))`` with HF names ``gate_proj`` / ``up_proj`` / ``down_proj``."""

    def __init__(self, h: int, inter: int, fp8: Fp8Mode, lora: bool = False, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.gate_proj = _proj(inter, h, fp8, lora=lora, shard="column", tp=tp)
        self.up_proj = _proj(inter, h, fp8, lora=lora, shard="column", tp=tp)
        self.down_proj = _proj(h, inter, fp8, lora=lora, shard="row", tp=tp)

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        return self.down_proj(sn.silu_and_mul(self.gate_proj(f), self.up_proj(f)))


def _norm(n: int) -> nn.Module:
    """An RMSNorm's parameter holder (HF name ``<norm>.weight``)."""
    m = nn.Module()
    m.weight = _param(n)
    return m


def norm_gain(norm: nn.Module, zero_centred: bool) -> torch.Tensor:
    """The gain an RMSNorm multiplies by: its weight, or for zero-centred gains (HF ``Qwen3NextRMSNorm``,
    ``x̂ (1 + w)`` in float32) ``1 + w`` in float32, computed per call (a hot-load rewrites ``w`` in place)."""
    return 1.0 + norm.weight.float() if zero_centred else norm.weight


class ResidualLayer(nn.Module):
    """One decoder layer's residual stream, the same for every token mixer: ``a = rms_norm(h)`` (fused with the
    previous layer's pending MLP output), ``h, f = add_rms_norm(h, attention(a))``, and ``mlp(f)`` returned as this
    layer's pending delta. Subclasses give ``self_attn`` and :meth:`attention` (``[n, hidden]`` in and out);
    ``zero_centred``: the two norms' gains are ``1 + w`` (:func:`norm_gain`)."""

    def __init__(self, hidden: int, eps: float, mlp: nn.Module, zero_centred: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.zero_centred = zero_centred
        self.input_layernorm = _norm(hidden)
        self.post_attention_layernorm = _norm(hidden)
        self.mlp = mlp

    def attention(self, a: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(
        self, h: torch.Tensor, delta: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``h``: the residual stream; ``delta``: the previous layer's MLP output still to be added (``None`` for
        the first layer). Returns ``(h, mlp_out)``: this layer's residual stream and its own pending delta."""
        zc = self.zero_centred
        if delta is None:
            a = sn.rms_norm(h, norm_gain(self.input_layernorm, zc), self.eps)
        else:
            h, a = sn.add_rms_norm(h, delta, norm_gain(self.input_layernorm, zc), self.eps)
        h, f = sn.add_rms_norm(h, self.attention(a, cos, sin), norm_gain(self.post_attention_layernorm, zc), self.eps)
        return h, self.mlp(f)


class GQALayer(ResidualLayer):
    """One grouped-query attention layer (the :class:`zerokld_models.mixers.GQA` component's vLLM face) over vLLM's
    paged K/V cache (:class:`vllm_plugin.attention_backend.ZeroKLDAttentionBackend`): q/k/v projections (biases and
    per-head QK RMSNorm as the plan's ``mixer`` says), rotate-half RoPE over ``rotary_dim`` dimensions of each head,
    causal attention, ``o_proj``; ``mlp`` the layer's MLP module. Gated attention (the mixer's ``output_gate``,
    Qwen3-Next): ``q_proj`` is ``[q | gate]`` per head (``2 x head_dim`` rows each) and the attention output is
    multiplied by ``sigmoid(gate)`` (:func:`shared_numerics.activation.sigmoid_gate`) before ``o_proj``. Under tensor
    parallelism (``tp``) q/k/v are column-parallel by head and ``o_proj`` row-parallel; LoRA (``lora``): every
    projection is a target."""

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
        h, nq, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        super().__init__(h, cfg.rms_norm_eps, mlp, zero_centred=cfg.zero_centred_norm)
        self.rotary_dim = GQA.rotary_dim(cfg)
        qk_norm = mixer.qk_norm
        size = tp.size if tp is not None else 1
        self.nq, self.nkv, self.hd = nq // size, nkv // size, hd  # this rank's heads
        self.output_gate = mixer.output_gate
        sa = self.self_attn = nn.Module()
        q_rows = nq * hd * (2 if mixer.output_gate else 1)
        for name, out in (("q_proj", q_rows), ("k_proj", nkv * hd), ("v_proj", nkv * hd)):
            setattr(sa, name, _proj(out, h, fp8, bias=mixer.qkv_bias, lora=lora, shard="column", tp=tp))
        sa.o_proj = _proj(h, nq * hd, fp8, lora=lora, shard="row", tp=tp)
        self.qk_norm = qk_norm
        if qk_norm:
            sa.q_norm = _norm(hd)
            sa.k_norm = _norm(hd)
        sa.attn = Attention(
            self.nq,
            hd,
            hd**-0.5,
            num_kv_heads=self.nkv,
            cache_config=vllm_config.cache_config,
            prefix=f"{prefix}.self_attn.attn",
            attn_backend=ZeroKLDAttentionBackend,
        )

    def attention(self, a: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        sa, n, hd = self.self_attn, a.shape[0], self.hd
        gate = None
        if self.output_gate:
            qg = sa.q_proj(a).view(n, self.nq, 2 * hd)
            q, gate = qg[..., :hd].contiguous(), qg[..., hd:].reshape(n, self.nq * hd)
        else:
            q = sa.q_proj(a).view(n, self.nq, hd)
        k = sa.k_proj(a).view(n, self.nkv, hd)
        v = sa.v_proj(a).view(n, self.nkv, hd)
        if self.qk_norm:
            zc = self.zero_centred
            q = sn.rms_norm_rope(q, norm_gain(sa.q_norm, zc), self.eps, cos, sin)
            k = sn.rms_norm_rope(k, norm_gain(sa.k_norm, zc), self.eps, cos, sin)
        else:
            q = sn.apply_rope(q, cos, sin)
            k = sn.apply_rope(k, cos, sin)
        o = sa.attn(q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1))
        if gate is not None:
            o = sigmoid_gate(o, gate)
        return sa.o_proj(o)
