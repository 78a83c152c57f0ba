"""The hot-load protocol, written once: wire constants, the signal schema, defaults and the replica's config.

The trainer side (:class:`deltasync.HotLoadClient`), the replica (:class:`deltasync.Replica`) and every engine
adapter (the vLLM server's endpoint :mod:`vllm_plugin.hotload`, the offline ``vllm.LLM`` adapter) read these and
nothing else. Wire format (Fireworks' bring-your-own-trainer hot-load API, ``docs/design.md`` §5)::

    POST {PREFIX}                    {"identity", "incremental_snapshot_metadata"?: {"previous_snapshot_identity",
                                      "compression_format", "checksum_format"}, "reset_prompt_cache"?,
                                      "lora_name"?}
        headers {TRANSITION_HEADER}: async|sync, {DRAIN_HEADER}: <seconds>
    GET  {PREFIX}/status             per replica: replica id, current_snapshot_identity, weights_digest, ready_since,
                                     readiness, loading_state, last_error, lora_adapters
    GET / DELETE {PREFIX}/ledger     the ledger; DELETE resets it (the next load must be full);
                                     ``?lora_name=``: that LoRA adapter's ledger

``lora_name`` (vLLM's name for a LoRA adapter, as in ``/v1/load_lora_adapter``) makes the snapshot a version of that
adapter: a PEFT adapter directory (full) or a delta against the adapter's served version (incremental), with its own
ledger and chain. Requests naming the adapter as their ``model`` get the newest version from then on; requests
admitted before finish on theirs. Each version is served under the vLLM adapter name :func:`lora_version`
(``<lora_name>@<identity>``), which is the ``model`` field of the responses it produced.

Serving responses carry :data:`IDENTITY_HEADER`: the snapshot(s) that sampled their tokens (comma-separated in order of
use when a response spans an async swap; per token: the choices' ``weight_versions`` spans).

The same replica also answers Fireworks' own spelling, as ``fireworks-ai``'s ``DeploymentManager`` sends it
(``docs/wire.md`` §3)::

    POST {FIREWORKS_HOT_LOAD}        {"identity", "reset_prompt_cache"?: true|false, "incremental_snapshot_metadata"?}
        headers fireworks-deployment: accounts/<account_id>/deployments/<deployment_id>, fireworks-model
    GET  {FIREWORKS_HOT_LOAD}        {"replicas": [...]}: the status above, a failed newest load as stage "error"

(:meth:`Signal.from_fireworks`, :func:`fireworks_status`): ``true`` is ``"all"``, ``false`` ``"none"``; the transition
is the replica's setting (:attr:`HotLoadConfig.transition`), as Fireworks makes it a deployment's.
"""

from __future__ import annotations

import errno
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from zerokld_plugins.errors import ZeroKLDError

from .ledger import IdentityError, validate_identity

__all__ = [
    "CHECKSUM_FORMATS",
    "DEFAULT_CHECKSUM_FORMAT",
    "DEFAULT_COMPRESSION_FORMAT",
    "DEFAULT_DRAIN_TIMEOUT_S",
    "FIREWORKS_DEPLOYMENT_HEADER",
    "FIREWORKS_FIELDS",
    "FIREWORKS_HOT_LOAD",
    "FIREWORKS_MODEL_HEADER",
    "fireworks_status",
    "DRAIN_HEADER",
    "HotLoadConfig",
    "HotLoadError",
    "IDENTITY_HEADER",
    "PREFIX",
    "RESET_MODES",
    "SESSION_HEADER",
    "Signal",
    "TRANSITIONS",
    "TRANSITION_HEADER",
    "lora_version",
    "openapi_operations",
    "public_message",
]

PREFIX = "/zerokld/v1/hot_load"
IDENTITY_HEADER = "x-zerokld-snapshot-identity"
#: a serving request's session (else the OpenAI ``user`` field): ``reset_prompt_cache="new_session"`` keeps the cached
#: prefixes of sessions seen before a swap
SESSION_HEADER = "x-zerokld-session-id"
TRANSITION_HEADER = "x-zerokld-hot-load-transition"
DRAIN_HEADER = "x-zerokld-hot-load-drain-timeout"

DEFAULT_COMPRESSION_FORMAT = "arc_v2"
#: Fireworks spells Adler-32 ``alder32`` on the wire; the correct spelling is accepted too.
DEFAULT_CHECKSUM_FORMAT = "alder32"
CHECKSUM_FORMATS = ("alder32", "adler32")
RESET_MODES = ("all", "new_session", "none")
TRANSITIONS = ("async", "sync")
DEFAULT_DRAIN_TIMEOUT_S = 90.0

#: Fireworks' hot-load route (``DeploymentManager.hotload`` POSTs, ``hotload_check_status`` GETs), its headers and
#: the fields of its body
FIREWORKS_HOT_LOAD = "/hot_load/v1/models/hot_load"
FIREWORKS_DEPLOYMENT_HEADER = "fireworks-deployment"
FIREWORKS_MODEL_HEADER = "fireworks-model"
FIREWORKS_FIELDS = ("identity", "reset_prompt_cache", "incremental_snapshot_metadata")


_IDENTITY_SCHEMA = {
    "type": "string",
    "pattern": "^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$",
    "description": "one path segment (deltasync.ledger.validate_identity)",
}
_METADATA_SCHEMA = {
    "type": "object",
    "required": ["previous_snapshot_identity"],
    "properties": {
        "previous_snapshot_identity": _IDENTITY_SCHEMA,
        "compression_format": {"type": "string"},
        "checksum_format": {"type": "string", "enum": list(CHECKSUM_FORMATS)},
    },
}


def _json_body(schema: dict) -> dict:
    return {"required": True, "content": {"application/json": {"schema": schema}}}


def _header(name: str, schema: dict, required: bool = False) -> dict:
    return {"name": name, "in": "header", "required": required, "schema": schema}


def openapi_operations() -> dict[tuple[str, str], dict]:
    """The OpenAPI operation fields (``requestBody``, ``parameters``) of the hot-load routes, keyed by ``(method,
    path)``: what each route's body and headers are, for the server's ``/openapi.json`` (FastAPI's ``openapi_extra``)
    and the API fuzzer that reads it. Descriptive only: the readers are :meth:`Signal.from_request` and
    :meth:`Signal.from_fireworks`, which refuse anything these schemas refuse (and a few things more: a snapshot
    identity ending in a staging suffix, a non-finite drain timeout)."""
    ours = {
        "type": "object",
        "required": ["identity"],
        "properties": {
            "identity": _IDENTITY_SCHEMA,
            "reset_prompt_cache": {"type": "string", "enum": list(RESET_MODES)},
            "lora_name": _IDENTITY_SCHEMA,
            "incremental_snapshot_metadata": _METADATA_SCHEMA,
        },
    }
    fireworks = {
        "type": "object",
        "required": ["identity"],
        "additionalProperties": False,
        "properties": {
            "identity": _IDENTITY_SCHEMA,
            "reset_prompt_cache": {"type": "boolean"},
            "incremental_snapshot_metadata": _METADATA_SCHEMA,
        },
    }
    deployment = _header(FIREWORKS_DEPLOYMENT_HEADER, {"type": "string"}, required=True)
    lora = {"name": "lora_name", "in": "query", "required": False, "schema": _IDENTITY_SCHEMA}
    return {
        ("POST", PREFIX): {
            "requestBody": _json_body(ours),
            "parameters": [
                _header(TRANSITION_HEADER, {"type": "string", "enum": list(TRANSITIONS)}),
                _header(DRAIN_HEADER, {"type": "string", "pattern": "^[0-9]+(\\.[0-9]+)?$"}),
            ],
        },
        ("POST", FIREWORKS_HOT_LOAD): {"requestBody": _json_body(fireworks), "parameters": [deployment]},
        ("GET", FIREWORKS_HOT_LOAD): {"parameters": [deployment]},
        ("GET", PREFIX + "/ledger"): {"parameters": [lora]},
        ("DELETE", PREFIX + "/ledger"): {"parameters": [lora]},
    }


def lora_version(lora_name: str, identity: str) -> str:
    """The engine-side name of snapshot ``identity`` of LoRA adapter ``lora_name``: ``<lora_name>@<identity>`` (both
    are path segments without ``@``, so the pair reads back unambiguously)."""
    return f"{lora_name}@{identity}"


#: an absolute path in a message: every directory part is dropped, the last name kept (never after ``:`` or ``/``, so
#: URLs such as ``s3://bucket/run`` and relative names stay as they are)
_ABS_PATH = re.compile(r"(?<![\w.~:/-])/(?:[^\s'\"/:,;()\[\]{}]+/)*([^\s'\"/:,;()\[\]{}]*)")
#: errnos that mean the disk (or a quota) is full: the API answers 507 Insufficient Storage
NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def public_message(error: BaseException | str) -> str:
    """What a hot-load answer, ledger row or status may say about ``error``: never an absolute server path (an
    ``OSError`` says its reason and the file's name only; any absolute path left in a message keeps its last name).
    Source: issue 35 point 6 (messages carry paths relative to the snapshot root at most)."""
    if isinstance(error, OSError) and error.strerror:
        name = Path(str(error.filename)).name if error.filename else None
        msg = error.strerror + (f": {name!r}" if name else "")
    else:
        msg = str(error) or type(error).__name__
    return _ABS_PATH.sub(lambda m: m.group(1) or "<path>", msg)


def fireworks_status(status: dict, lora_name: str | None = None) -> dict:
    """Fireworks' status of a replica's ``status()`` (``{"replicas": [...]}``, every field kept): a replica whose
    newest event is a failed or refused load, with nothing loading, reports ``loading_state`` ``{"stage": "error",
    "target_snapshot_identity": <that identity>}`` — what ``DeploymentManager.wait_for_hotload`` stops on (ours
    keeps ``idle`` and names the failure in ``last_error``). On a LoRA deployment (``lora_name``: the adapter it
    serves) the loading state and errors are the adapter's, and ``loaded_adapters`` ``[{"identity", "status":
    "loaded"}]`` names its served version (the SDK's multi-adapter completion check)."""
    replicas = []
    for replica in status.get("replicas", []):
        track = replica if lora_name is None else (replica.get("lora_adapters") or {}).get(lora_name, {})
        replica = dict(replica)
        if lora_name is not None:
            current = track.get("current_snapshot_identity")
            replica["loaded_adapters"] = [{"identity": current, "status": "loaded"}] if current else []
            replica["loading_state"] = track.get("loading_state") or {"stage": "idle", "target_snapshot_identity": None}
            replica["readiness"] = bool(replica.get("readiness")) and bool(track.get("readiness", True))
        err, state = track.get("last_error"), replica.get("loading_state") or {}
        ready_since = track.get("ready_since")
        newest = err is not None and (ready_since is None or (err.get("at") or 0) >= ready_since)
        if newest and state.get("stage") == "idle":
            replica["loading_state"] = {"stage": "error", "target_snapshot_identity": err["identity"]}
        replicas.append(replica)
    return {**status, "replicas": replicas}


class HotLoadError(ZeroKLDError):
    """A refused or failed hot-load; ``status`` (= ``status_code``) is the HTTP status the API answers with (400 bad
    identity or header, 404 no such snapshot, 409 replay / out-of-order chain / full required / busy, 422 refused by
    verification, 425 drain timeout — the signal's side —; 500 reload failed and the previous snapshot restored, 507
    no space left on the replica's disk — the replica's side: nothing changed either way)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status

    @property
    def status_code(self) -> int:  # type: ignore[override]
        return self.status


class HotLoadConfig(BaseModel):
    """The replica's configuration (vLLM: ``additional_config["zerokld"]["hot_load"]``).

    Attributes:
        snapshot_root: where ``<identity>/`` snapshots are published: a directory, or an fsspec URL
            (``s3://bucket/run``; fetched with :func:`deltasync.fetch_dir`: all or nothing, resumable, checksummed).
        state_dir: ledger + fetched and materialized snapshots; default ``<snapshot_root>/.zerokld_state`` (must be
            local: required when ``snapshot_root`` is a URL). One replica's alone: a second live replica on the
            same state dir is refused at start (:class:`deltasync.replica.StateDirInUseError`).
        initial_identity: identity of the weights the engine started with.
        keep_materialized: decoded snapshots kept on disk (bases of the next deltas).
        allow_non_finite: load snapshots whose weights hold NaN/inf (refused by default).
        replica_id: this replica's name in status and ledger rows (default: the engine adapter's, e.g.
            ``<hostname>:<port>`` for a server).
        fetch_concurrency: files of a remote snapshot downloaded at a time (:func:`deltasync.fetch_dir`: resumable,
            each file checked against its published SHA-256).
        transition: ``async`` or ``sync``: the swap of a request that names none — every request on
            :data:`FIREWORKS_HOT_LOAD` (Fireworks makes it a deployment's setting, ``hotLoadTransitionType``), and
            ours without :data:`TRANSITION_HEADER`.
        account_id, deployment_id: the names Fireworks' clients address this replica by
            (``accounts/<account_id>/deployments/<deployment_id>``: the ``fireworks-deployment`` header, the
            completions ``model``, ``GET /v1/accounts``); one path segment each.
        deployment_lora_name: a LoRA deployment (vLLM ``--enable-lora``): every load on
            :data:`FIREWORKS_HOT_LOAD` is a version of this adapter (a PEFT snapshot), and completions for the
            deployment sample from its served version (the base model until one is loaded). ``None``: loads are
            base weights.
    """

    model_config = ConfigDict(extra="forbid")

    snapshot_root: str
    state_dir: str | None = None
    initial_identity: str = "initial"
    keep_materialized: int = 2
    allow_non_finite: bool = False
    replica_id: str | None = None
    fetch_concurrency: int = Field(4, ge=1)
    transition: Literal["async", "sync"] = "async"
    account_id: str = Field("local", pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")
    deployment_id: str = Field("local", pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")
    deployment_lora_name: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")

    @property
    def deployment_name(self) -> str:
        """``accounts/<account_id>/deployments/<deployment_id>``: Fireworks' full name of this replica's
        deployment."""
        return f"accounts/{self.account_id}/deployments/{self.deployment_id}"

    @property
    def remote(self) -> bool:
        """``snapshot_root`` is a URL other than ``file://`` (snapshots are fetched)."""
        return "://" in self.snapshot_root and not self.snapshot_root.startswith("file://")

    @property
    def root(self) -> str | Path:
        """The snapshot root: a local ``Path``, or the URL without a trailing ``/``."""
        return self.snapshot_root.rstrip("/") if self.remote else Path(self.snapshot_root.removeprefix("file://"))

    def resolved_state_dir(self) -> str:
        """``state_dir``, or the default under a local ``snapshot_root``.

        Raises:
            ValueError: ``snapshot_root`` is a URL and no ``state_dir`` is given."""
        if self.state_dir:
            return self.state_dir
        if self.remote:
            raise ValueError("hot_load.state_dir is required when snapshot_root is a URL")
        return str(Path(self.root) / ".zerokld_state")


@dataclass
class Signal:
    """One hot-load request (the POST body plus the transition headers)."""

    identity: str
    previous_identity: str | None = None  # set: incremental snapshot
    compression_format: str | None = None
    checksum_format: str | None = None
    reset_prompt_cache: str = "all"
    transition: str = "async"
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S
    lora_name: str | None = None  # set: a version of this LoRA adapter

    @classmethod
    def claimed(cls, body: object) -> tuple[str, str | None, str | None]:
        """``(identity, previous identity, lora_name)`` as a request sent them, for the ledger row of a refused
        request (``lora_name``: only when it is a valid name, else ``None``)."""
        if not isinstance(body, dict):
            return str(body), None, None
        meta = body.get("incremental_snapshot_metadata")
        previous = meta.get("previous_snapshot_identity") if isinstance(meta, dict) else None
        try:
            lora_name = cls._lora_name(body)
        except IdentityError:
            lora_name = None
        return str(body.get("identity")), None if previous is None else str(previous), lora_name

    @staticmethod
    def _lora_name(body: dict) -> str | None:
        """The body's ``lora_name`` (``None``: absent). Raises IdentityError: not one path segment."""
        return None if body.get("lora_name") is None else validate_identity(body["lora_name"])

    @classmethod
    def from_request(
        cls, body: object, transition: str | None = None, drain_timeout: str | float | None = None
    ) -> Signal:
        """Parse the POST body and headers (``drain_timeout``: the header's text, or seconds).

        Raises:
            HotLoadError: 400 bad identity, ``reset_prompt_cache`` value or transition header (an empty header too:
                only a missing one means ``async``); 422 malformed body, metadata or drain timeout.
        """
        if not isinstance(body, dict):
            raise HotLoadError("request body must be a JSON object", 422)
        try:
            identity = validate_identity(body.get("identity"))
        except IdentityError as e:
            raise HotLoadError(str(e), 400) from e
        reset = body.get("reset_prompt_cache", "all")
        if reset not in RESET_MODES:  # exactly one of the three: no "", null, false or " all" read as "all"
            raise HotLoadError(f"reset_prompt_cache must be one of {RESET_MODES}, got {str(reset)[:40]!r}", 400)
        try:
            drain = DEFAULT_DRAIN_TIMEOUT_S if drain_timeout is None else float(drain_timeout)
        except ValueError:
            raise HotLoadError(
                f"drain timeout must be a number of seconds, got {str(drain_timeout)[:40]!r}", 422
            ) from None
        try:
            lora_name = cls._lora_name(body)
        except IdentityError as e:
            raise HotLoadError(f"invalid lora_name: {e}", 400) from e
        meta = body.get("incremental_snapshot_metadata")
        sig = cls(
            identity=identity,
            reset_prompt_cache=reset,
            transition="async" if transition is None else transition,
            drain_timeout=drain,
            lora_name=lora_name,
        )
        if meta is not None:
            if not isinstance(meta, dict) or "previous_snapshot_identity" not in meta:
                raise HotLoadError("incremental_snapshot_metadata needs previous_snapshot_identity", 422)
            try:
                sig.previous_identity = validate_identity(meta["previous_snapshot_identity"])
            except IdentityError as e:
                raise HotLoadError(str(e), 400) from e
            sig.compression_format = meta.get("compression_format", DEFAULT_COMPRESSION_FORMAT)
            sig.checksum_format = meta.get("checksum_format", DEFAULT_CHECKSUM_FORMAT)
            if sig.checksum_format not in CHECKSUM_FORMATS:
                raise HotLoadError(
                    f"unsupported checksum_format {sig.checksum_format!r} ({DEFAULT_CHECKSUM_FORMAT})", 422
                )
        if sig.transition not in TRANSITIONS:  # an empty header is not "async": only a missing one defaults
            raise HotLoadError(f"{TRANSITION_HEADER} must be one of {TRANSITIONS}, got {sig.transition[:40]!r}", 400)
        if not 0 <= sig.drain_timeout < float("inf"):  # refuses nan, negative and infinite timeouts
            raise HotLoadError("drain timeout must be a finite non-negative number of seconds", 422)
        return sig

    @classmethod
    def from_fireworks(cls, body: object, transition: str, lora_name: str | None = None) -> Signal:
        """Parse Fireworks' POST body (:data:`FIREWORKS_FIELDS`; ``reset_prompt_cache`` a boolean, default ``true``)
        into the signal :meth:`from_request` would make of ours, with the replica's ``transition`` and, on a LoRA
        deployment (:attr:`HotLoadConfig.deployment_lora_name`), the snapshot a version of adapter ``lora_name``.

        Raises:
            HotLoadError: 422 not an object or an unknown field (``lora_name`` included: Fireworks names adapters
                otherwise); 400 ``reset_prompt_cache`` not a boolean; and everything :meth:`from_request` raises.
        """
        if not isinstance(body, dict):
            raise HotLoadError("request body must be a JSON object", 422)
        unknown = sorted(set(body) - set(FIREWORKS_FIELDS))
        if unknown:
            raise HotLoadError(
                f"unknown field(s) {[u[:40] for u in unknown][:5]}: the Fireworks hot-load body has "
                f"{', '.join(FIREWORKS_FIELDS)}",
                422,
            )
        reset = body.get("reset_prompt_cache", True)
        if not isinstance(reset, bool):
            raise HotLoadError(
                f"reset_prompt_cache must be true or false on {FIREWORKS_HOT_LOAD}, got "
                f"{str(reset)[:40]!r} ({PREFIX} takes {RESET_MODES})",
                400,
            )
        ours = {**body, "reset_prompt_cache": "all" if reset else "none"}
        if lora_name is not None:
            ours["lora_name"] = lora_name
        return cls.from_request(ours, transition)

    @classmethod
    def for_snapshot(
        cls,
        info,
        reset_prompt_cache: str = "all",
        transition: str = "async",
        drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S,
        lora_name: str | None = None,
    ) -> Signal:
        """The signal announcing a written :class:`deltasync.SnapshotInfo` (``lora_name``: a LoRA adapter's)."""
        incremental = info.kind == "incremental"
        return cls(
            info.identity,
            info.previous_identity if incremental else None,
            info.compression_format if incremental else None,
            DEFAULT_CHECKSUM_FORMAT if incremental else None,
            reset_prompt_cache,
            transition,
            drain_timeout,
            lora_name,
        )

    def body(self) -> dict:
        """The POST body (inverse of :meth:`from_request`; the transition travels in headers)."""
        body: dict = {"identity": self.identity, "reset_prompt_cache": self.reset_prompt_cache}
        if self.lora_name is not None:
            body["lora_name"] = self.lora_name
        if self.previous_identity is not None:
            body["incremental_snapshot_metadata"] = {
                "previous_snapshot_identity": self.previous_identity,
                "compression_format": self.compression_format or DEFAULT_COMPRESSION_FORMAT,
                "checksum_format": self.checksum_format or DEFAULT_CHECKSUM_FORMAT,
            }
        return body

    def headers(self) -> dict[str, str]:
        return {TRANSITION_HEADER: self.transition, DRAIN_HEADER: str(self.drain_timeout)}
