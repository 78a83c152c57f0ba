"""The ``cublas`` backend's GEMM (:mod:`shared_numerics.gemm_cublas`): fixed-shape library calls are row-invariant by
construction. Here on CPU, where the same code issues torch's CPU GEMM (deterministic per shape at a fixed thread
count); ``tests/test_cuda.py`` proves it on cuBLAS. Negative control: one unchunked ``F.linear`` per batch differs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shared_numerics.gemm_cublas import CUBLAS_ROWS, fixed_rows_matmul, linear
from zerokld_testing import controls

M_VALUES = (1, 7, 64, 128, 300)


def _operands(dtype, k, seed=0, bias=True, n=1024):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(600, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * 0.02).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_alone_equal_rows_in_any_batch_and_stock_differs(dtype):
    """Negative control (upstream behaviour): stock ``F.linear`` gives a row other bits alone than in the batch — at
    N = K = 4096, where oneDNN's bf16 kernels (AMX, AVX512-BF16) and MKL's float32 ones do (an AMD EPYC with
    AVX512-BF16: bf16 only a row alone, N = 1024 never). Without oneDNN bf16 GEMMs (AVX2) stock's bf16 GEMM is row
    invariant itself (measured under the AVX2 switches at K 64-16384): there the bf16 control has nothing to show."""
    x, w, b = _operands(dtype, 4096, n=4096)
    full = linear(x, w, b)
    ref = F.linear(x, w, b)
    assert full.shape == ref.shape and full.dtype == dtype
    for m in M_VALUES:
        for start in (0, 200):
            assert torch.equal(linear(x[start : start + m], w, b), full[start : start + m]), (m, start)
    assert (full.float() - ref.float()).abs().max() <= 0.02 * ref.float().abs().max()
    stock_differs = [m for m in M_VALUES if not torch.equal(F.linear(x[:m], w, b), ref[:m])]
    if dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported():  # stock has oneDNN bf16 GEMMs
        controls.stock_differs(
            bool(stock_differs), f"{dtype} F.linear's rows alone vs in the batch", "M_VALUES or the shapes"
        )


def test_any_layout_of_the_same_rows_gives_the_same_bits():
    """A transposed, an offset (not 16-byte aligned) and a 3-D input are copied to the one row-major aligned layout."""
    x, w, b = _operands(torch.bfloat16, 1024, seed=1)
    full = linear(x, w, b)
    assert torch.equal(linear(x.t().contiguous().t(), w, b), full)
    flat = torch.cat([x.new_zeros(1), x.reshape(-1)])[1:].view(600, 1024)  # same values, storage offset 2 bytes
    assert flat.data_ptr() % 16 != 0
    assert torch.equal(linear(flat, w, b), full)
    assert torch.equal(linear(x.view(3, 200, 1024), w, b), full.view(3, 200, 1024))


def test_partial_last_block_and_empty_and_errors():
    x, w, _ = _operands(torch.float32, 256, seed=2, bias=False)
    m = CUBLAS_ROWS + 5
    y = fixed_rows_matmul(x[:m], w.t())
    assert y.shape == (m, 1024) and torch.equal(y, linear(x, w)[:m])
    assert fixed_rows_matmul(x[:0], w.t()).shape == (0, 1024)
    with pytest.raises(ValueError, match="need \\[M, K\\] @ \\[K, N\\]"):
        fixed_rows_matmul(x, w)
    with pytest.raises(ValueError, match="one dtype"):
        fixed_rows_matmul(x, w.t().to(torch.bfloat16))


def test_backward_matches_autograd_of_f_linear():
    x, w, b = _operands(torch.float32, 512, seed=3)
    x, w, b = (t[:300].clone().requires_grad_() if t is x else t.clone().requires_grad_() for t in (x, w, b))
    up = torch.randn(300, 1024, generator=torch.Generator().manual_seed(4))
    (linear(x, w, b) * up).sum().backward()
    ours = [t.grad.clone() for t in (x, w, b)]
    for t in (x, w, b):
        t.grad = None
    (F.linear(x, w, b) * up).sum().backward()
    for a, r in zip(ours, (x.grad, w.grad, b.grad), strict=True):
        assert a.shape == r.shape and torch.allclose(a, r, rtol=1e-4, atol=1e-4)


def test_backend_is_registered_and_refuses_without_cuda(monkeypatch):
    import shared_numerics as sn
    from shared_numerics.mode import contract

    assert f"cublas_rows={CUBLAS_ROWS}" in contract()
    monkeypatch.setenv("ZEROKLD_BACKEND", "cublas")
    if torch.cuda.is_available():  # a GPU machine: the table is the Triton one with the fixed-shape GEMM
        assert sn.active_ops(torch.empty(1, device="cuda"))["linear"] is linear
        return
    with pytest.raises(RuntimeError, match="'cublas' cannot run on this machine: no CUDA device"):
        sn.active_ops(torch.empty(1))
