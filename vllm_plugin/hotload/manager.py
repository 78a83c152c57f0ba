"""Hot-load of full and incremental snapshots into a running vLLM server, with a persistent ledger.

One :class:`HotLoadManager` per server process. A signal names a snapshot directory ``<snapshot_root>/<identity>``:

1. **validate** — identity is one path segment; not already loaded since the last ledger reset (a replayed XOR delta
   would corrupt the weights); an incremental snapshot must name the served identity as its previous one, and is
   refused after a ledger reset (the next load must be full);
2. **materialize and verify** while serving continues — a full snapshot is checked against the served model's tensor
   spec (names, dtypes, shapes, every shard readable in full); an incremental one is decoded onto the served snapshot
   with :func:`deltasync.apply_incremental_snapshot` (lengths, key set, Adler-32 of every tensor) into
   ``<state_dir>/materialized/<identity>``. Any refusal here leaves serving untouched;
3. **swap** — ``async``: ``pause_generation(mode="keep")`` (in-flight requests freeze with their KV), reload, resume;
   ``sync``: new requests get HTTP 425 while in-flight ones finish on the old weights (up to the drain timeout, else
   the signal itself gets 425 and nothing changes), then reload. The reload is vLLM's ``reload_weights`` worker
   method through ``collective_rpc`` (every worker, in place); then the prompt cache is reset per
   ``reset_prompt_cache`` (``all``: every cached prefix, running requests included; ``new_session``: cached prefixes
   not held by running requests; ``none``).

Each stage is timestamped in the ledger (:class:`deltasync.Ledger`); a process killed mid-swap restarts, marks the
row ``interrupted`` and reloads the last ``ready`` snapshot (:meth:`HotLoadManager.restore`).
Sources: Fireworks' bring-your-own-trainer hot-load API (``../shared/DESIGN.md`` §5); vLLM ``AsyncLLM``
(``pause_generation`` / ``resume_generation`` / ``reset_prefix_cache`` / ``collective_rpc``).
"""
from __future__ import annotations

import asyncio
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from deltasync import (IdentityError, Ledger, SnapshotError, materialize_snapshot, tensor_spec,
                       validate_identity)

__all__ = ["HotLoadError", "HotLoadManager", "Signal"]

RESET_MODES = ("all", "new_session", "none")
TRANSITIONS = ("async", "sync")


class HotLoadError(Exception):
    """A refused or failed hot-load; ``status`` is the HTTP status the API answers with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Signal:
    identity: str
    previous_identity: str | None = None  # set: incremental snapshot
    compression_format: str | None = None
    checksum_format: str | None = None
    reset_prompt_cache: str = "all"
    transition: str = "async"
    drain_timeout: float = 90.0

    @classmethod
    def from_request(cls, body: dict, transition: str | None, drain_timeout: float | None) -> "Signal":
        """Parse the POST body (``identity``, ``incremental_snapshot_metadata``, ``reset_prompt_cache``).

        Raises:
            HotLoadError (400/422): malformed request.
        """
        if not isinstance(body, dict):
            raise HotLoadError("request body must be a JSON object", 422)
        try:
            identity = validate_identity(body.get("identity"))
        except IdentityError as e:
            raise HotLoadError(str(e), 400) from e
        meta = body.get("incremental_snapshot_metadata")
        sig = cls(identity=identity, reset_prompt_cache=body.get("reset_prompt_cache") or "all",
                  transition=transition or "async", drain_timeout=90.0 if drain_timeout is None else drain_timeout)
        if meta is not None:
            if not isinstance(meta, dict) or "previous_snapshot_identity" not in meta:
                raise HotLoadError("incremental_snapshot_metadata needs previous_snapshot_identity", 422)
            try:
                sig.previous_identity = validate_identity(meta["previous_snapshot_identity"])
            except IdentityError as e:
                raise HotLoadError(str(e), 400) from e
            sig.compression_format = meta.get("compression_format", "arc_v2")
            sig.checksum_format = meta.get("checksum_format", "alder32")
            if sig.checksum_format not in ("alder32", "adler32"):
                raise HotLoadError(f"unsupported checksum_format {sig.checksum_format!r} (alder32)", 422)
        if sig.reset_prompt_cache not in RESET_MODES:
            raise HotLoadError(f"reset_prompt_cache must be one of {RESET_MODES}", 422)
        if sig.transition not in TRANSITIONS:
            raise HotLoadError(f"transition must be one of {TRANSITIONS}", 422)
        return sig


class HotLoadManager:
    """Owns the ledger, the materialized snapshots and the swap of one server.

    Args:
        engine: vLLM's ``EngineClient`` (``AsyncLLM``).
        snapshot_root: directory holding ``<identity>/`` snapshot directories (full HF layout or deltas).
        state_dir: ledger and materialized snapshots (survives restarts).
        initial_dir: the ``--model`` directory (served before any load, identity ``initial_identity``).
    """

    def __init__(self, engine, snapshot_root: str | Path, state_dir: str | Path, initial_dir: str | Path,
                 initial_identity: str = "initial", keep_materialized: int = 2) -> None:
        self.engine = engine
        self.root = Path(snapshot_root)
        self.state_dir = Path(state_dir)
        self.materialized = self.state_dir / "materialized"
        self.ledger = Ledger(self.state_dir / "ledger.json", initial_identity)
        self.initial_dir = Path(initial_dir)
        self.reference_spec = tensor_spec(self.initial_dir)
        self.keep = keep_materialized
        self.lock = asyncio.Lock()
        self.stage = "idle"
        self.target: str | None = None
        self.draining = False  # sync transition in progress: new requests get 425
        self.fault_delay = float(os.environ.get("ZEROKLD_HOTLOAD_FAULT_DELAY_S", "0") or 0)

    def served_dir(self, identity: str | None = None) -> Path:
        identity = identity or self.ledger.current_identity
        if identity == self.ledger.initial_identity:
            return self.initial_dir
        local = self.materialized / identity
        return local if local.exists() else self.root / identity

    def status(self) -> dict:
        return {"replicas": [{"replica": 0, "current_snapshot_identity": self.ledger.current_identity,
                              "readiness": self.stage == "idle",
                              "loading_state": {"stage": self.stage, "target_snapshot_identity": self.target}}]}

    async def restore(self) -> None:
        """After a restart: serve the last ``ready`` snapshot again (the engine started from ``--model``)."""
        if self.ledger.current_identity != self.ledger.initial_identity:
            await self._reload(self.served_dir())

    async def _reload(self, path: Path) -> None:
        await self.engine.collective_rpc("reload_weights", kwargs={"weights_path": str(path)})

    def _check(self, sig: Signal) -> None:
        led = self.ledger
        if sig.identity in led.loaded_identities():
            raise HotLoadError(f"snapshot {sig.identity!r} was already loaded (replay refused)", 409)
        if not (self.root / sig.identity).is_dir():
            raise HotLoadError(f"snapshot {sig.identity!r} not found under the snapshot root", 404)
        if sig.previous_identity is not None:
            if led.full_required:
                raise HotLoadError("the ledger was reset: the next snapshot must be full", 409)
            if sig.previous_identity != led.current_identity:
                raise HotLoadError(f"incremental snapshot {sig.identity!r} is against {sig.previous_identity!r}, "
                                   f"but this replica serves {led.current_identity!r} (out-of-order chain)", 409)

    def _materialize(self, sig: Signal) -> Path:
        """Blocking (run in a thread): the verified full snapshot directory to load."""
        base = None if sig.previous_identity is None else self.served_dir(sig.previous_identity)
        return materialize_snapshot(self.root / sig.identity, self.materialized / sig.identity, self.reference_spec,
                                    base, sig.compression_format)

    async def _drain(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.engine.get_num_unfinished_requests() > 0:
            if time.monotonic() > deadline:
                raise HotLoadError(f"in-flight requests did not finish within the drain timeout ({timeout} s)", 425)
            await asyncio.sleep(0.01)

    async def _reset_cache(self, mode: str) -> bool:
        if mode == "none":
            return True
        return bool(await self.engine.reset_prefix_cache(reset_running_requests=mode == "all"))

    async def signal(self, sig: Signal) -> dict:
        """Load one snapshot; returns its ledger row. Raises :class:`HotLoadError` (serving unchanged)."""
        if self.lock.locked():
            raise HotLoadError("another hot-load is in progress", 409)
        async with self.lock:
            kind = "incremental" if sig.previous_identity else "full"
            try:
                self._check(sig)
            except HotLoadError as e:
                self.ledger.refused(sig.identity, str(e), kind)
                raise
            row = self.ledger.begin(sig.identity, kind, sig.previous_identity, sig.compression_format)
            self.stage, self.target = "verifying", sig.identity
            try:
                path = await asyncio.to_thread(self._materialize, sig)
                self.ledger.stage(row, "verified")
                if sig.transition == "sync":
                    self.stage, self.draining = "draining", True
                    await self._drain(sig.drain_timeout)
                    await self.engine.pause_generation(mode="wait", clear_cache=False)
                else:
                    self.stage = "pausing"
                    await self.engine.pause_generation(mode="keep", clear_cache=False)
                self.ledger.stage(row, "paused")
                self.stage = "loading"
                if self.fault_delay:  # fault injection (tests): widen the window in which a kill lands mid-apply
                    await asyncio.sleep(self.fault_delay)
                try:
                    await self._reload(path)
                except Exception as e:  # restore the served weights, then report
                    await self._reload(self.served_dir())
                    raise HotLoadError(f"reload failed, previous snapshot restored: {e}", 500) from e
                self.ledger.stage(row, "loaded")
                cache_reset = await self._reset_cache(sig.reset_prompt_cache)
                self.ledger.ready(row)
                row["prompt_cache_reset"] = cache_reset
                self._prune()
                return row
            except Exception as e:  # every refusal and failure is recorded; serving keeps the old snapshot
                msg = str(e) or type(e).__name__
                self.ledger.fail(row, msg)
                if isinstance(e, HotLoadError):
                    raise
                status = 422 if isinstance(e, (SnapshotError, IdentityError, LookupError, OSError)) else 500
                raise HotLoadError(msg, status) from e
            finally:
                if await self.engine.is_paused():
                    await self.engine.resume_generation()
                self.draining = False
                self.stage, self.target = "idle", None

    def _prune(self) -> None:
        keep = {self.ledger.current_identity}
        for r in reversed(self.ledger.rows):
            if len(keep) >= self.keep:
                break
            if r.get("readiness") == "ready":
                keep.add(r["identity"])
        if self.materialized.exists():
            for d in self.materialized.iterdir():
                if d.name not in keep and not d.name.endswith(".tmp"):
                    shutil.rmtree(d, ignore_errors=True)
