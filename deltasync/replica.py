"""The replica state machine of the hot-load protocol, written once against a small engine protocol.

One :class:`Replica` per serving engine. A :class:`deltasync.protocol.Signal` names ``<snapshot_root>/<identity>``:

1. **check** — not already loaded since the last ledger reset (a replayed XOR delta would corrupt the weights); the
   snapshot exists; an incremental snapshot names the served identity as its previous one, and is refused after a
   ledger reset (the next load must be full);
2. **fetch** — a remote ``snapshot_root`` (fsspec URL) is downloaded into ``<state_dir>/fetched/<identity>``, all or
   nothing, ``fetch_concurrency`` files at a time, each checked against its published SHA-256, resuming an
   interrupted download (:func:`deltasync.fetch_dir`);
3. **verify** while serving continues (in a worker thread, never on the event loop) — a local snapshot is first
   copied into the replica's own state (``<state_dir>/materialized/<identity>``, a delta ``fetched/<identity>``;
   each file opened without following links or blocking and refused unless it is a regular file:
   :func:`deltasync.copy_snapshot`), and that private copy is what is verified and loaded, so bytes the publisher
   changes after the check never serve; the snapshot's numerics stamp must be the
   engine's (:class:`shared_numerics.NumericsMode`; an unstamped snapshot is accepted); a full snapshot is checked
   against the served model's tensor spec (names, dtypes, shapes, each tensor in one shard, an index naming every tensor
   and shard), then every tensor against its Adler-32 and SHA-256 in the spec and for finite values
   (``HotLoadConfig.allow_non_finite`` lifts that); an incremental one, on an engine that applies deltas in place
   (:attr:`ReplicaEngine.inplace_deltas`), is kept in ``<state_dir>/fetched/<identity>`` and decoded by every worker
   against its own loaded parameters, each tensor checked against its Adler-32 and SHA-256, nothing written (the stage
   pass of :meth:`ReplicaEngine.apply_delta`); on other engines it is decoded onto the served snapshot (lengths, key
   set, Adler-32 of every tensor) into ``<state_dir>/materialized/<identity>``. Any refusal here leaves serving
   untouched;
4. **swap** — ``async``: the engine pauses keeping in-flight requests (they freeze with their KV), reloads (a delta
   applied in place: the commit pass writes the new bits into the parameters),
   labels the weights with the identity (so each token is attributed to the snapshot that sampled it), resumes;
   ``sync``: new requests are refused (HTTP 425) while in-flight ones finish on the old weights, up to the
   drain timeout (else the signal itself gets 425 and nothing changes), then reload. A failed reload restores the
   previous snapshot. Then the prompt cache per ``reset_prompt_cache``: ``all`` drops every cached prefix and makes
   in-flight requests recompute their KV with the new weights; ``new_session`` keeps in-flight KV and the cached
   prefixes of sessions seen before, new sessions start afresh (:meth:`ReplicaEngine.isolate_new_sessions`);
   ``none`` keeps everything;
5. **ledger** — every stage is timestamped (:class:`deltasync.Ledger`), the loaded weights' digest recorded; a
   process killed mid-swap restarts, marks the row ``interrupted`` and reloads the last ``ready`` snapshot after
   verifying its bits against that digest (a delta applied in place: its chain replayed — the full snapshot it
   started from, then each kept delta, every tensor checked again) — or, if it is gone or altered, the newest earlier
   one that verifies, else the initial weights, the ledger saying so (:meth:`Replica.restore`).

**LoRA adapters** (a signal with ``lora_name``, vLLM's name for an adapter) go through the same stages on their own
track: one ledger, chain and retention per adapter name (``<state_dir>/lora/<name>/``), full snapshots being PEFT
adapter directories and incremental ones deltas against the adapter's served version. The swap pauses nothing: the
engine serves the new version under ``name`` to requests admitted from then on, while requests admitted before finish
on the version they started with (:meth:`ReplicaEngine.load_adapter`) — a response never mixes adapter versions, and
the versions have separate prefix-cache entries. A restart restores every adapter's last verified version.

The engine side is :class:`ReplicaEngine`: vLLM's OpenAI server (:mod:`vllm_plugin.hotload.engine`) and an offline
``vllm.LLM`` (:mod:`vllm_plugin.hotload.offline`) are its two adapters.
A full disk anywhere (the ledger's first write, a private copy, a decoded delta) refuses the signal with 507 and a
short message before the swap; the staged copy is removed, the engine serves what it served. Errors, ledger rows and
status never carry absolute server paths (:func:`deltasync.protocol.public_message`).
Sources: Fireworks' bring-your-own-trainer hot-load API (``docs/design.md`` §5).
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from zerokld_plugins.errors import ZeroKLDServerError

from .ledger import IdentityError, Ledger, LedgerWriteError, validate_identity
from .protocol import NO_SPACE, HotLoadConfig, HotLoadError, Signal, public_message
from .snapshot import (
    SnapshotError,
    check_regular_files,
    copy_snapshot,
    delta_weights_digest,
    materialize_snapshot,
    snapshot_numerics,
    tensor_spec,
    verify_adapter_config,
    verify_full_snapshot,
    weights_digest,
)
from .storage import fetch_dir

__all__ = ["LEDGER_FILE", "Replica", "ReplicaEngine", "StateDirInUseError", "Track"]

LEDGER_FILE = "ledger.jsonl"  # per track, in its state dir (:class:`deltasync.Ledger`: append-only JSON Lines)


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
        """Drop cached prefixes (``running_requests``: also those held by running requests, which recompute their
        KV with the new weights); ``False``: refused."""

    async def isolate_new_sessions(self) -> bool:
        """``reset_prompt_cache="new_session"``: requests of sessions seen before keep their cached prefixes, new
        sessions and requests without one get none computed with earlier weights; in-flight requests keep their
        KV. ``False``: the engine has no sessions (the replica resets the prefix cache of idle requests instead)."""

    async def apply_delta(
        self, path: str, compression_format: str | None, commit: bool, allow_non_finite: bool = False
    ) -> dict:
        """Decode the incremental snapshot at ``path`` against the loaded weights on every worker
        (:func:`deltasync.apply_delta_in_place`): ``commit=False`` verifies every tensor (and, unless
        ``allow_non_finite``, that its floating-point values are finite) and writes nothing,
        ``commit=True`` (called while paused) writes the new bits in place. Returns ``{"weights_digest"}`` (of the
        resulting weights, :func:`deltasync.checksums_digest`) and ``"tensors_changed"`` (commit: how many tensors'
        bits changed). Only called when :attr:`inplace_deltas`.

        Raises:
            DeltaError: refused (stage pass: nothing written)."""

    @property
    def inplace_deltas(self) -> bool:
        """Whether :meth:`apply_delta` works on this engine (else deltas are decoded on the host into a full snapshot
        that :meth:`reload_weights` loads)."""

    async def load_adapter(self, name: str, identity: str, path: str) -> None:
        """Serve the PEFT adapter directory ``path`` (snapshot ``identity``) as LoRA adapter ``name`` to requests
        admitted from now on; requests admitted before keep the version they started with. Raises (and changes
        nothing) when the engine refuses the adapter."""

    def adapter_versions_in_use(self, name: str) -> set[str]:
        """Snapshot identities of adapter ``name`` that unfinished requests use (their directories must stay)."""


class StateDirInUseError(ZeroKLDServerError, RuntimeError):
    """Another live replica holds the state directory (its ledger and snapshots are that replica's)."""


def hold_state_dir(state_dir: Path, replica_id: str):
    """Take ``<state_dir>/replica.lock`` (an exclusive ``flock``, released when the returned file is closed or the
    process ends, a crash included) and write the holder into it.

    Raises:
        StateDirInUseError: another replica (this process or another) holds it; the message names that replica.
    """
    state_dir.mkdir(parents=True, exist_ok=True)
    f = open(state_dir / "replica.lock", "a+")  # noqa: SIM115 - held open: the flock lives as long as the replica
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read()[:200] or "unknown"
        f.close()
        raise StateDirInUseError(
            f"hot_load state_dir {state_dir.name!r} is in use by another replica ({holder}); "
            "give each replica its own hot_load.state_dir"
        ) from None
    f.seek(0)
    f.truncate()
    f.write(json.dumps({"replica": replica_id, "pid": os.getpid()}))
    f.flush()
    return f


@dataclass
class Track:
    """What one ledger tracks: the base weights (``lora_name is None``) or one LoRA adapter name.

    Attributes:
        ledger: its :class:`deltasync.Ledger`.
        state_dir: ``ledger.jsonl``, ``fetched/<identity>`` and ``materialized/<identity>`` live here.
        stage, target: the hot-load in progress (``idle`` / ``verifying`` / ``draining`` / ``pausing`` /
            ``loading``) and the identity it loads.
    """

    ledger: Ledger
    state_dir: Path
    lora_name: str | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    stage: str = "idle"
    target: str | None = None

    @property
    def materialized(self) -> Path:
        return self.state_dir / "materialized"

    @property
    def fetched(self) -> Path:
        return self.state_dir / "fetched"

    def status(self) -> dict:
        """``current_snapshot_identity`` (an adapter that serves nothing: ``None``), its ``weights_digest`` and
        ``ready_since`` (Unix seconds), ``readiness``, ``loading_state``, and ``last_error`` (the newest refusal or
        failure: ``{"identity", "error", "at"}``, or ``None``)."""
        led, served = self.ledger, self.lora_name is None or self.ledger.current is not None
        return {
            "current_snapshot_identity": led.current_identity if served else None,
            "weights_digest": led.current_digest,
            "ready_since": led.ready_since,
            "readiness": self.stage == "idle",
            "loading_state": {"stage": self.stage, "target_snapshot_identity": self.target},
            "last_error": led.last_error,
        }


class Replica:
    """Owns the ledgers, the fetched and materialized snapshots and the swaps of one engine.

    The state directory is this replica's alone while it lives (:func:`hold_state_dir`): a second replica pointed at
    it — e.g. two servers left on the default ``<snapshot_root>/.zerokld_state`` — is refused at start.

    Args:
        engine: a :class:`ReplicaEngine`.
        config: :class:`deltasync.HotLoadConfig` (snapshot root, state dir, initial identity, retention, replica id).
        initial_dir: the weights the engine started with (identity ``config.initial_identity``).
        replica_id: this replica's name in status and ledger rows when ``config.replica_id`` is unset (default
            ``<hostname>-<pid>``).

    Raises:
        StateDirInUseError: another live replica holds the state directory.
    """

    def __init__(
        self, engine: ReplicaEngine, config: HotLoadConfig, initial_dir: str | Path, replica_id: str | None = None
    ) -> None:
        self.engine, self.config = engine, config
        self.replica_id = config.replica_id or replica_id or f"{socket.gethostname()}-{os.getpid()}"
        self.remote, self.root = config.remote, config.root
        self.state_dir = Path(config.resolved_state_dir())
        self._state_lock = hold_state_dir(self.state_dir, self.replica_id)
        self.base = Track(self._ledger(self.state_dir), self.state_dir)
        self.adapters: dict[str, Track] = {}
        for led in sorted((self.state_dir / "lora").glob("*/" + LEDGER_FILE)):  # adapters of an earlier run
            self.adapter_track(led.parent.name)
        self.initial_dir = Path(initial_dir)
        self.reference_spec = tensor_spec(self.initial_dir)
        self.swap_lock = asyncio.Lock()  # one engine swap at a time (verification runs concurrently)
        self.draining = False  # sync transition in progress: new requests get 425

    def _ledger(self, d: Path) -> Ledger:
        return Ledger(d / LEDGER_FILE, self.config.initial_identity, self.replica_id)

    def close(self) -> None:
        """Give the state directory up (another replica may take it); the replica is unusable afterwards."""
        self._state_lock.close()

    # the base track's state, under the names the engine adapters and the HTTP endpoint use
    @property
    def ledger(self) -> Ledger:
        return self.base.ledger

    @property
    def lock(self) -> asyncio.Lock:
        return self.base.lock

    @property
    def stage(self) -> str:
        return self.base.stage

    def adapter_track(self, name: str) -> Track:
        """The track of LoRA adapter ``name`` (created on first use).

        Raises:
            HotLoadError: 400, ``name`` is not one path segment (:func:`deltasync.validate_identity`'s rule)."""
        if name not in self.adapters:
            try:
                validate_identity(name)
            except IdentityError as e:
                raise HotLoadError(f"invalid lora_name: {e}", 400) from e
            d = self.state_dir / "lora" / name
            self.adapters[name] = Track(self._ledger(d), d, name)
        return self.adapters[name]

    def track_for(self, lora_name: str | None) -> Track:
        """The base track, or adapter ``lora_name``'s (:meth:`adapter_track`)."""
        return self.base if lora_name is None else self.adapter_track(lora_name)

    # -- where snapshots are -------------------------------------------------------------------------------------
    def _published(self, identity: str) -> str | Path:
        return f"{self.root}/{identity}" if self.remote else Path(self.root) / identity

    def _exists(self, identity: str) -> bool:
        if not self.remote:
            return (Path(self.root) / identity).is_dir()
        from .storage import filesystem_for

        return filesystem_for(str(self.root)).exists(f"{self.root}/{identity}")

    def served_dir(self, identity: str | None = None, track: Track | None = None) -> Path:
        """The local full snapshot directory of ``identity`` (default: the one serving) on ``track`` (default: the
        base weights).

        Raises:
            SnapshotError: an adapter track asked for its initial identity (an adapter has no initial weights)."""
        track = track or self.base
        identity = identity or track.ledger.current_identity
        if identity == track.ledger.initial_identity:
            if track.lora_name is None:
                return self.initial_dir
            raise SnapshotError(f"LoRA adapter {track.lora_name!r} serves no snapshot")
        for d in (track.materialized / identity, track.fetched / identity):
            if d.exists():
                return d
        return track.materialized / identity  # gone: never the published directory (its bytes were not verified)

    def status(self) -> dict:
        """Per replica (this one: ``replica`` is its id): the base track's :meth:`Track.status`, and
        ``lora_adapters``: each adapter name's."""
        return {
            "replicas": [
                {
                    "replica": self.replica_id,
                    **self.base.status(),
                    "lora_adapters": {n: t.status() for n, t in sorted(self.adapters.items())},
                }
            ]
        }

    def _reference(self, track: Track, path: Path) -> dict:
        """The tensor spec a snapshot of ``track`` must have: the served model's, or for an adapter its own (a new
        full version may change the rank; a delta is checked against its base by the decoder)."""
        return self.reference_spec if track.lora_name is None else tensor_spec(path)

    def _chain(self, track: Track, identity: str) -> tuple[list[str], dict[str, dict]]:
        """``([full, delta, ..., identity], rows)``: the identities whose snapshots rebuild ``identity``'s weights —
        just ``[identity]`` unless it was applied in place, then its ``previous_identity`` chain back to the newest one
        that was not (a full snapshot, a host-decoded one, or the initial weights) — and the ledger row each identity
        was last loaded with (``ready``, not a restore)."""
        rows = {
            r["identity"]: r for r in track.ledger.rows if r.get("readiness") == "ready" and r.get("kind") != "restore"
        }
        chain = [identity]
        while rows.get(chain[-1], {}).get("applied") == "in_place":
            chain.append(rows[chain[-1]]["previous_identity"])
        return chain[::-1], rows

    def _restorable(self, track: Track, identity: str, digest: str | None) -> Path | list[Path]:
        """Blocking (run in a thread): what rebuilds ``identity``'s weights, verified — its full snapshot directory
        (regular files, the served model's tensor spec, every tensor against its checksum), or for one applied in
        place the chain ``[full or initial directory, delta, ...]`` (the full one verified so, each delta's files
        regular; every tensor of a delta is checked again as it is applied) — and in both cases the checksums'
        digest equal to what the ledger recorded when it was loaded (``digest``), so replaced bits are never served
        under the old identity."""
        chain, rows = self._chain(track, identity)
        if len(chain) > 1:
            first = chain[0]
            head: Path | list[Path] = (
                self.initial_dir
                if first == track.ledger.initial_identity
                else self._restorable(track, first, rows.get(first, {}).get("weights_digest"))
            )
            deltas = [track.fetched / i for i in chain[1:]]
            for d in deltas:
                if not d.is_dir():
                    raise SnapshotError(f"delta {d.name!r} of the chain of {identity!r} is gone")
                check_regular_files(d, track.fetched)
            if digest is None or delta_weights_digest(deltas[-1]) != digest:
                raise SnapshotError(
                    f"snapshot {identity!r} is not the one loaded (weights digest differs from the ledger)"
                )
            assert isinstance(head, Path), head  # the chain starts at a full snapshot (or the initial weights)
            return [head, *deltas]
        path = self.served_dir(identity, track)
        if not path.is_dir():
            raise SnapshotError(f"snapshot {identity!r} is gone")
        check_regular_files(path, track.state_dir)
        if track.lora_name is not None:
            verify_adapter_config(path)
        verify_full_snapshot(
            path, self._reference(track, path), check_data=True, allow_non_finite=self.config.allow_non_finite
        )
        if digest is None or weights_digest(path) != digest:
            raise SnapshotError(f"snapshot {identity!r} is not the one loaded (weights digest differs from the ledger)")
        return path

    async def _load(self, track: Track, identity: str, path: Path | list[Path]) -> None:
        if isinstance(path, list):  # a chain applied in place: its full snapshot, then each delta (checked again)
            await self.engine.reload_weights(str(path[0]))
            for d in path[1:]:
                await self.engine.apply_delta(str(d), None, commit=True)
        elif track.lora_name is None:
            await self.engine.reload_weights(str(path))
        else:
            await self.engine.load_adapter(track.lora_name, identity, str(path))

    async def restore(self) -> None:
        """After a restart (the engine started from ``initial_dir``): serve the ledger's current snapshot again,
        verified (:meth:`_restorable`); if it is gone or its bits changed, the newest earlier ``ready`` snapshot that
        verifies, else the initial weights — the ledger marks what was lost and appends a ``restore`` row. Then the
        same for every LoRA adapter's track (an adapter with nothing left to serve is not served). Never raises for
        a missing or altered snapshot."""
        await self._restore(self.base)
        for track in self.adapters.values():
            if track.ledger.current is not None:
                await self._restore(track)

    async def _restore(self, track: Track) -> None:
        led, base = track.ledger, track.lora_name is None
        candidates = [(led.current_identity, led.current_digest)] + [
            (r["identity"], r.get("weights_digest"))
            for r in reversed(led.rows)
            if r.get("readiness") == "ready" and r["identity"] != led.current_identity
        ]
        lost: dict[str, str] = {}
        touched = False  # a failed chain may have written some of its deltas: the initial weights are reloaded
        for identity, digest in candidates:
            if identity == led.initial_identity:
                break
            try:
                path = await asyncio.to_thread(self._restorable, track, identity, digest)
                touched = True
                await self._load(track, identity, path)
            except Exception as e:  # noqa: BLE001 - any failure: try the next one, never crash the server
                lost[identity] = public_message(e)
                continue
            if lost:
                led.restored(identity, digest, lost)
            if base:
                await self.engine.set_weight_version(identity)
            return
        if lost:
            led.restored(led.initial_identity, None, lost)
        if base:
            if touched:
                await self.engine.reload_weights(str(self.initial_dir))
            await self.engine.set_weight_version(led.initial_identity)

    # -- the stages --------------------------------------------------------------------------------------------
    def _check(self, track: Track, sig: Signal) -> None:
        led = track.ledger
        if sig.identity == led.initial_identity:
            raise HotLoadError(
                f"snapshot identity {sig.identity!r} is reserved for the weights the engine started with", 409
            )
        if sig.identity in led.loaded_identities():
            raise HotLoadError(f"snapshot {sig.identity!r} was already loaded (replay refused)", 409)
        if not self._exists(sig.identity):
            raise HotLoadError(f"snapshot {sig.identity!r} not found under the snapshot root", 404)
        if sig.previous_identity is not None:
            if led.full_required:
                raise HotLoadError("the ledger was reset: the next snapshot must be full", 409)
            if track.lora_name is not None and led.current is None:
                raise HotLoadError(
                    f"LoRA adapter {track.lora_name!r} serves no snapshot yet: the first one must be full", 409
                )
            if sig.previous_identity != led.current_identity:
                raise HotLoadError(
                    f"incremental snapshot {sig.identity!r} is against {sig.previous_identity!r}, "
                    f"but this replica serves {led.current_identity!r} (out-of-order chain)",
                    409,
                )

    def _fetch(self, track: Track, sig: Signal) -> Path:
        if not self.remote:
            return Path(self.root) / sig.identity
        return fetch_dir(
            str(self._published(sig.identity)),
            track.fetched / sig.identity,
            max_concurrency=self.config.fetch_concurrency,
        )

    def _verify_numerics(self, local: Path) -> None:
        from shared_numerics.mode import NumericsMismatchError, NumericsMode, check_same_numerics

        stamp = snapshot_numerics(local)
        if stamp is None or self.engine.numerics is None:
            return
        try:
            check_same_numerics(
                NumericsMode.from_dict(self.engine.numerics), stamp, "this replica", f"snapshot {local.name!r}"
            )
        except (NumericsMismatchError, ValueError) as e:
            raise SnapshotError(str(e)) from e

    def _in_place(self, track: Track, sig: Signal) -> bool:
        return track.lora_name is None and sig.previous_identity is not None and self.engine.inplace_deltas

    def _stage_delta(self, track: Track, sig: Signal) -> Path:
        """Blocking (run in a thread): fetch an incremental snapshot applied in place, check its files and numerics,
        and keep it in the replica's state (``fetched/<identity>``: a restart replays the chain from it)."""
        try:
            local = self._private(track, sig, track.fetched)
            self._verify_numerics(local)
        except BaseException:
            shutil.rmtree(track.fetched / sig.identity, ignore_errors=True)
            raise
        return local

    def _private(self, track: Track, sig: Signal, folder: Path) -> Path:
        """Blocking: the replica's own copy of the signalled snapshot — fetched (remote roots) or copied from the
        local root into ``folder/<identity>`` (:func:`deltasync.copy_snapshot`: regular files only, checked at open)
        — whose files are checked again; everything after this reads the copy alone."""
        local = self._fetch(track, sig)
        if not self.remote:
            check_regular_files(local, self.root)  # a symlinked snapshot directory is refused before the copy
            local = copy_snapshot(local, folder / sig.identity)
        check_regular_files(local, track.state_dir)
        return local

    def _materialize(self, track: Track, sig: Signal) -> tuple[Path, str]:
        """Blocking (run in a thread): fetch, verify; the full snapshot directory to load and its weights digest.
        Everything is verified on the replica's private copy (:meth:`_private`), which is also what the engine loads;
        a full adapter snapshot stays there (the engine may read it again while a request uses it)."""
        base = None if sig.previous_identity is None else self.served_dir(sig.previous_identity, track)
        try:
            local = self._private(track, sig, track.materialized if base is None else track.fetched)
            self._verify_numerics(local)
            if track.lora_name is not None and base is None:
                if local != track.materialized / sig.identity:  # fetched: the engine reads the adapter from here
                    local = copy_snapshot(local, track.materialized / sig.identity)
                verify_adapter_config(local)
            path = materialize_snapshot(
                local,
                track.materialized / sig.identity,
                self._reference(track, base if base is not None else local),
                base,
                sig.compression_format,
                check_data=True,
                allow_non_finite=self.config.allow_non_finite,
            )
            return path, weights_digest(path)
        except BaseException:  # nothing of a refused snapshot stays in the replica's state
            for folder in (track.materialized, track.fetched):
                shutil.rmtree(folder / sig.identity, ignore_errors=True)
            raise

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
        if mode == "new_session" and await self.engine.isolate_new_sessions():
            return True
        return bool(await self.engine.reset_prefix_cache(running_requests=mode == "all"))

    async def signal(self, sig: Signal) -> dict:
        """Load one snapshot (``sig.lora_name``: a version of that LoRA adapter); returns its ledger row.

        Raises:
            HotLoadError: refused or failed (its ``status`` says why); the engine keeps serving what it served.
        """
        track = self.track_for(sig.lora_name)
        if track.lock.locked():
            raise HotLoadError(
                "another hot-load is in progress" + (f" for LoRA adapter {sig.lora_name!r}" if sig.lora_name else ""),
                409,
            )
        async with track.lock:
            kind = "incremental" if sig.previous_identity else "full"
            try:
                self._check(track, sig)
            except HotLoadError as e:
                track.ledger.refused(sig.identity, str(e), kind, sig.previous_identity)
                raise
            try:
                row = track.ledger.begin(sig.identity, kind, sig.previous_identity, sig.compression_format)
            except LedgerWriteError as e:  # nothing changed: refused, the reason kept in the refusals ring
                msg = public_message(e)
                track.ledger.refused(sig.identity, msg, kind, sig.previous_identity)
                raise HotLoadError(msg, 507 if e.errno in NO_SPACE else 500) from e
            track.stage, track.target = "verifying", sig.identity
            try:
                in_place = self._in_place(track, sig)
                if in_place:  # the stage pass on every worker: each tensor decoded and checked, nothing written
                    path = await asyncio.to_thread(self._stage_delta, track, sig)
                    try:
                        digest = (
                            await self.engine.apply_delta(
                                str(path),
                                sig.compression_format,
                                commit=False,
                                allow_non_finite=self.config.allow_non_finite,
                            )
                        )["weights_digest"]
                    except BaseException:
                        shutil.rmtree(path, ignore_errors=True)
                        raise
                    track.ledger.stage(row, "verified", weights_digest=digest, applied="in_place")
                else:
                    path, digest = await asyncio.to_thread(self._materialize, track, sig)
                    track.ledger.stage(row, "verified", weights_digest=digest)
                async with self.swap_lock:
                    if track.lora_name is None:
                        await self._swap_base(sig, path, row, in_place)
                    else:
                        track.stage = "loading"
                        await self.engine.load_adapter(track.lora_name, sig.identity, str(path))
                        track.ledger.stage(row, "loaded")
                        track.ledger.ready(row)
                self._prune(track)
                return row
            except Exception as e:  # every refusal and failure is recorded; serving keeps the old snapshot
                msg = public_message(e)
                track.ledger.fail(row, msg)
                if isinstance(e, HotLoadError):
                    if msg != str(e):
                        raise HotLoadError(msg, e.status) from e
                    raise
                if isinstance(e, OSError) and e.errno in NO_SPACE:
                    status = 507
                    msg = f"no space left on the replica's disk while staging {sig.identity!r}; nothing changed"
                else:
                    status = 422 if isinstance(e, (SnapshotError, IdentityError, LookupError, OSError)) else 500
                raise HotLoadError(msg, status) from e
            finally:
                track.stage, track.target = "idle", None

    async def _swap_base(self, sig: Signal, path: Path, row: dict, in_place: bool = False) -> None:
        """Pause (async: keep in-flight requests; sync: drain them first), reload (``in_place``: commit the staged
        delta on every worker), label, reset the prefix cache, resume — the previous snapshot restored if the load
        fails."""
        track, led = self.base, self.base.ledger
        try:
            if sig.transition == "sync":
                track.stage, self.draining = "draining", True
                await self._drain(sig.drain_timeout)
                await self.engine.pause(keep_requests=False)
            else:
                track.stage = "pausing"
                await self.engine.pause(keep_requests=True)
            led.stage(row, "paused")
            track.stage = "loading"
            try:
                if in_place:
                    done = await self.engine.apply_delta(str(path), sig.compression_format, commit=True)
                    if done["weights_digest"] != row.get("weights_digest"):
                        raise SnapshotError("the committed weights' digest differs from the staged one")
                    row["tensors_changed"] = done["tensors_changed"]
                else:
                    await self.engine.reload_weights(str(path))
            except Exception as e:  # restore the served weights, then report
                try:
                    served = (
                        self.initial_dir
                        if led.current_identity == led.initial_identity
                        else await asyncio.to_thread(self._restorable, track, led.current_identity, led.current_digest)
                    )
                    await self._load(track, led.current_identity, served)
                except Exception as lost:  # noqa: BLE001 - reported with the first failure
                    led.require_full()
                    raise HotLoadError(
                        f"reload failed ({e}) and the previous snapshot could not be restored "
                        f"({lost}); the weights are undefined until the next full snapshot",
                        500,
                    ) from e
                raise HotLoadError(f"reload failed, previous snapshot restored: {e}", 500) from e
            await self.engine.set_weight_version(sig.identity)  # still paused: the label switches between steps
            led.stage(row, "loaded")
            cache_reset = await self._reset_cache(sig.reset_prompt_cache)
            led.ready(row)
            # what really happened: "none" resets nothing; a refused reset is reported, not claimed
            row["prompt_cache_reset"] = cache_reset and sig.reset_prompt_cache != "none"
            if not cache_reset:
                row["prompt_cache_reset_error"] = (
                    f"reset_prompt_cache {sig.reset_prompt_cache!r} was refused "
                    "by the engine (running requests hold cached blocks)"
                )
        finally:
            if await self.engine.is_paused():
                await self.engine.resume()
            self.draining = False

    def _prune(self, track: Track) -> None:
        """Drop fetched and materialized snapshots beyond ``keep_materialized`` (the serving one and the newest
        ``ready`` ones); an adapter also keeps its previous version and every version a request still uses."""
        keep = {track.ledger.current_identity}
        limit = self.config.keep_materialized
        if track.lora_name is not None:
            keep |= self.engine.adapter_versions_in_use(track.lora_name)
            limit = max(limit, 2) + len(keep) - 1
        for r in reversed(track.ledger.rows):
            if len(keep) >= limit:
                break
            if r.get("readiness") == "ready":
                keep.add(r["identity"])
        keep |= {i for k in list(keep) for i in self._chain(track, k)[0]}  # deltas applied in place replay from these
        for folder in (track.materialized, track.fetched):
            if folder.exists():
                for d in folder.iterdir():
                    if d.name not in keep and not d.name.startswith("."):  # identities only (no .staging)
                        shutil.rmtree(d, ignore_errors=True)
