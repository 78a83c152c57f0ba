"""Every vLLM attribute zerokld replaces, in one table, checked against the running vLLM and installed once, at
plugin registration.

vLLM has no extension point for a model's sampler, its request seeds, the routed-experts capture on CPU, the
hot-load weight-version spans or the worker extension of an engine started without one, so the plugin replaces
those attributes. Each replacement is declared here (:data:`SEAMS`: target, what zerokld puts there, which modules
contribute to it). :func:`vllm_plugin.register.register` — vLLM calls it in every process it starts, before any model
is built — first runs :func:`check`, which refuses a vLLM that lacks a target with :class:`SeamError` naming each
missing target, the running vLLM version and the versions the table was verified with (:data:`VERIFIED_VLLM`),
instead of failing at the first request; then each module's installer, which replaces its targets through
:func:`replace` — the only place that assigns a vLLM attribute: an undeclared target or a second replacement of one
target is a :class:`SeamError` (no patch wraps another: a target two modules contribute to gets one replacement that
calls both). Nothing is installed later (no request path, no model constructor); replacements whose behaviour depends
on the engine read its settings when they run. ``tests/test_layering.py`` checks that ``vllm_plugin`` assigns no vLLM
attribute elsewhere and that registration installs every declared seam.

A target is "changed" when vLLM holds another kind of attribute there or its leading parameters differ from those
the replacement relies on; a change of meaning behind the same signature is what the parity tests, run against the
pinned vLLM, catch.

Source: vLLM's plugin system (``vllm/plugins/__init__.py``: ``load_general_plugins`` in every process).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

from zerokld_plugins.errors import ZeroKLDServerError

__all__ = ["SEAMS", "VERIFIED_VLLM", "Seam", "SeamError", "check", "installed", "missing", "replace"]

#: vLLM versions every target of :data:`SEAMS` was verified with (the test suite runs against them)
VERIFIED_VLLM = ("0.32.0",)


class SeamError(ZeroKLDServerError, RuntimeError):
    """The running vLLM lacks attributes zerokld replaces (the message names each, and the versions)."""


@dataclass(frozen=True)
class Seam:
    """One replaced vLLM attribute: ``target`` = ``"module:Class.attr"`` or ``"module:attr"``; ``purpose`` = what
    zerokld puts there; ``installers`` = the ``vllm_plugin`` modules that install it; ``kind`` = what vLLM holds there
    (``function``, ``classmethod``, ``staticmethod``, ``property``, ``tuple``) and ``params`` = the leading parameter
    names of that callable the replacement relies on (checked: a changed target is refused like a missing one)."""

    target: str
    purpose: str
    installers: tuple[str, ...]
    kind: str = "function"
    params: tuple[str, ...] = ()


_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
_STATE = "vllm.v1.engine.output_processor:RequestState"
_COMPLETION = "vllm.entrypoints.openai.completion.serving:OpenAIServingCompletion"
_CHAT = "vllm.entrypoints.openai.chat_completion.serving:OpenAIServingChat"

SEAMS: tuple[Seam, ...] = (
    Seam(
        "vllm.model_executor.model_loader.base_loader:initialize_model",
        "build ZeroKLDForCausalLM for a declared architecture with the switch on (any other refused at start)",
        ("vllm_plugin.register",),
        kind="function",
        params=("vllm_config",),
    ),
    Seam(
        "vllm.v1.engine.input_processor:InputProcessor.process_inputs",
        "draw a seed for requests without one (deterministic sampler), stamp the engine's numerics",
        ("vllm_plugin.sampler",),
        kind="function",
        params=("self",),
    ),
    Seam(
        f"{_STATE}.from_new_request",
        "carry the request's seed and numerics stamp to its outputs",
        ("vllm_plugin.sampler",),
        kind="classmethod",
        params=("cls", "tokenizer", "request"),
    ),
    Seam(
        f"{_STATE}._new_completion_output",
        "CompletionOutput.zerokld_seed / zerokld_numerics; the weight-version spans so far (hot-load attribution)",
        ("vllm_plugin.outputs", "vllm_plugin.sampler", "vllm_plugin.hotload.attribution"),
        kind="function",
        params=("self",),
    ),
    Seam(
        f"{_COMPLETION}.request_output_to_completion_response",
        "zerokld_seed / zerokld_numerics and weight_versions on each /v1/completions choice",
        ("vllm_plugin.outputs", "vllm_plugin.sampler", "vllm_plugin.hotload.attribution"),
        kind="function",
        params=("self", "final_res_batch"),
    ),
    Seam(
        f"{_COMPLETION}.completion_stream_generator",
        "weight_versions on streamed completion choices",
        ("vllm_plugin.hotload.attribution",),
        kind="function",
        params=("self", "request", "engine_inputs", "result_generator"),
    ),
    Seam(
        f"{_CHAT}.chat_completion_full_generator",
        "weight_versions on chat choices",
        ("vllm_plugin.hotload.attribution",),
        kind="function",
        params=("self", "request", "result_generator"),
    ),
    Seam(
        f"{_CHAT}.chat_completion_stream_generator",
        "weight_versions on streamed chat choices",
        ("vllm_plugin.hotload.attribution",),
        kind="function",
        params=("self", "request", "result_generator"),
    ),
    Seam(
        f"{_RUNNER}._update_states",
        "keep vLLM's per-request torch.Generator bookkeeping off for zerokld seeds",
        ("vllm_plugin.sampler",),
        kind="function",
        params=("self", "scheduler_output"),
    ),
    Seam(
        f"{_RUNNER}._sample",
        "sample with shared_numerics.sampling (noise = hash(seed, position, vocab id))",
        ("vllm_plugin.sampler",),
        kind="function",
        params=("self", "logits", "spec_decode_metadata"),
    ),
    Seam(
        f"{_RUNNER}.sample_tokens",
        "attach the routed experts recorded on CPU (enable_return_routed_experts)",
        ("vllm_plugin.routing",),
        kind="function",
        params=("self", "grammar_output"),
    ),
    Seam(
        "vllm.v1.sample.sampler:Sampler.sample",
        "the deterministic sampler inside vLLM's Sampler",
        ("vllm_plugin.sampler",),
        kind="function",
        params=("self", "logits", "sampling_metadata", "logprobs_mode_override"),
    ),
    Seam(
        "vllm.v1.sample.sampler:Sampler.compute_logprobs",
        "the sampler's log-softmax on shared_numerics (vocab-parallel with tp_k_block)",
        ("vllm_plugin.models.dense",),
        kind="staticmethod",
        params=("logits",),
    ),
    Seam(
        "vllm.config.vllm:VllmConfig._verify_aux_output_compatibility",
        "allow enable_return_routed_experts on CPU for zerokld MoE models, with zerokld's own checks",
        ("vllm_plugin.routing",),
        kind="function",
        params=("self",),
    ),
    Seam(
        "vllm.config.vllm:VllmConfig.use_v2_model_runner",
        "select vLLM's V1 model runner (where the hooks live) for zerokld engines",
        ("vllm_plugin.runner",),
        kind="property",
        params=("self",),
    ),
    Seam(
        "vllm.engine.arg_utils:EngineArgs.create_engine_config",
        "check zerokld engines' settings before any engine process starts, and give them the hot-load worker extension",
        ("vllm_plugin.start",),
        kind="function",
        params=("self",),
    ),
    Seam(
        "vllm.entrypoints.serve.middleware.authenticate:AuthenticationMiddleware.verify_token",
        "accept the server's key as Fireworks' X-Api-Key header too (hot-load servers only)",
        ("vllm_plugin.hotload.fireworks",),
        kind="function",
        params=("self", "headers"),
    ),
    Seam(
        "vllm.platforms.cpu:CpuPlatform.check_and_update_config",
        "keep chunked prefill, prefix caching and the block size of zerokld MLA engines (vLLM-CPU turns them off "
        "for its own MLA kernels)",
        ("vllm_plugin.latent_platform",),
        kind="classmethod",
        params=("cls", "vllm_config"),
    ),
    Seam(
        "vllm.lora.utils:_all_lora_classes",
        "vLLM's LoRA manager wraps zerokld projections with zerokld's layer",
        ("vllm_plugin.lora",),
        kind="tuple",
        params=(),
    ),
)


def _owner(target: str):
    """``(object, attribute name)`` of ``target``: its module imported, the classes on its path walked.

    Raises:
        ImportError: no such module. AttributeError: no such class on the path.
    """
    module, _, path = target.partition(":")
    obj = importlib.import_module(module)
    *parents, name = path.split(".")
    for part in parents:
        obj = getattr(obj, part)
    return obj, name


def _problem(seam: Seam) -> str | None:
    """Why ``seam`` cannot be installed on the running vLLM (``None``: it can)."""
    try:
        owner, name = _owner(seam.target)
        held = inspect.getattr_static(owner, name)
    except ImportError:
        return "no such module"
    except AttributeError:
        return "no such attribute"
    kind = {classmethod: "classmethod", staticmethod: "staticmethod", property: "property", tuple: "tuple"}.get(
        type(held), "function" if callable(held) else type(held).__name__
    )
    if kind != seam.kind:
        return f"a {kind}, not a {seam.kind}"
    if seam.params:
        fn = held.fget if isinstance(held, property) else getattr(held, "__func__", held)
        got = tuple(inspect.signature(fn).parameters)
        if got[: len(seam.params)] != seam.params:
            return f"parameters ({', '.join(got)}), expected ({', '.join(seam.params)}, ...)"
    return None


def missing(seams: tuple[Seam, ...] = SEAMS) -> list[Seam]:
    """The seams whose target the running vLLM lacks or changed (module or attribute absent, another kind of
    attribute, other leading parameters)."""
    return [s for s in seams if _problem(s) is not None]


def check(seams: tuple[Seam, ...] = SEAMS) -> None:
    """Refuse a vLLM that lacks any target of ``seams``.

    Raises:
        SeamError: naming every missing or changed target, what changed and what zerokld needs it for, the running
            vLLM version and :data:`VERIFIED_VLLM`.
    """
    problems = [(s, p) for s in seams if (p := _problem(s)) is not None]
    if problems:
        import vllm

        raise SeamError(
            f"zerokld cannot run on vLLM {getattr(vllm, '__version__', '?')} (verified with "
            f"{', '.join(VERIFIED_VLLM)}): it lacks or changed "
            + "; ".join(f"{s.target} ({p}; zerokld needs it to {s.purpose})" for s, p in problems)
        )


_INSTALLED: dict[str, object] = {}  # target -> vLLM's original
_BY: dict[str, str] = {}  # target -> the make that replaced it


def replace(target: str, make) -> None:
    """Replace the declared ``target`` with ``make(original)`` (``original``: the attribute as the class or module
    holds it — a function, a ``classmethod``'s bound method, a ``property``, a tuple), once per process; the same
    ``make`` again is a no-op.

    Raises:
        SeamError: ``target`` is not in :data:`SEAMS`, is missing from this vLLM, or was already replaced by another
            ``make`` (one replacement per target: a patch never wraps another).
    """
    who = f"{make.__module__}.{make.__qualname__}"
    if target in _INSTALLED:
        if _BY[target] != who:
            raise SeamError(
                f"{target} is replaced by {_BY[target]}; {who} would wrap that patch (contribute to "
                "the one replacement instead)"
            )
        return
    seam = next((s for s in SEAMS if s.target == target), None)
    if seam is None:
        raise SeamError(f"zerokld replaces {target}, which vllm_plugin.seams.SEAMS does not declare")
    check((seam,))
    owner, name = _owner(target)
    original = getattr(owner, name)
    setattr(owner, name, make(original))
    _INSTALLED[target] = original
    _BY[target] = who


def installed() -> dict[str, object]:
    """``{target: vLLM's original}`` of the seams installed in this process."""
    return dict(_INSTALLED)
