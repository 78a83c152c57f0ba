"""The hot-load HTTP API on vLLM's OpenAI server, as a ``vllm.endpoint_plugins`` entry point (``zerokld_hotload``).

The replica state machine and the wire protocol are :mod:`deltasync`'s (:class:`deltasync.Replica`,
:mod:`deltasync.protocol`); this module only maps HTTP onto them. Switch it on with both plugin names allow-listed and
the ``hot_load`` section in the zerokld config::

    VLLM_PLUGINS=zerokld,zerokld_hotload python -m vllm.entrypoints.openai.api_server --model DIR ... \\
        --additional-config '{"zerokld": {"batch_invariant": true,
                                          "hot_load": {"snapshot_root": "/snapshots", "state_dir": "/var/zerokld"}}}'

Routes (guarded by the server's keys, ``--api-key`` or ``VLLM_API_KEY``, as ``Authorization: Bearer <key>`` or
Fireworks' ``X-Api-Key: <key>``; 401 otherwise):

* ``POST /zerokld/v1/hot_load`` — body ``{"identity", "incremental_snapshot_metadata"?: {"previous_snapshot_identity",
  "compression_format", "checksum_format"}, "reset_prompt_cache"?: "all"|"new_session"|"none"}``; headers
  ``x-zerokld-hot-load-transition: async|sync`` (default async) and ``x-zerokld-hot-load-drain-timeout: <seconds>``
  (default 90; sync only: exceeding it answers 425 and changes nothing). Returns the ledger row once the snapshot
  serves; errors: 400 (bad identity), 404 (no such snapshot), 409 (replay, out-of-order chain, full required,
  another load running), 422 (snapshot refused by verification), 425 (drain timeout), 500 (reload failed; the
  previous snapshot was restored).
* ``GET /zerokld/v1/hot_load/status`` — per replica: ``replica`` (``hot_load.replica_id``, default
  ``<hostname>:<port>``), ``current_snapshot_identity``, ``weights_digest`` (equal across replicas serving the same
  bits), ``ready_since``, ``readiness``, ``loading_state{stage, target_snapshot_identity}``, ``last_error``,
  ``lora_adapters``.
* ``GET /zerokld/v1/hot_load/ledger``; ``DELETE /zerokld/v1/hot_load/ledger`` (the next load must be full); with
  ``?lora_name=NAME``, that LoRA adapter's ledger (404: no adapter of that name was hot-loaded).

Fireworks' spelling of the same API, for ``fireworks-ai``'s ``DeploymentManager`` / ``DeploymentSampler`` /
``WeightSyncer`` unmodified (:mod:`deltasync.protocol`, :mod:`vllm_plugin.hotload.fireworks`):

* ``POST /hot_load/v1/models/hot_load`` — ``{"identity", "reset_prompt_cache"?: true|false,
  "incremental_snapshot_metadata"?}``, header ``fireworks-deployment: accounts/<account_id>/deployments/
  <deployment_id>`` (404 for another); the swap's transition is ``hot_load.transition``. The ledger row once the
  snapshot serves, or 202 if it still loads after :data:`FIREWORKS_ACK_S` (the client then polls); errors as above.
* ``GET /hot_load/v1/models/hot_load`` — ``{"replicas": [...]}`` (the status above; a failed newest load reads
  ``loading_state.stage == "error"``).
* ``GET /v1/accounts``, ``GET /v1/accounts/<account_id>/deployments/<deployment_id>`` — this server as the one
  account's one ``READY`` deployment.
* ``POST /inference/v1/completions`` — token ids in; ``raw_output.completion_token_ids`` and
  ``logprobs.content[].sampling_logprob`` out (SSE with ``stream``), answered by this server's ``/v1/completions``.

A body with ``"lora_name"`` (vLLM's ``--enable-lora`` server) hot-loads a version of that LoRA adapter (a PEFT
adapter snapshot, full or a delta against the adapter's served version; its own ledger and chain): requests whose
``model`` is ``lora_name`` get it from then on, requests admitted before finish on the version they started with,
and every response's ``model`` names the version that produced it (``<lora_name>@<identity>``). Status lists each
adapter under ``lora_adapters``.

``reset_prompt_cache`` of a swap: ``all`` (default) drops every cached prefix and makes in-flight requests recompute
their KV with the new weights; ``new_session`` keeps in-flight requests' KV and the cached prefixes of sessions seen
before the swap — a session is the ``x-zerokld-session-id`` header, else the OpenAI ``user`` field — while new
sessions and requests without one start from prefixes computed with the new weights
(:mod:`vllm_plugin.hotload.sessions`: ``/v1/completions``, ``/v1/chat/completions`` and ``/invocations`` requests get
a ``cache_salt`` from their session's epoch; while that isolation is in force, other POST routes that could read the
prefix cache get 409); ``none`` keeps everything.

With hot-load on, every serving route (all but the probes in :data:`PROBES`: ``/v1/*``, SageMaker's
``/invocations``, ``/pooling``, ``/tokenize``, ...) needs the key, gets HTTP 425 during a ``sync`` swap, and answers
with ``x-zerokld-snapshot-identity``: the snapshot(s) that sampled the response's tokens (comma-separated in order of
use when a response spans a swap; for a stream, the one that sampled its first token). Completion and chat choices
carry ``weight_versions`` (vLLM's per-token spans, :mod:`vllm_plugin.hotload.attribution`), streamed chunks too.
Source: vLLM ``plugins/endpoint_plugins/interface.py``; Fireworks' hot-load API (``docs/design.md`` §5).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from deltasync.ledger import LedgerWriteError
from deltasync.protocol import (
    DRAIN_HEADER,
    FIREWORKS_DEPLOYMENT_HEADER,
    FIREWORKS_HOT_LOAD,
    IDENTITY_HEADER,
    NO_SPACE,
    PREFIX,
    SESSION_HEADER,
    TRANSITION_HEADER,
    HotLoadError,
    Signal,
    fireworks_status,
    openapi_operations,
    public_message,
)

from . import fireworks
from .attribution import versions_in_sse, versions_of
from .sessions import SALTED_ROUTES, isolation_refuses

__all__ = ["FIREWORKS_ACK_S", "PROBES", "ZeroKLDHotLoadEndpoint"]

logger = logging.getLogger(__name__)

#: routes that stay open with hot-load on (health and metadata probes; vLLM leaves them unguarded too)
PROBES = frozenset({"/health", "/ping", "/version", "/load", "/openapi.json", "/docs", "/redoc"})
#: vLLM's Prometheus route: behind the key with hot-load on (a scraper sends it as ``Authorization: Bearer``), its
#: text with the served model's name where vLLM's labels carry the ``--model`` path
METRICS = "/metrics"
#: seconds a Fireworks-spelled POST waits for its load before answering 202 (the load goes on; GET shows it):
#: ``DeploymentManager.hotload`` gives up after 60
FIREWORKS_ACK_S = 45.0
_ACCOUNTS = "/v1/accounts"


async def _salt(request: Request, epochs) -> None:
    """Give a generation request its prompt-cache salt (:mod:`vllm_plugin.hotload.sessions`): the session is the
    ``x-zerokld-session-id`` header, else the body's OpenAI ``user``; a body that is not a JSON object is left for
    vLLM to refuse."""
    body = await request.body()
    try:
        data = json.loads(body)
    except ValueError:
        return
    if not isinstance(data, dict):
        return
    user = data.get("user")
    session = request.headers.get(SESSION_HEADER) or (user if isinstance(user, str) and user else None)
    client_salt = data.get("cache_salt")
    data["cache_salt"] = epochs.salt(
        None if session is None else session[:256], client_salt if isinstance(client_salt, str) else None
    )
    new = json.dumps(data).encode()
    # Starlette's BaseHTTPMiddleware replays the body the middleware read (Request._body) to the route
    request._body = new
    request.scope["headers"] = [(k, v) for k, v in request.scope["headers"] if k != b"content-length"] + [
        (b"content-length", str(len(new)).encode())
    ]


async def _with_identity(response, admitted: str):
    """``response`` with :data:`IDENTITY_HEADER` naming the snapshot(s) that sampled its tokens (the choices'
    ``weight_versions``, :mod:`vllm_plugin.hotload.attribution`): a JSON body — every snapshot, comma-separated in
    order of use; a stream — the one that sampled its first token (headers precede the body: each chunk's
    ``weight_versions`` tells the rest). A response without tokens: ``admitted`` (the one serving when it arrived)."""
    ctype = response.headers.get("content-type", "")
    headers = dict(response.headers)
    if ctype.startswith("text/event-stream"):
        body, head, versions = response.body_iterator, [], []
        async for chunk in body:  # hold the headers until the first token is attributed
            head.append(chunk)
            if versions := versions_in_sse(chunk):
                break

        async def replay():
            for chunk in head:
                yield chunk
            async for chunk in body:
                yield chunk

        headers[IDENTITY_HEADER] = versions[0] if versions else admitted
        return StreamingResponse(replay(), status_code=response.status_code, headers=headers)
    if ctype.startswith("application/json"):
        content = b"".join([c if isinstance(c, bytes) else c.encode() async for c in response.body_iterator])
        versions = []
        if b'"weight_versions"' in content:  # parse only bodies that carry attributions
            try:
                data = json.loads(content)
                versions = versions_of(data.get("choices")) if isinstance(data, dict) else []
            except ValueError:
                pass
        headers[IDENTITY_HEADER] = ",".join(versions) or admitted
        return Response(content, status_code=response.status_code, headers=headers)
    response.headers[IDENTITY_HEADER] = admitted
    return response


def _serve_without_paths(models, model_path: str) -> str:
    """Keep server paths out of answers (issue 54): without ``--served-model-name`` vLLM serves a local ``--model``
    under its path (``launchers/api_server/app_state.py``: ``served_model_names = [args.model]``), so every response's
    ``model`` and ``/v1/models`` (``id``; ``root``, which is the path even with a served name, and a LoRA card's
    adapter path) would show it. Here ``models`` (the server's ``OpenAIServingModels``) serves a local model named by
    its path under the path's last component instead, and ``/v1/models`` cards name no path (``root`` is the card's
    ``id``); the path is still accepted as a request's ``model``, so clients that send it keep working. A hub id
    (not a local path) and ``--served-model-name`` names are kept. Returns the first served name."""
    from vllm.entrypoints.openai.models.protocol import BaseModelPath

    local = Path(model_path).exists()
    name = Path(model_path).name if local and Path(model_path).name else model_path
    paths = models.base_model_paths  # the list its registry shares
    paths[:] = [BaseModelPath(name=name if p.name == model_path else p.name, model_path=name) for p in paths]
    registry, show = models.registry, models.show_available_models
    accepts = registry.is_base_model
    registry.is_base_model = lambda model: model == model_path or accepts(model)

    async def show_available_models():
        cards = await show()
        for card in cards.data:
            card.root = card.id
        return cards

    models.show_available_models = show_available_models
    return paths[0].name


class ZeroKLDHotLoadEndpoint:
    """``vllm.endpoint_plugins`` factory result (see the module docstring)."""

    name = "zerokld_hotload"
    required_tasks = ("generate",)

    def __init__(self) -> None:
        self.manager = None
        self.auth = None  # vLLM's AuthenticationMiddleware over the server's keys; None: no key configured
        self.salting = False  # prefix caching on: generation requests get their prompt-cache epoch's salt
        self.served_model = None  # the OpenAI model name requests use (never a server path: _serve_without_paths)
        self.model_path = ""  # vllm serve's --model (kept out of answers)
        self.port = None  # this server's port: Fireworks completions are answered by its own /v1/completions
        self._loads: set = set()  # Fireworks-spelled loads still running after their 202

    def _authorized(self, request: Request) -> bool:
        """vLLM's own check (``AuthenticationMiddleware.verify_token``, ``entrypoints/serve/middleware/
        authenticate.py``): the same keys guard the hot-load routes as guard ``/v1``."""
        return self.auth is None or self.auth.verify_token(request.headers)

    def _guard(self, request: Request):
        if not self._authorized(request):
            return JSONResponse({"error": "missing or wrong API key"}, status_code=401)
        if self.manager is None:
            return JSONResponse(
                {"error": "hot-load is not enabled (additional_config zerokld.hot_load)"}, status_code=404
            )
        return None

    def _deployment_refused(self, got: str | None):
        """404 unless ``got`` (the ``fireworks-deployment`` header, a lookup's path) names this server's deployment
        (``None``: it does)."""
        name = self.manager.config.deployment_name
        if got != name:
            return JSONResponse(
                {"error": f"no deployment {str(got)[:120]!r} here: this server is {name!r}"}, status_code=404
            )
        return None

    async def _signal(self, request: Request, parse, wait: float | None = None):
        """Parse the POST body with ``parse(body)`` and load it: the ledger row once it serves, or an error answer.
        ``wait``: answer 202 after that many seconds while the load goes on."""
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse({"error": "body is not JSON"}, status_code=422)
        sig = None
        try:
            sig = parse(body)
            if wait is None:
                row = await self.manager.signal(sig)
            else:  # a task, so that answering 202 does not cancel the load
                load = asyncio.ensure_future(self.manager.signal(sig))
                load.add_done_callback(self._load_done)
                try:
                    row = await asyncio.wait_for(asyncio.shield(load), wait)
                except TimeoutError:
                    self._loads.add(load)
                    return JSONResponse(
                        {
                            "identity": sig.identity,
                            "loading_state": self.manager.status()["replicas"][0]["loading_state"],
                        },
                        status_code=202,
                    )
        except HotLoadError as e:
            if sig is None:  # refused while parsing: recorded under the identities as sent (bounded)
                identity, previous, lora_name = Signal.claimed(body)
                self.manager.track_for(lora_name).ledger.refused(identity, str(e), previous_identity=previous)
            return JSONResponse({"error": public_message(e)}, status_code=e.status)
        return JSONResponse(row)

    def _load_done(self, load) -> None:
        """A Fireworks-spelled load's end (its outcome is in the ledger and the status); one that outlived its 202
        logs a failure here too (the exception is retrieved either way)."""
        answered = load not in self._loads
        self._loads.discard(load)
        error = None if load.cancelled() else load.exception()
        if error is not None and not answered:
            logger.warning("zerokld hot-load failed after its 202: %s", public_message(error))

    def attach_router(self, app: FastAPI) -> None:
        described = openapi_operations()  # each route's body and headers in /openapi.json (the API fuzzer reads it)

        @app.post(PREFIX, openapi_extra=described["POST", PREFIX])
        async def signal(request: Request):
            if (resp := self._guard(request)) is not None:
                return resp
            transition = request.headers.get(TRANSITION_HEADER, self.manager.config.transition)
            return await self._signal(
                request, lambda body: Signal.from_request(body, transition, request.headers.get(DRAIN_HEADER))
            )

        @app.post(FIREWORKS_HOT_LOAD, openapi_extra=described["POST", FIREWORKS_HOT_LOAD])
        async def fireworks_signal(request: Request):
            if (
                resp := self._guard(request)
                or self._deployment_refused(request.headers.get(FIREWORKS_DEPLOYMENT_HEADER))
            ) is not None:
                return resp
            cfg = self.manager.config
            return await self._signal(
                request,
                lambda body: Signal.from_fireworks(body, cfg.transition, cfg.deployment_lora_name),
                wait=FIREWORKS_ACK_S,
            )

        @app.get(FIREWORKS_HOT_LOAD, openapi_extra=described["GET", FIREWORKS_HOT_LOAD])
        async def fireworks_hot_load_status(request: Request):
            if (
                resp := self._guard(request)
                or self._deployment_refused(request.headers.get(FIREWORKS_DEPLOYMENT_HEADER))
            ) is not None:
                return resp
            return JSONResponse(fireworks_status(self.manager.status(), self.manager.config.deployment_lora_name))

        @app.get(_ACCOUNTS)
        async def accounts(request: Request):
            if (resp := self._guard(request)) is not None:
                return resp
            return JSONResponse(fireworks.accounts(self.manager.config.account_id))

        @app.get(_ACCOUNTS + "/{account_id}/deployments/{deployment_id}")
        async def deployment(account_id: str, deployment_id: str, request: Request):
            got = f"accounts/{account_id}/deployments/{deployment_id}"
            if (resp := self._guard(request) or self._deployment_refused(got)) is not None:
                return resp
            cfg = self.manager.config
            return JSONResponse(fireworks.deployment(cfg.deployment_name, self.served_model, cfg.transition))

        @app.post(
            "/inference/v1/completions",
            openapi_extra={
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": fireworks.COMPLETIONS_SCHEMA}},
                }
            },
        )
        async def fireworks_completions(request: Request):
            if (resp := self._guard(request)) is not None:
                return resp
            return await self._completions(request)

        @app.get(PREFIX + "/status")
        async def status(request: Request):
            if (resp := self._guard(request)) is not None:
                return resp
            return JSONResponse(self.manager.status())

        def track(request: Request):
            """The ledger track a ``?lora_name=`` query names (none: the base weights'), or an error response."""
            name = request.query_params.get("lora_name")
            if name is not None and name not in self.manager.adapters:
                return JSONResponse({"error": f"no hot-loaded LoRA adapter named {name[:64]!r}"}, status_code=404)
            return self.manager.track_for(name)

        @app.get(PREFIX + "/ledger", openapi_extra=described["GET", PREFIX + "/ledger"])
        async def ledger(request: Request):
            if (resp := self._guard(request)) is not None:
                return resp
            if isinstance(t := track(request), JSONResponse):
                return t
            return JSONResponse(t.ledger.to_json())

        @app.delete(PREFIX + "/ledger", openapi_extra=described["DELETE", PREFIX + "/ledger"])
        async def reset_ledger(request: Request):
            if (resp := self._guard(request)) is not None:
                return resp
            if isinstance(t := track(request), JSONResponse):
                return t
            if t.lock.locked():
                return JSONResponse({"error": "a hot-load is in progress"}, status_code=409)
            try:
                t.ledger.reset()
            except LedgerWriteError as e:  # the ledger is unchanged
                return JSONResponse({"error": public_message(e)}, status_code=507 if e.errno in NO_SPACE else 500)
            return JSONResponse(t.ledger.to_json())

        @app.middleware("http")
        async def serving_routes(request: Request, call_next):
            manager = self.manager
            path = request.url.path
            if (
                manager is None
                or path.startswith((PREFIX, FIREWORKS_HOT_LOAD, _ACCOUNTS))
                or path in PROBES
                or request.method == "OPTIONS"
            ):
                return await call_next(request)
            # vLLM's own guard covers /v1, /v2, /inference, /cohere only; with hot-load on, every serving route
            # (SageMaker's /invocations, /pooling, /tokenize, ...) needs the key and honours the sync drain
            if not self._authorized(request):
                return JSONResponse({"error": "Unauthorized"}, status_code=401)
            if path == METRICS:
                return await self._metrics_without_paths(await call_next(request))
            if manager.draining:
                return JSONResponse(
                    {"error": "a sync hot-load is in progress; retry"},
                    status_code=425,
                    headers={IDENTITY_HEADER: manager.ledger.current_identity},
                )
            if self.salting and manager.engine.epochs.isolating and isolation_refuses(request.method, path):
                return JSONResponse(
                    {
                        "error": f"{path} takes no prompt-cache salt: refused while a reset_prompt_cache "
                        "'new_session' isolation is in force (use /v1/completions, "
                        "/v1/chat/completions or /invocations)"
                    },
                    status_code=409,
                    headers={IDENTITY_HEADER: manager.ledger.current_identity},
                )
            if self.salting and request.method == "POST" and path in SALTED_ROUTES:
                await _salt(request, manager.engine.epochs)
            return await _with_identity(await call_next(request), manager.ledger.current_identity)

    async def _metrics_without_paths(self, resp):
        """vLLM's ``/metrics`` answer with every occurrence of the ``--model`` path (as given and resolved: vLLM's
        ``model_name`` labels) replaced by the served model's name (:func:`_serve_without_paths`)."""
        text = b"".join([chunk async for chunk in resp.body_iterator])
        for p in sorted({self.model_path, str(Path(self.model_path).resolve())}, key=len, reverse=True):
            if p and p != self.served_model:
                text = text.replace(p.encode(), self.served_model.encode())
        headers = {k: v for k, v in resp.headers.items() if k.lower() != "content-length"}
        return Response(text, status_code=resp.status_code, headers=headers)

    async def _completions(self, request: Request):
        """Fireworks' ``/inference/v1/completions`` answered by this server's own ``/v1/completions`` (loopback,
        through every guard and salt of a direct request), reshaped (:mod:`vllm_plugin.hotload.fireworks`)."""
        import httpx

        try:
            body = await request.json()
        except ValueError:
            return JSONResponse({"error": "body is not JSON"}, status_code=422)
        name, lora = self.manager.config.deployment_name, self.manager.config.deployment_lora_name
        track = self.manager.adapters.get(lora) if lora is not None else None
        if track is None or track.ledger.current is None:
            lora = None  # no version loaded yet: the deployment serves the base model
        try:
            req = fireworks.vllm_completion_request(body, self.served_model, name, lora)
        except fireworks.FireworksRequestError as e:
            return JSONResponse({"error": {"message": str(e), "code": "invalid_request_error"}}, status_code=e.status)
        forwarded = ("authorization", fireworks.API_KEY_HEADER.lower(), SESSION_HEADER)  # the key as sent: both pass
        headers = {k: v for k, v in request.headers.items() if k.lower() in forwarded}
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{self.port}", timeout=None) as client:
            inner = await client.post("/v1/completions", json=req, headers=headers)
        passed = {k: v for k, v in inner.headers.items() if k.lower() == IDENTITY_HEADER}
        if inner.status_code != 200:
            return Response(inner.content, status_code=inner.status_code, media_type="application/json", headers=passed)
        try:
            reply = fireworks.fireworks_completion(inner.json(), body, name)
        except fireworks.FireworksRequestError as e:
            return JSONResponse({"error": {"message": str(e)}}, status_code=e.status, headers=passed)
        if body.get("stream"):
            return Response(fireworks.sse(reply), media_type="text/event-stream", headers=passed)
        return JSONResponse(reply, headers=passed)

    async def init_state(self, engine_client, state, args) -> None:
        from deltasync import Replica

        from ..config import ZeroKLDConfigError, from_vllm_config
        from .engine import ServerEngine

        if engine_client is None:
            return
        try:
            cfg = from_vllm_config(engine_client.vllm_config).hot_load
        except ZeroKLDConfigError:
            return  # the model constructor already refused the engine at start
        if cfg is None:
            return
        # vLLM's resolution (entrypoints/serve/middleware/register.py): --api-key wins, else VLLM_API_KEY
        import vllm.envs as envs
        from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

        key = getattr(args, "api_key", None)
        keys = [key] if isinstance(key, str) else list(key or [])
        if tokens := [k for k in (keys or [envs.VLLM_API_KEY]) if k]:
            self.auth = AuthenticationMiddleware(app=None, tokens=tokens)
        from .attribution import enable

        enable()  # weight_versions on completions and chat choices (this process serves them)
        fireworks.enable()  # the key as X-Api-Key too (Fireworks' control-plane calls)
        names = getattr(args, "served_model_name", None)
        self.model_path = str(args.model)
        self.served_model = (names[0] if isinstance(names, list) and names else names) or args.model
        if (models := getattr(state, "openai_serving_models", None)) is not None:
            self.served_model = _serve_without_paths(models, args.model)
        self.port = args.port
        self.salting = bool(engine_client.vllm_config.cache_config.enable_prefix_caching)
        self.manager = Replica(
            ServerEngine(engine_client, getattr(state, "openai_serving_models", None)),
            cfg,
            args.model,
            replica_id=f"{socket.gethostname()}:{args.port}",
        )
        await self.manager.restore()
