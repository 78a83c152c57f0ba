"""A zerokld engine's start checks, run where vLLM builds its config: ``EngineArgs.create_engine_config``, in the
``vllm.LLM`` / ``vllm serve`` process, before vLLM spawns the engine core and its workers.

The worker runs the same checks again when it builds the model (:func:`check_engine_config` in the
``initialize_model`` seam of :mod:`vllm_plugin.register` with zerokld off, :func:`check_model_settings` in
:class:`vllm_plugin.models.model.ZeroKLDForCausalLM` with it on), on the same ``VllmConfig`` (the one built here is
what vLLM sends to its engine core and workers), so they refuse the same engines with the same messages. Run first
here, a refused engine fails in about a second with :class:`vllm_plugin.config.ZeroKLDConfigError` raised in the
caller's process, instead of after an engine core and a worker have each imported vLLM and started (20-40 s on 2
cores) with the reason only in their logs and vLLM's "Engine core initialization failed" in the caller's.

The same replacement of ``create_engine_config`` then gives zerokld engines the hot-load worker extension
(:func:`vllm_plugin.hotload.worker.configure_worker_extension`).

Source: vLLM ``engine/arg_utils.py`` (``EngineArgs.create_engine_config``), ``config/model.py``
(``ModelConfig.architecture``: the architecture whose class vLLM builds).
"""

from __future__ import annotations

__all__ = [
    "check_engine_config",
    "check_model_settings",
    "install",
    "keep_recurrent_state_float32",
    "unsupported_architecture",
]


def unsupported_architecture(model_config):
    """The error for an engine with zerokld on whose model (vLLM's ``ModelConfig``: the engine's, or the one
    ``initialize_model`` was given) no ``zerokld`` model adapter declares.

    Returns:
        :class:`vllm_plugin.config.ZeroKLDConfigError` naming the checkpoint's ``architectures`` and the declared ones.
    """
    from zerokld_plugins import registered

    from .config import ZeroKLDConfigError

    archs = getattr(model_config.hf_config, "architectures", None)
    return ZeroKLDConfigError(
        f"zerokld batch_invariant mode does not support architecture {archs}; supported: {sorted(registered('model'))}"
    )


def check_model_settings(vllm_config, adapter):
    """The start checks of an engine whose architecture ``adapter`` declares, in the one order both callers run them
    (:func:`check_engine_config` where the config is built and, with zerokld off, in the worker's ``initialize_model``
    seam of :mod:`vllm_plugin.register`; :class:`vllm_plugin.models.model.ZeroKLDForCausalLM` with it on). With
    zerokld off: a ``zerokld_fp8`` checkpoint (:func:`vllm_plugin.support.check_stock_engine`). With it on: the
    architecture's model features and engine settings (:func:`vllm_plugin.support.check_supported`), the sampler's
    (:func:`vllm_plugin.sampler.check_sampler_supported`) and, for architectures with routed MLPs, the MoE settings'
    (:func:`vllm_plugin.support.check_moe_supported`).

    Returns:
        The checkpoint's :class:`zerokld_models.ModelConfig` with zerokld on; ``None`` with it off.

    Raises:
        vllm_plugin.config.ZeroKLDConfigError: naming what is not supported.
        zerokld_models.UnsupportedModelError: the checkpoint's config cannot be read as its architecture.
    """
    from zerokld_models import layer_plan, read_model_config

    from .config import from_vllm_config
    from .sampler import check_sampler_supported
    from .support import check_moe_supported, check_stock_engine, check_supported

    if not from_vllm_config(vllm_config).batch_invariant:
        check_stock_engine(vllm_config)
        return None
    cfg = read_model_config(vllm_config.model_config.hf_config)
    check_supported(vllm_config, cfg, adapter)
    check_sampler_supported(vllm_config)
    if adapter.moe or any(layer.mlp.routed for layer in layer_plan(cfg, adapter)):
        check_moe_supported(vllm_config, cfg.architecture)
    return cfg


def check_engine_config(vllm_config) -> None:
    """Refuse ``vllm_config`` where its worker would refuse it when building the model: with zerokld on, an
    architecture (vLLM's resolved ``model_config.architecture``) that no ``zerokld`` model adapter declares; for a
    declared one, :func:`check_model_settings`.

    Raises:
        vllm_plugin.config.ZeroKLDConfigError: naming what is not supported.
        zerokld_models.UnsupportedModelError: the checkpoint's config cannot be read as its architecture.
    """
    from zerokld_plugins import get_model_adapter, registered

    from .config import from_vllm_config

    model_config = vllm_config.model_config
    if model_config is None:
        return
    if model_config.architecture in registered("model"):
        check_model_settings(vllm_config, get_model_adapter(model_config.architecture))
    elif from_vllm_config(vllm_config).batch_invariant:
        raise unsupported_architecture(model_config)


def keep_recurrent_state_float32(engine_args) -> None:
    """With zerokld on, a Gated DeltaNet (or Mamba) layer's recurrent state is float32 whatever the platform picks:
    vLLM's ``mamba_ssm_cache_dtype`` left at ``"auto"`` (the model dtype on CPUs without AVX512-BF16; vLLM-CPU sets
    float32 only where its own accelerated kernels run, ``platforms/cpu.py``) becomes ``"float32"`` before vLLM
    sizes the cache; an explicit other value is refused by :func:`vllm_plugin.support.check_supported`. Engines
    without a recurrent layer never read it."""
    from .config import ZeroKLDConfigError, from_vllm_config

    try:
        on = from_vllm_config(engine_args).batch_invariant
    except ZeroKLDConfigError:
        return  # refused with its message once the config is built (check_engine_config)
    if on and getattr(engine_args, "mamba_ssm_cache_dtype", None) == "auto":
        engine_args.mamba_ssm_cache_dtype = "float32"


def install() -> None:
    """Wrap ``EngineArgs.create_engine_config``: :func:`keep_recurrent_state_float32` on its arguments, then
    :func:`check_engine_config` and the hot-load worker extension on every config it builds (idempotent)."""
    import functools

    from .hotload.worker import configure_worker_extension
    from .seams import replace

    def wrap(original):
        @functools.wraps(original)
        def create_engine_config(self, *args, **kwargs):
            keep_recurrent_state_float32(self)
            config = original(self, *args, **kwargs)
            check_engine_config(config)
            configure_worker_extension(config)
            return config

        return create_engine_config

    replace("vllm.engine.arg_utils:EngineArgs.create_engine_config", wrap)
