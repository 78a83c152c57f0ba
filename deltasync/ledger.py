"""The hot-load ledger: one row per snapshot a replica was asked to load, persisted as JSON, plus identity rules.

Row fields (Fireworks' bring-your-own-trainer ledger, ``../shared/DESIGN.md`` §5): ``replica`` (the replica id
that wrote it: a fleet's ledgers can be merged and told apart), ``identity``, ``kind``
(``full`` | ``incremental``; ``restore``: a restart fell back to an earlier snapshot), ``previous_identity``,
``compression_format``, ``readiness`` (``loading`` | ``ready`` | ``failed``), ``error``, ``weights_digest`` (SHA-256 of
the loaded snapshot's per-tensor checksums: a restart verifies the bits it restores against it), ``timestamps``
(stage name → Unix seconds: ``signaled``, ``verified``, ``paused``, ``loaded``, ``ready`` / ``failed``). The file is
rewritten atomically (temporary file + ``os.replace``) after every change, so a process killed at any point leaves
either the previous or the next ledger. On load, a row still ``loading`` (the process died mid-apply) becomes
``failed`` with error ``interrupted``: the replica serves the last ``ready`` identity.
"""
from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

__all__ = ["IdentityError", "Ledger", "RESERVED_SUFFIXES", "validate_identity"]

_IDENTITY = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")  # \Z: no trailing newline (``$`` allows one)
#: suffixes of staging directories (``<out>.tmp``, ``<out>.old``): an identity never ends with one, so a snapshot can
#: never collide with another's staging directory
RESERVED_SUFFIXES = (".tmp", ".old")


class IdentityError(ValueError):
    """A snapshot identity that is not one safe path segment."""


def validate_identity(identity: object) -> str:
    """Return ``identity`` if it is one path segment: ``[A-Za-z0-9][A-Za-z0-9._-]{0,127}`` (anchored at both ends),
    without ``..`` and not ending in a staging suffix (:data:`RESERVED_SUFFIXES`).

    Raises:
        IdentityError: anything else (``/``, ``\\``, ``..``, a newline, empty, too long, not a string); the message
            quotes at most 64 characters of it.
    """
    if (not isinstance(identity, str) or not _IDENTITY.match(identity) or ".." in identity
            or identity.endswith(RESERVED_SUFFIXES)):
        shown = repr(identity)[:64] + ("..." if len(repr(identity)) > 64 else "")
        raise IdentityError(f"invalid snapshot identity {shown}: one path segment of letters, digits, '.', '_' or "
                            f"'-' (no '/', no '..', not ending in {' or '.join(RESERVED_SUFFIXES)}), at most 128 "
                            "characters")
    return identity


MAX_FIELD = 200  # characters of an identity kept in a ledger row (errors: 4x)


def _bounded(value, limit: int = MAX_FIELD):
    if value is None:
        return None
    value = str(value)
    return value if len(value) <= limit else value[:limit] + f"... ({len(value)} characters)"


class Ledger:
    """Persistent ledger of one replica (``path``: a JSON file; created on first write).

    Attributes:
        initial_identity: what the replica serves before any load (its ``--model``).
        replica_id: stamped into every new row as ``replica`` (``None``: no stamp).
    """

    def __init__(self, path: str | Path, initial_identity: str = "initial", replica_id: str | None = None) -> None:
        self.path = Path(path)
        self.initial_identity, self.replica_id = initial_identity, replica_id
        self.rows: list[dict] = []
        self.reset_at: float | None = None
        self.current: str | None = None  # identity being served (survives a ledger reset)
        self.current_digest: str | None = None  # its weights digest (what a restart must find on disk)
        self.full_required = False  # set by reset(): the next load must be a full snapshot
        if self.path.exists():
            data = json.loads(self.path.read_text())
            self.rows, self.reset_at = data.get("rows", []), data.get("reset_at")
            self.current, self.full_required = data.get("current"), data.get("full_required", False)
            self.current_digest = data.get("current_digest")
            changed = False
            for r in self.rows:
                if r.get("readiness") == "loading":
                    r.update(readiness="failed", error="interrupted (the process stopped mid-apply)")
                    r.setdefault("timestamps", {})["failed"] = time.time()
                    changed = True
            if changed:
                self._save()

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps({"rows": self.rows, "reset_at": self.reset_at, "current": self.current,
                                   "current_digest": self.current_digest, "full_required": self.full_required},
                                  indent=1))
        os.replace(tmp, self.path)

    @property
    def current_identity(self) -> str:
        """The identity being served: the last one loaded (``initial_identity`` before any load)."""
        return self.current or self.initial_identity

    def loaded_identities(self) -> set[str]:
        """Identities this replica has loaded since the last reset (a signal for one of them is a replay)."""
        return {r["identity"] for r in self.rows if r.get("readiness") == "ready"} | {self.current_identity}

    def begin(self, identity: str, kind: str, previous_identity: str | None, compression_format: str | None) -> dict:
        row = {"replica": self.replica_id, "identity": identity, "kind": kind, "previous_identity": previous_identity,
               "compression_format": compression_format, "readiness": "loading", "error": None,
               "timestamps": {"signaled": time.time()}}
        self.rows.append(row)
        self._save()
        return row

    def refused(self, identity: str, error: str, kind: str | None = None, previous_identity: str | None = None
                ) -> dict:
        """Record a signal refused before any loading (bad identity, replay, out-of-order chain, missing snapshot).
        Fields are bounded: identities at :data:`MAX_FIELD` characters, the error at 4 times that."""
        now = time.time()
        row = {"replica": self.replica_id, "identity": _bounded(identity), "kind": kind,
               "previous_identity": _bounded(previous_identity),
               "compression_format": None, "readiness": "failed", "error": _bounded(error, 4 * MAX_FIELD),
               "timestamps": {"signaled": now, "failed": now}}
        self.rows.append(row)
        self._save()
        return row

    def stage(self, row: dict, stage: str, **fields) -> None:
        row["timestamps"][stage] = time.time()
        row.update(fields)
        self._save()

    def fail(self, row: dict, error: str) -> None:
        self.stage(row, "failed", readiness="failed", error=_bounded(error, 4 * MAX_FIELD))

    def ready(self, row: dict) -> None:
        self.current, self.current_digest = row["identity"], row.get("weights_digest")
        if row["kind"] == "full":
            self.full_required = False
        self.stage(row, "ready", readiness="ready")

    def restored(self, identity: str, digest: str | None, lost: dict[str, str]) -> None:
        """After a restart that could not serve the recorded snapshot: serve ``identity`` (an earlier verified one,
        or :attr:`initial_identity`), mark the rows of every ``lost`` identity (identity → why) ``failed``, and append
        a ``restore`` row saying what happened."""
        now = time.time()
        for r in self.rows:
            if r["identity"] in lost and r.get("readiness") == "ready":
                r.update(readiness="failed", error=_bounded(f"lost at restart: {lost[r['identity']]}", 4 * MAX_FIELD))
        self.rows.append({"replica": self.replica_id, "identity": identity, "kind": "restore",
                          "previous_identity": _bounded(self.current),
                          "compression_format": None, "readiness": "ready",
                          "error": _bounded("restored after a restart; lost: " + "; ".join(
                              f"{k}: {v}" for k, v in lost.items()), 4 * MAX_FIELD),
                          "weights_digest": digest, "timestamps": {"signaled": now, "ready": now}})
        self.current = None if identity == self.initial_identity else identity
        self.current_digest = digest
        self._save()

    def require_full(self) -> None:
        """The next load must be full (the served weights can no longer be a delta's base); rows are kept."""
        self.full_required = True
        self._save()

    def reset(self) -> None:
        """Forget every row; the next load must be full. The replica keeps serving what it serves."""
        self.rows = []
        self.reset_at = time.time()
        self.full_required = True
        self._save()

    @property
    def ready_since(self) -> float | None:
        """Unix time the current snapshot became ready (its newest ``ready`` or ``restore`` row), ``None`` before
        any load or after a reset."""
        for r in reversed(self.rows):
            if r["identity"] == self.current_identity and r.get("readiness") == "ready":
                return r.get("timestamps", {}).get("ready")
        return None

    @property
    def last_error(self) -> dict | None:
        """``{"identity", "error", "at"}`` of the newest failed row, ``None`` if none."""
        for r in reversed(self.rows):
            if r.get("readiness") == "failed":
                return {"identity": r["identity"], "error": r.get("error"),
                        "at": r.get("timestamps", {}).get("failed")}
        return None

    def to_json(self) -> dict:
        return {"replica": self.replica_id, "current_snapshot_identity": self.current_identity,
                "full_required": self.full_required, "reset_at": self.reset_at, "rows": self.rows}
