"""Every ``ZEROKLD_*`` environment variable zerokld reads: its name, type, default and meaning, in one place (vLLM
keeps its own the same way, ``vllm/envs.py``).

Read one as an attribute — ``from zerokld_plugins import envs; envs.ZEROKLD_GEMM_THREADS`` — and the environment is
consulted at that moment, parsed, with the default where the variable is unset or empty. A module that caches a
value reads it once at import (``shared_numerics.linear.ONEDNN_THREADS``, ``deltasync.snapshot.ENCODE_THREADS``)
or once per process (the machine-property functions, ``functools.lru_cache``), as it did before this module.
``python -m zerokld_plugins`` lists them with their current values. Other packages' variables that zerokld sets or
reads (``TRITON_INTERPRET``, ``CXX``, ``RANK`` / ``WORLD_SIZE`` / ``MASTER_*``, vLLM's ``VLLM_*``, oneDNN's
``ONEDNN_MAX_CPU_ISA``, ATen's ``ATEN_CPU_CAPABILITY``) keep their owners' names and documentation.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["VARIABLES", "EnvVar", "describe"]


def _on(value: str) -> bool:
    """A switch that only ``"0"`` turns off."""
    return value != "0"


def _cache_dir() -> Path:
    return Path.home() / ".cache" / "zerokld"


@dataclass(frozen=True)
class EnvVar:
    """One variable: ``parse`` turns its string into the value; ``default`` (or ``default_factory``) stands where it
    is unset or empty."""

    name: str
    parse: Callable[[str], Any]
    default: Any
    doc: str
    default_factory: Callable[[], Any] | None = None

    def read(self) -> Any:
        """The current value (parsed; the default where unset or empty).

        Raises:
            ValueError: a value ``parse`` refuses (e.g. ``ZEROKLD_GEMM_THREADS=two``), naming the variable.
        """
        raw = os.environ.get(self.name)
        if not raw:
            return self.default_factory() if self.default_factory else self.default
        try:
            return self.parse(raw)
        except ValueError as e:
            raise ValueError(f"{self.name}={raw!r}: {e}") from None


VARIABLES: dict[str, EnvVar] = {
    v.name: v
    for v in (
        # numerics (shared_numerics): both sides of an RL loop must agree; the numerics contract records what matters
        EnvVar(
            "ZEROKLD_BACKEND",
            str,
            None,
            "the numerics backend on both sides, `torch` | `triton` | `cublas` (unset: `triton` on CUDA, `torch` "
            "elsewhere; part of the NumericsMode)",
        ),
        EnvVar(
            "ZEROKLD_AMX",
            _on,
            True,
            "`0`: never use the AMX tiles (bf16 GEMMs take the float32 FMA kernel; emulates a CPU without AMX)",
        ),
        EnvVar("ZEROKLD_F32_KERNEL", _on, True, "`0`: float32 GEMMs take oneDNN calls instead of zerokld's FMA kernel"),
        EnvVar(
            "ZEROKLD_GEMM_THREADS",
            int,
            1,
            "OpenMP threads of every pinned oneDNN GEMM call (both sides the same; in the numerics contract)",
        ),
        EnvVar(
            "ZEROKLD_CPU_MARCH",
            str,
            "native",
            "`-march` the CPU kernels are compiled with (`x86-64-v3`: an AVX2 CPU's kernels on a newer one)",
        ),
        EnvVar(
            "ZEROKLD_CACHE_DIR",
            Path,
            None,
            "where the compiled CPU kernels are kept (default `~/.cache/zerokld`)",
            default_factory=_cache_dir,
        ),
        # hot-load (deltasync)
        EnvVar("ZEROKLD_ENCODE_THREADS", int, 0, "threads that encode and decode delta snapshots (0: every CPU)"),
        # vLLM plugin helpers
        EnvVar(
            "ZEROKLD_KV_CACHE_BYTES",
            int,
            None,
            "`kv_cache_memory_bytes` of every engine and server the helpers "
            "start (`vllm_plugin.engines.start_llm`, `vllm_plugin.serve`); unset: vLLM sizes it",
        ),
        EnvVar(
            "ZEROKLD_FAULT_COPY_ARM",
            Path,
            None,
            "tests only: while this file exists, a hot-load's weight copy "
            "pauses after its third tensor, so a kill lands inside the copy (`vllm_plugin.faults`)",
        ),
        EnvVar(
            "ZEROKLD_FAULT_STEP_DELAY_ARM",
            Path,
            None,
            "tests only: while this file exists, each engine step sleeps the seconds it holds (`vllm_plugin.faults`)",
        ),
        # the training server (titan_plugin.training_server)
        EnvVar("ZEROKLD_API_KEY", str, None, "the training server's API key (`--api-key` default)"),
        EnvVar(
            "ZEROKLD_SAMPLER_API_KEY",
            str,
            None,
            "the key the training server sends to its `--sampler-url` (`--sampler-api-key` default)",
        ),
    )
}


def __getattr__(name: str) -> Any:
    if name in VARIABLES:
        return VARIABLES[name].read()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*VARIABLES, *__all__])


def describe() -> list[dict]:
    """Every variable: ``name``, ``value`` (current, parsed; an unparsable value as its error), ``set`` (in the
    environment now), ``doc``."""
    rows = []
    for v in VARIABLES.values():
        try:
            value = v.read()
        except ValueError as e:
            value = f"invalid: {e}"
        rows.append({"name": v.name, "value": value, "set": bool(os.environ.get(v.name)), "doc": v.doc})
    return rows
