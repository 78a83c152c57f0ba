"""The deterministic sampler: vLLM's ``Sampler.sample`` on :mod:`shared_numerics.sampling` when the zerokld config
has ``batch_invariant`` (and ``deterministic_sampler``, default on).

Seams (:mod:`vllm_plugin.seams`, installed at registration), each a no-op unless the engine's config enables the
sampler:

* front end (``v1/engine/input_processor.py`` ``InputProcessor.process_inputs``): a request without ``seed`` gets one
  drawn (62 bits) before vLLM fans ``n > 1`` out into children (which then get ``seed + index``, vLLM's own rule in
  ``v1/engine/parallel_sampling.py``), from a stream seeded with the engine's ``seed`` (``ModelConfig.seed``,
  ``--seed``; ``secrets`` when the engine has none): the same engine seed and the same order of requests sample the
  same tokens, as vLLM's unseeded sampling from its seeded generator does; ``CompletionOutput.zerokld_seed`` returns
  each sample's seed (on an engine without the sampler: the request's own seed or ``None``)
  (``v1/engine/output_processor.py``), so every sample can be reproduced; the OpenAI ``/v1/completions`` response
  carries it as the extension field ``zerokld_seed`` of each choice (non-streaming responses). With
  ``batch_invariant`` on, every output also carries the engine's numerics contract
  (:class:`shared_numerics.NumericsMode` as a dict): ``CompletionOutput.zerokld_numerics`` and the choice field
  ``zerokld_numerics``, checked when the trainer consumes the rollouts (:class:`shared_numerics.RolloutBatch`).
* worker (``v1/worker/gpu_model_runner.py``): new requests' seeds are taken out of ``SamplingParams.seed`` into the
  runner before vLLM would build a ``torch.Generator`` for them. vLLM-CPU crashes on seeded requests with chunked
  prefill (``gen.set_offset`` on a CPU generator, which has no offset) — without generators that path never runs.
  ``_sample`` publishes each row's ``(seed, output position)``; the position is the number of tokens the request has
  generated so far, so a recomputation after preemption samples the same noise.
* ``Sampler.sample`` (``v1/sample/sampler.py``): greedy rows stay ``argmax``; random rows are
  ``sample_scaled(scale_logits(logits, T), seed, position, top_k, top_p)``. Logits processors run as in vLLM.
  ``logprobs_mode`` ``processed_*`` is refused at start (the returned logprobs are the raw ones, as by default).
* ``Sampler.compute_logprobs``: the log-softmax on ``shared_numerics`` in processes whose model is zerokld's
  (:func:`set_logprobs_definition`), vLLM's own elsewhere.
"""

from __future__ import annotations

import contextvars
import random
import secrets

import torch

import shared_numerics.sampling as sn_sampling

from .config import ZeroKLDConfigError, from_vllm_config, numerics_stamp
from .seams import replace

__all__ = [
    "check_sampler_supported",
    "install",
    "set_logprobs_definition",
    "tag_choice",
    "tag_output",
    "unseeded_request_seed",
]

_ROWS: contextvars.ContextVar = contextvars.ContextVar("zerokld_sampler_rows", default=None)
_EPS = 1e-5


def check_sampler_supported(vllm_config) -> None:
    """Raise :class:`ZeroKLDConfigError` for settings the deterministic sampler does not implement."""
    if not from_vllm_config(vllm_config).sampler_enabled:
        return
    mode = str(getattr(vllm_config.model_config, "logprobs_mode", "raw_logprobs"))
    problems = []
    if "processed" in mode:
        problems.append(f"logprobs_mode {mode} (use raw_logprobs or raw_logits)")
    if vllm_config.speculative_config is not None:
        problems.append("speculative decoding")
    if problems:
        raise ZeroKLDConfigError("zerokld deterministic sampler does not support: " + "; ".join(problems))


# request id -> the engine's NumericsMode dict (front end: input processor -> output processor)
_NUMERICS: dict[str, dict] = {}
# the mode of the latest request this process admitted (one engine per front-end process): n > 1 children
_LAST_NUMERICS: list = [None]
#: the log-softmax vLLM's sampler runs here (:func:`set_logprobs_definition`): None = vLLM's own
_LOGPROBS: list = [None]


def _numerics(owner) -> dict | None:
    """The engine's :class:`shared_numerics.NumericsMode` as a dict when ``batch_invariant`` is on (else ``None``),
    computed once per ``owner`` (a vLLM object holding ``vllm_config``)."""
    if "_zerokld_numerics" not in owner.__dict__:
        try:
            owner.__dict__["_zerokld_numerics"] = numerics_stamp(owner.vllm_config)
        except ZeroKLDConfigError:
            owner.__dict__["_zerokld_numerics"] = None
    return owner.__dict__["_zerokld_numerics"]


def _enabled(owner) -> bool:
    """Whether the sampler is on for ``owner`` (a vLLM object holding ``vllm_config``: input processor, model
    runner), parsed once per owner — the worker hooks run every step."""
    on = owner.__dict__.get("_zerokld_sampler_enabled")
    if on is None:
        on = owner.__dict__["_zerokld_sampler_enabled"] = from_vllm_config(owner.vllm_config).sampler_enabled
    return on


def unseeded_request_seed(owner) -> int:
    """The seed of the next request without one (62 bits), drawn by ``owner`` (the front end's input processor) from
    a ``random.Random`` seeded with the engine's ``model_config.seed``: reproducible for the same engine seed and
    request order; ``secrets.randbits`` when the engine has no seed."""
    stream = owner.__dict__.get("_zerokld_seed_stream")
    if stream is None:
        seed = getattr(owner.vllm_config.model_config, "seed", None)
        stream = owner.__dict__["_zerokld_seed_stream"] = (
            random.Random(f"zerokld-sampler-{seed}") if seed is not None else None
        )
    return secrets.randbits(62) if stream is None else stream.getrandbits(62)


def _patch_front_end() -> None:
    def process_inputs(original):
        def zerokld_process_inputs(self, *args, **kwargs):
            request = original(self, *args, **kwargs)
            numerics = _numerics(self)
            _LAST_NUMERICS[0] = numerics
            if numerics is not None:
                _NUMERICS[request.request_id] = numerics  # the external id: vLLM adds a random suffix afterwards
            sp = request.sampling_params
            if sp is not None and _enabled(self) and sp.seed is None:
                sp.seed = unseeded_request_seed(self)  # sp is vLLM's clone of the caller's params
            return request

        return zerokld_process_inputs

    def from_new_request(original):
        def zerokld_from_new_request(cls, tokenizer, request, *args, **kwargs):
            state = original.__func__(cls, tokenizer, request, *args, **kwargs)
            state.zerokld_seed = request.sampling_params.seed if request.sampling_params is not None else None
            external = getattr(request, "external_req_id", None) or request.request_id
            state.zerokld_numerics = _NUMERICS.pop(external, _LAST_NUMERICS[0])  # n > 1 children: the parent's
            return state

        return classmethod(zerokld_from_new_request)

    replace("vllm.v1.engine.input_processor:InputProcessor.process_inputs", process_inputs)
    replace("vllm.v1.engine.output_processor:RequestState.from_new_request", from_new_request)


def tag_output(state, out) -> None:
    """``CompletionOutput.zerokld_seed`` / ``zerokld_numerics`` from the request's state (:mod:`vllm_plugin.outputs`
    calls it from vLLM's ``RequestState._new_completion_output``)."""
    out.zerokld_seed = getattr(state, "zerokld_seed", None)
    out.zerokld_numerics = getattr(state, "zerokld_numerics", None)


def tag_choice(choice, out) -> None:
    """The ``zerokld_seed`` / ``zerokld_numerics`` fields of a ``/v1/completions`` choice (``OpenAIBaseModel`` allows
    extra fields) from its output (:mod:`vllm_plugin.outputs`)."""
    for field in ("zerokld_seed", "zerokld_numerics"):
        value = getattr(out, field, None)
        if value is not None:
            setattr(choice, field, value)


def set_logprobs_definition(vocab_parallel: bool | None) -> None:
    """Which log-softmax vLLM's sampler runs in this process (``Sampler.compute_logprobs``, ``v1/sample/sampler.py``):
    ``None`` vLLM's own; ``False`` :func:`shared_numerics.log_softmax`; ``True`` (``tp_k_block``) the definition the
    trainer computes on its vocabulary shard (:func:`shared_numerics.vocab_parallel.log_softmax`). Set by the zerokld
    model's constructor (vLLM builds one model per engine process); the seam itself is installed at registration."""
    _LOGPROBS[0] = vocab_parallel


def _patch_logprobs() -> None:
    import shared_numerics as sn
    import shared_numerics.vocab_parallel as sn_vocab

    def compute_logprobs(original):
        def zerokld_compute_logprobs(logits):
            choice = _LOGPROBS[0]
            if choice is None:
                return original(logits)
            return (sn_vocab.log_softmax if choice else sn.log_softmax)(logits)

        return staticmethod(zerokld_compute_logprobs)

    replace("vllm.v1.sample.sampler:Sampler.compute_logprobs", compute_logprobs)


def _patch_worker() -> None:
    def wrap_update_states(update_states):
        def zerokld_update_states(self, scheduler_output):
            if _enabled(self):
                seeds = self.__dict__.setdefault("zerokld_seeds", {})
                for req_id in scheduler_output.finished_req_ids:
                    seeds.pop(req_id, None)
                for new in scheduler_output.scheduled_new_reqs:
                    sp = new.sampling_params
                    if sp is None:
                        continue
                    if sp.seed is not None:
                        seeds[new.req_id] = sp.seed
                        sp.seed = None  # no torch.Generator: vLLM's CPU offset bookkeeping never runs
                        if "sampling_type" in getattr(sp, "__dict__", {}):  # cached_property computed earlier
                            del sp.__dict__["sampling_type"]
                    else:
                        seeds.setdefault(new.req_id, secrets.randbits(62))
            return update_states(self, scheduler_output)

        return zerokld_update_states

    def wrap_sample(sample):
        def zerokld_sample(self, logits, spec_decode_metadata):
            if not _enabled(self):
                return sample(self, logits, spec_decode_metadata)
            batch = self.input_batch
            ids = batch.req_ids[: batch.num_reqs]
            seeds = torch.tensor([self.zerokld_seeds[r] for r in ids], dtype=torch.int64)
            positions = torch.tensor([len(self.requests[r].output_token_ids) for r in ids], dtype=torch.int64)
            token = _ROWS.set((seeds, positions))
            try:
                return sample(self, logits, spec_decode_metadata)
            finally:
                _ROWS.reset(token)

        return zerokld_sample

    replace("vllm.v1.worker.gpu_model_runner:GPUModelRunner._update_states", wrap_update_states)
    replace("vllm.v1.worker.gpu_model_runner:GPUModelRunner._sample", wrap_sample)


def _patch_sampler() -> None:
    def wrap(original):
        def zerokld_sample(self, logits, sampling_metadata, logprobs_mode_override=None):
            rows = _ROWS.get()
            md = sampling_metadata
            if rows is None or md.all_greedy:
                return original(self, logits, sampling_metadata, logprobs_mode_override)
            seeds, positions = rows
            if seeds.shape[0] != logits.shape[0]:
                raise RuntimeError(
                    f"zerokld sampler: {logits.shape[0]} logit rows for {seeds.shape[0]} requests "
                    "(speculative decoding is not supported)"
                )
            greedy = None if md.all_random else self.greedy_sample(logits)
            z = sn_sampling.scale_logits(logits, md.temperature)
            for processor in md.logitsprocs.argmax_invariant:
                z = processor.apply(z)
            sampled = sn_sampling.sample_scaled(z, seeds, positions, md.top_k, md.top_p)
            if greedy is not None:
                sampled = torch.where(md.temperature < _EPS, greedy, sampled)
            return sampled, None

        return zerokld_sample

    replace("vllm.v1.sample.sampler:Sampler.sample", wrap)


def install() -> None:
    """Install the sampler's seams (:mod:`vllm_plugin.seams`; idempotent; each checks the engine's config on every
    call). The output fields are added by :mod:`vllm_plugin.outputs` (:func:`tag_output`, :func:`tag_choice`)."""
    _patch_front_end()
    _patch_worker()
    _patch_sampler()
    _patch_logprobs()
