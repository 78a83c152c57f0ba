"""The generic dense decoder for vLLM built only from ``shared_numerics`` ops; the architecture declarations
(``zerokld_models/<arch>/__init__.py``) specialise it by their traits (QK-norm, q/k/v bias).

Each registered class subclasses vLLM's own class for the architecture: with the zerokld flag off it *is* the stock
model (``super().__init__``, stock forward); with ``additional_config={"zerokld": {"batch_invariant": true}}`` it
builds :class:`DenseDecoder` instead, whose forward is the op sequence the TorchTitan side runs through
``titan_plugin`` overrides:

``h = E[ids]``; per layer: ``a = rms_norm(h)``; ``q, k, v = linear(a, Wq|Wk|Wv)``; (Qwen3: per-head ``rms_norm`` of q
and k); rotate-half RoPE; paged causal attention; ``h = h + linear(o, Wo)``; ``f = rms_norm(h)``;
``h = h + linear(silu_and_mul(linear(f, Wg), linear(f, Wu)), Wd)``; then ``rms_norm`` and ``linear(h, W_lm)``.
Each residual add runs fused with the norm after it (:func:`shared_numerics.add_rms_norm`) and Qwen3's QK-norm with
the rotation (:func:`shared_numerics.rms_norm_rope`): by definition the same bits as the unfused sequence TorchTitan
runs, one pass fewer over the activations each.
The sampler's ``compute_logprobs`` becomes :func:`shared_numerics.log_softmax` (with ``tp_k_block``: the vocab-parallel
definition the trainer computes on its vocabulary shard, :func:`shared_numerics.vocab_parallel.log_softmax`).

FP8 (``additional_config={"zerokld": {"batch_invariant": true, "fp8": "per_channel" | "block"}}``, or a
``zerokld_fp8`` checkpoint): the seven decoder projections run :func:`shared_numerics.fp8_linear` (embeddings, norms
and lm_head stay in the model dtype, as in vLLM's FP8 and the trainer's QAT); MoE and MLA models extend this to their
experts and latent projections (:mod:`vllm_plugin.models.moe`, :mod:`vllm_plugin.models.mla`).

Weights keep HF names (``model.layers.N.self_attn.q_proj.weight`` ...), so vLLM's loader feeds a HF checkpoint straight
in; ``load_weights`` goes through each parameter's ``weight_loader`` so ``reload_weights`` works in place.
Sources: HF ``modeling_qwen3.py`` / ``modeling_llama.py``; vLLM ``model_executor/models/qwen3.py`` / ``llama.py``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.model_loader.weight_utils import default_weight_loader

import shared_numerics as sn
import shared_numerics.fp8 as sn_fp8
import shared_numerics.tensor_parallel as sn_tp
from shared_numerics.fp8_checkpoint import QUANT_METHOD
from zerokld_models import ModelConfig, layer_plan
from zerokld_models.mixers import GQA, TokenMixer

from ..attention_backend import ZeroKLDAttentionBackend
from ..config import ZeroKLDConfigError, from_vllm_config
from ..faults import copy_fault, step_delay
from ..sampler import set_logprobs_definition
from ..start import check_model_settings
from ..support import is_zerokld_fp8

__all__ = ["DenseDecoder", "ResidualLayer", "ZeroKLDMixin"]


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


class ResidualLayer(nn.Module):
    """One decoder layer's residual stream, the same for every token mixer: ``a = rms_norm(h)`` (fused with the
    previous layer's pending MLP output), ``h, f = add_rms_norm(h, attention(a))``, and ``mlp(f)`` returned as this
    layer's pending delta. Subclasses give ``self_attn`` and :meth:`attention` (``[n, hidden]`` in and out)."""

    def __init__(self, hidden: int, eps: float, mlp: nn.Module) -> None:
        super().__init__()
        self.eps = eps
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
        if delta is None:
            a = sn.rms_norm(h, self.input_layernorm.weight, self.eps)
        else:
            h, a = sn.add_rms_norm(h, delta, self.input_layernorm.weight, self.eps)
        h, f = sn.add_rms_norm(h, self.attention(a, cos, sin), self.post_attention_layernorm.weight, self.eps)
        return h, self.mlp(f)


class _Layer(ResidualLayer):
    def __init__(
        self,
        cfg: ModelConfig,
        mixer: TokenMixer,
        vllm_config,
        prefix: str,
        fp8: Fp8Mode,
        mlp: nn.Module | None = None,
        lora: bool = False,
        tp: TensorParallel | None = None,
    ) -> None:
        h, nq, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        # dense SwiGLU MLP, unless an MoE decoder passes its sparse block (vllm_plugin.models.moe)
        super().__init__(
            h, cfg.rms_norm_eps, mlp if mlp is not None else _DenseMLP(h, cfg.intermediate_size, fp8, lora=lora, tp=tp)
        )
        qk_norm = mixer.qk_norm
        size = tp.size if tp is not None else 1
        self.nq, self.nkv, self.hd = nq // size, nkv // size, hd  # this rank's heads
        sa = self.self_attn = nn.Module()
        for name, out in (("q_proj", nq * hd), ("k_proj", nkv * hd), ("v_proj", nkv * hd)):
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
        sa, n = self.self_attn, a.shape[0]
        q = sa.q_proj(a).view(n, self.nq, self.hd)
        k = sa.k_proj(a).view(n, self.nkv, self.hd)
        v = sa.v_proj(a).view(n, self.nkv, self.hd)
        if self.qk_norm:
            q = sn.rms_norm_rope(q, sa.q_norm.weight, self.eps, cos, sin)
            k = sn.rms_norm_rope(k, sa.k_norm.weight, self.eps, cos, sin)
        else:
            q = sn.apply_rope(q, cos, sin)
            k = sn.apply_rope(k, cos, sin)
        return sa.o_proj(sa.attn(q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)))


class DenseDecoder(nn.Module):
    """The batch-invariant decoder body; parameters under ``model.`` and ``lm_head`` with HF names.

    ``layer_factory``: ``(layer index, this decoder's TensorParallel) -> ResidualLayer`` for layers that are not the
    grouped-query attention layer (MLA, :mod:`vllm_plugin.models.mla`), with ``rotary_dim`` their RoPE width
    (default: grouped-query attention's, ``head_dim * partial_rotary_factor``; each layer's QK norm and q/k/v bias as
    its plan says, :func:`zerokld_models.layer_plan`)."""

    def __init__(
        self,
        vllm_config,
        cfg: ModelConfig,
        adapter,
        prefix: str = "",
        fp8: Fp8Mode | None = None,
        mlp_factory=None,
        layer_factory=None,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        fp8 = fp8 or Fp8Mode()
        lora = vllm_config.lora_config is not None
        self.tp = tp = TensorParallel(vllm_config)
        self.cfg = cfg
        self.rotary_dim = rotary_dim or GQA.rotary_dim(cfg)
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = _param(cfg.vocab_size, cfg.hidden_size)
        if layer_factory is None:
            plan = layer_plan(cfg, adapter)

            def layer_factory(i: int, tp: TensorParallel) -> ResidualLayer:
                return _Layer(
                    cfg,
                    plan[i].mixer,
                    vllm_config,
                    f"{prefix}layers.{i}",
                    fp8,
                    mlp_factory(i) if mlp_factory else None,
                    lora=lora,
                    tp=tp,
                )

        self.layers = nn.ModuleList([layer_factory(i, tp) for i in range(cfg.num_hidden_layers)])
        self.norm = _norm(cfg.hidden_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens.weight[input_ids]
        cfg = self.cfg
        cos, sin = sn.rope_cos_sin(positions, self.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
        delta = None
        for layer in self.layers:
            h, delta = layer(h, delta, cos, sin)
        if delta is None:
            return sn.rms_norm(h, self.norm.weight, cfg.rms_norm_eps)
        return sn.add_rms_norm(h, delta, self.norm.weight, cfg.rms_norm_eps)[1]


def _fp8_mode(vllm_config, cfg) -> Fp8Mode:
    if is_zerokld_fp8(vllm_config):
        stored = vllm_config.quant_config.granularity
        if cfg.fp8 not in (None, stored):
            raise ZeroKLDConfigError(f"fp8 {cfg.fp8!r} conflicts with the checkpoint's granularity {stored!r}")
        return Fp8Mode("serialized", stored)
    if cfg.fp8:
        return Fp8Mode("online", cfg.fp8)
    return Fp8Mode()


class ZeroKLDMixin:
    """Base of every declared architecture's vLLM class (:mod:`vllm_plugin.models.classes`: ``(ZeroKLDMixin,
    vLLM's class)`` with ``adapter`` = the declaration):
    vLLM's model unless the zerokld switch is on, then :class:`DenseDecoder` specialised by ``adapter``'s traits."""

    adapter = None  # the architecture's zerokld_plugins.ModelAdapterSpec

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        cfg = from_vllm_config(vllm_config)
        self.batch_invariant = cfg.batch_invariant
        model_cfg = check_model_settings(vllm_config, self.adapter)  # the checks vllm_plugin.start ran first
        if not cfg.batch_invariant:
            super().__init__(vllm_config=vllm_config, prefix=prefix)  # stock vLLM model, untouched
            return
        self.model_cfg = model_cfg
        nn.Module.__init__(self)
        self.config = vllm_config.model_config.hf_config
        self.vllm_config = vllm_config
        self.fp8 = _fp8_mode(vllm_config, cfg)
        self.model = self._decoder(vllm_config, f"{prefix}model." if prefix else "model.")
        if self.model_cfg.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:  # vocab-parallel under TP: this rank's vocab/TP rows (a tied lm_head slices the replicated embedding)
            self.lm_head = nn.Module()
            v, tp = self.model_cfg.vocab_size, self.model.tp
            self.lm_head.weight = tp.param((v, self.model_cfg.hidden_size), 0, rows=tp.vocab_rows(v)[:2])
        set_logprobs_definition(cfg.tp_k_block is not None)  # vLLM's sampler log-softmax: ours (vllm_plugin.sampler)

    def _decoder(self, vllm_config, prefix: str) -> nn.Module:
        """The decoder body under ``model.`` (MLA models build their own, :mod:`vllm_plugin.models.mla`)."""
        return DenseDecoder(
            vllm_config,
            self.model_cfg,
            self.adapter,
            prefix=prefix,
            fp8=self.fp8,
            mlp_factory=self._mlp_factory(vllm_config),
        )

    def _mlp_factory(self, vllm_config):
        """``layer index -> MLP module``, or ``None`` for the dense SwiGLU MLP (MoE models override this)."""
        return None

    def _load_tensor(self, params: dict, name: str, tensor: torch.Tensor) -> None:
        """Copy one checkpoint tensor into its parameter (MoE models also map per-expert tensors)."""
        if name not in params:
            raise KeyError(f"zerokld: checkpoint tensor {name!r} has no parameter in the model")
        p = params[name]
        if p.dtype in (sn_fp8.FP8_DTYPE, torch.float32) and self.fp8.kind == "serialized" and tensor.dtype != p.dtype:
            raise ValueError(
                f"zerokld: {name} is {tensor.dtype}; this FP8 engine needs {p.dtype} ({QUANT_METHOD} snapshots only)"
            )
        expected = tuple(getattr(p, "checkpoint_shape", p.shape))  # a TP shard's loader slices the full tensor
        if expected != tuple(tensor.shape):
            raise ValueError(f"zerokld: {name} has shape {tuple(tensor.shape)}, model expects {expected}")
        p.weight_loader(p, tensor)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.batch_invariant:
            return super().embed_input_ids(input_ids)
        return self.model.embed_tokens.weight[input_ids]

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        step_delay()  # inert unless a test armed it (vllm_plugin.faults)
        if not self.batch_invariant:
            return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)
        if inputs_embeds is not None or intermediate_tensors is not None:
            raise NotImplementedError("zerokld: inputs_embeds / pipeline intermediate tensors are not supported")
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor):
        if not self.batch_invariant:
            return super().compute_logits(hidden_states)
        tp = self.model.tp
        if tp.size == 1:
            return sn.linear(hidden_states, self.lm_head.weight)
        from vllm.distributed import tensor_model_parallel_all_gather

        vocab = self.model_cfg.vocab_size
        start, rows, per = tp.vocab_rows(vocab)
        w = self.lm_head.weight
        if self.model_cfg.tie_word_embeddings:  # the replicated embedding: this rank's rows of it
            w = w.narrow(0, start, rows)
        logits = sn.linear(hidden_states, w)
        if rows < per:  # the last rank's short share: pad to the common width for the gather, cut after it
            logits = torch.nn.functional.pad(logits, (0, per - rows))
        # each logit is a full-K dot product: the gathered vocab shards are the unsharded logits, bit for bit
        return tensor_model_parallel_all_gather(logits, dim=-1)[..., :vocab]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        if not self.batch_invariant:
            return super().load_weights(weights)
        params = self._checkpoint_params()
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.model_cfg.tie_word_embeddings:
                continue
            self._load_tensor(params, name, tensor)
            loaded.add(name)
            copy_fault(len(loaded))  # inert unless a test armed it (vllm_plugin.faults)
        self.checkpoint_updated(loaded)  # codes follow the weights, also on reload_weights (hot-load)
        if self.model_cfg.tie_word_embeddings:
            loaded.add("lm_head.weight")
        return loaded

    def _checkpoint_params(self) -> dict[str, torch.Tensor]:
        params = dict(self.named_parameters(remove_duplicate=False))
        # vLLM's LoRA manager wraps each projection (vllm_plugin.lora): its weight lives at ``...base_layer.weight``
        params.update({k.replace(".base_layer.", "."): v for k, v in list(params.items()) if ".base_layer." in k})
        return params

    def checkpoint_views(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The live tensors holding checkpoint tensors ``names`` bit for bit (what a hot-load delta is decoded
        against and written into, :func:`deltasync.apply_delta_in_place`): each parameter (a projection wrapped by
        vLLM's LoRA manager: its base layer's), an expert of a stacked MoE parameter (:class:`ZeroKLDMoEMixin`), and
        for a tied ``lm_head.weight`` a copy of the embedding (the model ignores it, as when loading; a checkpoint
        whose lm_head differs from the embedding is refused by its checksums). Shapes and dtypes are the
        checkpoint's (FP8 checkpoints: codes and scales as serialized).

        Raises:
            KeyError: a name the model holds no bits of.
            RuntimeError: stock numerics (``batch_invariant`` off: vLLM's model repacks checkpoint tensors)."""
        if not self.batch_invariant:
            raise RuntimeError("stock vLLM model: its parameters are not checkpoint tensors")
        if self.model.tp.size > 1:
            raise RuntimeError("tensor-parallel workers hold slices of checkpoint tensors (deltas: reload_weights)")
        names = list(names)
        params = self._checkpoint_params()
        if self.model_cfg.tie_word_embeddings and "lm_head.weight" in names:  # a copy: written, then dropped
            params["lm_head.weight"] = self.model.embed_tokens.weight.detach().clone()
        return {name: self._checkpoint_view(params, name).data for name in names}

    def _checkpoint_view(self, params: dict, name: str) -> torch.Tensor:
        if name not in params:
            raise KeyError(f"zerokld: checkpoint tensor {name!r} has no parameter in the model")
        return params[name]

    def checkpoint_updated(self, names: Iterable[str]) -> None:
        """After checkpoint tensors ``names`` were written into the parameters (a load, or a delta applied in place):
        online FP8 re-quantizes the projections they belong to, and only those."""
        if self.fp8.kind != "online":
            return
        modules = dict(self.named_modules())
        for name in names:
            owner = modules.get(name.rsplit(".", 1)[0])
            if isinstance(owner, _Proj):
                owner.quantize()
