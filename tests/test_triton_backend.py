"""The ``triton`` numerics backend, proven on CPU with Triton's interpreter (``TRITON_INTERPRET=1``).

The interpreter runs the kernels with numpy: these tests prove the kernels' logic — indexing, masks, the fixed split
and chunk structure, that fused and split paths run the same arithmetic, batch invariance of the algorithm — not the
GPU's bits (``tests/test_cuda.py`` runs the same claims on a GPU when one is present). Per op: agreement with the torch
backend (tolerance stated per op: the two backends reduce in different orders and round intermediates differently),
exact batch invariance, deterministic backward close to the torch backward. Then the zero-KLD property with both
sides on Triton: an op-table model (trainer vs a continuous-batching paged engine), TorchTitan's model and a real vLLM
engine, ``torch.equal``.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # conftest sets it first: before anything imports triton

import random

import numpy as np
import pytest
import torch

import shared_numerics as sn
from shared_numerics import ops_torch
from shared_numerics.ops_triton import attention as tattn
from shared_numerics.ops_triton.table import OPS as T
from shared_numerics.rollout import RolloutBatch

pytestmark = pytest.mark.long  # minutes of Triton-interpreter and engine runs: `make test-long`

R = ops_torch.OPS
DTYPES = [torch.float32, torch.bfloat16]
# Max |triton - torch| allowed, relative to max |torch|: fp32 — a few ulps of accumulated rounding; bf16 outputs —
# one bf16 ulp (2^-8 relative) where an fp32 intermediate lands on the other side of a bf16 rounding boundary.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-7}
# Attention in bf16: Triton rounds the probabilities to bf16 for the p·v dot (FlashAttention-2), the torch backend
# keeps them fp32: up to a few bf16 ulps of the output.
ATTN_TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-5}


def _close(a, b, dtype, tol=TOL):
    a, b = a.float(), b.float()
    assert (a - b).abs().max().item() <= tol[dtype] * max(b.abs().max().item(), 1.0)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _attn_inputs(dtype, b=3, t=45, hq=4, hk=2, d=32, seed=1):
    g = _gen(seed)
    return [torch.randn(b, t, h, d, generator=g).to(dtype) for h in (hq, hk, hk)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_each_op_matches_torch_and_is_batch_invariant(dtype):
    g = _gen()
    # 300 rows: three 128-row GEMM tiles; the slices put rows at other positions of a tile (0, 1, 127, 128, 129)
    x, w, bias = (
        torch.randn(300, 200, generator=g).to(dtype),
        (torch.randn(150, 200, generator=g) * 0.05).to(dtype),
        torch.randn(150, generator=g).to(dtype),
    )
    y = T["linear"](x, w, bias)
    _close(y, R["linear"](x, w, bias), dtype)
    for sl in (slice(0, 1), slice(5, 9), slice(127, 130), slice(130, 300), slice(3, 299)):
        assert torch.equal(T["linear"](x[sl], w, bias), y[sl])
    assert torch.equal(T["linear"](x[:40], w.float(), bias), T["linear"](x[:40], w.to(dtype), bias))  # x's dtype

    h, nw = torch.randn(40, 3, 64, generator=g).to(dtype), torch.randn(64, generator=g).to(dtype)
    yn = T["rms_norm"](h, nw, 1e-6)
    _close(yn, R["rms_norm"](h, nw, 1e-6), dtype)
    assert torch.equal(T["rms_norm"](h[7:9], nw, 1e-6), yn[7:9])

    cos, sin = sn.rope_cos_sin(torch.arange(40) + 5, 32, 10000.0)
    q = torch.randn(40, 4, 32, generator=g).to(dtype)
    yr = T["apply_rope"](q, cos, sin)
    _close(yr, R["apply_rope"](q, cos, sin), dtype)
    assert torch.equal(T["apply_rope"](q[11:12], cos[11:12], sin[11:12]), yr[11:12])

    gate, up = torch.randn(9, 1300, generator=g).to(dtype), torch.randn(9, 1300, generator=g).to(dtype)
    ys = T["silu_and_mul"](gate, up)
    _close(ys, R["silu_and_mul"](gate, up), dtype)
    assert torch.equal(T["silu_and_mul"](gate[4:5], up[4:5]), ys[4:5])

    z, t = torch.randn(6, 3000, generator=g).to(dtype), torch.randint(0, 3000, (6,), generator=g)
    ls = T["log_softmax"](z)
    _close(ls, R["log_softmax"](z), torch.float32)  # float32 output either way: 1e-5 relative to max |logprob|
    assert torch.equal(T["log_softmax"](z[2:3]), ls[2:3])
    assert torch.equal(T["selected_logprobs"](z, t), ls[torch.arange(6), t])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ops", [T, R], ids=["triton", "torch"])
def test_fused_ops_are_bitwise_their_composition(ops, dtype):
    """add_rms_norm == (x + r, rms_norm(x + r)); rms_norm_rope == apply_rope(rms_norm(x)): the vLLM side runs the
    fused ops, TorchTitan the unfused sequence. Rows stay independent (a slice gives the same rows)."""
    g = _gen(11)
    x, r, w = (
        torch.randn(70, 96, generator=g).to(dtype),
        torch.randn(70, 96, generator=g).to(dtype),
        torch.randn(96, generator=g).to(dtype),
    )
    s, y = ops["add_rms_norm"](x, r, w, 1e-6)
    assert torch.equal(s, x + r) and torch.equal(y, ops["rms_norm"](x + r, w, 1e-6))
    assert torch.equal(ops["add_rms_norm"](x[3:4], r[3:4], w, 1e-6)[1], y[3:4])
    q, wq = torch.randn(70, 5, 64, generator=g).to(dtype), torch.randn(64, generator=g).to(dtype)
    cos, sin = sn.rope_cos_sin(torch.arange(70) * 3, 64, 1e6)
    f = ops["rms_norm_rope"](q, wq, 1e-6, cos, sin)
    assert torch.equal(f, ops["apply_rope"](ops["rms_norm"](q, wq, 1e-6), cos, sin))
    assert torch.equal(ops["rms_norm_rope"](q[40:41], wq, 1e-6, cos[40:41], sin[40:41]), f[40:41])
    if ops is T:
        _close(f, R["rms_norm_rope"](q, wq, 1e-6, cos, sin), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k_chunk", [None, 128])
def test_gemm_decode_path_gives_the_persistent_bits(dtype, k_chunk):
    """The Triton GEMM's decode-size path (64-row tiles of each width it may pick, rows past M unread, and with
    ``k_chunk`` one program per K chunk plus the ordered chunk sum) computes the persistent path's arithmetic: the
    same rows bitwise, with and without bias, K ragged over the chunks. Control: another chunking (the bits'
    definition) differs. ``tests/test_cuda.py`` proves the GPU's bits."""
    import dataclasses

    from shared_numerics.ops_triton import matmul as mm

    cfg = dataclasses.replace(mm.CONFIGS[dtype], k_chunk=k_chunk)
    g = _gen(11)
    a = torch.randn(70, 300, generator=g).to(dtype)
    b = torch.randn(40, 300, generator=g).to(dtype).t()
    bias = torch.randn(40, generator=g).to(dtype)
    for bb in (None, bias):
        full = mm.gemm(a, b, dtype, bb, config=cfg, split=False)
        _close(full, a.float() @ b.float() + (0 if bb is None else bb.float()), dtype)
        for bn in cfg.split_n:
            assert torch.equal(mm.gemm(a, b, dtype, bb, config=cfg, split=True, split_n=bn), full)
            for rows in (slice(0, 1), slice(3, 11)):
                assert torch.equal(mm.gemm(a[rows], b, dtype, bb, config=cfg, split=True, split_n=bn), full[rows])
    other = dataclasses.replace(cfg, k_chunk=64 if k_chunk else 128)
    f32 = torch.float32  # fp32 outputs: bf16 rounding hides most one-ulp differences of the sums at this K
    assert not torch.equal(mm.gemm(a, b, f32, config=other, split=False), mm.gemm(a, b, f32, config=cfg, split=False))


@pytest.mark.parametrize("dtype", DTYPES)
def test_lora_linear_matches_torch_and_is_batch_invariant(dtype):
    """Multi-LoRA (issue 18): three adapters and base-only rows in one call; a row alone, or the batch reordered,
    gives the co-batched row's bits; close to the torch backend."""
    g = _gen(3)
    x = torch.randn(70, 96, generator=g).to(dtype)
    w, b = (torch.randn(80, 96, generator=g) * 0.1).to(dtype), torch.randn(80, generator=g).to(dtype)
    a, bb = (torch.randn(3, 16, 96, generator=g) * 0.1).to(dtype), (torch.randn(3, 80, 16, generator=g) * 0.5).to(dtype)
    s, ids = torch.tensor([2.0, 0.5, 1.0]), torch.randint(-1, 3, (70,), generator=g)
    y = T["lora_linear"](x, w, b, a, bb, s, ids)
    _close(y, R["lora_linear"](x, w, b, a, bb, s, ids), dtype)
    for i in (0, 33, 69):
        assert torch.equal(T["lora_linear"](x[i : i + 1], w, b, a, bb, s, ids[i : i + 1]), y[i : i + 1])
    perm = torch.randperm(70, generator=g)
    assert torch.equal(T["lora_linear"](x[perm], w, b, a, bb, s, ids[perm]), y[perm])
    # the engine's half (vLLM's add_lora_linear seam): adapters added to the Triton base output
    assert torch.equal(T["add_lora"](T["linear"](x, w, b), x, a, bb, s, ids), y)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_dense_paged_and_invariance(dtype):
    q, k, v = _attn_inputs(dtype)
    b, t, _, d = q.shape
    scale = d**-0.5
    od = T["dense_causal_attention"](q, k, v, scale)
    _close(od, R["dense_causal_attention"](q, k, v, scale), dtype, ATTN_TOL)
    # a shorter batch of one sequence: same rows
    assert torch.equal(T["dense_causal_attention"](q[1:2, :20], k[1:2, :20], v[1:2, :20], scale)[0], od[1, :20])


# held-out-like attention shapes (issue 35 row 2): odd head counts, GQA 3:1 and 5:1, MHA, head_dim 32 / 20 / 16
SHAPES = [(3, 1, 32), (6, 2, 20), (5, 5, 16), (5, 1, 16), (3, 3, 20)]


@pytest.mark.parametrize("hq,hk,d", [*SHAPES[:2], *(pytest.param(*s, marks=pytest.mark.extended) for s in SHAPES[2:])])
def test_attention_shape_matrix_dense_equals_paged(hq, hk, d):
    """Every shape runs (Triton 3.9 refused the split kernel's store mask for all of them), agrees with the torch
    backend, and the trainer's dense rows are bitwise vLLM's paged rows (decodes and a prefill chunk)."""
    dtype = torch.float32
    q, k, v = _attn_inputs(dtype, b=2, t=40, hq=hq, hk=hk, d=d, seed=hq * 100 + d)
    scale = d**-0.5
    od = T["dense_causal_attention"](q, k, v, scale)
    _close(od, R["dense_causal_attention"](q, k, v, scale), dtype, ATTN_TOL)
    kc, vc, table = _paged_cache(k, v, 16, seed=d)
    for sched in ([(0, 39, 40), (1, 20, 21)], [(1, 0, 33), (0, 10, 40)]):
        assert torch.equal(_paged(q, kc, vc, table, sched, 40, scale), torch.cat([od[s, a:e] for s, a, e in sched]))


def _paged_cache(k, v, bs, seed):
    """vLLM 0.32's per-layer view ``[blocks, kv_heads, bs, 2 * D]`` (K|V content), shuffled blocks, NaN garbage in
    never-written slots; returns (key_cache, value_cache, block_table)."""
    b, t, hk, d = k.shape
    per_seq = -(-t // bs)
    kv = torch.full((b * per_seq + 3, hk, bs, 2 * d), float("nan")).to(k.dtype)
    kc, vc = kv.split(d, dim=-1)
    table = torch.randperm(b * per_seq + 3, generator=_gen(seed))[: b * per_seq].reshape(b, per_seq)
    for s in range(b):
        for p in range(t):
            kc[table[s, p // bs], :, p % bs] = k[s, p]
            vc[table[s, p // bs], :, p % bs] = v[s, p]
    return kc, vc, table


def _paged(q, kc, vc, table, sched, t, scale, **kw):
    """Attention of the scheduled queries ``sched = [(seq, first, last+1), ...]`` (each sequence's context ends at
    its last scheduled query) over the paged cache."""
    qs = torch.cat([q[s, a:e] for s, a, e in sched])
    qsl = torch.tensor([0] + [e - a for _, a, e in sched]).cumsum(0)
    return T["paged_causal_attention"](
        qs, kc, vc, qsl, torch.tensor([e for _, _, e in sched]), table[[s for s, _, _ in sched]], scale, **kw
    )


# float32 is `make test-extended` (~35 s on the interpreter): bfloat16 runs the same splits, blocks and batches
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=pytest.mark.extended), torch.bfloat16])
def test_attention_fixed_splits_dense_equals_paged(dtype):
    """Contexts of 1100 keys (3 splits of 512): the trainer's dense rows == vLLM's paged rows at block sizes 16 and
    64 (the smallest and one that is not vLLM's default) for decodes (one program per split + the ordered combine),
    prefill chunks crossing a split boundary (splits merged inside the program), a chunk starting at 0, and a decode
    batched with a prefill — same bits every way."""
    q, k, v = _attn_inputs(dtype, b=2, t=1100, seed=3)
    scale = q.shape[-1] ** -0.5
    od = T["dense_causal_attention"](q, k, v, scale)
    _close(od[:, ::50], R["dense_causal_attention"](q, k, v, scale)[:, ::50], dtype, ATTN_TOL)
    batches = [
        [(0, 1099, 1100), (1, 600, 601), (1, 1023, 1024)],  # decodes only: split-KV path
        [(0, 490, 530), (1, 1000, 1050)],  # prefill chunks across split boundaries: in-program path
        [(1, 0, 70), (0, 511, 512), (0, 1099, 1100)],  # a prefill from 0, co-batched with decodes
    ]
    for bs in (16, 64):
        kc, vc, table = _paged_cache(k, v, bs, seed=bs)
        for sched in batches:
            out = _paged(q, kc, vc, table, sched, 1100, scale)
            assert torch.equal(out, torch.cat([od[s, a:e] for s, a, e in sched])), (bs, sched)


def test_attention_split_kv_and_in_program_paths_agree():
    """The same queries through the two launch shapes (``max_query_len`` decides) give the same bits."""
    q, k, v = _attn_inputs(torch.bfloat16, b=2, t=700, seed=5)
    kc, vc, table = _paged_cache(k, v, 16, seed=6)
    sched = [(0, 690, 700), (1, 512, 530), (1, 100, 101)]
    split = _paged(q, kc, vc, table, sched, 700, 0.2, max_query_len=1, max_seq_len=700)  # forced: one program/split
    whole = _paged(q, kc, vc, table, sched, 700, 0.2, max_query_len=1000, max_seq_len=700)  # forced: in-program
    assert torch.equal(split, whole)


def test_attention_split_size_is_what_fixes_the_bits(monkeypatch):
    """Negative control: a split size chosen from the batch (what stock split-KV decoding does) gives other bits for
    every query past the first split — the fixed SPLIT is what keeps dense == paged."""
    q, k, v = _attn_inputs(torch.bfloat16, b=1, t=600, seed=7)
    od = T["dense_causal_attention"](q, k, v, 0.2)
    monkeypatch.setattr(tattn, "SPLIT", 256)
    other = T["dense_causal_attention"](q, k, v, 0.2)
    assert torch.equal(other[0, :256], od[0, :256])
    assert not torch.equal(other[0, 256:], od[0, 256:])


def test_paged_launch_reads_nothing_back_from_the_device(monkeypatch):
    """With vLLM's host ints (``max_query_len``, ``max_seq_len``) the Triton wrapper and the vLLM backend's forward
    run on ``meta`` tensors (whose values cannot be read): no device-to-host copy, no sync — CUDA-graph capturable.
    The kernels themselves are stubbed (the interpreter cannot run on meta tensors)."""
    from vllm_plugin.attention_backend import ZeroKLDAttentionImpl, ZeroKLDAttentionMetadata

    launches = []

    class Stub:
        def __getitem__(self, grid):
            return lambda *a, **kw: launches.append(grid)

    monkeypatch.setattr(tattn, "_attn_fwd", Stub())
    monkeypatch.setattr(tattn, "_attn_combine", Stub())
    monkeypatch.setenv("ZEROKLD_BACKEND", "triton")
    meta = torch.device("meta")
    impl = ZeroKLDAttentionImpl(8, 64, 0.125, 2, None, None, "auto")
    kv = torch.empty(40, 2, 16, 128, dtype=torch.bfloat16, device=meta)
    md = ZeroKLDAttentionMetadata(
        num_actual_tokens=5,
        max_query_len=1,
        max_seq_len=1500,
        query_start_loc=torch.empty(6, dtype=torch.int32, device=meta),
        seq_lens=torch.empty(5, dtype=torch.int32, device=meta),
        block_table=torch.empty(5, 100, dtype=torch.int32, device=meta),
        slot_mapping=torch.empty(5, dtype=torch.int64, device=meta),
    )
    out = torch.empty(5, 8 * 64, dtype=torch.bfloat16, device=meta)
    impl.forward(None, torch.empty(5, 8, 64, dtype=torch.bfloat16, device=meta), None, None, kv, md, out)
    assert launches == [(5 // 32 + 5, 2, 3), (5,)]  # tiles, kv heads, 3 splits of 512; then the combine
    md.max_query_len = 40  # a prefill chunk: one program per tile, no combine
    impl.forward(None, torch.empty(5, 8, 64, dtype=torch.bfloat16, device=meta), None, None, kv, md, out)
    assert launches[-1] == (5 // 32 + 5, 2, 1)


@pytest.mark.parametrize("granularity", ["per_channel", "block"])
def test_fp8_kernels(granularity):
    from shared_numerics.fp8 import quantize_fp8_activation
    from shared_numerics.ops_triton.fp8 import quantize_fp8_activation as triton_quantize

    g = _gen(5)
    x = torch.randn(37, 300, generator=g).to(torch.bfloat16)
    x[3] = 0.0
    x[4, :5] = torch.tensor([448.0, 1.0625, 1.1875, 2.0**-9 * 1.5, -1e-30])
    tq, ts = triton_quantize(x, granularity)
    rq, rs = quantize_fp8_activation(x, granularity)
    assert torch.equal(tq.float(), rq.float()) and torch.equal(ts, rs)  # the quantizer is exact across backends
    w = (torch.randn(150, 300, generator=g) * 0.05).to(torch.bfloat16)
    qw, sw = sn.quantize_fp8_weight(w, granularity)
    y = T["fp8_linear"](x, qw, sw, granularity)
    _close(y, R["fp8_linear"](x, qw, sw, granularity), torch.bfloat16)
    assert torch.equal(T["fp8_linear"](x[5:9], qw, sw, granularity), y[5:9])
    assert torch.equal(T["fp8_linear_qat"](x, w, granularity), y)
    for bad in (float("nan"), float("inf")):
        xb = x.clone()
        xb[20, 7] = bad
        with pytest.raises(ValueError, match="inf or NaN"):
            triton_quantize(xb, granularity)


def _grads(fn, args, up):
    args = [a.detach().clone().requires_grad_(a.is_floating_point()) for a in args]
    (fn(*args).float() * up).sum().backward()
    return [a.grad for a in args if a.is_floating_point()]


BACKWARD_CASES = {
    "linear": lambda g: (
        [torch.randn(37, 200, generator=g), torch.randn(150, 200, generator=g) * 0.05, torch.randn(150, generator=g)],
        (),
    ),
    "rms_norm": lambda g: ([torch.randn(7, 3, 64, generator=g), torch.randn(64, generator=g)], (1e-6,)),
    "apply_rope": lambda g: ([torch.randn(7, 4, 32, generator=g)], sn.rope_cos_sin(torch.arange(7), 32, 1e4)),
    "silu_and_mul": lambda g: ([torch.randn(9, 130, generator=g), torch.randn(9, 130, generator=g)], ()),
    "log_softmax": lambda g: ([torch.randn(6, 3000, generator=g)], ()),
    "selected_logprobs": lambda g: ([torch.randn(6, 3000, generator=g)], (torch.randint(0, 3000, (6,), generator=g),)),
    # 150 positions, 4 query heads per kv head: several query tiles and key chunks per sequence
    "dense_causal_attention": lambda g: (_attn_inputs(torch.float32, b=2, t=150, hq=8, hk=2), (32**-0.5,)),
    "fp8_linear_qat": lambda g: ([torch.randn(37, 200, generator=g), torch.randn(150, 200, generator=g) * 0.05], ()),
    "fused_selected_logprobs": lambda g: (
        [torch.randn(40, 64, generator=g), torch.randn(500, 64, generator=g) * 0.1],
        (torch.randint(0, 500, (40,), generator=g), 16),
    ),
}


# the ops of a decoder layer's backward (linear, attention, the fused head) by default; the rest `make test-extended`
_BACKWARD_DEFAULT = {"linear", "dense_causal_attention", "fused_selected_logprobs"}


@pytest.mark.parametrize(
    "op", [o if o in _BACKWARD_DEFAULT else pytest.param(o, marks=pytest.mark.extended) for o in sorted(BACKWARD_CASES)]
)
def test_backward_close_to_torch_and_deterministic(op):
    """Gradients: within 1e-5 relative of the torch backend's (fp32), and bitwise repeatable."""
    args, extra = BACKWARD_CASES[op](_gen(6))
    up = torch.randn(R[op](*args, *extra).shape, generator=_gen(7))
    gt = _grads(lambda *a: T[op](*a, *extra), args, up)
    gr = _grads(lambda *a: R[op](*a, *extra), args, up)
    for a, b in zip(gt, gr, strict=True):
        assert (a - b).abs().max().item() <= 1e-5 * max(b.abs().max().item(), 1.0)
    assert all(torch.equal(a, b) for a, b in zip(gt, _grads(lambda *a: T[op](*a, *extra), args, up), strict=True))


def test_fused_head_equals_unfused_on_triton():
    g = _gen(8)
    h, w, t = torch.randn(40, 64, generator=g), torch.randn(500, 64, generator=g) * 0.1, torch.randint(0, 500, (40,))
    assert torch.equal(T["fused_selected_logprobs"](h, w, t, 16), T["selected_logprobs"](T["linear"](h, w), t))


def test_interpreter_gaps_are_filled():
    """Why :mod:`shared_numerics.ops_triton.interpreter` patches Triton's interpreter (negative controls): its own
    ``tl.dot`` multiplies bf16 bit patterns, and numpy's float32 GEMM rounds a row by what else is in the call — by
    its position in the tile (OpenBLAS's AVX2 kernels) or by the number of rows (one row takes the gemv path; seen
    on AVX-512 machines, where the position does not matter). The fixed dot gives a row the same bits either way."""
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    from shared_numerics.ops_triton.interpreter import ORIGINALS

    a = torch.randn(16, 32, generator=_gen(9))
    b = torch.randn(32, 16, generator=_gen(10))
    bits = lambda t: t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    acc = TensorHandle(np.zeros((16, 16), np.float32), tl.float32)
    ha, hb = TensorHandle(bits(a), tl.bfloat16), TensorHandle(bits(b), tl.bfloat16)
    exact = a.bfloat16().float() @ b.bfloat16().float()
    orig = torch.from_numpy(ORIGINALS["create_dot"](None, ha, hb, acc, None, None).data)
    assert (orig - exact).abs().max() > 1e6  # bit patterns multiplied
    from triton.runtime.interpreter import interpreter_builder

    fixed = torch.from_numpy(interpreter_builder.create_dot(ha, hb, acc, None, None).data)
    assert (fixed - exact).abs().max() < 1e-4
    # a row moved to another position of the tile, or alone: numpy's sgemm may round it differently, the fixed dot
    # never
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((64, 96)).astype(np.float32), rng.standard_normal((96, 32)).astype(np.float32)
    moved = [not np.array_equal((x @ y)[r], (_at0(x, r) @ y)[0]) for r in range(64)]
    alone = [not np.array_equal((x @ y)[r], (x[r : r + 1] @ y)[0]) for r in range(64)]
    assert any(moved) or any(alone)
    hx, hy = TensorHandle(x, tl.float32), TensorHandle(y, tl.float32)
    z = TensorHandle(np.zeros((64, 32), np.float32), tl.float32)
    full = interpreter_builder.create_dot(hx, hy, z, None, None).data
    for r in range(64):
        one = interpreter_builder.create_dot(TensorHandle(_at0(x, r), tl.float32), hy, z, None, None).data
        assert np.array_equal(one[0], full[r])
        single = interpreter_builder.create_dot(
            TensorHandle(x[r : r + 1].copy(), tl.float32),
            hy,
            TensorHandle(np.zeros((1, 32), np.float32), tl.float32),
            None,
            None,
        ).data
        assert np.array_equal(single[0], full[r])


def _at0(x, r):
    moved = np.zeros_like(x)
    moved[0] = x[r]
    return moved


# float32 is `make test-extended` (~95 s on the interpreter): bfloat16 runs the same op model
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=pytest.mark.extended), torch.bfloat16])
def test_op_model_trainer_equals_continuous_batching_engine(dtype):
    """Model level on the Triton op table: a Qwen3-style model whose engine serves requests that arrive at different
    steps, chunked prefill co-batched with decodes, 16-token blocks handed out shuffled, one prompt crossing the
    512-key split — every generated token's engine log-prob == the trainer's (dense batch), bitwise. Stock PyTorch
    ops on the same model and schedule differ (negative control)."""
    from benchmarks.op_model import STOCK_OPS, OpModel, OpModelSpec, rollout

    rng = random.Random(0)
    prompts = [[rng.randrange(1, 256) for _ in range(n)] for n in (5, 40, 9, 70, 540)]
    arrivals = [0, 0, 3, 4, 1]
    spec = OpModelSpec()
    model = OpModel(spec, dtype, ops=T)
    res = rollout(model, prompts, 5, token_budget=48, block_size=16, arrivals=arrivals)
    assert res.mixed_steps > 0
    train = model.trainer_logprobs(res.sequences[:4]) + model.trainer_logprobs(res.sequences[4:])
    assert all(torch.equal(a[-5:], b) for a, b in zip(train, res.logprobs, strict=True))
    stock = OpModel(spec, dtype, ops=STOCK_OPS)
    sres = rollout(stock, prompts, 5, token_budget=48, block_size=16, arrivals=arrivals)
    strain = stock.trainer_logprobs(sres.sequences)
    assert not all(torch.equal(a[-5:], b) for a, b in zip(strain, sres.logprobs, strict=True))


def test_backend_selection(monkeypatch):
    x = torch.randn(4, 8)
    monkeypatch.delenv("ZEROKLD_BACKEND", raising=False)
    assert sn.backend_name(x) == "torch"  # CPU tensors pick torch ...
    monkeypatch.setenv("ZEROKLD_BACKEND", "triton")
    assert sn.backend_name(x) == "triton"  # ... unless forced
    assert torch.equal(sn.linear(x, torch.eye(8)), T["linear"](x, torch.eye(8)))
    monkeypatch.delenv("TRITON_INTERPRET")
    sn._OPS_CACHE.pop("triton", None)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        sn.linear(x, torch.eye(8))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    sn._OPS_CACHE.pop("triton", None)


@pytest.fixture(scope="module")
def triton_engine(engine_slot, checkpoint_factory):
    """A real vLLM engine whose worker runs the Triton backend (interpreter): the env is inherited at spawn."""
    from vllm_plugin.engines import start_llm

    ckpt = checkpoint_factory("qwen3", "float32")
    saved = os.environ.get("ZEROKLD_BACKEND")
    os.environ["ZEROKLD_BACKEND"] = "triton"
    try:
        llm = engine_slot.get(
            ("zerokld-triton", ckpt),
            lambda: start_llm(ckpt, dtype="float32", max_num_batched_tokens=64, max_model_len=256, block_size=16),
        )
    finally:
        if saved is None:
            os.environ.pop("ZEROKLD_BACKEND")
        else:
            os.environ["ZEROKLD_BACKEND"] = saved
    return llm, ckpt


@pytest.mark.vllm
@pytest.mark.titan
def test_parity_matrix_both_sides_on_triton(triton_engine, monkeypatch):
    """Trainer (TorchTitan) and vLLM (16-token KV blocks, vLLM's CUDA default) both on the Triton backend: sampled
    logprobs == trainer logprobs, alone vs in a batch, chunked prefill (64-token chunks) and a prefix-cache hit — all
    ``torch.equal``."""
    from vllm import SamplingParams

    from titan_plugin import trainer_logprobs
    from vllm_plugin.engines import completion_logprobs, prompt_logprobs

    llm, ckpt = triton_engine
    monkeypatch.setenv("ZEROKLD_BACKEND", "triton")
    rng = random.Random(0)
    prompts = [[1] + [rng.randrange(3, 100) for _ in range(rng.randrange(4, 110))] for _ in range(10)]
    sp = SamplingParams(max_tokens=8, temperature=1.0, logprobs=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs, strict=True)]
    train = trainer_logprobs(ckpt, seqs, [len(p) for p in prompts], dtype="float32")
    assert all(torch.equal(t, completion_logprobs(o)) for t, o in zip(train, outs, strict=True))
    greedy = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0, ignore_eos=True)
    batch = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    llm.reset_prefix_cache()
    alone = llm.generate([{"prompt_token_ids": prompts[3]}], greedy, use_tqdm=False)[0]
    assert torch.equal(completion_logprobs(alone), completion_logprobs(batch[3]))
    # a prefix-cache hit (a cached 140-token prefix) gives the cold run's bits
    base = [1] + [rng.randrange(3, 100) for _ in range(139)]
    llm.reset_prefix_cache()
    cold = llm.generate([{"prompt_token_ids": base + [5, 6, 7]}], greedy, use_tqdm=False)[0]
    llm.reset_prefix_cache()
    llm.generate([{"prompt_token_ids": base}], greedy, use_tqdm=False)
    warm = llm.generate([{"prompt_token_ids": base + [5, 6, 7]}], greedy, use_tqdm=False)[0]
    assert (warm.num_cached_tokens or 0) > 0, "no prefix-cache hit"
    assert torch.equal(completion_logprobs(warm), completion_logprobs(cold))
    # the longest sequence scored as a prompt (prefilled in 64-token chunks) == the trainer
    longest = max(seqs, key=len)
    llm.reset_prefix_cache()
    scored = llm.generate(
        [{"prompt_token_ids": longest}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
    )[0]
    assert torch.equal(prompt_logprobs(scored, start=1), trainer_logprobs(ckpt, [longest], [1], dtype="float32")[0])
    # negative control: the torch backend's trainer logprobs are other bits (the two backends reduce differently)
    monkeypatch.setenv("ZEROKLD_BACKEND", "torch")
    torch_train = trainer_logprobs(ckpt, seqs, [len(p) for p in prompts], dtype="float32")
    assert any(not torch.equal(a, b) for a, b in zip(torch_train, train, strict=True))


@pytest.mark.titan
def test_torchtitan_training_step_on_triton(checkpoint_factory, tmp_path, monkeypatch):
    """TorchTitan's Trainer with every zerokld op on Triton (forward and backward): the training forward gives
    trainer_logprobs' bits, and the step actually moves the weights."""
    from titan_plugin import trainer_logprobs
    from titan_plugin.rl import RLTrainer, rl_trainer_config

    monkeypatch.setenv("ZEROKLD_BACKEND", "triton")
    ckpt = checkpoint_factory("qwen3", "bfloat16")
    seqs = [[1] + list(range(5, 5 + n)) for n in (12, 40, 70)]
    plens = [4, 20, 33]
    ref = trainer_logprobs(ckpt, seqs, plens, dtype="bfloat16")
    trainer = RLTrainer(rl_trainer_config(ckpt, str(tmp_path / "dump"), dtype="bfloat16", lr=1e-2))
    try:
        out = trainer.rl_step(
            RolloutBatch(seqs, plens, [1.0, -1.0, 0.5], [r.clone() for r in ref], numerics=trainer.numerics)
        )
        assert all(torch.equal(a, b) for a, b in zip(out["train_logprobs"], ref, strict=True))
        after = trainer.forward_logprobs(RolloutBatch(seqs, plens))
        assert any(not torch.equal(a, b) for a, b in zip(after, ref, strict=True))
        snap = trainer.save_hf(tmp_path / "step1", "bfloat16")
        assert all(
            torch.equal(a, b)
            for a, b in zip(trainer_logprobs(str(snap), seqs, plens, dtype="bfloat16"), after, strict=True)
        )
    finally:
        trainer.close()
