"""The batch-invariant multi-LoRA op (:func:`shared_numerics.lora_linear`, issue 18 point 1), torch backend.

Claims: a row's output is bitwise the same alone, in a batch with rows of other adapters and base-only rows, and in any
order of the batch; the arithmetic is PEFT's (``base + lora_B(lora_A(x)) * scaling``, every op rounded to the
activation dtype); gradients reach the adapters, deterministically. Control: the same PEFT arithmetic on ATen's own
``F.linear`` (what a stock trainer computes) gives other bits for a row alone than inside the batch.
"""

from __future__ import annotations

import pytest
import torch

import shared_numerics as sn
from benchmarks.op_model import STOCK_OPS, peft_lora_linear
from zerokld_testing.controls import stock_differs

pytestmark = pytest.mark.timeout(120)

DTYPES = [torch.float32, torch.bfloat16]


def _case(dtype, m=100, k=96, n=200, adapters=3, rank=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w, b = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype), torch.randn(n, generator=g).to(dtype)
    a = (torch.randn(adapters, rank, k, generator=g) * k**-0.5).to(dtype)
    bb = (torch.randn(adapters, n, rank, generator=g) * 0.5).to(dtype)
    scaling = torch.tensor([2.0, 0.5, 1.0][:adapters])
    ids = torch.randint(-1, adapters, (m,), generator=g)
    return x, w, b, a, bb, scaling, ids


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_are_batch_invariant_across_adapters(dtype):
    x, w, b, a, bb, s, ids = _case(dtype)
    assert set(ids.tolist()) == {-1, 0, 1, 2}
    y = sn.lora_linear(x, w, b, a, bb, s, ids)
    for i in (0, 17, 42, 99):
        assert torch.equal(sn.lora_linear(x[i : i + 1], w, b, a, bb, s, ids[i : i + 1]), y[i : i + 1])
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(1))
    assert torch.equal(sn.lora_linear(x[perm], w, b, a, bb, s, ids[perm]), y[perm])
    for j in range(
        3
    ):  # every row on adapter j (scalings 2, 0.5, 1; the op's no-gather path): rows on j keep their bits
        yj = sn.lora_linear(x, w, b, a, bb, s, ids.clone().fill_(j))
        assert torch.equal(yj[ids == j], y[ids == j])
    base = sn.lora_linear(x, w, b, a, bb, s, torch.full_like(ids, -1))
    assert torch.equal(base, sn.linear(x, w, b)) and torch.equal(base[ids == -1], y[ids == -1])
    assert not torch.equal(base[ids >= 0], y[ids >= 0])
    # batched leading dimensions ([B, T, K] like a model's activations) reshape to rows
    assert torch.equal(sn.lora_linear(x.reshape(4, 25, -1), w, b, a, bb, s, ids.reshape(4, 25)).reshape(100, -1), y)


@pytest.mark.parametrize("dtype", DTYPES)
def test_arithmetic_is_peft(dtype):
    """Bitwise PEFT's arithmetic when every op is ours (one rounding per op, as ATen rounds a bf16 ``*``/``+``);
    close to PEFT on stock ``F.linear``."""
    x, w, b, a, bb, s, ids = _case(dtype)
    y = sn.lora_linear(x, w, b, a, bb, s, ids)
    assert torch.equal(y, peft_lora_linear(sn.linear, x, w, b, a, bb, s, ids))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.float(), STOCK_OPS["lora_linear"](x, w, b, a, bb, s, ids).float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_lora_is_the_adapter_half(dtype):
    """``add_lora`` on the base output (what the engine runs after its base projection) == ``lora_linear``, base
    rows untouched, the input not modified; with the scaling folded into ``lora_B`` (vLLM's
    ``LoRALayerWeights.optimize``: ``round(B * s)``, scaling 1) it equals the unfolded op for power-of-two scalings."""
    x, w, b, a, bb, s, ids = _case(dtype)
    base = sn.linear(x, w, b)
    kept = base.clone()
    y = sn.add_lora(base, x, a, bb, s, ids)
    assert torch.equal(base, kept) and torch.equal(y, sn.lora_linear(x, w, b, a, bb, s, ids))
    assert torch.equal(y[ids == -1], base[ids == -1])
    folded = bb * s.to(dtype)[:, None, None]
    assert torch.equal(sn.add_lora(base, x, a, folded, torch.ones(3), ids), y)  # 2.0, 0.5, 1.0: powers of two
    with pytest.raises(ValueError, match="dtype"):
        sn.add_lora(base.double(), x, a, bb, s, ids)


def test_stock_peft_arithmetic_depends_on_the_batch():
    """Negative control: PEFT on ATen's ``F.linear`` (fp32: GEMV for one row, GEMM for many) — a row alone differs
    from the same row co-batched with other adapters' rows; ours (same inputs) does not."""
    x, w, b, a, bb, s, ids = _case(torch.float32)

    def stock(rows):
        return STOCK_OPS["lora_linear"](x[rows], w, b, a, bb, s, ids[rows])

    full = stock(slice(None))
    stock_differs(
        any(not torch.equal(stock(slice(i, i + 1)), full[i : i + 1]) for i in range(0, 100, 11)),
        "LoRA linear (torch ops) of a row alone vs in the batch",
        "the shapes",
    )
    ours = sn.lora_linear(x, w, b, a, bb, s, ids)
    assert all(
        torch.equal(sn.lora_linear(x[i : i + 1], w, b, a, bb, s, ids[i : i + 1]), ours[i : i + 1])
        for i in range(0, 100, 11)
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_reach_the_adapters_deterministically(dtype):
    x, w, b, a, bb, s, ids = _case(dtype, m=40)
    grads = []
    for _ in range(2):
        la, lb = a.clone().requires_grad_(), bb.clone().requires_grad_()
        y = sn.lora_linear(x, w, b, la, lb, s, ids)
        (y.float() ** 2).sum().backward()
        grads.append((la.grad, lb.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    used = set(ids[ids >= 0].tolist())
    for j in range(a.shape[0]):
        assert (grads[0][1][j].abs().sum() > 0) == (j in used)


def test_bad_inputs_are_refused():
    x, w, b, a, bb, s, ids = _case(torch.float32, m=8)
    with pytest.raises(ValueError, match="adapter ids"):
        sn.lora_linear(x, w, b, a, bb, s, torch.full_like(ids, 3))
    with pytest.raises(ValueError, match="adapter_ids has shape"):
        sn.lora_linear(x, w, b, a, bb, s, ids[:4])
    with pytest.raises(ValueError, match="do not fit"):
        sn.lora_linear(x, w, b, a[:, :, :50], bb, s, ids)
    with pytest.raises(ValueError, match="scaling"):
        sn.lora_linear(x, w, b, a, bb, s[:2], ids)
    with pytest.raises(ValueError, match=r"\[L, R, K\]"):
        sn.lora_linear(x, w, b, a[0], bb, s, ids)
