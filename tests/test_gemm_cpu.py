"""The GEMM kernels (shared_numerics/gemm_cpu.py, csrc/gemm.cpp: bf16 on AMX, float32 on AVX-512 / AVX2 FMA, bf16
without AMX on the FMA kernel): close to a float64 reference, and an element's bits depend only on its row of A and its
row of B — not on the other rows, the tails, strides or the thread count. Each runs where the CPU has its unit (the
test says so and skips otherwise: linear then takes oneDNN's pinned calls, tested in test_numerics)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared_numerics import gemm_cpu

needs_amx = pytest.mark.requires_amx  # (tests/conftest.py: CAPABILITIES)
needs_f32 = pytest.mark.requires_f32_kernel
needs_bf16 = pytest.mark.requires_bf16_kernel  # the AMX kernel, or the FMA kernel's bf16 reads
KINDS = [
    pytest.param((torch.bfloat16, torch.bfloat16), marks=needs_bf16, id="bf16"),
    pytest.param((torch.bfloat16, torch.float32), marks=needs_bf16, id="bf16-f32out"),
    pytest.param((torch.float32, torch.float32), marks=needs_f32, id="f32"),
]

# (I, J, K): tails of the 32-row strips, the 16-row B blocks, the 32-element K steps, odd K, K > one 256 block
SHAPES = [
    (1, 1, 1),
    (17, 5, 33),
    (48, 100, 96),
    (33, 70, 1000),
    (300, 257, 64),
    (64, 19, 2050),
    (530, 1000, 200),  # several work units of the float32 kernel on both sides
    (100, 30, 300),
]  # the float32 kernel's few-rows path (9..48 rows of B: the tokens are the vector operand)


def _with_threads(n, fn):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_gemm_abt_close_and_element_invariant(shape, transpose, kind):
    dtype, out_dtype = kind
    i, j, k = shape
    g = torch.Generator().manual_seed(i * 7 + j * 3 + k)
    a = (torch.randn(i, k, generator=g) * k**-0.5).to(dtype)
    b = torch.randn(j, k, generator=g).to(dtype)
    bias = torch.randn(i, generator=g)
    full = gemm_cpu.gemm_abt(a, b, bias, transpose=transpose, out_dtype=out_dtype)
    ref = a.double() @ b.double().t() + bias.double()[:, None]
    ref = ref.t() if transpose else ref
    assert full.dtype == out_dtype and full.shape == ref.shape
    tol = dict(rtol=1e-2, atol=1e-2) if out_dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(full.double(), ref, **tol)
    c = full.t() if transpose else full  # [I, J] view
    for r in sorted({0, i // 2, i - 1}):  # a row of A alone
        one = gemm_cpu.gemm_abt(a[r : r + 1], b, bias[r : r + 1], transpose=transpose, out_dtype=out_dtype)
        assert torch.equal((one.t() if transpose else one)[0], c[r])
    for r in sorted({0, j // 2, j - 1}):  # a row of B alone (a token at decode)
        one = gemm_cpu.gemm_abt(a, b[r : r + 1], bias, transpose=transpose, out_dtype=out_dtype)
        assert torch.equal((one.t() if transpose else one)[:, 0], c[:, r])
    for n in (1, 3):
        assert torch.equal(
            _with_threads(n, lambda: gemm_cpu.gemm_abt(a, b, bias, transpose=transpose, out_dtype=out_dtype)), full
        )


@pytest.mark.parametrize(
    "dtype",
    [pytest.param(torch.bfloat16, marks=needs_bf16, id="bf16"), pytest.param(torch.float32, marks=needs_f32, id="f32")],
)
def test_gemm_abt_strided_rows_and_errors(dtype):
    g = torch.Generator().manual_seed(0)
    wide_a, wide_b = torch.randn(40, 200, generator=g).to(dtype), torch.randn(70, 300, generator=g).to(dtype)
    a, b = wide_a[:, 10:138], wide_b[:, 100:228]  # row strides 200 and 300, K = 128
    assert torch.equal(gemm_cpu.gemm_abt(a, b), gemm_cpu.gemm_abt(a.contiguous(), b.contiguous()))
    for i, j, k in SHAPES:  # k-major operands (transposed views, e.g. w.t() in the backward) are read in place
        a, b = torch.randn(i, k, generator=g).to(dtype), torch.randn(j, k, generator=g).to(dtype)
        want = gemm_cpu.gemm_abt(a, b)
        at, bt = a.t().contiguous().t(), b.t().contiguous().t()
        assert at.stride(0) == 1 or i == 1
        for x, y in ((at, b), (a, bt), (at, bt)):
            assert torch.equal(gemm_cpu.gemm_abt(x, y), want), (i, j, k)
    with pytest.raises(ValueError, match="K differs"):
        gemm_cpu.gemm_abt(a, torch.zeros(3, a.shape[1] + 1, dtype=dtype))
    with pytest.raises(TypeError, match="must be a 2-d"):
        gemm_cpu.gemm_abt(a, b.half() if dtype == torch.float32 else b.float())


@pytest.mark.parametrize(
    "dtype",
    [pytest.param(torch.bfloat16, marks=needs_bf16, id="bf16"), pytest.param(torch.float32, marks=needs_f32, id="f32")],
)
def test_linear_gradients_thread_invariant(dtype):
    """``sn.linear``'s backward on the kernels: dX, dW and db are the same bits at 1, 2 and 3 threads; a row's dX is
    the same alone; dW is close to the float32 reference."""
    import shared_numerics as sn

    g = torch.Generator().manual_seed(2)
    x = torch.randn(300, 1024, generator=g).to(dtype)
    w, b = (torch.randn(512, 1024, generator=g) * 0.03).to(dtype), torch.randn(512, generator=g).to(dtype)
    gy = torch.randn(300, 512, generator=g).to(dtype)

    def grads(rows=slice(None)):
        xr, wr, br = (t.detach().clone().requires_grad_() for t in (x[rows], w, b))
        sn.linear(xr, wr, br).backward(gy[rows])
        return xr.grad, wr.grad, br.grad

    runs = [_with_threads(n, grads) for n in (1, 2, 3)]
    for other in runs[1:]:
        assert all(torch.equal(p, q) for p, q in zip(runs[0], other, strict=True))
    assert torch.equal(grads(slice(7, 8))[0], runs[0][0][7:8])
    ref_w = (gy.float().t() @ x.float()).to(dtype)
    torch.testing.assert_close(runs[0][1].float(), ref_w.float(), rtol=1e-2, atol=1e-1)


def _variants(gemm_cpu, a, b, bias):
    """The float32 kernel's paths: ``[J, I]`` and ``[I, J]`` outputs, k-major views of A and of B (read in place or
    packed by row copies), a single row of B (decode), 12 rows of B (the few-rows path, A's rows or its k-major
    view broadcast); then the same with bf16 operands (float32 output: the kernel's bf16 reads)."""
    out = []
    for x, y in ((a, b), (a.bfloat16(), b.bfloat16())):
        f32 = dict(out_dtype=torch.float32) if x.dtype == torch.bfloat16 else {}
        out += [
            gemm_cpu.gemm_abt(x, y, bias, transpose=True, **f32),
            gemm_cpu.gemm_abt(x, y, bias, **f32),
            gemm_cpu.gemm_abt(x.t().contiguous().t(), y.t().contiguous().t(), bias, **f32),
            gemm_cpu.gemm_abt(x.t().contiguous().t(), y[:1], bias, transpose=True, **f32),
            gemm_cpu.gemm_abt(x, y[:12], bias, **f32),
            gemm_cpu.gemm_abt(x.t().contiguous().t(), y[:12], bias, **f32),
        ]
    return out


@needs_f32
@pytest.mark.parametrize("j", [1, 2, 3, 8, 12, 30, 48])
@pytest.mark.parametrize("b_kmajor", [False, True])
@pytest.mark.parametrize("a_kmajor", [False, True])
def test_float32_decode_rows_path_is_the_packed_chain(j, b_kmajor, a_kmajor):
    """1..8 rows of B (single-sequence decode: A = the weight), and up to 48 of them when A is k-major (the backward's
    dX = dY W: A = Wᵀ), run a path that streams A in 16-row blocks instead of packing it (a k-major A with 1 or 2 rows
    of B: row after row, 512 outputs a unit — 700 rows of A make a partial second unit); 9..48 rows of B with a
    K-contiguous A take the few-rows path; all the same chains as the packed path, which the same rows take among 60
    more (partial 16-row blocks and K tails included)."""
    g = torch.Generator().manual_seed(j)
    a, bias = torch.randn(700, 1001, generator=g), torch.randn(700, generator=g)
    b = torch.randn(j, 1001, generator=g)
    packed = gemm_cpu.gemm_abt(a, torch.cat([b, torch.randn(60, 1001, generator=g)]), bias, transpose=True)[:j]
    a = a.t().contiguous().t() if a_kmajor else a
    b = b.t().contiguous().t() if b_kmajor else b
    for t in (True, False):
        out = gemm_cpu.gemm_abt(a, b, bias, transpose=t)
        assert torch.equal(out if t else out.t(), packed)


def test_float32_kernel_same_bits_on_avx2_and_avx512(tmp_path, monkeypatch):
    """The float32 kernel's arithmetic does not depend on the vector width: a build for AVX2 (``-march=haswell``, two
    8-lane registers per 16 lanes) gives the bits of this machine's build, float32 and bf16 operands. A compiler
    wrapper swaps ``-march=native`` for ``-march=haswell`` in a subprocess with its own kernel cache. Meaningful where
    this machine has AVX-512 (it says so otherwise: then both builds are AVX2)."""
    import inspect
    import os
    import subprocess
    import sys
    import textwrap

    wrapper = tmp_path / "cxx"
    wrapper.write_text(
        '#!/bin/sh\nfor a in "$@"; do shift; [ "$a" = "-march=native" ] && a="-march=haswell"; '
        'set -- "$@" "$a"; done\nexec "${ZK_REAL_CXX:-g++}" "$@"\n'
    )
    wrapper.chmod(0o755)
    g = torch.Generator().manual_seed(4)
    a, b, bias = torch.randn(70, 1000, generator=g), torch.randn(37, 1000, generator=g), torch.randn(70, generator=g)
    # (70 rows: full and partial 48-row (16-row on AVX2) panels; 37: whole and partial B blocks; K 1000: K blocks)
    torch.save((a, b, bias), tmp_path / "in.pt")
    script = textwrap.dedent(f"""
        import torch
        from shared_numerics import gemm_cpu
        assert not gemm_cpu.amx_available() and gemm_cpu.f32_available(), "not an AVX2 build"
        a, b, bias = torch.load({str(tmp_path / "in.pt")!r})
        torch.save(_variants(gemm_cpu, a, b, bias), {str(tmp_path / "out.pt")!r})
    """)
    script = textwrap.dedent(inspect.getsource(_variants)) + script
    env = dict(
        os.environ,
        CXX=str(wrapper),
        ZEROKLD_CACHE_DIR=str(tmp_path / "cache"),
        ZK_REAL_CXX=os.environ.get("CXX") or "g++",
    )
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from shared_numerics import cpu_ops

    monkeypatch.setattr(cpu_ops, "_bf16_on_amx", lambda: False)  # bf16 on the FMA kernel here too (as ZEROKLD_AMX=0)
    avx2, here = torch.load(tmp_path / "out.pt"), _variants(gemm_cpu, a, b, bias)
    assert len(avx2) == len(here) == 12
    for x, y in zip(avx2, here, strict=True):
        assert torch.equal(x, y)
    if "avx512f" not in Path("/proc/cpuinfo").read_text():
        print("this machine has no AVX-512: both builds are AVX2 builds")


@needs_f32
@pytest.mark.parametrize("rows", [1, 5, 48, 200])
@pytest.mark.parametrize("kmajor", [False, True])
def test_float32_operands_trade_places(rows, kmajor):
    """Without a bias the kernel may compute ``C = A · Bᵀ`` as ``(B · Aᵀ)ᵀ`` (few rows of A meet many of B as the
    decode paths' few rows of B; an ``[I, J]`` output becomes a ``[J, I]`` one, written in place): the same chain per
    element, so a few rows of A alone — dX = dY W of one token, dW = dYᵀ X of a short micro-batch — give the bits those
    rows have among 600, either output layout."""
    g = torch.Generator().manual_seed(rows)
    a, b = torch.randn(600, 1001, generator=g), torch.randn(700, 1001, generator=g)
    if kmajor:  # the backward's transposed views, read in place
        a, b = a.t().contiguous().t(), b.t().contiguous().t()
    full = gemm_cpu.gemm_abt(a, b)
    assert torch.equal(gemm_cpu.gemm_abt(a, b, transpose=True), full.t())
    for t in (False, True):
        part = gemm_cpu.gemm_abt(a[:rows], b, transpose=t)
        assert torch.equal(part.t() if t else part, full[:rows])
        part = gemm_cpu.gemm_abt(a, b[:rows], transpose=t)
        assert torch.equal(part.t() if t else part, full[:, :rows])


@needs_f32
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_operands_on_the_fma_kernel_are_the_float32_chains_of_their_upcasts(threads, monkeypatch):
    """bf16 without AMX (``bf16=fp32``): the FMA kernel widens each bf16 element exactly as it reads it, so every path
    (decode rows, k-major streams, the few-rows path, the packed path, accumulation) gives bit for bit the float32
    kernel on the operands' float32 upcasts — a bf16 output that result rounded once (torch's rounding). On an AMX
    machine bf16 is routed to the FMA kernel as ``ZEROKLD_AMX=0`` routes it."""
    import itertools

    from shared_numerics import cpu_ops

    monkeypatch.setattr(cpu_ops, "_bf16_on_amx", lambda: False)
    g = torch.Generator().manual_seed(11)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for i, j, k in [(1024, 1, 1024), (1000, 3, 515), (64, 7, 33), (200, 8, 1024), (300, 20, 100), (513, 47, 17),
                        (1024, 64, 256), (130, 300, 70), (5, 900, 31), (48, 2, 1024), (2, 48, 64)]:  # fmt: skip
            a, b = torch.randn(i, k, generator=g).bfloat16(), torch.randn(j, k, generator=g).bfloat16()
            bias = torch.randn(i, generator=g)
            for a_km, b_km, tr, with_bias in itertools.product([0, 1], [0, 1], [False, True], [False, True]):
                x = a.t().contiguous().t() if a_km else a
                y = b.t().contiguous().t() if b_km else b
                bb = bias if with_bias else None
                want = gemm_cpu.gemm_abt(x.float(), y.float(), bb, transpose=tr)
                got = gemm_cpu.gemm_abt(x, y, bb, transpose=tr, out_dtype=torch.float32)
                assert torch.equal(got, want), (i, j, k, a_km, b_km, tr, with_bias)
                assert torch.equal(gemm_cpu.gemm_abt(x, y, bb, transpose=tr), want.bfloat16())
            if k % gemm_cpu.CHAIN_K_MULTIPLE == 0:
                acc = torch.randn(i, j, generator=g)
                want = gemm_cpu.gemm_abt_accumulate(acc.clone(), a.float(), b.float())
                assert torch.equal(gemm_cpu.gemm_abt_accumulate(acc, a, b), want)
    finally:
        torch.set_num_threads(old)
