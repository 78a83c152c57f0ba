"""Rotary position embedding (RoPE), HF "rotate-half" layout.

The cos/sin table is computed in float64 from the absolute positions and rounded to float32, so a position's angle
never depends on which other positions are in the call. The rotation itself is elementwise float32 (on CPU one pass
of ``csrc/pointwise.cpp``'s ``zk_rope``, the same operations as the torch ops, the same bits).

Layout: HF checkpoints (Qwen3, Llama) pair dimension ``i`` with ``i + D/2`` ("rotate_half", ``is_neox_style=True`` in
vLLM). Source: Su et al., "RoFormer" (2021); HF ``modeling_llama.apply_rotary_pos_emb``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .norm import rms_norm
from .reduce import true_divide

__all__ = ["RopeScaling", "YarnScaling", "apply_rope", "rms_norm_rope", "rope_cos_sin", "yarn_get_mscale"]


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
            self.high_freq_factor - self.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """DeepSeek's YaRN magnitude factor ``0.1 * mscale * ln(scale) + 1`` (1 for ``scale <= 1``). Source: HF
    ``modeling_deepseek_v3.yarn_get_mscale``, DeepSeek-V3 ``inference/model.py``."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class YarnScaling:
    """YaRN frequency scaling (HF ``rope_type: "yarn"``, DeepSeek-V2/V3, Kimi, GLM-MoE): each frequency is a blend of
    the original (extrapolated) and ``factor``-interpolated one, ramped linearly between the correction dimensions of
    ``beta_fast`` and ``beta_slow`` rotations (floored / ceiled when ``truncate``), and cos/sin are multiplied by
    :attr:`attention_factor`. All of it in float64 here. Source: HF ``modeling_rope_utils._compute_yarn_parameters``
    (the same formula); Peng et al., "YaRN" (2023)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor_override: float | None = None
    truncate: bool = True
    rope_type: str = "yarn"

    @property
    def attention_factor(self) -> float:
        """The cos/sin multiplier: explicit ``attention_factor``, else ``mscale(factor, mscale) / mscale(factor,
        mscale_all_dim)`` when both are set, else ``mscale(factor)``."""
        if self.attention_factor_override is not None:
            return float(self.attention_factor_override)
        if self.mscale and self.mscale_all_dim:
            return yarn_get_mscale(self.factor, self.mscale) / yarn_get_mscale(self.factor, self.mscale_all_dim)
        return yarn_get_mscale(self.factor)

    def softmax_scale(self, qk_head_dim: int) -> float:
        """DeepSeek's attention scale ``qk_head_dim ** -0.5 * mscale(factor, mscale_all_dim) ** 2`` (only the
        ``qk_head_dim ** -0.5`` part without ``mscale_all_dim``). Source: HF ``modeling_deepseek_v3.
        yarn_apply_mscale``."""
        scale = qk_head_dim**-0.5
        if self.mscale_all_dim:
            m = yarn_get_mscale(self.factor, self.mscale_all_dim)
            scale = scale * m * m
        return scale

    def inv_freq(self, head_dim: int, theta: float) -> torch.Tensor:
        """``[head_dim / 2]`` float64 scaled inverse frequencies."""

        def correction_dim(rotations: float) -> float:
            return (head_dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
                2 * math.log(theta)
            )

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001  # HF's guard against a zero-width ramp
        pos_freqs = float(theta) ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        return (1.0 / (self.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, scaling: RopeScaling | YarnScaling | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cos/sin tables for ``positions``.

    Args:
        positions: ``[N]`` integer absolute positions (0-based).
        head_dim: rotary dimension ``D`` (even).
        theta: RoPE base (HF ``rope_theta``).
        scaling: Llama 3.x or YaRN frequency scaling (YaRN also multiplies cos and sin by its attention factor,
            in float64 before the rounding), or ``None``.

    Returns:
        ``(cos, sin)``, each ``[N, D/2]`` float32, on ``positions.device``.

    Raises:
        ValueError: odd ``head_dim``.
    """
    if head_dim % 2:
        raise ValueError(f"rotary dimension must be even, got {head_dim}")
    if isinstance(scaling, YarnScaling):
        inv_freq = scaling.inv_freq(head_dim, theta).to(positions.device)
    else:
        exponent = true_divide(torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device), head_dim)
        inv_freq = 1.0 / (float(theta) ** exponent)
        if scaling is not None:
            inv_freq = scaling.apply(inv_freq)
    angles = positions.to(torch.float64).reshape(-1, 1) * inv_freq.reshape(1, -1)
    if isinstance(scaling, YarnScaling) and scaling.attention_factor != 1.0:
        return (torch.cos(angles) * scaling.attention_factor).float(), (
            torch.sin(angles) * scaling.attention_factor
        ).float()
    return torch.cos(angles).float(), torch.sin(angles).float()


def _rotate_cpu(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """:func:`_rotate` in one pass (``csrc/pointwise.cpp`` ``zk_rope``: the same operations, the same bits) for a
    plain CPU ``[N, heads, D]`` float32 / bf16 ``x`` whose last dim is contiguous; ``None`` otherwise."""
    from . import cpu_ops
    from .cpu_kernels import plain

    if (
        x.device.type != "cpu"
        or x.dim() != 3
        or x.dtype not in (torch.float32, torch.bfloat16)
        or x.stride(-1) != 1
        or cos.dtype != torch.float32
        or sin.dtype != torch.float32
        or cos.device.type != "cpu"
        or tuple(cos.shape) != (x.shape[0], x.shape[-1] // 2)
        or tuple(sin.shape) != tuple(cos.shape)
    ):
        return None
    xp, cp, sp = plain(x), plain(cos), plain(sin)
    if xp is None or cp is None or sp is None:
        return None
    cp, sp = cp.contiguous(), sp.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype)
    if y.numel():
        cpu_ops.rope(xp, cp, sp, y)
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


def rms_norm_rope(
    x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor
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
