"""Trainer → rollout-engine weight sync for the example, through the same protocol and replica as a server.

:class:`DeltaSync` pushes each step's weights with :meth:`deltasync.HotLoadClient.push`: a
:class:`deltasync.SnapshotWriter` decides full (first, and every ``full_every`` steps) or ``arc_v2`` incremental
(against the last loaded snapshot) and stamps the trainer's numerics mode into each snapshot; the signal goes to a
:class:`vllm_plugin.hotload.offline.OfflineReplica` — :class:`deltasync.Replica` over the example's offline
``vllm.LLM`` — which checks the ledger (replay, chain), the numerics stamp against the engine's, verifies/decodes
the snapshot before anything is swapped, reloads in place and resets the prefix cache — or, with ``--server``, over
HTTP to the hot-load endpoint of a live ``vllm serve`` (:mod:`examples.countdown.served`). A refused incremental
snapshot falls back to a full one.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from deltasync import HotLoadClient, HotLoadConfig, HotLoadError, Signal, SnapshotWriter
from deltasync.protocol import DRAIN_HEADER, TRANSITION_HEADER

__all__ = ["AdapterSync", "DeltaSync", "OfflineHotLoadClient"]


class OfflineHotLoadClient(HotLoadClient):
    """A :class:`deltasync.HotLoadClient` whose one replica (URL :attr:`URL`) is in this process: the signal that
    would be POSTed goes to the replica instead, so refusals and the fall-back to a full snapshot are the client's
    own."""

    URL = "offline"

    def __init__(self, replica) -> None:
        super().__init__([self.URL])
        self.replica = replica

    def _post(self, url: str, body: dict, headers: dict) -> tuple[int, str]:
        try:
            self.replica.load(Signal.from_request(body, headers.get(TRANSITION_HEADER), headers.get(DRAIN_HEADER)))
        except HotLoadError as e:  # refused: the served weights are untouched
            return e.status, str(e)
        return 200, ""


class DeltaSync:
    """Per-step sync; ``push`` returns the metrics the example logs; ``identity`` is the snapshot serving and
    :attr:`versions` maps every identity pushed (and the initial one) to its policy version (steps trained).

    With ``llm`` (an offline ``vllm.LLM``), the replica runs in this process; without, :meth:`connect` points the
    sync at a ``vllm serve`` started with :attr:`config` as its ``hot_load`` section (HTTP, async transition: the
    server pauses requests in flight, swaps, recomputes their KV under the new weights and resumes them).
    """

    def __init__(
        self,
        root: Path,
        dtype: str,
        initial_dir: Path,
        llm=None,
        full_every: int = 10,
        keep_snapshots: bool = False,
        numerics=None,
    ) -> None:
        root = Path(root)
        self.dtype, self.keep_snapshots = dtype, keep_snapshots
        self.writer = SnapshotWriter(
            root / "snapshots", initial_dir, full_every=full_every, cache_dir=root / "writer_cache", numerics=numerics
        )
        self.config = HotLoadConfig(snapshot_root=str(root / "snapshots"), state_dir=str(root / "replica"))
        (root / "snapshots").mkdir(parents=True, exist_ok=True)
        self.replica = None
        self.client: HotLoadClient | None = None
        self.versions: dict[str, int] = {}
        self._served: str | None = None
        if llm is not None:
            from vllm_plugin.hotload.offline import OfflineReplica

            self.replica = OfflineReplica(llm, self.config, initial_dir)
            self.client = OfflineHotLoadClient(self.replica)
            self.versions[self.identity] = 0
        self._shipped: list[Path] = []

    def connect(self, base_url: str) -> None:
        """Sync into the ``vllm serve`` at ``base_url`` (its hot-load endpoint; started with :attr:`config`)."""
        self.client = HotLoadClient(base_url, reset_prompt_cache="all")
        self._served = self.client.status()[0]["replicas"][0]["current_snapshot_identity"]
        self.versions[self._served] = 0

    @property
    def identity(self) -> str:
        return self.replica.ledger.current_identity if self.replica is not None else self._served

    def push(self, weights: dict, step: int) -> dict:
        """Ship ``weights`` (the trainer's ``hf_weights`` after ``step`` steps) and swap the engine to them.
        Returns ``sync_kind``, ``sync_bytes`` (shipped), ``full_bytes``, ``delta_density``, ``swap_seconds``
        (signal to ready), ``sync_seconds`` (write + swap), ``sync_refused`` (fallbacks)."""
        t0 = time.perf_counter()
        res = self.client.push(self.writer, f"step-{step:05d}", weights)
        info = res.snapshot
        self.versions[info.identity] = step
        self._served = info.identity
        self._shipped.append(info.path)
        while len(self._shipped) > 2 and not self.keep_snapshots:  # the replica holds its own copy
            shutil.rmtree(self._shipped.pop(0), ignore_errors=True)
        return {
            "sync_identity": info.identity,
            "sync_kind": info.kind,
            "sync_bytes": info.bytes,
            "full_bytes": info.full_bytes,
            "delta_density": info.density,
            "swap_seconds": res.swap_seconds,
            "sync_seconds": time.perf_counter() - t0,
            "sync_refused": len(res.refused),
        }


class AdapterSync:
    """``--lora``: the base stays frozen, so each step ships the trainer's adapter only, through the same protocol as
    :class:`DeltaSync`: a :class:`deltasync.SnapshotWriter` over the adapter's PEFT tensors (full first and every
    ``full_every`` steps, else an ``arc_v2`` delta against the served adapter version) signalled with ``lora_name``
    to the :class:`vllm_plugin.hotload.offline.OfflineReplica` over the offline engine, which verifies it and serves
    it as a new ``vllm.lora.request.LoRARequest`` (:attr:`lora_request`; ``None``: the base model, policy version 0).
    Same interface as :class:`DeltaSync` for the loop: ``push``, ``identity``, ``versions``, plus :meth:`write`."""

    NAME = "policy"

    def __init__(
        self,
        root: Path,
        dtype: str,
        initial_dir: Path,
        llm,
        full_every: int = 10,
        keep_snapshots: bool = False,
        numerics=None,
    ) -> None:
        from vllm_plugin.hotload.offline import OfflineReplica

        self.root, self.dtype, self.keep_snapshots = Path(root), dtype, keep_snapshots
        self.full_every, self.numerics = full_every, numerics
        (self.root / "snapshots").mkdir(parents=True, exist_ok=True)
        self.config = HotLoadConfig(snapshot_root=str(self.root / "snapshots"), state_dir=str(self.root / "replica"))
        self.replica = OfflineReplica(llm, self.config, initial_dir)
        self.client = OfflineHotLoadClient(self.replica)
        self.writer: SnapshotWriter | None = None  # made at the first push (its assets: the adapter's config)
        self.identity = "base"
        self.versions: dict[str, int] = {"base": 0}
        self.lora_request = None
        self._shipped: list[Path] = []

    def write(self, trainer, step: int) -> Path:
        """The trainer's adapter after ``step`` steps, as a PEFT directory (what :meth:`push` ships)."""
        return trainer.save_lora(self.root / "trainer" / f"step-{step:05d}", self.dtype)

    def push(self, adapter_dir: Path, step: int) -> dict:
        """Ship the adapter in ``adapter_dir`` and serve it from now on. Returns the :class:`DeltaSync` metrics
        (``sync_kind`` ``full`` / ``incremental``, ``sync_bytes`` shipped, ...)."""
        from deltasync import read_snapshot_tensors

        t0 = time.perf_counter()
        adapter_dir = Path(adapter_dir)
        if self.writer is None:
            assets = self.root / "assets"
            assets.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(adapter_dir / "adapter_config.json", assets / "adapter_config.json")
            self.writer = SnapshotWriter(
                self.root / "snapshots",
                assets,
                full_every=self.full_every,
                cache_dir=self.root / "writer_cache",
                numerics=self.numerics,
            )
        res = self.client.push(
            self.writer, f"lora-step-{step:05d}", read_snapshot_tensors(adapter_dir), lora_name=self.NAME
        )
        info = res.snapshot
        self.lora_request = self.replica.lora_request(self.NAME)
        self.identity = info.identity
        self.versions[info.identity] = step
        self._shipped += [adapter_dir, info.path]
        while len(self._shipped) > 4 and not self.keep_snapshots:  # the replica holds its own copy
            shutil.rmtree(self._shipped.pop(0), ignore_errors=True)
        return {
            "sync_identity": info.identity,
            "sync_kind": info.kind,
            "sync_bytes": info.bytes,
            "full_bytes": info.full_bytes,
            "delta_density": info.density,
            "swap_seconds": res.swap_seconds,
            "sync_seconds": time.perf_counter() - t0,
            "sync_refused": len(res.refused),
        }
