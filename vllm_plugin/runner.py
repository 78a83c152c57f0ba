"""Which vLLM model runner serves a zerokld engine: always the V1 ``GPUModelRunner`` family.

The sampler, logprobs and routing hooks (:mod:`vllm_plugin.sampler`, :mod:`vllm_plugin.routing`, the model's
``compute_logprobs``) are installed on the V1 runner (``v1/worker/gpu_model_runner.py``, whose CPU runner subclasses
it). vLLM 0.32 picks Model Runner V2 (``v1/worker/gpu/model_runner.py``: its own sampler and a fused Triton logprob
kernel) by default on CUDA when Triton is present (``VllmConfig.use_v2_model_runner``); on it those hooks would
silently not run and the returned logprobs would be vLLM's, not ours. So, with ``batch_invariant`` on:

* ``VLLM_USE_V2_MODEL_RUNNER`` unset (or ``0``): the engine uses the V1 runner;
* ``VLLM_USE_V2_MODEL_RUNNER=1``: the engine refuses to start, naming the variable.

Engines without zerokld keep vLLM's own choice.
"""

from __future__ import annotations

from .config import ZeroKLDConfigError, from_vllm_config

__all__ = ["install", "use_v2_model_runner"]


def use_v2_model_runner(vllm_config, vllm_default) -> bool:
    """``vllm_default()`` for engines without zerokld; ``False`` with it.

    Raises:
        ZeroKLDConfigError: zerokld is on and ``VLLM_USE_V2_MODEL_RUNNER=1`` asks for Model Runner V2.
    """
    if not from_vllm_config(vllm_config).batch_invariant:
        return vllm_default()
    import vllm.envs as envs

    if envs.VLLM_USE_V2_MODEL_RUNNER:
        raise ZeroKLDConfigError(
            "zerokld batch_invariant needs vLLM's V1 model runner (its sampler/logprobs hooks); "
            "VLLM_USE_V2_MODEL_RUNNER=1 selects Model Runner V2: unset it or set it to 0"
        )
    return False


def install() -> None:
    """Wrap ``VllmConfig.use_v2_model_runner`` (idempotent)."""
    from .seams import replace

    replace(
        "vllm.config.vllm:VllmConfig.use_v2_model_runner",
        lambda original: property(
            lambda self: use_v2_model_runner(self, lambda: original.fget(self)), doc=original.__doc__
        ),
    )
