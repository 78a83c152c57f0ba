"""The replica state machine of the hot-load protocol, written once against a small engine protocol.

One :class:`Replica` per serving engine. A :class:`deltasync.protocol.Signal` names ``<snapshot_root>/<identity>``:

1. **check** — not already loaded since the last ledger reset (a replayed XOR delta would corrupt the weights); the
   snapshot exists; an incremental snapshot names the served identity as its previous one, and is refused after a
   ledger reset (the next load must be full);
2. **fetch** — a remote ``snapshot_root`` (fsspec URL) is downloaded into ``<state_dir>/fetched/<identity>``, all or
   nothing (:func:`deltasync.fetch_dir`);
3. **verify** while serving continues (in a worker thread, never on the event loop) — only regular files inside
   the snapshot root are opened (no symlinks out, no FIFOs or devices); the snapshot's numerics stamp must be the
   engine's (:class:`shared_numerics.NumericsMode`; an unstamped snapshot is accepted); a full snapshot is checked against
   the served model's tensor spec (names, dtypes, shapes, each tensor in one shard), then every tensor against its
   Adler-32 in the spec and for finite values (``HotLoadConfig.allow_non_finite`` lifts that); an incremental one is
   decoded onto the served snapshot (lengths, key set, Adler-32 of every tensor) into
   ``<state_dir>/materialized/<identity>``. Any refusal here leaves serving untouched;
4. **swap** — ``async``: the engine pauses keeping in-flight requests (they freeze with their KV), reloads,
   labels the weights with the identity (so each token is attributed to the snapshot that sampled it), resumes;
   ``sync``: new requests are refused (HTTP 425) while in-flight ones finish on the old weights, up to the
   drain timeout (else the signal itself gets 425 and nothing changes), then reload. A failed reload restores the
   previous snapshot. Then the prefix cache is reset per ``reset_prompt_cache``;
5. **ledger** — every stage is timestamped (:class:`deltasync.Ledger`), the loaded weights' digest recorded; a
   process killed mid-swap restarts, marks the row ``interrupted`` and reloads the last ``ready`` snapshot after
   verifying its bits against that digest — or, if it is gone or altered, the newest earlier one that verifies, else
   the initial weights, the ledger saying so (:meth:`Replica.restore`).

The engine side is :class:`ReplicaEngine`: vLLM's OpenAI server (:mod:`vllm_plugin.hotload.engine`) and an offline
``vllm.LLM`` (:mod:`vllm_plugin.hotload.offline`) are its two adapters.
Sources: Fireworks' bring-your-own-trainer hot-load API (``../shared/DESIGN.md`` §5).
"""
from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path
from typing import Protocol

from .ledger import IdentityError, Ledger
from .protocol import HotLoadConfig, HotLoadError, Signal
from .snapshot import (SnapshotError, check_regular_files, materialize_snapshot, snapshot_numerics, tensor_spec,
                       verify_full_snapshot, weights_digest)
from .storage import fetch_dir

__all__ = ["Replica", "ReplicaEngine"]


class ReplicaEngine(Protocol):
    """What a replica needs from a serving engine.

    Attributes:
        numerics: the engine's :class:`shared_numerics.NumericsMode` as a dict, ``None`` for stock numerics.
    """

    numerics: dict | None

    async def reload_weights(self, path: str) -> None:
        """Load the full HF snapshot at ``path`` in place (every worker)."""

    async def set_weight_version(self, identity: str) -> None:
        """Label the loaded weights (called while paused): every token sampled from now on is attributed to
        ``identity`` (vLLM: ``update_weight_version``, per-token ``weight_versions`` spans)."""

    async def pause(self, keep_requests: bool) -> None:
        """Stop scheduling: ``keep_requests`` freezes in-flight requests with their KV, else waits for them."""

    async def resume(self) -> None: ...

    async def is_paused(self) -> bool: ...

    def num_unfinished_requests(self) -> int: ...

    async def reset_prefix_cache(self, running_requests: bool) -> bool:
        """Drop cached prefixes (``running_requests``: also those held by running requests); ``False``: refused."""


class Replica:
    """Owns the ledger, the fetched and materialized snapshots and the swap of one engine.

    Args:
        engine: a :class:`ReplicaEngine`.
        config: :class:`deltasync.HotLoadConfig` (snapshot root, state dir, initial identity, retention).
        initial_dir: the weights the engine started with (identity ``config.initial_identity``).
    """

    def __init__(self, engine: ReplicaEngine, config: HotLoadConfig, initial_dir: str | Path) -> None:
        self.engine, self.config = engine, config
        self.remote, self.root = config.remote, config.root
        self.state_dir = Path(config.resolved_state_dir())
        self.materialized = self.state_dir / "materialized"
        self.fetched = self.state_dir / "fetched"
        self.ledger = Ledger(self.state_dir / "ledger.json", config.initial_identity)
        self.initial_dir = Path(initial_dir)
        self.reference_spec = tensor_spec(self.initial_dir)
        self.lock = asyncio.Lock()
        self.stage = "idle"
        self.target: str | None = None
        self.draining = False  # sync transition in progress: new requests get 425

    # -- where snapshots are -------------------------------------------------------------------------------------
    def _published(self, identity: str) -> str | Path:
        return f"{self.root}/{identity}" if self.remote else self.root / identity

    def _exists(self, identity: str) -> bool:
        if not self.remote:
            return (self.root / identity).is_dir()
        from .storage import filesystem_for

        return filesystem_for(self.root).exists(f"{self.root}/{identity}")

    def served_dir(self, identity: str | None = None) -> Path:
        """The local full snapshot directory of ``identity`` (default: the one serving)."""
        identity = identity or self.ledger.current_identity
        if identity == self.ledger.initial_identity:
            return self.initial_dir
        for d in (self.materialized / identity, self.fetched / identity):
            if d.exists():
                return d
        return self.root / identity if not self.remote else self.fetched / identity

    def status(self) -> dict:
        return {"replicas": [{"replica": 0, "current_snapshot_identity": self.ledger.current_identity,
                              "readiness": self.stage == "idle",
                              "loading_state": {"stage": self.stage, "target_snapshot_identity": self.target}}]}

    def _restorable(self, identity: str, digest: str | None) -> Path:
        """Blocking (run in a thread): the verified directory of ``identity`` — regular files, the served model's
        tensor spec, every tensor against its checksum, and the checksums' digest equal to what the ledger recorded
        when it was loaded (``digest``), so replaced bits are never served under the old identity."""
        path = self.served_dir(identity)
        if not path.is_dir():
            raise SnapshotError(f"snapshot {identity!r} is gone")
        check_regular_files(path, path.parent)
        verify_full_snapshot(path, self.reference_spec, check_data=True, allow_non_finite=self.config.allow_non_finite)
        if digest is None or weights_digest(path) != digest:
            raise SnapshotError(f"snapshot {identity!r} is not the one loaded (weights digest differs from the ledger)")
        return path

    async def restore(self) -> None:
        """After a restart (the engine started from ``initial_dir``): serve the ledger's current snapshot again,
        verified (:meth:`_restorable`); if it is gone or its bits changed, the newest earlier ``ready`` snapshot that
        verifies, else the initial weights — the ledger marks what was lost and appends a ``restore`` row. Never
        raises for a missing or altered snapshot."""
        led = self.ledger
        candidates = [(led.current_identity, led.current_digest)] + [
            (r["identity"], r.get("weights_digest")) for r in reversed(led.rows)
            if r.get("readiness") == "ready" and r["identity"] != led.current_identity]
        lost: dict[str, str] = {}
        for identity, digest in candidates:
            if identity == led.initial_identity:
                break
            try:
                path = await asyncio.to_thread(self._restorable, identity, digest)
                await self.engine.reload_weights(str(path))
            except Exception as e:  # noqa: BLE001 - any failure: try the next one, never crash the server
                lost[identity] = str(e) or type(e).__name__
                continue
            if lost:
                led.restored(identity, digest, lost)
            await self.engine.set_weight_version(identity)
            return
        if lost:
            led.restored(led.initial_identity, None, lost)
        await self.engine.set_weight_version(led.initial_identity)

    # -- the stages --------------------------------------------------------------------------------------------
    def _check(self, sig: Signal) -> None:
        led = self.ledger
        if sig.identity == led.initial_identity:
            raise HotLoadError(f"snapshot identity {sig.identity!r} is reserved for the weights the engine started "
                               "with", 409)
        if sig.identity in led.loaded_identities():
            raise HotLoadError(f"snapshot {sig.identity!r} was already loaded (replay refused)", 409)
        if not self._exists(sig.identity):
            raise HotLoadError(f"snapshot {sig.identity!r} not found under the snapshot root", 404)
        if sig.previous_identity is not None:
            if led.full_required:
                raise HotLoadError("the ledger was reset: the next snapshot must be full", 409)
            if sig.previous_identity != led.current_identity:
                raise HotLoadError(f"incremental snapshot {sig.identity!r} is against {sig.previous_identity!r}, "
                                   f"but this replica serves {led.current_identity!r} (out-of-order chain)", 409)

    def _fetch(self, sig: Signal) -> Path:
        if not self.remote:
            return self.root / sig.identity
        return fetch_dir(str(self._published(sig.identity)), self.fetched / sig.identity)

    def _verify_numerics(self, local: Path) -> None:
        from shared_numerics.mode import NumericsMismatchError, NumericsMode, check_same_numerics

        stamp = snapshot_numerics(local)
        if stamp is None or self.engine.numerics is None:
            return
        try:
            check_same_numerics(NumericsMode.from_dict(self.engine.numerics), stamp, "this replica",
                                f"snapshot {local.name!r}")
        except (NumericsMismatchError, ValueError) as e:
            raise SnapshotError(str(e)) from e

    def _materialize(self, sig: Signal) -> tuple[Path, str]:
        """Blocking (run in a thread): fetch, verify; the full snapshot directory to load and its weights digest."""
        local = self._fetch(sig)
        check_regular_files(local, self.fetched if self.remote else self.root)  # before anything is opened
        self._verify_numerics(local)
        base = None if sig.previous_identity is None else self.served_dir(sig.previous_identity)
        path = materialize_snapshot(local, self.materialized / sig.identity, self.reference_spec, base,
                                    sig.compression_format, check_data=True,
                                    allow_non_finite=self.config.allow_non_finite)
        return path, weights_digest(path)

    async def _drain(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.engine.num_unfinished_requests() > 0:
            if time.monotonic() > deadline:
                raise HotLoadError(f"in-flight requests did not finish within the drain timeout ({timeout} s)", 425)
            await asyncio.sleep(0.01)

    async def _reset_cache(self, mode: str) -> bool:
        """``True`` when the requested reset happened (``none``: nothing to do)."""
        if mode == "none":
            return True
        return bool(await self.engine.reset_prefix_cache(running_requests=mode == "all"))

    async def signal(self, sig: Signal) -> dict:
        """Load one snapshot; returns its ledger row.

        Raises:
            HotLoadError: refused or failed (its ``status`` says why); the engine keeps serving what it served.
        """
        if self.lock.locked():
            raise HotLoadError("another hot-load is in progress", 409)
        async with self.lock:
            kind = "incremental" if sig.previous_identity else "full"
            try:
                self._check(sig)
            except HotLoadError as e:
                self.ledger.refused(sig.identity, str(e), kind, sig.previous_identity)
                raise
            row = self.ledger.begin(sig.identity, kind, sig.previous_identity, sig.compression_format)
            self.stage, self.target = "verifying", sig.identity
            try:
                path, digest = await asyncio.to_thread(self._materialize, sig)
                self.ledger.stage(row, "verified", weights_digest=digest)
                if sig.transition == "sync":
                    self.stage, self.draining = "draining", True
                    await self._drain(sig.drain_timeout)
                    await self.engine.pause(keep_requests=False)
                else:
                    self.stage = "pausing"
                    await self.engine.pause(keep_requests=True)
                self.ledger.stage(row, "paused")
                self.stage = "loading"
                try:
                    await self.engine.reload_weights(str(path))
                except Exception as e:  # restore the served weights, then report
                    await self.engine.reload_weights(str(self.served_dir()))
                    raise HotLoadError(f"reload failed, previous snapshot restored: {e}", 500) from e
                await self.engine.set_weight_version(sig.identity)  # still paused: the label switches between steps
                self.ledger.stage(row, "loaded")
                cache_reset = await self._reset_cache(sig.reset_prompt_cache)
                self.ledger.ready(row)
                # what really happened: "none" resets nothing; a refused reset is reported, not claimed
                row["prompt_cache_reset"] = cache_reset and sig.reset_prompt_cache != "none"
                if not cache_reset:
                    row["prompt_cache_reset_error"] = (f"reset_prompt_cache {sig.reset_prompt_cache!r} was refused "
                                                       "by the engine (running requests hold cached blocks)")
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
                    await self.engine.resume()
                self.draining = False
                self.stage, self.target = "idle", None

    def _prune(self) -> None:
        keep = {self.ledger.current_identity}
        for r in reversed(self.ledger.rows):
            if len(keep) >= self.config.keep_materialized:
                break
            if r.get("readiness") == "ready":
                keep.add(r["identity"])
        for folder in (self.materialized, self.fetched):
            if folder.exists():
                for d in folder.iterdir():
                    if d.name not in keep and not d.name.startswith("."):  # identities only (no .staging)
                        shutil.rmtree(d, ignore_errors=True)
