"""vLLM general-plugin entry point (``vllm.general_plugins`` → ``vllm_plugin.register:register``).

vLLM calls ``register()`` in every process it starts (API server, engine core, each worker), possibly more than
once, before any model is built (``vllm/plugins/__init__.py``: ``load_general_plugins``). It only registers names;
nothing changes until a model is built with ``additional_config={"zerokld": {"batch_invariant": true}}``:

* model construction (``model_loader/utils.py``'s ``initialize_model``, as ``base_loader`` calls it) chooses the
  class once: with the flag on, :class:`vllm_plugin.models.model.ZeroKLDForCausalLM` for an architecture declared
  through the ``zerokld`` model-adapter hook (ours: ``zerokld_models/<arch>/``), a clear error at start for any other
  (never stock numerics served silently); with it off, vLLM's own class from its registry, untouched;
* the attention backend names ``ZEROKLD_ATTN`` and ``ZEROKLD_LATENT_ATTN`` (MLA's latent cache) are registered for
  those models' attention layers, and vLLM-CPU's MLA scheduling overrides skip zerokld MLA engines
  (:mod:`vllm_plugin.latent_platform`);
* the quantization method ``zerokld_fp8`` (FP8 checkpoints exported by the trainer) is added to vLLM's registry;
* the deterministic sampler (:mod:`vllm_plugin.sampler`), the output fields (:mod:`vllm_plugin.outputs`: seeds,
  numerics stamp, hot-load weight-version spans), the CPU side of vLLM's ``enable_return_routed_experts``
  (:mod:`vllm_plugin.routing`) and the LoRA layer class (:mod:`vllm_plugin.lora`) are installed, each inert unless
  the engine's zerokld settings (or the hot-load endpoint) switch it on;
* engines with zerokld on use vLLM's V1 model runner, where those hooks live (:mod:`vllm_plugin.runner`);
* their configs are checked where vLLM builds them, before it starts any engine process (:mod:`vllm_plugin.start`:
  the checks each worker runs again when it builds the model), and their workers get the hot-load worker extension
  (:mod:`vllm_plugin.hotload.worker`: deltas applied in place);

Every vLLM attribute replaced on the way is declared in :data:`vllm_plugin.seams.SEAMS` and checked against the running
vLLM first (:class:`vllm_plugin.seams.SeamError` names what is missing).
"""

from __future__ import annotations

_REGISTERED = False


def register() -> None:
    """Idempotently register zerokld's attention backends, quantization method and seams with vLLM."""
    global _REGISTERED
    if _REGISTERED:
        return
    from .seams import check

    check()  # every vLLM attribute zerokld replaces exists in this vLLM, or a SeamError naming them (vllm_plugin.seams)
    from vllm.v1.attention.backends.registry import register_backend

    from . import latent_platform, lora, outputs, routing, runner, sampler, start
    from .attention_backend import BACKEND_NAME, LATENT_BACKEND_NAME
    from .fp8 import register as register_fp8
    from .hotload import attribution, fireworks

    register_backend(BACKEND_NAME, "vllm_plugin.attention_backend.ZeroKLDAttentionBackend")
    register_backend(LATENT_BACKEND_NAME, "vllm_plugin.attention_backend.ZeroKLDLatentAttentionBackend")
    register_fp8()
    # every seam of vllm_plugin.seams.SEAMS, once, here (each inert until an engine's settings switch it on)
    for module in (sampler, outputs, attribution, fireworks, routing, runner, start, lora, latent_platform):
        module.install()
    _guard_initialize_model()
    _REGISTERED = True


def _guard_initialize_model() -> None:
    from zerokld_plugins import registered

    from .config import ZeroKLDConfigError, from_vllm_config
    from .seams import replace
    from .start import check_engine_config, unsupported_architecture

    def wrap(original):
        def initialize_model(vllm_config, *args, **kwargs):
            """vLLM's ``initialize_model(vllm_config, *, prefix, model_class, model_config)`` with the class chosen
            here: zerokld's for a declared architecture with the switch on (its constructor runs the start checks
            again), vLLM's own with it off (after the stock engine's check, :func:`vllm_plugin.start.
            check_engine_config`)."""
            if not from_vllm_config(vllm_config).batch_invariant:
                check_engine_config(vllm_config)
                return original(vllm_config, *args, **kwargs)
            model_config = kwargs.get("model_config") or vllm_config.model_config
            asked = kwargs.get("model_class")
            if asked is not None:  # a caller that names its class (vLLM 0.32's base loader never does)
                raise ZeroKLDConfigError(
                    f"zerokld batch_invariant mode builds its own model class; vLLM asked for {asked.__name__}"
                )
            if model_config.architecture not in registered("model"):
                raise unsupported_architecture(model_config)
            from .models.model import ZeroKLDForCausalLM

            kwargs["model_class"] = ZeroKLDForCausalLM
            return original(vllm_config, *args, **kwargs)

        return initialize_model

    replace("vllm.model_executor.model_loader.base_loader:initialize_model", wrap)
