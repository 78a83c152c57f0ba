"""The parity matrix on a CUDA GPU: compiled Triton kernels, bitwise.

Run on a GPU machine (no vLLM or TorchTitan needed): ``ZEROKLD_CUDA_TESTS=1 python -m pytest -m cuda
tests/test_cuda.py``. Elsewhere every test here skips with one reason, the only skip the suite allows
(``tests/conftest.py``). The interpreter tests (``tests/test_triton_backend.py``) prove the same kernels' logic on
CPU; these prove the GPU's bits: per-row invariance of every op at LLM shapes, dense == paged attention at block sizes
16/32/64 across several 512-key splits, the split-KV launch == the in-program one, fused == unfused, deterministic
backward, and a model built from the op table whose continuous-batching engine equals its trainer token for token —
each with a stock PyTorch negative control that differs.
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.requires_cuda]

DEV = "cuda"
DTYPES = [torch.bfloat16, torch.float32]


def _g(seed):
    return torch.Generator(device=DEV).manual_seed(seed)


def _rand(*shape, dtype=torch.bfloat16, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=_g(seed), device=DEV) * scale).to(dtype)


@pytest.fixture(scope="module")
def T():
    import shared_numerics as sn

    return sn.active_ops(torch.empty(1, device=DEV))


def _table(backend: str) -> dict:
    """The op table of one CUDA backend: ``triton`` (persistent Triton GEMM) or ``cublas`` (fixed-shape cuBLAS
    calls; every other op is Triton's)."""
    if backend == "triton":
        from shared_numerics.ops_triton import OPS
    else:
        from shared_numerics.ops_cublas import OPS
    return OPS


@pytest.fixture(scope="module", params=["triton", "cublas"])
def G(request):
    """Each CUDA GEMM backend's op table in turn."""
    return _table(request.param)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float16])
def test_linear_rows_invariant_at_llm_shapes(G, dtype):
    """Rows of M = 1, 7, 64, 300 equal the same rows of M = 4096 (4096 -> 12288, the 151936-vocab lm_head, and
    large-K shapes: 4096 -> 4096, Llama-8B's down_proj 14336 -> 4096, 16384 -> 1024); cuBLAS F.linear does not
    (negative control: at least one shape differs — on an H200 with torch 2.11 the first two alone are row-invariant
    in bf16 and fp16, hence the large-K shapes, where cuBLAS may split K for small M)."""
    stock_differs = False
    for n, k in ((12288, 4096), (151936, 1024), (4096, 4096), (4096, 14336), (1024, 16384)):
        x = _rand(4096, k, dtype=dtype, seed=1)
        w = _rand(n, k, dtype=dtype, seed=2, scale=0.02)
        full = G["linear"](x, w)
        ref = torch.nn.functional.linear(x, w)
        for m in (1, 7, 64, 300):
            assert torch.equal(G["linear"](x[:m], w), full[:m])
            assert torch.equal(G["linear"](x[1000 : 1000 + m], w), full[1000 : 1000 + m])
            stock_differs |= not torch.equal(torch.nn.functional.linear(x[:m], w), ref[:m])
        assert (full.float() - ref.float()).abs().max() <= 0.05 * ref.float().abs().max()
    assert stock_differs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k_chunk", [None, 2048])
def test_linear_decode_tiles_give_the_persistent_bits(dtype, k_chunk):
    """The Triton GEMM's decode-size path (issue 57 point 1: one program per 64-row tile of every width it may pick,
    and with ``k_chunk`` per K chunk, the chunks' partials summed in order by a second kernel) gives the persistent
    path's rows bitwise at M = 1, 8, 64 — K 4096 and 12288, N 12288 and 4096 — so picking the path by M keeps rows
    invariant. Negative control: a different K chunking (the bits' definition) differs."""
    import dataclasses

    from shared_numerics.ops_triton import matmul as mm

    base = mm.CONFIGS[dtype]
    # a K-chunked persistent tile of 128 x 256 spills its two fp32 accumulators (zerokld_testing.triton_aot)
    cfg = base if k_chunk is None else dataclasses.replace(base, k_chunk=k_chunk, block_n=min(base.block_n, 128))
    other = dataclasses.replace(cfg, k_chunk=1024 if k_chunk else 2048, block_n=min(base.block_n, 128))
    for n, k in ((12288, 4096), (4096, 12288)):
        x = _rand(512, k, dtype=dtype, seed=1)
        w = _rand(n, k, dtype=dtype, seed=2, scale=0.02).t()
        full = mm.gemm(x, w, dtype, config=cfg, split=False)
        assert not torch.equal(mm.gemm(x, w, dtype, config=other, split=False), full)
        for m in (1, 8, 64):
            for bn in cfg.split_n:
                for rows in (slice(0, m), slice(300, 300 + m)):
                    assert torch.equal(mm.gemm(x[rows], w, dtype, config=cfg, split=True, split_n=bn), full[rows])


@pytest.mark.parametrize("dtype", DTYPES)
def test_lora_linear_rows_invariant_at_llm_shapes(G, dtype):
    """Multi-LoRA (issue 18): 4 adapters of rank 64 and base rows on a 4096 -> 4096 layer; rows alone and in a
    reordered batch give the co-batched bits; PEFT's arithmetic on cuBLAS (one F.linear per adapter group) differs
    (negative control)."""
    from benchmarks.op_model import STOCK_OPS

    x, w = _rand(2048, 4096, dtype=dtype, seed=1), _rand(4096, 4096, dtype=dtype, seed=2, scale=0.02)
    a, bb = _rand(4, 64, 4096, dtype=dtype, seed=3, scale=0.02), _rand(4, 4096, 64, dtype=dtype, seed=4, scale=0.1)
    s = torch.tensor([2.0, 0.5, 1.0, 0.25])
    ids = torch.randint(-1, 4, (2048,), generator=_g(5), device=DEV)
    full = G["lora_linear"](x, w, None, a, bb, s, ids)
    perm = torch.randperm(2048, generator=_g(6), device=DEV)
    assert torch.equal(G["lora_linear"](x[perm], w, None, a, bb, s, ids[perm]), full[perm])
    assert torch.equal(G["add_lora"](G["linear"](x, w), x, a, bb, s, ids), full)  # the engine's half

    def stock(rows):
        return STOCK_OPS["lora_linear"](x[rows], w, None, a, bb, s, ids[rows])

    ref = stock(slice(None))
    stock_differs = False
    for m in (1, 7, 64, 300):
        assert torch.equal(G["lora_linear"](x[:m], w, None, a, bb, s, ids[:m]), full[:m])
        stock_differs |= not torch.equal(stock(slice(0, m)), ref[:m])
    assert (full.float() - ref.float()).abs().max() <= 0.05 * ref.float().abs().max()
    assert stock_differs


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_logprobs_equal_unfused(G, dtype):
    """The lm_head + log-probs fused chunk by chunk == the unfused ops on the same backend (151936 vocab), rows alone
    too."""
    h, w = _rand(600, 1024, dtype=dtype, seed=26), _rand(151936, 1024, dtype=dtype, seed=27, scale=0.02)
    t = torch.randint(0, 151936, (600,), generator=_g(28), device=DEV)
    unfused = G["selected_logprobs"](G["linear"](h, w), t)
    assert torch.equal(G["fused_selected_logprobs"](h, w, t), unfused)
    assert torch.equal(G["fused_selected_logprobs"](h[5:8], w, t[5:8]), unfused[5:8])


@pytest.mark.parametrize("granularity", ["per_channel", "block"])
def test_fp8_linear_rows_invariant(T, granularity):
    import shared_numerics.fp8 as ref

    x = _rand(2048, 4096, seed=3)
    w = _rand(4096, 4096, seed=4, scale=0.02)
    qw, sw = T["quantize_fp8_weight"](w, granularity)
    full = T["fp8_linear"](x, qw, sw, granularity)
    for m in (1, 64, 300):
        assert torch.equal(T["fp8_linear"](x[:m], qw, sw, granularity), full[:m])
    assert torch.equal(T["fp8_linear_qat"](x, w, granularity), full)
    from shared_numerics.ops_triton.fp8 import quantize_fp8_activation

    tq, ts = quantize_fp8_activation(x, granularity)
    rq, rs = ref.quantize_fp8_activation(x, granularity)
    assert torch.equal(tq.float(), rq.float()) and torch.equal(ts, rs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_ops_invariant_and_fused_equals_unfused(T, dtype):
    import shared_numerics as sn

    x, r, w = _rand(4096, 4096, dtype=dtype, seed=5), _rand(4096, 4096, dtype=dtype, seed=6), _rand(4096, seed=7)
    s, y = T["add_rms_norm"](x, r, w, 1e-6)
    assert torch.equal(s, x + r) and torch.equal(y, T["rms_norm"](x + r, w, 1e-6))
    assert torch.equal(T["rms_norm"](x[5:6], w, 1e-6), T["rms_norm"](x, w, 1e-6)[5:6])
    q, wq = _rand(2048, 32, 128, dtype=dtype, seed=8), _rand(128, dtype=dtype, seed=9)
    cos, sin = sn.rope_cos_sin(torch.arange(2048, device=DEV), 128, 1e6)
    assert cos.is_cuda
    f = T["rms_norm_rope"](q, wq, 1e-6, cos, sin)
    assert torch.equal(f, T["apply_rope"](T["rms_norm"](q, wq, 1e-6), cos, sin))
    assert torch.equal(T["rms_norm_rope"](q[9:10], wq, 1e-6, cos[9:10], sin[9:10]), f[9:10])
    g, u = _rand(4096, 12288, dtype=dtype, seed=10), _rand(4096, 12288, dtype=dtype, seed=11)
    assert torch.equal(T["silu_and_mul"](g[3:4], u[3:4]), T["silu_and_mul"](g, u)[3:4])
    z = _rand(256, 151936, dtype=dtype, seed=12)
    assert torch.equal(T["log_softmax"](z[7:8]), T["log_softmax"](z)[7:8])


def _paged_cache(k, v, bs, seed):
    b, t, hk, d = k.shape
    per = -(-t // bs)
    n = b * per + 5
    kv = torch.full((n, hk, bs, 2 * d), float("nan"), device=DEV).to(k.dtype)
    kc, vc = kv.split(d, dim=-1)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[: b * per].reshape(b, per).to(DEV)
    pos = torch.arange(t, device=DEV)
    for s in range(b):
        kc[perm[s, pos // bs], :, pos % bs] = k[s]
        vc[perm[s, pos // bs], :, pos % bs] = v[s]
    return kc, vc, perm


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_dense_equals_paged_across_splits(T, dtype):
    """Contexts of 2100 keys (5 splits), 32 query / 8 kv heads, head_dim 128: decodes (split-KV + combine), prefill
    chunks across split boundaries (in-program merge), mixed batches, block sizes 16/32/64 — all bitwise the dense
    rows; close to SDPA."""
    b, t = 3, 2100
    q, k, v = (_rand(b, t, h, 128, dtype=dtype, seed=s) for h, s in ((32, 13), (8, 14), (8, 15)))
    od = T["dense_causal_attention"](q, k, v, 128**-0.5)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    ).transpose(1, 2)
    assert (od.float() - sdpa.float()).abs().max() < (0.05 if dtype == torch.bfloat16 else 1e-4)
    batches = [
        [(0, 2099, 2100), (1, 1500, 1501), (2, 511, 512), (2, 512, 513)],
        [(0, 1000, 1100), (1, 0, 600), (2, 2000, 2100)],
        [(1, 1023, 1024), (0, 480, 560), (2, 2099, 2100)],
    ]
    for bs in (16, 32, 64):
        kc, vc, table = _paged_cache(k, v, bs, seed=bs)
        for sched in batches:
            qs = torch.cat([q[s, a:e] for s, a, e in sched])
            qsl = torch.tensor([0] + [e - a for _, a, e in sched], device=DEV).cumsum(0).int()
            lens = torch.tensor([e for _, _, e in sched], device=DEV, dtype=torch.int32)
            rows = torch.tensor([s for s, _, _ in sched], device=DEV)
            want = torch.cat([od[s, a:e] for s, a, e in sched])
            for mql in (1, 10_000):  # both launch shapes
                out = T["paged_causal_attention"](qs, kc, vc, qsl, lens, table[rows], 128**-0.5, mql, 2100)
                assert torch.equal(out, want), (bs, sched, mql)


def test_true_divide_is_ieee_division_on_cuda():
    """FP8 scales and RoPE exponents divide by Python numbers through shared_numerics.reduce.true_divide: the CPU's
    bits on CUDA; plain ``x / 448.0`` on CUDA multiplies by the reciprocal (negative control: some quotient
    differs)."""
    from shared_numerics.reduce import true_divide

    x = _rand(1 << 20, dtype=torch.float32, seed=29).abs()
    cpu = x.cpu() / 448.0
    assert torch.equal(true_divide(x, 448.0).cpu(), cpu)
    assert not torch.equal((x / 448.0).cpu(), cpu)


def test_backward_is_deterministic(G):
    T = G
    q, k, v = (_rand(2, 1500, h, 128, seed=s).requires_grad_() for h, s in ((32, 16), (8, 17), (8, 18)))
    x, w = _rand(1024, 4096, seed=19).requires_grad_(), _rand(4096, 4096, seed=20, scale=0.02).requires_grad_()
    up = _rand(2, 1500, 32, 128, seed=21)
    grads = []
    for _ in range(2):
        for t in (q, k, v, x, w):
            t.grad = None
        (T["dense_causal_attention"](q, k, v, 0.088).float() * up.float()).sum().backward()
        T["linear"](x, w).float().square().sum().backward()
        grads.append([t.grad.clone() for t in (q, k, v, x, w)])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_sampler_on_cuda_rows_are_independent():
    from shared_numerics.sampling import sample_tokens

    z = _rand(64, 151936, dtype=torch.float32, seed=22)
    temp = torch.full((64,), 0.9, device=DEV)
    seeds, pos = torch.arange(64) * 7919, torch.arange(64) % 5
    top_k, top_p = torch.full((64,), 50, device=DEV), torch.full((64,), 0.9, device=DEV)
    full = sample_tokens(z, temp, seeds, pos, top_k, top_p)
    assert full.is_cuda
    for i in (0, 13, 63):
        one = sample_tokens(
            z[i : i + 1], temp[i : i + 1], seeds[i : i + 1], pos[i : i + 1], top_k[i : i + 1], top_p[i : i + 1]
        )
        assert torch.equal(one, full[i : i + 1])


@pytest.mark.parametrize("backend", ["triton", "cublas"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_op_model_trainer_equals_continuous_batching_engine(dtype, backend):
    """A Qwen3-style model (hidden 1024, 4 layers, 16/4 heads, head_dim 128) built from the op table: requests arrive
    over time, prefill chunks co-batched with decodes, 16-token blocks, prompts up to 1300 tokens (3 splits), 24
    generated tokens each — every engine log-prob == the trainer's; stock PyTorch differs."""
    from benchmarks.op_model import STOCK_OPS, OpModel, OpModelSpec, rollout

    spec = OpModelSpec(
        vocab_size=32000,
        hidden_size=1024,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=128,
        intermediate_size=3072,
        init_std=0.02,
    )
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 32000) for _ in range(rng.randrange(3, 1300))] for _ in range(24)]
    arrivals = [rng.randrange(0, 30) for _ in prompts]
    model = OpModel(spec, dtype, device=DEV, ops=_table(backend))
    res = rollout(model, prompts, 24, token_budget=512, block_size=16, arrivals=arrivals)
    assert res.mixed_steps > 0
    train = [model.trainer_logprobs([s])[0] for s in res.sequences[:12]] + model.trainer_logprobs(res.sequences[12:])
    assert len(train) == len(res.logprobs) == len(prompts)
    equal = sum(torch.equal(a[-24:], b) for a, b in zip(train, res.logprobs, strict=True))
    assert equal == len(prompts)
    stock = OpModel(spec, dtype, device=DEV, ops=STOCK_OPS)
    sres = rollout(stock, prompts, 24, token_budget=512, block_size=16, arrivals=arrivals)
    strain = stock.trainer_logprobs(sres.sequences)
    assert sum(torch.equal(a[-24:], b) for a, b in zip(strain, sres.logprobs, strict=True)) < len(prompts)


def test_losses_run_on_cuda_deterministically():
    from shared_numerics.losses import GSPOConfig, LossBatch, gspo_loss

    logp = _rand(4000, dtype=torch.float32, seed=23, scale=0.5) - 2
    q = logp + _rand(4000, dtype=torch.float32, seed=24, scale=0.01)
    adv = _rand(4000, dtype=torch.float32, seed=25)
    batch = LossBatch(torch.arange(4000, device=DEV) // 37, 4000 // 37 + 1)
    a, _ = gspo_loss(logp, q, adv, GSPOConfig(), batch)
    b, _ = gspo_loss(logp, q, adv, GSPOConfig(), batch)
    assert a.is_cuda and torch.equal(a, b)
