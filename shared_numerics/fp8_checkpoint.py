"""The FP8 serving checkpoint: an HF directory whose decoder linears hold :mod:`shared_numerics.fp8` codes.

Layout (same file names and tensor names as the high-precision checkpoint it was made from):

* ``config.json`` gains ``"quantization_config": {"quant_method": "zerokld_fp8", "fmt": "e4m3",
  "activation_scheme": "dynamic", "granularity": "per_channel" | "block", "weight_block_size": [128, 128] | null,
  "modules_to_not_convert": ["lm_head", "embed_tokens", "norm"]}`` — the HF ``quantization_config`` convention
  (``transformers`` ``FineGrainedFP8Config`` / vLLM ``Fp8Config`` use the same keys for the same meanings).
* each decoder projection ``…{q,k,v,o,gate,up,down}_proj.weight`` is stored as ``float8_e4m3fn`` ``[N, K]`` codes,
  with ``…_proj.weight_scale`` (float32, ``[N]`` per channel, ``[ceil(N/128), ceil(K/128)]`` per block) next to it;
  every other tensor (embeddings, norms, lm_head) is copied unchanged.

vLLM serves it with the zerokld plugin (``vllm_plugin.fp8`` registers ``zerokld_fp8`` with vLLM's quantization
registry); codes and scales are exactly what online quantization of the source checkpoint computes.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .fp8 import BLOCK, GRANULARITIES, Fp8QuantizationError, quantize_fp8_weight

__all__ = ["FP8_PROJECTIONS", "QUANT_METHOD", "export_fp8_checkpoint", "is_fp8_projection", "parse_quantization_config",
           "quantization_config"]

QUANT_METHOD = "zerokld_fp8"
FP8_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def is_fp8_projection(name: str) -> bool:
    """Whether HF tensor ``name`` is a decoder projection weight that FP8 mode quantizes."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in FP8_PROJECTIONS and ".layers." in name


def quantization_config(granularity: str = "per_channel") -> dict:
    """The ``config.json`` ``quantization_config`` block for ``granularity``."""
    if granularity not in GRANULARITIES:
        raise Fp8QuantizationError(f"unknown FP8 granularity {granularity!r}; expected one of {GRANULARITIES}")
    return {"quant_method": QUANT_METHOD, "fmt": "e4m3", "activation_scheme": "dynamic", "granularity": granularity,
            "weight_block_size": [BLOCK, BLOCK] if granularity == "block" else None,
            "modules_to_not_convert": ["lm_head", "embed_tokens", "norm"]}


def parse_quantization_config(cfg: dict) -> str:
    """Validate a ``zerokld_fp8`` ``quantization_config`` and return its granularity.

    Raises:
        Fp8QuantizationError: another method, or a field this format does not define.
    """
    if cfg.get("quant_method") != QUANT_METHOD:
        raise Fp8QuantizationError(f"not a {QUANT_METHOD} checkpoint: quant_method={cfg.get('quant_method')!r}")
    if cfg.get("fmt", "e4m3") != "e4m3" or cfg.get("activation_scheme", "dynamic") != "dynamic":
        raise Fp8QuantizationError(f"{QUANT_METHOD} supports fmt=e4m3 with dynamic activations only, got {cfg}")
    granularity = cfg.get("granularity", "per_channel")
    if granularity not in GRANULARITIES:
        raise Fp8QuantizationError(f"unknown FP8 granularity {granularity!r}; expected one of {GRANULARITIES}")
    expected = [BLOCK, BLOCK] if granularity == "block" else None
    if cfg.get("weight_block_size") not in (expected, tuple(expected) if expected else None):
        raise Fp8QuantizationError(f"weight_block_size {cfg.get('weight_block_size')} does not match {granularity}")
    return granularity


def export_fp8_checkpoint(src_dir: str | Path, out_dir: str | Path, granularity: str = "per_channel") -> Path:
    """Write the FP8 serving checkpoint of an HF checkpoint (as the trainer saves it, in the serving dtype).

    Args:
        src_dir: HF directory (``config.json`` + ``*.safetensors`` + tokenizer files), float32 or bfloat16 weights —
            the values the QAT forward fake-quantizes (bf16 training: the bf16 checkpoint).
        out_dir: created (must not exist or be empty).
        granularity: ``"per_channel"`` or ``"block"``.

    Returns:
        ``out_dir`` as a ``Path``.

    Raises:
        FileExistsError: ``out_dir`` holds files. Fp8QuantizationError: non-finite weights, bad granularity, or
        ``src_dir`` already quantized.
    """
    src, out = Path(src_dir), Path(out_dir)
    cfg = json.loads((src / "config.json").read_text())
    if cfg.get("quantization_config"):
        raise Fp8QuantizationError(f"{src} is already quantized ({cfg['quantization_config'].get('quant_method')})")
    cfg["quantization_config"] = quantization_config(granularity)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty")
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy2(f, out / f.name)
    for f in sorted(src.glob("*.safetensors")):
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(f), framework="pt") as fh:
            meta = fh.metadata()
            for name in fh.keys():
                t = fh.get_tensor(name)
                if is_fp8_projection(name):
                    q, s = quantize_fp8_weight(t, granularity)
                    tensors[name], tensors[name + "_scale"] = q, s
                else:
                    tensors[name] = t
        save_file(tensors, str(out / f.name), metadata=meta)
    index = out / "model.safetensors.index.json"
    if index.exists():  # sharded: the scales live in their weight's shard
        idx = json.loads(index.read_text())
        wm = idx.get("weight_map", {})
        wm.update({k + "_scale": v for k, v in list(wm.items()) if is_fp8_projection(k)})
        index.write_text(json.dumps(idx, indent=2))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
