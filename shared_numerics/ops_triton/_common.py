"""Helpers shared by the Triton kernels' host wrappers."""

from __future__ import annotations

import triton

__all__ = ["next_pow2"]


def next_pow2(n: int, minimum: int = 16) -> int:
    return max(minimum, triton.next_power_of_2(int(n)))
