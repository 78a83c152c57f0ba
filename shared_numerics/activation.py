"""SiLU-and-mul (SwiGLU feed-forward gate), batch invariant.

``silu(g) * u = g / (1 + exp(-g)) * u``; the exponential runs through :func:`shared_numerics.reduce.exp64` so the
result of an element never depends on its position in the tensor. Source: Shazeer, "GLU Variants Improve
Transformer" (2020); vLLM ``SiluAndMul.forward_native``.
"""
from __future__ import annotations

import torch

from .reduce import exp64

__all__ = ["silu_and_mul"]


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``.

    Args:
        gate, up: same shape ``[..., I]``, float32 or bfloat16.

    Returns:
        ``[..., I]`` in ``gate.dtype``; arithmetic in float32 (exp in float64).
    """
    g = gate.float()
    y = g / (1.0 + exp64(-g)) * up.float()
    return y.to(gate.dtype)
