"""Qwen3-Next's (and Qwen3.5-MoE's) MoE block: softmax top-k routed experts beside a sigmoid-gated shared expert
(:func:`shared_numerics.moe.moe_forward` with ``shared`` and ``shared_gate``): HF's block within float32 rounding,
every row the same bits alone as in any batch, the gradient of the definition's ops."""

from __future__ import annotations

import pytest
import torch

from shared_numerics.moe import moe_forward
from zerokld_testing.controls import stock_differs

pytestmark = pytest.mark.timeout(300)


def _hf_block(seed: int, shared_size: int = 40):
    """HF's ``Qwen3NextSparseMoeBlock`` of a tiny ``Qwen3NextConfig`` (6 experts, top 2, renormalised), float32,
    every parameter random."""
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

    cfg = Qwen3NextConfig(
        hidden_size=32,
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=shared_size,
        norm_topk_prob=True,
        num_hidden_layers=1,
        layer_types=["full_attention"],
    )
    torch.manual_seed(seed)
    block = Qwen3NextSparseMoeBlock(cfg).float().eval()
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return block


def _ours(block, x, dtype):
    """Our block on HF's weights (its fused ``gate_up_proj`` split into gate and up), in ``dtype``."""
    e, i = block.experts.gate_up_proj.shape[0], block.experts.gate_up_proj.shape[1] // 2
    gu = block.experts.gate_up_proj.detach().to(dtype)
    se = block.shared_expert
    shared = tuple(w.weight.detach().to(dtype) for w in (se.gate_proj, se.up_proj, se.down_proj))
    out, ids = moe_forward(
        x.to(dtype),
        block.gate.weight.detach().to(dtype),
        gu[:, :i],
        gu[:, i:],
        block.experts.down_proj.detach().to(dtype),
        block.gate.top_k,
        renormalize=block.gate.norm_topk_prob,
        shared=shared,
        shared_gate=block.shared_expert_gate.weight.detach().to(dtype),
    )
    assert ids.shape == (x.shape[0], block.gate.top_k) and int(ids.max()) < e
    return out


def test_ours_is_hfs_block_within_float32_rounding():
    """Our definition is the model's: HF's ``Qwen3NextSparseMoeBlock`` within 1e-5 in float32 (HF's products and
    sums in other orders), the shared expert's gate included (the block without it differs by far more)."""
    block = _hf_block(seed=0)
    x = torch.randn(50, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = block(x[None])[0]
    ours = _ours(block, x, torch.float32)
    assert ours.shape == ref.shape == (50, 32)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        ungated = ref - block.shared_expert(x) * (torch.sigmoid(block.shared_expert_gate(x)) - 1)
    assert (ungated - ref).abs().max() > 1e-2  # the gate matters at these weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_row_is_the_same_bits_alone_and_in_any_batch(dtype):
    """Each token's output is the same bits alone, in a batch of 64 and at any position in it; negative control:
    HF's own block in float32 gives some row other bits alone than in the batch."""
    block = _hf_block(seed=2)
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(3))
    batch = _ours(block, x, dtype)
    alone = torch.cat([_ours(block, x[i : i + 1], dtype) for i in range(64)])
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(4))
    shuffled = _ours(block, x[perm], dtype)
    assert batch.shape == alone.shape == (64, 32)
    assert torch.equal(batch, alone) and torch.equal(shuffled, batch[perm])
    if dtype == torch.float32:  # (HF's bf16 block happens to be row-invariant on the CPUs measured)
        with torch.no_grad():
            hf_batch = block(x[None])[0]
            hf_alone = torch.cat([block(x[i : i + 1][None])[0] for i in range(64)])
        stock_differs(not torch.equal(hf_batch, hf_alone), "HF Qwen3NextSparseMoeBlock fp32 alone vs batch", "64 rows")


def test_gradients_are_the_definitions_and_need_the_gate():
    """Under autograd every weight and ``x`` get gradients that match autograd through the same ops written out
    (route, experts, gated shared expert) within float32 rounding; refused: a shared expert without its gate."""
    from shared_numerics import linear, silu_and_mul
    from shared_numerics.activation import sigmoid_gate
    from shared_numerics.moe import gather_route_weights, moe_experts, route_topk

    g = torch.Generator().manual_seed(5)
    n, h, i, e, s = 20, 16, 12, 4, 20
    leaves = [
        torch.randn(n, h, generator=g),
        torch.randn(e, h, generator=g) * 0.3,
        torch.randn(e, i, h, generator=g) * 0.3,
        torch.randn(e, i, h, generator=g) * 0.3,
        torch.randn(e, h, i, generator=g) * 0.3,
        torch.randn(s, h, generator=g) * 0.3,
        torch.randn(s, h, generator=g) * 0.3,
        torch.randn(h, s, generator=g) * 0.3,
        torch.randn(1, h, generator=g) * 0.3,
    ]
    weight = torch.randn(n, h, generator=g)

    def grads(fn):
        xs = [t.clone().requires_grad_() for t in leaves]
        (fn(*xs) * weight).sum().backward()
        return [t.grad for t in xs]

    def ours(x, r, wg, wu, wd, sg, su, sd, gate):
        return moe_forward(x, r, wg, wu, wd, 2, shared=(sg, su, sd), shared_gate=gate)[0]

    def written_out(x, r, wg, wu, wd, sg, su, sd, gate):
        ids, _ = route_topk(linear(x, r), 2)
        weights = gather_route_weights(torch.softmax(linear(x, r).float(), -1), ids)
        shared = sigmoid_gate(linear(silu_and_mul(linear(x, sg), linear(x, su)), sd), linear(x, gate))
        return moe_experts(x, ids, weights, wg, wu, wd, shared_out=shared)

    for a, b in zip(grads(ours), grads(written_out), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="shared_gate"):
        moe_forward(*leaves[:5], 2, shared=tuple(leaves[5:8]))
