"""Trainer → rollout-engine weight sync for the example, with the snapshot protocol of :mod:`deltasync`.

:class:`DeltaSync` writes each step's weights with a :class:`deltasync.SnapshotWriter` (full first and every
``full_every`` steps, ``arc_v2`` incremental snapshots against the last loaded one in between) and hands them to
:class:`OfflineReplica`, which does for the example's offline ``vllm.LLM`` what the server-side hot-load manager
(:mod:`vllm_plugin.hotload`) does for ``vllm serve``: decode a delta onto the snapshot it serves (verified before
anything is published), reload the result in place, reset the prefix cache. A refused incremental snapshot falls
back to a full one, as :class:`deltasync.HotLoadClient` does over HTTP.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path

from deltasync import SnapshotWriter, apply_incremental_snapshot, tensor_spec, verify_full_snapshot
from zerokld_testing.engines import reload_weights

__all__ = ["DeltaSync", "OfflineReplica"]


class OfflineReplica:
    """Loads full or incremental snapshots into an offline ``vllm.LLM`` (served weights start at ``initial_dir``)."""

    def __init__(self, llm, initial_dir: Path, state_dir: Path) -> None:
        self.llm, self.served, self.state = llm, Path(initial_dir), Path(state_dir)
        self.spec = tensor_spec(initial_dir)

    def load(self, info) -> float:
        """Returns the swap time in seconds (decode + verify + reload + cache reset)."""
        t0 = time.perf_counter()
        if info.kind == "incremental":
            path = self.state / info.identity
            apply_incremental_snapshot(self.served, info.path, path, info.compression_format)
        else:
            path = info.path
        verify_full_snapshot(path, self.spec)
        reload_weights(self.llm, str(path))
        if self.served.parent == self.state:
            shutil.rmtree(self.served, ignore_errors=True)
        self.served = path
        return time.perf_counter() - t0


class DeltaSync:
    """Per-step sync; ``push`` returns the metrics the example logs."""

    def __init__(self, root: Path, dtype: str, initial_dir: Path, llm, full_every: int = 10,
                 keep_snapshots: bool = False) -> None:
        root = Path(root)
        self.keep_snapshots = keep_snapshots
        self.dtype = dtype
        self.writer = SnapshotWriter(root / "snapshots", initial_dir, full_every=full_every,
                                     cache_dir=root / "writer_cache")
        self.replica = OfflineReplica(llm, initial_dir, root / "replica")
        self._shipped: list[Path] = []

    def push(self, trainer, llm, step: int) -> dict:
        """Returns ``sync_kind``, ``sync_bytes`` (shipped), ``full_bytes``, ``delta_density``, ``swap_seconds``,
        ``sync_seconds`` (write + swap)."""
        t0 = time.perf_counter()
        weights = trainer.hf_weights(self.dtype)
        info = self.writer.write(f"step-{step:05d}", weights)
        try:
            swap = self.replica.load(info)
        except ValueError:  # refused (DeltaError / SnapshotError): fall back to a full snapshot
            self.writer.failed(info)
            info = self.writer.write(f"step-{step:05d}-full", weights, kind="full")
            swap = self.replica.load(info)
        self.writer.confirm(info)
        self._shipped.append(info.path)
        while len(self._shipped) > 2 and not self.keep_snapshots:  # the replica has its own copy; old shipped snapshots can go
            shutil.rmtree(self._shipped.pop(0), ignore_errors=True)
        return {"sync_kind": info.kind, "sync_bytes": info.bytes, "full_bytes": info.full_bytes,
                "delta_density": info.density, "swap_seconds": swap, "sync_seconds": time.perf_counter() - t0}
