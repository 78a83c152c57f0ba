"""The fused TP-aligned K-block tree (:func:`shared_numerics.tensor_parallel.k_block_tree`): the same bits as the
block-by-block definition — ``block_tree_sum(k_block_partials(...))`` — forward, input gradient and weight gradient,
float32 and bf16 operands, one block to twelve; what makes every row-parallel linear, column-parallel input gradient
and TP-split MoE down projection one kernel pass per direction on CPUs with the float32 FMA kernel."""

from __future__ import annotations

import pytest
import torch

import shared_numerics.tensor_parallel as sn_tp

pytestmark = pytest.mark.requires_f32_kernel


def _blocks(x, w, k_block):
    return sn_tp.block_tree_sum(sn_tp.k_block_partials(x, w, k_block))


def _run(fn, x, w, grad):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fn(x, w)
    y.backward(grad)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("blocks", [1, 3, 4, 12])
def test_fused_tree_is_the_blocks_bits(dtype, blocks):
    g = torch.Generator().manual_seed(blocks)
    k_block = 16
    x = torch.randn(517, k_block * blocks, generator=g).to(dtype)
    w = torch.randn(300, k_block * blocks, generator=g).to(dtype)
    grad = torch.randn(517, 300, generator=g)
    grad[3] = -0.0  # zero rows of dY, of either sign
    fused = _run(lambda a, b: sn_tp.k_block_tree(a, b, k_block), x, w, grad)
    ref = _run(lambda a, b: _blocks(a, b, k_block), x, w, grad)
    for f, r in zip(fused, ref, strict=True):
        assert f.dtype == r.dtype and torch.equal(f, r) and torch.equal(f.signbit(), r.signbit())
    # only one side differentiable (a detached weight: the chained MoE experts; the column-parallel dX in a backward)
    y = sn_tp.k_block_tree(x.clone().requires_grad_(), w, k_block)
    assert torch.equal(y, ref[0])
    # control: the tree over another blocking is other bits (the test sees the definition)
    if blocks % 2 == 0:
        assert not torch.equal(sn_tp.k_block_tree(x, w, 2 * k_block), ref[0])


def test_row_parallel_linear_and_column_dx_use_it():
    """:func:`row_parallel_linear` and :func:`column_parallel_dx` on the fused tree equal the blocks' definition."""
    g = torch.Generator().manual_seed(7)
    x, w, dy = torch.randn(9, 64, generator=g), torch.randn(24, 64, generator=g), torch.randn(9, 48, generator=g)
    bias = torch.randn(24, generator=g)
    assert torch.equal(sn_tp.row_parallel_linear(x, w, bias, k_block=16), (_blocks(x, w, 16) + bias).to(x.dtype))
    w2 = torch.randn(48, 64, generator=g)
    assert torch.equal(sn_tp.column_parallel_dx(dy, w2, 16), _blocks(dy, w2.t(), 16))


def test_the_kernel_op_refuses_what_it_cannot_take():
    """``torch.ops.zerokld.gemm_f32_ktree``: a ``k_block`` that does not divide K, or an output of another shape, is
    an error before the kernel writes anything."""
    a, b = torch.randn(8, 48), torch.randn(5, 48)
    out = torch.full((5, 8), 7.0)
    with pytest.raises((TypeError, ValueError), match="multiple of k_block 20"):
        torch.ops.zerokld.gemm_f32_ktree(a, b, out, 20)
    with pytest.raises((TypeError, ValueError), match=r"out must be \(5, 8\)"):
        torch.ops.zerokld.gemm_f32_ktree(a, b, torch.empty(8, 5), 16)
    assert torch.equal(out, torch.full((5, 8), 7.0))
