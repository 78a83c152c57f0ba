"""Exact gradient accumulation (``shared_numerics.grad_chain``): a gradient element is one float32 chain over the
tokens, so any split of the tokens into consecutive calls gives the bits of one call on all of them. Negative
controls: the sum of per-call results (what autograd's accumulation into ``.grad`` does) and one library reduction
give other bits."""

from __future__ import annotations

import itertools

import pytest
import torch

from shared_numerics.gemm_cpu import CHAIN_K_MULTIPLE, f32_available, gemm_abt, gemm_abt_accumulate
from shared_numerics.grad_chain import GradChain, chain_available, chained_embedding
from zerokld_testing.controls import stock_differs

pytestmark = pytest.mark.timeout(300)

KERNELS = [
    pytest.param(torch.float32, marks=pytest.mark.requires_f32_kernel),
    pytest.param(torch.bfloat16, marks=pytest.mark.requires_amx),
]
# (rows of A, rows of B, token counts of the consecutive calls): several kernel work units, a few-rows shape, tails
SHAPES = [(1000, 530, [64, 96, 160]), (64, 40, [32, 64]), (300, 1024, [128, 384, 32]), (17, 9, [32, 32])]


@pytest.mark.parametrize("dtype", KERNELS)
@pytest.mark.parametrize("i_rows,j_rows,calls", SHAPES)
def test_consecutive_calls_continue_the_chain(dtype, i_rows, j_rows, calls, threads):
    g = torch.Generator().manual_seed(i_rows + j_rows)
    t = sum(calls)
    dy = torch.randn(t, i_rows, generator=g).to(dtype)  # token-major, as a backward has them
    x = (torch.randn(t, j_rows, generator=g) * torch.rand(t, 1, generator=g) * 30).to(dtype)
    one = gemm_abt_accumulate(torch.zeros(i_rows, j_rows), dy.t(), x.t())
    assert torch.equal(one, gemm_abt(dy.t(), x.t(), out_dtype=torch.float32))  # a chain from zero: the GEMM's bits
    acc, parts, s = torch.zeros(i_rows, j_rows), torch.zeros(i_rows, j_rows), 0
    for n in calls:
        gemm_abt_accumulate(acc, dy[s : s + n].t(), x[s : s + n].t())
        parts += gemm_abt(dy[s : s + n].t(), x[s : s + n].t(), out_dtype=torch.float32)
        s += n
    assert torch.equal(acc, one)
    if i_rows * j_rows > 1000:  # negative control: per-call results summed (autograd's accumulation)
        assert not torch.equal(parts, one)


@pytest.mark.parametrize("dtype", KERNELS)
def test_zero_tokens_add_nothing(dtype):
    """Padding and masked positions (``dY = 0``, any ``X``) between the tokens leave every chain's bits unchanged —
    for bf16 whole 32-token steps of them, as the trainer's layout pads each rollout to 32 positions."""
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(64, 200, generator=g).to(dtype), torch.randn(64, 300, generator=g).to(dtype)
    c, d = torch.randn(96, 200, generator=g).to(dtype), torch.randn(96, 300, generator=g).to(dtype)
    zero, junk = torch.zeros(64, 200).to(dtype), (torch.randn(64, 300, generator=g) * 1e4).to(dtype)
    plain = gemm_abt_accumulate(torch.zeros(200, 300), torch.cat([a, c]).t(), torch.cat([b, d]).t())
    padded = gemm_abt_accumulate(torch.zeros(200, 300), torch.cat([a, zero, c]).t(), torch.cat([b, junk, d]).t())
    assert torch.equal(plain, padded)


@pytest.mark.requires_f32_kernel
def test_float32_products_chain_any_token_count_of_bf16(threads):
    """An MoE expert's chain (``float32_products``): bf16 operands widened exactly, the float32 kernel's chain — any
    token counts per call (5, 7, 19: no 32-token steps), one call's bits, the stacked weight's ``part`` writing into
    its expert's slice. Negative control: without ``float32_products`` such counts are refused for bf16 on AMX (its
    kernel's 32-token steps; without AMX bf16 is upcast, so any count chains)."""
    g = torch.Generator().manual_seed(9)
    dy = torch.randn(31, 3, 40, generator=g).to(torch.bfloat16)  # tokens x experts x outputs
    x = torch.randn(31, 24, generator=g).to(torch.bfloat16)
    whole = GradChain((3, 40, 24), float32_products=True)
    whole.part(1).add_gemm(dy[:, 1].t(), x.t())
    split, s = GradChain((3, 40, 24), float32_products=True), 0
    for n in (5, 7, 19):
        split.part(1).add_gemm(dy[s : s + n, 1].t(), x[s : s + n].t())
        s += n
    assert torch.equal(split.acc, whole.acc) and not bool(whole.acc[1].eq(0).all())
    assert bool(whole.acc[0].eq(0).all()) and bool(whole.acc[2].eq(0).all())
    assert torch.equal(whole.acc[1], gemm_abt(dy[:, 1].float().t(), x.float().t()))
    from shared_numerics.linear import bf16_path

    if bf16_path() == "amx":  # the bf16 kernel: such counts are refused
        with pytest.raises(ValueError, match=f"multiples of {CHAIN_K_MULTIPLE}"):
            GradChain((40, 24)).add_gemm(dy[:7, 1].t(), x[:7].t())
    else:  # bf16 linears are upcast here, and so are their chains (any token count)
        plain = GradChain((40, 24))
        plain.add_gemm(dy[:7, 1].t(), x[:7].t())
        assert torch.equal(plain.acc, gemm_abt(dy[:7, 1].float().t(), x[:7].float().t()))


def test_accumulate_refuses_what_it_cannot_chain():
    # the checks run before any kernel: refused on every machine
    with pytest.raises(ValueError, match=f"multiples of {CHAIN_K_MULTIPLE}"):
        gemm_abt_accumulate(
            torch.zeros(4, 4), torch.ones(4, 33, dtype=torch.bfloat16), torch.ones(4, 33, dtype=torch.bfloat16)
        )
    with pytest.raises(TypeError, match="accumulator"):
        gemm_abt_accumulate(torch.zeros(4, 4, dtype=torch.float64), torch.ones(4, 8), torch.ones(4, 8))
    with pytest.raises(TypeError, match="accumulator"):
        gemm_abt_accumulate(torch.zeros(4, 5), torch.ones(4, 8), torch.ones(4, 8))


@pytest.mark.parametrize("rows", [1, 300, 32000], ids=["sum (norm, bias)", "300 rows", "32k rows (embedding)"])
def test_rows_enter_in_order(rows, threads):
    """``GradChain.add_rows`` (``index_add_`` on CPU) adds the source rows one after another in index order: the bits
    of a naive loop, and of any split into consecutive calls. Negative control: ``Tensor.sum`` over the rows."""
    g = torch.Generator().manual_seed(rows)
    t, h = 3000, 128
    src = torch.randn(t, h, generator=g) * torch.rand(t, 1, generator=g) * 100
    index = torch.randint(0, rows, (t,), generator=g) if rows > 1 else None
    whole = GradChain((rows, h) if rows > 1 else (h,))
    whole.add_rows(src, index)
    loop = torch.zeros(rows, h)
    for i in range(t):
        loop[0 if index is None else index[i]] += src[i]
    assert torch.equal(whole.acc.reshape(rows, h), loop)
    split = GradChain(whole.acc.shape)
    for s, e in ((0, 1000), (1000, 1001), (1001, t)):
        split.add_rows(src[s:e], None if index is None else index[s:e])
    assert torch.equal(split.acc, whole.acc)
    if rows == 1:
        assert not torch.equal(src.sum(0), whole.acc)
    with pytest.raises(ValueError, match="rows of 127"):
        whole.add_rows(src[:, :127], index)


def test_chained_embedding_gradient():
    """The embedding's gradient goes into the chain in token order (repeated ids included), none to autograd; the
    forward is ``F.embedding``."""
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    ids = torch.randint(0, 10, (4, 30), generator=g)
    chain = GradChain(weight.shape)
    out = chained_embedding(ids, weight, chain)
    assert torch.equal(out, torch.nn.functional.embedding(ids, weight))
    up = torch.randn(out.shape, generator=g)
    (out * up).sum().backward()
    assert weight.grad is None
    ref = torch.zeros(50, 16)
    for t, i in enumerate(ids.reshape(-1).tolist()):
        ref[i] += up.reshape(-1, 16)[t]
    assert torch.equal(chain.acc, ref)


def test_chain_available_follows_the_kernels():
    assert chain_available(torch.float32) == f32_available()
    assert not chain_available(torch.float16)


@pytest.mark.requires_f32_kernel
def test_recorded_additions_continue_another_ranks_chain(threads):
    """The data-parallel hand-off (:class:`titan_plugin.exact_accumulation.ExactAccumulation`): rank 1 records its
    additions (GEMM, rows, a norm's gain through its kernel) while rank 0 runs its own, then replays them into the sums
    rank 0 handed over: the bits of one rank running both halves in order. The recorded operands are copies: writing
    the caller's buffers after recording (a pipeline stage reuses its receive buffers) changes nothing. Negative
    control: the sum of the two halves' separate chains (FSDP's reduce-scatter) gives other bits."""
    from shared_numerics.grad_chain import replay
    from shared_numerics.norm import rms_norm

    g = torch.Generator().manual_seed(5)
    dy, x = torch.randn(192, 300, generator=g), torch.randn(192, 64, generator=g) * 30
    h = torch.randn(192, 64, generator=g) * 10
    gain = torch.rand(64, generator=g) + 0.5

    def run(chains, rows):
        chains[0].add_gemm(dy[rows].t(), x[rows].t())
        chains[1].add_rows(dy[rows, :64] * 7)
        hr = h[rows].clone().requires_grad_(True)
        rms_norm(hr, gain, 1e-6, weight_chain=chains[2]).backward(dy[rows, :64])
        return hr.grad

    first, second = slice(0, 96), slice(96, 192)
    one = [GradChain((300, 64)), GradChain((64,)), GradChain((64,))]
    run(one, first)
    dx_one = run(one, second)
    rank0 = [GradChain((300, 64)), GradChain((64,)), GradChain((64,))]
    run(rank0, first)
    log: list = []
    rank1 = [GradChain((300, 64), log=log), GradChain((64,), log=log), GradChain((64,), log=log)]
    saved = dy.clone()
    dx_rank1 = run(rank1, second)
    assert all(torch.equal(c.acc, torch.zeros_like(c.acc)) for c in rank1)  # nothing added yet
    assert torch.equal(dx_rank1, dx_one)  # the input gradient is computed at once
    dy[96:].normal_(generator=g)  # the caller's buffer is reused after recording
    for mine, handed in zip(rank1, rank0, strict=True):
        mine.acc.copy_(handed.acc)
    replay(log)
    assert not log
    for mine, ref in zip(rank1, one, strict=True):
        assert torch.equal(mine.acc, ref.acc)
    dy.copy_(saved)
    alone = [GradChain((300, 64)), GradChain((64,)), GradChain((64,))]
    run(alone, second)
    assert not torch.equal(rank0[0].acc + alone[0].acc, one[0].acc)


@pytest.mark.requires_f32_kernel
def test_mla_absorbed_weights_chain_grouping_invariant_gradients(threads):
    """MLA's absorbed weights (:mod:`shared_numerics.mla`, float32): ``kv_norm``'s gain and ``kv_b_proj`` — read as
    tensors, one linear per head for ``W_UK[h]ᵀ`` and one for ``W_UV[h]`` — go into chains (``kv_b``: one block per
    head and linear, :func:`shared_numerics.mla.kv_b_chain_shape`). One call on 40 tokens and calls on 13 + 27 leave
    the same bits; laid out as the weight (:func:`shared_numerics.mla.kv_b_grad_from_chain`) the sums are autograd's
    gradient on the whole batch within 1e-5 (Dn != Dv: the blocks are not mixed up). The forward bits are the
    unchained definition's. Negative control: autograd's gradients summed over 13 + 27 differ from one call's."""
    from shared_numerics.mla import MLADims, kv_b_chain_shape, kv_b_grad_from_chain, mla_output, mla_query_latent
    from shared_numerics.rope import rope_cos_sin

    d = MLADims(
        num_heads=3, kv_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24,
        rope_interleave=True, eps=1e-6,
    )  # fmt: skip
    g = torch.Generator().manual_seed(9)
    n, r, dn, dr, dv = 40, d.kv_lora_rank, d.qk_nope_head_dim, d.qk_rope_head_dim, d.v_head_dim
    q = torch.randn(n, d.num_heads * (dn + dr), generator=g)
    ckv = torch.randn(n, r + dr, generator=g) * 3
    norm = torch.rand(r, generator=g) + 0.5
    kv_b = torch.randn(d.num_heads * (dn + dv), r, generator=g) * 0.2
    cos, sin = rope_cos_sin(torch.arange(n), dr, 10000.0)
    up_q = torch.randn(n, d.num_heads, r + dr, generator=g)
    up_l = torch.randn(n, r + dr, generator=g)
    o_lat = torch.randn(n, d.num_heads, r + dr, generator=g)
    up_o = torch.randn(n, d.num_heads * dv, generator=g)

    def run(cuts, chains=None, params=(norm, kv_b)):
        kw = {} if chains is None else {"kv_norm_chain": chains[0], "kv_b_chain": chains[1]}
        outs = []
        for a, b in itertools.pairwise(cuts):
            # activations with gradients, as in a model (the weights' gradients go into the chains)
            qa, ca, oa = (t[a:b].clone().requires_grad_() for t in (q, ckv, o_lat))
            ql, lat = mla_query_latent(qa, ca, *params, cos[a:b], sin[a:b], d, **kw)
            o = mla_output(oa, params[1], d, kv_b_chain=kw.get("kv_b_chain"))
            torch.autograd.backward([ql, lat, o], [up_q[a:b], up_l[a:b], up_o[a:b]])
            outs.append(torch.cat([ql.flatten(1), lat, o], dim=1).detach())
        return torch.cat(outs)

    def chained(cuts):
        chains = (GradChain((r,)), GradChain(kv_b_chain_shape(d.num_heads, dn, dv, r)))
        out = run(cuts, chains)
        return out, chains[0].acc.clone(), kv_b_grad_from_chain(chains[1].acc, dn, dv)

    def autograd(cuts):
        params = (norm.clone().requires_grad_(), kv_b.clone().requires_grad_())
        out = run(cuts, params=params)
        return out, params[0].grad, params[1].grad

    whole, split = chained([0, n]), chained([0, 13, n])
    assert all(torch.equal(a, b) for a, b in zip(whole, split, strict=True))
    ref = autograd([0, n])
    assert torch.equal(whole[0], ref[0])  # the forward bits are the unchained definition's
    for mine, theirs in zip(whole[1:], ref[1:], strict=True):
        assert mine.shape == theirs.shape
        assert float((mine - theirs).abs().max()) <= 1e-5 * float(theirs.abs().max())
    summed = autograd([0, 13, n])
    stock_differs(
        any(not torch.equal(a, b) for a, b in zip(summed[1:], ref[1:], strict=True)),
        "autograd's MLA weight gradients summed over 13 + 27",
        "the tokens",
    )


@pytest.mark.requires_bf16_grad_chain
def test_bf16_weight_chain_takes_the_linears_bf16_path(threads):
    """``chained_weight_grad`` feeds ``add_gemm`` bf16 ``dY`` and ``X`` (TP's row-parallel linears, the MoE experts'
    tree). Where :func:`shared_numerics.linear.linear` takes bf16 to the float32 path (no AMX: AVX-512 or AVX2) the
    chain multiplies on the float32 kernel, as that linear's own chain: the bits of the widened operands' chain, not
    a refusal (there is no bf16 kernel there; FSDP 2 x TP 2 training in bf16 raised on AVX2). On AMX: the bf16
    kernel, consecutive calls one chain."""
    from shared_numerics.linear import bf16_path

    g = torch.Generator().manual_seed(9)
    dy, x = torch.randn(96, 40, generator=g).bfloat16(), torch.randn(96, 24, generator=g).bfloat16()
    one, two = GradChain((40, 24)), GradChain((40, 24))
    one.add_gemm(dy.t(), x.t())
    two.add_gemm(dy[:64].t(), x[:64].t())
    two.add_gemm(dy[64:].t(), x[64:].t())
    assert torch.equal(one.acc, two.acc)
    if bf16_path() != "amx":
        widened = GradChain((40, 24), float32_products=True)
        widened.add_gemm(dy.t(), x.t())
        assert torch.equal(one.acc, widened.acc)
