"""TorchTitan ``Qwen3Model.Config`` with an MoE block in every layer (stock components)."""
from titan_plugin.models import cos_sin_rope, decoder_config
from zerokld_models.config import ModelConfig


def titan_config(cfg: ModelConfig):
    from torchtitan.models.qwen3.model import Qwen3Model, Qwen3TransformerBlock

    return decoder_config(cfg, Qwen3Model, Qwen3TransformerBlock, cos_sin_rope(cfg), qk_norm=True, moe=True)
