"""Unit tests of shared_numerics: batch invariance (exact), thread invariance (exact), closeness to torch (tolerance
stated per op: the reduction order legitimately differs from ATen's)."""

from __future__ import annotations

import os

import pytest
import torch

import shared_numerics as sn
from tests.mixers.test_attention import sdpa
from zerokld_testing.controls import stock_differs

DTYPES = [torch.float32, torch.bfloat16]


def _rows_invariant(fn, x, *rest, idx=(0, 1, 7, 16, 17, 63, 99)):
    full = fn(x, *rest)
    for i in idx:
        assert torch.equal(fn(x[i : i + 1], *rest), full[i : i + 1]), f"row {i} differs alone"
    assert torch.equal(fn(x[5:90], *rest), full[5:90])
    return full


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_batch_invariant_and_close(dtype, threads):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(100, 96, generator=g).to(dtype)
    w = torch.randn(200, 96, generator=g).to(dtype)
    b = torch.randn(200, generator=g).to(dtype)
    y = _rows_invariant(lambda a: sn.linear(a, w, b), x)
    assert y.dtype == dtype
    ref = torch.nn.functional.linear(x.float(), w.float(), b.float())
    torch.testing.assert_close(
        y.float(), ref, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-4 if dtype == torch.float32 else 5e-2
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernels", ["machine", "onednn"])
def test_linear_thread_count_does_not_change_bits(dtype, kernels, monkeypatch):
    """1 thread, 2 threads and the machine's count give the same bits, for M = 1 (a decode row) and M = 300 (many
    tiles, a prefill), and the decode row is the prefill's row 0: with this machine's kernels (AMX / AVX-512 where
    present) and with the pinned oneDNN calls a CPU without them takes."""
    import importlib

    sl = importlib.import_module("shared_numerics.linear")
    if kernels == "onednn":
        monkeypatch.setattr(sl, "amx_available", lambda: False)
        monkeypatch.setattr(sl, "f32_available", lambda: False)
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(300, 1024, generator=g).to(dtype), torch.randn(1024, 1024, generator=g).to(dtype)
    old = torch.get_num_threads()
    outs = []
    try:
        for n in sorted({1, 2, os.cpu_count() or 1}):
            torch.set_num_threads(n)
            outs.append((sn.linear(x[:1], w), sn.linear(x, w)))
    finally:
        torch.set_num_threads(old)
    for one, many in outs:
        assert torch.equal(one, outs[0][0]) and torch.equal(many, outs[0][1]) and torch.equal(one, many[:1])
    if dtype == torch.float32:  # negative control: stock's GEMM picks another kernel for one row
        stock_differs(
            not torch.equal(torch.nn.functional.linear(x[:1], w), torch.nn.functional.linear(x, w)[:1]),
            "float32 F.linear's row alone vs in the batch",
            "the shapes",
        )


@pytest.mark.parametrize(
    "path",
    [
        pytest.param("amx", marks=pytest.mark.requires_amx),
        pytest.param("fp32", marks=pytest.mark.requires_f32_kernel),
    ],
)
def test_bf16_gemm_is_row_and_thread_invariant(path, monkeypatch):
    """bf16 on the AMX kernel or, without AMX, on the FMA kernel reading the bf16 operands (``bf16=fp32``: the float32
    chains of their exact upcasts, one rounding), every element whole on one thread. The shapes are ones where oneDNN
    splits K across threads for some batch sizes or thread counts (measured on a 2-core Xeon with AMX): a row alone, in
    33, 128 or 300 rows, at 1, 2 and 8 torch threads, gives the same bits; on the ``fp32`` path they are the bits of
    ``linear`` on the float32 upcasts rounded once, with and without autograd. Negative controls (upstream behaviour:
    checked by ``stock_differs``): stock ``F.linear`` changes a row's bits with the batch size (on an AMD EPYC with
    AVX512-BF16 only at K = N = 4096, a row alone vs in 300), and where oneDNN runs its AMX kernels even one fixed
    128-row call changes bits with the thread count (K split)."""
    import importlib

    sl = importlib.import_module("shared_numerics.linear")
    if path == "amx":
        assert f"gemm={sl.gemm_partition()}" in sn.mode.contract() and "bf16=amx" in sl.gemm_partition()
    else:  # the path of a CPU without AMX (on an AMX machine: as ZEROKLD_AMX=0 sets it)
        monkeypatch.setattr(sl, "amx_available", lambda: False)
        monkeypatch.setattr(importlib.import_module("shared_numerics.cpu_ops"), "_bf16_on_amx", lambda: False)
    g = torch.Generator().manual_seed(5)
    old = torch.get_num_threads()
    stock_batch_differs = stock_threads_differ = False
    try:
        for k, n in ((1024, 1024), (3072, 1024), (4096, 1024), (8192, 256), (4096, 4096)):
            x = torch.randn(300, k, generator=g).bfloat16()
            w, b = (torch.randn(n, k, generator=g) * k**-0.5).bfloat16(), torch.randn(n, generator=g).bfloat16()
            outs = []
            for threads in (1, 2, 8):
                torch.set_num_threads(threads)
                outs += [sn.linear(x[:m], w, b) for m in (1, 33, 128, 300)]
            full = outs[-1]
            for y in outs:
                assert y.dtype == torch.bfloat16 and torch.equal(y, full[: y.shape[0]]), (k, n, y.shape)
            ref = (x.float() @ w.float().t() + b.float()).bfloat16()  # fp32 accumulation, bias in fp32, one rounding
            torch.testing.assert_close(full.float(), ref.float(), rtol=8e-3, atol=1e-3)
            if path == "fp32":  # the float32 path's bits on the upcasts, one rounding; autograd's forward the same
                assert torch.equal(full, sn.linear(x.float(), w.float(), b.float()).bfloat16())
                xg = x.clone().requires_grad_()
                assert torch.equal(sn.linear(xg, w, b).detach(), full)
            torch.set_num_threads(2)
            stock = torch.nn.functional.linear
            stock_batch_differs |= not torch.equal(stock(x[:1], w, b), stock(x, w, b)[:1])
            one_call = [stock(x[:128], w, b)]
            torch.set_num_threads(1)
            one_call.append(stock(x[:128], w, b))
            stock_threads_differ |= not torch.equal(*one_call)
    finally:
        torch.set_num_threads(old)
    stock_differs(stock_batch_differs, "bf16 F.linear's rows alone vs in a batch of 300", "the (K, N) shapes")
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    if torch.cpu._is_amx_tile_supported() and (isa == "ALL" or "AMX" in isa):  # oneDNN's AMX kernels split K
        stock_differs(stock_threads_differ, "bf16 F.linear's one 128-row call at 1 vs 2 threads", "the (K, N) shapes")


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_backward_is_row_invariant_and_close(dtype, threads):
    """dX of a row does not depend on the other rows; dX and dW are F.linear's up to float32 summation order."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(70, 96, generator=g).to(dtype)
    w = torch.randn(200, 96, generator=g).to(dtype)
    b = torch.randn(200, generator=g).to(dtype)
    gy = torch.randn(70, 200, generator=g).to(dtype)

    def grads(fn, rows):
        xr, wr, br = (t.detach().clone().requires_grad_() for t in (x[rows], w, b))
        fn(xr, wr, br).backward(gy[rows])
        return xr.grad, wr.grad, br.grad

    gx, gw, gb = grads(sn.linear, slice(None))
    assert gx.dtype == gw.dtype == dtype
    for rows in (slice(0, 1), slice(17, 18), slice(5, 60)):
        assert torch.equal(grads(sn.linear, rows)[0], gx[rows])
    ref = grads(lambda a, m, c: torch.nn.functional.linear(a.float(), m.float(), c.float()), slice(None))
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-1)
    for ours, theirs in zip((gx, gw, gb), ref, strict=True):
        torch.testing.assert_close(ours.float(), theirs.float(), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(dtype, threads):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(100, 64, generator=g).to(dtype)
    w = torch.rand(64, generator=g).to(dtype)
    y = _rows_invariant(lambda a: sn.rms_norm(a, w, 1e-6), x)
    ref = torch.nn.functional.rms_norm(x.float(), (64,), w.float(), 1e-6)
    torch.testing.assert_close(
        y.float(), ref, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5 if dtype == torch.float32 else 2e-2
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype, threads):
    g = torch.Generator().manual_seed(3)
    gate = torch.randn(100, 48, generator=g).to(dtype)
    up = torch.randn(100, 48, generator=g).to(dtype)
    full = sn.silu_and_mul(gate, up)
    for i in (0, 13, 99):
        assert torch.equal(sn.silu_and_mul(gate[i : i + 1], up[i : i + 1]), full[i : i + 1])
    ref = torch.nn.functional.silu(gate.float()) * up.float()
    torch.testing.assert_close(
        full.float(), ref, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-6 if dtype == torch.float32 else 1e-2
    )


def test_log_softmax_and_selected_logprobs(threads):
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(100, 1000, generator=g) * 5
    lp = _rows_invariant(sn.log_softmax, logits)
    # one float32 ulp of |logp| ~ 30 is 3.8e-6: ATen rounds in float32, we round once from float64
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1), rtol=3e-7, atol=1e-6)
    ids = torch.randint(0, 1000, (100,), generator=g)
    assert torch.equal(sn.selected_logprobs(logits, ids), lp.gather(1, ids[:, None]).squeeze(1))
    assert torch.equal(sn.selected_logprobs(logits[3:4], ids[3:4]), sn.selected_logprobs(logits, ids)[3:4])


def test_rope_position_invariant():
    pos = torch.arange(0, 300)
    cos, sin = sn.rope_cos_sin(pos, 32, 10000.0)
    c1, s1 = sn.rope_cos_sin(pos[[7, 255]], 32, 10000.0)
    assert torch.equal(c1, cos[[7, 255]]) and torch.equal(s1, sin[[7, 255]])
    x = torch.randn(300, 4, 32)
    y = sn.apply_rope(x, cos, sin)
    # rotation preserves the norm of each pair
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError):
        sn.rope_cos_sin(pos, 31, 10000.0)


def test_tree_sum_exact_and_shape_independent():
    x = torch.randn(37, 100, dtype=torch.float64)
    s = sn.tree_sum(x, dim=-1)
    torch.testing.assert_close(s, x.sum(-1))
    assert torch.equal(sn.tree_sum(x[5:6], dim=-1), s[5:6])
    assert torch.equal(sn.tree_sum(x.t().contiguous(), dim=0), s)  # layout does not matter
    assert sn.tree_sum(x[:, :0], dim=-1).shape == (37,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_kernel_equals_its_torch_ops(dtype):
    """On CPU ``rms_norm`` runs the compiled kernel (with or without autograd); its torch ops (other devices) are the
    same definition (same operations, same order): the same bits, at odd widths and strided rows too."""
    from shared_numerics.norm import _rms_norm_ops

    g = torch.Generator().manual_seed(12)
    for shape in [(100, 64), (7, 1000), (3, 5, 96), (1, 1), (40, 4, 128)]:
        x = (torch.randn(shape, generator=g) * 3).to(dtype)
        w = torch.randn(shape[-1], generator=g).to(dtype)
        with torch.no_grad():
            kernel = sn.rms_norm(x, w, 1e-6)
        assert torch.equal(kernel, _rms_norm_ops(x, w, 1e-6))
        assert torch.equal(kernel, sn.rms_norm(x.clone().requires_grad_(), w, 1e-6).detach())  # training forward
    x = torch.randn(64, 3, 256, generator=g).to(dtype)[:, 1]  # rows with a stride
    with torch.no_grad():
        assert torch.equal(sn.rms_norm(x, w.new_ones(256), 1e-5), _rms_norm_ops(x, w.new_ones(256), 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_rope_backward_row_invariant_and_close(dtype):
    """The compiled RMSNorm backward and RoPE's closed-form backward: a row's ``dx`` the same bits alone as in the
    batch, close to autograd of the torch ops (float64); the gain's gradient is the row-order sum of ``dy * x̂``."""
    from shared_numerics.norm import _rms_norm_ops

    g = torch.Generator().manual_seed(14)
    x = (torch.randn(100, 96, generator=g) * 3).to(dtype)
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype)
    dy = torch.randn(100, 96, generator=g).to(dtype)

    def norm_grads(fn, sl, xs=x, ws=w):
        a, b = xs[sl].clone().requires_grad_(), ws.clone().requires_grad_()
        return torch.autograd.grad((fn(a, b, 1e-6).float() * dy[sl].float()).sum(), (a, b))

    dx, dw = norm_grads(sn.rms_norm, slice(None))
    for sl in (slice(7, 8), slice(5, 90)):
        assert torch.equal(norm_grads(sn.rms_norm, sl)[0], dx[sl])
    rx, rw = norm_grads(_rms_norm_ops, slice(None), x.double(), w.double())
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(dx.double(), rx, **tol)
    torch.testing.assert_close(dw.double(), rw, **tol)
    x32 = x.float()
    xhat = x32 * torch.rsqrt((x32 * x32).mean(-1, keepdim=True) + 1e-6)
    rows = torch.zeros(96)
    for i in range(100):
        rows = rows + dy[i].float() * (x32[i] * torch.rsqrt(sn.tree_sum(x32[i] * x32[i], dim=-1) / 96 + 1e-6))
    assert torch.equal(dw, rows.to(dtype)) and torch.allclose(rows, (dy.float() * xhat).sum(0), rtol=1e-4, atol=1e-4)

    q = (torch.randn(100, 4, 64, generator=g)).to(dtype)
    cos, sin = sn.rope_cos_sin(torch.arange(100), 64, 1e4)
    dq = torch.randn(100, 4, 64, generator=g).to(dtype)

    def rope_grad(sl):
        a = q[sl].clone().requires_grad_()
        return torch.autograd.grad((sn.apply_rope(a, cos[sl], sin[sl]).float() * dq[sl].float()).sum(), a)[0]

    full = rope_grad(slice(None))
    assert full.dtype == dtype and torch.equal(rope_grad(slice(7, 8)), full[7:8])
    a = q.double().requires_grad_()  # reference: autograd of the rotation's torch ops, float64
    c, s = cos.double().unsqueeze(1), sin.double().unsqueeze(1)
    rotated = torch.cat([a[..., :32] * c - a[..., 32:] * s, a[..., 32:] * c + a[..., :32] * s], dim=-1)
    ref = torch.autograd.grad((rotated * dq.double()).sum(), a)[0]
    torch.testing.assert_close(full.double(), ref, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_gradients_row_invariant(dtype):
    """CPU ``silu_and_mul`` with autograd: the forward bits of the inference path, and a row's gradients the same
    alone as in the batch."""
    g = torch.Generator().manual_seed(13)
    gate = (torch.randn(100, 48, generator=g) * 4).to(dtype)
    up = torch.randn(100, 48, generator=g).to(dtype)
    dy = torch.randn(100, 48, generator=g).to(dtype)
    with torch.no_grad():
        plain = sn.silu_and_mul(gate, up)

    def run(sl):
        a, b = gate[sl].clone().requires_grad_(), up[sl].clone().requires_grad_()
        y = sn.silu_and_mul(a, b)
        return (y.detach(), *torch.autograd.grad((y * dy[sl]).sum(), (a, b)))

    full = run(slice(0, 100))
    assert torch.equal(full[0], plain)
    for i in (0, 41, 99):
        one = run(slice(i, i + 1))
        assert all(torch.equal(f[i : i + 1], o) for f, o in zip(full, one, strict=True))
    ref_g, ref_u = gate.float().requires_grad_(), up.float().requires_grad_()
    ref = torch.autograd.grad((torch.nn.functional.silu(ref_g) * ref_u * dy.float()).sum(), (ref_g, ref_u))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for ours, theirs in zip(full[1:], ref, strict=True):
        torch.testing.assert_close(ours.float(), theirs, **tol)


# Stock counterparts of the invariance claims above, at the same shapes. Claims whose stock op is already invariant on
# this machine (2-core AVX2 CPU, torch 2.13+cpu), so that the test above cannot fail for want of our kernels, are
# listed, not tested: linear in bf16 (alone vs batch), rms_norm and log_softmax (one row per reduction in ATen too),
# silu_and_mul (elementwise), linear across 1 and 2 threads (MKL keeps the K order per output), rope (elementwise).
# On a GPU these differ (split-K GEMMs, split reductions): tests/test_cuda.py and benchmarks/gpu_kernels.py.
def _stock_linear_rows_alone(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(100, 96, generator=g).to(dtype)
    w, b = torch.randn(200, 96, generator=g).to(dtype), torch.randn(200, generator=g).to(dtype)
    ours = lambda a: sn.linear(a, w, b)
    stock = lambda a: torch.nn.functional.linear(a, w, b)
    return [(f(x[i : i + 1]), f(x)[i : i + 1]) for f in (ours, stock) for i in (0, 17, 99)]


def _stock_attention_prefix(dtype):
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 600, h, 32, generator=g).to(dtype) for h in (4, 2, 2))
    pairs = []
    for f in (lambda *a: sn.dense_causal_attention(*a, 32**-0.5), sdpa):
        pairs.append((f(q[:, :342], k[:, :342], v[:, :342]), f(q, k, v)[:, :342]))
    return pairs


@pytest.mark.parametrize(
    "claim,dtype",
    [
        (_stock_linear_rows_alone, torch.float32),
        (_stock_attention_prefix, torch.float32),
        (_stock_attention_prefix, torch.bfloat16),
    ],
    ids=["linear-alone-vs-batch-fp32", "attention-prefix-fp32", "attention-prefix-bf16"],
)
def test_negative_controls_stock_ops(claim, dtype, threads):
    """Stock ATen gives other bits alone than in the batch (fp32 linear: MKL's GEMV for one row, GEMM for many;
    SDPA: its flash kernel splits the keys by the query length); ours gives the same bits."""
    pairs = claim(dtype)
    half = len(pairs) // 2
    assert all(torch.equal(a, b) for a, b in pairs[:half])
    assert len(pairs[half:]) == half > 0
    stock_differs(
        any(not torch.equal(a, b) for a, b in pairs[half:]),
        claim.__name__.removeprefix("_stock_"),
        "the shapes in " + claim.__name__,
    )


def test_metrics():
    a = [torch.tensor([-1.0, -2.0]), torch.tensor([-0.5])]
    m = sn.logprob_diff_metrics(a, [x.clone() for x in a])
    assert m["k1"] == 0 and m["k3"] == 0 and m["tokens_bitwise_different"] == 0 and m["clipped_fraction"] == 0
    m = sn.logprob_diff_metrics(a, [torch.tensor([-1.0, -2.5]), torch.tensor([-0.5])])
    assert m["tokens_bitwise_different"] == 1 and m["max_abs_logprob_diff"] == 0.5 and m["k3"] > 0
    assert m["clipped_fraction"] == pytest.approx(1 / 3)
    with pytest.raises(ValueError):
        sn.logprob_diff_metrics(a, a[:1])
    # a near-certain token whose log-probs differ by one ulp: k3 = d^2/2 > 0 (exp(d) - d - 1 cancels to 0 there)
    near = [torch.tensor([-1e-6])]
    other = [torch.nextafter(near[0], torch.tensor(0.0))]
    m = sn.logprob_diff_metrics(near, other)
    d = (near[0].double() - other[0].double()).item()
    assert m["tokens_bitwise_different"] == 1 and m["k3"] == pytest.approx(d * d / 2, rel=1e-6)
    assert (torch.exp(torch.tensor(d, dtype=torch.float64)) - d - 1).item() == 0.0  # control: the naive form


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_selected_logprobs(dtype):
    """Bitwise equal to the unfused lm_head + selected_logprobs for any chunk size; closed-form gradient equal to
    autograd's up to float32 summation order (fp32) or one bf16 rounding of dlogits (bf16: autograd rounds them to
    bf16, the fused backward keeps float32)."""
    g = torch.Generator().manual_seed(8)
    h = torch.randn(300, 64, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(1000, 64, generator=g) * 0.3).to(dtype).requires_grad_()
    t = torch.randint(0, 1000, (300,), generator=g)
    ref = sn.selected_logprobs(sn.linear(h, w), t)
    for chunk in (16, 64, 1000):
        assert torch.equal(sn.fused_selected_logprobs(h, w, t, chunk=chunk), ref)
    up = torch.randn(300, generator=g)
    ga = torch.autograd.grad((sn.fused_selected_logprobs(h, w, t, chunk=64) * up).sum(), (h, w))
    gb = torch.autograd.grad((ref * up).sum(), (h, w))
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    for a, b in zip(ga, gb, strict=True):
        assert (a.float() - b.float()).abs().max() <= tol * b.float().abs().max()
    ga2 = torch.autograd.grad((sn.fused_selected_logprobs(h, w, t, chunk=64) * up).sum(), (h, w))
    assert all(torch.equal(a, b) for a, b in zip(ga, ga2, strict=True))
    with pytest.raises(ValueError, match="expected hidden"):
        sn.fused_selected_logprobs(h, w, t[:5])


def test_cpu_kernel_build_errors_are_clear(monkeypatch, tmp_path):
    """No compiler: a RuntimeError that names it (nothing cached, nothing half-written)."""
    from shared_numerics import cpu_kernels

    monkeypatch.setenv("ZEROKLD_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "zerokld-no-such-compiler")
    cpu_kernels.load.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="zerokld-no-such-compiler"):
            cpu_kernels.load("attention")
    finally:
        cpu_kernels.load.cache_clear()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_silu_backward_kernel_is_the_torch_formula(dtype):
    """The one-pass backward kernel (``zk_silu_mul_bwd``) gives the bits of its torch-op formula on the saved ``s``:
    ``dg = dy * u * (s + g * s * (1 - s))``, ``du = dy * (g * s)`` in float32, rounded once; odd sizes (vector
    tails)."""
    from shared_numerics.activation import _silu_mul_cpu

    gen = torch.Generator().manual_seed(9)
    g, u, dy = (torch.randn(37, 301, generator=gen).to(dtype) for _ in range(3))
    gr, ur = g.clone().requires_grad_(), u.clone().requires_grad_()
    sn.silu_and_mul(gr, ur).backward(dy)
    _, s = _silu_mul_cpu(g, u, True)
    gf, uf, df = g.float(), u.float(), dy.float()
    assert torch.equal(gr.grad, (df * uf * (s + gf * s * (1.0 - s))).to(dtype))
    assert torch.equal(ur.grad, (df * (gf * s)).to(dtype))
