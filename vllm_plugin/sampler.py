"""The deterministic sampler: vLLM's ``Sampler.sample`` on :mod:`shared_numerics.sampling` when the zerokld config
has ``batch_invariant`` (and ``deterministic_sampler``, default on).

Three patches, each a no-op unless the engine's config enables the sampler:

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
"""
from __future__ import annotations

import contextvars
import random
import secrets

import torch

import shared_numerics.sampling as sn_sampling

from .config import ZeroKLDConfigError, config_or_off, from_vllm_config, numerics_stamp

__all__ = ["check_sampler_supported", "install", "unseeded_request_seed"]

_ROWS: contextvars.ContextVar = contextvars.ContextVar("zerokld_sampler_rows", default=None)
_EPS = 1e-5
_INSTALLED = False


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
        on = owner.__dict__["_zerokld_sampler_enabled"] = config_or_off(owner.vllm_config).sampler_enabled
    return on


def unseeded_request_seed(owner) -> int:
    """The seed of the next request without one (62 bits), drawn by ``owner`` (the front end's input processor) from
    a ``random.Random`` seeded with the engine's ``model_config.seed``: reproducible for the same engine seed and
    request order; ``secrets.randbits`` when the engine has no seed."""
    stream = owner.__dict__.get("_zerokld_seed_stream")
    if stream is None:
        seed = getattr(owner.vllm_config.model_config, "seed", None)
        stream = owner.__dict__["_zerokld_seed_stream"] = (
            random.Random(f"zerokld-sampler-{seed}") if seed is not None else None)
    return secrets.randbits(62) if stream is None else stream.getrandbits(62)


def _patch_front_end() -> None:
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.engine.output_processor import RequestState

    process_inputs = InputProcessor.process_inputs

    def zerokld_process_inputs(self, *args, **kwargs):
        request = process_inputs(self, *args, **kwargs)
        numerics = _numerics(self)
        _LAST_NUMERICS[0] = numerics
        if numerics is not None:
            _NUMERICS[request.request_id] = numerics  # the external id: vLLM adds a random suffix afterwards
            _patch_openai_completions()
        sp = request.sampling_params
        if sp is not None and _enabled(self):
            if sp.seed is None:
                sp.seed = unseeded_request_seed(self)  # sp is vLLM's clone of the caller's params
            _patch_openai_completions()  # in the API server, once its serving module is loaded
        return request

    InputProcessor.process_inputs = zerokld_process_inputs

    from_new_request = RequestState.from_new_request.__func__
    new_completion_output = RequestState._new_completion_output

    def zerokld_from_new_request(cls, tokenizer, request, *args, **kwargs):
        state = from_new_request(cls, tokenizer, request, *args, **kwargs)
        state.zerokld_seed = request.sampling_params.seed if request.sampling_params is not None else None
        external = getattr(request, "external_req_id", None) or request.request_id
        state.zerokld_numerics = _NUMERICS.pop(external, _LAST_NUMERICS[0])  # n > 1 children: the parent's
        return state

    def zerokld_new_completion_output(self, *args, **kwargs):
        out = new_completion_output(self, *args, **kwargs)
        out.zerokld_seed = getattr(self, "zerokld_seed", None)
        out.zerokld_numerics = getattr(self, "zerokld_numerics", None)
        return out

    RequestState.from_new_request = classmethod(zerokld_from_new_request)
    RequestState._new_completion_output = zerokld_new_completion_output


def _patch_openai_completions() -> None:
    """Add ``zerokld_seed`` to each ``/v1/completions`` choice (``OpenAIBaseModel`` allows extra fields). Patched
    lazily, only where vLLM's OpenAI server already imported the module (not in engine or worker processes)."""
    import sys

    module = sys.modules.get("vllm.entrypoints.openai.completion.serving")
    if module is None:
        return
    cls = module.OpenAIServingCompletion
    original = cls.request_output_to_completion_response
    if getattr(original, "_zerokld", False):
        return

    def with_seeds(self, final_res_batch, *args, **kwargs):
        response = original(self, final_res_batch, *args, **kwargs)
        outputs = [o for res in final_res_batch for o in res.outputs]
        for choice, out in zip(response.choices, outputs):  # vLLM appends choices in this order
            for field in ("zerokld_seed", "zerokld_numerics"):
                value = getattr(out, field, None)
                if value is not None:
                    setattr(choice, field, value)
        return response

    with_seeds._zerokld = True
    cls.request_output_to_completion_response = with_seeds


def _patch_worker() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    update_states = GPUModelRunner._update_states
    sample = GPUModelRunner._sample

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

    GPUModelRunner._update_states = zerokld_update_states
    GPUModelRunner._sample = zerokld_sample


def _patch_sampler() -> None:
    from vllm.v1.sample.sampler import Sampler

    original = Sampler.sample

    def zerokld_sample(self, logits, sampling_metadata, logprobs_mode_override=None):
        rows = _ROWS.get()
        md = sampling_metadata
        if rows is None or md.all_greedy:
            return original(self, logits, sampling_metadata, logprobs_mode_override)
        seeds, positions = rows
        if seeds.shape[0] != logits.shape[0]:
            raise RuntimeError(f"zerokld sampler: {logits.shape[0]} logit rows for {seeds.shape[0]} requests "
                               "(speculative decoding is not supported)")
        greedy = None if md.all_random else self.greedy_sample(logits)
        z = sn_sampling.scale_logits(logits, md.temperature)
        for processor in md.logitsprocs.argmax_invariant:
            z = processor.apply(z)
        sampled = sn_sampling.sample_scaled(z, seeds, positions, md.top_k, md.top_p)
        if greedy is not None:
            sampled = torch.where(md.temperature < _EPS, greedy, sampled)
        return sampled, None

    Sampler.sample = zerokld_sample


def install() -> None:
    """Install the three patches (idempotent; each checks the engine's config on every call)."""
    global _INSTALLED
    if _INSTALLED:
        return
    _patch_front_end()
    _patch_worker()
    _patch_sampler()
    _INSTALLED = True
