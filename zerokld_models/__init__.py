"""Model architectures, one folder each (TorchTitan's ``models/<arch>/`` style).

``zerokld_models/<arch>/`` declares an HF architecture (``ADAPTER``, a :class:`zerokld_plugins.ModelAdapterSpec`):
where vLLM's and TorchTitan's stock classes, state-dict adapter and parallelize function are, the checkpoint names the
stock adapter lacks, and the traits (RoPE kind, head size, QK-norm, q/k/v bias, MoE). It imports neither plugin nor
any host library; each plugin builds its side from the declaration
(:class:`vllm_plugin.models.model.ZeroKLDForCausalLM`, :func:`titan_plugin.models.architecture_config`). What every
architecture shares lives here once: the HF-config reader (:mod:`.config`), the per-layer plan of token mixers and MLPs
(:mod:`.plan`), the support check
(:mod:`.support`), checkpoint files (:mod:`.checkpoint`). Adding an
architecture = one folder + one line in :mod:`.hooks`.
"""

from .config import ModelConfig, indexer_dims, mla_dims, mla_softmax_scale, read_model_config, topk_sources
from .plan import Layer, dense_prefix, latent_cache, layer_plan
from .support import UnsupportedModelError, check_supported, unsupported_features

__all__ = [
    "Layer",
    "ModelConfig",
    "UnsupportedModelError",
    "adapter_for",
    "check_supported",
    "dense_prefix",
    "indexer_dims",
    "latent_cache",
    "layer_plan",
    "mla_dims",
    "mla_softmax_scale",
    "read_model_config",
    "topk_sources",
    "unsupported_features",
]


def adapter_for(cfg: ModelConfig):
    """The registered :class:`zerokld_plugins.ModelAdapterSpec` of ``cfg.architecture``.

    Raises:
        zerokld_plugins.UnknownNameError: no architecture folder registers it (the message lists those that do).
    """
    from zerokld_plugins import get_model_adapter

    return get_model_adapter(cfg.architecture)
