"""Partial RoPE in TorchTitan (grouped-query attention's ``partial_rotary_factor``: GLM-4.5's 0.5).

TorchTitan 0.3.0's ``CosSinRoPE`` rotates every dimension of a head (its cache is ``dim`` wide and it splits it by
the head size). :class:`PartialCosSinRoPE` is that module over the first ``dim`` dimensions of each head, the rest
passed through: HF ``apply_rotary_pos_emb`` (``modeling_glm4_moe.py``: ``q_rot, q_pass = q[..., :rotary_dim],
q[..., rotary_dim:]``), with TorchTitan's own rotate-half arithmetic on the rotated part (the trainer's stock
numerics). With zerokld on it becomes :class:`titan_plugin.overrides.ZeroKLDCosSinRoPE`, which rotates the same
dimensions with :func:`shared_numerics.apply_rope`. Its state-dict keys are ``CosSinRoPE``'s (none: the cache is a
non-persistent buffer)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchtitan.models.common.rope import CosSinRoPE

__all__ = ["PartialCosSinRoPE"]


class PartialCosSinRoPE(CosSinRoPE):
    """``CosSinRoPE`` over the first ``config.dim`` dimensions of each ``[B, L, heads, head_dim]`` head."""

    @dataclass(kw_only=True, slots=True)
    class Config(CosSinRoPE.Config):
        pass

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.config.dim
        q_rot, k_rot = super().forward(query[..., :r], key[..., :r], positions)
        return torch.cat([q_rot, query[..., r:]], dim=-1), torch.cat([k_rot, key[..., r:]], dim=-1)
