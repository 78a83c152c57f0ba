"""Partial RoPE, the grouped-query attention option GLM-4.5 needs (``partial_rotary_factor``): the shared op rotates
the first dimensions of each head and passes the rest through (:func:`shared_numerics.apply_rope` with narrower
tables), forward and backward; it is HF's ``apply_rotary_pos_emb`` up to float rounding, and TorchTitan's stock module
(:class:`titan_plugin.rope.PartialCosSinRoPE`) is too. Negative control: the full-width rotation of the same head
differs (the pass-through dimensions would move)."""

from __future__ import annotations

import pytest
import torch

import shared_numerics as sn

pytestmark = pytest.mark.timeout(120)


def _hf(x: torch.Tensor, pos: torch.Tensor, rotary: int, theta: float = 10000.0) -> torch.Tensor:
    """HF ``modeling_glm4_moe.apply_rotary_pos_emb`` on ``x [N, heads, D]`` (its default rope init, float32)."""
    from transformers.models.glm4_moe.modeling_glm4_moe import apply_rotary_pos_emb

    inv = 1.0 / (theta ** (torch.arange(0, rotary, 2, dtype=torch.float32) / rotary))
    freqs = pos[:, None].float() * inv[None]
    emb = torch.cat([freqs, freqs], dim=-1)
    q = x.transpose(0, 1)[None]  # [1, heads, N, D]
    out, _ = apply_rotary_pos_emb(q, q, emb.cos()[None], emb.sin()[None])
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_rope_rotates_the_first_dimensions_and_passes_the_rest(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 4, 32, generator=g).to(dtype)
    pos = torch.arange(100, 137)
    cos, sin = sn.rope_cos_sin(pos, 16, 10000.0)
    y = sn.apply_rope(x, cos, sin)
    assert y.shape == x.shape and y.dtype == dtype
    assert torch.equal(y[..., :16], sn.apply_rope(x[..., :16].contiguous(), cos, sin))
    assert torch.equal(y[..., 16:], x[..., 16:])
    full = sn.apply_rope(x, *sn.rope_cos_sin(pos, 32, 10000.0))
    assert not torch.equal(full, y)  # the negative control: rotating every dimension is another function
    w = torch.rand(32, generator=g).to(dtype) + 0.5
    assert torch.equal(sn.rms_norm_rope(x, w, 1e-6, cos, sin), sn.apply_rope(sn.rms_norm(x, w, 1e-6), cos, sin))
    ref = _hf(x.float(), pos, 16)
    assert (y.float() - ref).abs().max().item() < (1e-5 if dtype == torch.float32 else 0.05)
    with pytest.raises(ValueError, match="tables for 64 dimensions"):
        sn.apply_rope(x, *sn.rope_cos_sin(pos, 64, 10000.0))


def test_partial_rope_backward_is_the_rotation_and_the_identity():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 2, 32, generator=g, requires_grad=True)
    dy = torch.randn(9, 2, 32, generator=g)
    cos, sin = sn.rope_cos_sin(torch.arange(9), 16, 10000.0)
    sn.apply_rope(x, cos, sin).backward(dy)
    head = x.detach()[..., :16].clone().requires_grad_(True)
    sn.apply_rope(head, cos, sin).backward(dy[..., :16].contiguous())
    assert torch.equal(x.grad[..., :16], head.grad)
    assert torch.equal(x.grad[..., 16:], dy[..., 16:])


@pytest.mark.titan
def test_torchtitans_stock_partial_rope_is_hfs():
    from titan_plugin.rope import PartialCosSinRoPE

    rope = PartialCosSinRoPE.Config(dim=16, max_seq_len=64, theta=10000.0).build()
    rope.init_states(buffer_device=torch.device("cpu"))
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 20, 4, 32, generator=g)  # [B, L, heads, D]
    out, same = rope(q, q)
    ref = _hf(q[0], torch.arange(20), 16)
    assert torch.equal(out, same) and torch.equal(out[..., 16:], q[..., 16:])
    assert (out[0] - ref).abs().max().item() < 1e-5
