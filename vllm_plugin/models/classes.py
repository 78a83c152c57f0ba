"""The vLLM model class of every declared architecture, built here from its declaration
(:class:`zerokld_plugins.ModelAdapterSpec`, a ``zerokld_models/<arch>/`` folder's ``ADAPTER``).

``ZeroKLD<architecture>`` = ``(ZeroKLDMixin or ZeroKLDMoEMixin, vLLM's own class)`` with ``adapter`` = the
declaration: vLLM's model, untouched, unless the engine's zerokld switch is on; then the ``shared_numerics`` decoder
specialised by the declaration's traits (:mod:`vllm_plugin.models.dense`, :mod:`vllm_plugin.models.moe`).

vLLM registers them lazily by name (``ModelRegistry.register_model(arch, "vllm_plugin.models.classes:ZeroKLD<arch>")``,
:func:`vllm_plugin.register.register`): the class is built when vLLM first imports it (this module's
``__getattr__``), in whichever process that is, so registering imports no vLLM model module; a class pickles by
that name.
"""

from __future__ import annotations

import functools

__all__ = ["class_name", "model_class", "registered_name"]

_PREFIX = "ZeroKLD"
#: the decoder of each declared token mixer's cache kind, without and with routed MLPs (the latent decoder builds
#: each layer's MLP from the plan)
_MIXINS = {
    "paged_kv": {False: "vllm_plugin.models.dense:ZeroKLDMixin", True: "vllm_plugin.models.moe:ZeroKLDMoEMixin"},
    "latent": {False: "vllm_plugin.models.mla:ZeroKLDMLAMixin", True: "vllm_plugin.models.mla:ZeroKLDMLAMixin"},
}


def class_name(architecture: str) -> str:
    """``"ZeroKLD" + architecture`` (e.g. ``ZeroKLDQwen3ForCausalLM``)."""
    return _PREFIX + architecture


def registered_name(architecture: str) -> str:
    """What vLLM's ``ModelRegistry`` gets for ``architecture``: ``"vllm_plugin.models.classes:ZeroKLD<arch>"``."""
    return f"{__name__}:{class_name(architecture)}"


@functools.cache
def model_class(architecture: str) -> type:
    """The vLLM model class of a registered architecture (built once per process).

    Raises:
        zerokld_plugins.UnknownNameError: no ``zerokld`` model adapter declares ``architecture``.
    """
    from zerokld_models.mixers import mixer_component
    from zerokld_plugins import get_model_adapter, resolve

    spec = get_model_adapter(architecture)
    mixin = resolve(_MIXINS[mixer_component(spec).cache][spec.moe])
    base = resolve(spec.vllm_base)
    name = class_name(architecture)
    return type(
        name,
        (mixin, base),
        {
            "adapter": spec,
            "__module__": __name__,
            "__qualname__": name,
            "__doc__": f"vLLM's {base.__name__}, with zerokld numerics when the switch "
            f"is on (declared by {architecture}'s ModelAdapterSpec).",
        },
    )


def __getattr__(name: str):
    if name.startswith(_PREFIX):
        from zerokld_plugins import registered

        if name[len(_PREFIX) :] in registered("model"):
            return model_class(name[len(_PREFIX) :])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
