"""Model architectures, one folder each (TorchTitan's ``models/<arch>/`` style).

``zerokld_models/<arch>/`` holds everything an HF architecture needs on both sides: its registration
(``ADAPTER``, a :class:`zerokld_plugins.ModelAdapterSpec` with the architecture's traits), the vLLM model class
(``vllm.py``) and the TorchTitan config builder, state-dict adapter and parallelize function (``titan.py``). What
every architecture shares lives here once: the HF-config reader (:mod:`.config`), the support check
(:mod:`.support`); the generic decoders they specialise live in the plugins (``vllm_plugin.models``,
``titan_plugin.models``). Adding an architecture = one folder + one line in :mod:`.hooks`.
"""
from .config import ModelConfig, read_model_config
from .support import UnsupportedModelError, check_supported, unsupported_features

__all__ = ["ModelConfig", "UnsupportedModelError", "adapter_for", "check_supported", "read_model_config",
           "unsupported_features"]


def adapter_for(cfg: ModelConfig):
    """The registered :class:`zerokld_plugins.ModelAdapterSpec` of ``cfg.architecture``.

    Raises:
        zerokld_plugins.UnknownNameError: no architecture folder registers it (the message lists those that do).
    """
    from zerokld_plugins import get_model_adapter

    return get_model_adapter(cfg.architecture)
