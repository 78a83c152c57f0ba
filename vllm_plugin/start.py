"""A zerokld engine's start checks, run where vLLM builds its config: ``EngineArgs.create_engine_config``, in the
``vllm.LLM`` / ``vllm serve`` process, before vLLM spawns the engine core and its workers.

Each check here is one the worker runs again when it builds the model (:class:`vllm_plugin.models.dense.ZeroKLDMixin`
and the ``initialize_model`` guard of :mod:`vllm_plugin.register`), on the same ``VllmConfig`` (the one built here is
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

__all__ = ["check_engine_config", "install", "unsupported_architecture"]


def unsupported_architecture(vllm_config):
    """The error for an engine with zerokld on whose architecture no ``zerokld`` model adapter declares.

    Returns:
        :class:`vllm_plugin.config.ZeroKLDConfigError` naming the checkpoint's ``architectures`` and the declared ones.
    """
    from zerokld_plugins import registered

    from .config import ZeroKLDConfigError

    archs = getattr(vllm_config.model_config.hf_config, "architectures", None)
    return ZeroKLDConfigError(
        f"zerokld batch_invariant mode does not support architecture {archs}; supported: {sorted(registered('model'))}"
    )


def check_engine_config(vllm_config) -> None:
    """Refuse ``vllm_config`` where its worker would refuse it when building the model.

    With zerokld off: a ``zerokld_fp8`` checkpoint of a declared architecture
    (:func:`vllm_plugin.models.dense.check_stock_engine`). With it on: an architecture (vLLM's resolved
    ``model_config.architecture``) that no ``zerokld`` model adapter declares; then the architecture's checks
    (:func:`vllm_plugin.models.dense.check_supported`: model features and engine settings), the sampler's
    (:func:`vllm_plugin.sampler.check_sampler_supported`) and, for MoE and MLA architectures, the MoE settings'
    (:func:`vllm_plugin.models.moe.check_moe_supported`), in the order the worker runs them.

    Raises:
        vllm_plugin.config.ZeroKLDConfigError: naming what is not supported.
        zerokld_models.UnsupportedModelError: the checkpoint's config cannot be read as its architecture.
    """
    from zerokld_plugins import get_model_adapter, registered

    from .config import from_vllm_config

    model_config = vllm_config.model_config
    if model_config is None:
        return
    declared = model_config.architecture in registered("model")
    if not from_vllm_config(vllm_config).batch_invariant:
        if declared:
            from .models.dense import check_stock_engine

            check_stock_engine(vllm_config)
        return
    if not declared:
        raise unsupported_architecture(vllm_config)
    from zerokld_models import read_model_config

    from .models.dense import check_supported
    from .models.moe import check_moe_supported
    from .sampler import check_sampler_supported

    adapter = get_model_adapter(model_config.architecture)
    cfg = read_model_config(model_config.hf_config)
    check_supported(vllm_config, cfg, adapter)
    check_sampler_supported(vllm_config)
    if adapter.attention == "mla" or adapter.moe:
        check_moe_supported(vllm_config, cfg.architecture)


def install() -> None:
    """Wrap ``EngineArgs.create_engine_config``: :func:`check_engine_config`, then the hot-load worker extension, on
    every config it builds (idempotent)."""
    import functools

    from .hotload.worker import configure_worker_extension
    from .seams import replace

    def wrap(original):
        @functools.wraps(original)
        def create_engine_config(self, *args, **kwargs):
            config = original(self, *args, **kwargs)
            check_engine_config(config)
            configure_worker_extension(config)
            return config

        return create_engine_config

    replace("vllm.engine.arg_utils:EngineArgs.create_engine_config", wrap)
