"""TorchTitan ``Llama3Model.Config`` (stock components; ``ComplexRoPE`` with Llama 3.x scaling when the checkpoint
has it)."""
from titan_plugin.models import complex_rope, decoder_config
from zerokld_models.config import ModelConfig


def titan_config(cfg: ModelConfig):
    """Raises:
        ValueError: ``head_dim * num_attention_heads != hidden_size`` (TorchTitan's llama3 derives the head size)."""
    from torchtitan.models.llama3.model import Llama3Model, Llama3TransformerBlock

    if cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
        raise ValueError("TorchTitan llama3 needs head_dim * num_attention_heads == hidden_size")
    return decoder_config(cfg, Llama3Model, Llama3TransformerBlock, complex_rope(cfg), qk_norm=False,
                          head_dim=None)
