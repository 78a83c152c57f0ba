"""Full snapshots: an HF checkpoint directory (config, tokenizer files, ``model.safetensors``), published atomically.

Layout follows HF ``transformers`` checkpoints so vLLM loads a snapshot like any model directory. The directory is
assembled under a temporary name beside the target and renamed into place, so a reader never sees a half-written
snapshot.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

__all__ = ["write_full_snapshot"]

_WEIGHT_FILES = (".safetensors",)
_SKIP = {"model.safetensors.index.json"}


def write_full_snapshot(hf_state_dict: dict[str, torch.Tensor], assets_dir: str | Path, out_dir: str | Path,
                        dtype: torch.dtype | None = None) -> Path:
    """Write ``hf_state_dict`` as ``out_dir/model.safetensors`` plus every non-weight file of ``assets_dir``.

    Args:
        hf_state_dict: HF parameter names → tensors (any device; copied to CPU, made contiguous).
        assets_dir: a checkpoint directory whose ``config.json``, tokenizer and generation files are copied.
        out_dir: the snapshot directory to publish; replaced if it exists.
        dtype: cast every tensor to this dtype (``None``: keep).

    Returns:
        ``Path(out_dir)``.

    Raises:
        FileNotFoundError: ``assets_dir`` has no ``config.json``.
    """
    src, out = Path(assets_dir), Path(out_dir)
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{src} has no config.json")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(_WEIGHT_FILES) and f.name not in _SKIP:
            shutil.copy2(f, tmp / f.name)
    tensors = {k: (v.to(dtype) if dtype is not None else v).detach().cpu().contiguous()
               for k, v in hf_state_dict.items()}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    if out.exists():
        old = out.with_name(out.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)
    return out
