"""Trainer → rollout-engine weight sync for the example, with the snapshot protocol of :mod:`deltasync`.

:class:`DeltaSync` pushes each step's weights with :meth:`deltasync.HotLoadClient.push` — a
:class:`deltasync.SnapshotWriter` decides full (first, and every ``full_every`` steps) or ``arc_v2`` incremental
(against the last loaded snapshot), the client signals, and a refused incremental snapshot falls back to a full one.
The example's engine is an offline ``vllm.LLM`` rather than ``vllm serve``, so the signal goes to
:class:`OfflineHotLoadClient`, which does in-process what the server's hot-load manager (:mod:`vllm_plugin.hotload`)
does over HTTP: decode a delta onto the snapshot it serves (verified before anything is published), reload the
result in place, reset the prefix cache.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path

from deltasync import (HotLoadClient, HotLoadRefused, SnapshotError, SnapshotWriter, materialize_snapshot,
                       tensor_spec)
from zerokld_testing.engines import reload_weights

__all__ = ["DeltaSync", "OfflineHotLoadClient"]


class OfflineHotLoadClient(HotLoadClient):
    """A :class:`deltasync.HotLoadClient` whose replica is an offline ``vllm.LLM`` in this process."""

    def __init__(self, llm, initial_dir: Path, state_dir: Path) -> None:
        super().__init__([])
        self.llm, self.served, self.state = llm, Path(initial_dir), Path(state_dir)
        self.spec = tensor_spec(initial_dir)

    def signal(self, info) -> None:
        try:
            base = self.served if info.kind == "incremental" else None
            path = materialize_snapshot(info.path, self.state / info.identity, self.spec, base,
                                        info.compression_format)
        except SnapshotError as e:  # refused: the served weights are untouched
            raise HotLoadRefused(422, str(e)) from e
        reload_weights(self.llm, str(path))
        if self.served.parent == self.state:
            shutil.rmtree(self.served, ignore_errors=True)
        self.served = path


class DeltaSync:
    """Per-step sync; ``push`` returns the metrics the example logs."""

    def __init__(self, root: Path, dtype: str, initial_dir: Path, llm, full_every: int = 10,
                 keep_snapshots: bool = False) -> None:
        root = Path(root)
        self.dtype, self.keep_snapshots = dtype, keep_snapshots
        self.writer = SnapshotWriter(root / "snapshots", initial_dir, full_every=full_every,
                                     cache_dir=root / "writer_cache")
        self.client = OfflineHotLoadClient(llm, initial_dir, root / "replica")
        self._shipped: list[Path] = []

    def push(self, trainer, llm, step: int) -> dict:
        """Returns ``sync_kind``, ``sync_bytes`` (shipped), ``full_bytes``, ``delta_density``, ``swap_seconds``
        (signal to ready), ``sync_seconds`` (write + swap), ``sync_refused`` (fallbacks)."""
        t0 = time.perf_counter()
        res = self.client.push(self.writer, f"step-{step:05d}", trainer.hf_weights(self.dtype))
        info = res.snapshot
        self._shipped.append(info.path)
        while len(self._shipped) > 2 and not self.keep_snapshots:  # the replica holds its own copy
            shutil.rmtree(self._shipped.pop(0), ignore_errors=True)
        return {"sync_kind": info.kind, "sync_bytes": info.bytes, "full_bytes": info.full_bytes,
                "delta_density": info.density, "swap_seconds": res.swap_seconds,
                "sync_seconds": time.perf_counter() - t0, "sync_refused": len(res.refused)}
