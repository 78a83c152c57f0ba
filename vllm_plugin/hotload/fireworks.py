"""Fireworks' serving wire on the zerokld vLLM server: what ``fireworks-ai``'s ``DeploymentManager`` and
``DeploymentSampler`` send, mapped onto vLLM's own OpenAI routes (``docs/wire.md`` §3).

The hot-load routes themselves are :mod:`deltasync.protocol`'s second spelling (:data:`~deltasync.protocol.
FIREWORKS_HOT_LOAD`); this module holds the rest:

* **the key as Fireworks sends it**: ``X-Api-Key: <key>`` is accepted wherever vLLM accepts ``Authorization: Bearer
  <key>`` (the SDK's control-plane calls, ``GET /v1/accounts`` and the deployment's GET, send only that header) — one
  replacement of vLLM's ``AuthenticationMiddleware.verify_token`` (:mod:`vllm_plugin.seams`), inert until the
  hot-load endpoint starts (:func:`enable`); the same keys, never another.
* **the account and the deployment** (:func:`accounts`, :func:`deployment`): this server is one deployment,
  ``accounts/<account_id>/deployments/<deployment_id>`` of its ``hot_load`` settings, ``READY`` while it serves.
* **completions** (:func:`vllm_completion_request`, :func:`fireworks_completion`): ``POST /inference/v1/completions``
  (token ids in, ``raw_output.completion_token_ids`` and ``logprobs.content[]`` out; SSE when ``stream``) is answered
  by vLLM's ``/v1/completions`` of the same server. ``sampling_logprob`` is the log-prob of the distribution the
  token was sampled from: the model's own (zerokld's raw log-probs, the trainer's definition) when the request samples
  from it unchanged (temperature 1, ``top_p`` 1, no ``top_k``/``min_p``); otherwise ``null`` — this server returns no
  temperature- or truncation-processed log-probs (``fireworks-ai`` then refuses to use them, as it does for any
  server without them). Fields that ask for what zerokld does not serve (images, Parquet routing or top-K sampling)
  are refused with 400 rather than ignored.
* **routing matrices** (R3, ``include_routing_matrix``; MoE servers started with vLLM's
  ``--enable-return-routed-experts``): every ``logprobs.content[]`` row carries ``routing_matrix``, the experts that
  the forward which produced the row's log-prob selected — row of position ``q``: the routes of input position
  ``q - 1``, ``[layers, top_k]``, encoded as vLLM encodes its own ``routed_experts`` (base64 ``.npy``); an echoed first
  token, which no forward produced, has ``""``. A datum's ``model_input.routing_matrices`` are then the rows of its
  positions (the SDK's echo rows, first dropped), which the training server replays
  (:mod:`titan_plugin.training_server`). The SDK passes them through unread.

Source: ``fireworks-ai==1.2.30`` (``fireworks/training/sdk/deployment.py``, ``sampling.py``, ``_rest_client.py``).
"""

from __future__ import annotations

import json
import time

from zerokld_plugins.errors import ZeroKLDClientError

__all__ = [
    "API_KEY_HEADER",
    "COMPLETIONS_SCHEMA",
    "FireworksRequestError",
    "accounts",
    "deployment",
    "enable",
    "fireworks_completion",
    "install",
    "routing_matrix",
    "sse",
    "vllm_completion_request",
]

API_KEY_HEADER = "X-Api-Key"
_AUTH_TARGET = "vllm.entrypoints.serve.middleware.authenticate:AuthenticationMiddleware.verify_token"
_ENABLED = [False]

#: request fields passed to vLLM unchanged (same meaning in both APIs)
_PASSED = (
    "prompt",
    "n",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "echo",
    "user",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "ignore_eos",
    "stop_token_ids",
)
#: request fields that only shape Fireworks' reply (always given) or its gateway's metrics
_SHAPING = (
    "model",
    "stream",
    "raw_output",
    "logprobs",
    "top_logprobs",
    "top_k",
    "perf_metrics_in_response",
    "prompt_cache_key",
    "return_token_ids",
)
#: request fields for features this server does not serve: refused, not silently ignored
_REFUSED = ("images", "routing_matrix_format", "top_sampling_logprobs", "top_sampling_format", "sampling_mask")
#: request fields that add to the reply (:func:`fireworks_completion`)
_ADDING = ("include_routing_matrix",)


_INT, _NUM, _BOOL, _STR = {"type": "integer"}, {"type": "number"}, {"type": "boolean"}, {"type": "string"}
#: JSON Schema of the ``/inference/v1/completions`` body, for the server's OpenAPI document (descriptive: the reader
#: is :func:`vllm_completion_request`, then vLLM's own ``CompletionRequest`` for the passed fields). The refused
#: fields are left out (a client that sends them gets 400).
COMPLETIONS_SCHEMA = {
    "type": "object",
    "required": ["model", "prompt"],
    "additionalProperties": False,
    "properties": {
        "model": _STR,
        "prompt": {"oneOf": [{"type": "array", "items": {"type": "integer", "minimum": 0}}, _STR]},
        "n": {"type": "integer", "minimum": 1},
        "max_tokens": {"type": "integer", "minimum": 0},
        "temperature": _NUM,
        "top_p": _NUM,
        "top_k": _INT,
        "min_p": _NUM,
        "seed": _INT,
        "stop": {"oneOf": [_STR, {"type": "array", "items": _STR}]},
        "echo": _BOOL,
        "user": _STR,
        "presence_penalty": _NUM,
        "frequency_penalty": _NUM,
        "repetition_penalty": _NUM,
        "ignore_eos": _BOOL,
        "stop_token_ids": {"type": "array", "items": _INT},
        "stream": _BOOL,
        "raw_output": _BOOL,
        "logprobs": {"oneOf": [_BOOL, {"type": "integer", "minimum": 0}]},
        "top_logprobs": {"type": "integer", "minimum": 0},
        "perf_metrics_in_response": _BOOL,
        "prompt_cache_key": _STR,
        "return_token_ids": _BOOL,
        "include_routing_matrix": _BOOL,
    },
}


#: the body's boolean fields (:data:`COMPLETIONS_SCHEMA`)
_BOOLEANS = tuple(k for k, v in COMPLETIONS_SCHEMA["properties"].items() if v == _BOOL)


class FireworksRequestError(ZeroKLDClientError, ValueError):
    """A completions request this server refuses; ``status`` (= ``status_code``) is the HTTP status."""

    @property
    def status_code(self) -> int:  # type: ignore[override]
        return self.status

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def install() -> None:
    """Replace vLLM's token check (at registration, :mod:`vllm_plugin.seams`); inert until :func:`enable`."""
    from ..seams import replace

    def make(original):
        def verify_token(self, headers) -> bool:
            if original(self, headers):
                return True
            key = headers.get(API_KEY_HEADER) if _ENABLED[0] else None
            return bool(key) and original(self, {"Authorization": f"Bearer {key}"})

        return verify_token

    replace(_AUTH_TARGET, make)


def enable() -> None:
    """Accept ``X-Api-Key`` in this process (the hot-load endpoint's start, in the API server)."""
    _ENABLED[0] = True


def accounts(account_id: str) -> dict:
    """``GET /v1/accounts``: the one account (``DeploymentManager`` resolves its ``account_id`` from it)."""
    return {"accounts": [{"name": f"accounts/{account_id}"}]}


def deployment(name: str, served_model: str, transition: str) -> dict:
    """``GET /v1/accounts/<a>/deployments/<d>``: this server as a ready deployment (Fireworks' camelCase fields that
    ``DeploymentManager.get`` reads)."""
    return {"name": name, "state": "READY", "baseModel": served_model, "hotLoadTransitionType": transition.upper()}


def _samples_from_model(body: dict) -> bool:
    """The request samples from the model's own distribution, so its log-prob is the sampling log-prob."""

    def num(key, default):
        value = body.get(key, default)
        return default if value is None else value

    return (
        num("temperature", 1.0) == 1.0
        and num("top_p", 1.0) == 1.0
        and num("top_k", 0) in (0, -1)
        and num("min_p", 0.0) == 0.0
    )


def vllm_completion_request(
    body: object, served_model: str, deployment_name: str, lora_name: str | None = None
) -> dict:
    """The ``/v1/completions`` body that answers Fireworks' completions ``body`` (never streamed: the reply is
    reshaped, see :func:`fireworks_completion`). ``lora_name``: the adapter a LoRA deployment serves (its newest
    version answers requests for the deployment); ``None``: the base model.

    Raises:
        FireworksRequestError: not an object; ``model`` neither the deployment's name nor the served model (the
            message names the deployment only: the served model may be a server path); a refused or unknown field;
            a boolean field (``stream``, ``echo``, ``raw_output``, ...) not a JSON boolean; ``top_logprobs`` not a
            non-negative integer; ``include_routing_matrix`` without ``logprobs``.
    """
    if not isinstance(body, dict):
        raise FireworksRequestError("request body must be a JSON object", 422)
    model = body.get("model")
    if model not in (deployment_name, served_model):
        raise FireworksRequestError(
            f"model must be this server's deployment {deployment_name!r}, got {str(model)[:80]!r}"
        )
    for key in _BOOLEANS:  # the published schema's booleans: JSON true / false (or null), nothing else
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise FireworksRequestError(f"{key} must be true or false, got {str(body[key])[:20]!r}")
    refused = sorted(k for k in body if k in _REFUSED and body[k] not in (None, False))
    if refused:
        raise FireworksRequestError(f"not served by zerokld: {refused}")
    unknown = sorted(k[:40] for k in body if k not in _PASSED + _SHAPING + _REFUSED + _ADDING)
    if unknown:
        raise FireworksRequestError(f"unknown field(s) {unknown[:5]}")
    req = {k: body[k] for k in _PASSED if k in body and body[k] is not None}
    target = lora_name if lora_name is not None and model == deployment_name else served_model
    req.update(model=target, stream=False, return_token_ids=True, return_tokens_as_token_ids=True)
    top_k = body.get("top_k")
    if top_k not in (None, 0):
        req["top_k"] = top_k
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 0):
        raise FireworksRequestError(f"top_logprobs must be a non-negative integer, got {str(top)[:20]!r}")
    if logprobs is None or isinstance(logprobs, bool):
        if logprobs or top:
            req["logprobs"] = int(top or 0)  # the sampled token's log-prob (+ top alternatives)
    elif isinstance(logprobs, int):
        req["logprobs"] = logprobs
    else:
        raise FireworksRequestError(f"logprobs must be true, false or a number, got {str(logprobs)[:40]!r}")
    if body.get("include_routing_matrix") and "logprobs" not in req:
        raise FireworksRequestError("include_routing_matrix needs logprobs: the routing matrices ride on its rows")
    return req


def routing_matrix(routes) -> str:
    """One position's routes (``[layers, top_k]`` integer array) as a ``routing_matrix`` string: base64 of its
    ``.npy`` bytes, vLLM's encoding of ``routed_experts`` (``vllm.utils.serial_utils.numpy2base64``)."""
    from vllm.utils.serial_utils import numpy2base64

    return numpy2base64(routes)


def _routes(choice: dict, positions: int):
    """vLLM's ``routed_experts`` of a choice, ``[positions, layers, top_k]``. Raises FireworksRequestError: absent
    (400: the server records no routes) or of another length (500)."""
    from shared_numerics.rollout import decode_routes

    if choice.get("routed_experts") is None:
        raise FireworksRequestError(
            "include_routing_matrix: this deployment records no routes (an MoE model served "
            "with --enable-return-routed-experts does)"
        )
    routes = decode_routes(choice["routed_experts"])
    if routes.ndim != 3 or routes.shape[0] != positions:
        raise FireworksRequestError(f"vLLM's routes cover {routes.shape[:1]} positions, not {positions}", 500)
    return routes


def _content(lp: dict, ids: list[int], prompt_rows: int, exact: bool, first: int = 0, routes=None) -> list[dict]:
    """``logprobs.content[]`` of one choice from vLLM's legacy completion log-probs (``tokens`` as ``token_id:N``);
    ``first``: the position of the first row; ``routes``: ``[positions - 1, layers, top_k]`` or ``None`` (no
    ``routing_matrix``)."""
    out = []
    top = lp.get("top_logprobs") or [None] * len(ids)
    for i, (tok, value, alts) in enumerate(
        zip(lp.get("tokens") or [], lp.get("token_logprobs") or [], top, strict=True)
    ):
        if value is None and i == 0:  # an echoed first prompt token: nothing precedes it, the SDK drops the row
            value = 0.0
        entry = {
            "token": tok,
            "token_id": ids[i],
            "logprob": value,
            "sampling_logprob": value if exact and i >= prompt_rows else None,
        }
        if alts:
            entry["top_logprobs"] = [
                {"token": t, "token_id": int(t.split(":", 1)[1]), "logprob": v} for t, v in alts.items()
            ]
        if routes is not None:  # the forward at the previous position produced this row
            entry["routing_matrix"] = routing_matrix(routes[first + i - 1]) if first + i else ""
        out.append(entry)
    return out


def fireworks_completion(vllm_reply: dict, body: dict, deployment_name: str) -> dict:
    """Fireworks' completions reply from vLLM's: per choice ``raw_output`` (``prompt_token_ids``,
    ``completion_token_ids`` — prompt + completion with ``echo``), ``logprobs.content[]`` rows (prompt rows too
    with ``echo``: their ``sampling_logprob`` is ``null``, and the first token's ``logprob``, which does not exist,
    reads 0.0 — the client drops that row, as it does Fireworks'), zerokld's choice fields (``zerokld_seed``,
    ``zerokld_numerics``, ``weight_versions``) kept.

    With ``include_routing_matrix`` every row carries its ``routing_matrix`` (see the module).

    Raises:
        FireworksRequestError: (500) vLLM's reply lacks the token ids this reply needs, or its routes do not cover
            them; (400) routing matrices asked of a server that records no routes.
    """
    echo, exact = bool(body.get("echo")), _samples_from_model(body)
    choices = []
    for choice in vllm_reply.get("choices", []):
        prompt_ids, ids = choice.get("prompt_token_ids"), choice.get("token_ids")
        if prompt_ids is None or ids is None:
            raise FireworksRequestError("vLLM's reply carries no token ids", 500)
        completion = (list(prompt_ids) + list(ids)) if echo else list(ids)
        out = {
            k: v for k, v in choice.items() if k not in ("logprobs", "token_ids", "prompt_token_ids", "prompt_logprobs")
        }
        out["raw_output"] = {"prompt_token_ids": list(prompt_ids), "completion_token_ids": completion}
        routes = None
        if body.get("include_routing_matrix") and choice.get("logprobs") is not None:
            routes = _routes(choice, len(prompt_ids) + len(ids) - 1)
        if choice.get("logprobs") is not None:
            lp = choice["logprobs"]
            if len(lp.get("tokens") or []) != len(completion):
                raise FireworksRequestError("vLLM's log-probs do not cover the token ids", 500)
            out["logprobs"] = {
                "content": _content(
                    lp, completion, len(prompt_ids) if echo else 0, exact, 0 if echo else len(prompt_ids), routes
                )
            }
        choices.append(out)
    return {
        "id": vllm_reply.get("id"),
        "object": "text_completion",
        "created": vllm_reply.get("created", int(time.time())),
        "model": deployment_name,
        "choices": choices,
        "usage": vllm_reply.get("usage"),
    }


def sse(reply: dict) -> bytes:
    """``reply`` as one server-sent event and ``[DONE]`` (the SDK concatenates ``logprobs.content`` over chunks and
    keeps the last ``raw_output``: one chunk holding everything is a complete stream)."""
    return b"data: " + json.dumps(reply).encode() + b"\n\ndata: [DONE]\n\n"
