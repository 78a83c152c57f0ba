"""Build TorchTitan's own models for an HF checkpoint and load its safetensors.

:func:`decoder_config` is the generic builder, filled from an architecture's declaration
(:class:`zerokld_plugins.ModelAdapterSpec`, registered by its ``zerokld_models/<arch>/`` folder): TorchTitan's
builders (``make_gqa_config``, ``make_ffn_config``, the router/experts builders) from the
:class:`zerokld_models.ModelConfig` the one HF-config reader returns, with separate wq/wk/wv projections
(``fuse_qkv=False``: vLLM's zerokld model also projects q, k and v separately). HF weights go through the
architecture's ``StateDictAdapter.from_hf`` (e.g. ``torchtitan/models/{qwen3,llama3}/state_dict_adapter.py``),
exactly as TorchTitan's ``--checkpoint.initial_load_in_hf`` does, and come back out through ``to_hf``.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear
from torchtitan.models.common.config_utils import get_attention_config, make_ffn_config, make_gqa_config
from torchtitan.models.common.nn_modules import RMSNorm

from shared_numerics.settings import ZeroKLDSettings
from zerokld_models import (
    Layer,
    ModelConfig,
    UnsupportedModelError,
    adapter_for,
    check_supported,
    dense_prefix,
    latent_cache,
    layer_plan,
    read_model_config,
)
from zerokld_models.checkpoint import read_tensors
from zerokld_models.mixers import GQA
from zerokld_models.mlps import MLP

from .overrides import apply_zerokld_overrides, set_mla, set_tp_k_block
from .rope import PartialCosSinRoPE

__all__ = [
    "architecture_config",
    "build_titan_model",
    "complex_rope",
    "cos_sin_rope",
    "decoder_config",
    "hf_state_dict",
    "load_hf_weights",
    "mla_config",
    "state_dict_adapter_class",
    "titan_model_config",
    "trainer_unbuilt",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_INIT = {"weight": lambda w: torch.nn.init.normal_(w, std=0.02), "bias": torch.nn.init.zeros_}
_ONES = {"weight": torch.nn.init.ones_}


def cos_sin_rope(cfg: ModelConfig) -> CosSinRoPE.Config:
    """TorchTitan's HF-halves RoPE (Qwen); Llama 3.x scaling is not available on it (TorchTitan raises). With a
    ``partial_rotary_factor`` below 1 (GLM-4.5), :class:`titan_plugin.rope.PartialCosSinRoPE` over the rotated
    dimensions."""
    rotary = GQA.rotary_dim(cfg)
    kind = CosSinRoPE if rotary == cfg.head_dim else PartialCosSinRoPE
    return kind.Config(dim=rotary, max_seq_len=cfg.max_position_embeddings, theta=cfg.rope_theta)


def complex_rope(cfg: ModelConfig) -> ComplexRoPE.Config:
    """TorchTitan's interleaved RoPE (llama3), with ``scaling="llama"`` and the checkpoint's factors when it has
    Llama 3.x scaling."""
    sc = cfg.rope_scaling
    extra = (
        {}
        if sc is None
        else dict(
            scaling="llama",
            scaling_factor=sc.factor,
            low_freq_factor=sc.low_freq_factor,
            high_freq_factor=sc.high_freq_factor,
            original_max_position_embeddings=sc.original_max_position_embeddings,
        )
    )
    return ComplexRoPE.Config(
        dim=cfg.head_dim, max_seq_len=cfg.max_position_embeddings, theta=cfg.rope_theta, **({"scaling": "none"} | extra)
    )


_EXPERTS_INIT = {w: _INIT["weight"] for w in ("w1_EFD", "w2_EDF", "w3_EFD")}


def _moe_config(cfg: ModelConfig, mlp: MLP):
    """TorchTitan ``MoE.Config`` for a routed layer, built as TorchTitan's own builders do: a softmax top-k MoE
    (Qwen3-MoE: ``route_norm = norm_topk_prob``, no shared expert; ``torchtitan.models.qwen3._build_qwen3_moe_layers``)
    or DeepSeekMoE (``n_group`` groups of which ``topk_group`` are used, ``route_scale = routed_scaling_factor``,
    shared experts ``moe_intermediate_size x n_shared_experts`` wide, the selection bias as TorchTitan's
    ``expert_bias_E`` with sigmoid scores; ``torchtitan.models.deepseek_v3.build_mla_moe_layers``)."""
    from torchtitan.models.common.config_utils import make_moe_config, make_routed_experts_config, make_router_config

    e, k, deepseek = mlp.num_experts, mlp.top_k, mlp.component.grouped
    router = dict(score_func="softmax", route_norm=cfg.norm_topk_prob)
    if deepseek:
        router = dict(
            score_func=cfg.scoring_func,
            num_expert_groups=cfg.n_group,
            num_limited_groups=cfg.topk_group,
            route_scale=cfg.routed_scaling_factor,
            route_norm=cfg.norm_topk_prob,
        )
    moe = make_moe_config(
        num_experts=e,
        router=make_router_config(dim=cfg.hidden_size, num_experts=e, gate_param_init=_INIT, top_k=k, **router),
        routed_experts=make_routed_experts_config(
            dim=cfg.hidden_size,
            hidden_dim=mlp.intermediate_size,
            num_experts=e,
            top_k=k,
            param_init=_EXPERTS_INIT,
            comm_backend="standard",
        ),
        **(
            dict(
                shared_experts=make_ffn_config(
                    dim=cfg.hidden_size,
                    hidden_dim=mlp.intermediate_size * mlp.shared_experts,
                    w1_param_init=_INIT,
                    w2w3_param_init=_INIT,
                )
            )
            if deepseek
            else {}
        ),
    )
    if deepseek and cfg.scoring_func != "sigmoid":  # softmax DeepSeekMoE: no selection bias
        moe.load_balance_coeff = None
    return moe


_SAME = object()


def decoder_config(cfg: ModelConfig, plan: tuple[Layer, ...], model_cls, block_cls, rope, head_dim=_SAME):
    """A TorchTitan decoder config (stock components) of ``model_cls`` / ``block_cls`` for ``cfg``, one block per
    layer of the plan (:func:`zerokld_models.layer_plan`): grouped-query attention with the layer's QK norm and
    q/k/v bias, and its MLP (the dense ``FeedForward``, or an ``MoE``: :func:`_moe_config`).

    Args:
        rope: the RoPE config (:func:`cos_sin_rope` or :func:`complex_rope`).
        head_dim: what ``make_gqa_config`` gets (default ``cfg.head_dim``; llama3 passes ``None``: derived).
    """

    def norm(n: int) -> RMSNorm.Config:
        return RMSNorm.Config(normalized_shape=n, eps=cfg.rms_norm_eps, param_init=_ONES)

    layers = []
    for layer in plan:
        attention = make_gqa_config(
            dim=cfg.hidden_size,
            n_heads=cfg.num_attention_heads,
            n_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim if head_dim is _SAME else head_dim,
            wqkv_param_init=_INIT,
            wo_param_init=_INIT,
            inner_attention=get_attention_config("flex"),
            fuse_qkv=False,
            rope=rope,
            qk_norm=norm(cfg.head_dim) if layer.mixer.qk_norm else None,
        )
        if layer.mixer.qkv_bias:
            attention.qkv_linear.wq.bias = attention.qkv_linear.wkv.bias = True
        routed = layer.mlp.routed
        layers.append(
            block_cls.Config(
                attention_norm=norm(cfg.hidden_size),
                ffn_norm=norm(cfg.hidden_size),
                attention=attention,
                feed_forward=None
                if routed
                else make_ffn_config(
                    dim=cfg.hidden_size,
                    hidden_dim=layer.mlp.intermediate_size,
                    w1_param_init=_INIT,
                    w2w3_param_init=_INIT,
                ),
                moe=_moe_config(cfg, layer.mlp) if routed else None,
            )
        )
    return model_cls.Config(
        dim=cfg.hidden_size,
        vocab_size=cfg.vocab_size,
        norm=norm(cfg.hidden_size),
        enable_weight_tying=cfg.tie_word_embeddings,
        tok_embeddings=Embedding.Config(num_embeddings=cfg.vocab_size, embedding_dim=cfg.hidden_size, param_init=_INIT),
        lm_head=Linear.Config(in_features=cfg.hidden_size, out_features=cfg.vocab_size, param_init=_INIT),
        layers=layers,
    )


def architecture_config(adapter, cfg: ModelConfig):
    """TorchTitan's config of ``adapter.titan_model`` for ``cfg`` (stock components), from the architecture's
    declaration (:class:`zerokld_plugins.ModelAdapterSpec`: model and block classes, RoPE kind, head size) and the
    checkpoint's plan (:func:`zerokld_models.layer_plan`: each layer's QK norm, q/k/v bias and MLP).

    Raises:
        ValueError: a ``derived_head_dim`` architecture whose ``head_dim * num_attention_heads != hidden_size``
            (TorchTitan's llama3 derives the head size and would build another model).
    """
    from zerokld_plugins import resolve

    plan = layer_plan(cfg, adapter)
    if latent_cache(plan):  # TorchTitan's MLA lives in its DeepSeek-V3 model
        return mla_config(cfg, plan)
    if adapter.derived_head_dim and cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
        raise ValueError(
            f"TorchTitan's {adapter.titan_model.rpartition(':')[2]} derives the head size: it needs "
            f"head_dim * num_attention_heads == hidden_size, got {cfg.head_dim} * "
            f"{cfg.num_attention_heads} != {cfg.hidden_size}"
        )
    rope = complex_rope(cfg) if adapter.rope == "complex" else cos_sin_rope(cfg)
    return decoder_config(
        cfg,
        plan,
        resolve(adapter.titan_model),
        resolve(adapter.titan_block),
        rope,
        head_dim=None if adapter.derived_head_dim else _SAME,
    )


def mla_config(cfg: ModelConfig, plan: tuple[Layer, ...]):
    """TorchTitan's ``DeepSeekV3Model`` config (stock components, its own ``build_mla_moe_layers``) for a DeepSeek-V3
    or -V2 checkpoint: MLA (``q_lora_rank`` 0 = one ``wq``), YaRN on TorchTitan's complex (interleaved) RoPE with
    ``mscale = mscale_all_dim``, DeepSeekMoE with the checkpoint's router (V3: sigmoid with the selection bias as
    TorchTitan's ``expert_bias_E``; V2: softmax, no bias) in ``n_group`` groups, ``route_norm =
    norm_topk_prob``, ``route_scale = routed_scaling_factor``, ``n_shared_experts`` shared experts, the layers the
    plan's (:func:`zerokld_models.layer_plan`) dense prefix holds dense; every RMSNorm with the checkpoint's
    ``rms_norm_eps``.

    Raises:
        ValueError: the plan's routed layers are not all after its dense ones (TorchTitan's ``build_mla_moe_layers``
            builds ``n_dense_layers`` dense ones first, then MoE).
    """
    import dataclasses

    from torchtitan.models.deepseek_v3 import DeepSeekV3Model, build_mla_moe_layers

    from shared_numerics.rope import YarnScaling

    yarn = cfg.rope_scaling if isinstance(cfg.rope_scaling, YarnScaling) else None
    rope = ComplexRoPE.Config(
        dim=cfg.qk_rope_head_dim,
        max_seq_len=cfg.max_position_embeddings,
        theta=cfg.rope_theta,
        **(
            {"scaling": "none"}
            if yarn is None
            else dict(
                scaling="yarn",
                rope_factor=yarn.factor,
                beta_fast=yarn.beta_fast,
                beta_slow=yarn.beta_slow,
                original_seq_len=yarn.original_max_position_embeddings,
            )
        ),
    )
    n_dense = dense_prefix(plan)
    if n_dense is None:
        raise ValueError(
            "TorchTitan's DeepSeek-V3 model builds its dense layers first, then MoE; this plan's MLPs are "
            + ", ".join(layer.mlp.kind for layer in plan)
        )
    experts_init = _EXPERTS_INIT
    layers = build_mla_moe_layers(
        n_layers=len(plan),
        n_dense_layers=n_dense,
        dim=cfg.hidden_size,
        n_heads=cfg.num_attention_heads,
        q_lora_rank=cfg.q_lora_rank or 0,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        mscale=(yarn.mscale_all_dim or 1.0) if yarn is not None else 1.0,
        dense_hidden_dim=cfg.intermediate_size,
        moe_hidden_dim=cfg.moe_intermediate_size,
        num_experts=cfg.num_experts,
        num_shared_experts=cfg.n_shared_experts,
        router_top_k=cfg.num_experts_per_tok,
        router_score_func=cfg.scoring_func,
        router_num_expert_groups=cfg.n_group,
        router_num_limited_groups=cfg.topk_group,
        router_route_scale=cfg.routed_scaling_factor,
        router_route_norm=cfg.norm_topk_prob,
        attn_backend="flex",
        moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        linear_init=_INIT,
        norm_init=_ONES,
        depth_init=lambda i: _INIT,
        depth_experts_init=lambda i: experts_init,
        rope=rope,
    )

    if cfg.scoring_func != "sigmoid":  # DeepSeek-V2: no selection bias (TorchTitan's load-balancing bias) at all
        for layer in layers:
            if layer.moe is not None:
                layer.moe.load_balance_coeff = None

    def eps(node):  # every RMSNorm config of the tree gets the checkpoint's epsilon
        if isinstance(node, RMSNorm.Config):
            node.eps = cfg.rms_norm_eps
        elif dataclasses.is_dataclass(node):
            for f in dataclasses.fields(node):
                eps(getattr(node, f.name))
        elif isinstance(node, list):
            for x in node:
                eps(x)

    model_cfg = DeepSeekV3Model.Config(
        dim=cfg.hidden_size,
        vocab_size=cfg.vocab_size,
        norm=RMSNorm.Config(normalized_shape=cfg.hidden_size, param_init=_ONES),
        tok_embeddings=Embedding.Config(num_embeddings=cfg.vocab_size, embedding_dim=cfg.hidden_size, param_init=_INIT),
        lm_head=Linear.Config(in_features=cfg.hidden_size, out_features=cfg.vocab_size, param_init=_INIT),
        layers=layers,
        mtp_layers=[],
    )
    eps(model_cfg)
    return model_cfg


def trainer_unbuilt(cfg: ModelConfig, plan: tuple[Layer, ...]) -> list[str]:
    """The components of ``plan`` that zerokld's definitions implement (vLLM serves them) but the trainer's model
    does not build yet: Gated DeltaNet layers, gated attention, the sigmoid-gated shared expert, zero-centred
    RMSNorm gains (Qwen3-Next's; TorchTitan 0.3.0's ``qwen3_5`` model needs FLA's kernels). Empty: it builds."""
    found = {
        "Gated DeltaNet layers": any(layer.mixer.kind == "gated_deltanet" for layer in plan),
        "gated attention (attn_output_gate)": any(layer.mixer.output_gate for layer in plan),
        "sigmoid-gated shared expert": any(layer.mlp.shared_expert_gate for layer in plan),
        "zero-centred RMSNorm gains": cfg.zero_centred_norm,
    }
    return [name for name, present in found.items() if present]


def titan_model_config(cfg: ModelConfig, settings: ZeroKLDSettings | None = None):
    """TorchTitan model config for a checkpoint's :class:`zerokld_models.ModelConfig`, built from its architecture's
    declaration (:func:`architecture_config`), under the trainer's settings.

    Args:
        cfg: from :func:`zerokld_models.read_model_config`.
        settings: :class:`shared_numerics.settings.ZeroKLDSettings` (default: its defaults): ``batch_invariant``
            applies the :mod:`titan_plugin.overrides` (otherwise stock TorchTitan components, with TorchTitan's SDPA
            inner attention where its default is flex attention, which has no CPU path); ``fp8``: FP8 QAT granularity;
            ``tp_k_block``: the fixed K-block of the TP-size-invariant row-parallel sum
            (:func:`titan_plugin.overrides.set_tp_k_block`).

    Raises:
        zerokld_plugins.UnknownNameError: no architecture folder registers ``cfg.architecture``.
        zerokld_models.UnsupportedModelError: a feature the definition does not implement (RoPE scaling type, bias,
            ...; DeepSeek Sparse Attention with ``batch_invariant`` off: TorchTitan has none), or one the trainer does
            not build yet (:func:`trainer_unbuilt`); ValueError: a quantized
            checkpoint (train from the high-precision one; export with
            :func:`titan_plugin.export_fp8_checkpoint`); ``tp_k_block`` with FP8.
    """
    settings = ZeroKLDSettings() if settings is None else settings
    if cfg.quant_method:
        raise ValueError(f"the trainer loads high-precision checkpoints; this one is quantized ({cfg.quant_method})")
    adapter = adapter_for(cfg)
    check_supported(cfg, adapter)
    unbuilt = trainer_unbuilt(cfg, layer_plan(cfg, adapter))
    if unbuilt:
        raise UnsupportedModelError(f"the zerokld trainer does not build {cfg.architecture}'s " + "; ".join(unbuilt))
    if cfg.index_topk is not None and not settings.batch_invariant:
        raise UnsupportedModelError(
            f"{cfg.architecture}: TorchTitan has no DeepSeek Sparse Attention; only zerokld's definition "
            "(batch_invariant on) trains it"
        )
    model_cfg = architecture_config(adapter, cfg)
    if settings.batch_invariant:
        apply_zerokld_overrides(model_cfg, fp8=settings.fp8)
        if latent_cache(layer_plan(cfg, adapter)):
            set_mla(model_cfg, cfg)
        if settings.tp_k_block is not None:
            set_tp_k_block(model_cfg, settings.tp_k_block)
    else:  # TorchTitan's default inner attention is flex attention, which has no CPU path: its SDPA config instead
        from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

        for layer in model_cfg.layers:
            if isinstance(layer.attention.inner_attention, FlexAttention.Config):
                layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return model_cfg


def state_dict_adapter_class(cfg: ModelConfig):
    """TorchTitan ``StateDictAdapter`` class of the checkpoint's architecture: the declared stock adapter, extended
    by the declaration's ``extra_hf_names`` (e.g. Qwen2's q/k/v biases on TorchTitan's Qwen3 adapter), whose
    ``to_hf`` leaves LoRA adapters out (``...lora_a.weight`` / ``...lora_b.weight``: not checkpoint tensors; they are
    saved as PEFT adapters, :func:`titan_plugin.lora.save_peft_adapter`). TorchTitan's Qwen3 adapter skips names it
    does not know; its DeepSeek-V3 adapter raises ``KeyError`` on them, so a LoRA model's HF load failed there."""
    adapter = adapter_for(cfg)
    return _state_dict_adapter(adapter.titan_state_dict_adapter, adapter.extra_hf_names)


def _lora_key(name: str) -> bool:
    return ".lora_a." in name or ".lora_b." in name


@functools.cache
def _state_dict_adapter(stock: str, extra_hf_names: tuple[tuple[str, str], ...]):
    from zerokld_plugins import resolve

    base = resolve(stock)

    def __init__(self, model_config, hf_assets_path):
        base.__init__(self, model_config, hf_assets_path)
        self.from_hf_map.update(extra_hf_names)

    def to_hf(self, state_dict):
        return base.to_hf(self, {k: v for k, v in state_dict.items() if not _lora_key(k)})

    extra = f" plus {[h for h, _ in extra_hf_names]}" if extra_hf_names else ""
    return type(
        base.__name__,
        (base,),
        {
            "__init__": __init__,
            "to_hf": to_hf,
            "__module__": __name__,
            "__doc__": f"{base.__name__}{extra}, LoRA adapters left out of to_hf",
        },
    )


def _adapter(model_cfg, cfg: ModelConfig, checkpoint_dir: str | Path | None):
    return state_dict_adapter_class(cfg)(model_cfg, str(checkpoint_dir) if checkpoint_dir else None)


def load_hf_weights(model: torch.nn.Module, model_cfg, cfg: ModelConfig, checkpoint_dir: str | Path) -> None:
    """Load ``*.safetensors`` of an HF checkpoint into a TorchTitan model (strict: every key must match).

    Raises:
        RuntimeError: missing or unexpected keys (``load_state_dict(strict=True)``).
    """
    hf_sd = read_tensors(checkpoint_dir)
    sd = _adapter(model_cfg, cfg, checkpoint_dir).from_hf(hf_sd)
    ref = model.state_dict()
    sd = {k: v.to(ref[k].dtype) if k in ref else v for k, v in sd.items()}
    if model_cfg.enable_weight_tying:
        sd.setdefault("lm_head.weight", sd["tok_embeddings.weight"])
    for k in ref:  # MoE load-balancing bias: training state, not in HF checkpoints; keep the model's (zeros)
        if k.endswith("moe.expert_bias_E"):
            sd.setdefault(k, ref[k])
    model.load_state_dict(sd, strict=True)


def hf_state_dict(
    model: torch.nn.Module | list[torch.nn.Module], model_cfg, cfg: ModelConfig, group=None
) -> dict[str, torch.Tensor]:
    """The model's weights under HF names (TorchTitan's ``to_hf``; DTensors gathered), detached copies; a LoRA
    model's base weights (its adapters: :func:`titan_plugin.lora.peft_adapter_state_dict`).

    ``model`` may be a list of model parts (pipeline stages, TorchTitan's ``model_parts``); with ``group`` (the
    ``pp`` process group) every rank's parts are gathered, so each rank returns the whole model's weights."""
    from torch.distributed.tensor import DTensor

    parts = model if isinstance(model, list) else [model]
    sd = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for part in parts
        for k, v in part.state_dict().items()
        if not _lora_key(k)
    }  # LoRA adapters: titan_plugin.lora.save_peft_adapter
    if group is not None:
        import torch.distributed as dist

        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, sd, group=group)
        sd = {k: v for stage in gathered for k, v in stage.items()}
    if model_cfg.enable_weight_tying:
        sd.pop("lm_head.weight", None)
    out = _adapter(model_cfg, cfg, None).to_hf(sd)
    if model_cfg.enable_weight_tying:
        out.pop("lm_head.weight", None)
    return out


def build_titan_model(
    checkpoint_dir: str | Path,
    dtype: str = "float32",
    batch_invariant: bool = True,
    fp8: str | None = None,
    tp_k_block: int | None = None,
):
    """Build TorchTitan's model for an HF checkpoint directory and load its weights.

    Args:
        batch_invariant, fp8, tp_k_block: the :class:`shared_numerics.settings.ZeroKLDSettings` fields of the same
            names and defaults (validated there: ``fp8`` and ``tp_k_block`` need ``batch_invariant``).

    Parameters are cast to ``dtype``; buffers (RoPE caches, MoE token counters) keep the dtype TorchTitan builds them
    in, as in TorchTitan's trainer, where FSDP's ``MixedPrecisionPolicy(param_dtype=...)`` casts parameters only.
    (``nn.Module.to(dtype)`` would also cast ``ComplexRoPE``'s complex64 cache to real, dropping its imaginary part:
    llama3's RoPE then rotates nothing.)

    Returns:
        ``(model, model_config, model_cfg)``: the model (on CPU, parameters in ``dtype``), its TorchTitan config and the
        checkpoint's :class:`zerokld_models.ModelConfig`.
    """
    from .cpu_compat import apply

    apply()  # TorchTitan on a CPU-only torch (titan_plugin.cpu_compat)
    cfg = read_model_config(checkpoint_dir)
    settings = ZeroKLDSettings.parse(
        dict(batch_invariant=batch_invariant, fp8=fp8, tp_k_block=tp_k_block), "build_titan_model settings"
    )
    model_cfg = titan_model_config(cfg, settings)
    with torch.device("cpu"):
        model = model_cfg.build()
    model.init_states(buffer_device=torch.device("cpu"))
    with torch.no_grad():  # parameters only: buffers keep the dtype TorchTitan builds them in
        for p in model.parameters():
            p.data = p.data.to(_DTYPES[dtype])
    load_hf_weights(model, model_cfg, cfg, checkpoint_dir)
    return model, model_cfg, cfg
