"""Trainer → rollout-engine weight sync for the example, through the same protocol and replica as a server.

:class:`DeltaSync` pushes each step's weights with :meth:`deltasync.HotLoadClient.push`: a
:class:`deltasync.SnapshotWriter` decides full (first, and every ``full_every`` steps) or ``arc_v2`` incremental
(against the last loaded snapshot) and stamps the trainer's numerics mode into each snapshot; the signal goes to a
:class:`vllm_plugin.hotload.offline.OfflineReplica` — :class:`deltasync.Replica` over the example's offline
``vllm.LLM`` — which checks the ledger (replay, chain), the numerics stamp against the engine's, verifies/decodes
the snapshot before anything is swapped, reloads in place and resets the prefix cache. A refused incremental
snapshot falls back to a full one.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path

from deltasync import HotLoadClient, HotLoadConfig, HotLoadError, HotLoadRefused, SnapshotWriter

__all__ = ["DeltaSync", "OfflineHotLoadClient"]


class OfflineHotLoadClient(HotLoadClient):
    """A :class:`deltasync.HotLoadClient` whose one replica is in this process (no HTTP)."""

    def __init__(self, replica) -> None:
        super().__init__([])
        self.replica = replica

    def signal(self, info) -> None:
        try:
            self.replica.load(self.signal_for(info))
        except HotLoadError as e:  # refused: the served weights are untouched
            raise HotLoadRefused(e.status, str(e)) from e


class DeltaSync:
    """Per-step sync; ``push`` returns the metrics the example logs; ``identity`` is the snapshot serving."""

    def __init__(self, root: Path, dtype: str, initial_dir: Path, llm, full_every: int = 10,
                 keep_snapshots: bool = False, numerics=None) -> None:
        from vllm_plugin.hotload.offline import OfflineReplica

        root = Path(root)
        self.dtype, self.keep_snapshots = dtype, keep_snapshots
        self.writer = SnapshotWriter(root / "snapshots", initial_dir, full_every=full_every,
                                     cache_dir=root / "writer_cache", numerics=numerics)
        self.replica = OfflineReplica(llm, HotLoadConfig(snapshot_root=str(root / "snapshots"),
                                                         state_dir=str(root / "replica")), initial_dir)
        self.client = OfflineHotLoadClient(self.replica)
        self._shipped: list[Path] = []

    @property
    def identity(self) -> str:
        return self.replica.ledger.current_identity

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
