"""Fireworks' Training API over the real TorchTitan trainer: the JSON wire ``fireworks-ai``'s
``FiretitanServiceClient`` sends (Tinker 0.23's, ``docs/wire.md`` §1-2), served by
FastAPI + uvicorn over :class:`titan_plugin.client.TrainingClient`, so Fireworks' SDK — unmodified — trains with
zerokld's numerics and its snapshots hot-load into the zerokld vLLM server (``vllm_plugin.hotload``)::

    python -m titan_plugin.training_server --checkpoint /path/to/hf_ckpt --snapshot-root /snapshots \\
        --api-key $KEY --port 8001

Routes (under ``/api/v1``, key required as ``X-Api-Key``; 401 otherwise): ``create_session``,
``session_heartbeat``, ``telemetry``, ``create_model`` (full-parameter; ``lora_config.rank`` > 0 trains LoRA),
``get_info``, ``GET get_server_capabilities``, ``forward``, ``forward_backward`` (the losses registered through the
``zerokld`` hooks, Tinker's names and ``loss_fn_config``), ``optim_step``, ``save_weights_for_sampler``,
``save_weights``, ``load_weights``, ``GET list_checkpoints``, ``unload_model``, ``retrieve_future``; tinker's
``client/config``, ``create_sampling_session``, ``GET samplers/{id}``, ``asample`` (below).

Every training call answers ``{"request_id"}`` at once and runs on the trainer's one worker thread in ``seq_id`` order
per model (the SDK may upload forward_backward chunks in parallel; a later ``seq_id`` waits for the earlier ones — for
``seq_gap_s`` at most, then it fails as a user error —, a ``seq_id`` already used is refused with 400);
``retrieve_future`` long-polls up to :data:`POLL_S` seconds, then answers ``try_again``. Failures come back as
``{"error", "category": "user" | "server"}`` (malformed data, unknown losses and refused numerics are the user's);
messages carry no absolute server paths.

Snapshots: ``save_weights_for_sampler`` writes ``<snapshot_root>/<path>`` (``path``: the SDK's qualified name, which
``WeightSyncer`` then hot-loads) through :class:`deltasync.SnapshotWriter`, stamped with the trainer's numerics mode.
``checkpoint_type`` ``base`` writes a full snapshot; ``delta`` an ``arc_v2`` delta against the model's previous
snapshot — the server's own record of its chain (a ``delta`` with no previous snapshot is written full); the replica
checks the chain from the snapshot's ``delta.json``, never from the client's pairing. LoRA models write PEFT adapters
(always full).

``optim_step`` applies the request's AdamParams (learning rate, betas, eps, weight decay; ``grad_clip_norm`` 0 = no
clipping, as in Tinker) and answers ``grad_norm:mean``. ``save_weights`` (a name; ``overwrite``) keeps model and
optimizer through TorchTitan's checkpointer, ``load_weights`` restores it (``optimizer: false``: the weights, with a
fresh optimizer), ``GET list_checkpoints`` names them. ``forward_backward_custom`` works as Fireworks runs it:
``forward`` and ``forward_backward`` on the client.

LoRA (``lora_config.rank`` > 0; ``--max-lora-rank`` = the vLLM server's): ``save_weights_for_sampler`` writes the
PEFT adapter as a full snapshot, which a LoRA deployment (``hot_load.deployment_lora_name``) serves as a new version
of its adapter.

Restarts (``--state-dir``): every model's state after its last ``optim_step`` is checkpointed; a server restarted on
the same state dir (and port) resumes each model there — the work after it, accumulated gradients included, is gone —
and its clients go on with their ``model_id`` and numbering.

tinker 0.38 (``tinker.ServiceClient``, a ``tml-`` key; issue 38): ``client/config`` answers the client's defaults but
asks for zstd-compressed protobuf bodies (``client/dynamic_config``: the defaults), and ``forward`` /
``forward_backward`` bodies in tinker's protobuf (zstd or not) are read as the JSON ones
(:mod:`titan_plugin.tinker_proto`) — a ``forward_only`` request is a ``forward`` — and their results go back as
protobuf; ``create_lora_training_client(rank=0)`` trains full-parameter. Sampling (with ``--sampler-url``: the zerokld
vLLM server on the same snapshot root, LoRA on for LoRA models; :mod:`titan_plugin.tinker_sampler`): tinker's
``save_weights_for_sampler`` (``kind`` set) answers ``tinker://<model_id>/sampler_weights/<name>``; without a name
(``save_weights_and_get_sampling_client``) it loads the model's next snapshot into the sampler — a LoRA model's adapter
as a version of the vLLM adapter named ``<model_id>``, a full-parameter model's weights as a delta where the sampler
serves the previous one — and answers a sampling session on it; ``create_sampling_session`` (a saved ``tinker://`` path,
loaded first, or ``base_model``), ``GET samplers/{id}`` and ``asample`` (``sample_sequence_ids``; the result a protobuf
``SampleResponse``, run beside the training calls) complete it.

MoE routing replay (R3): a datum's ``model_input.routing_matrices`` (one per position, as the zerokld vLLM server's
``include_routing_matrix`` rows give them) are replayed in its forward (:func:`routes_of`,
:mod:`titan_plugin.routing`); Parquet routing references are refused.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import itertools
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, ValidationError

from zerokld_plugins.errors import ZeroKLDClientError

from . import tinker_proto

__all__ = ["POLL_S", "WORK_DIR", "Limits", "TrainingServer", "TrainingServerProcess", "datums", "main", "routes_of"]

logger = logging.getLogger(__name__)

#: the answer to a request that failed on this server's side (the details are in its log)
INTERNAL_ERROR = "internal server error (the training server's log has the details)"
#: seconds ``retrieve_future`` waits for a result before answering ``try_again`` (the SDK's per-call timeout is 45)
POLL_S = 10.0
_REGISTRY = "models.json"
#: the server's own files without ``--state-dir`` (trainer folders, the snapshot writer's cache) live under the
#: snapshot root in this folder: a name no snapshot identity can take (identities start with a letter or digit)
WORK_DIR = ".zerokld-training-server"


@dataclass(frozen=True)
class Limits:
    """What one request may cost (server options; the limits table and memory bound of docs/security.md).

    Attributes:
        max_body_bytes: a request body, as sent and after ``Content-Encoding: zstd`` (decompressed as a stream that
            stops at the limit): 413 beyond.
        max_context: tokens of one datum's ``model_input`` (advertised by ``get_server_capabilities``): beyond, the
            request's future fails (the user's error).
        max_parked: requests of one model waiting for an earlier ``seq_id``, refused ones included: 429 beyond.
        max_held_bytes: what one model's training requests hold from submit until their result is retrieved (parked,
            queued on the trainer thread, or done; :func:`datums_cost` of their checked datums, refused ones
            :data:`REQUEST_OVERHEAD`): 429 beyond.
        max_models: models held at once (each a trainer: its weights, gradients and optimizer state; ``unload_model``
            frees one): 429 beyond.
        max_request_tokens: input tokens of one ``forward`` / ``forward_backward`` over all its datums, each datum
            counting at least one (what bounds the trainer thread's time per request and a decoded request's size):
            413 beyond, at submit.
        body_timeout_s: seconds a request may take to send its body (each chunk must come within it): 408 beyond.
        limit_concurrency: connections and requests in progress at once (uvicorn's ``--limit-concurrency``): 503
            beyond.
        max_decoding: bodies decoded at once (protobuf ones and JSON ones over :data:`INLINE_BODY_BYTES`), from
            decoding until their datums are checked; more wait their turn holding only their bytes.
    """

    max_body_bytes: int = 64 << 20
    max_context: int = 4096
    max_parked: int = 64
    max_held_bytes: int = 256 << 20
    max_models: int = 8
    max_request_tokens: int = 65536
    body_timeout_s: float = 30.0
    limit_concurrency: int = 32
    max_decoding: int = 2

    @property
    def other_body_bytes(self) -> int:
        """The largest body of a route other than ``forward`` / ``forward_backward`` (a sample's prompt of
        ``max_context`` tokens at 8 bytes a token of JSON, and its parameters; at least :data:`INLINE_BODY_BYTES`):
        413 beyond."""
        return min(self.max_body_bytes, max(INLINE_BODY_BYTES, 8 * self.max_context + (16 << 10)))

    def requests_memory_bound(self) -> int:
        """The most bytes requests can make the server's resident memory grow by, beyond its trainers (the formula
        of docs/security.md, "Peak memory"): every model's held requests; on every connection its body being read (a
        ``bytearray`` grows by an eighth over its size) and a small body decoded (:attr:`other_body_bytes`, which a
        training call's inline body, up to :data:`INLINE_BODY_BYTES`, does not exceed); each decoding turn's decoded
        body and checked datums (:data:`DECODED_PER_BODY_BYTE`, :data:`DECODED_PER_DATUM`)."""
        connection = self.max_body_bytes * 9 // 8 + DECODED_PER_BODY_BYTE * self.other_body_bytes
        decoding = DECODED_PER_BODY_BYTE * self.max_body_bytes + DECODED_PER_DATUM * self.max_request_tokens
        return (
            self.max_models * self.max_held_bytes + self.limit_concurrency * connection + self.max_decoding * decoding
        )


#: JSON bodies up to this size are parsed on the event loop (one at a time), larger ones off it under
#: :attr:`Limits.max_decoding`
INLINE_BODY_BYTES = 64 << 10
#: the most bytes a decoded body and its checked datums hold per byte of body: a JSON body as Python objects is at
#: most ~27x (measured: ``[{}, {}, ...]`` 26.5x, ints 10.9x, floats 12.9x, minimal datums 14.2x), its checked arrays
#: at most ~6x (one-value inputs: 264 bytes for ~50 of JSON); a protobuf message 8.7x before its datums become
#: Python objects (then at most --max-request-tokens datums of them, :data:`DECODED_PER_DATUM`)
DECODED_PER_BODY_BYTE = 40
#: the most bytes one datum of a decoded protobuf body holds as Python objects beyond its values (its dicts and
#: lists, ~1.5 KiB measured)
DECODED_PER_DATUM = 2048


class UserError(ZeroKLDClientError, ValueError):
    """A request the client must change (category ``user``; HTTP 400 at submit; ``status`` = ``status_code``)."""

    status = 400

    @property
    def status_code(self) -> int:  # type: ignore[override]
        return self.status


class BodyTooLarge(UserError):
    """A body over :attr:`Limits.max_body_bytes` (HTTP 413)."""

    status = 413


class Busy(UserError):
    """Too many requests parked for an earlier ``seq_id`` (HTTP 429): send the missing one, or retry later."""

    status = 429


class TooMuchWork(UserError):
    """A training call over :attr:`Limits.max_request_tokens` (HTTP 413, at submit): split it."""

    status = 413


class BodyTimeout(UserError):
    """A body that did not arrive within :attr:`Limits.body_timeout_s` (HTTP 408)."""

    status = 408


def _without_frames(error: BaseException) -> BaseException:
    """``error`` with no traceback and no chained exceptions: kept or raised on, it keeps no frame's locals (a
    request's decoded body) alive."""
    error.__traceback__ = error.__context__ = error.__cause__ = None
    error.__suppress_context__ = True
    return error


def _give_memory_back() -> None:
    """Collect the freed requests' and trainers' objects and return the allocator's free pages to the system
    (glibc's ``malloc_trim``: CPython and numpy allocate through malloc, which keeps freed small blocks otherwise);
    nothing where the C library has no ``malloc_trim``."""
    import contextlib
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)


def _is_integer(value) -> bool:
    """A JSON integer (Python's ``bool`` is an ``int``: not one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite_number(value) -> bool:
    """A finite JSON number (not a boolean, NaN or an infinity)."""
    return (_is_integer(value) or isinstance(value, float)) and math.isfinite(value)


def _number(value, what: str) -> float:
    """A finite JSON number (not a boolean). Raises UserError naming ``what``."""
    if not _is_finite_number(value):
        raise UserError(f"{what} must be a finite number, got {str(value)[:40]!r}")
    return float(value)


def _tensor_data(td, name: str) -> list:
    """Tinker ``TensorData`` (``{"data", "dtype", "shape"}``) as a flat list of finite numbers. Raises UserError:
    ragged or malformed, or a value that is not a finite number (NaN / inf, a string, a boolean) — naming its
    index."""
    if not isinstance(td, dict) or not isinstance(td.get("data"), list):
        raise UserError(f"loss_fn_inputs[{name!r}] must be TensorData {{data, dtype, shape}}")
    shape = td.get("shape") or [len(td["data"])]
    if not isinstance(shape, list) or len(shape) != 1 or not _is_integer(shape[0]) or shape[0] != len(td["data"]):
        raise UserError(
            f"loss_fn_inputs[{name!r}]: shape {str(shape)[:40]} does not match {len(td['data'])} values (1-d)"
        )
    for j, v in enumerate(td["data"]):
        if not _is_finite_number(v):
            raise UserError(f"loss_fn_inputs[{name!r}][{j}] is {str(v)[:20]!r}, not a finite number")
    return td["data"]


def routes_of(matrices: object, positions: int, num_experts: int | None, where: str):
    """A datum's ``model_input.routing_matrices`` (R3) as the routes to replay: ``[positions, layers, top_k]`` int64,
    row ``p`` the experts the rollout's forward at input position ``p`` selected (``-1`` where the string is empty:
    that position is routed afresh). Each string is base64 ``.npy`` of one position's ``[layers, top_k]`` ids — the
    encoding of the zerokld vLLM server's ``routing_matrix`` rows (:mod:`vllm_plugin.hotload.fireworks`, vLLM's own
    ``routed_experts`` encoding).

    Raises:
        UserError: a dense model; not a list of strings, one per position; a string that is not base64 ``.npy``
            of an integer ``[layers, top_k]`` array, shapes that differ, or ids outside ``[0, num_experts)``.
    """
    import numpy as np

    from shared_numerics.rollout import decode_routes

    if not num_experts:
        raise UserError(f"{where}: routing_matrices given, but this model has no experts")
    if not isinstance(matrices, list) or not all(isinstance(m, str) for m in matrices):
        raise UserError(f"{where}: routing_matrices must be a list of strings")
    if len(matrices) != positions:
        raise UserError(f"{where}: {len(matrices)} routing matrices for {positions} positions")
    rows, shape = [], None
    for p, m in enumerate(matrices):
        if not m:
            rows.append(None)
            continue
        try:
            a = decode_routes(m)
        except (ValueError, EOFError, OSError):
            raise UserError(f"{where}: routing_matrices[{p}] is not base64 .npy") from None
        if a.ndim != 2 or a.dtype.kind not in "iu" or (shape is not None and a.shape != shape):
            raise UserError(
                f"{where}: routing_matrices[{p}] is {a.dtype} {a.shape}; expected integer "
                f"[layers, top_k]{'' if shape is None else ' ' + str(list(shape))}"
            )
        if a.size and (int(a.min()) < 0 or int(a.max()) >= num_experts):
            raise UserError(f"{where}: routing_matrices[{p}] names experts outside [0, {num_experts})")
        shape = a.shape
        rows.append(a.astype(np.int64))
    if shape is None:
        return None  # nothing to replay: every position routed afresh
    return np.stack([r if r is not None else np.full(shape, -1, dtype=np.int64) for r in rows])


#: loss_fn_inputs with one value per input token (``target_tokens`` and the per-token loss inputs)
PER_TOKEN_INPUTS = ("target_tokens", "weights", "advantages", "logprobs", "ref_logprobs")


def datums(
    data: object,
    vocab_size: int,
    num_experts: int | None = None,
    max_context: int | None = None,
    max_tokens: int | None = None,
) -> list[dict]:
    """The wire's ``Datum`` list as :class:`titan_plugin.client.TrainingClient` datums (``model_input.
    routing_matrices`` as ``routed_experts`` to replay, :func:`routes_of`), held compactly: ``model_input`` and
    ``target_tokens`` as int64 arrays, the other ``loss_fn_inputs`` as float64 arrays (the wire's values exactly; the
    trainer rounds them to float32 as it did the lists), so a request's memory is :func:`datums_cost`.

    Raises:
        TooMuchWork (413): more than ``max_tokens`` input tokens over all datums, each counting at least one
            (checked before any datum is read).
        UserError (naming the datum and the field): not a list of datums; chunks that are not encoded text; token
            ids outside ``[0, vocab_size)``; more than ``max_context`` tokens; a ``loss_fn_inputs`` value that is
            not finite (NaN, inf) or not a number; a per-token input (:data:`PER_TOKEN_INPUTS`) whose length is not
            the datum's token count; malformed routing matrices.
    """
    import numpy as np

    if not isinstance(data, list) or not data:
        raise UserError("data must be a non-empty list of datums")
    if max_tokens is not None and (total := _input_tokens(data)) > max_tokens:
        raise _too_much_work(total, len(data), max_tokens)
    out = []
    for i, d in enumerate(data):
        model_input = (d.get("model_input") or {}) if isinstance(d, dict) else {}
        chunks = model_input.get("chunks") if isinstance(model_input, dict) else None
        if not isinstance(chunks, list) or not chunks:
            raise UserError(f"datum {i}: model_input.chunks missing")
        tokens = []
        for c in chunks:
            if not isinstance(c, dict) or c.get("type", "encoded_text") != "encoded_text":
                raise UserError(f"datum {i}: only encoded_text chunks are served")
            if not isinstance(c.get("tokens") or [], list):
                raise UserError(f"datum {i}: model_input.chunks[].tokens must be a list of token ids")
            tokens += c.get("tokens") or []
        if max_context is not None and len(tokens) > max_context:
            raise UserError(
                f"datum {i}: model_input has {len(tokens)} tokens, more than the served context "
                f"{max_context} (get_server_capabilities' max_context_length)"
            )
        if not all(_is_integer(t) and 0 <= t < vocab_size for t in tokens):
            raise UserError(f"datum {i}: token ids must be integers in [0, {vocab_size})")
        raw_inputs = d.get("loss_fn_inputs") or {}
        if not isinstance(raw_inputs, dict):
            raise UserError(f"datum {i}: loss_fn_inputs must be an object of TensorData")
        try:
            inputs = {k: _tensor_data(v, k) for k, v in raw_inputs.items()}
        except UserError as e:
            raise UserError(f"datum {i}: {e}") from None
        for k in PER_TOKEN_INPUTS:
            if k in inputs and len(inputs[k]) != len(tokens):
                raise UserError(
                    f"datum {i}: loss_fn_inputs[{k!r}] has {len(inputs[k])} values for {len(tokens)} input tokens"
                )
        targets = inputs.get("target_tokens")
        if targets is not None and not all(float(t).is_integer() and 0 <= t < vocab_size for t in targets):
            raise UserError(f"datum {i}: target_tokens must be integers in [0, {vocab_size})")
        inputs = {
            k: np.asarray([int(t) for t in v], dtype=np.int64) if k == "target_tokens" else np.asarray(v, np.float64)
            for k, v in inputs.items()
        }
        if model_input.get("routing_references") is not None or model_input.get("routing_matrix_format") not in (
            None,
            "base64_inline",
        ):
            raise UserError(f"datum {i}: routing references (parquet_v1) are not served; send routing_matrices")
        if model_input.get("routing_matrices") is not None:
            inputs["routed_experts"] = routes_of(
                model_input["routing_matrices"], len(tokens), num_experts, f"datum {i}"
            )
        out.append({"model_input": np.asarray(tokens, dtype=np.int64), "loss_fn_inputs": inputs})
    return out


def _input_tokens(data: list) -> int:
    """The input tokens of a wire ``Datum`` list as :attr:`Limits.max_request_tokens` counts them: chunks' ``tokens``
    lengths, each datum at least one (malformed parts count 0: the datum check refuses them)."""
    total = 0
    for d in data:
        model_input = d.get("model_input") if isinstance(d, dict) else None
        chunks = model_input.get("chunks") if isinstance(model_input, dict) else None
        n = 0
        for c in chunks if isinstance(chunks, list) else ():
            tokens = c.get("tokens") if isinstance(c, dict) else None
            n += len(tokens) if isinstance(tokens, list) else 0
        total += max(1, n)
    return total


def _too_much_work(tokens: int, n_datums: int, max_tokens: int) -> TooMuchWork:
    return TooMuchWork(
        f"this request has {tokens} input tokens over {n_datums} datums (each counting at least one), more than "
        f"one request may carry ({max_tokens}, --max-request-tokens): split it into several calls"
    )


#: bytes a parked request is counted for beyond its arrays' data: each array's object and allocation (numpy's are
#: ~240 measured), each datum's two dicts (~250), and a request's own records (its future, closure and error)
ARRAY_OVERHEAD, DATUM_OVERHEAD, REQUEST_OVERHEAD = 256, 256, 4096


def datums_cost(data: list[dict]) -> int:
    """The bytes checked :func:`datums` hold (what a training request is counted for against ``--max-held-bytes``):
    every array's data plus :data:`ARRAY_OVERHEAD` per array and :data:`DATUM_OVERHEAD` per datum."""
    cost = 0
    for d in data:
        arrays = [d["model_input"], *d["loss_fn_inputs"].values()]
        cost += DATUM_OVERHEAD + sum(int(getattr(a, "nbytes", 0)) + ARRAY_OVERHEAD for a in arrays)
    return cost


def _tensor_data_schema(items: dict) -> dict:
    return {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {"type": "array", "items": items},
            "dtype": {"type": "string"},
            "shape": {"type": "array", "items": {"type": "integer"}},
        },
    }


#: the forward / forward_backward body (tinker 0.38's ``ForwardBackwardRequest``, ``types/forward_backward_input.py``,
#: ``datum.py``, ``tensor_data.py``, ``model_input.py``: these are not pydantic models, so written out here)
_DATUM = {
    "type": "object",
    "required": ["model_input"],
    "properties": {
        "model_input": {
            "type": "object",
            "required": ["chunks"],
            "properties": {
                "chunks": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["tokens"],
                        "properties": {
                            "type": {"type": "string", "enum": ["encoded_text"]},
                            "tokens": {"type": "array", "items": {"type": "integer"}},
                        },
                    },
                },
                "routing_matrices": {"type": "array", "items": {"type": "string"}},
            },
        },
        "loss_fn_inputs": {"type": "object", "additionalProperties": _tensor_data_schema({"type": "number"})},
    },
}
_FORWARD_INPUT = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "data": {"type": "array", "items": _DATUM},
        "loss_fn": {"type": "string"},
        "loss_fn_config": {"type": "object", "additionalProperties": {"type": ["number", "string"]}},
    },
}
_TRAINING_CALL = {"model_id": {"type": "string"}, "seq_id": {"type": "integer"}}


def request_schemas() -> dict[str, dict]:
    """Route (under ``/api/v1``) -> the JSON schema of its request body, for the server's OpenAPI document (what an
    API fuzzer generates from): tinker 0.38's own request models where they are pydantic (``tinker.types``:
    ``CreateModelRequest``, ``OptimStepRequest``, ...; references into ``#/components/schemas``), the forward /
    forward_backward bodies and the Fireworks spellings of the training calls written out (:data:`_DATUM`)."""
    from tinker import types

    ref = "#/components/schemas/{model}"
    out = {
        route: getattr(types, model).model_json_schema(ref_template=ref)
        for route, model in (
            ("create_session", "CreateSessionRequest"),
            ("session_heartbeat", "SessionHeartbeatRequest"),
            ("client/config", "ClientConfigRequest"),
            ("telemetry", "TelemetrySendRequest"),
            ("create_model", "CreateModelRequest"),
            ("get_info", "GetInfoRequest"),
            ("unload_model", "UnloadModelRequest"),
            ("retrieve_future", "FutureRetrieveRequest"),
            ("save_weights", "SaveWeightsRequest"),
            ("load_weights", "LoadWeightsRequest"),
            ("create_sampling_session", "CreateSamplingSessionRequest"),
            ("asample", "SampleRequest"),
        )
    }
    adam = types.AdamParams.model_json_schema(ref_template=ref)
    out["optim_step"] = {
        "type": "object",
        "required": ["model_id", "seq_id"],
        "properties": {**_TRAINING_CALL, "adam_params": adam},
    }
    out["save_weights_for_sampler"] = {
        "type": "object",
        "required": ["model_id", "seq_id"],
        "properties": {
            **_TRAINING_CALL,
            "path": {"type": "string"},
            "checkpoint_type": {"type": "string", "enum": ["base", "delta"]},
            "kind": {"type": "string"},
            "sampling_session_seq_id": {"type": "integer"},
        },
    }
    out["forward"] = {
        "type": "object",
        "required": ["model_id", "seq_id", "forward_input"],
        "properties": {**_TRAINING_CALL, "forward_input": _FORWARD_INPUT},
    }
    out["forward_backward"] = {
        "type": "object",
        "required": ["model_id", "seq_id", "forward_backward_input"],
        "properties": {**_TRAINING_CALL, "forward_backward_input": _FORWARD_INPUT, "forward_only": {"type": "boolean"}},
    }
    return out


def _outputs(lps, metrics: dict, loss_fn: str) -> dict:
    """A forward's result as held until retrieved: each datum's log-probs a float32 numpy array (4 bytes a token, less
    than the request's :func:`datums_cost`), as JSON lists only when answered (:func:`_json_result`)."""
    return {
        "loss_fn_output_type": loss_fn,
        "loss_fn_outputs": [
            {"logprobs": {"data": lp.detach().float().numpy().copy(), "dtype": "float32", "shape": [int(lp.numel())]}}
            for lp in lps
        ],
        "metrics": metrics,
    }


def _json_result(result):
    """``result`` with every numpy array as a list of Python numbers (a float32 value as the float it is exactly)."""
    import numpy as np

    if isinstance(result, dict):
        return {k: _json_result(v) for k, v in result.items()}
    if isinstance(result, list):
        return [_json_result(v) for v in result]
    return result.tolist() if isinstance(result, np.ndarray) else result


API = "/api/v1"


class _Body(BaseModel):
    """A request body as a route reads it: the fields it uses, strictly typed (``"7"`` is not an integer, ``1`` not
    a boolean, a list not a string); the others pass through (the SDKs send more than a route reads)."""

    model_config = ConfigDict(strict=True, extra="allow")


class ModelIdRequest(_Body):
    """``get_info``, ``unload_model``."""

    model_id: str


class CreateModelRequest(_Body):
    """``create_model`` (``lora_config`` read by :meth:`TrainingServer._lora_config`)."""

    base_model: str | None = None
    lora_config: dict | None = None


class RetrieveFutureRequest(_Body):
    request_id: str


class CreateSamplingSessionRequest(_Body):
    """tinker's ``create_sampling_client``: a saved ``tinker://`` ``model_path`` or a ``base_model``."""

    model_path: str | None = None
    base_model: str | None = None


class AsampleRequest(_Body):
    """``asample`` (the sampling fields read by :class:`titan_plugin.tinker_sampler.Sampler`)."""

    sampling_session_id: str | None = None


class TrainingCallRequest(_Body):
    """Every training call's envelope: the model and its place in the model's sequence."""

    model_id: str
    seq_id: int


class ForwardRequest(TrainingCallRequest):
    """``forward`` (``forward_input`` read by :meth:`TrainingServer._forward_input` and :func:`datums`)."""

    forward_input: dict | None = None


class ForwardBackwardRequest(TrainingCallRequest):
    """``forward_backward``; tinker 0.38 sends a forward as one with ``forward_only`` (its datums then under
    ``forward_input``)."""

    forward_backward_input: dict | None = None
    forward_input: dict | None = None
    forward_only: bool = False


class OptimStepRequest(TrainingCallRequest):
    """``optim_step`` (``adam_params`` read by :meth:`TrainingServer._adam_params`)."""

    adam_params: dict | None = None


class SaveWeightsForSamplerRequest(TrainingCallRequest):
    """``save_weights_for_sampler`` (read by :meth:`TrainingServer._check_save_for_sampler`)."""


class SaveWeightsRequest(TrainingCallRequest):
    path: str | None = None
    overwrite: bool = False


class LoadWeightsRequest(TrainingCallRequest):
    path: str
    optimizer: bool = False


def _parsed(model: type[_Body], body: dict) -> _Body:
    """``body`` read as ``model``. Raises UserError naming the first field that is wrong."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors(include_url=False, include_input=False)[0]
        where = ".".join(str(part) for part in first["loc"]) or "body"
        raise UserError(f"{where}: {first['msg']}") from None


def _is_proto(request: Request) -> bool:
    return request.headers.get("content-type", "").split(";")[0].strip() == tinker_proto.CONTENT_TYPE


class _Parked(NamedTuple):
    """A training request waiting for its ``seq_id``'s turn."""

    fn: object
    future: concurrent.futures.Future
    arrived: float  # time.monotonic()
    rid: str  # its request id


@dataclass
class _Model:
    client: object
    base_model: str
    lora: dict
    next_seq: int | None = 1  # None: restored after a restart, the first seq_id that arrives is the next one
    checkpoint: str | None = None  # the state after its last optim_step (with a state dir)
    pending: dict = field(default_factory=dict)  # seq_id -> _Parked
    held: dict = field(default_factory=dict)  # request id -> the bytes it holds until retrieved (Limits.max_held_bytes)
    writer: object = None

    @property
    def lora_rank(self) -> int:
        return _lora_rank(self.lora)


def _lora_rank(lora_config: dict) -> int:
    """The rank of a wire ``lora_config`` (0: full-parameter)."""
    return int(lora_config.get("rank") or 0)


class TrainingServer:
    """The app's state: one trainer worker thread, the models, the futures.

    Args:
        checkpoint: the HF checkpoint every ``create_model`` trains (its ``base_model`` is a name only).
        snapshot_root: where ``save_weights_for_sampler`` writes snapshots (the vLLM server's ``hot_load``
            ``snapshot_root``).
        api_key: the key clients send as ``X-Api-Key``.
        dtype: the serving dtype of the forward. learning_rate: the trainer's initial rate.
        batch_invariant: zerokld's numerics (``False``: TorchTitan's stock ones, for contrast).
        seq_gap_s: how long a request may wait for an earlier ``seq_id`` before it fails (a gap in the numbering).
        max_lora_rank: the vLLM server's ``--max-lora-rank``: LoRA models are zero-padded to it, so the adapters it
            serves compute the trainer's bits (0: the model's own rank).
        state_dir: where the server keeps what a restart needs (``None``: nothing survives the process): each
            model's trainer folder, a TorchTitan checkpoint after every ``optim_step`` (model, optimizer, schedule;
            one per step: size it), the ``save_weights`` names and ``models.json``. A server started on a state dir
            with ``models.json`` recreates every model at its last completed ``optim_step`` — gradients accumulated
            after it are gone — and takes the first ``seq_id`` each model receives as the next. Without one, the
            trainer folders and the snapshot writer's cache are ``<snapshot_root>/.zerokld-training-server/``
            (:data:`WORK_DIR`): the server writes nothing outside these two roots.
        limits: what one request may cost (:class:`Limits`).
    """

    def __init__(
        self,
        checkpoint: str,
        snapshot_root: str,
        api_key: str,
        dtype: str = "bfloat16",
        learning_rate: float = 1e-4,
        batch_invariant: bool = True,
        seq_gap_s: float = 120.0,
        max_lora_rank: int = 0,
        state_dir: str | None = None,
        sampler_url: str | None = None,
        sampler_api_key: str | None = None,
        limits: Limits = Limits(),
    ) -> None:
        if not api_key:
            raise ValueError("an API key is required")
        self.checkpoint, self.root, self.api_key = checkpoint, Path(snapshot_root), api_key
        self.limits = limits
        self.dtype, self.learning_rate, self.batch_invariant = dtype, learning_rate, batch_invariant
        self.seq_gap_s, self.max_lora_rank = seq_gap_s, max_lora_rank
        from zerokld_models import read_model_config

        config = read_model_config(checkpoint)
        self.vocab_size, self.num_experts = int(config.vocab_size), config.num_experts
        self.worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="zerokld-trainer")
        self._lanes: dict[str, collections.deque] = {}  # model id -> its queued jobs, in round-robin order
        self._lanes_lock = threading.Lock()
        self.models: dict[str, _Model] = {}
        self.creating = 0  # create_model calls queued or running (they count against Limits.max_models)
        self.futures: dict[str, concurrent.futures.Future] = {}
        self._owners: dict[str, str] = {}  # a training request's id -> its model id (whose ``held`` counts it)
        self.proto_results: dict = {}  # request id -> the encoder of its tinker protobuf result
        #: the bodies decoded at once (:attr:`Limits.max_decoding`)
        self.decoding = asyncio.Semaphore(limits.max_decoding)
        self.sampler = None
        if sampler_url:
            from .tinker_sampler import Sampler

            self.sampler = Sampler(sampler_url, sampler_api_key or api_key)
        self.sample_pool = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="zerokld-sample")
        self.saved: dict[str, tuple] = {}  # tinker sampler snapshot identity -> (model_id, lora_name, SnapshotInfo)
        self.checkpoints: dict[str, tuple[str, str]] = {}  # save_weights name -> (model_id, trainer checkpoint)
        self.lock = threading.Lock()
        self._ids = itertools.count(1)
        self.state_dir = Path(state_dir) if state_dir else None
        #: the trainer folders and the writer's cache: under --state-dir, else under the snapshot root
        self.work_dir = self.state_dir if self.state_dir is not None else self.root / WORK_DIR
        if self.state_dir is not None and (self.state_dir / _REGISTRY).exists():
            self.worker.submit(self._restore).result()  # on the trainer thread, before anything is served
        self.app = self._build()
        self._stop_expiry = threading.Event()
        threading.Thread(
            target=self._expire_every, args=(self._stop_expiry,), daemon=True, name="zerokld-expiry"
        ).start()

    # ---- state across restarts ---------------------------------------------------------------------------------
    def _dump_folder(self, model_id: str) -> str:
        return str(self.work_dir / model_id)

    def _persist(self) -> None:
        """``models.json`` (written whole, then renamed): every model's creation and last checkpoint, the saved
        names."""
        if self.state_dir is None:
            return
        import json
        import os

        with self.lock:
            data = {
                "models": {
                    i: {"base_model": m.base_model, "lora": m.lora, "checkpoint": m.checkpoint}
                    for i, m in self.models.items()
                },
                "checkpoints": {n: list(v) for n, v in self.checkpoints.items()},
            }
        self.state_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.state_dir / (_REGISTRY + ".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.state_dir / _REGISTRY)

    def _restore(self) -> None:
        import json

        data = json.loads((self.state_dir / _REGISTRY).read_text())
        self.checkpoints = {n: tuple(v) for n, v in data.get("checkpoints", {}).items()}
        for model_id, m in data["models"].items():  # the registry is left as it was: nothing changed
            self._create(model_id, m["base_model"], m["lora"], restore=m.get("checkpoint"), restored=True)

    # ---- execution ---------------------------------------------------------------------------------------------
    def _future(self) -> tuple[str, concurrent.futures.Future]:
        rid = f"req-{next(self._ids)}"
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self.futures[rid] = fut
        return rid, fut

    def _run(self, fn, fut: concurrent.futures.Future, lane: str) -> None:
        """Queue ``fn`` on the trainer thread in ``lane`` (a model id): a lane's jobs run in order, and the thread
        takes one job from each lane with work in turn (round robin), so a model with a long queue cannot starve
        another — its next job waits for at most one job of every other model."""

        with self._lanes_lock:
            self._lanes.setdefault(lane, collections.deque()).append(functools.partial(_settle, fut, fn))
        self.worker.submit(self._next_job)  # one tick per job: each tick runs the next lane's first job

    def _next_job(self) -> None:
        with self._lanes_lock:
            lane, jobs = next(iter(self._lanes.items()))
            job = jobs.popleft()
            del self._lanes[lane]
            if jobs:  # to the back of the rotation
                self._lanes[lane] = jobs
        job()

    def _submit(self, model_id: str, seq_id, fn, check=None) -> str:
        """Queue ``fn`` at ``seq_id`` of the model; runs when every earlier seq_id has. ``check()`` (the request's
        validation, after the seq_id is known to be the model's next or later) returns the bytes the queued request
        holds (:func:`datums_cost` of its checked datums); its raising UserError refuses the request before anything
        of it runs: its future fails with that error (category ``user``) at its turn, in the shape the SDKs continue
        from (a 400 here would end their request sequence: ``fireworks-ai``'s training client raises "Training
        request sequence failed" for every later call). A request counts what it holds (a refused one
        :data:`REQUEST_OVERHEAD`) against the model's :attr:`Limits.max_held_bytes` until its result is retrieved
        (:meth:`_release`), and against :attr:`Limits.max_parked` while it waits for an earlier seq_id.

        Raises:
            UserError: unknown model, a seq_id already used (or not an integer).
            TooMuchWork: the request is over :attr:`Limits.max_request_tokens` (nothing is queued).
            Busy: :attr:`Limits.max_parked` requests of the model already wait for an earlier seq_id, or its
                requests not yet retrieved hold :attr:`Limits.max_held_bytes` (nothing is queued; the same seq_id
                may be sent again).
        """

        def seq_checked() -> _Model:
            model = self.models.get(model_id)
            if model is None:
                raise UserError(f"unknown model_id {str(model_id)[:40]!r}")
            if not _is_integer(seq_id):
                raise UserError(f"seq_id must be an integer, got {str(seq_id)[:20]!r}")
            if model.next_seq is None:  # restored: the client's numbering goes on
                model.next_seq = seq_id
            if seq_id < model.next_seq or seq_id in model.pending:
                raise UserError(f"seq_id {seq_id!r} was already used (next: {model.next_seq})")
            return model

        def admit_or_refuse(model: _Model, nbytes: int) -> None:
            held = sum(model.held.values())
            if held + nbytes > self.limits.max_held_bytes:
                raise Busy(
                    f"this model's {len(model.held)} requests not yet retrieved hold {held} bytes; this one needs "
                    f"{nbytes} more (limit: {self.limits.max_held_bytes} bytes): retrieve their results first"
                )
            if seq_id != model.next_seq and len(model.pending) >= self.limits.max_parked:
                raise Busy(
                    f"{len(model.pending)} requests already wait for seq_id {model.next_seq} "
                    f"(limit: {self.limits.max_parked} requests)"
                )

        with self.lock:
            admit_or_refuse(seq_checked(), REQUEST_OVERHEAD)  # before the check reads anything
        refusal, nbytes = None, REQUEST_OVERHEAD
        if check is not None:
            try:
                nbytes += check()
            except TooMuchWork:
                raise
            except ZeroKLDClientError as e:  # kept without its frames, which hold the decoded request
                refusal, nbytes = _without_frames(e), REQUEST_OVERHEAD
        with self.lock:
            model = seq_checked()
            admit_or_refuse(model, nbytes)
            rid, fut = self._future()
            model.held[rid], self._owners[rid] = nbytes, model_id
            if refusal is not None:  # its turn only fails it: nothing of the request is kept or run

                def fn(error=refusal):
                    raise error

            model.pending[seq_id] = _Parked(fn, fut, time.monotonic(), rid)
            while model.next_seq in model.pending:
                turn = model.pending.pop(model.next_seq)
                self._run(turn.fn, turn.future, model_id)
                model.next_seq += 1
        return rid

    def _release(self, rid: str) -> None:
        """Forget request ``rid`` (retrieved, or its model unloaded): its bytes stop counting against its model's
        :attr:`Limits.max_held_bytes`."""
        with self.lock:
            self.futures.pop(rid, None)
            self.proto_results.pop(rid, None)
            model = self.models.get(self._owners.pop(rid, ""))
            if model is not None:
                model.held.pop(rid, None)

    def _expire_gaps(self) -> None:
        """Fail the requests that waited more than ``seq_gap_s`` for an earlier ``seq_id`` that never came (a user
        error; nothing of theirs ran). The missing ``seq_id`` stays expected."""
        now, expired = time.monotonic(), 0
        with self.lock:
            for model in self.models.values():
                for seq, parked in list(model.pending.items()):
                    if now - parked.arrived > self.seq_gap_s:
                        del model.pending[seq]  # its datums with it: the failed future holds only its error
                        if parked.rid in model.held:
                            model.held[parked.rid] = REQUEST_OVERHEAD
                        expired += 1
                        parked.future.set_exception(
                            UserError(
                                f"seq_id {seq} waited {self.seq_gap_s:g} s for "
                                f"seq_id {model.next_seq}, which never arrived"
                            )
                        )
        if expired:
            _give_memory_back()

    def _expire_every(self, stop: threading.Event) -> None:
        """The expiry of parked requests (:meth:`_expire_gaps`) a few times per ``seq_gap_s``, whether or not any
        client polls ``retrieve_future``."""
        while not stop.wait(min(5.0, max(self.seq_gap_s / 4, 0.1))):
            self._expire_gaps()

    # ---- operations (on the worker thread) -----------------------------------------------------------------------
    def _create(
        self, model_id: str, base_model: str, lora: dict, restore: str | None = None, restored: bool = False
    ) -> dict:
        """Build the model's trainer; ``restored`` (a restart): load ``restore``, its last checkpoint, if any."""
        from .client import TrainingClient

        rank = _lora_rank(lora)
        if rank > 0:
            client = TrainingClient.create_lora(
                self.checkpoint,
                rank=rank,
                seed=lora.get("seed"),
                train_mlp=bool(lora.get("train_mlp", True)),
                train_attn=bool(lora.get("train_attn", True)),
                alpha=float(lora.get("alpha") or 32.0),
                dtype=self.dtype,
                max_rank=self.max_lora_rank,
                learning_rate=self.learning_rate,
                dump_folder=self._dump_folder(model_id),
            )
        else:
            client = TrainingClient.from_checkpoint(
                self.checkpoint,
                dtype=self.dtype,
                learning_rate=self.learning_rate,
                dump_folder=self._dump_folder(model_id),
                batch_invariant=self.batch_invariant,
            )
        if restore is not None:
            client.load_state(restore)
        with self.lock:
            self.models[model_id] = _Model(
                client, base_model, dict(lora), next_seq=None if restored else 1, checkpoint=restore
            )
        if not restored:  # a restart re-reads the registry; rewriting it model by model would drop the rest
            self._persist()
        # capabilities the SDK reads from the reply: routing replay (R3) for MoE models, routes inline (base64)
        return {
            "type": "create_model",
            "model_id": model_id,
            "supports_router_replay": bool(self.num_experts),
            "routing_matrix_format": "base64_inline",
        }

    def _forward_input(self, body: dict, backward: bool) -> tuple[list[dict], str, dict | None]:
        """``(datums, loss_fn, loss_fn_config)`` of a forward / forward_backward body, checked (:func:`datums`).
        Raises UserError."""
        spec = body.get("forward_backward_input" if backward else "forward_input") or {}
        if not isinstance(spec, dict):
            raise UserError("forward_input / forward_backward_input must be an object")
        loss_fn, config = spec.get("loss_fn") or "cross_entropy", spec.get("loss_fn_config")
        if not isinstance(loss_fn, str):
            raise UserError("loss_fn must be a string")
        if config is not None and not isinstance(config, dict):
            raise UserError("loss_fn_config must be an object")
        data = datums(
            spec.get("data"),
            self.vocab_size,
            self.num_experts,
            self.limits.max_context,
            self.limits.max_request_tokens,
        )
        return data, loss_fn, config

    def _forward(self, model: _Model, parsed: tuple, backward: bool) -> dict:
        data, loss_fn, config = parsed
        if not backward:
            res = model.client.forward(data)
            return _outputs([o["logprobs"] for o in res["loss_fn_outputs"]], {}, loss_fn)
        res = model.client.forward_backward(data, loss_fn, config)
        if not math.isfinite(float(res["loss"])):  # overflowed (e.g. huge weights): this step cannot be applied
            model.client.trainer.zero_grad()
            raise UserError(
                f"the loss of this forward_backward is {float(res['loss'])} (not finite: inputs too large "
                "for the model's dtype); the gradients accumulated since the last optim_step were "
                "discarded, the weights are unchanged"
            )
        m = res["metrics"]
        metrics = {
            "loss:sum": float(res["loss"]),
            "clipped:sum": float(m["clipped"]),
            "response_tokens:sum": float(m["num_tokens"]),
        }
        return _outputs([o["logprobs"] for o in res["loss_fn_outputs"]], metrics, loss_fn)

    @staticmethod
    def _adam_params(body: dict) -> dict:
        """The request's ``adam_params`` (Tinker's AdamParams) as finite floats. Raises UserError."""
        adam = body.get("adam_params") or {}
        if not isinstance(adam, dict):
            raise UserError("adam_params must be an object")
        known = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
        return {k: _number(adam[k], f"adam_params.{k}") for k in known if adam.get(k) is not None}

    def _optim(self, model: _Model, adam: dict) -> dict:
        res = model.client.optim_step(adam)
        if self.state_dir is not None:  # the state a restart comes back to
            model.checkpoint = model.client.save_state("last")
            self._persist()
        return {
            "metrics": {
                f"{k}:mean": float(v)
                for k, v in (res or {}).items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)
            }
        }

    def _save_state(self, model_id: str, model: _Model, name: str, overwrite: bool) -> dict:
        """``save_weights``: ``name`` checked at submit (one path segment, :meth:`_identity`)."""
        with self.lock:
            if name in self.checkpoints and not overwrite:
                raise UserError(f"checkpoint {name!r} exists (overwrite: true replaces it)")
        path = model.client.save_state(name)
        with self.lock:
            self.checkpoints[name] = (model_id, path)
        self._persist()
        return {"path": name, "type": "save_weights"}

    def _load_state(self, model: _Model, name: str, optimizer: bool) -> dict:
        with self.lock:
            saved = self.checkpoints.get(name)
        if saved is None:
            raise UserError(f"no checkpoint {str(name)[:80]!r} (list_checkpoints names them)")
        model.client.load_state(saved[1])
        if not optimizer:  # weights only: the optimizer starts afresh (Tinker's load_state)
            for opt in model.client.trainer.optimizers.optimizers:
                opt.state.clear()
        return {"path": name, "type": "load_weights"}

    def _snapshot_source(self, model: _Model, identity: str) -> tuple:
        """``(writer, tensors)`` of a model's next sampler snapshot: a LoRA model's PEFT adapter (exported as
        ``.adapter-<identity>``, a writer of its own that writes full snapshots), else the model's weights in the
        serving dtype and its chain's writer over the base checkpoint (made on first use)."""
        from deltasync import SnapshotWriter, read_snapshot_tensors

        cache = self.work_dir / "writer_cache"
        numerics = model.client.trainer.numerics
        if model.lora_rank:
            adapter = Path(model.client.save_weights_for_sampler(f".adapter-{identity}"))
            writer = SnapshotWriter(self.root, adapter, full_every=1, numerics=numerics, cache_dir=cache)
            return writer, read_snapshot_tensors(adapter)
        if model.writer is None:
            model.writer = SnapshotWriter(
                self.root, self.checkpoint, full_every=1 << 30, numerics=numerics, cache_dir=cache
            )
        return model.writer, model.client.trainer.hf_weights(self.dtype)

    def _save_for_sampler(self, model_id: str, model: _Model, body: dict) -> dict:
        """Fireworks' ``save_weights_for_sampler`` (``path``, ``checkpoint_type``), or tinker's (``kind`` set):
        :meth:`_save_for_tinker`."""
        if "kind" in body or body.get("sampling_session_seq_id") is not None:
            return self._save_for_tinker(model_id, model, body)
        identity, checkpoint_type = body["path"], str(body.get("checkpoint_type") or "base")
        writer, tensors = self._snapshot_source(model, identity)
        if model.lora_rank:  # a PEFT adapter snapshot, always full (Fireworks: LoRA saves are always base)
            return {"path": writer.write(identity, tensors, kind="full").identity, "type": "save_weights_for_sampler"}
        # base: full; delta: the writer's choice — full while it has no snapshot to diff against, else incremental
        info = writer.write(identity, tensors, kind="full" if checkpoint_type == "base" else None)
        writer.confirm(info)  # the next delta is against this snapshot: the server's own chain
        return {"path": info.identity, "type": "save_weights_for_sampler"}

    def _save_for_tinker(self, model_id: str, model: _Model, body: dict) -> dict:
        """tinker's ``save_weights_for_sampler``: with ``path``, a full snapshot of that name (a LoRA model's PEFT
        adapter), answered as ``tinker://<model_id>/sampler_weights/<path>``; without (``sampling_session_seq_id``:
        ``save_weights_and_get_sampling_client``), the next snapshot of the model's chain — a delta where the sampler
        serves its base — loaded into the sampler and answered with a sampling session on it too."""
        from .tinker_sampler import tinker_path

        session = body.get("path") is None
        if session and self.sampler is None:
            raise UserError(
                "this training server has no sampler: start it with --sampler-url (the zerokld vLLM "
                "server on the same snapshot root)"
            )
        identity = (
            f"{model_id}-{1 + sum(v[0] == model_id for v in self.saved.values())}" if session else str(body["path"])
        )
        lora_name = model_id if model.lora_rank else None  # the adapter's versions: vLLM LoRA <model_id>
        writer, tensors = self._snapshot_source(model, identity)
        if not session:
            info = writer.write(identity, tensors, kind="full")
            if writer is model.writer:  # not loaded: the chain's next snapshot is full again
                writer.failed(info)
            self.saved[identity] = (model_id, lora_name, info)
            return {"path": tinker_path(model_id, identity), "type": "save_weights_for_sampler"}
        info = self.sampler.push(writer, identity, tensors, lora_name)
        self.saved[info.identity] = (model_id, lora_name, info)
        path = tinker_path(model_id, info.identity)
        s = self.sampler.open(model.base_model, path, info.identity, lora_name, inflight=body.get("kind") == "inflight")
        return {"path": path, "sampling_session_id": s.sampling_session_id, "type": "save_weights_for_sampler"}

    # ---- request checks (at submit, before anything runs or touches the disk) ---------------------------------------
    @staticmethod
    def _identity(name, what: str) -> str:
        """A client-given name that becomes a file or folder name: one path segment
        (:func:`deltasync.validate_identity`). Raises UserError."""
        from deltasync import IdentityError, validate_identity

        try:
            return validate_identity(name)
        except IdentityError as e:
            raise UserError(f"{what}: {e}") from None

    def _check_save_for_sampler(self, body: dict) -> None:
        if "kind" in body or body.get("sampling_session_seq_id") is not None:  # tinker's: path optional
            if body.get("path") is not None:
                self._identity(body["path"], "path")
            return
        self._identity(body.get("path"), "path")
        if body.get("checkpoint_type") not in (None, "base", "delta"):
            raise UserError(f"checkpoint_type must be 'base' or 'delta', got {str(body.get('checkpoint_type'))[:20]!r}")

    def _lora_config(self, body: dict) -> dict:
        """``create_model``'s ``lora_config`` (``rank`` a non-negative integer; 0 or absent: full-parameter).
        Raises UserError."""
        lora = body.get("lora_config") or {}
        if not isinstance(lora, dict):
            raise UserError("lora_config must be an object")
        rank = lora.get("rank") or 0
        if not _is_integer(rank) or rank < 0:
            raise UserError(f"lora_config.rank must be a non-negative integer, got {str(rank)[:20]!r}")
        if self.max_lora_rank and rank > self.max_lora_rank:
            raise UserError(f"lora_config.rank {rank} is above this server's --max-lora-rank {self.max_lora_rank}")
        if lora.get("seed") is not None and not _is_integer(lora["seed"]):
            raise UserError("lora_config.seed must be an integer")
        if lora.get("alpha") is not None:
            _number(lora["alpha"], "lora_config.alpha")
        for k in ("train_mlp", "train_attn", "train_unembed"):
            if lora.get(k) is not None and not isinstance(lora[k], bool):
                raise UserError(f"lora_config.{k} must be true or false")
        return lora

    # ---- HTTP ------------------------------------------------------------------------------------------------------
    def _build(self) -> FastAPI:
        """The app: :data:`router` under :data:`API` and ``/health``, the key and body-size check
        (:meth:`_admit`), the error mapping (:func:`_client_error`, :func:`_server_error`) and the OpenAPI document
        with every route's request body (:func:`_openapi`)."""
        app = FastAPI(title="zerokld training server (Fireworks Training API)")
        app.state.server = self
        app.include_router(health_router)
        app.include_router(router, prefix=API)
        app.middleware("http")(self._admit)
        app.add_exception_handler(ZeroKLDClientError, _client_error)
        app.add_exception_handler(Exception, _server_error)
        app.openapi = lambda: _openapi(app)
        return app

    async def _admit(self, request: Request, call_next):
        """401 without the API key, 413 for a declared body over ``--max-body-bytes`` (before a byte of it is
        read)."""
        if request.url.path.startswith(API) and request.headers.get("x-api-key") != self.api_key:
            return JSONResponse({"detail": "missing or wrong API key"}, status_code=401)
        limit, declared = self.limits.max_body_bytes, request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            return JSONResponse(
                {"detail": f"body of {declared} bytes is over the limit of {limit} bytes (--max-body-bytes)"},
                status_code=413,
            )
        return await call_next(request)

    async def raw_body(self, request: Request, most: int) -> bytearray:
        """The request's bytes, up to ``most`` (413 beyond) within ``--body-timeout-s`` (408 beyond).

        Raises:
            BodyTooLarge, BodyTimeout.
        """
        raw = bytearray()
        try:
            async with asyncio.timeout(self.limits.body_timeout_s):
                async for chunk in request.stream():
                    if len(raw) + len(chunk) > most:
                        raise BodyTooLarge(f"body is over the limit of {most} bytes (--max-body-bytes)")
                    raw += chunk
        except TimeoutError:
            raise BodyTimeout(
                f"the body did not arrive within {self.limits.body_timeout_s:g} s (--body-timeout-s)"
            ) from None
        return raw

    def decode(self, request: Request, raw: bytearray) -> dict:
        """A body as its JSON object (a tinker protobuf one as the JSON body of the same call).

        Raises:
            UserError: not JSON, not an object, nested too deeply, compressed JSON, malformed protobuf.
            BodyTooLarge, TooMuchWork: a protobuf body over the limits once decompressed.
        """
        if _is_proto(request):
            try:  # tinker 0.38's forward / forward_backward: the JSON body of the same call
                return tinker_proto.forward_backward_request(
                    raw,
                    request.headers.get("content-encoding"),
                    self.limits.max_body_bytes,
                    self.limits.max_request_tokens,
                )
            except tinker_proto.BodyTooLarge as e:
                raise BodyTooLarge(str(e)) from None
            except tinker_proto.TooManyTokens as e:
                raise _too_much_work(e.tokens, e.datums, self.limits.max_request_tokens) from None
            except tinker_proto.WireError as e:
                raise UserError(str(e)) from None
        if request.headers.get("content-encoding", "identity") not in ("", "identity"):
            raise UserError("JSON bodies are read uncompressed (Content-Encoding zstd: protobuf bodies only)")
        import json

        try:
            body = json.loads(raw)
        except RecursionError:
            raise UserError("body is nested too deeply") from None
        except ValueError:
            raise UserError("body is not JSON") from None
        if not isinstance(body, dict):
            raise UserError("body must be a JSON object")
        return body

    async def body_of(self, request: Request, model: type[_Body]) -> _Body:
        """The body of a route other than ``forward`` / ``forward_backward`` as its request ``model``: at most
        :attr:`Limits.other_body_bytes`, parsed on the event loop. Raises UserError."""
        if _is_proto(request):
            raise UserError("protobuf bodies are read for forward and forward_backward only")
        return _parsed(model, self.decode(request, await self.raw_body(request, self.limits.other_body_bytes)))

    def model_of(self, model_id: str) -> _Model:
        """The model ``model_id`` names. Raises UserError: no such model."""
        model = self.models.get(model_id)
        if model is None:
            raise UserError(f"unknown model_id {model_id[:40]!r}")
        return model

    def submit_call(self, request: Request, raw: bytearray, call: TrainingCall) -> tuple[str, str]:
        """A training call's body decoded, its envelope (:class:`TrainingCallRequest`) read and the call queued at its
        seq_id (:meth:`_submit`), where ``call.check`` reads the rest: ``(request id, model id)``. Only the checked
        datums and the body's other fields stay (held until retrieved); a refusal carries no frames, so nothing of
        the decoded body outlives this call.

        Raises:
            ZeroKLDClientError: a malformed envelope, an unknown model, a seq_id already used; the limits'
                refusals (:class:`BodyTooLarge`, :class:`TooMuchWork`, :class:`Busy`).
        """
        try:
            body = self.decode(request, raw)
            envelope = _parsed(TrainingCallRequest, body)
            model = self.model_of(envelope.model_id)
            checked, held = {}, {"body": body}

            def validate() -> int:
                """The request checked; what it holds queued: its checked datums and the body's other fields
                (the wire's datums are dropped)."""
                checked["value"] = value = call.check(self, _parsed(call.request, body), body)
                held["body"] = {k: v for k, v in body.items() if k not in _DATUM_FIELDS}
                return datums_cost(value[0]) if call.datums else 0

            queued = lambda: call.run(self, model, held["body"], checked.get("value"))
            return self._submit(envelope.model_id, envelope.seq_id, queued, validate), envelope.model_id
        except ZeroKLDClientError as e:
            error = _without_frames(e)
        body = held = checked = None  # the frame the error is raised from holds nothing of the request
        raise error


# ---- routes ------------------------------------------------------------------------------------------------------
#: the Fireworks / Tinker routes, under :data:`API`; each handler reads its :class:`TrainingServer` from the app
router = APIRouter()
health_router = APIRouter()


def _server(request: Request) -> TrainingServer:
    return request.app.state.server


async def _client_error(request: Request, e: ZeroKLDClientError) -> JSONResponse:
    """A request refused: its status (400; 413 a body over the limit, 429 too many parked requests, ...) and
    ``{"detail"}`` (the SDK raises ``BadRequestError`` on a 400), no server paths in it."""
    from deltasync.protocol import public_message

    return JSONResponse({"detail": public_message(e)}, status_code=e.status_code)


async def _server_error(request: Request, e: Exception) -> JSONResponse:
    """Anything else a handler raised is this server's fault: 500, logged with its traceback, nothing of it in the
    answer."""
    logger.error("%s %s failed", request.method, request.url.path, exc_info=e)
    return JSONResponse({"detail": INTERNAL_ERROR}, status_code=500)


def _openapi(app: FastAPI) -> dict:
    """FastAPI's document with every route's request body (:func:`request_schemas`: the handlers read the raw body,
    so FastAPI cannot see it) and the ``X-Api-Key`` scheme."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = doc.setdefault("components", {})
        schemas = components.setdefault("schemas", {})
        for route, body in request_schemas().items():
            schemas.update(body.pop("$defs", {}))
            doc["paths"][f"{API}/{route}"]["post"]["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": body}},
            }
        components["securitySchemes"] = {"key": {"type": "apiKey", "in": "header", "name": "X-Api-Key"}}
        doc["security"] = [{"key": []}]
        app.openapi_schema = doc
    return app.openapi_schema


@health_router.get("/health")
async def health():
    return {"status": "ok"}


@router.post("/create_session")
async def create_session(request: Request):
    return {"type": "create_session", "session_id": f"session-{uuid.uuid4().hex[:8]}"}


@router.post("/session_heartbeat")
async def heartbeat(request: Request):
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish")
async def finish_session(session_id: str):
    """tinker's ``ServiceClient.close(status)``: the session ends (its models stay until ``unload_model``)."""
    return None


@router.post("/client/config")
async def client_config(request: Request):
    """tinker's startup call (``tml-`` keys): its defaults, but forward / forward_backward bodies zstd-compressed
    (``proto_compress_fwdbwd``)."""
    return {"proto_compress_fwdbwd": True}


@router.post("/client/dynamic_config")
async def client_dynamic_config(request: Request):
    """tinker's periodically refreshed flags: its defaults (no ``cancel_future``: an abandoned sample finishes on the
    engine and its result is dropped)."""
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}


@router.post("/telemetry")
async def telemetry(request: Request):
    return {"status": "accepted"}


@router.get("/get_server_capabilities")
async def capabilities(request: Request):
    server = _server(request)
    name = Path(server.checkpoint).name
    return {"supported_models": [{"model_name": name, "max_context_length": server.limits.max_context}]}


@router.post("/create_model")
async def create_model(request: Request):
    """A model on the server's checkpoint (``lora_config.rank`` > 0: LoRA), built on the trainer thread; counted
    against ``--max-models`` from here."""
    server = _server(request)
    body = await server.body_of(request, CreateModelRequest)
    base_model = body.base_model or Path(server.checkpoint).name
    lora = server._lora_config(body.model_dump())
    model_id = f"model-{uuid.uuid4().hex[:8]}"
    with server.lock:
        if len(server.models) + server.creating >= server.limits.max_models:
            raise Busy(f"this server holds {server.limits.max_models} models (--max-models): unload_model one first")
        server.creating += 1
    rid, fut = server._future()

    def create():
        try:
            return server._create(model_id, base_model, lora)
        finally:
            with server.lock:
                server.creating -= 1

    server._run(create, fut, model_id)
    return {"request_id": rid, "model_id": model_id}


@router.post("/get_info")
async def get_info(request: Request):
    server = _server(request)
    body = await server.body_of(request, ModelIdRequest)
    model = server.model_of(body.model_id)
    return {
        "type": "get_info",
        "model_id": body.model_id,
        "model_data": {"arch": "zerokld", "model_name": model.base_model, "tokenizer_id": model.base_model},
        "is_lora": bool(model.lora_rank),
        "lora_rank": model.lora_rank,
        "model_name": model.base_model,
    }


_DATUM_FIELDS = ("forward_input", "forward_backward_input")


@dataclass(frozen=True)
class TrainingCall:
    """A training route: its body (``request``, read at the call's turn), ``check(server, request, body)`` (reads and
    validates the rest off the event loop; a refusal fails the call's future, :meth:`TrainingServer._submit`),
    ``run(server, model, body, checked)`` (on the trainer thread) and whether it carries datums (counted against
    ``--max-held-bytes``)."""

    request: type[TrainingCallRequest]
    run: Callable
    check: Callable = lambda server, request, body: None
    datums: bool = False


#: the training calls, by route (tinker 0.38 sends forward as a protobuf forward_backward with forward_only)
TRAINING_CALLS = {
    "forward": TrainingCall(
        ForwardRequest,
        lambda s, m, b, c: s._forward(m, c, backward=False),
        lambda s, r, b: s._forward_input(b, backward=False),
        datums=True,
    ),
    "forward_backward": TrainingCall(
        ForwardBackwardRequest,
        lambda s, m, b, c: s._forward(m, c, backward=not b.get("forward_only")),
        lambda s, r, b: s._forward_input(b, backward=not r.forward_only),
        datums=True,
    ),
    "optim_step": TrainingCall(OptimStepRequest, lambda s, m, b, c: s._optim(m, c), lambda s, r, b: s._adam_params(b)),
    "save_weights_for_sampler": TrainingCall(
        SaveWeightsForSamplerRequest,
        lambda s, m, b, c: s._save_for_sampler(b["model_id"], m, b),
        lambda s, r, b: s._check_save_for_sampler(b),
    ),
    "save_weights": TrainingCall(
        SaveWeightsRequest,
        lambda s, m, b, c: s._save_state(b["model_id"], m, b["path"], bool(b.get("overwrite"))),
        lambda s, r, b: (s._identity(r.path, "path"), r.overwrite),
    ),
    "load_weights": TrainingCall(
        LoadWeightsRequest,
        lambda s, m, b, c: s._load_state(m, b["path"], bool(b.get("optimizer"))),
        lambda s, r, b: (r.path, r.optimizer),
    ),
}


def _training_route(path: str, call: TrainingCall) -> None:
    """Route ``path``: the body read (at most ``--max-body-bytes``), then decoded and queued off the event loop
    (:meth:`TrainingServer.submit_call`); a protobuf body, or a JSON one over :data:`INLINE_BODY_BYTES`, while it
    holds one of ``--max-decoding`` turns (others wait holding only their bytes). Answers ``{"request_id",
    "model_id"}``; a protobuf call's result goes back as protobuf."""

    @router.post("/" + path, name=path)
    async def handler(request: Request):
        server = _server(request)
        raw = await server.raw_body(request, server.limits.max_body_bytes)
        big = _is_proto(request) or len(raw) > INLINE_BODY_BYTES
        async with server.decoding if big else contextlib.nullcontext():
            rid, model_id = await asyncio.to_thread(server.submit_call, request, raw, call)
        if _is_proto(request):
            server.proto_results[rid] = tinker_proto.forward_backward_output
        return {"request_id": rid, "model_id": model_id}


for _path, _call in TRAINING_CALLS.items():
    _training_route(_path, _call)


def _sampler(server: TrainingServer):
    if server.sampler is None:
        raise UserError("this training server has no sampler: start it with --sampler-url")
    return server.sampler


@router.post("/create_sampling_session")
async def create_sampling_session(request: Request):
    """tinker's ``create_sampling_client``: a session on a saved ``tinker://`` snapshot (loaded into the sampler first
    unless it serves) or on ``base_model`` (the base weights)."""
    from deltasync import HotLoadRefused

    from .tinker_sampler import parse_model_path

    server = _server(request)
    body, s = await server.body_of(request, CreateSamplingSessionRequest), _sampler(server)
    if body.model_path:
        model_id, identity = parse_model_path(body.model_path)
        saved = server.saved.get(identity)
        if saved is None or saved[0] != model_id:
            raise UserError(f"no sampler snapshot {body.model_path[:120]!r} on this server")
        _, lora_name, info = saved
        try:
            await asyncio.to_thread(s.load, info, lora_name)
        except HotLoadRefused as e:
            raise UserError(f"the sampler cannot load {identity!r}: {e}") from None
        model = server.models.get(model_id)
        base = model.base_model if model else server.checkpoint
        session = s.open(base, body.model_path, identity, lora_name)
    elif body.base_model:
        session = s.open(body.base_model, None, None, None)
    else:
        raise UserError("create_sampling_session needs model_path or base_model")
    return {"type": "create_sampling_session", "sampling_session_id": session.sampling_session_id}


@router.get("/samplers/{sampler_id}")
async def get_sampler(request: Request, sampler_id: str):
    session = _sampler(_server(request)).session(sampler_id)
    return {
        "sampler_id": session.sampling_session_id,
        "base_model": session.base_model,
        "model_path": session.model_path,
    }


@router.post("/asample")
async def asample(request: Request):
    """A sample on a session's snapshot, run beside the training calls; the result (protobuf ``SampleResponse``)
    through ``retrieve_future``; one ``sample_sequence_ids`` entry per sample."""
    server = _server(request)
    body, s = await server.body_of(request, AsampleRequest), _sampler(server)
    session = s.session(body.sampling_session_id)
    raw = body.model_dump()
    n = s.request(session, raw)["n"]  # refused here, at submit
    rid, fut = server._future()
    server.proto_results[rid] = tinker_proto.sample_response
    server.sample_pool.submit(_settle, fut, lambda: s.sample(session, raw))
    return {"request_id": rid, "sample_sequence_ids": [f"{rid}-{i}" for i in range(n)]}


@router.get("/list_checkpoints")
async def list_checkpoints(request: Request):
    return {"checkpoints": sorted(_server(request).checkpoints)}


@router.post("/unload_model")
async def unload(request: Request):
    """The model forgotten: its parked requests fail, its queued ones run first, then its trainer closes and its
    results not yet retrieved are dropped (``retrieve_future``: 404)."""
    server = _server(request)
    model_id = (await server.body_of(request, ModelIdRequest)).model_id
    with server.lock:
        model = server.models.pop(model_id, None)
        parked = list(model.pending.values()) if model else []
        if model:
            model.pending.clear()
    for p in parked:  # nothing of theirs ran; their futures answer
        p.future.set_exception(UserError("the model was unloaded before this request's seq_id came"))
    del parked
    server._persist()
    rid, fut = server._future()

    def close():  # after the model's queued jobs (the same lane)
        if model:
            model.client.close()
            for held in list(model.held):
                server._release(held)
        _give_memory_back()
        return {"model_id": model_id}

    server._run(close, fut, model_id)
    return {"request_id": rid}


@router.post("/retrieve_future")
async def retrieve(request: Request):
    """A request's result, waiting up to :data:`POLL_S` (then ``try_again``); a failure as ``{"error", "category",
    "error_class"}``: ``user`` for a :class:`ZeroKLDClientError` (its message), ``server`` for anything else (logged
    where it was raised; its message not in the answer)."""
    server = _server(request)
    rid = (await server.body_of(request, RetrieveFutureRequest)).request_id
    fut = server.futures.get(rid)
    if fut is None:
        return JSONResponse({"detail": f"unknown request_id {rid[:40]!r}"}, status_code=404)
    try:
        await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), POLL_S)
    except TimeoutError:
        server._expire_gaps()
        if not fut.done():
            return {"type": "try_again", "request_id": rid, "queue_state": "active"}
    except Exception:  # noqa: BLE001 - the operation's failure: read from the future below
        pass
    proto = server.proto_results.get(rid)
    server._release(rid)
    error = fut.exception()
    if error is not None:
        return _failure(error)
    if proto is not None:
        return Response(proto(fut.result()), media_type=tinker_proto.CONTENT_TYPE)
    return _json_result(fut.result())


def _failure(error: BaseException) -> dict:
    """A failed request in the clients' error shape (tinker's ``RequestFailedResponse``)."""
    from deltasync.protocol import public_message

    if isinstance(error, ZeroKLDClientError):
        return {"error": public_message(error), "category": "user", "error_class": type(error).__name__}
    return {"error": INTERNAL_ERROR, "category": "server", "error_class": "InternalServerError"}


def _settle(fut: concurrent.futures.Future, fn) -> None:
    """``fut`` gets ``fn()``'s result or its failure; a failure that is not the client's is logged with its
    traceback here, where it was raised."""
    try:
        fut.set_result(fn())
    except Exception as e:
        if not isinstance(e, ZeroKLDClientError):
            logger.error("a queued request failed", exc_info=e)
        fut.set_exception(e)


class TrainingServerProcess:
    """``python -m titan_plugin.training_server`` as a child process on ``127.0.0.1``, on a free port (tests, examples).

    Args:
        checkpoint, snapshot_root, api_key: the server's ``--checkpoint``, ``--snapshot-root``, ``--api-key``.
        log_path: its stdout and stderr. extra_args: more flags (``--stock``, ``--max-lora-rank 8``, ...).

    Attributes:
        python: the interpreter it runs under (default this one's; another virtualenv's to test an install).
    """

    def __init__(self, checkpoint: str, snapshot_root: str, api_key: str, log_path, extra_args=()) -> None:
        import sys

        self.args = [
            "--checkpoint",
            str(checkpoint),
            "--snapshot-root",
            str(snapshot_root),
            "--api-key",
            api_key,
            *map(str, extra_args),
        ]
        self.log_path, self.proc, self.base = Path(log_path), None, ""
        self.python = sys.executable

    def start(self, budget_s: float = 120.0, env: dict | None = None, port: int | None = None) -> str:
        """Start (on ``port``, default a free one) and wait for ``/health``; returns the base URL.

        Raises:
            RuntimeError: it exited (its log's tail attached) or was not healthy within ``budget_s`` (then stopped).
        """
        import os
        import socket
        import subprocess

        import requests

        if port is None:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(
                [self.python, "-m", "titan_plugin.training_server", *self.args, "--port", str(port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "TINKER_TELEMETRY": "0", **(env or {})},
            )
        self.base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + budget_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.proc = None
                raise RuntimeError("training server exited:\n" + self.log_tail())
            try:
                if requests.get(self.base + "/health", timeout=2).status_code == 200:
                    return self.base
            except requests.ConnectionError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"training server not healthy within {budget_s:.0f} s:\n" + self.log_tail())

    def log_tail(self, chars: int = 3000) -> str:
        """The last ``chars`` characters of its log (``""`` before the first start)."""
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def stop(self, kill: bool = False) -> None:
        """SIGTERM (``kill``: SIGKILL at once, as a crash would), then SIGKILL after 60 s (this process only: it
        starts no children of its own)."""
        import subprocess

        if self.proc is None:
            return
        if kill:
            self.proc.kill()
        else:
            self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.proc = None


def main(argv=None) -> None:
    import os

    import uvicorn

    from zerokld_plugins import envs

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--snapshot-root", required=True)
    ap.add_argument("--api-key", default=envs.ZEROKLD_API_KEY)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--learning-rate", type=float, default=1e-4)
    ap.add_argument(
        "--seq-gap-s", type=float, default=120.0, help="seconds a request waits for an earlier seq_id before failing"
    )
    ap.add_argument(
        "--max-lora-rank",
        type=int,
        default=0,
        help="the vLLM server's --max-lora-rank (LoRA models are zero-padded to it)",
    )
    ap.add_argument(
        "--state-dir",
        default=None,
        help="keep what a restart needs here (a checkpoint per optim_step); "
        "a restart on it resumes every model at its last optim_step",
    )
    ap.add_argument(
        "--sampler-url",
        default=None,
        help="the zerokld vLLM server (hot-load on, on this --snapshot-root) that serves tinker's sampling sessions",
    )
    ap.add_argument("--sampler-api-key", default=envs.ZEROKLD_SAMPLER_API_KEY, help="its API key (default: --api-key)")
    ap.add_argument(
        "--stock", action="store_true", help="TorchTitan's stock numerics (batch_invariant off), for contrast"
    )
    defaults = Limits()
    ap.add_argument(
        "--max-body-bytes",
        type=int,
        default=defaults.max_body_bytes,
        help="largest request body, as sent and decompressed (413 beyond)",
    )
    ap.add_argument(
        "--max-context",
        type=int,
        default=defaults.max_context,
        help="most tokens in one datum (advertised by get_server_capabilities; beyond: the request's future fails)",
    )
    ap.add_argument(
        "--max-parked",
        type=int,
        default=defaults.max_parked,
        help="most requests of one model waiting for an earlier seq_id (429 beyond)",
    )
    ap.add_argument(
        "--max-held-bytes",
        type=int,
        default=defaults.max_held_bytes,
        help="most bytes one model's training requests hold decoded from submit until retrieved (429 beyond)",
    )
    ap.add_argument(
        "--max-models",
        type=int,
        default=defaults.max_models,
        help="most models held at once (unload_model frees one; 429 beyond)",
    )
    ap.add_argument(
        "--max-request-tokens",
        type=int,
        default=defaults.max_request_tokens,
        help="most input tokens of one forward / forward_backward over its datums (413 beyond)",
    )
    ap.add_argument(
        "--body-timeout-s",
        type=float,
        default=defaults.body_timeout_s,
        help="seconds a request may take to send its headers (then the connection is closed) and its body (408)",
    )
    ap.add_argument(
        "--limit-concurrency",
        type=int,
        default=defaults.limit_concurrency,
        help="most connections and requests in progress at once (uvicorn's; 503 beyond)",
    )
    ap.add_argument(
        "--max-decoding",
        type=int,
        default=defaults.max_decoding,
        help="most request bodies decoded at once (protobuf ones and JSON ones over 64 KiB; the rest wait their turn)",
    )
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8001)
    args = ap.parse_args(argv)
    if not args.api_key:
        raise SystemExit("an API key is required: --api-key or ZEROKLD_API_KEY")
    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        raise SystemExit("the training server is one process (WORLD_SIZE 1); start it without torchrun")
    import socket

    with socket.socket() as s:  # its one-process group's own port: an inherited MASTER_PORT may be held by the
        s.bind(("127.0.0.1", 0))  # process that started it (one that ran a trainer in-process, e.g. a test run)
        os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    server = TrainingServer(
        args.checkpoint,
        args.snapshot_root,
        args.api_key,
        args.dtype,
        args.learning_rate,
        batch_invariant=not args.stock,
        seq_gap_s=args.seq_gap_s,
        max_lora_rank=args.max_lora_rank,
        state_dir=args.state_dir,
        sampler_url=args.sampler_url,
        sampler_api_key=args.sampler_api_key,
        limits=Limits(
            args.max_body_bytes,
            args.max_context,
            args.max_parked,
            args.max_held_bytes,
            args.max_models,
            args.max_request_tokens,
            args.body_timeout_s,
            args.limit_concurrency,
            args.max_decoding,
        ),
    )
    uvicorn.run(
        server.app,
        host=args.host,
        port=args.port,
        log_level="warning",
        http=header_timeout_protocol(args.body_timeout_s),
        limit_concurrency=args.limit_concurrency,
    )


def header_timeout_protocol(seconds: float):
    """uvicorn's h11 protocol class with a header read timeout: a connection whose request line and headers have not
    all arrived ``seconds`` after it opened (or after its previous response) is closed. uvicorn 0.54 has none of its
    own (its keep-alive timer is armed only after a response, and the first byte of a next request disarms it), so a
    client could hold a connection open forever with an incomplete request. Source: ``uvicorn/protocols/http/
    h11_impl.py`` (``H11Protocol``, ``timeout_keep_alive_handler``)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutH11Protocol(H11Protocol):
        _header_timer = None

        def _arm_header_timer(self) -> None:
            self._disarm_header_timer()
            self._header_timer = self.loop.call_later(seconds, self.timeout_keep_alive_handler)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_header_timer()

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # the request's headers are in (or the connection ended)
                self._disarm_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_header_timer()

        def connection_lost(self, exc) -> None:
            self._disarm_header_timer()
            super().connection_lost(exc)

    return HeaderTimeoutH11Protocol


if __name__ == "__main__":
    main()
