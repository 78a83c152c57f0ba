"""Fireworks' Training API over the real TorchTitan trainer: the JSON wire ``fireworks-ai``'s
``FiretitanServiceClient`` sends (Tinker 0.23's, ``../shared/wire/fireworks_tinker_wire.md`` §1-2), served by
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
asks for zstd-compressed protobuf bodies (``client/dynamic_config``: the defaults), and ``forward`` / ``forward_backward`` bodies in tinker's protobuf (zstd or
not) are read as the JSON ones (:mod:`titan_plugin.tinker_proto`) — a ``forward_only`` request is a ``forward`` — and
their results go back as protobuf; ``create_lora_training_client(rank=0)`` trains full-parameter. Sampling (with
``--sampler-url``: the zerokld vLLM server on the same snapshot root, LoRA on for LoRA models;
:mod:`titan_plugin.tinker_sampler`): tinker's ``save_weights_for_sampler`` (``kind`` set) answers
``tinker://<model_id>/sampler_weights/<name>``; without a name (``save_weights_and_get_sampling_client``) it loads
the model's next snapshot into the sampler — a LoRA model's adapter as a version of the vLLM adapter named
``<model_id>``, a full-parameter model's weights as a delta where the sampler serves the previous one — and answers a
sampling session on it; ``create_sampling_session`` (a saved ``tinker://`` path, loaded first, or ``base_model``),
``GET samplers/{id}`` and ``asample`` (``sample_sequence_ids``; the result a protobuf ``SampleResponse``, run beside
the training calls) complete it.

MoE routing replay (R3): a datum's ``model_input.routing_matrices`` (one per position, as the zerokld vLLM server's
``include_routing_matrix`` rows give them) are replayed in its forward (:func:`routes_of`,
:mod:`titan_plugin.routing`); Parquet routing references are refused.
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import itertools
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from . import tinker_proto
from .tinker_sampler import SamplerError

__all__ = ["POLL_S", "TrainingServer", "TrainingServerProcess", "datums", "main", "routes_of"]

#: seconds ``retrieve_future`` waits for a result before answering ``try_again`` (the SDK's per-call timeout is 45)
POLL_S = 10.0
_REGISTRY = "models.json"
_CAPABILITIES_CONTEXT = 4096


class UserError(ValueError):
    """A request the client must change (category ``user``)."""


def _tensor_data(td, name: str) -> list:
    """Tinker ``TensorData`` (``{"data", "dtype", "shape"}``) as a flat list. Raises UserError: ragged or
    malformed."""
    if not isinstance(td, dict) or not isinstance(td.get("data"), list):
        raise UserError(f"loss_fn_inputs[{name!r}] must be TensorData {{data, dtype, shape}}")
    shape = td.get("shape") or [len(td["data"])]
    if len(shape) != 1 or int(shape[0]) != len(td["data"]):
        raise UserError(f"loss_fn_inputs[{name!r}]: shape {shape} does not match {len(td['data'])} values (1-d)")
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
            raise UserError(f"{where}: routing_matrices[{p}] is {a.dtype} {a.shape}; expected integer "
                            f"[layers, top_k]{'' if shape is None else ' ' + str(list(shape))}")
        if a.size and (int(a.min()) < 0 or int(a.max()) >= num_experts):
            raise UserError(f"{where}: routing_matrices[{p}] names experts outside [0, {num_experts})")
        shape = a.shape
        rows.append(a.astype(np.int64))
    if shape is None:
        return None  # nothing to replay: every position routed afresh
    return np.stack([r if r is not None else np.full(shape, -1, dtype=np.int64) for r in rows])


def datums(data: object, vocab_size: int, num_experts: int | None = None) -> list[dict]:
    """The wire's ``Datum`` list as :class:`titan_plugin.client.TrainingClient` datums (``model_input.
    routing_matrices`` as ``routed_experts`` to replay, :func:`routes_of`). Raises UserError."""
    if not isinstance(data, list) or not data:
        raise UserError("data must be a non-empty list of datums")
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
            tokens += c.get("tokens") or []
        if not all(isinstance(t, int) and 0 <= t < vocab_size for t in tokens):
            raise UserError(f"datum {i}: token ids must be integers in [0, {vocab_size})")
        inputs = {k: _tensor_data(v, k) for k, v in (d.get("loss_fn_inputs") or {}).items()}
        targets = inputs.get("target_tokens")
        if targets is not None and not all(isinstance(t, (int, float)) and 0 <= t < vocab_size for t in targets):
            raise UserError(f"datum {i}: target_tokens must be in [0, {vocab_size})")
        if model_input.get("routing_references") is not None or model_input.get("routing_matrix_format") not in (
                None, "base64_inline"):
            raise UserError(f"datum {i}: routing references (parquet_v1) are not served; send routing_matrices")
        if model_input.get("routing_matrices") is not None:
            inputs["routed_experts"] = routes_of(model_input["routing_matrices"], len(tokens), num_experts,
                                                 f"datum {i}")
        out.append({"model_input": tokens, "loss_fn_inputs": inputs})
    return out


def _outputs(lps, metrics: dict, loss_fn: str) -> dict:
    return {"loss_fn_output_type": loss_fn,
            "loss_fn_outputs": [{"logprobs": {"data": [float(x) for x in lp.tolist()], "dtype": "float32",
                                              "shape": [int(lp.numel())]}} for lp in lps],
            "metrics": metrics}


@dataclass
class _Model:
    client: object
    base_model: str
    lora: dict
    next_seq: int | None = 1  # None: restored after a restart, the first seq_id that arrives is the next one
    checkpoint: str | None = None  # the state after its last optim_step (with a state dir)
    pending: dict = field(default_factory=dict)  # seq_id -> (fn, placeholder future, arrival time)
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
            after it are gone — and takes the first ``seq_id`` each model receives as the next.
    """

    def __init__(self, checkpoint: str, snapshot_root: str, api_key: str, dtype: str = "bfloat16",
                 learning_rate: float = 1e-4, batch_invariant: bool = True, seq_gap_s: float = 120.0,
                 max_lora_rank: int = 0, state_dir: str | None = None, sampler_url: str | None = None,
                 sampler_api_key: str | None = None) -> None:
        if not api_key:
            raise ValueError("an API key is required")
        self.checkpoint, self.root, self.api_key = checkpoint, Path(snapshot_root), api_key
        self.dtype, self.learning_rate, self.batch_invariant = dtype, learning_rate, batch_invariant
        self.seq_gap_s, self.max_lora_rank = seq_gap_s, max_lora_rank
        from zerokld_models import read_model_config

        config = read_model_config(checkpoint)
        self.vocab_size, self.num_experts = int(config.vocab_size), config.num_experts
        self.worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="zerokld-trainer")
        self.models: dict[str, _Model] = {}
        self.futures: dict[str, concurrent.futures.Future] = {}
        self.proto_results: dict = {}  # request id -> the encoder of its tinker protobuf result
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
        if self.state_dir is not None and (self.state_dir / _REGISTRY).exists():
            self.worker.submit(self._restore).result()  # on the trainer thread, before anything is served
        self.app = self._build()

    # ---- state across restarts ---------------------------------------------------------------------------------
    def _dump_folder(self, model_id: str) -> str:
        return str(self.state_dir / model_id if self.state_dir else self.root.parent / f".{model_id}")

    def _persist(self) -> None:
        """``models.json`` (written whole, then renamed): every model's creation and last checkpoint, the saved
        names."""
        if self.state_dir is None:
            return
        import json
        import os

        with self.lock:
            data = {"models": {i: {"base_model": m.base_model, "lora": m.lora, "checkpoint": m.checkpoint}
                               for i, m in self.models.items()},
                    "checkpoints": {n: list(v) for n, v in self.checkpoints.items()}}
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

    def _run(self, fn, fut: concurrent.futures.Future) -> None:
        def job():
            try:
                fut.set_result(fn())
            except Exception as e:  # noqa: BLE001 - every failure is the future's answer
                fut.set_exception(e)
        self.worker.submit(job)

    def _submit(self, model_id: str, seq_id, fn) -> str:
        """Queue ``fn`` at ``seq_id`` of the model; runs when every earlier seq_id has. Raises UserError."""
        with self.lock:
            model = self.models.get(model_id)
            if model is None:
                raise UserError(f"unknown model_id {str(model_id)[:40]!r}")
            if model.next_seq is None and isinstance(seq_id, int):  # restored: the client's numbering goes on
                model.next_seq = seq_id
            if not isinstance(seq_id, int) or seq_id < model.next_seq or seq_id in model.pending:
                raise UserError(f"seq_id {seq_id!r} was already used (next: {model.next_seq})")
            rid, fut = self._future()
            model.pending[seq_id] = (fn, fut, time.monotonic())
            while model.next_seq in model.pending:
                self._run(*model.pending.pop(model.next_seq)[:2])
                model.next_seq += 1
        return rid

    def _expire_gaps(self) -> None:
        """Fail the requests that waited more than ``seq_gap_s`` for an earlier ``seq_id`` that never came (a user
        error; nothing of theirs ran). The missing ``seq_id`` stays expected."""
        now = time.monotonic()
        with self.lock:
            for model in self.models.values():
                for seq, (_, fut, arrived) in list(model.pending.items()):
                    if now - arrived > self.seq_gap_s:
                        del model.pending[seq]
                        fut.set_exception(UserError(f"seq_id {seq} waited {self.seq_gap_s:g} s for seq_id "
                                                    f"{model.next_seq}, which never arrived"))

    # ---- operations (on the worker thread) -----------------------------------------------------------------------
    def _create(self, model_id: str, base_model: str, lora: dict, restore: str | None = None,
                restored: bool = False) -> dict:
        """Build the model's trainer; ``restored`` (a restart): load ``restore``, its last checkpoint, if any."""
        from .client import TrainingClient

        rank = _lora_rank(lora)
        if rank > 0:
            client = TrainingClient.create_lora(self.checkpoint, rank=rank, seed=lora.get("seed"),
                                                train_mlp=bool(lora.get("train_mlp", True)),
                                                train_attn=bool(lora.get("train_attn", True)),
                                                alpha=float(lora.get("alpha") or 32.0), dtype=self.dtype,
                                                max_rank=self.max_lora_rank,
                                                learning_rate=self.learning_rate,
                                                dump_folder=self._dump_folder(model_id))
        else:
            client = TrainingClient.from_checkpoint(self.checkpoint, dtype=self.dtype,
                                                    learning_rate=self.learning_rate,
                                                    dump_folder=self._dump_folder(model_id),
                                                    batch_invariant=self.batch_invariant)
        if restore is not None:
            client.load_state(restore)
        with self.lock:
            self.models[model_id] = _Model(client, base_model, dict(lora), next_seq=None if restored else 1,
                                           checkpoint=restore)
        if not restored:  # a restart re-reads the registry; rewriting it model by model would drop the rest
            self._persist()
        # capabilities the SDK reads from the reply: routing replay (R3) for MoE models, routes inline (base64)
        return {"type": "create_model", "model_id": model_id, "supports_router_replay": bool(self.num_experts),
                "routing_matrix_format": "base64_inline"}

    def _forward(self, model: _Model, body: dict, backward: bool) -> dict:
        spec = body.get("forward_backward_input" if backward else "forward_input") or {}
        data = datums(spec.get("data"), self.vocab_size, self.num_experts)
        loss_fn = spec.get("loss_fn") or "cross_entropy"
        if not backward:
            res = model.client.forward(data)
            return _outputs([o["logprobs"] for o in res["loss_fn_outputs"]], {}, loss_fn)
        res = model.client.forward_backward(data, loss_fn, spec.get("loss_fn_config"))
        m = res["metrics"]
        metrics = {"loss:sum": float(res["loss"]), "clipped:sum": float(m["clipped"]),
                   "response_tokens:sum": float(m["num_tokens"])}
        return _outputs([o["logprobs"] for o in res["loss_fn_outputs"]], metrics, loss_fn)

    def _optim(self, model: _Model, adam: dict) -> dict:
        known = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
        res = model.client.optim_step({k: float(adam[k]) for k in known if adam.get(k) is not None})
        if self.state_dir is not None:  # the state a restart comes back to
            model.checkpoint = model.client.save_state("last")
            self._persist()
        return {"metrics": {f"{k}:mean": float(v) for k, v in (res or {}).items()
                            if isinstance(v, (int, float)) and not isinstance(v, bool)}}

    def _save_state(self, model_id: str, model: _Model, name: str, overwrite: bool) -> dict:
        from deltasync import validate_identity

        validate_identity(name)  # one path segment: a name, never a server path
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

        cache = self.root.parent / ".zerokld_writer_cache"
        numerics = model.client.trainer.numerics
        if model.lora_rank:
            adapter = Path(model.client.save_weights_for_sampler(f".adapter-{identity}"))
            writer = SnapshotWriter(self.root, adapter, full_every=1, numerics=numerics, cache_dir=cache)
            return writer, read_snapshot_tensors(adapter)
        if model.writer is None:
            model.writer = SnapshotWriter(self.root, self.checkpoint, full_every=1 << 30, numerics=numerics,
                                          cache_dir=cache)
        return model.writer, model.client.trainer.hf_weights(self.dtype)

    def _save_for_sampler(self, model_id: str, model: _Model, body: dict) -> dict:
        """Fireworks' ``save_weights_for_sampler`` (``path``, ``checkpoint_type``), or tinker's (``kind`` set):
        :meth:`_save_for_tinker`."""
        if "kind" in body or body.get("sampling_session_seq_id") is not None:
            return self._save_for_tinker(model_id, model, body)
        identity, checkpoint_type = str(body.get("path")), str(body.get("checkpoint_type") or "base")
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
            raise UserError("this training server has no sampler: start it with --sampler-url (the zerokld vLLM "
                            "server on the same snapshot root)")
        identity = (f"{model_id}-{1 + sum(v[0] == model_id for v in self.saved.values())}" if session
                    else str(body["path"]))
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

    # ---- HTTP ------------------------------------------------------------------------------------------------------
    def _build(self) -> FastAPI:
        app = FastAPI(title="zerokld training server (Fireworks Training API)")
        api = "/api/v1"

        @app.middleware("http")
        async def auth(request: Request, call_next):
            if request.url.path.startswith(api) and request.headers.get("x-api-key") != self.api_key:
                return JSONResponse({"detail": "missing or wrong API key"}, status_code=401)
            return await call_next(request)

        def is_proto(request: Request) -> bool:
            return request.headers.get("content-type", "").split(";")[0].strip() == tinker_proto.CONTENT_TYPE

        async def body_of(request: Request) -> dict:
            if is_proto(request):
                try:  # tinker 0.38's forward / forward_backward: the JSON body of the same call
                    return tinker_proto.forward_backward_request(await request.body(),
                                                                 request.headers.get("content-encoding"))
                except tinker_proto.WireError as e:
                    raise UserError(str(e)) from None
            try:
                body = await request.json()
            except ValueError:
                raise UserError("body is not JSON") from None
            if not isinstance(body, dict):
                raise UserError("body must be a JSON object")
            return body

        @app.exception_handler(UserError)
        @app.exception_handler(SamplerError)
        async def refused(request: Request, e: ValueError) -> JSONResponse:
            """A request refused at submit: 400 ``{"detail"}`` (the SDK raises ``BadRequestError``)."""
            from deltasync.protocol import public_message

            return JSONResponse({"detail": public_message(e)}, status_code=400)

        @app.get("/health")
        async def health():
            return {"status": "ok"}

        @app.post(api + "/create_session")
        async def create_session(request: Request):
            return {"type": "create_session", "session_id": f"session-{uuid.uuid4().hex[:8]}"}

        @app.post(api + "/session_heartbeat")
        async def heartbeat(request: Request):
            return {"type": "session_heartbeat"}

        @app.post(api + "/sessions/{session_id}/finish")
        async def finish_session(session_id: str):
            """tinker's ``ServiceClient.close(status)``: the session ends (its models stay until ``unload_model``)."""
            return None

        @app.post(api + "/client/config")
        async def client_config(request: Request):
            """tinker's startup call (``tml-`` keys): its defaults, but forward / forward_backward bodies zstd-compressed
            (``proto_compress_fwdbwd``)."""
            return {"proto_compress_fwdbwd": True}

        @app.post(api + "/client/dynamic_config")
        async def client_dynamic_config(request: Request):
            """tinker's periodically refreshed flags: its defaults (no ``cancel_future``: an abandoned sample
            finishes on the engine and its result is dropped)."""
            return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

        @app.post(api + "/telemetry")
        async def telemetry(request: Request):
            return {"status": "accepted"}

        @app.get(api + "/get_server_capabilities")
        async def capabilities():
            return {"supported_models": [{"model_name": self.checkpoint, "max_context_length": _CAPABILITIES_CONTEXT}]}

        @app.post(api + "/create_model")
        async def create_model(request: Request):
            body = await body_of(request)
            model_id = f"model-{uuid.uuid4().hex[:8]}"
            rid, fut = self._future()
            self._run(lambda: self._create(model_id, str(body.get("base_model") or self.checkpoint),
                                           body.get("lora_config") or {}), fut)
            return {"request_id": rid, "model_id": model_id}

        def model_of(body: dict) -> _Model:
            model = self.models.get(body.get("model_id"))
            if model is None:
                raise UserError(f"unknown model_id {str(body.get('model_id'))[:40]!r}")
            return model

        @app.post(api + "/get_info")
        async def get_info(request: Request):
            body = await body_of(request)
            model = model_of(body)
            return {"type": "get_info", "model_id": body["model_id"],
                    "model_data": {"arch": "zerokld", "model_name": model.base_model, "tokenizer_id": model.base_model},
                    "is_lora": bool(model.lora_rank), "lora_rank": model.lora_rank, "model_name": model.base_model}

        def op(path: str, run):
            @app.post(api + "/" + path)
            async def handler(request: Request):
                body = await body_of(request)
                model = model_of(body)
                rid = self._submit(body["model_id"], body.get("seq_id"), lambda: run(model, body))
                if is_proto(request):  # its result goes back as protobuf too
                    self.proto_results[rid] = tinker_proto.forward_backward_output
                return {"request_id": rid, "model_id": body["model_id"]}
            return handler

        op("forward", lambda m, b: self._forward(m, b, backward=False))
        # (tinker 0.38 sends forward as a protobuf forward_backward with forward_only)
        op("forward_backward", lambda m, b: self._forward(m, b, backward=not b.get("forward_only")))
        op("optim_step", lambda m, b: self._optim(m, b.get("adam_params") or {}))
        op("save_weights_for_sampler", lambda m, b: self._save_for_sampler(b["model_id"], m, b))

        op("save_weights", lambda m, b: self._save_state(b["model_id"], m, str(b.get("path")),
                                                          bool(b.get("overwrite"))))
        op("load_weights", lambda m, b: self._load_state(m, str(b.get("path")), bool(b.get("optimizer"))))

        def sampler():
            if self.sampler is None:
                raise UserError("this training server has no sampler: start it with --sampler-url")
            return self.sampler

        @app.post(api + "/create_sampling_session")
        async def create_sampling_session(request: Request):
            """tinker's ``create_sampling_client``: a session on a saved ``tinker://`` snapshot (loaded into the
            sampler first unless it serves) or on ``base_model`` (the base weights)."""
            from deltasync import HotLoadRefused

            from .tinker_sampler import parse_model_path

            body, s = await body_of(request), sampler()
            if body.get("model_path"):
                model_id, identity = parse_model_path(body["model_path"])
                saved = self.saved.get(identity)
                if saved is None or saved[0] != model_id:
                    raise UserError(f"no sampler snapshot {str(body['model_path'])[:120]!r} on this server")
                _, lora_name, info = saved
                try:
                    await asyncio.to_thread(s.load, info, lora_name)
                except HotLoadRefused as e:
                    raise UserError(f"the sampler cannot load {identity!r}: {e}") from None
                model = self.models.get(model_id)
                session = s.open(model.base_model if model else self.checkpoint, str(body["model_path"]), identity,
                                 lora_name)
            elif body.get("base_model"):
                session = s.open(str(body["base_model"]), None, None, None)
            else:
                raise UserError("create_sampling_session needs model_path or base_model")
            return {"type": "create_sampling_session", "sampling_session_id": session.sampling_session_id}

        @app.get(api + "/samplers/{sampler_id}")
        async def get_sampler(sampler_id: str):
            session = sampler().session(sampler_id)
            return {"sampler_id": session.sampling_session_id, "base_model": session.base_model,
                    "model_path": session.model_path}

        @app.post(api + "/asample")
        async def asample(request: Request):
            """A sample on a session's snapshot, run beside the training calls; the result (protobuf
            ``SampleResponse``) through ``retrieve_future``; one ``sample_sequence_ids`` entry per sample."""
            body, s = await body_of(request), sampler()
            session = s.session(body.get("sampling_session_id"))
            n = s.request(session, body)["n"]  # refused here, at submit
            rid, fut = self._future()
            self.proto_results[rid] = tinker_proto.sample_response

            def job():
                try:
                    fut.set_result(s.sample(session, body))
                except Exception as e:  # noqa: BLE001 - every failure is the future's answer
                    fut.set_exception(e)
            self.sample_pool.submit(job)
            return {"request_id": rid, "sample_sequence_ids": [f"{rid}-{i}" for i in range(n)]}

        @app.get(api + "/list_checkpoints")
        async def list_checkpoints():
            return {"checkpoints": sorted(self.checkpoints)}

        @app.post(api + "/unload_model")
        async def unload(request: Request):
            body = await body_of(request)
            model = self.models.pop(body.get("model_id"), None)
            self._persist()
            rid, fut = self._future()
            self._run(lambda: (model.client.close() if model else None) or {"model_id": body.get("model_id")}, fut)
            return {"request_id": rid}

        @app.post(api + "/retrieve_future")
        async def retrieve(request: Request):
            from deltasync.protocol import public_message

            body = await body_of(request)
            rid = body.get("request_id")
            fut = self.futures.get(rid)
            if fut is None:
                return JSONResponse({"detail": f"unknown request_id {str(rid)[:40]!r}"}, status_code=404)
            try:
                await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), POLL_S)
            except TimeoutError:
                self._expire_gaps()
                if not fut.done():
                    return {"type": "try_again", "request_id": rid, "queue_state": "active"}
            except Exception:  # noqa: BLE001, S110 - the operation's failure: read from the future below
                pass
            self.futures.pop(rid, None)
            proto = self.proto_results.pop(rid, None)
            error = fut.exception()
            if error is not None:  # in the client's error shape
                user = isinstance(error, (ValueError, KeyError, TypeError, NotImplementedError))  # UserError too
                return {"error": public_message(error), "category": "user" if user else "server",
                        "error_class": type(error).__name__}
            if proto is not None:
                return Response(proto(fut.result()), media_type=tinker_proto.CONTENT_TYPE)
            return fut.result()

        return app


class TrainingServerProcess:
    """``python -m titan_plugin.training_server`` as a child process on ``127.0.0.1``, on a free port (tests, examples).

    Args:
        checkpoint, snapshot_root, api_key: the server's ``--checkpoint``, ``--snapshot-root``, ``--api-key``.
        log_path: its stdout and stderr. extra_args: more flags (``--stock``, ``--max-lora-rank 8``, ...).
    """

    def __init__(self, checkpoint: str, snapshot_root: str, api_key: str, log_path, extra_args=()) -> None:
        self.args = ["--checkpoint", str(checkpoint), "--snapshot-root", str(snapshot_root), "--api-key", api_key,
                     *map(str, extra_args)]
        self.log_path, self.proc, self.base = Path(log_path), None, ""

    def start(self, budget_s: float = 120.0, env: dict | None = None, port: int | None = None) -> str:
        """Start (on ``port``, default a free one) and wait for ``/health``; returns the base URL.

        Raises:
            RuntimeError: it exited (its log's tail attached) or was not healthy within ``budget_s`` (then stopped).
        """
        import os
        import socket
        import subprocess
        import sys

        import requests

        if port is None:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "titan_plugin.training_server", *self.args,
                                          "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, "TINKER_TELEMETRY": "0", **(env or {})})
        self.base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + budget_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.proc = None
                raise RuntimeError("training server exited:\n" + self.log_path.read_text(errors="replace")[-3000:])
            try:
                if requests.get(self.base + "/health", timeout=2).status_code == 200:
                    return self.base
            except requests.ConnectionError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"training server not healthy within {budget_s:.0f} s:\n"
                           + self.log_path.read_text(errors="replace")[-3000:])

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

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--snapshot-root", required=True)
    ap.add_argument("--api-key", default=os.environ.get("ZEROKLD_API_KEY"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--learning-rate", type=float, default=1e-4)
    ap.add_argument("--seq-gap-s", type=float, default=120.0, help="seconds a request waits for an earlier seq_id "
                                                                     "before failing")
    ap.add_argument("--max-lora-rank", type=int, default=0, help="the vLLM server's --max-lora-rank (LoRA models "
                                                                    "are zero-padded to it)")
    ap.add_argument("--state-dir", default=None, help="keep what a restart needs here (a checkpoint per optim_step); "
                                                     "a restart on it resumes every model at its last optim_step")
    ap.add_argument("--sampler-url", default=None, help="the zerokld vLLM server (hot-load on, on this --snapshot-root) "
                                                        "that serves tinker's sampling sessions")
    ap.add_argument("--sampler-api-key", default=os.environ.get("ZEROKLD_SAMPLER_API_KEY"),
                    help="its API key (default: --api-key)")
    ap.add_argument("--stock", action="store_true", help="TorchTitan's stock numerics (batch_invariant off), for "
                                                         "contrast")
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
    server = TrainingServer(args.checkpoint, args.snapshot_root, args.api_key, args.dtype, args.learning_rate,
                            batch_invariant=not args.stock, seq_gap_s=args.seq_gap_s,
                            max_lora_rank=args.max_lora_rank, state_dir=args.state_dir,
                            sampler_url=args.sampler_url, sampler_api_key=args.sampler_api_key)
    uvicorn.run(server.app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
