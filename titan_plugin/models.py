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

__all__ = ["build_titan_model", "hf_state_dict", "llama3_config", "load_hf_config", "load_hf_weights", "qwen3_config",
           "qwen3_moe_config", "state_dict_adapter_class", "titan_model_config"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_INIT = {"weight": lambda w: torch.nn.init.normal_(w, std=0.02), "bias": torch.nn.init.zeros_}
_ONES = {"weight": torch.nn.init.ones_}


def load_hf_config(checkpoint_dir: str | Path) -> dict:
    return json.loads((Path(checkpoint_dir) / "config.json").read_text())


def _architecture(hf: dict):
    from zerokld_plugins import get_model_adapter

    arch = (hf.get("architectures") or [""])[0]
    if hf.get("rope_scaling"):
        raise ValueError(f"rope_scaling {hf['rope_scaling']} is not supported by zerokld")
    return get_model_adapter(arch)  # UnknownNameError lists the registered architectures


def _dims(hf: dict) -> dict:
    h, nq = hf["hidden_size"], hf["num_attention_heads"]
    return {"h": h, "nq": nq, "nkv": hf.get("num_key_value_heads", nq), "hd": hf.get("head_dim") or h // nq,
            "eps": hf.get("rms_norm_eps", 1e-6), "vocab": hf["vocab_size"],
            "max_len": hf.get("max_position_embeddings", 4096), "theta": float(hf.get("rope_theta", 10000.0))}


def _moe_config(hf: dict, d: dict):
    """TorchTitan ``MoE.Config`` for a Qwen3-MoE layer (softmax router, ``route_norm = norm_topk_prob``, no shared
    expert), built as ``torchtitan.models.qwen3._build_qwen3_moe_layers`` does."""
    from torchtitan.models.common.config_utils import (make_moe_config, make_routed_experts_config,
                                                        make_router_config)

    e = hf.get("num_experts") or hf.get("num_local_experts")
    k = hf["num_experts_per_tok"]
    experts_init = {w: _INIT["weight"] for w in ("w1_EFD", "w2_EDF", "w3_EFD")}
    return make_moe_config(
        num_experts=e,
        router=make_router_config(dim=d["h"], num_experts=e, gate_param_init=_INIT, top_k=k, score_func="softmax",
                                  route_norm=bool(hf.get("norm_topk_prob", True))),
        routed_experts=make_routed_experts_config(dim=d["h"], hidden_dim=hf["moe_intermediate_size"], num_experts=e,
                                                  top_k=k, param_init=experts_init, comm_backend="standard"),
    )


def _decoder_config(hf: dict, model_cls, block_cls, rope, qk_norm: bool, head_dim, moe: bool = False):
    d = _dims(hf)

    def norm(n: int) -> RMSNorm.Config:
        return RMSNorm.Config(normalized_shape=n, eps=d["eps"], param_init=_ONES)

    layers = [
        block_cls.Config(
            attention_norm=norm(d["h"]),
            ffn_norm=norm(d["h"]),
            attention=make_gqa_config(
                dim=d["h"], n_heads=d["nq"], n_kv_heads=d["nkv"], head_dim=head_dim, wqkv_param_init=_INIT,
                wo_param_init=_INIT, inner_attention=get_attention_config("flex"), fuse_qkv=False, rope=rope,
                qk_norm=norm(d["hd"]) if qk_norm else None,
            ),
            feed_forward=None if moe else make_ffn_config(dim=d["h"], hidden_dim=hf["intermediate_size"],
                                                          w1_param_init=_INIT, w2w3_param_init=_INIT),
            moe=_moe_config(hf, d) if moe else None,
        )
        for _ in range(hf["num_hidden_layers"])
    ]
    return model_cls.Config(
        dim=d["h"], vocab_size=d["vocab"], norm=norm(d["h"]), enable_weight_tying=bool(hf.get("tie_word_embeddings")),
        tok_embeddings=Embedding.Config(num_embeddings=d["vocab"], embedding_dim=d["h"], param_init=_INIT),
        lm_head=Linear.Config(in_features=d["h"], out_features=d["vocab"], param_init=_INIT),
        layers=layers,
    )


def qwen3_config(hf: dict):
    """TorchTitan ``Qwen3Model.Config`` (stock components) for a ``Qwen3ForCausalLM`` config.

    Registered as the TorchTitan side of the ``Qwen3ForCausalLM`` model adapter (``zerokld_plugins.builtin``)."""
    from torchtitan.models.qwen3.model import Qwen3Model, Qwen3TransformerBlock

    d = _dims(hf)
    rope = CosSinRoPE.Config(dim=d["hd"], max_seq_len=d["max_len"], theta=d["theta"])
    return _decoder_config(hf, Qwen3Model, Qwen3TransformerBlock, rope, True, d["hd"])


def qwen3_moe_config(hf: dict):
    """TorchTitan ``Qwen3Model.Config`` with an MoE block in every layer, for a ``Qwen3MoeForCausalLM`` config.

    Raises:
        ValueError: dense layers mixed in (``mlp_only_layers``, ``decoder_sparse_step != 1``) or shared experts.
    """
    from torchtitan.models.qwen3.model import Qwen3Model, Qwen3TransformerBlock

    if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
        raise ValueError("zerokld Qwen3-MoE needs every layer to be MoE (mlp_only_layers=[], decoder_sparse_step=1)")
    if hf.get("shared_expert_intermediate_size"):
        raise ValueError("zerokld Qwen3-MoE does not support shared experts")
    d = _dims(hf)
    rope = CosSinRoPE.Config(dim=d["hd"], max_seq_len=d["max_len"], theta=d["theta"])
    return _decoder_config(hf, Qwen3Model, Qwen3TransformerBlock, rope, True, d["hd"], moe=True)


def llama3_config(hf: dict):
    """TorchTitan ``Llama3Model.Config`` (stock components) for a ``LlamaForCausalLM`` config.

    Raises:
        ValueError: ``head_dim * num_attention_heads != hidden_size`` (TorchTitan's llama3 derives the head size).
    """
    from torchtitan.models.llama3.model import Llama3Model, Llama3TransformerBlock

    d = _dims(hf)
    if d["hd"] * d["nq"] != d["h"]:
        raise ValueError("TorchTitan llama3 needs head_dim * num_attention_heads == hidden_size")
    rope = ComplexRoPE.Config(dim=d["hd"], max_seq_len=d["max_len"], theta=d["theta"], scaling="none")
    return _decoder_config(hf, Llama3Model, Llama3TransformerBlock, rope, False, None)


def titan_model_config(hf: dict, zerokld: bool = True, fp8: str | None = None):
    """TorchTitan model config for an HF ``config.json`` dict, built by the architecture's registered model adapter.

    Args:
        hf: the parsed ``config.json``.
        zerokld: apply the :mod:`titan_plugin.overrides` (otherwise stock TorchTitan components, flex attention).
        fp8: FP8 QAT granularity (``"per_channel"`` / ``"block"``) or ``None``; needs ``zerokld``.

    Raises:
        zerokld_plugins.UnknownNameError: no model adapter for the architecture.
        ValueError: unsupported RoPE scaling or dimensions; ``fp8`` without ``zerokld``; a quantized checkpoint
            (train from the high-precision one; export with :func:`titan_plugin.export_fp8_checkpoint`).
    """
    from zerokld_plugins import resolve

    if hf.get("quantization_config"):
        raise ValueError(f"the trainer loads high-precision checkpoints; this one is quantized "
                         f"({hf['quantization_config'].get('quant_method')})")
    if fp8 is not None and not zerokld:
        raise ValueError("FP8 QAT needs the zerokld numerics (zerokld=True)")
    cfg = resolve(_architecture(hf).titan_config)(hf)
    if zerokld:
        apply_zerokld_overrides(cfg, fp8=fp8)
    return cfg


def state_dict_adapter_class(hf: dict):
    """TorchTitan ``StateDictAdapter`` class of the architecture's registered model adapter."""
    from zerokld_plugins import resolve

    return resolve(_architecture(hf).titan_state_dict_adapter)


def _adapter(model_cfg, hf: dict, checkpoint_dir: str | Path | None):
    return state_dict_adapter_class(hf)(model_cfg, str(checkpoint_dir) if checkpoint_dir else None)


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
    for k in ref:  # MoE load-balancing bias: training state, not in HF checkpoints; keep the model's (zeros)
        if k.endswith("moe.expert_bias_E"):
            sd.setdefault(k, ref[k])
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


def build_titan_model(checkpoint_dir: str | Path, dtype: str = "float32", zerokld: bool = True,
                      fp8: str | None = None):
    """Build TorchTitan's model for an HF checkpoint directory and load its weights.

    Args:
        fp8: FP8 QAT granularity or ``None`` (see :func:`titan_model_config`).

    Returns:
        ``(model, model_config, hf_config)``; the model is on CPU in ``dtype``.
    """
    hf = load_hf_config(checkpoint_dir)
    cfg = titan_model_config(hf, zerokld=zerokld, fp8=fp8)
    with torch.device("cpu"):
        model = cfg.build()
    model.init_states(buffer_device=torch.device("cpu"))
    model.to(_DTYPES[dtype])
    load_hf_weights(model, cfg, hf, checkpoint_dir)
    return model, cfg, hf
