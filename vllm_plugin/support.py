"""What a zerokld vLLM engine refuses at start, in one place: the checkpoint's features (each layer component's answer,
:func:`zerokld_models.unsupported_features`, the check the trainer runs too) and the engine's settings (parallelism,
LoRA, FP8, dtype, quantization); :func:`vllm_plugin.start.check_model_settings` runs them where vLLM builds its config
and again in the worker.

Source: vLLM ``config/parallel.py``, ``config/lora.py`` (the settings read here).
"""

from __future__ import annotations

import torch

from shared_numerics.fp8_checkpoint import QUANT_METHOD
from zerokld_models import ModelConfig, adapter_for, layer_plan, unsupported_features

from .config import ZeroKLDConfigError, from_vllm_config

__all__ = ["check_moe_supported", "check_stock_engine", "check_supported", "is_zerokld_fp8"]


def is_zerokld_fp8(vllm_config) -> bool:
    """Whether the engine serves a ``zerokld_fp8`` checkpoint (vLLM's ``quant_config`` is zerokld's)."""
    qc = vllm_config.quant_config
    return qc is not None and qc.get_name() == QUANT_METHOD


def check_stock_engine(vllm_config) -> None:
    """With the zerokld switch off (vLLM's own model serves): refuse a checkpoint exported as ``zerokld_fp8``, whose
    FP8 codes vLLM's layers would misread.

    Raises:
        ZeroKLDConfigError: the checkpoint is quantized with ``zerokld_fp8``.
    """
    if is_zerokld_fp8(vllm_config):
        raise ZeroKLDConfigError(
            f"this checkpoint is quantized with {QUANT_METHOD}; serve it with "
            "additional_config={'zerokld': {'batch_invariant': true}}"
        )


def check_supported(vllm_config, cfg: ModelConfig, adapter) -> None:
    """Refuse, at start, every feature the batch-invariant path does not implement: the architecture's
    (:func:`zerokld_models.unsupported_features`, the check the trainer runs too) and the engine's.

    Raises:
        ZeroKLDConfigError: naming each unsupported setting.
    """
    pc = vllm_config.parallel_config
    plan = layer_plan(cfg, adapter)
    problems = unsupported_features(cfg, adapter)
    if pc.pipeline_parallel_size != 1:
        problems.append("pipeline parallelism (use PP=1)")
    problems += _tp_problems(
        pc.tensor_parallel_size,
        from_vllm_config(vllm_config).tp_k_block,
        cfg,
        lora=vllm_config.lora_config is not None,
        fp8=from_vllm_config(vllm_config).fp8 or is_zerokld_fp8(vllm_config),
    )
    problems += _load_format_problems(vllm_config.load_config)
    if vllm_config.model_config.dtype not in (torch.float32, torch.bfloat16):
        problems.append(f"dtype {vllm_config.model_config.dtype} (use float32 or bfloat16)")
    qc = vllm_config.quant_config
    if qc is not None and getattr(qc, "get_name", lambda: None)() != QUANT_METHOD:
        problems.append(
            f"quantization {qc.get_name()} (zerokld serves its own FP8: additional_config fp8, or a "
            f"{QUANT_METHOD} checkpoint)"
        )
    lc = vllm_config.lora_config
    if lc is not None:
        if from_vllm_config(vllm_config).fp8 or is_zerokld_fp8(vllm_config):
            problems.append("LoRA with FP8 (the adapters would bypass the FP8 GEMM)")
        if not all(layer.mlp.component.lora for layer in plan):
            # DeepSeekMoE's LoRA (MLA projections and dense first layers) is tested; a softmax MoE in every layer
            # would adapt its attention only
            problems.append("LoRA on an MoE model (experts are not adapted)")
        if lc.lora_dtype not in ("auto", None, vllm_config.model_config.dtype):
            problems.append(f"lora_dtype {lc.lora_dtype} (adapters run in the model dtype: leave it auto)")
    fp8 = from_vllm_config(vllm_config).fp8 or is_zerokld_fp8(vllm_config)
    if fp8 and any(layer.mixer.qkv_bias for layer in plan):
        problems.append("FP8 with q/k/v bias (the FP8 GEMM is bias-free)")
    if any(layer.mixer.cache == "recurrent" for layer in plan):
        problems += _recurrent_problems(vllm_config)
    if cfg.index_topk is not None:
        from vllm.platforms import current_platform

        if current_platform.is_cuda_alike() and not vllm_config.model_config.enforce_eager:
            # the selection's sizes are data-dependent (which queries select, how many sequences): no graph capture
            problems.append("DeepSeek Sparse Attention with CUDA graphs (use enforce_eager)")
    if problems:
        raise ZeroKLDConfigError(
            f"zerokld batch_invariant mode does not support ({cfg.architecture}): " + "; ".join(problems)
        )


def _recurrent_problems(vllm_config) -> list[str]:
    """What a zerokld engine of a model with Gated DeltaNet layers does not run (yet): the recurrent state kept in
    anything but float32 (vLLM's ``mamba_ssm_cache_dtype``; ``"auto"`` is made float32 where the config is built,
    :func:`vllm_plugin.start.keep_recurrent_state_float32`), a conv state in another dtype than the activations',
    speculative decoding, and tensor parallelism, LoRA or FP8 over those layers.

    Source: vLLM ``config/cache.py`` (``mamba_cache_dtype``, ``mamba_ssm_cache_dtype``, ``mamba_cache_mode``)."""
    cc, problems = vllm_config.cache_config, []
    if cc.mamba_ssm_cache_dtype != "float32":
        problems.append(
            f"mamba_ssm_cache_dtype {cc.mamba_ssm_cache_dtype} (zerokld keeps the Gated DeltaNet state in float32)"
        )
    if cc.mamba_cache_dtype not in ("auto", str(vllm_config.model_config.dtype).removeprefix("torch.")):
        problems.append(f"mamba_cache_dtype {cc.mamba_cache_dtype} (the conv state is kept in the model dtype)")
    if getattr(cc, "mamba_cache_mode", "none") not in ("none", "align"):
        problems.append(f"mamba_cache_mode {cc.mamba_cache_mode} (supported: none, align)")
    if vllm_config.speculative_config is not None:
        problems.append("speculative decoding with Gated DeltaNet layers")
    if vllm_config.parallel_config.tensor_parallel_size != 1:
        problems.append("tensor parallelism with Gated DeltaNet layers (use TP=1)")
    if vllm_config.lora_config is not None:
        problems.append("LoRA with Gated DeltaNet layers")
    if from_vllm_config(vllm_config).fp8 or is_zerokld_fp8(vllm_config):
        problems.append("FP8 with Gated DeltaNet layers")
    return problems


def _load_format_problems(load_config) -> list[str]:
    """A ``load_format`` whose loader builds the model itself instead of through ``BaseModelLoader.load_model`` (where
    the ``initialize_model`` seam of :mod:`vllm_plugin.register` chooses zerokld's class): vLLM 0.32's ``tensorizer``,
    ``modelexpress`` and ``ipc_cache`` would build the stock class, stock numerics served with the switch on.

    Source: vLLM ``model_executor/model_loader/__init__.py`` (the load format -> loader class table).
    """
    from vllm.model_executor import model_loader

    fmt = load_config.load_format
    fmt = getattr(fmt, "value", fmt)
    loader = getattr(model_loader, "_LOAD_FORMAT_TO_MODEL_LOADER", {}).get(fmt)
    if loader is not None and loader.load_model is model_loader.BaseModelLoader.load_model:
        return []
    return [f"load_format {fmt} (its loader builds the model without zerokld's class; use auto or safetensors)"]


def _tp_problems(tp: int, k_block: int | None, cfg: ModelConfig, lora: bool, fp8: bool) -> list[str]:
    """What keeps ``cfg`` from running at TP size ``tp`` with ``tp_k_block`` ``k_block`` (empty: it runs): the
    power-of-two size, and each layer component's split (:meth:`zerokld_models.mixers.GQA.tp_split`, its MLP's
    ``row_parallel``)."""
    problems = []
    if tp > 1 and k_block is None:
        problems.append(
            f"tensor_parallel_size {tp} without tp_k_block (set additional_config zerokld tp_k_block: "
            "the fixed K-block of the TP-invariant row-parallel sum)"
        )
    if tp & (tp - 1):
        problems.append(
            f"tensor_parallel_size {tp} (a power of two: the rank subtrees of the fixed reduction tree must align)"
        )
    if k_block is None:
        return problems
    if lora:
        problems.append("tp_k_block with LoRA")
    if fp8:
        problems.append("tp_k_block with FP8")
    shards: dict[str, int] = {}
    widths: dict[str, int] = {}
    for layer in layer_plan(cfg, adapter_for(cfg)):  # each layer's components say how TP splits them
        split = layer.mixer.component.tp_split(cfg)
        shards.update(split.shards)
        widths.update(split.row_parallel)
        widths.update(layer.mlp.component.row_parallel(layer.mlp))
    problems += [f"{k}={v} not divisible by tensor_parallel_size {tp}" for k, v in shards.items() if v % tp]
    for name, k in widths.items():
        if k % (tp * k_block):
            problems.append(f"{name} K={k} not divisible by tensor_parallel_size x tp_k_block = {tp * k_block}")
    return problems


def check_moe_supported(vllm_config, architecture: str) -> None:
    """Raise :class:`ZeroKLDConfigError` for MoE engine settings the zerokld path does not implement (the model's own
    MoE structure is checked by :func:`zerokld_models.unsupported_features`)."""
    problems = []
    if vllm_config.parallel_config.enable_expert_parallel:
        problems.append("expert parallelism")
    if problems:
        raise ZeroKLDConfigError(f"zerokld {architecture} does not support: " + "; ".join(problems))
