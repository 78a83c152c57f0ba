"""Rotary position embedding (RoPE), HF "rotate-half" layout.

The cos/sin table is computed in float64 from the absolute positions and rounded to float32, so a position's angle
never depends on which other positions are in the call. The rotation itself is elementwise float32.

Layout: HF checkpoints (Qwen3, Llama) pair dimension ``i`` with ``i + D/2`` ("rotate_half", ``is_neox_style=True`` in
vLLM). Source: Su et al., "RoFormer" (2021); HF ``modeling_llama.apply_rotary_pos_emb``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .norm import rms_norm
from .reduce import true_divide

__all__ = ["RopeScaling", "apply_rope", "rms_norm_rope", "rope_cos_sin"]


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.x frequency scaling (HF ``rope_scaling`` / ``rope_parameters`` with ``rope_type: "llama3"``).

    Wavelengths longer than ``original_max_position_embeddings / low_freq_factor`` are stretched by ``factor``,
    shorter than ``original_max_position_embeddings / high_freq_factor`` are kept, and the band between is a linear
    blend — HF ``modeling_rope_utils._compute_llama3_parameters`` (the same formula, evaluated in float64 here)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    rope_type: str = "llama3"

    def apply(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """Scaled inverse frequencies (float64 in, float64 out)."""
        low_wavelen = self.original_max_position_embeddings / self.low_freq_factor
        high_wavelen = self.original_max_position_embeddings / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (self.original_max_position_embeddings / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, scaling: RopeScaling | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Cos/sin tables for ``positions``.

    Args:
        positions: ``[N]`` integer absolute positions (0-based).
        head_dim: rotary dimension ``D`` (even).
        theta: RoPE base (HF ``rope_theta``).
        scaling: Llama 3.x frequency scaling, or ``None``.

    Returns:
        ``(cos, sin)``, each ``[N, D/2]`` float32, on ``positions.device``.

    Raises:
        ValueError: odd ``head_dim``.
    """
    if head_dim % 2:
        raise ValueError(f"rotary dimension must be even, got {head_dim}")
    exponent = true_divide(torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device), head_dim)
    inv_freq = 1.0 / (float(theta) ** exponent)
    if scaling is not None:
        inv_freq = scaling.apply(inv_freq)
    angles = positions.to(torch.float64).reshape(-1, 1) * inv_freq.reshape(1, -1)
    return torch.cos(angles).float(), torch.sin(angles).float()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x32 = x.float()
    x1, x2 = x32[..., :half], x32[..., half:]
    c = cos.unsqueeze(1)
    s = sin.unsqueeze(1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


class _Rope(torch.autograd.Function):
    """:func:`apply_rope` with its closed-form backward, the rotation by the opposite angle: ``dx1 = dy1 c + dy2 s``,
    ``dx2 = dy2 c - dy1 s`` (float32, one rounding) — a row's gradient depends only on that row, and no autograd graph
    of slices and concatenations is kept."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        half = grad.shape[-1] // 2
        g = grad.float()
        g1, g2 = g[..., :half], g[..., half:]
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        return torch.cat([g1 * c + g2 * s, g2 * c - g1 * s], dim=-1).to(grad.dtype), None, None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` by the given tables.

    Args:
        x: ``[N, heads, D]`` float32 or bfloat16 (token-major, as both vLLM and the trainer flatten tokens).
        cos, sin: ``[N, D/2]`` from :func:`rope_cos_sin`.

    Returns:
        ``[N, heads, D]`` in ``x.dtype``: ``(x1*cos - x2*sin, x2*cos + x1*sin)`` with ``x1, x2`` the two halves.
    """
    if torch.is_grad_enabled() and x.requires_grad and not (cos.requires_grad or sin.requires_grad):
        return _Rope.apply(x, cos, sin)
    return _rotate(x, cos, sin)


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor
                  ) -> torch.Tensor:
    """Per-head RMSNorm then RoPE (Qwen3's QK-norm before the rotation): ``apply_rope(rms_norm(x, weight, eps), cos,
    sin)``, by definition bitwise that composition (backends may fuse it into one pass; Triton does).

    Args:
        x: ``[N, heads, D]`` float32 or bfloat16; weight: ``[D]``; eps: as :func:`shared_numerics.norm.rms_norm`.
        cos, sin: ``[N, D/2]`` from :func:`rope_cos_sin`.

    Returns:
        ``[N, heads, D]`` in ``x.dtype``. Source: HF ``Qwen3Attention.forward`` (``q_norm``/``k_norm`` then
        ``apply_rotary_pos_emb``).
    """
    return apply_rope(rms_norm(x, weight, eps), cos, sin)
