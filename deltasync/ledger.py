"""The hot-load ledger: one row per snapshot a replica was asked to load, persisted as JSON, plus identity rules.

Row fields (Fireworks' bring-your-own-trainer ledger, ``docs/design.md`` §5): ``replica`` (the replica id
that wrote it: a fleet's ledgers can be merged and told apart), ``identity``, ``kind``
(``full`` | ``incremental``; ``restore``: a restart fell back to an earlier snapshot), ``previous_identity``,
``compression_format``, ``readiness`` (``loading`` | ``ready`` | ``failed``), ``error``, ``weights_digest`` (SHA-256 of
the loaded snapshot's per-tensor checksums: a restart verifies the bits it restores against it), ``timestamps``
(stage name → Unix seconds: ``signaled``, ``verified``, ``paused``, ``loaded``, ``ready`` / ``failed``).

Persistence is **append-only** (JSON Lines, ``ledger.jsonl``): every change appends one line per changed row
(``{"i": index, "row": {...}}``) and, when it changed, the replica state (``{"state": {...}}``); nothing is rewritten
except by a ledger reset, which replaces the file atomically. Reading replays the lines; a line a crash or a full disk
cut short is skipped (the next append starts on a new line). On load, a row still ``loading`` (the process died
mid-apply) becomes ``failed`` with error ``interrupted``: the replica serves the last ``ready`` identity.

The first write of a load (:meth:`Ledger.begin`) must reach the disk, else the load is refused before anything
changes (:class:`LedgerWriteError`); a later write that fails (disk full mid-load) is kept and written with the next
change, so the ledger on disk is always a prefix of the one in memory, never a corrupt one.

Signals refused before anything was loaded (bad identity, replay, out-of-order chain, missing snapshot) are not rows:
they are kept in a bounded ring (:data:`MAX_REFUSALS`, newest last, in memory) that the ledger's JSON shows as
``refusals``, so a flood of refused signals neither grows the file nor hides the loads.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections import deque
from pathlib import Path

from zerokld_plugins.errors import ZeroKLDClientError, ZeroKLDServerError

__all__ = ["IdentityError", "Ledger", "LedgerWriteError", "MAX_REFUSALS", "RESERVED_SUFFIXES", "validate_identity"]

log = logging.getLogger(__name__)
MAX_REFUSALS = 64  # refused signals kept (newest last)

_IDENTITY = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")  # \Z: no trailing newline (``$`` allows one)
#: suffixes of staging directories (``<out>.tmp``, ``<out>.old``): an identity never ends with one, so a snapshot can
#: never collide with another's staging directory
RESERVED_SUFFIXES = (".tmp", ".old")


class IdentityError(ZeroKLDClientError, ValueError):
    """A snapshot identity that is not one safe path segment."""


class LedgerWriteError(ZeroKLDServerError, OSError):
    """The ledger could not be written (``errno``: the cause, e.g. ``ENOSPC``); raised by :meth:`Ledger.begin` only,
    before anything is loaded."""


def validate_identity(identity: object) -> str:
    """Return ``identity`` if it is one path segment: ``[A-Za-z0-9][A-Za-z0-9._-]{0,127}`` (anchored at both ends),
    without ``..`` and not ending in a staging suffix (:data:`RESERVED_SUFFIXES`).

    Raises:
        IdentityError: anything else (``/``, ``\\``, ``..``, a newline, empty, too long, not a string); the message
            quotes at most 64 characters of it.
    """
    if (
        not isinstance(identity, str)
        or not _IDENTITY.match(identity)
        or ".." in identity
        or identity.endswith(RESERVED_SUFFIXES)
    ):
        shown = repr(identity)[:64] + ("..." if len(repr(identity)) > 64 else "")
        raise IdentityError(
            f"invalid snapshot identity {shown}: one path segment of letters, digits, '.', '_' or "
            f"'-' (no '/', no '..', not ending in {' or '.join(RESERVED_SUFFIXES)}), at most 128 "
            "characters"
        )
    return identity


MAX_FIELD = 200  # characters of an identity kept in a ledger row (errors: 4x)


def _bounded(value, limit: int = MAX_FIELD):
    if value is None:
        return None
    value = str(value)
    return value if len(value) <= limit else value[:limit] + f"... ({len(value)} characters)"


class Ledger:
    """Persistent ledger of one replica (``path``: its JSON Lines file; created on first write).

    Attributes:
        initial_identity: what the replica serves before any load (its ``--model``).
        replica_id: stamped into every new row as ``replica`` (``None``: no stamp).
        refusals: the newest :data:`MAX_REFUSALS` refused signals (rows with ``readiness`` ``failed``), in memory.
    """

    def __init__(self, path: str | Path, initial_identity: str = "initial", replica_id: str | None = None) -> None:
        self.path = Path(path)
        self.initial_identity, self.replica_id = initial_identity, replica_id
        self.rows: list[dict] = []
        self.refusals: deque[dict] = deque(maxlen=MAX_REFUSALS)
        self.reset_at: float | None = None
        self.current: str | None = None  # identity being served (survives a ledger reset)
        self.current_digest: str | None = None  # its weights digest (what a restart must find on disk)
        self.full_required = False  # set by reset(): the next load must be a full snapshot
        self._pending: list[str] = []  # lines a failed append could not write (written with the next change)
        self._torn = False  # the last append failed part-way: the next starts on a new line
        if self.path.exists():
            self._replay(self.path.read_text(errors="replace"))
            interrupted = []
            for i, r in enumerate(self.rows):
                if r.get("readiness") == "loading":
                    r.update(readiness="failed", error="interrupted (the process stopped mid-apply)")
                    r.setdefault("timestamps", {})["failed"] = time.time()
                    interrupted.append(i)
            if interrupted:
                self._save(*interrupted)

    def _state(self) -> dict:
        return {
            "reset_at": self.reset_at,
            "current": self.current,
            "current_digest": self.current_digest,
            "full_required": self.full_required,
        }

    def _replay(self, text: str) -> None:
        for line in text.splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # cut short by a crash or a full disk
            if not isinstance(rec, dict):
                continue
            if "row" in rec and isinstance(rec.get("i"), int) and 0 <= rec["i"] <= len(self.rows):
                if rec["i"] == len(self.rows):
                    self.rows.append(rec["row"])
                else:
                    self.rows[rec["i"]] = rec["row"]
            elif isinstance(rec.get("state"), dict):
                st = rec["state"]
                self.reset_at, self.current = st.get("reset_at"), st.get("current")
                self.current_digest, self.full_required = st.get("current_digest"), st.get("full_required", False)
                if st.get("reset"):
                    self.rows = []

    def _save(self, *changed: int, state: bool = False, strict: bool = False) -> None:
        """Append the rows at indices ``changed`` (and the state, with ``state``). ``strict``: raise
        :class:`LedgerWriteError` when the lines cannot be written (and keep none of them); else keep them for the
        next append and log the error."""
        lines = [json.dumps({"i": i, "row": self.rows[i]}) for i in changed]
        if state:
            lines.append(json.dumps({"state": self._state()}))
        todo = self._pending + lines
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write(("\n" if self._torn else "") + "".join(line + "\n" for line in todo))
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            self._torn = True
            if strict:
                raise LedgerWriteError(e.errno, f"the ledger cannot be written: {e.strerror}") from None
            self._pending = todo
            log.error("hot-load ledger append failed (%s); kept for the next write", e.strerror)
            return
        self._torn, self._pending = False, []

    @property
    def current_identity(self) -> str:
        """The identity being served: the last one loaded (``initial_identity`` before any load)."""
        return self.current or self.initial_identity

    def loaded_identities(self) -> set[str]:
        """Identities this replica has loaded since the last reset (a signal for one of them is a replay)."""
        return {r["identity"] for r in self.rows if r.get("readiness") == "ready"} | {self.current_identity}

    def begin(self, identity: str, kind: str, previous_identity: str | None, compression_format: str | None) -> dict:
        """Append a ``loading`` row for a load that starts now.

        Raises:
            LedgerWriteError: the row could not be written (e.g. the disk is full); the ledger is unchanged."""
        row = {
            "replica": self.replica_id,
            "identity": identity,
            "kind": kind,
            "previous_identity": previous_identity,
            "compression_format": compression_format,
            "readiness": "loading",
            "error": None,
            "timestamps": {"signaled": time.time()},
        }
        self.rows.append(row)
        try:
            self._save(len(self.rows) - 1, strict=True)
        except LedgerWriteError:
            self.rows.pop()
            raise
        return row

    def refused(self, identity: str, error: str, kind: str | None = None, previous_identity: str | None = None) -> dict:
        """Record a signal refused before any loading (bad identity, replay, out-of-order chain, missing snapshot) in
        the bounded ring :attr:`refusals` (not a ledger row; nothing is written to disk). Fields are bounded:
        identities at :data:`MAX_FIELD` characters, the error at 4 times that."""
        now = time.time()
        row = {
            "replica": self.replica_id,
            "identity": _bounded(identity),
            "kind": kind,
            "previous_identity": _bounded(previous_identity),
            "compression_format": None,
            "readiness": "failed",
            "error": _bounded(error, 4 * MAX_FIELD),
            "timestamps": {"signaled": now, "failed": now},
        }
        self.refusals.append(row)
        return row

    def _index(self, row: dict) -> int:
        return next(i for i in range(len(self.rows) - 1, -1, -1) if self.rows[i] is row)

    def stage(self, row: dict, stage: str, **fields) -> None:
        row["timestamps"][stage] = time.time()
        row.update(fields)
        self._save(self._index(row), state=stage == "ready")

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
        self.rows.append(
            {
                "replica": self.replica_id,
                "identity": identity,
                "kind": "restore",
                "previous_identity": _bounded(self.current),
                "compression_format": None,
                "readiness": "ready",
                "error": _bounded(
                    "restored after a restart; lost: " + "; ".join(f"{k}: {v}" for k, v in lost.items()), 4 * MAX_FIELD
                ),
                "weights_digest": digest,
                "timestamps": {"signaled": now, "ready": now},
            }
        )
        self.current = None if identity == self.initial_identity else identity
        self.current_digest = digest
        self._save(*[i for i, r in enumerate(self.rows) if r["identity"] in lost], len(self.rows) - 1, state=True)

    def require_full(self) -> None:
        """The next load must be full (the served weights can no longer be a delta's base); rows are kept."""
        self.full_required = True
        self._save(state=True)

    def reset(self) -> None:
        """Forget every row; the next load must be full. The replica keeps serving what it serves. The file is
        replaced atomically by one state line (the only rewrite).

        Raises:
            LedgerWriteError: it could not be written; the ledger is unchanged."""
        reset_at = time.time()
        line = json.dumps({"state": {**self._state(), "reset_at": reset_at, "full_required": True, "reset": True}})
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(line + "\n")
            os.replace(tmp, self.path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise LedgerWriteError(e.errno, f"the ledger cannot be written: {e.strerror}") from None
        self.rows, self.reset_at, self.full_required = [], reset_at, True
        self._pending, self._torn = [], False
        self.refusals.clear()

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
        """``{"identity", "error", "at"}`` of the newest failed row or refusal, ``None`` if none."""
        failed = [r for r in self.rows if r.get("readiness") == "failed"] + list(self.refusals)
        if not failed:
            return None
        r = max(failed, key=lambda r: r.get("timestamps", {}).get("failed") or 0)
        return {"identity": r["identity"], "error": r.get("error"), "at": r.get("timestamps", {}).get("failed")}

    def to_json(self) -> dict:
        """The ledger as the API shows it: ``rows`` (loads), ``refusals`` (the bounded ring, newest last) and the
        replica state."""
        return {
            "replica": self.replica_id,
            "current_snapshot_identity": self.current_identity,
            "full_required": self.full_required,
            "reset_at": self.reset_at,
            "rows": self.rows,
            "refusals": list(self.refusals),
        }
