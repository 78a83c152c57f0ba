"""The ``triton`` numerics backend, proven on CPU with Triton's interpreter (``TRITON_INTERPRET=1``).

Per op: agreement with the torch backend (tolerance stated per op: the two backends reduce in different orders and
round intermediates differently), exact batch invariance, deterministic backward close to the torch backward. Then
the zero-KLD property with both sides on Triton: TorchTitan's model and a real vLLM engine, ``torch.equal``.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # conftest sets it first: before anything imports triton

import pytest  # noqa: E402
import torch  # noqa: E402

import shared_numerics as sn  # noqa: E402
from shared_numerics import ops_torch  # noqa: E402

T = pytest.importorskip("shared_numerics.ops_triton.table").OPS
R = ops_torch.OPS
DTYPES = [torch.float32, torch.bfloat16]
# Max |triton - torch| allowed, relative to max |torch|: fp32 — a few ulps of accumulated rounding; bf16 outputs —
# one bf16 ulp (2^-8 relative) where an fp32 intermediate lands on the other side of a bf16 rounding boundary.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7}


def _close(a, b, dtype):
    a, b = a.float(), b.float()
    assert (a - b).abs().max().item() <= TOL[dtype] * max(b.abs().max().item(), 1.0)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _attn_inputs(dtype, b=3, t=45, hq=4, hk=2, d=32):
    g = _gen(1)
    return [torch.randn(b, t, h, d, generator=g).to(dtype) for h in (hq, hk, hk)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_each_op_matches_torch_and_is_batch_invariant(dtype):
    g = _gen()
    x, w, bias = torch.randn(37, 200, generator=g).to(dtype), (torch.randn(150, 200, generator=g) * .05).to(dtype), \
        torch.randn(150, generator=g).to(dtype)
    y = T["linear"](x, w, bias)
    _close(y, R["linear"](x, w, bias), dtype)
    for sl in (slice(0, 1), slice(0, 5), slice(20, 37), slice(3, 35)):
        assert torch.equal(T["linear"](x[sl], w, bias), y[sl])

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
def test_attention_dense_paged_and_invariance(dtype):
    q, k, v = _attn_inputs(dtype)
    b, t, _, d = q.shape
    scale = d ** -0.5
    od = T["dense_causal_attention"](q, k, v, scale)
    _close(od, R["dense_causal_attention"](q, k, v, scale), dtype)
    # a shorter batch of one sequence: same rows
    assert torch.equal(T["dense_causal_attention"](q[1:2, :20], k[1:2, :20], v[1:2, :20], scale)[0], od[1, :20])
    # vLLM's paged cache, shuffled blocks of 16 (the triton kernel takes any block size), the last 7 tokens of each
    # sequence scheduled (chunked-prefill shape): bitwise the dense rows
    bs, per_seq = 16, (t + 15) // 16
    kc = torch.randn(b * per_seq + 3, 2, bs, d, generator=_gen(2)).to(dtype)  # never-written slots hold garbage
    vc = torch.randn(b * per_seq + 3, 2, bs, d, generator=_gen(3)).to(dtype)
    table = torch.randperm(b * per_seq + 3, generator=_gen(4))[: b * per_seq].reshape(b, per_seq)
    for s in range(b):
        for p in range(t):
            kc[table[s, p // bs], :, p % bs] = k[s, p]
            vc[table[s, p // bs], :, p % bs] = v[s, p]
    qs = torch.cat([q[s, t - 7:] for s in range(b)])
    op = T["paged_causal_attention"](qs, kc, vc, torch.tensor([0, 7, 14, 21]), torch.full((b,), t), table, scale)
    assert torch.equal(op, torch.cat([od[s, t - 7:] for s in range(b)]))


@pytest.mark.parametrize("granularity", ["per_channel", "block"])
def test_fp8_kernels(granularity):
    from shared_numerics.fp8 import quantize_fp8_activation
    from shared_numerics.ops_triton.fp8 import quantize_fp8_activation as triton_quantize

    g = _gen(5)
    x = torch.randn(37, 200, generator=g).to(torch.bfloat16)
    x[3] = 0.0
    x[4, :5] = torch.tensor([448.0, 1.0625, 1.1875, 2.0 ** -9 * 1.5, -1e-30])
    tq, ts = triton_quantize(x, granularity)
    rq, rs = quantize_fp8_activation(x, granularity)
    assert torch.equal(tq.float(), rq.float()) and torch.equal(ts, rs)  # the quantizer is exact across backends
    w = (torch.randn(150, 200, generator=g) * .05).to(torch.bfloat16)
    qw, sw = sn.quantize_fp8_weight(w, granularity)
    y = T["fp8_linear"](x, qw, sw, granularity)
    _close(y, R["fp8_linear"](x, qw, sw, granularity), torch.bfloat16)
    assert torch.equal(T["fp8_linear"](x[5:9], qw, sw, granularity), y[5:9])
    assert torch.equal(T["fp8_linear_qat"](x, w, granularity), y)
    x[0, 0] = float("nan")
    with pytest.raises(ValueError, match="inf or NaN"):
        triton_quantize(x, granularity)


def _grads(fn, args, up):
    args = [a.detach().clone().requires_grad_(a.is_floating_point()) for a in args]
    (fn(*args).float() * up).sum().backward()
    return [a.grad for a in args if a.is_floating_point()]


BACKWARD_CASES = {
    "linear": lambda g: ([torch.randn(37, 200, generator=g), torch.randn(150, 200, generator=g) * .05,
                          torch.randn(150, generator=g)], ()),
    "rms_norm": lambda g: ([torch.randn(7, 3, 64, generator=g), torch.randn(64, generator=g)], (1e-6,)),
    "apply_rope": lambda g: ([torch.randn(7, 4, 32, generator=g)], sn.rope_cos_sin(torch.arange(7), 32, 1e4)),
    "silu_and_mul": lambda g: ([torch.randn(9, 130, generator=g), torch.randn(9, 130, generator=g)], ()),
    "log_softmax": lambda g: ([torch.randn(6, 3000, generator=g)], ()),
    "selected_logprobs": lambda g: ([torch.randn(6, 3000, generator=g)], (torch.randint(0, 3000, (6,), generator=g),)),
    "dense_causal_attention": lambda g: (_attn_inputs(torch.float32, b=2), (32 ** -0.5,)),
    "fp8_linear_qat": lambda g: ([torch.randn(37, 200, generator=g), torch.randn(150, 200, generator=g) * .05], ()),
    "fused_selected_logprobs": lambda g: ([torch.randn(40, 64, generator=g), torch.randn(500, 64, generator=g) * .1],
                                          (torch.randint(0, 500, (40,), generator=g), 16)),
}


@pytest.mark.parametrize("op", sorted(BACKWARD_CASES))
def test_backward_close_to_torch_and_deterministic(op):
    """Gradients: within 1e-5 relative of the torch backend's (fp32), and bitwise repeatable."""
    args, extra = BACKWARD_CASES[op](_gen(6))
    up = torch.randn(R[op](*args, *extra).shape, generator=_gen(7))
    gt = _grads(lambda *a: T[op](*a, *extra), args, up)
    gr = _grads(lambda *a: R[op](*a, *extra), args, up)
    for a, b in zip(gt, gr):
        assert (a - b).abs().max().item() <= 1e-5 * max(b.abs().max().item(), 1.0)
    assert all(torch.equal(a, b) for a, b in zip(gt, _grads(lambda *a: T[op](*a, *extra), args, up)))


def test_fused_head_equals_unfused_on_triton():
    g = _gen(8)
    h, w, t = torch.randn(40, 64, generator=g), torch.randn(500, 64, generator=g) * .1, torch.randint(0, 500, (40,))
    assert torch.equal(T["fused_selected_logprobs"](h, w, t, 16), T["selected_logprobs"](T["linear"](h, w), t))


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
    from zerokld_testing.engines import start_llm

    ckpt = checkpoint_factory("qwen3", "float32")
    saved = os.environ.get("ZEROKLD_BACKEND")
    os.environ["ZEROKLD_BACKEND"] = "triton"
    try:
        llm = engine_slot.get(("zerokld-triton", ckpt),
                              lambda: start_llm(ckpt, dtype="float32", max_num_batched_tokens=64, max_model_len=256))
    finally:
        if saved is None:
            os.environ.pop("ZEROKLD_BACKEND")
        else:
            os.environ["ZEROKLD_BACKEND"] = saved
    return llm, ckpt


@pytest.mark.vllm
@pytest.mark.titan
def test_parity_matrix_both_sides_on_triton(triton_engine, monkeypatch):
    """Trainer (TorchTitan) and vLLM both on the Triton backend: sampled logprobs == trainer logprobs, alone vs in a
    batch, chunked prefill (64-token chunks) and a prefix-cache hit — all ``torch.equal``."""
    import random

    from vllm import SamplingParams

    from titan_plugin import trainer_logprobs
    from zerokld_testing.engines import completion_logprobs, prompt_logprobs

    llm, ckpt = triton_engine
    monkeypatch.setenv("ZEROKLD_BACKEND", "triton")
    rng = random.Random(0)
    prompts = [[1] + [rng.randrange(3, 100) for _ in range(rng.randrange(4, 110))] for _ in range(10)]
    sp = SamplingParams(max_tokens=8, temperature=1.0, logprobs=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
    train = trainer_logprobs(ckpt, seqs, [len(p) for p in prompts], dtype="float32")
    assert all(torch.equal(t, completion_logprobs(o)) for t, o in zip(train, outs))
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
    scored = llm.generate([{"prompt_token_ids": longest}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                          use_tqdm=False)[0]
    assert torch.equal(prompt_logprobs(scored, start=1), trainer_logprobs(ckpt, [longest], [1], dtype="float32")[0])
    # negative control: the torch backend's trainer logprobs are other bits (the two backends reduce differently)
    monkeypatch.setenv("ZEROKLD_BACKEND", "torch")
    torch_train = trainer_logprobs(ckpt, seqs, [len(p) for p in prompts], dtype="float32")
    assert any(not torch.equal(a, b) for a, b in zip(torch_train, train))


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
        out = trainer.rl_step(seqs, plens, [1.0, -1.0, 0.5], [r.clone() for r in ref])
        assert all(torch.equal(a, b) for a, b in zip(out["train_logprobs"], ref))
        after = trainer.forward_logprobs(seqs, plens)
        assert any(not torch.equal(a, b) for a, b in zip(after, ref))
        snap = trainer.save_hf(tmp_path / "step1", "bfloat16")
        assert all(torch.equal(a, b) for a, b in zip(trainer_logprobs(str(snap), seqs, plens, dtype="bfloat16"),
                                                      after))
    finally:
        trainer.close()
