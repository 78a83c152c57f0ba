"""Wall-clock timing shared by the CPU benchmarks."""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["cuda_event_ms", "machine_phrase", "wall_times", "wall_times_interleaved"]


def wall_times(fn: Callable[[], object], repeats: int, warmup: int = 1) -> list[float]:
    """Seconds of ``repeats`` calls of ``fn`` (``time.perf_counter``), after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def cuda_event_ms(fn: Callable[[], object], repeats: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of one call of ``fn`` between two CUDA events, the GPU idle before each (the host's launch
    cost included), after ``warmup`` untimed calls (the GPU benchmarks' eager timing)."""
    import statistics

    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def wall_times_interleaved(fns: list[Callable[[], object]], repeats: int, min_s: float = 0.02) -> list[list[float]]:
    """Seconds per call of each of ``fns``, ``repeats`` rounds, the functions taking turns within a round (so that a
    slow spell of the machine hits all of them alike); each timing covers as many back-to-back calls as fill
    ``min_s`` (so that sub-millisecond calls are not timer- and jitter-bound), after one untimed call of each."""
    loops = []
    for fn in fns:
        t0 = time.perf_counter()
        fn()
        loops.append(max(1, int(min_s / max(time.perf_counter() - t0, 1e-7))))
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, (fn, n) in enumerate(zip(fns, loops, strict=True)):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            times[i].append((time.perf_counter() - t0) / n)
    return times


def machine_phrase(m: dict) -> str:
    """A results table's "measured on" phrase for :func:`shared_numerics.machine.machine_facts` (CPU model, ISA flags,
    cores, threads, platform); early results recorded only the CPU count and the platform."""
    if "cpu_model" not in m:
        return f"{m['cpus']} CPU cores ({m['platform']})"
    isa = ", ".join(m["isa_flags"]) or "no AVX2"
    return f"{m['cpu_model']} ({isa}; {m['cores']} cores, {m['threads']} threads, {m['platform']})"
