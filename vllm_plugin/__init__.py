"""zerokld's vLLM plugin: batch-invariant models on ``shared_numerics``, switched on via ``additional_config``."""

from .config import ZeroKLDConfig, ZeroKLDConfigError

__all__ = ["ZeroKLDConfig", "ZeroKLDConfigError"]
