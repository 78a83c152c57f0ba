"""tinker 0.38's sampling sessions on the zerokld vLLM server (issue 38): what the training server's
``create_sampling_session``, ``GET samplers/{id}``, ``asample`` and ``save_weights_and_get_sampling_client`` do
(``docs/wire.md`` §4).

The sampler is one ``vllm serve`` with zerokld's hot-load API (:mod:`vllm_plugin.hotload`) on the training server's
snapshot root. A sampling session is bound to one snapshot: a full-parameter model's snapshot serves as the engine's
weights (a later one replaces it), a LoRA model's as a version of the adapter named after its ``model_id`` (vLLM
multi-LoRA: each model its own adapter, on the base weights); a ``base_model`` session samples the base weights.
A ``kind="inflight"`` session follows its model's later snapshots (tinker's
contract: the weights saved when it was made, or newer). Every sample is checked against the snapshot that produced it —
the response's ``x-zerokld-snapshot-identity`` header (base weights) and ``model`` (``<adapter>@<identity>``,
:func:`deltasync.lora_version`) — so a session whose snapshot was replaced is refused (the user's error), never answered
by other weights.

``asample`` → vLLM's ``/v1/completions``: the prompt's token ids, ``n`` = ``num_samples``, ``max_tokens``,
``temperature``, ``top_p``, ``top_k`` (``-1``: off), ``seed``; ``stop``: strings → ``stop``, token ids →
``stop_token_ids``, ``[]`` → ``ignore_eos`` (tinker: no stop at all); the sampled tokens' log-probs (vLLM's
``logprobs: 0``: the model's log-softmax, the trainer's ``forward`` log-probs bit for bit under zerokld) and, with
``prompt_logprobs``, the prompt's (``NaN`` for the first token, as tinker's ``SampleResponse`` has it). Top-k
log-probs, target / alternative prompt tokens, ``prompt_logprobs_last_n`` and stability records are refused.

Source: ``tinker==0.38.0`` (``types/sample_request.py``, ``types/sampling_params.py``,
``lib/public_interfaces/sampling_client.py``); vLLM's completions API.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass

from zerokld_plugins.errors import ZeroKLDClientError

__all__ = ["Sampler", "SamplerError", "Session", "parse_model_path", "tinker_path"]

_UNSERVED = ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k")
_UNSERVED_SET = ("target_prompt_logprobs", "prompt_logprobs_last_n")


class SamplerError(ZeroKLDClientError, ValueError):
    """A sampling request the client must change (tinker's ``user`` category / HTTP 400)."""


def tinker_path(model_id: str, identity: str) -> str:
    """The ``tinker://`` path of a sampler snapshot: ``tinker://<model_id>/sampler_weights/<identity>``."""
    return f"tinker://{model_id}/sampler_weights/{identity}"


def parse_model_path(path: object) -> tuple[str, str]:
    """``(model_id, identity)`` of a :func:`tinker_path`. Raises SamplerError: another form."""
    parts = str(path).removeprefix("tinker://").split("/") if str(path).startswith("tinker://") else []
    if len(parts) != 3 or parts[1] != "sampler_weights" or not parts[0] or not parts[2]:
        raise SamplerError(f"model_path must be tinker://<model_id>/sampler_weights/<name>, got {str(path)[:80]!r}")
    return parts[0], parts[2]


@dataclass(frozen=True)
class Session:
    """One sampling session: ``identity`` ``None`` = the base weights; ``lora_name``: the adapter it samples;
    ``inflight``: it follows the model's later snapshots (``identity`` is the first)."""

    sampling_session_id: str
    base_model: str
    model_path: str | None
    identity: str | None
    lora_name: str | None
    inflight: bool = False  # tinker's ``kind="inflight"``: the model's newest snapshot, whichever serves


class Sampler:
    """The zerokld vLLM server as tinker's sampler.

    Args:
        url: the server's base URL (``http://127.0.0.1:8000``); its ``hot_load.snapshot_root`` is the training
            server's ``--snapshot-root``.
        api_key: its key (sent as a Bearer token), or ``None``.
        timeout: seconds per HTTP call (hot-loads included).
    """

    def __init__(self, url: str, api_key: str | None, timeout: float = 600.0) -> None:
        from deltasync import HotLoadClient

        self.url, self.timeout = url.rstrip("/"), timeout
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.hot = HotLoadClient(self.url, api_key, timeout=timeout)
        self.lock = threading.Lock()
        self.sessions: dict[str, Session] = {}
        self._served_model: str | None = None
        self._base: str | None = None  # the engine's weights when this server first spoke to it
        self._full: str | None = None  # a full-parameter snapshot loaded since (the base weights no longer serve)
        self._adapters: dict[str, str] = {}  # adapter -> the version it serves

    def _get(self, path: str) -> dict:
        import requests

        r = requests.get(self.url + path, headers=self.headers, timeout=self.timeout)
        r.raise_for_status()
        return r.json()

    def _engine(self) -> tuple[str, str]:
        """``(served model name, identity of the weights it started this server's life with)``, read once."""
        from deltasync.protocol import PREFIX

        if self._served_model is None:
            self._served_model = str(self._get("/v1/models")["data"][0]["id"])
            self._base = str(self._get(PREFIX + "/status")["replicas"][0]["current_snapshot_identity"])
        return self._served_model, self._base

    # ---- loading ---------------------------------------------------------------------------------------------
    def push(self, writer, identity: str, tensors: dict, lora_name: str | None):
        """Write the next snapshot of a chain (delta where the engine serves its base, else full) and load it
        (:meth:`deltasync.HotLoadClient.push`); returns the :class:`deltasync.SnapshotInfo` that serves
        (``<identity>-full`` after a refused delta). Raises deltasync.HotLoadRefused."""
        with self.lock:
            self._engine()
            info = self.hot.push(writer, identity, tensors, lora_name).snapshot
            self._mark(info.identity, lora_name)
        return info

    def load(self, info, lora_name: str | None) -> None:
        """Load a snapshot already written (:class:`deltasync.SnapshotInfo`, a full one) unless it serves already.
        Raises deltasync.HotLoadRefused."""
        with self.lock:
            self._engine()
            if (self._adapters.get(lora_name) if lora_name else self._full) == info.identity:
                return
            self.hot.signal(info, lora_name)
            self._mark(info.identity, lora_name)

    def _mark(self, identity: str, lora_name: str | None) -> None:
        if lora_name:
            self._adapters[lora_name] = identity
        else:
            self._full = identity

    # ---- sessions --------------------------------------------------------------------------------------------
    def open(
        self,
        base_model: str,
        model_path: str | None,
        identity: str | None,
        lora_name: str | None,
        inflight: bool = False,
    ) -> Session:
        """A new session on what serves now (``identity`` ``None``: the base weights)."""
        s = Session(f"sampler-{uuid.uuid4().hex[:12]}", base_model, model_path, identity, lora_name, inflight)
        with self.lock:
            self.sessions[s.sampling_session_id] = s
        return s

    def session(self, sampling_session_id: object) -> Session:
        """Raises SamplerError: unknown id."""
        s = self.sessions.get(str(sampling_session_id))
        if s is None:
            raise SamplerError(f"unknown sampling_session_id {str(sampling_session_id)[:40]!r}")
        return s

    # ---- sampling --------------------------------------------------------------------------------------------
    def request(self, s: Session, body: dict) -> dict:
        """vLLM's ``/v1/completions`` body for an ``asample`` body. Raises SamplerError: the session's snapshot no
        longer serves (a later save replaced it), or a refused request (see the module)."""
        if not isinstance(body, dict):
            raise SamplerError("body must be a JSON object")
        with self.lock:
            self._engine()
            gone = s.lora_name is not None and self._full is not None  # an adapter's base weights were replaced
            if not s.inflight:
                gone |= s.identity != (self._adapters.get(s.lora_name) if s.lora_name else self._full)
        if gone:
            raise SamplerError(
                f"sampling session {s.sampling_session_id}: its weights "
                f"({s.identity or 'the base model'}) no longer serve — a later save replaced them; "
                "sample through a sampling client of the newer weights"
            )
        for key in _UNSERVED:
            if body.get(key):
                raise SamplerError(f"{key} is not served by zerokld's sampler")
        for key in _UNSERVED_SET + ("record_stability_info",):
            if body.get(key) not in (None, False):
                raise SamplerError(f"{key} is not served by zerokld's sampler")
        tokens = []
        for c in (body.get("prompt") or {}).get("chunks") or []:
            if not isinstance(c, dict) or c.get("type", "encoded_text") != "encoded_text":
                raise SamplerError("only encoded_text prompt chunks are served")
            tokens += c.get("tokens") or []
        if not tokens or not all(isinstance(t, int) and t >= 0 for t in tokens):
            raise SamplerError("prompt must hold token ids (encoded_text chunks)")
        n = body.get("num_samples", 1)
        if not isinstance(n, int) or n < 1:
            raise SamplerError(f"num_samples must be a positive integer, got {str(n)[:20]!r}")
        params = body.get("sampling_params") or {}
        model, _ = self._engine()
        req = {
            "model": s.lora_name or model,
            "prompt": tokens,
            "n": n,
            "stream": False,
            "logprobs": 0,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "temperature": float(params.get("temperature", 1.0)),
            "top_p": float(params.get("top_p", 1.0)),
        }
        if params.get("max_tokens") is not None:
            req["max_tokens"] = int(params["max_tokens"])
        if params.get("top_k") not in (None, -1, 0):
            req["top_k"] = int(params["top_k"])
        if params.get("seed") is not None:
            req["seed"] = int(params["seed"])
        stop = params.get("stop")
        if isinstance(stop, str):
            req["stop"] = [stop]
        elif isinstance(stop, list) and not stop:  # tinker: [] disables every stop, EOS included
            req["ignore_eos"] = True
        elif isinstance(stop, list) and all(isinstance(x, int) for x in stop):
            req["stop_token_ids"] = stop
        elif isinstance(stop, list) and all(isinstance(x, str) for x in stop):
            req["stop"] = stop
        elif stop is not None:
            raise SamplerError("sampling_params.stop must be a string, a list of strings or a list of token ids")
        if body.get("prompt_logprobs"):
            req["prompt_logprobs"] = 0
        return req

    def sample(self, s: Session, body: dict) -> dict:
        """One ``asample``: ``{"sequences": [{"tokens", "logprobs", "stop_reason"}], "prompt_logprobs": [...] |
        None}`` (:func:`titan_plugin.tinker_proto.sample_response` encodes it).

        Raises:
            SamplerError: as :meth:`request`. RuntimeError: the engine failed the request or answered with other weights
            than the session's.
        """
        import requests

        from deltasync.protocol import IDENTITY_HEADER, lora_version

        req = self.request(s, body)
        with self.lock:
            _, base = self._engine()
            identity = (self._adapters.get(s.lora_name) if s.lora_name else self._full) if s.inflight else s.identity
        r = requests.post(self.url + "/v1/completions", json=req, headers=self.headers, timeout=self.timeout)
        if r.status_code == 400:
            raise SamplerError(f"the sampler refused the request: {r.text[:300]}")
        if r.status_code != 200:
            raise RuntimeError(f"the sampler answered {r.status_code}: {r.text[:300]}")
        reply = r.json()
        want_header = identity if s.lora_name is None and identity else base
        want_model = lora_version(s.lora_name, identity) if s.lora_name else None
        if r.headers.get(IDENTITY_HEADER) != want_header or (want_model and reply.get("model") != want_model):
            raise RuntimeError(
                f"sampling session {s.sampling_session_id} expected snapshot {identity or base!r}, "
                f"the sampler answered with {r.headers.get(IDENTITY_HEADER)!r} "
                f"({str(reply.get('model'))[:80]!r})"
            )
        sequences, prompt_lps = [], None
        for c in reply.get("choices", []):
            ids, lp = c.get("token_ids"), (c.get("logprobs") or {}).get("token_logprobs")
            if ids is None or lp is None or len(lp) != len(ids):
                raise RuntimeError("the sampler's reply lacks token ids or their log-probs")
            sequences.append(
                {
                    "tokens": list(ids),
                    "logprobs": [float(x) for x in lp],
                    "stop_reason": "length" if c.get("finish_reason") == "length" else "stop",
                }
            )
            if body.get("prompt_logprobs") and prompt_lps is None:
                rows = c.get("prompt_logprobs")
                if rows is None or len(rows) != len(req["prompt"]):
                    raise RuntimeError("the sampler's reply lacks the prompt log-probs")
                prompt_lps = [
                    None if row is None else _prompt_logprob(row, t) for row, t in zip(rows, req["prompt"], strict=True)
                ]
        if len(sequences) != req["n"]:
            raise RuntimeError(f"the sampler answered {len(sequences)} samples for {req['n']}")
        return {"sequences": sequences, "prompt_logprobs": prompt_lps}


def _prompt_logprob(row: dict, token: int) -> float:
    """The prompt token's log-prob in one of vLLM's ``prompt_logprobs`` rows (``{token_id: {"logprob", ...}}``)."""
    entry = row.get(str(token), row.get(token)) if isinstance(row, dict) else None
    if entry is None:
        raise RuntimeError(f"the sampler's prompt log-probs lack token {token}")
    return float(entry["logprob"] if isinstance(entry, dict) else entry)
