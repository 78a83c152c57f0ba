"""What a benchmark or a run records about the machine it ran on: CPU model, ISA flags, threads.

Ratios against stock vLLM / torch move a lot between CPUs (stock picks AMX or AVX512-BF16 kernels where the CPU has
them; an AVX2-only CPU runs bf16 GEMMs without a matrix unit), and the bits of a run depend on the ISA too, so every
JSON under ``benchmarks/results/`` and every example summary carries :func:`machine_facts`.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

__all__ = ["ISA_FLAGS", "PATH_SWITCHES", "cpu_model", "isa_flags", "machine_facts", "path_switches"]

#: the ISA flags that change which kernels torch and oneDNN pick (and so the bits of a run): ``/proc/cpuinfo`` names
ISA_FLAGS = ("amx_bf16", "avx512_bf16", "avx512f", "avx2")
#: environment switches that put a process on an older CPU's path (docs/tests.md, "CPU paths"; ``make ... CPU_PATH=``)
PATH_SWITCHES = (
    "ZEROKLD_AMX",
    "ZEROKLD_F32_KERNEL",
    "ZEROKLD_CPU_MARCH",
    "ATEN_CPU_CAPABILITY",
    "ONEDNN_MAX_CPU_ISA",
)


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``'s ``model name``; the platform's processor string elsewhere)."""
    for line in _cpuinfo().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def isa_flags() -> list[str]:
    """Which of :data:`ISA_FLAGS` the CPU has (``/proc/cpuinfo``'s ``flags``; empty where that is unreadable)."""
    flags = next((line.split(":", 1)[1].split() for line in _cpuinfo().splitlines() if line.startswith("flags")), [])
    return [f for f in ISA_FLAGS if f in flags]


def path_switches() -> dict[str, str]:
    """Which of :data:`PATH_SWITCHES` this process has set (``{}``: the machine's own path)."""
    return {k: os.environ[k] for k in PATH_SWITCHES if k in os.environ}


def machine_facts() -> dict:
    """``{"cpu_model", "isa_flags", "cores", "threads", "platform", "torch", "path_switches", "date"}``: ``threads`` is
    ``torch.get_num_threads()`` of the calling process (the intra-op threads its CPU kernels use), ``cores``
    ``os.cpu_count()``, ``path_switches`` :func:`path_switches` (an emulated older CPU's path), ``date`` today's
    (ISO 8601, local time: the day a benchmark measured)."""
    import datetime

    import torch

    return {
        "cpu_model": cpu_model(),
        "isa_flags": isa_flags(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "path_switches": path_switches(),
        "date": datetime.date.today().isoformat(),
    }
