"""Export the FP8 serving checkpoint (format: :mod:`shared_numerics.fp8_checkpoint`) of an HF checkpoint, through
the one checkpoint writer (:func:`zerokld_models.checkpoint.write_checkpoint`: atomic, shards and index kept)."""

from __future__ import annotations

from pathlib import Path

from shared_numerics.fp8 import Fp8QuantizationError, Granularity, quantize_fp8_weight
from shared_numerics.fp8_checkpoint import is_fp8_projection, quantization_config

from .checkpoint import iter_shards, read_config, write_checkpoint

__all__ = ["export_fp8_checkpoint"]


def export_fp8_checkpoint(src_dir: str | Path, out_dir: str | Path, granularity: Granularity = "per_channel") -> Path:
    """Write the FP8 serving checkpoint of an HF checkpoint (as the trainer saves it, in the serving dtype).

    Args:
        src_dir: HF directory (``config.json`` + ``*.safetensors`` + tokenizer files), float32 or bfloat16 weights —
            the values the QAT forward fake-quantizes (bf16 training: the bf16 checkpoint).
        out_dir: created (must not exist or be empty); published atomically.
        granularity: ``"per_channel"`` or ``"block"``.

    Returns:
        ``out_dir`` as a ``Path``.

    Raises:
        FileExistsError: ``out_dir`` holds files. Fp8QuantizationError: non-finite weights, bad granularity, or
        ``src_dir`` already quantized.
    """
    src, out = Path(src_dir), Path(out_dir)
    cfg = read_config(src)
    if cfg.get("quantization_config"):
        raise Fp8QuantizationError(f"{src} is already quantized ({cfg['quantization_config'].get('quant_method')})")
    cfg["quantization_config"] = quantization_config(granularity)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty")
    shards, metadata = {}, {}
    for fname, tensors, meta in iter_shards(src):  # the scales live in their weight's shard
        quantized = {}
        for name, t in tensors.items():
            if is_fp8_projection(name):
                quantized[name], quantized[name + "_scale"] = quantize_fp8_weight(t, granularity)
            else:
                quantized[name] = t
        shards[fname], metadata[fname] = quantized, meta
    return write_checkpoint(out, shards, assets_dir=src, config=cfg, metadata=metadata)
