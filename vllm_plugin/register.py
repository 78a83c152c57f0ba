"""vLLM general-plugin entry point (``vllm.general_plugins`` → ``vllm_plugin.register:register``).

vLLM calls ``register()`` in every process it starts (API server, engine core, each worker), possibly more than
once, before any model is built (``vllm/plugins/__init__.py``: ``load_general_plugins``). It only registers names;
nothing changes until a model is built with ``additional_config={"zerokld": {"batch_invariant": true}}``:

* the architectures in :data:`vllm_plugin.models.SUPPORTED_ARCHITECTURES` point to classes that build the stock vLLM
  model when the flag is off and the ``shared_numerics`` model when it is on;
* the attention backend name ``ZEROKLD_ATTN`` is registered for those models' ``Attention`` layers.
"""
from __future__ import annotations

_REGISTERED = False


def register() -> None:
    """Idempotently register the zerokld model classes and attention backend with vLLM."""
    global _REGISTERED
    if _REGISTERED:
        return
    from vllm import ModelRegistry
    from vllm.v1.attention.backends.registry import register_backend

    from .attention_backend import BACKEND_NAME
    from .models import SUPPORTED_ARCHITECTURES

    register_backend(BACKEND_NAME, "vllm_plugin.attention_backend.ZeroKLDAttentionBackend")
    for arch, path in SUPPORTED_ARCHITECTURES.items():
        ModelRegistry.register_model(arch, path)
    _REGISTERED = True
