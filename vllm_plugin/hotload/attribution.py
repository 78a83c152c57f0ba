"""Per-token snapshot attribution on vLLM's OpenAI server: which snapshot sampled which tokens of a response.

vLLM 0.32 already labels weights (``AsyncLLM.update_weight_version``; ``v1/engine/core.py`` stamps every step's
outputs with the label, which changes only while generation is paused) and keeps, per request, the spans of output
tokens each label sampled (``RequestState.track_weight_version``, ``vllm.outputs.WeightVersionSpan``). The
replica labels the weights with the snapshot identity while the engine is paused for the swap, so the spans are
exact. vLLM returns them only on the finished output of its token-in/token-out ``generate`` API; this module
carries the same field, ``weight_versions`` (``[{"version", "start", "end"}]``: output tokens ``[start, end)``
sampled by the snapshot ``version``), on the routes RL clients use:

* ``/v1/completions`` and ``/v1/chat/completions``, non-streaming: on every choice, covering its whole output;
* the same routes streaming: on every chunk's choices, covering the output so far (the last span names the snapshot
  that sampled the chunk's tokens; a response that spans a swap shows where it switched).

:func:`versions_of` reads them back (the endpoint's response header uses it). The seams are installed at registration
(:mod:`vllm_plugin.seams`; the non-streaming fields through :mod:`vllm_plugin.outputs`) and stay inert until the
hot-load endpoint starts in the API server (:meth:`vllm_plugin.hotload.endpoint.ZeroKLDHotLoadEndpoint.init_state`
calls :func:`enable`).
Source: vLLM ``v1/engine/output_processor.py``, ``entrypoints/scale_out/token_in_token_out/protocol.py``.
"""

from __future__ import annotations

import json
from dataclasses import asdict

from ..seams import replace

__all__ = ["enable", "install", "spans_so_far", "tag_choice", "versions_in_sse", "versions_of"]

_ENABLED = [False]
_COMPLETION = "vllm.entrypoints.openai.completion.serving:OpenAIServingCompletion"
_CHAT = "vllm.entrypoints.openai.chat_completion.serving:OpenAIServingChat"


def _spans(output) -> list[dict] | None:
    spans = getattr(output, "weight_versions", None)
    return [asdict(s) for s in spans] if spans else None


def versions_of(choices: list) -> list[str]:
    """The snapshot identities that sampled ``choices`` (OpenAI JSON choices carrying ``weight_versions``), in order
    of first use; empty when none carries them."""
    seen: list[str] = []
    for c in choices or []:
        for span in (c.get("weight_versions") or []) if isinstance(c, dict) else []:
            if span.get("version") not in seen and span.get("end", 0) > span.get("start", 0):
                seen.append(span["version"])
    return seen


def _sse_data(event: str) -> dict | None:
    """The JSON object of one ``data: {...}`` server-sent event (vLLM's stream chunks), else ``None``."""
    if not event.startswith("data: {"):
        return None
    try:
        return json.loads(event[6:])
    except ValueError:
        return None


def versions_in_sse(chunk: bytes | str) -> list[str]:
    """:func:`versions_of` the choices of every event in a piece of a server-sent event stream."""
    text = chunk.decode("utf-8", "replace") if isinstance(chunk, bytes) else chunk
    events = [_sse_data(e) for e in text.split("\n\n")]
    return versions_of([c for data in events if data for c in data.get("choices") or []])


def _annotate_sse(chunk: str, spans: dict[int, list[dict]]) -> str:
    """Add ``weight_versions`` to the choices of one ``data: {...}`` server-sent event."""
    data = _sse_data(chunk) if spans else None
    if data is None:
        return chunk
    changed = False
    for choice in data.get("choices") or []:
        if (s := spans.get(choice.get("index"))) is not None:
            choice["weight_versions"] = s
            changed = True
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n" if changed else chunk


async def _tracking(results, spans: dict[int, list[dict]], num_choices: int | None):
    """Pass ``results`` through, recording each choice's latest spans (completions: ``(prompt_idx, output)``
    pairs, choice index ``output.index + prompt_idx * n``; chat: outputs, choice index ``output.index``)."""
    async for item in results:
        prompt_idx, res = item if num_choices is not None else (0, item)
        for output in res.outputs:
            if (s := _spans(output)) is not None:
                spans[output.index + prompt_idx * (num_choices or 0)] = s
        yield item


def spans_so_far(state, out) -> None:
    """Where attribution is on (:func:`enable`): ``out.weight_versions`` = the request's spans so far (vLLM sets them
    on the finished output only); called by :mod:`vllm_plugin.outputs` from ``RequestState._new_completion_output``."""
    if _ENABLED[0] and out.weight_versions is None and getattr(state, "detokenizer", None) is not None:
        out.weight_versions = state._weight_version_spans()


def tag_choice(choice, out) -> None:
    """Where attribution is on: the non-streaming ``/v1/completions`` choice's ``weight_versions``
    (:mod:`vllm_plugin.outputs`)."""
    if _ENABLED[0] and (s := _spans(out)) is not None:
        choice.weight_versions = s


def _patch_streams() -> None:
    def completion_stream(stream):
        async def stream_with_spans(self, request, engine_inputs, result_generator, *args, **kwargs):
            if not _ENABLED[0]:
                async for chunk in stream(self, request, engine_inputs, result_generator, *args, **kwargs):
                    yield chunk
                return
            spans: dict[int, list[dict]] = {}
            n = 1 if request.n is None else request.n
            async for chunk in stream(
                self, request, engine_inputs, _tracking(result_generator, spans, n), *args, **kwargs
            ):
                yield _annotate_sse(chunk, spans)

        return stream_with_spans

    def chat_full(full):
        async def full_with_spans(self, request, result_generator, *args, **kwargs):
            if not _ENABLED[0]:
                return await full(self, request, result_generator, *args, **kwargs)
            spans: dict[int, list[dict]] = {}
            response = await full(self, request, _tracking(result_generator, spans, None), *args, **kwargs)
            for choice in getattr(response, "choices", None) or []:
                if (s := spans.get(choice.index)) is not None:
                    choice.weight_versions = s
            return response

        return full_with_spans

    def chat_stream(stream):
        async def stream_with_spans(self, request, result_generator, *args, **kwargs):
            if not _ENABLED[0]:
                async for chunk in stream(self, request, result_generator, *args, **kwargs):
                    yield chunk
                return
            spans: dict[int, list[dict]] = {}
            async for chunk in stream(self, request, _tracking(result_generator, spans, None), *args, **kwargs):
                yield _annotate_sse(chunk, spans)

        return stream_with_spans

    replace(f"{_COMPLETION}.completion_stream_generator", completion_stream)
    replace(f"{_CHAT}.chat_completion_full_generator", chat_full)
    replace(f"{_CHAT}.chat_completion_stream_generator", chat_stream)


def install() -> None:
    """Install the streaming seams (idempotent; at registration, :mod:`vllm_plugin.seams`). The non-streaming fields
    go through :mod:`vllm_plugin.outputs`. Everything stays inert until :func:`enable`."""
    _patch_streams()


def enable() -> None:
    """Attribute tokens to snapshots in this process (the hot-load endpoint's start, in the API server)."""
    _ENABLED[0] = True
