"""Trainer → rollout-engine weight sync for the example: a full HF snapshot per step, loaded in place.

This is the seam the delta hot-load work replaces (incremental snapshots, HTTP signal, ledger); the example only
calls :meth:`FullSnapshotSync.push`.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path

from zerokld_testing.engines import reload_weights

__all__ = ["FullSnapshotSync"]


class FullSnapshotSync:
    """Writes ``<root>/step_<k>/`` (HF layout) from the trainer and reloads it into the vLLM engine; keeps the last
    ``keep`` snapshots on disk."""

    def __init__(self, root: str | Path, dtype: str, keep: int = 2) -> None:
        self.root = Path(root)
        self.dtype = dtype
        self.keep = keep
        self._written: list[Path] = []

    def push(self, trainer, llm, step: int) -> dict:
        """Returns ``{"sync_bytes": int, "sync_seconds": float}``."""
        t0 = time.perf_counter()
        snap = trainer.save_hf(self.root / f"step_{step:05d}", self.dtype)
        reload_weights(llm, str(snap))
        self._written.append(snap)
        while len(self._written) > self.keep:
            shutil.rmtree(self._written.pop(0), ignore_errors=True)
        size = sum(f.stat().st_size for f in snap.glob("*.safetensors"))
        return {"sync_bytes": size, "sync_seconds": time.perf_counter() - t0}
