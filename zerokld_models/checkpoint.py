"""The one reader and writer of Hugging Face checkpoint directories (``config.json``, ``*.safetensors`` shards,
``model.safetensors.index.json``, tokenizer and generation files).

Used by the snapshot protocol (:func:`deltasync.write_full_snapshot`), the FP8 export
(:func:`zerokld_models.fp8_export.export_fp8_checkpoint`), TorchTitan loading
(:func:`titan_plugin.models.load_hf_weights`) and the test factory (:func:`zerokld_testing.make_tiny_checkpoint`). Every
write is atomic: the directory is built as ``<out>.tmp`` and renamed over ``<out>`` only when complete, so a reader
(vLLM's loader, a replica) never sees half a checkpoint. Layout: HF ``transformers`` ``save_pretrained``
(``safetensors`` shards; an index with ``weight_map`` when there is more than one shard).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "FLOAT32_TENSORS",
    "INDEX_FILE",
    "STAGING_DIR",
    "copy_assets",
    "held_dtype",
    "iter_shards",
    "publish_atomically",
    "read_config",
    "read_tensors",
    "shard_files",
    "staged_dir",
    "staging_path",
    "weights_file",
    "write_checkpoint",
]

INDEX_FILE = "model.safetensors.index.json"
#: a PEFT LoRA adapter directory: ``adapter_config.json`` + ``adapter_model.safetensors`` (PEFT ``save_pretrained``;
#: what vLLM's ``LoRAModel.from_local_checkpoint`` reads)
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: the hidden directory beside published ones where they are assembled and retired; a hot-load snapshot identity
#: never starts with ``.``, so no published name can collide with a staging one
STAGING_DIR = ".staging"


def staging_path(out: str | Path, kind: str = "tmp") -> Path:
    """Where ``out`` is assembled (``kind="tmp"``), moved aside while replaced (``"old"``) or downloaded into across
    interruptions (``"part"``, :func:`deltasync.fetch_dir`): ``<parent>/.staging/<name>.<kind>`` (the staging
    directory is created)."""
    out = Path(out)
    (out.parent / STAGING_DIR).mkdir(parents=True, exist_ok=True)
    return out.parent / STAGING_DIR / f"{out.name}.{kind}"


WEIGHT_SUFFIX = ".safetensors"

#: HF tensor-name suffixes that the served and the trained model hold in float32 whatever dtype the checkpoint stores
#: them in: DeepSeekMoE's selection bias (vLLM's ``DeepseekV2MoE`` and zerokld's gate hold a float32
#: ``e_score_correction_bias`` parameter; TorchTitan's ``expert_bias_E`` is a float32 buffer its load balancing
#: updates). A snapshot carries them in float32, the trainer's bits; a delta encodes and decodes them against float32.
FLOAT32_TENSORS = (".e_score_correction_bias",)
_NARROW_FLOATS = {"BF16": "F32", "F16": "F32", torch.bfloat16: torch.float32, torch.float16: torch.float32}


def held_dtype(name: str, stored):
    """The dtype the models hold checkpoint tensor ``name`` in when a checkpoint stores it as ``stored`` (a torch
    dtype, or a safetensors dtype name such as ``"BF16"``; the result is of the same kind): float32 for a bf16 / fp16
    tensor named in :data:`FLOAT32_TENSORS` (an exact widening), else ``stored``."""
    if name.endswith(FLOAT32_TENSORS):
        return _NARROW_FLOATS.get(stored, stored)
    return stored


def read_config(checkpoint_dir: str | Path) -> dict:
    """``config.json`` as a dict. Raises FileNotFoundError when absent."""
    path = Path(checkpoint_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{checkpoint_dir} has no config.json")
    return json.loads(path.read_text())


def weights_file(checkpoint_dir: str | Path) -> str:
    """The single-shard weights file name a directory of this kind uses: ``model.safetensors`` for a model checkpoint
    (``config.json``), ``adapter_model.safetensors`` for a PEFT adapter (``adapter_config.json``).

    Raises:
        FileNotFoundError: neither file is there."""
    d = Path(checkpoint_dir)
    if (d / "config.json").is_file():
        return "model" + WEIGHT_SUFFIX
    if (d / ADAPTER_CONFIG).is_file():
        return ADAPTER_WEIGHTS
    raise FileNotFoundError(f"{d.name} has neither config.json nor {ADAPTER_CONFIG}")


def shard_files(checkpoint_dir: str | Path) -> list[Path]:
    """The ``*.safetensors`` shards, sorted by name."""
    return sorted(Path(checkpoint_dir).glob("*" + WEIGHT_SUFFIX))


def read_tensors(checkpoint_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of every shard (CPU, stored dtype)."""
    out: dict[str, torch.Tensor] = {}
    for f in shard_files(checkpoint_dir):
        out.update(load_file(str(f)))
    return out


def iter_shards(checkpoint_dir: str | Path) -> Iterator[tuple[str, dict[str, torch.Tensor], dict | None]]:
    """``(file name, tensors, safetensors metadata)`` per shard, one shard in memory at a time."""
    for f in shard_files(checkpoint_dir):
        with safe_open(str(f), framework="pt") as fh:
            yield f.name, {name: fh.get_tensor(name) for name in fh.keys()}, fh.metadata()


def copy_assets(src_dir: str | Path, out_dir: str | Path, skip: set[str] | frozenset = frozenset()) -> None:
    """Copy every non-weight file of ``src_dir`` (config, tokenizer, generation config, ...) except the index and
    ``skip``."""
    for f in sorted(Path(src_dir).iterdir()):
        if f.is_file() and not f.name.endswith(WEIGHT_SUFFIX) and f.name != INDEX_FILE and f.name not in skip:
            shutil.copy2(f, Path(out_dir) / f.name)


def publish_atomically(tmp: Path, out: Path) -> Path:
    """Rename the complete directory ``tmp`` to ``out`` (an existing ``out`` is replaced)."""
    if out.exists():
        old = staging_path(out, "old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)
    return out


@contextmanager
def staged_dir(out: str | Path) -> Iterator[Path]:
    """An empty staging directory for ``out`` (:func:`staging_path`): published over ``out``
    (:func:`publish_atomically`) when the ``with`` block completes, removed if it raises."""
    out = Path(out)
    tmp = staging_path(out)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish_atomically(tmp, out)


def write_checkpoint(
    out_dir: str | Path,
    shards: dict[str, dict[str, torch.Tensor]],
    *,
    assets_dir: str | Path | None = None,
    config: dict | None = None,
    metadata: dict[str, dict | None] | None = None,
    skip_assets: set[str] | frozenset = frozenset(),
    finalize: Callable[[Path], None] | None = None,
) -> Path:
    """Write an HF checkpoint directory atomically.

    Args:
        out_dir: the directory to publish (replaced if it exists).
        shards: file name (``model.safetensors``, ``model-00001-of-00002.safetensors``) → HF name → tensor (any
            device; copied to CPU, made contiguous). More than one shard also writes ``model.safetensors.index.json``.
        assets_dir: a checkpoint whose non-weight files are copied (:func:`copy_assets`), or ``None``.
        config: written as ``config.json`` (after the assets: it wins over a copied one), or ``None``.
        metadata: per shard, safetensors header metadata (default ``{"format": "pt"}``).
        skip_assets: asset file names not to copy.
        finalize: called with the temporary directory before it is published (extra files, e.g. a spec).

    Returns:
        ``Path(out_dir)``.

    Raises:
        ValueError: no shard, or a tensor name in two shards.
    """
    if not shards:
        raise ValueError("a checkpoint needs at least one shard")
    with staged_dir(out_dir) as tmp:
        if assets_dir is not None:
            copy_assets(assets_dir, tmp, skip_assets)
        weight_map: dict[str, str] = {}
        for fname, tensors in shards.items():
            for name in tensors:
                if name in weight_map:
                    raise ValueError(f"tensor {name} in two shards ({weight_map[name]}, {fname})")
                weight_map[name] = fname
            meta = (metadata or {}).get(fname) or {"format": "pt"}
            save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp / fname), metadata=meta)
        if len(shards) > 1:
            size = sum(f.stat().st_size for f in shard_files(tmp))
            (tmp / INDEX_FILE).write_text(
                json.dumps({"metadata": {"total_size": size}, "weight_map": dict(sorted(weight_map.items()))}, indent=2)
            )
        if config is not None:
            (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if finalize is not None:
            finalize(tmp)
    return Path(out_dir)
