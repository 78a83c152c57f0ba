"""vLLM-CPU's MLA scheduling overrides, skipped for zerokld MLA engines.

For a model vLLM serves with its own MLA (``ModelConfig.use_mla``: DeepSeek-V2/V3, Kimi, GLM-MoE), vLLM-CPU without
AMX forces ``block_size`` 16, turns chunked prefill and prefix caching off and raises ``max_num_batched_tokens`` to the
model length (``platforms/cpu.py`` ``CpuPlatform.check_and_update_config``: its reference MLA decode kernel needs
that). A zerokld engine serves those models with its own latent attention
(:class:`vllm_plugin.attention_backend.ZeroKLDLatentAttentionBackend`), which takes any block size that is a multiple of
16, chunked prefill and prefix-cache hits — so for an engine with ``batch_invariant`` on whose checkpoint has layers
with a latent cache (:func:`zerokld_models.layer_plan`), those four settings come out of the platform's pass as they
would for a model without MLA: the user's values, and the CPU default block size 128 when none was given. Every other
engine — stock DeepSeek included — gets vLLM's own pass unchanged.
"""

from __future__ import annotations

__all__ = ["CPU_DEFAULT_BLOCK_SIZE", "install", "zerokld_latent_engine"]

_TARGET = "vllm.platforms.cpu:CpuPlatform.check_and_update_config"
#: vLLM-CPU's block size when the user gives none (``platforms/cpu.py``, the branch for models without MLA)
CPU_DEFAULT_BLOCK_SIZE = 128


def zerokld_latent_engine(vllm_config) -> bool:
    """Whether ``vllm_config`` is a zerokld engine (``batch_invariant`` on) whose checkpoint has a layer with a latent
    cache (:func:`zerokld_models.layer_plan`: MLA, DSA)."""
    from zerokld_models import latent_cache, layer_plan, read_model_config
    from zerokld_plugins import registered

    from .config import ZeroKLDConfigError, from_vllm_config

    try:
        if not from_vllm_config(vllm_config).batch_invariant:
            return False
    except ZeroKLDConfigError:
        return False  # the model constructor refuses the engine with the message
    mc = vllm_config.model_config
    archs = (getattr(mc.hf_config, "architectures", None) or []) if mc is not None else []
    adapters = registered("model")
    if not archs or archs[0] not in adapters:
        return False
    try:
        cfg = read_model_config(mc.hf_config)
    except (KeyError, TypeError, ValueError):
        return False  # the model constructor refuses the engine with the message
    return latent_cache(layer_plan(cfg, adapters[archs[0]].spec))


def install() -> None:
    """Wrap ``CpuPlatform.check_and_update_config`` (idempotent)."""
    from .seams import replace

    def make(original):
        def check_and_update_config(cls, vllm_config) -> None:
            if not zerokld_latent_engine(vllm_config):
                return original(vllm_config)
            cache, sched = vllm_config.cache_config, vllm_config.scheduler_config
            before = (
                cache.block_size if cache.user_specified_block_size else CPU_DEFAULT_BLOCK_SIZE,
                sched.enable_chunked_prefill,
                cache.enable_prefix_caching,
                sched.max_num_batched_tokens,
            )
            original(vllm_config)
            (
                cache.block_size,
                sched.enable_chunked_prefill,
                cache.enable_prefix_caching,
                sched.max_num_batched_tokens,
            ) = before

        return classmethod(check_and_update_config)

    replace(_TARGET, make)
