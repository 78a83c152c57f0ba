"""Tensor-parallel-size invariance of the ops (``shared_numerics.tensor_parallel``, ``tp_k_block``): the same bits
at TP 1, 2 and 4, the ranks emulated in one process (each rank's shard, the gather stacking every rank's subtree
root); the engine's and the trainer's refusals of TP they cannot keep invariant."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
from torchtitan.config import ParallelismConfig

import shared_numerics as sn
from shared_numerics.mode import NumericsMismatchError, NumericsMode, check_same_numerics
from shared_numerics.tensor_parallel import (
    block_tree_sum,
    column_parallel_input_grad,
    k_block_partials,
    row_parallel_linear,
)
from tests.layouts.launch import K_BLOCK
from zerokld_testing.controls import stock_differs

pytestmark = pytest.mark.long  # minutes of TP 2 engines and trainers: `make test-long`


DTYPES = [torch.float32, torch.bfloat16]


def _shards(x, w, tp):
    k = x.shape[-1] // tp
    return [(x[:, r * k : (r + 1) * k], w[:, r * k : (r + 1) * k]) for r in range(tp)]


def _emulated_tp(x, w, b, tp, k_block=K_BLOCK):
    """Every rank's output of :func:`row_parallel_linear`; the gather returns all ranks' roots in rank order."""
    shards = _shards(x, w, tp)
    roots = torch.stack([block_tree_sum(k_block_partials(xs, ws, k_block)) for xs, ws in shards])
    return [
        row_parallel_linear(
            xs,
            ws,
            b,
            k_block=k_block,
            gather=lambda root, r=r: (torch.testing.assert_close(root[0], roots[r], rtol=0, atol=0), roots)[1],
        )
        for r, (xs, ws) in enumerate(shards)
    ]


def _stock_tp(x, w, b, tp):
    """What vLLM's ``RowParallelLinear`` / DTensor's ``RowwiseParallel`` compute: each rank's GEMM rounded to the
    activation dtype, then an all-reduce summing the ranks in order, then the bias."""
    parts = [sn.linear(xs, ws) for xs, ws in _shards(x, w, tp)]
    out = parts[0]
    for p in parts[1:]:
        out = out + p
    return out + b


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_row_parallel_sum_is_the_same_bits_at_tp_1_2_4_and_stock_is_not(dtype):
    g = torch.Generator().manual_seed(0)
    m, n, k = 37, 48, 192  # K = 12 blocks of 16: odd part 3, so TP 4 ranks each hold a 3-block run
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    tp1 = row_parallel_linear(x, w, b, k_block=K_BLOCK)
    assert tp1.dtype == dtype and tp1.shape == (m, n)
    for tp in (2, 4):
        for out in _emulated_tp(x, w, b, tp):
            assert torch.equal(out, tp1), f"TP {tp}"
    # row invariance holds too: one row alone is the same bits as inside the batch
    assert torch.equal(row_parallel_linear(x[5:6], w, b, k_block=K_BLOCK), tp1[5:6])
    # negative control: the stock row-parallel sum changes with the TP size
    stock = {tp: _stock_tp(x, w, b, tp) for tp in (1, 2, 4)}
    assert not torch.equal(stock[1], stock[2]) and not torch.equal(stock[1], stock[4])


def _input_grad(x, w, dy, k_block=K_BLOCK, gather=None):
    """``x``'s gradient through a column-parallel linear of ``w``'s rows with :func:`column_parallel_input_grad`."""
    xr = x.detach().requires_grad_()
    y = column_parallel_input_grad(sn.linear(xr.detach(), w), xr, w, k_block=k_block, gather=gather)
    y.backward(dy)
    return xr.grad


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_column_parallel_input_grad_is_the_same_bits_at_tp_1_2_4_and_stock_is_not(dtype):
    """The backward of a column-parallel linear sums ``dX = dY W`` over the output rows, which TP splits: with
    :func:`column_parallel_input_grad` the rows' ``k_block`` blocks add in the TP-aligned tree, each rank's blocks
    one subtree, so every rank of TP 2 and 4 (its rows, its slice of ``dY``, the ranks' roots gathered) has TP 1's
    ``dX`` bit for bit. Negative control: stock (each rank's ``dY_r W_r``, all-reduced) changes with the TP size."""
    g = torch.Generator().manual_seed(3)
    m, n, k = 37, 192, 48  # N = 12 blocks of 16: odd part 3, so TP 4 ranks each hold a 3-block run
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    dy = torch.randn(m, n, generator=g).to(dtype)
    tp1 = _input_grad(x, w, dy)
    assert tp1.dtype == dtype and tp1.shape == (m, k)
    for tp in (2, 4):
        rows = n // tp
        parts = [(w[r * rows : (r + 1) * rows], dy[:, r * rows : (r + 1) * rows]) for r in range(tp)]
        roots = torch.stack([block_tree_sum(k_block_partials(d, ws.t(), K_BLOCK)) for ws, d in parts])
        for r, (ws, d) in enumerate(parts):
            gather = lambda root, r=r: (torch.testing.assert_close(root[0], roots[r], rtol=0, atol=0), roots)[1]
            assert torch.equal(_input_grad(x, ws, d, gather=gather), tp1), f"TP {tp} rank {r}"
    # the forward is the linear's own; the gradient is dY W to rounding
    torch.testing.assert_close(
        tp1.float(), dy.float() @ w.float(), rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-3
    )

    def stock(tp):
        rows = n // tp
        parts = [sn.linear(dy[:, r * rows : (r + 1) * rows], w[r * rows : (r + 1) * rows].t()) for r in range(tp)]
        out = parts[0]
        for p in parts[1:]:
            out = out + p
        return out

    assert not torch.equal(stock(1), stock(2)) and not torch.equal(stock(1), stock(4))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_per_head_norm_gain_grad_is_the_same_bits_at_tp_1_2_and_one_chained_call_or_two(dtype):
    """Qwen3's q/k norms share one gain over the heads, which TP splits: with ``head_tree`` the gain's gradient is
    one float32 sum per head (rows in order), the heads added with the TP-aligned tree, so TP 2 (each rank its
    heads, the roots gathered) has TP 1's bits, and a per-head chain over two calls (13 + 27 tokens) the same.
    ``x``'s gradient and the forward are the plain norm's. Negative control: the plain norm's gain gradient, summed
    over the two head shards, is not TP 1's."""
    import shared_numerics.norm as sn_norm
    from shared_numerics.grad_chain import GradChain

    g = torch.Generator().manual_seed(5)
    b, t, heads, d = 2, 20, 8, 32
    x = torch.randn(b, t, heads, d, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype)
    dy = torch.randn(b, t, heads, d, generator=g).to(dtype)

    def run(xs, dys, gather=None, chain=None, head_tree=True):
        xr, wr = xs.detach().requires_grad_(), w.detach().requires_grad_(chain is None)
        y = sn_norm.rms_norm(xr, wr, 1e-6, weight_chain=chain, head_tree=head_tree, gather=gather)
        y.backward(dys)
        return y.detach(), xr.grad, wr.grad

    y1, dx1, dw1 = run(x, dy)
    y0, dx0, dw0 = run(x, dy, head_tree=False)
    assert torch.equal(y1, y0) and torch.equal(dx1, dx0)
    halves = [slice(0, heads // 2), slice(heads // 2, heads)]
    roots = []
    for h in halves:
        chain = GradChain((heads // 2, d))
        run(x[:, :, h], dy[:, :, h], chain=chain)
        roots.append(block_tree_sum(chain.acc))
    roots = torch.stack(roots)
    for r, h in enumerate(halves):
        gather = lambda root, r=r: (torch.testing.assert_close(root[0], roots[r], rtol=0, atol=0), roots)[1]
        y2, dx2, dw2 = run(x[:, :, h], dy[:, :, h], gather=gather)
        assert torch.equal(dw2, dw1) and torch.equal(dx2, dx1[:, :, h]) and torch.equal(y2, y1[:, :, h])
    chain = GradChain((heads, d))  # one chain per head over two calls: the tree at write time
    flat_x, flat_dy = x.reshape(b * t, heads, d), dy.reshape(b * t, heads, d)
    run(flat_x[:13], flat_dy[:13], chain=chain)
    run(flat_x[13:], flat_dy[13:], chain=chain)
    assert torch.equal(sn_norm.head_tree_gain_grad(chain.acc).to(dtype), dw1)
    torch.testing.assert_close(dw1.float(), dw0.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-4)
    plain = [run(x[:, :, h], dy[:, :, h], head_tree=False)[2] for h in halves]
    assert not torch.equal(plain[0] + plain[1], run(x, dy, head_tree=False)[2])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_moe_experts_same_bits_at_tp_1_2_4(dtype):
    """Tensor-parallel experts (each expert's intermediate size split over the ranks): with ``k_block`` every rank's
    output is the TP 1 bits; the stock split (each rank's expert outputs rounded, then summed) is not."""
    import shared_numerics.moe as sn_moe

    g = torch.Generator().manual_seed(2)
    n, h, inter, e, k = 29, 64, 64, 8, 2
    x = torch.randn(n, h, generator=g).to(dtype)
    router = torch.randn(e, h, generator=g).to(dtype)
    wg, wu, wd = (
        (torch.randn(*shape, generator=g) * 0.2).to(dtype) for shape in ((e, inter, h), (e, inter, h), (e, h, inter))
    )
    ref, ids = sn_moe.moe_forward(x, router, wg, wu, wd, k, k_block=K_BLOCK)

    def shard(q, tp):
        s = inter // tp
        return wg[:, q * s : (q + 1) * s], wu[:, q * s : (q + 1) * s], wd[:, :, q * s : (q + 1) * s]

    for tp in (2, 4):
        roots = []
        for q in range(tp):  # each rank's subtree roots, as its gather receives them
            captured = []
            sn_moe.moe_forward(
                x,
                router,
                *shard(q, tp),
                k,
                k_block=K_BLOCK,
                gather=lambda r: captured.append(r) or r.expand(tp, *r.shape[1:]),
            )
            roots.append(captured[0])
        stacked = torch.cat(roots)
        for q in range(tp):
            out, ids_q = sn_moe.moe_forward(x, router, *shard(q, tp), k, k_block=K_BLOCK, gather=lambda r: stacked)
            assert torch.equal(out, ref) and torch.equal(ids_q, ids)
    # negative control: stock tensor-parallel experts (each rank's block output in the activation dtype, summed)
    w = sn_moe.gather_route_weights(sn_moe._scores(sn.linear(x, router)), ids)
    stock = sum(sn_moe.moe_experts(x, ids, w, *shard(q, 2)).float() for q in range(2)).to(dtype)
    assert not torch.equal(stock, sn_moe.moe_forward(x, router, wg, wu, wd, k)[0])


@pytest.mark.timeout(60)
def test_column_shards_of_a_linear_are_its_columns():
    """Column-parallel layers (q/k/v, gate/up, the vocab-parallel lm_head) need no change: each output column is
    the same bits whichever other columns share the call."""
    g = torch.Generator().manual_seed(1)
    for dtype in DTYPES:
        x = torch.randn(23, 64, generator=g).to(dtype)
        w = torch.randn(101, 64, generator=g).to(dtype)  # an odd vocabulary: uneven shards
        full = sn.linear(x, w)
        for per in (51, 26):
            for s in range(0, 101, per):
                assert torch.equal(sn.linear(x, w[s : s + per]), full[:, s : s + per])


class _Exchange(torch.autograd.Function):
    """One emulated rank's all-gather: every thread's ``[1, ...]`` stacked in rank order; backward keeps the rank's
    own slice (as :class:`titan_plugin.tensor_parallel._GatherRoots`)."""

    @staticmethod
    def forward(ctx, x, rank, slots, barrier):
        ctx.rank = rank
        slots[rank] = x.detach()
        barrier.wait()
        out = torch.cat(list(slots))
        barrier.wait()  # every rank has read the slots before any writes the next call's
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.rank : ctx.rank + 1], None, None, None


def _lockstep(tp, fn):
    """``[fn(rank, gather) for rank in range(tp)]`` with the ranks as threads exchanging through ``gather``."""
    import threading

    barrier, slots, results, errors = threading.Barrier(tp, timeout=60), [None] * tp, [None] * tp, []

    def run(r):
        try:
            results[r] = fn(r, lambda x: _Exchange.apply(x, r, slots, barrier))
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def _megatron_logprobs(z, t, bounds):
    """Stock vocab-parallel log-probs (Megatron's ``_VocabParallelCrossEntropy``, torch's ``loss_parallel``): the
    global max, each rank's float32 ``sum(exp)`` over its slice, the partial sums all-reduced."""
    z = z.float()
    m = z.amax(-1, keepdim=True)
    total = None
    for lo, hi in pairwise(bounds):
        part = torch.exp(z[:, lo:hi] - m).sum(-1, keepdim=True)
        total = part if total is None else total + part
    return (z - m - torch.log(total)).gather(-1, t.unsqueeze(-1)).squeeze(-1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_vocab_parallel_log_softmax_same_bits_for_every_split_and_stock_is_not(dtype):
    """The vocab-parallel log-softmax (exact integer sum over the vocabulary): every rank of TP 2, 3, 4 (even and
    uneven slices, torch.chunk's and arbitrary) returns the full-vocabulary bits, and each rank's gradient is its
    slice of the full gradient, bitwise. Negative control: the stock split (float32 partial sums all-reduced)
    changes with the TP size."""
    import shared_numerics.vocab_parallel as vp

    g = torch.Generator().manual_seed(4)
    n = 48
    for vocab in (101, 4096):
        z = (torch.randn(n, vocab, generator=g) * 3).to(dtype)
        t = torch.randint(0, vocab, (n,), generator=g)
        w = torch.randn(n, generator=g)
        z_full = z.clone().requires_grad_()
        full = vp.selected_logprobs(z_full, t)
        (full * w).sum().backward()
        assert full.dtype == torch.float32
        assert torch.equal(full, vp.log_softmax(z)[torch.arange(n), t])
        torch.testing.assert_close(
            full.double(), torch.log_softmax(z.double(), -1)[torch.arange(n), t], rtol=0, atol=2e-6
        )
        splits = [[round(i * vocab / tp) for i in range(tp + 1)] for tp in (2, 3, 4)]
        splits += [[0, 7, vocab], [0, -(-vocab // 2), vocab]]  # a 7-wide slice; torch.chunk's ceil split
        for bounds in splits:
            tp = len(bounds) - 1

            def rank(r, gather, bounds=bounds):
                part = z[:, bounds[r] : bounds[r + 1]].clone().requires_grad_()
                lp = vp.selected_logprobs(part, t, vocab_start=bounds[r], vocab_size=vocab, gather=gather)
                (lp * w).sum().backward()
                return lp, part.grad

            for r, (lp, grad) in enumerate(_lockstep(tp, rank)):
                assert torch.equal(lp, full), f"V={vocab} split {bounds} rank {r}"
                assert torch.equal(grad, z_full.grad[:, bounds[r] : bounds[r + 1]]), f"grad V={vocab} {bounds} {r}"
        stock1 = _megatron_logprobs(z, t, [0, vocab])
        assert any(not torch.equal(stock1, _megatron_logprobs(z, t, b)) for b in splits[:3])


def _lm_head_case(seed: int, n: int, h: int, vocab: int, dtype):
    """Random ``hidden [n, h]``, lm_head ``weight [vocab, h]``, targets ``t``, per-row loss weights ``w``, and the
    unfused vocab-parallel reference: its inputs' leaf copies after ``(log-probs * w).sum()``'s backward and its
    log-probs."""
    import shared_numerics.vocab_parallel as vp

    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(vocab, h, generator=g) * 0.3).to(dtype)
    t = torch.randint(0, vocab, (n,), generator=g)
    w = torch.randn(n, generator=g)
    h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = vp.selected_logprobs(sn.linear(h_ref, w_ref), t)
    (ref * w).sum().backward()
    return hidden, weight, t, w, h_ref, w_ref, ref


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_fused_vocab_parallel_logprobs_equal_unfused_for_every_split(dtype):
    """The fused lm_head + vocab-parallel log-probs (rows in chunks, no ``[N, V]`` logits): bitwise the unfused
    vocab-parallel log-probs, on every rank of every split of the lm_head rows; its closed-form gradients (each rank's
    weight rows; the hidden states' gradient summed over the ranks) match autograd of the unfused path."""
    import shared_numerics.vocab_parallel as vp

    n, vocab = 37, 101
    hidden, weight, t, w, h_ref, w_ref, ref = _lm_head_case(5, n, 32, vocab, dtype)
    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for bounds in ([0, vocab], [0, 51, vocab], [0, 30, 64, vocab]):
        tp = len(bounds) - 1

        def rank(r, gather, bounds=bounds):
            hs = hidden.clone().requires_grad_()
            ws = weight[bounds[r] : bounds[r + 1]].clone().requires_grad_()
            lp = vp.fused_selected_logprobs(
                hs, ws, t, vocab_start=bounds[r], vocab_size=vocab, gather=gather if tp > 1 else None, chunk=16
            )
            (lp * w).sum().backward()
            return lp, hs.grad, ws.grad

        results = _lockstep(tp, rank)
        for r, (lp, _, grad_w) in enumerate(results):
            assert torch.equal(lp, ref), f"split {bounds} rank {r}"
            torch.testing.assert_close(grad_w.float(), w_ref.grad[bounds[r] : bounds[r + 1]].float(), **tol)
        torch.testing.assert_close(sum(gh.float() for _, gh, _ in results), h_ref.grad.float(), **tol)


@pytest.mark.timeout(120)
@pytest.mark.requires_f32_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_fused_vocab_parallel_backward_is_the_same_bits_at_every_split_and_grouping(dtype):
    """The fused vocab-parallel lm_head's backward under exact accumulation with ``k_block`` (issue 56 point 6 with
    the fused loss under TP): each rank's weight rows' gradient is a chain over the rows in order
    (``weight_chain``), so one call on 40 rows and two calls on 13 + 27 give the same chains, and TP 2 and 4 (each
    rank's rows) give TP 1's rows; the hidden states' gradient sums over the vocabulary in the TP-aligned tree, so
    every rank of every split holds TP 1's whole ``dh``. Both within float32 rounding of autograd's gradient of the
    unfused log-probs. Negative controls: without ``k_block`` the ranks' partial ``dh`` summed is not TP 1's; without
    chains two calls' weight gradients added are not one call's."""
    import shared_numerics.vocab_parallel as vp
    from shared_numerics.grad_chain import GradChain

    n, h, vocab = 40, 48, 128
    hidden, weight, t, w, h_ref, w_ref, _ = _lm_head_case(7, n, h, vocab, dtype)

    def backward(rows, ws, bounds, r, gather, chain, k_block=K_BLOCK):
        hs = hidden[rows].clone().requires_grad_()
        lp = vp.fused_selected_logprobs(
            hs, ws, t[rows], vocab_start=bounds[r], vocab_size=vocab, gather=gather, chunk=16,
            weight_chain=chain, k_block=k_block,
        )  # fmt: skip
        (lp * w[rows]).sum().backward()
        return hs.grad

    groupings = {"one call": [slice(0, n)], "13 + 27": [slice(0, 13), slice(13, n)]}
    by_split = {}
    for tp in (1, 2, 4):
        bounds = [r * vocab // tp for r in range(tp + 1)]

        def rank(r, gather, bounds=bounds, tp=tp):
            ws = weight[bounds[r] : bounds[r + 1]]
            out = {}
            for name, calls in groupings.items():
                chain = GradChain(ws.shape)
                dh = torch.cat([backward(c, ws, bounds, r, gather if tp > 1 else None, chain) for c in calls])
                out[name] = (chain.acc.clone(), dh)
            return out

        by_split[tp] = _lockstep(tp, rank)
    chain1, dh1 = by_split[1][0]["one call"]
    assert dh1.dtype == dtype and dh1.shape == (n, h)
    for tp, ranks in by_split.items():
        for name in groupings:
            chains = torch.cat([ranks[r][name][0] for r in range(tp)])
            assert torch.equal(chains, chain1), f"weight chains, TP {tp}, {name}"
            for r in range(tp):
                assert torch.equal(ranks[r][name][1], dh1), f"dh, TP {tp} rank {r}, {name}"
    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(chain1, w_ref.grad.float(), **tol)
    torch.testing.assert_close(dh1.float(), h_ref.grad.float(), **tol)

    # negative controls: the ranks' partial dh summed (no k_block); two calls' weight gradients added (no chain)
    def stock(tp):
        bounds = [r * vocab // tp for r in range(tp + 1)]

        def rank(r, gather):
            ws = weight[bounds[r] : bounds[r + 1]]
            return backward(slice(0, n), ws, bounds, r, gather, None, k_block=0)

        parts = _lockstep(tp, rank)
        out = parts[0].float()
        for p in parts[1:]:  # an all-reduce adding the ranks in order
            out = out + p.float()
        return out

    partial_sums_differ = any(not torch.equal(stock(1), stock(tp)) for tp in (2, 4))

    def added_grads(calls):
        ws = weight.clone().requires_grad_()
        for c in calls:
            hs = hidden[c].clone()
            (vp.fused_selected_logprobs(hs, ws, t[c], chunk=16) * w[c]).sum().backward()
        return ws.grad

    grouping_differs = not torch.equal(added_grads(groupings["one call"]), added_grads(groupings["13 + 27"]))
    stock_differs(partial_sums_differ, "the ranks' partial dh summed at TP 2 / 4 vs TP 1", "the seed or shapes")
    stock_differs(grouping_differs, "two calls' weight gradients added vs one call's", "the seed or shapes")


@pytest.mark.timeout(120)
def test_sampler_logprobs_follow_tp_k_block(monkeypatch):
    """vLLM's ``compute_logprobs`` is the vocab-parallel definition exactly when the process's zerokld model has
    ``tp_k_block``, the dense one for other zerokld models, vLLM's own otherwise (the engine tests cannot tell: the two
    definitions agree on almost every row, see :mod:`shared_numerics.vocab_parallel`). The seam is installed at
    registration; the model constructor only names the definition
    (:func:`vllm_plugin.sampler.set_logprobs_definition`)."""
    from vllm.v1.sample.sampler import Sampler

    import shared_numerics.vocab_parallel as vp
    from vllm_plugin import sampler, seams
    from vllm_plugin.register import register

    register()
    logits = torch.randn(3, 50)
    monkeypatch.setattr(vp, "log_softmax", lambda x: "vocab-parallel")
    monkeypatch.setattr(sn, "log_softmax", lambda x: "dense")
    before = sampler._LOGPROBS[0]
    try:
        sampler.set_logprobs_definition(True)
        assert Sampler.compute_logprobs(logits) == "vocab-parallel"
        sampler.set_logprobs_definition(False)
        assert Sampler.compute_logprobs(logits) == "dense"
        sampler.set_logprobs_definition(None)
        vllm_own = seams.installed()["vllm.v1.sample.sampler:Sampler.compute_logprobs"]
        assert torch.equal(Sampler.compute_logprobs(logits), vllm_own(logits))
    finally:
        sampler.set_logprobs_definition(before)


@pytest.mark.timeout(300)
def test_trainer_logprobs_follow_the_lm_head(checkpoint_factory, tmp_path, monkeypatch):
    """The trainer's unfused log-softmax is the one its model's lm_head names, in ``forward_logprobs``, in the RL
    step's loss and in a :meth:`~titan_plugin.RLTrainer.build_loss` loss: vocab-parallel exactly when the model was
    built with ``tp_k_block`` (one source, so the two paths cannot mix definitions; the engine tests cannot tell them
    apart, see :func:`test_sampler_logprobs_follow_tp_k_block`)."""
    import shared_numerics.vocab_parallel as vp
    from shared_numerics import RolloutBatch
    from titan_plugin.rl import RLTrainer, rl_trainer_config
    from zerokld_testing import random_prompts

    calls = []
    exact = vp.selected_logprobs
    monkeypatch.setattr(vp, "selected_logprobs", lambda *a, **k: calls.append(1) or exact(*a, **k))
    ckpt = checkpoint_factory("qwen3", "float32")
    seqs = random_prompts(2, seed=23, lo=8, hi=12)
    lens = [4, 5]
    seen = {}
    for k_block in (K_BLOCK, None):
        trainer = RLTrainer(rl_trainer_config(ckpt, str(tmp_path / f"d{k_block}"), dtype="float32", tp_k_block=k_block))
        try:
            assert trainer.loss_fn.lm_head is trainer.model.lm_head
            assert trainer.build_loss("ppo").lm_head is trainer.model.lm_head
            calls.clear()
            lps = trainer.forward_logprobs(RolloutBatch(seqs, lens))
            forward = len(calls)
            trainer.rl_step(
                RolloutBatch(seqs, lens, advantages=[1.0, -1.0], sampler_logprobs=lps, numerics=trainer.numerics)
            )
            seen[k_block] = (forward, len(calls) - forward)
        finally:
            trainer.close()
    assert seen[K_BLOCK][0] == len(seqs) and seen[K_BLOCK][1] == 1, seen  # per sequence; one call for the loss
    assert seen[None] == (0, 0), seen


@pytest.mark.timeout(60)
def test_vocab_parallel_log_softmax_edges():
    import shared_numerics.vocab_parallel as vp

    z = torch.randn(4, 10)
    z[1, 3] = float("nan")
    z[2] = float("-inf")
    z[3, 0] = float("inf")
    out = vp.log_softmax(z)
    assert torch.isfinite(out[0]).all() and out[1:].isnan().all()
    with pytest.raises(ValueError, match=r"token ids outside \[0, 10\)"):
        vp.selected_logprobs(z, torch.tensor([0, 1, 2, 10]))
    with pytest.raises(ValueError, match="a vocabulary of"):
        vp.selected_logprobs(z, torch.zeros(4, dtype=torch.long), vocab_size=vp.MAX_VOCAB)


@pytest.mark.timeout(60)
def test_block_tree_and_refusals():
    p = torch.arange(12, dtype=torch.float64).reshape(12, 1) + 1
    assert block_tree_sum(p).item() == 78
    x, w = torch.randn(3, 40), torch.randn(5, 40)
    with pytest.raises(ValueError, match="not a multiple of tp_k_block=16"):
        row_parallel_linear(x, w, k_block=16)
    x, w = torch.randn(3, 48), torch.randn(5, 48)
    with pytest.raises(ValueError, match="TP size 3 is not a power of two"):
        row_parallel_linear(x, w, k_block=16, gather=lambda r: r.expand(3, *r.shape[1:]))
    with pytest.raises(ValueError, match="tp_k_block"):
        NumericsMode(True, "torch", "bfloat16", tp_k_block=0)
    # the trainer and the engine must name the same block: a different one is a numerics mismatch
    ours = NumericsMode.build(True, "bfloat16", tp_k_block=16)
    with pytest.raises(NumericsMismatchError, match="tp_k_block=16"):
        check_same_numerics(ours, NumericsMode.build(True, "bfloat16", tp_k_block=32).to_dict(), "trainer", "rollout")
    with pytest.raises(NumericsMismatchError):
        check_same_numerics(ours, NumericsMode.build(True, "bfloat16").to_dict(), "trainer", "rollout")
    assert NumericsMode.from_dict(ours.to_dict()) == ours


@pytest.mark.timeout(60)
def test_engine_refuses_tp_it_cannot_keep_invariant():
    from vllm_plugin.support import _tp_problems
    from zerokld_models import ModelConfig

    cfg = ModelConfig(
        architecture="Qwen3ForCausalLM",
        vocab_size=101,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        rope_scaling=None,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    assert _tp_problems(2, 16, cfg, lora=False, fp8=False) == []
    assert "without tp_k_block" in " ".join(_tp_problems(2, None, cfg, lora=False, fp8=False))
    assert "power of two" in " ".join(_tp_problems(3, 16, cfg, lora=False, fp8=False))
    assert "down_proj K=128 not divisible" in " ".join(_tp_problems(4, 64, cfg, lora=False, fp8=False))
    assert "num_key_value_heads=2 not divisible" in " ".join(_tp_problems(4, 8, cfg, lora=False, fp8=False))
    assert "FP8" in " ".join(_tp_problems(1, 16, cfg, lora=False, fp8=True))
    # MLA (DeepSeek-V3): o_proj sums over heads x v_head_dim, the shared experts over n_shared x moe_intermediate_size;
    # no KV heads to split (one latent per token on every rank)
    import dataclasses

    mla = dataclasses.replace(
        cfg,
        architecture="DeepseekV3ForCausalLM",
        num_key_value_heads=1,
        kv_lora_rank=256,
        qk_nope_head_dim=32,
        qk_rope_head_dim=64,
        v_head_dim=24,
        num_experts=8,
        moe_intermediate_size=64,
        n_shared_experts=1,
        first_k_dense_replace=1,
    )
    assert _tp_problems(2, 16, mla, lora=False, fp8=False) == []
    assert "o_proj K=96 not divisible by tensor_parallel_size x tp_k_block = 64" in " ".join(
        _tp_problems(2, 32, mla, lora=False, fp8=False)
    )
    shared = " ".join(
        _tp_problems(
            2, 16, dataclasses.replace(mla, n_shared_experts=1, moe_intermediate_size=48), lora=False, fp8=False
        )
    )
    assert "shared experts' down_proj K=48" in shared and "experts' down_proj K=48" in shared


@pytest.mark.timeout(120)
def test_trainer_refuses_tp_k_block_where_not_implemented(checkpoint_factory, tmp_path):
    from shared_numerics.settings import ZeroKLDSettings
    from titan_plugin.models import titan_model_config
    from titan_plugin.rl import rl_trainer_config
    from zerokld_models import read_model_config

    with pytest.raises(ValueError, match="tp_k_block with fp8"):  # a settings rule, on both sides
        ZeroKLDSettings(fp8="per_channel", tp_k_block=16)
    with pytest.raises(ValueError, match="FP8 or LoRA"):  # the overrides' own guard, behind it
        titan_model_config(
            read_model_config(checkpoint_factory("qwen3", "float32")),
            ZeroKLDSettings.model_construct(fp8="per_channel", tp_k_block=16),
        )
    with pytest.raises(ValueError, match="needs tp_k_block"):
        rl_trainer_config(
            checkpoint_factory("qwen3", "float32"),
            "/nonexistent",
            parallelism=ParallelismConfig(tensor_parallel_degree=2),
        )
    # MLA: tp_k_block is built; DeepSeekMoE's TP-split experts are refused before any rank starts (TP x EP runs)
    from zerokld_testing.deepseek import make_deepseek_checkpoint

    ds = make_deepseek_checkpoint(tmp_path / "ds")
    titan_model_config(read_model_config(ds), ZeroKLDSettings(tp_k_block=16))
    with pytest.raises(ValueError, match="tensor_parallel_degree 2 on DeepSeekMoE: with expert_parallel_degree 2"):
        rl_trainer_config(
            str(ds), "/nonexistent", parallelism=ParallelismConfig(tensor_parallel_degree=2), tp_k_block=16
        )
