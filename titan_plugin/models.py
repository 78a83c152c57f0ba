"""Build TorchTitan's own ``qwen3`` / ``llama3`` models for an HF checkpoint and load its safetensors.

The model configs are made with TorchTitan's builders (``make_gqa_config``, ``make_ffn_config``, the
``Qwen3Model`` / ``Llama3Model`` configs) from the HF ``config.json``, with separate wq/wk/wv projections
(``fuse_qkv=False``: vLLM's zerokld model also projects q, k and v separately). HF weights go through TorchTitan's
``StateDictAdapter.from_hf`` (``torchtitan/models/{qwen3,llama3}/state_dict_adapter.py``), exactly as TorchTitan's
``--checkpoint.initial_load_in_hf`` does, and come back out through ``to_hf``.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear
from torchtitan.models.common.config_utils import get_attention_config, make_ffn_config, make_gqa_config
from torchtitan.models.common.nn_modules import RMSNorm

from .overrides import apply_zerokld_overrides

__all__ = ["build_titan_model", "hf_state_dict", "load_hf_config", "load_hf_weights", "titan_model_config"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_INIT = {"weight": lambda w: torch.nn.init.normal_(w, std=0.02), "bias": torch.nn.init.zeros_}
_ONES = {"weight": torch.nn.init.ones_}


def load_hf_config(checkpoint_dir: str | Path) -> dict:
    return json.loads((Path(checkpoint_dir) / "config.json").read_text())


def _family(hf: dict) -> str:
    arch = (hf.get("architectures") or [""])[0]
    fam = {"Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama3"}.get(arch)
    if fam is None:
        raise ValueError(f"unsupported architecture {arch!r}; zerokld supports Qwen3ForCausalLM, LlamaForCausalLM")
    if hf.get("rope_scaling"):
        raise ValueError(f"rope_scaling {hf['rope_scaling']} is not supported by zerokld")
    return fam


def titan_model_config(hf: dict, zerokld: bool = True):
    """TorchTitan model config (``Qwen3Model.Config`` or ``Llama3Model.Config``) for an HF ``config.json`` dict.

    Args:
        hf: the parsed ``config.json``.
        zerokld: apply the :mod:`titan_plugin.overrides` (otherwise stock TorchTitan components, flex attention).

    Raises:
        ValueError: unsupported architecture or RoPE scaling.
    """
    fam = _family(hf)
    h, nq = hf["hidden_size"], hf["num_attention_heads"]
    nkv = hf.get("num_key_value_heads", nq)
    hd = hf.get("head_dim") or h // nq
    eps = hf.get("rms_norm_eps", 1e-6)
    vocab = hf["vocab_size"]
    max_len = hf.get("max_position_embeddings", 4096)
    theta = float(hf.get("rope_theta", 10000.0))

    def norm(n: int) -> RMSNorm.Config:
        return RMSNorm.Config(normalized_shape=n, eps=eps, param_init=_ONES)

    if fam == "qwen3":
        from torchtitan.models.qwen3.model import Qwen3Model as M, Qwen3TransformerBlock as Block

        rope = CosSinRoPE.Config(dim=hd, max_seq_len=max_len, theta=theta)
        qk_norm, head_dim = norm(hd), hd
    else:
        from torchtitan.models.llama3.model import Llama3Model as M, Llama3TransformerBlock as Block

        if hd * nq != h:
            raise ValueError("TorchTitan llama3 needs head_dim * num_attention_heads == hidden_size")
        rope = ComplexRoPE.Config(dim=hd, max_seq_len=max_len, theta=theta, scaling="none")
        qk_norm, head_dim = None, None
    layers = [
        Block.Config(
            attention_norm=norm(h),
            ffn_norm=norm(h),
            attention=make_gqa_config(
                dim=h, n_heads=nq, n_kv_heads=nkv, head_dim=head_dim, wqkv_param_init=_INIT, wo_param_init=_INIT,
                inner_attention=get_attention_config("flex"), fuse_qkv=False, rope=rope, qk_norm=qk_norm,
            ),
            feed_forward=make_ffn_config(dim=h, hidden_dim=hf["intermediate_size"], w1_param_init=_INIT,
                                         w2w3_param_init=_INIT),
        )
        for _ in range(hf["num_hidden_layers"])
    ]
    cfg = M.Config(
        dim=h, vocab_size=vocab, norm=norm(h), enable_weight_tying=bool(hf.get("tie_word_embeddings", False)),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=h, param_init=_INIT),
        lm_head=Linear.Config(in_features=h, out_features=vocab, param_init=_INIT),
        layers=layers,
    )
    if zerokld:
        apply_zerokld_overrides(cfg)
    return cfg


def _adapter(model_cfg, hf: dict, checkpoint_dir: str | Path | None):
    if _family(hf) == "qwen3":
        from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter as A
    else:
        from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter as A
    return A(model_cfg, str(checkpoint_dir) if checkpoint_dir else None)


def load_hf_weights(model: torch.nn.Module, model_cfg, hf: dict, checkpoint_dir: str | Path) -> None:
    """Load ``*.safetensors`` of an HF checkpoint into a TorchTitan model (strict: every key must match).

    Raises:
        RuntimeError: missing or unexpected keys (``load_state_dict(strict=True)``).
    """
    hf_sd: dict[str, torch.Tensor] = {}
    for f in sorted(Path(checkpoint_dir).glob("*.safetensors")):
        hf_sd.update(load_file(str(f)))
    sd = _adapter(model_cfg, hf, checkpoint_dir).from_hf(hf_sd)
    ref = model.state_dict()
    sd = {k: v.to(ref[k].dtype) if k in ref else v for k, v in sd.items()}
    if model_cfg.enable_weight_tying:
        sd.setdefault("lm_head.weight", sd["tok_embeddings.weight"])
    model.load_state_dict(sd, strict=True)


def hf_state_dict(model: torch.nn.Module, model_cfg, hf: dict) -> dict[str, torch.Tensor]:
    """The model's weights under HF names (TorchTitan's ``to_hf``; DTensors gathered), detached copies."""
    from torch.distributed.tensor import DTensor

    sd = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.state_dict().items()}
    if model_cfg.enable_weight_tying:
        sd.pop("lm_head.weight", None)
    out = _adapter(model_cfg, hf, None).to_hf(sd)
    if model_cfg.enable_weight_tying:
        out.pop("lm_head.weight", None)
    return out


def build_titan_model(checkpoint_dir: str | Path, dtype: str = "float32", zerokld: bool = True):
    """Build TorchTitan's model for an HF checkpoint directory and load its weights.

    Returns:
        ``(model, model_config, hf_config)``; the model is on CPU in ``dtype``.
    """
    hf = load_hf_config(checkpoint_dir)
    cfg = titan_model_config(hf, zerokld=zerokld)
    with torch.device("cpu"):
        model = cfg.build()
    model.init_states(buffer_device=torch.device("cpu"))
    model.to(_DTYPES[dtype])
    load_hf_weights(model, cfg, hf, checkpoint_dir)
    return model, cfg, hf
