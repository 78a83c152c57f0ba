"""Trainer side of the snapshot protocol: :class:`SnapshotWriter` decides full vs incremental and writes the next
snapshot into the snapshot root.

Cadence (``docs/design.md`` §5): the first snapshot is full; then incremental snapshots against the **last
successfully loaded** identity, and a full one every ``full_every`` snapshots, after any failed load
(:meth:`SnapshotWriter.failed`), or when the replica's ledger was reset (:meth:`SnapshotWriter.require_full`). An
incremental snapshot needs the base's full weights: the writer keeps a private full copy of the last loaded snapshot
(``<cache_dir>/<identity>``, never shipped).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zerokld_models.checkpoint import staged_dir

from .ledger import validate_identity
from .protocol import DEFAULT_COMPRESSION_FORMAT
from .snapshot import (
    element_density,
    read_snapshot_tensors,
    weight_bytes,
    write_full_snapshot,
    write_incremental_snapshot,
)

__all__ = ["SnapshotInfo", "SnapshotWriter"]


@dataclass
class SnapshotInfo:
    """One written snapshot. ``bytes``: size of what is shipped (the delta for incremental); ``full_bytes``: the
    model's weight bytes; ``density``: fraction of elements whose bits changed vs the base (1.0 for full)."""

    identity: str
    kind: str
    previous_identity: str | None
    path: Path
    bytes: int
    full_bytes: int
    density: float
    compression_format: str | None


class SnapshotWriter:
    """Writes ``<root>/<identity>/`` snapshots following the cadence policy.

    Args:
        root: where snapshots are written: the snapshot root the replicas read, or (with ``publish_url``) a local
            staging directory.
        assets_dir: config/tokenizer files copied into full snapshots.
        full_every: a full snapshot at least every ``full_every`` snapshots (``1``: always full).
        compression_format: codec of incremental snapshots (registered through the ``zerokld`` hooks).
        cache_dir: the writer's private copies of loaded snapshots (default ``<root>/.writer_cache``).
        dtype: cast tensors to this dtype before writing (the serving dtype), or ``None``.
        numerics: the trainer's :class:`shared_numerics.NumericsMode` (or its dict), stamped into every snapshot's
            spec; the replica refuses a snapshot stamped with another mode than its engine's.
        publish_url: the replicas' snapshot root when it is remote storage (``s3://bucket/run``, any fsspec URL):
            each snapshot is uploaded to ``<publish_url>/<identity>`` (:func:`deltasync.publish_dir`, completion
            marker last) once written under ``root``.
    """

    def __init__(
        self,
        root: str | Path,
        assets_dir: str | Path,
        full_every: int = 20,
        compression_format: str = DEFAULT_COMPRESSION_FORMAT,
        cache_dir: str | Path | None = None,
        dtype: torch.dtype | None = None,
        numerics: Any = None,
        publish_url: str | None = None,
    ) -> None:
        if full_every < 1:
            raise ValueError("full_every must be >= 1")
        self.root, self.assets = Path(root), Path(assets_dir)
        self.publish_url = publish_url.rstrip("/") if publish_url else None
        self.cache = Path(cache_dir) if cache_dir else self.root / ".writer_cache"
        self.full_every, self.compression_format, self.dtype = full_every, compression_format, dtype
        self.numerics = numerics.to_dict() if hasattr(numerics, "to_dict") else numerics
        self.loaded: str | None = None  # last identity a replica confirmed
        self._since_full = 0
        self._force_full = True
        self._pending: SnapshotInfo | None = None

    def require_full(self) -> None:
        """The next snapshot must be full (the replica's ledger was reset)."""
        self._force_full = True

    def next_kind(self) -> str:
        if self._force_full or self.loaded is None or self._since_full + 1 >= self.full_every:
            return "full"
        return "incremental"

    def write(self, identity: str, tensors: dict[str, torch.Tensor], kind: str | None = None) -> SnapshotInfo:
        """Write the next snapshot (``kind``: force ``"full"``; default: the cadence's choice).

        Every directory (the snapshot, the writer's private copy) is assembled under a staging name and renamed into
        place, so a write that fails (e.g. the disk fills up) leaves nothing under ``<root>/<identity>`` and the same
        call can be retried once there is space.

        Raises:
            IdentityError: bad identity. FileExistsError: the identity exists. DeltaError: tensors do not match the
            base's names/shapes/dtypes. OSError: the write failed (``ENOSPC``: disk full; nothing published).
        """
        validate_identity(identity)
        out = self.root / identity
        if out.exists():
            raise FileExistsError(f"snapshot {identity!r} already exists in the snapshot root")
        if self.dtype is not None:
            tensors = {k: v.to(self.dtype) for k, v in tensors.items()}
        kind = kind or self.next_kind()
        private = self.cache / identity
        try:  # every directory is staged and renamed into place: a failed write (disk full) publishes nothing
            write_full_snapshot(tensors, self.assets, private, numerics=self.numerics)
            full_bytes = weight_bytes(private)
            if kind == "full":
                with staged_dir(out) as tmp:  # the private copy carries the stamp too
                    for f in sorted(private.iterdir()):
                        shutil.copyfile(f, tmp / f.name)
                info = SnapshotInfo(identity, "full", None, out, full_bytes, full_bytes, 1.0, None)
            else:
                assert self.loaded is not None  # kind is "full" until a replica confirmed one
                base = self.cache / self.loaded
                write_incremental_snapshot(base, tensors, out, self.compression_format, numerics=self.numerics)
                info = SnapshotInfo(
                    identity,
                    "incremental",
                    self.loaded,
                    out,
                    weight_bytes(out),
                    full_bytes,
                    self._density(base, tensors),
                    self.compression_format,
                )
        except BaseException:
            if private.name != self.loaded:
                shutil.rmtree(private, ignore_errors=True)
            raise
        if self.publish_url is not None:
            from .storage import publish_dir

            publish_dir(out, f"{self.publish_url}/{identity}")
        self._pending = info
        return info

    @staticmethod
    def _density(base_dir: Path, tensors: dict[str, torch.Tensor]) -> float:
        changed, total = element_density(read_snapshot_tensors(base_dir), tensors)
        return changed / max(total, 1)

    def confirm(self, info: SnapshotInfo) -> None:
        """The replica serves ``info``: it becomes the base of the next incremental snapshot."""
        previous = self.loaded
        self.loaded = info.identity
        self._force_full = False
        self._since_full = 0 if info.kind == "full" else self._since_full + 1
        if previous and previous != info.identity:
            shutil.rmtree(self.cache / previous, ignore_errors=True)

    def failed(self, info: SnapshotInfo) -> None:
        """The replica refused or failed ``info``: the next snapshot will be full."""
        self._force_full = True
        shutil.rmtree(self.cache / info.identity, ignore_errors=True)
