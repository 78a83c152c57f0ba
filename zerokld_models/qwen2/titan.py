"""TorchTitan for Qwen2/Qwen2.5: TorchTitan's Qwen3 model without QK-norm, with biased q/k/v projections."""
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

from titan_plugin.models import cos_sin_rope, decoder_config
from zerokld_models.config import ModelConfig


def titan_config(cfg: ModelConfig):
    from torchtitan.models.qwen3.model import Qwen3Model, Qwen3TransformerBlock

    return decoder_config(cfg, Qwen3Model, Qwen3TransformerBlock, cos_sin_rope(cfg), qk_norm=False, qkv_bias=True)


class Qwen2StateDictAdapter(Qwen3StateDictAdapter):
    """TorchTitan's Qwen3 adapter plus the q/k/v biases (``model.layers.N.self_attn.{q,k,v}_proj.bias``)."""

    def __init__(self, model_config, hf_assets_path):
        super().__init__(model_config, hf_assets_path)
        for hf, tt in (("q", "wq"), ("k", "wk"), ("v", "wv")):
            self.from_hf_map[f"model.layers.{{}}.self_attn.{hf}_proj.bias"] = f"layers.{{}}.attention.qkv_linear.{tt}.bias"
