"""Wall-clock timing shared by the CPU benchmarks."""
from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["wall_times"]


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
