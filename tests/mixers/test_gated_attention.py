"""Qwen3-Next's (and Qwen3.5's) gated full attention as the shared ops compose it: ``q_proj`` giving each head's query
and its output gate, per-head QK RMSNorm with zero-centred gains (``x̂ (1 + w)``: :func:`shared_numerics.rms_norm`
with the gain ``1 + w`` in float32), partial RoPE on the first quarter of each head, causal attention, the output
times ``sigmoid(gate)`` (:func:`shared_numerics.activation.sigmoid_gate`), ``o_proj``. HF's layer within float32
rounding; the gate and the zero-centred gains each matter (negative controls)."""

from __future__ import annotations

import pytest
import torch

import shared_numerics as sn
from shared_numerics.activation import sigmoid_gate

pytestmark = pytest.mark.timeout(300)


def _hf(seed: int):
    """HF's ``Qwen3NextAttention`` (layer 0 of a tiny ``Qwen3NextConfig``: 4 query heads over 2 K/V heads of 32,
    partial_rotary_factor 0.25) and its rotary embedding, float32, every parameter random."""
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextAttention, Qwen3NextRotaryEmbedding

    cfg = Qwen3NextConfig(
        hidden_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        partial_rotary_factor=0.25,
        num_hidden_layers=1,
        layer_types=["full_attention"],
        rms_norm_eps=1e-6,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    layer = Qwen3NextAttention(cfg, 0).float().eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return cfg, layer, Qwen3NextRotaryEmbedding(cfg)


def _ours(cfg, layer, x: torch.Tensor, gate: bool = True, zero_centred: bool = True) -> torch.Tensor:
    """The layer on the shared ops, ``x`` ``[T, hidden]`` one sequence from position 0."""
    t, hd, nq, nkv = x.shape[0], cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    qg = sn.linear(x, layer.q_proj.weight.detach()).view(t, nq, 2 * hd)
    q, g = qg[..., :hd].contiguous(), qg[..., hd:].reshape(t, nq * hd)
    k = sn.linear(x, layer.k_proj.weight.detach()).view(t, nkv, hd)
    v = sn.linear(x, layer.v_proj.weight.detach()).view(t, nkv, hd)

    def gain(norm):
        w = norm.weight.detach().float()
        return 1.0 + w if zero_centred else w

    cos, sin = sn.rope_cos_sin(torch.arange(t), int(hd * cfg.partial_rotary_factor), cfg.rope_parameters["rope_theta"])
    q = sn.rms_norm_rope(q, gain(layer.q_norm), cfg.rms_norm_eps, cos, sin)
    k = sn.rms_norm_rope(k, gain(layer.k_norm), cfg.rms_norm_eps, cos, sin)
    o = sn.dense_causal_attention(q[None], k[None], v[None], hd**-0.5)[0].reshape(t, nq * hd)
    return sn.linear(sigmoid_gate(o, g) if gate else o, layer.o_proj.weight.detach())


def test_ours_is_hfs_gated_attention_within_float32_rounding():
    cfg, layer, rotary = _hf(seed=0)
    x = torch.randn(40, 48, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(40)[None]
    mask = torch.full((40, 40), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        ref, _ = layer(x[None], rotary(x[None], pos), mask)
    ours = _ours(cfg, layer, x)
    assert ours.shape == ref[0].shape == (40, 48)
    torch.testing.assert_close(ours, ref[0], rtol=1e-5, atol=1e-5)
    for wrong in (_ours(cfg, layer, x, gate=False), _ours(cfg, layer, x, zero_centred=False)):
        assert (wrong - ref[0]).abs().max() > 1e-2  # each of the two is the model's


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_the_output_gate_is_elementwise_and_one_rounding(dtype):
    """``sigmoid_gate`` is elementwise (a row's bits alone are its bits in a batch) and within an ulp of the exact
    product; HF's ``x * torch.sigmoid(gate)`` in bf16 (the sigmoid rounded to bf16 first) is another function."""
    g = torch.Generator().manual_seed(2)
    x, gate = torch.randn(64, 96, generator=g).to(dtype), (torch.randn(64, 96, generator=g) * 3).to(dtype)
    y = sigmoid_gate(x, gate)
    assert y.dtype == dtype and torch.equal(
        y, torch.cat([sigmoid_gate(x[i : i + 1], gate[i : i + 1]) for i in range(64)])
    )
    exact = x.double() * torch.sigmoid(gate.double())
    ulp = 2.0 ** (-23 if dtype == torch.float32 else -7)  # within an ulp of the exact product in x's dtype
    assert ((y.double() - exact).abs() <= ulp * exact.abs()).all()
    if dtype == torch.bfloat16:
        assert not torch.equal(x * torch.sigmoid(gate), y)
