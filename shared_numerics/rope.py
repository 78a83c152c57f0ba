"""Rotary position embedding (RoPE), HF "rotate-half" layout.

The cos/sin table is computed in float64 from the absolute positions and rounded to float32, so a position's angle
never depends on which other positions are in the call. The rotation itself is elementwise float32 (on CPU one pass
of ``csrc/pointwise.cpp``'s ``zk_rope``, the same operations as the torch ops, the same bits).

Layout: HF checkpoints (Qwen3, Llama) pair dimension ``i`` with ``i + D/2`` ("rotate_half", ``is_neox_style=True`` in
vLLM). Source: Su et al., "RoFormer" (2021); HF ``modeling_llama.apply_rotary_pos_emb``.
"""
from __future__ import annotations

import ctypes
import functools
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


@functools.lru_cache(maxsize=1)
def _lib():
    from .cpu_kernels import load

    lib = load("pointwise")
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.zk_rope.argtypes = [ctypes.c_int, vp, i64, i64, i64, i64, i64, vp, vp, vp, ctypes.c_int]
    lib.zk_rope.restype = None
    return lib


def _rotate_cpu(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """:func:`_rotate` in one pass (``csrc/pointwise.cpp`` ``zk_rope``: the same operations, the same bits) for a
    plain CPU ``[N, heads, D]`` float32 / bf16 ``x`` whose last dim is contiguous; ``None`` otherwise."""
    from .cpu_kernels import DTYPE_CODES, plain

    if (x.device.type != "cpu" or x.dim() != 3 or x.dtype not in (torch.float32, torch.bfloat16) or x.stride(-1) != 1
            or cos.dtype != torch.float32 or sin.dtype != torch.float32 or cos.device.type != "cpu"
            or tuple(cos.shape) != (x.shape[0], x.shape[-1] // 2) or tuple(sin.shape) != tuple(cos.shape)):
        return None
    xp, cp, sp = plain(x), plain(cos), plain(sin)
    if xp is None or cp is None or sp is None:
        return None
    cp, sp = cp.contiguous(), sp.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype)
    if y.numel():
        _lib().zk_rope(DTYPE_CODES[x.dtype], xp.data_ptr(), x.shape[0], x.shape[1], x.shape[2], xp.stride(0),
                       xp.stride(1), cp.data_ptr(), sp.data_ptr(), y.data_ptr(), torch.get_num_threads())
    return y


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] % 2 == 0:
        y = _rotate_cpu(x, cos, sin)
        if y is not None:
            return y
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
