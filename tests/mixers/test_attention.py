"""The attention kernels of the GQA token mixer (``shared_numerics.dense_causal_attention``, the paged attention
vLLM serves with, their backward): the documented arithmetic, batch, thread and block-size invariance, closeness to
ATen's SDPA."""

from __future__ import annotations

import pytest
import torch

import shared_numerics as sn

DTYPES = [torch.float32, torch.bfloat16]


def sdpa(q, k, v, scale=None):
    """Stock: ATen's scaled_dot_product_attention in the ``[B, T, H, D]`` layout."""
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True, scale=scale
    ).transpose(1, 2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_attention_matches_sdpa_and_is_batch_invariant(dtype, threads):
    """600 tokens: a 342-token prefix alone gives other bits than inside the 600-token sequence under ATen's SDPA
    (``tests/test_numerics.py::test_negative_controls_stock_ops``), and the same bits under ours."""
    g = torch.Generator().manual_seed(5)
    b, t, hq, hkv, d = 3, 600, 4, 2, 32
    q = torch.randn(b, t, hq, d, generator=g).to(dtype)
    k = torch.randn(b, t, hkv, d, generator=g).to(dtype)
    v = torch.randn(b, t, hkv, d, generator=g).to(dtype)
    out = sn.dense_causal_attention(q, k, v, d**-0.5)
    assert torch.equal(sn.dense_causal_attention(q[1:2, :342], k[1:2, :342], v[1:2, :342], d**-0.5), out[1:2, :342])
    ref = sdpa(q.float(), k.float(), v.float())
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=2e-6 if dtype == torch.float32 else 2e-2)


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def _exp_nonpos(x: torch.Tensor) -> torch.Tensor:
    """``zk::exp_nonpos`` (csrc/zk_simd.h) written out in float32 torch ops, one rounding per operation."""
    xc = torch.where(x < -87.0, _f32(-87.0), x)
    fn = (xc * _f32(1.44269504088896341) + _f32(12582912.0)) - _f32(12582912.0)
    r = xc - fn * _f32(0.693359375)
    r = r - fn * _f32(-2.12194440e-4)
    z = r * r
    y = torch.full_like(x, 1.9875691500e-4)
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        y = y * r + _f32(c)
    y = (y * z + r) + _f32(1.0)
    two_n = ((fn.to(torch.int32) + 127) << 23).view(torch.float32)
    return torch.where(x < -87.0, _f32(0.0), y * two_n)


def _decode_row_as_documented(q, keys, values, scale):
    """One query row at position ``len(keys) - 1`` by the arithmetic csrc/attention.cpp's header states, each
    operation a float32 torch op: scores summed in d order (multiply, then add), the chunk's max, online softmax with
    sums in key order."""
    n, d = keys.shape
    q, keys, values = q.float(), keys.float(), values.float()
    m, l, acc = _f32(float("-inf")), _f32(0.0), torch.zeros(d)
    for j in range((n + 31) // 32):
        k = torch.zeros(32, d)
        v = torch.zeros(32, d)
        k[: min(32, n - 32 * j)] = keys[32 * j : 32 * j + 32]
        v[: min(32, n - 32 * j)] = values[32 * j : 32 * j + 32]
        s = torch.zeros(32)
        for i in range(d):
            s = s + q[i] * k[:, i]
        s = torch.where(torch.arange(32) + 32 * j > n - 1, _f32(float("-inf")), s * _f32(scale))
        mx = torch.maximum(s.max(), m)
        alpha = _f32(0.0) if m == float("-inf") else _exp_nonpos(m - mx)
        p = torch.where(s == float("-inf"), _f32(0.0), _exp_nonpos(s - mx))
        lsum, pv = _f32(0.0), torch.zeros(d)
        for c in range(32):
            lsum = lsum + p[c]
            pv = pv + p[c] * v[c]
        l, acc, m = l * alpha + lsum, acc * alpha + pv, mx
    return acc / l


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_kernel_is_the_documented_arithmetic(dtype):
    """The compiled kernel's bits are those of its header's arithmetic, written out op by op in torch. Covers the
    fast forms that must not change them: bf16 scores as one fused multiply-add per product (exact products: the same
    sum as multiply-then-add), the chunk's max as a vector tree (scores are never -0, so equal scores are equal bits),
    including an all-zero query whose scores all tie."""
    g = torch.Generator().manual_seed(3)
    b, hq, hkv, d, bs = 3, 4, 2, 64, 32
    lens = torch.tensor([1, 45, 130])
    cache = torch.randn(b * 5, hkv, bs, 2 * d, generator=g).to(dtype)
    kc, vc = cache.split(d, dim=-1)
    bt = torch.randperm(b * 5, generator=g).reshape(b, 5)
    q = torch.randn(b, hq, d, generator=g).to(dtype)
    q[1, 2] = 0
    out = sn.paged_causal_attention(q, kc, vc, torch.arange(b + 1), lens, bt, d**-0.5)
    for s in range(b):
        pos = torch.arange(int(lens[s]))
        blocks = bt[s, pos // bs]
        for h in range(hq):
            ref = _decode_row_as_documented(
                q[s, h], kc[blocks, h // (hq // hkv), pos % bs], vc[blocks, h // (hq // hkv), pos % bs], d**-0.5
            )
            assert torch.equal(out[s, h], ref.to(dtype)), (s, h)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_kernel_thread_count_and_streamed_gradients(dtype):
    """The compiled CPU attention (``shared_numerics/csrc/attention.cpp``): the same bits at 1, 2 and 3 threads
    (decode batch over the paged cache and dense prefill), and a sequence's gradients (dq, dk, dv) the same bits
    alone as inside a batch of other sequences (what the trainer's exact streaming needs)."""
    g = torch.Generator().manual_seed(11)
    b, t, hq, hkv, d = 4, 150, 8, 2, 64
    q = torch.randn(b, t, hq, d, generator=g).to(dtype)
    k = torch.randn(b, t, hkv, d, generator=g).to(dtype)
    v = torch.randn(b, t, hkv, d, generator=g).to(dtype)
    bs = 32
    cache = torch.randn(b * (t // bs + 1) + 2, hkv, bs, 2 * d, generator=g).to(dtype)
    kc, vc = cache.split(d, dim=-1)
    bt = torch.randperm(cache.shape[0], generator=g)[: b * (t // bs + 1)].reshape(b, -1)
    for s in range(b):
        for p in range(t):
            kc[bt[s, p // bs], :, p % bs], vc[bt[s, p // bs], :, p % bs] = k[s, p], v[s, p]
    lens = torch.tensor([150, 37, 1, 96])
    decode_q = q[torch.arange(b), lens - 1]
    old = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(
                (
                    sn.dense_causal_attention(q, k, v, d**-0.5),
                    sn.paged_causal_attention(decode_q, kc, vc, torch.arange(b + 1), lens, bt, d**-0.5),
                )
            )
    finally:
        torch.set_num_threads(old)
    for dense, paged in outs[1:]:
        assert torch.equal(dense, outs[0][0]) and torch.equal(paged, outs[0][1])
    assert torch.equal(outs[0][1], outs[0][0][torch.arange(b), lens - 1])  # decode rows == their prefill rows

    grad_out = torch.randn(b, t, hq, d, generator=g)

    def grads(sl):
        leaves = [x[sl].float().requires_grad_() for x in (q, k, v)]
        out = sn.dense_causal_attention(*leaves, d**-0.5)
        return torch.autograd.grad((out * grad_out[sl]).sum(), leaves)

    batch, alone = grads(slice(0, b)), grads(slice(2, 3))
    assert len(batch) == len(alone) == 3
    for full, one in zip(batch, alone, strict=True):
        assert torch.equal(full[2:3], one)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bs", [16, 32, 64])
def test_paged_attention_equals_dense(dtype, bs):
    """Mixed vLLM-style batch: a decode, a prefill chunk in the middle of a sequence, a fresh prefill; random block
    placement and NaN garbage in unused cache slots; vLLM 0.32's cache view (``[blocks, kv_heads, block_size,
    2 * head_dim]``, K and V the two halves of each token's content) at block sizes 16 (vLLM's CUDA default: a
    32-key chunk spans two blocks), 32 and 64."""
    g = torch.Generator().manual_seed(6)
    b, t, hq, hkv, d = 3, 70, 4, 2, 32
    q = torch.randn(b, t, hq, d, generator=g).to(dtype)
    k = torch.randn(b, t, hkv, d, generator=g).to(dtype)
    v = torch.randn(b, t, hkv, d, generator=g).to(dtype)
    dense = sn.dense_causal_attention(q, k, v, d**-0.5)
    per_seq = -(-t // bs)
    kv = torch.full((64 * 32 // bs, hkv, bs, 2 * d), float("nan")).to(dtype)
    kc, vc = kv.split(d, dim=-1)
    bt = torch.randperm(kv.shape[0], generator=g)[: b * per_seq].reshape(b, per_seq)
    for s in range(b):
        for p in range(t):
            kc[bt[s, p // bs], :, p % bs] = k[s, p]
            vc[bt[s, p // bs], :, p % bs] = v[s, p]
    qs = torch.cat([q[0, 69:70], q[1, 20:46], q[2, 0:11]])
    out = sn.paged_causal_attention(qs, kc, vc, torch.tensor([0, 1, 27, 38]), torch.tensor([70, 46, 11]), bt, d**-0.5)
    assert torch.equal(out, torch.cat([dense[0, 69:70], dense[1, 20:46], dense[2, 0:11]]))
    # vLLM's own metadata: int32, the block table the first columns of a wider persistent one (read in place)
    wide = torch.full((b + 2, per_seq + 5), -1, dtype=torch.int32)
    wide[:b, :per_seq] = bt
    out32 = sn.paged_causal_attention(
        qs,
        kc,
        vc,
        torch.tensor([0, 1, 27, 38], dtype=torch.int32),
        torch.tensor([70, 46, 11], dtype=torch.int32),
        wide[:b, :per_seq],
        d**-0.5,
    )
    assert torch.equal(out32, out)


def test_paged_attention_refuses_metadata_that_does_not_fit():
    """Metadata that does not describe the batch is refused with a clear error, never read past its end: query starts
    that do not cover the queries, a sequence longer than its block-table row, tensors of mismatched lengths."""
    g = torch.Generator().manual_seed(8)
    hq, hkv, d, bs = 4, 2, 16, 16
    kv = torch.randn(8, hkv, bs, 2 * d, generator=g)
    kc, vc = kv.split(d, dim=-1)
    q = torch.randn(5, hq, d, generator=g)
    bt = torch.arange(6).reshape(2, 3)
    ok = sn.paged_causal_attention(q, kc, vc, torch.tensor([0, 2, 5]), torch.tensor([10, 48]), bt, 0.25)
    assert ok.shape == q.shape
    with pytest.raises(ValueError, match="do not describe 5 queries"):
        sn.paged_causal_attention(q, kc, vc, torch.tensor([0, 2, 4]), torch.tensor([10, 48]), bt, 0.25)
    with pytest.raises(ValueError, match="do not describe 5 queries"):  # a start past Nq, then back: never written
        sn.paged_causal_attention(q, kc, vc, torch.tensor([0, 9, 5]), torch.tensor([20, 48]), bt, 0.25)
    with pytest.raises(ValueError, match="do not describe 5 queries"):  # more queries than the sequence holds
        sn.paged_causal_attention(q, kc, vc, torch.tensor([0, 2, 5]), torch.tensor([1, 48]), bt, 0.25)
    with pytest.raises(ValueError, match="reach past the block table"):
        sn.paged_causal_attention(q, kc, vc, torch.tensor([0, 2, 5]), torch.tensor([10, 49]), bt, 0.25)
    with pytest.raises(ValueError, match="do not fit one batch"):
        sn.paged_causal_attention(q, kc, vc, torch.tensor([0, 5]), torch.tensor([10, 48]), bt, 0.25)


def test_attention_backward_is_deterministic():
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 40, 4, 16, generator=g, requires_grad=True)
    k = torch.randn(2, 40, 2, 16, generator=g, requires_grad=True)
    v = torch.randn(2, 40, 2, 16, generator=g, requires_grad=True)
    grads = []
    for _ in range(2):
        q.grad = k.grad = v.grad = None
        sn.dense_causal_attention(q, k, v, 0.25).square().sum().backward()
        grads.append((q.grad.clone(), k.grad.clone(), v.grad.clone()))
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    ref_q = q.detach().clone().requires_grad_()
    torch.nn.functional.scaled_dot_product_attention(
        ref_q.transpose(1, 2),
        k.detach().transpose(1, 2),
        v.detach().transpose(1, 2),
        is_causal=True,
        scale=0.25,
        enable_gqa=True,
    ).transpose(1, 2).square().sum().backward()
    torch.testing.assert_close(grads[0][0], ref_q.grad, rtol=1e-4, atol=1e-5)
