"""MoE numerics (shared_numerics.moe): lowest-id tie-break, batch invariance, invariance to expert load, replay."""

from __future__ import annotations

import itertools

import pytest
import torch

from shared_numerics import linear
from shared_numerics.moe import gather_route_weights, moe_experts, route_topk
from zerokld_testing.controls import stock_differs

DTYPES = [torch.float32, torch.bfloat16]


def _experts(e=6, h=32, i=48, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*s, generator=g) * 0.1).to(dtype) for s in ((e, i, h), (e, i, h), (e, h, i))]


def test_exact_ties_go_to_the_lowest_expert_id():
    logits = torch.tensor([[0.5, 2.0, 2.0, 1.0, 2.0], [3.0, 3.0, 3.0, 3.0, 3.0]])
    ids, w = route_topk(logits, k=2)
    assert ids.tolist() == [[1, 2], [0, 1]]
    assert torch.topk(logits, 2).indices.tolist() != ids.tolist()  # negative control: stock topk picks others
    assert torch.equal(w[1], torch.tensor([0.5, 0.5]))
    with pytest.raises(ValueError, match="top-k"):
        route_topk(logits, k=6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_routing_and_experts_are_batch_and_load_invariant(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 32, generator=g).to(dtype)
    router = (torch.randn(6, 32, generator=g) * 0.5).to(dtype)
    router[4] = router[1]  # duplicated expert rows: ties in every token's scores ...
    wg, wu, wd = _experts(dtype=dtype)
    logits = linear(x, router).float()
    # ... made exact: a CPU GEMM may round two equal weight rows' columns differently (vector lanes vs tail; measured
    # on an AMD EPYC with torch's CPU BLAS), and this test is about the tie-break, not about the GEMM
    logits[:, 4] = logits[:, 1]
    ids, w = route_topk(logits, k=2)
    assert not bool(((ids == 4).any(1) & ~(ids == 1).any(1)).any())  # 4 never wins over its twin 1
    y = moe_experts(x, ids, w, wg, wu, wd)
    assert y.dtype == dtype
    for sl in (slice(0, 1), slice(7, 8), slice(3, 30)):
        i2, w2 = route_topk(logits[sl], k=2)
        assert torch.equal(i2, ids[sl]) and torch.equal(w2, w[sl])
        assert torch.equal(moe_experts(x[sl], i2, w2, wg, wu, wd), y[sl])
    # one expert receives 200 more tokens: the first 40 rows do not move
    crowd = torch.cat([x, x[:1].repeat(200, 1)])
    crowd_ids = torch.cat([ids, torch.tensor([[0, 3]]).repeat(200, 1)])
    crowd_w = torch.cat([w, w[:1].repeat(200, 1)])
    assert torch.equal(moe_experts(crowd, crowd_ids, crowd_w, wg, wu, wd)[:40], y)
    # negative control: the stock per-expert loop (HF's reference MoE: each expert's tokens through F.linear) gives a
    # token alone other bits than in the batch in fp32 (one token per expert: MKL's GEMV, not its GEMM). Stock holds
    # too on this machine for the crowded expert (GEMMs of 2+ rows keep each row's bits) and in bf16 (ATen's CPU
    # bf16 linear is row-invariant here): those claims are only proven where stock differs (GPU, tests/test_cuda.py)
    stock = _stock_moe(x, ids, w, wg, wu, wd)
    alone = [_stock_moe(x[i : i + 1], ids[i : i + 1], w[i : i + 1], wg, wu, wd) for i in (0, 7, 21)]
    if dtype == torch.float32:
        stock_differs(
            any(not torch.equal(a, stock[i : i + 1]) for a, i in zip(alone, (0, 7, 21), strict=True)),
            "float32 MoE experts (F.linear) of a token alone vs in the batch",
            "the shapes",
        )


def _stock_moe(x, ids, w, wg, wu, wd):
    """The reference MoE loop of HF ``Qwen3MoeSparseMoeBlock``: each expert's tokens gathered, run, scattered back."""
    F = torch.nn.functional
    out = torch.zeros(x.shape, dtype=torch.float32)
    for e in range(wg.shape[0]):
        rows, slot = torch.nonzero(ids == e, as_tuple=True)
        if rows.numel():
            xe = x[rows]
            ye = F.linear(F.silu(F.linear(xe, wg[e])) * F.linear(xe, wu[e]), wd[e])
            out.index_add_(0, rows, ye.float() * w[rows, slot, None].float())
    return out.to(x.dtype)


def test_matches_a_per_token_reference_and_replay_keeps_gradients():
    from shared_numerics import linear, silu_and_mul

    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, 32, generator=g)
    wg, wu, wd = _experts()
    logits = torch.randn(9, 6, generator=g, requires_grad=True)
    ids, w = route_topk(logits, k=3)
    y = moe_experts(x, ids, w, wg, wu, wd)
    for n in range(9):
        acc = None
        for j in range(3):
            e = int(ids[n, j])
            xe = x[n : n + 1]
            part = linear(silu_and_mul(linear(xe, wg[e]), linear(xe, wu[e])), wd[e]).float() * w[n, j]
            acc = part if acc is None else acc + part
        assert torch.equal(acc[0], y[n])
    # replay: recorded ids, weights from the current scores; gradients reach the router logits
    scores = torch.softmax(logits.float(), -1)
    y2 = moe_experts(x, ids, gather_route_weights(scores, ids), wg, wu, wd)
    y2.sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_moe_forward_replay_rows_and_errors():
    from shared_numerics.moe import moe_forward

    g = torch.Generator().manual_seed(3)
    x = torch.randn(10, 32, generator=g)
    router = torch.randn(6, 32, generator=g, requires_grad=True)
    wg, wu, wd = _experts()
    y, ids = moe_forward(x, router, wg, wu, wd, top_k=2)
    y_same, ids_same = moe_forward(x, router, wg, wu, wd, 2, expert_ids=ids)
    assert torch.equal(y_same, y) and torch.equal(ids_same, ids)  # replaying its own routes changes nothing
    other = (ids + 1) % 6
    mixed = torch.where(torch.arange(10).unsqueeze(1) < 5, other, torch.full_like(ids, -1))
    y_mixed, used = moe_forward(x, router, wg, wu, wd, 2, expert_ids=mixed)
    assert torch.equal(used[:5], other[:5]) and torch.equal(used[5:], ids[5:])  # -1 rows routed afresh
    assert torch.equal(y_mixed[5:], y[5:]) and not torch.equal(y_mixed[:5], y[:5])
    y_mixed.sum().backward()
    assert router.grad is not None and router.grad.abs().sum() > 0  # gate weights still train under replay
    with pytest.raises(ValueError, match="shape"):
        moe_forward(x, router, wg, wu, wd, 2, expert_ids=ids[:, :1])
    with pytest.raises(ValueError, match="outside"):
        moe_forward(x, router, wg, wu, wd, 2, expert_ids=torch.full_like(ids, 6))


def test_tie_checkpoint_ties_decide_the_last_slot_in_the_trainer(checkpoint_factory):
    """The ``qwen3_moe_ties`` checkpoint (router rows duplicated in pairs, top-3): in TorchTitan's real forward every
    token's third expert is chosen between two exactly equal scores, and the lower id wins."""
    from shared_numerics import linear
    from titan_plugin.models import build_titan_model
    from titan_plugin.routing import captured_routes

    ckpt = checkpoint_factory("qwen3_moe_ties", "float32")
    model, _, _ = build_titan_model(ckpt, dtype="float32")
    seen = {}
    layer = model.layers["0"].moe
    hook = layer.register_forward_hook(lambda m, args, out: seen.setdefault("x", args[0].detach()))
    tokens = torch.randint(3, 100, (2, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        model(tokens)
    hook.remove()
    ids = captured_routes(model)[:, :, 0].reshape(-1, 3)
    scores = torch.softmax(linear(seen["x"].reshape(-1, seen["x"].shape[-1]), layer.router.gate.weight).float(), -1)
    third = scores.gather(1, ids[:, 2:3])
    twin = scores.gather(1, ids[:, 2:3] ^ 1)
    assert torch.equal(third, twin)  # the third slot is always half of an exactly tied pair...
    assert bool((ids[:, 2] % 2 == 0).all())  # ...and the lower (even) id of the pair wins


@pytest.mark.parametrize("granularity", ["per_channel", "block"])
def test_fp8_experts_qat_forward_is_the_served_codes_and_rows_are_invariant(granularity):
    """FP8 experts (each expert's weight quantized alone): the QAT forward (high-precision weights quantized on the
    fly, straight-through gradients) equals the served codes' forward bit for bit; a token's row does not depend on
    the batch or on its experts' load; the gradient reaches the stacked weights. Negative control: the bf16 experts
    differ from the FP8 ones."""
    from shared_numerics import quantize_fp8_weight

    ws = [w.requires_grad_() for w in _experts(e=4, h=160, i=136, dtype=torch.bfloat16, seed=4)]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(24, 160, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(24)])
    ids[:12, 0] = 1  # expert 1 gets most tokens
    weights = torch.rand(24, 2, generator=g)
    qat = moe_experts(x, ids, weights, *ws, fp8=granularity)
    codes, scales = [], []
    for w in ws:
        per = [quantize_fp8_weight(w[e].detach(), granularity) for e in range(w.shape[0])]
        codes.append(torch.stack([q for q, _ in per]))
        scales.append(torch.stack([s for _, s in per]))
    served = moe_experts(x, ids, weights, *codes, fp8=granularity, scales=tuple(scales))
    assert torch.equal(qat, served)
    alone = moe_experts(x[7:9], ids[7:9], weights[7:9], *codes, fp8=granularity, scales=tuple(scales))
    assert torch.equal(alone, served[7:9])
    assert not torch.equal(moe_experts(x, ids, weights, *ws), qat)
    qat.float().square().sum().backward()
    assert all(w.grad is not None and bool(w.grad.abs().sum() > 0) for w in ws)
    with pytest.raises(ValueError, match="k_block"):
        moe_experts(x, ids, weights, *ws, fp8=granularity, k_block=32)
    with pytest.raises(ValueError, match="without an FP8"):
        moe_experts(x, ids, weights, *codes, scales=tuple(scales))


def test_fp8_weight_qat_is_the_served_dequantized_weight_with_a_straight_through_gradient():
    """MLA's absorbed ``kv_b_proj`` under FP8: the trainer's fake-quantized weight equals what the server
    dequantizes from the codes (in the model dtype), and its gradient passes through unchanged."""
    from shared_numerics.fp8 import fp8_weight_qat, quantize_fp8_weight, served_fp8_weight

    w = (torch.randn(192, 136, generator=torch.Generator().manual_seed(2)) * 0.05).to(torch.bfloat16).requires_grad_()
    fq = fp8_weight_qat(w, "block")
    assert fq.dtype == torch.bfloat16
    assert torch.equal(fq, served_fp8_weight(*quantize_fp8_weight(w.detach(), "block"), "block", torch.bfloat16))
    assert not torch.equal(fq, w)  # the quantization is real
    up = torch.randn(192, 136, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    fq.backward(up)
    assert torch.equal(w.grad, up)


class _Mailbox:
    """An in-process stand-in for the EP group's all-to-all between ``size`` threads (each thread one rank):
    rank ``r`` puts its split rows, waits for every rank, takes the ``r``-th split of each. Differentiable: the
    backward is the reverse exchange, as torch's ``all_to_all_single_autograd``."""

    def __init__(self, size: int) -> None:
        import threading

        self.size, self.barrier, self.slots = size, threading.Barrier(size), {}

    def exchange(self, rank: int, t: torch.Tensor, output_splits, input_splits) -> torch.Tensor:
        box = self

        class A2A(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return box._swap(rank, x, input_splits)

            @staticmethod
            def backward(ctx, g):
                return box._swap(rank, g.contiguous(), output_splits)

        if output_splits is None:  # the counts: one value per rank
            return self._swap(rank, t, [1] * self.size)
        return A2A.apply(t)

    def _swap(self, rank: int, t: torch.Tensor, splits) -> torch.Tensor:
        self.barrier.wait()
        self.slots[rank] = list(torch.split(t, list(splits)))
        self.barrier.wait()
        out = torch.cat([self.slots[src][rank] for src in range(self.size)])
        self.barrier.wait()
        return out


def _run_ranks(size: int, fn) -> dict:
    """``{rank: fn(rank, exchange)}`` with ``size`` threads as ranks, ``exchange`` their :class:`_Mailbox` all-to-all
    (what :class:`shared_numerics.moe.ExpertParallel` takes); an error on any rank is raised here."""
    import threading

    box, results, errors = _Mailbox(size), {}, []

    def rank(r):
        try:
            results[r] = fn(r, lambda t, o, i: box.exchange(r, t, o, i))
        except Exception as e:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(e)
            box.barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    return results


@pytest.mark.parametrize("top_k", [2, 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_expert_parallel_is_one_ranks_bits_and_gradients(dtype, top_k):
    """:class:`shared_numerics.moe.ExpertParallel` with 2 ranks (threads exchanging through an in-process
    all-to-all), each holding 3 of 6 experts and its own tokens: every output row equals one rank's over the two
    batches concatenated, and each expert's weight gradient too (one GEMM over its rows in the order received: rank
    0's, then rank 1's — the single rank's order); the tokens' gradients are their own, each token's slots added in
    slot order wherever its experts ran (top-3: three terms, whose order counts). Negative control: one rank's
    gradient over the batches in the other order (rank 1's first) differs, so the order is what makes it equal."""

    from shared_numerics.moe import ExpertParallel

    w = [t.requires_grad_() for t in _experts(e=6, h=64, i=96, dtype=dtype, seed=7)]
    g = torch.Generator().manual_seed(8)
    xs = [torch.randn(n, 64, generator=g).to(dtype) for n in (11, 17)]
    ids = [torch.stack([torch.randperm(6, generator=g)[:top_k] for _ in range(x.shape[0])]) for x in xs]
    ws = [torch.rand(x.shape[0], top_k, generator=g) for x in xs]
    ups = [torch.randn(x.shape[0], 64, generator=g).to(dtype) for x in xs]

    def one_rank(order):
        params = [p.detach().clone().requires_grad_() for p in w]
        x = torch.cat([xs[i] for i in order]).requires_grad_()
        out = moe_experts(x, torch.cat([ids[i] for i in order]), torch.cat([ws[i] for i in order]), *params)
        out.backward(torch.cat([ups[i] for i in order]))
        return out, x.grad, [p.grad for p in params]

    ref_out, ref_dx, ref_dw = one_rank([0, 1])
    local = [[p.detach()[r * 3 : (r + 1) * 3].clone().requires_grad_() for p in w] for r in range(2)]

    def rank(r, exchange):
        x = xs[r].clone().requires_grad_()
        out = moe_experts(x, ids[r], ws[r], *local[r], expert_parallel=ExpertParallel(r, 2, exchange))
        out.backward(ups[r])
        return out, x.grad

    results = _run_ranks(2, rank)
    assert torch.equal(torch.cat([results[0][0], results[1][0]]), ref_out)
    assert torch.equal(torch.cat([results[0][1], results[1][1]]), ref_dx)
    for k in range(3):  # each stacked weight: rank r's experts are rows [3r, 3r + 3)
        assert torch.equal(torch.cat([local[0][k].grad, local[1][k].grad]), ref_dw[k])
    _, _, swapped = one_rank([1, 0])
    stock_differs(
        any(not torch.equal(a, b) for a, b in zip(swapped, ref_dw, strict=True)),
        "an expert's weight gradient over the same rows in another order",
        "the token counts",
    )
    with pytest.raises(ValueError, match="k_block"):
        moe_experts(  # tensor-parallel experts (I split, roots gathered) with EP: not implemented
            xs[0], ids[0], ws[0], *w, k_block=32, gather=lambda root: root, expert_parallel=ExpertParallel(0, 1, None)
        )


def _gather_rows(r: int, exchange):
    """Rank ``r`` of 2's ``gather_rows`` for :class:`shared_numerics.moe.ExpertParallel` over :func:`_run_ranks`'
    ``exchange``: every rank's rows in rank order; the backward keeps this rank's slice."""

    class GatherRows(torch.autograd.Function):
        @staticmethod
        def forward(ctx, rows, sizes):
            ctx.start, ctx.stop = sum(sizes[:r]), sum(sizes[: r + 1])
            return exchange(torch.cat([rows] * 2), sizes, [rows.shape[0]] * 2).detach()

        @staticmethod
        def backward(ctx, grad):
            return grad[ctx.start : ctx.stop], None

    return GatherRows.apply


@pytest.mark.parametrize("k_block", [None, 32])
@pytest.mark.parametrize("dtype", DTYPES)
def test_expert_parallel_over_replicated_tokens_is_one_ranks_bits(dtype, k_block):
    """TP x EP (:class:`shared_numerics.moe.ExpertParallel` with ``gather_rows``): both ranks hold the same 28 tokens
    and 3 of 6 experts each; each rank exchanges only its share of the tokens' rows (the first 14 tokens on rank 0,
    the rest on rank 1) and all-gathers the outputs. Every rank's output equals one rank's bit for bit (with
    ``k_block``: TP 1's down-projection tree), the ranks' input gradients (each its share's, exact zeros elsewhere)
    sum to one rank's, and each expert's weight gradient is one rank's (each expert's gradient counted once).
    Negative control: without the share (every rank exchanging every token) the weight gradients double."""
    from shared_numerics.moe import ExpertParallel

    w = [t.requires_grad_() for t in _experts(e=6, h=64, i=96, dtype=dtype, seed=9)]
    g = torch.Generator().manual_seed(10)
    x0 = torch.randn(28, 64, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(28)])
    ws = torch.rand(28, 2, generator=g)
    up = torch.randn(28, 64, generator=g).to(dtype)

    params = [p.detach().clone().requires_grad_() for p in w]
    x = x0.clone().requires_grad_()
    ref = moe_experts(x, ids, ws, *params, k_block=k_block)
    ref.backward(up)
    ref_dx, ref_dw = x.grad, [p.grad for p in params]

    def run(share: bool):
        local = [[p.detach()[r * 3 : (r + 1) * 3].clone().requires_grad_() for p in w] for r in range(2)]

        def rank(r, exchange):
            ep = ExpertParallel(r, 2, exchange, _gather_rows(r, exchange) if share else None)
            xr = x0.clone().requires_grad_()
            out = moe_experts(xr, ids, ws, *local[r], k_block=k_block, expert_parallel=ep)
            out.backward(up)
            return out, xr.grad

        results = _run_ranks(2, rank)
        return results, [torch.cat([local[0][k].grad, local[1][k].grad]) for k in range(3)]

    results, dw = run(share=True)
    assert torch.equal(results[0][0], ref) and torch.equal(results[1][0], ref)
    assert torch.equal(results[0][1] + results[1][1], ref_dx)
    assert all(torch.equal(a, b) for a, b in zip(dw, ref_dw, strict=True))
    _, doubled = run(share=False)
    stock_differs(
        any(not torch.equal(a, b) for a, b in zip(doubled, ref_dw, strict=True)),
        "every rank exchanging every replicated token",
        "the token counts",
    )


@pytest.mark.requires_f32_kernel
def test_whole_expert_chains_with_k_block_are_one_ranks_under_tp_x_ep():
    """Exact accumulation of whole experts with ``k_block`` (TP x EP, ``tp_k_block``; float32): the down projection
    sums in the TP-invariant tree and its chain takes ``dYᵀ act`` of the tree's root
    (:func:`shared_numerics.grad_chain.chained_weight_grad`). On one rank one call on 28 tokens and calls on 11 + 17
    leave the same chains; on two ranks holding the same tokens and 3 of 6 experts each (each exchanging its share of
    the rows, ``gather_rows``), each rank's experts' chains after the same two calls are one rank's slices, bit for
    bit; the chains are autograd's gradient within 1e-5. Negative control: autograd's gradients summed over 11 + 17
    differ from one call's."""
    from shared_numerics.grad_chain import GradChain
    from shared_numerics.moe import ExpertParallel

    w, x0, ids, ws, up = _expert_case(i=96, seed=21)

    def chains(experts):
        return [GradChain((experts, *p.shape[1:]), float32_products=True) for p in w]

    def one_rank(cuts):
        cs = chains(6)
        for a, b in itertools.pairwise(cuts):
            xa = x0[a:b].clone().requires_grad_()
            moe_experts(xa, ids[a:b], ws[a:b], *w, k_block=32, chains=cs).backward(up[a:b])
        return [c.acc.clone() for c in cs]

    whole = one_rank([0, 28])
    assert all(torch.equal(a, b) for a, b in zip(whole, one_rank([0, 11, 28]), strict=True))
    _check_expert_chains_against_autograd(whole, w, x0, ids, ws, up)

    def rank(r, exchange):
        local, cs = [p[r * 3 : (r + 1) * 3] for p in w], chains(3)
        for a, b in ((0, 11), (11, 28)):
            ep = ExpertParallel(r, 2, exchange, _gather_rows(r, exchange))
            xa = x0[a:b].clone().requires_grad_()
            moe_experts(xa, ids[a:b], ws[a:b], *local, k_block=32, chains=cs, expert_parallel=ep).backward(up[a:b])
        return [c.acc for c in cs]

    ranks = _run_ranks(2, rank)
    for k in range(3):
        assert torch.equal(torch.cat([ranks[0][k], ranks[1][k]]), whole[k])


def _expert_case(i: int, seed: int):
    """6 float32 experts (hidden 64, intermediate ``i``) and 28 tokens: ``(weights, x, top-2 ids, routing weights,
    output gradient)``."""
    w = _experts(e=6, h=64, i=i, dtype=torch.float32, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(28, 64, generator=g)
    ids = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(28)])
    return w, x, ids, torch.rand(28, 2, generator=g), torch.randn(28, 64, generator=g)


def _check_expert_chains_against_autograd(chains, w, x, ids, ws, up) -> None:
    """The experts' chains after the 28 tokens (``k_block`` 32) are autograd's one-call gradient within 1e-5; the
    negative control: autograd's gradients summed over calls on 11 + 17 tokens differ from one call's."""

    def autograd(cuts):
        params = [p.clone().requires_grad_() for p in w]
        for a, b in itertools.pairwise(cuts):
            moe_experts(x[a:b], ids[a:b], ws[a:b], *params, k_block=32).backward(up[a:b])
        return [p.grad for p in params]

    ref = autograd([0, 28])
    for mine, theirs in zip(chains, ref, strict=True):
        assert float((mine - theirs).abs().max()) <= 1e-5 * float(theirs.abs().max())
    stock_differs(
        any(not torch.equal(a, b) for a, b in zip(autograd([0, 11, 28]), ref, strict=True)),
        "autograd's expert gradients (k_block) summed over 11 + 17",
        "the tokens",
    )


def _gather_roots(r: int, exchange):
    """Rank ``r`` of 2's all-gather of float32 subtree roots (``[1, ...] -> [2, ...]``, rank order) over
    :func:`_run_ranks`' ``exchange``, as :func:`shared_numerics.tensor_parallel.reduce_over_ranks` takes it; the
    backward keeps this rank's slice."""

    class GatherRoots(torch.autograd.Function):
        @staticmethod
        def forward(ctx, root):
            return exchange(torch.cat([root] * 2), [1, 1], [1, 1]).detach()

        @staticmethod
        def backward(ctx, grad):
            return grad[r : r + 1]

    return GatherRoots.apply


def test_tensor_parallel_expert_chains_are_tp_1s_slices():
    """Exact accumulation of tensor-parallel experts (``k_block``, each expert's intermediate size split over 2 ranks,
    every rank every token; float32): the down projection's chain takes ``dYᵀ act`` of this rank's subtree root,
    whose gradient is the whole output's, so each rank's chains after calls on 11 + 17 tokens are TP 1's one call's
    slices (the gate/up rows, the down columns it holds), bit for bit, and its outputs TP 1's. Negative control:
    autograd's gradients summed over the two calls differ from one call's."""
    from shared_numerics.grad_chain import GradChain

    w, x0, ids, ws, up = _expert_case(i=128, seed=23)

    def run(weights, cuts, gather=None):
        cs = [GradChain(p.shape, float32_products=True) for p in weights]
        outs = []
        for a, b in itertools.pairwise(cuts):
            xa = x0[a:b].clone().requires_grad_()
            out = moe_experts(xa, ids[a:b], ws[a:b], *weights, k_block=32, gather=gather, chains=cs)
            out.backward(up[a:b])
            outs.append(out.detach())
        return torch.cat(outs), [c.acc.clone() for c in cs]

    tp1_out, tp1 = run(w, [0, 28])

    def rank(r, exchange):
        shard = [w[0][:, r * 64 : (r + 1) * 64], w[1][:, r * 64 : (r + 1) * 64], w[2][:, :, r * 64 : (r + 1) * 64]]
        return run(shard, [0, 11, 28], _gather_roots(r, exchange))

    ranks = _run_ranks(2, rank)
    for r in range(2):
        assert torch.equal(ranks[r][0], tp1_out), f"rank {r}'s outputs"
    for k, dim in enumerate((1, 1, 2)):
        assert torch.equal(torch.cat([ranks[0][1][k], ranks[1][1][k]], dim=dim), tp1[k]), f"weight {k}"
    _check_expert_chains_against_autograd(tp1, w, x0, ids, ws, up)


@pytest.mark.parametrize("dtype", DTYPES)
def test_expert_parallel_deepseekmoe_is_one_ranks_bits_and_gradients(dtype):
    """DeepSeekMoE (:func:`shared_numerics.moe.deepseek_moe_forward`: grouped sigmoid routing with a selection bias,
    8 experts in 4 groups, top-2 of 2 groups, a shared expert) with the routed experts split over 2 ranks (threads
    exchanging through :class:`_Mailbox`; router, bias and shared expert replicated, each rank its own tokens): the
    outputs, the routes, the tokens' gradients and each routed expert's weight gradient equal one rank's over the
    batches concatenated. Negative control: without the exchange a rank holding only its own experts cannot serve
    these routes (they name the other rank's experts: refused)."""

    from shared_numerics.moe import ExpertParallel, deepseek_moe_forward

    e, h, i = 8, 64, 48
    w = [t.requires_grad_() for t in _experts(e=e, h=h, i=i, dtype=dtype, seed=11)]
    g = torch.Generator().manual_seed(12)
    router = torch.randn(e, h, generator=g) * 0.3
    bias = torch.randn(e, generator=g) * 0.1
    shared = [(torch.randn(*s, generator=g) * 0.1).to(dtype) for s in ((i, h), (i, h), (h, i))]
    xs = [torch.randn(n, h, generator=g).to(dtype) for n in (13, 9)]
    ups = [torch.randn(x.shape[0], h, generator=g).to(dtype) for x in xs]
    kw = dict(top_k=2, n_group=4, topk_group=2, renormalize=True, scaling=2.5)

    params = [p.detach().clone().requires_grad_() for p in w]
    x_all = torch.cat(xs).requires_grad_()
    ref_out, ref_ids = deepseek_moe_forward(x_all, router, bias, *params, shared, **kw)
    ref_out.backward(torch.cat(ups))
    local = [[p.detach()[r * 4 : (r + 1) * 4].clone().requires_grad_() for p in w] for r in range(2)]

    def rank(r, exchange):
        x = xs[r].clone().requires_grad_()
        out, ids = deepseek_moe_forward(
            x, router, bias, *local[r], shared, **kw, expert_parallel=ExpertParallel(r, 2, exchange)
        )
        out.backward(ups[r])
        return out, ids, x.grad

    results = _run_ranks(2, rank)
    assert torch.equal(torch.cat([results[0][0], results[1][0]]), ref_out)
    assert torch.equal(torch.cat([results[0][1], results[1][1]]), ref_ids)
    assert torch.equal(torch.cat([results[0][2], results[1][2]]), x_all.grad)
    for k in range(3):  # each stacked weight: rank r's experts are rows [4r, 4r + 4)
        assert torch.equal(torch.cat([local[0][k].grad, local[1][k].grad]), params[k].grad)
    assert int(ref_ids.max()) >= 4  # negative control: rank 0 alone (experts 0-3) cannot serve these routes
    with pytest.raises(ValueError, match="beyond the 4 experts held here"):
        deepseek_moe_forward(xs[0], router, bias, *[p.detach() for p in local[0]], shared, **kw)


@pytest.mark.requires_f32_kernel
def test_deepseekmoe_chains_are_grouping_invariant_gradients():
    """DeepSeekMoE with exact-accumulation chains (:func:`shared_numerics.moe.deepseek_moe_forward` ``chains``,
    float32): the router's chain continues the float32 logits' weight gradient over every token, each routed
    expert's over its rows, so one call on 22 tokens and calls on 9 + 13 leave the same bits in every chain; and the
    chains hold the gradient (autograd's on the whole batch within 1e-5). Negative control: autograd's gradients
    summed over the two calls differ from one call's."""
    from shared_numerics.grad_chain import GradChain
    from shared_numerics.moe import deepseek_moe_forward

    e, h, i = 8, 64, 48
    w = _experts(e=e, h=h, i=i, dtype=torch.float32, seed=13)
    g = torch.Generator().manual_seed(14)
    router = torch.randn(e, h, generator=g) * 0.3
    bias = torch.randn(e, generator=g) * 0.1
    shared = [torch.randn(*s, generator=g) * 0.1 for s in ((i, h), (i, h), (h, i))]
    x = torch.randn(22, h, generator=g)
    up = torch.randn(22, h, generator=g)
    kw = dict(top_k=2, n_group=4, topk_group=2, renormalize=True, scaling=2.5)

    def chained(cuts):
        chains = {
            "router": GradChain((e, h)),
            **{
                k: GradChain(tuple(p.shape), float32_products=True)
                for k, p in zip(("w_gate", "w_up", "w_down"), w, strict=True)
            },
        }
        for a, b in itertools.pairwise(cuts):
            xa = x[a:b].clone().requires_grad_()  # the weights' gradients go into the chains
            out, _ = deepseek_moe_forward(xa, router, bias, *w, shared, **kw, chains=chains)
            out.backward(up[a:b])
        return {k: c.acc.clone() for k, c in chains.items()}

    def autograd(cuts):
        params = [router.clone().requires_grad_()] + [p.clone().requires_grad_() for p in w]
        for a, b in itertools.pairwise(cuts):
            out, _ = deepseek_moe_forward(x[a:b], params[0], bias, *params[1:], shared, **kw)
            out.backward(up[a:b])
        return dict(zip(("router", "w_gate", "w_up", "w_down"), (p.grad for p in params), strict=True))

    whole, split = chained([0, 22]), chained([0, 9, 22])
    assert all(torch.equal(whole[k], split[k]) for k in whole)
    ref = autograd([0, 22])
    for k in whole:
        assert float((whole[k] - ref[k]).abs().max()) <= 1e-5 * float(ref[k].abs().max()), k
    summed = autograd([0, 9, 22])
    stock_differs(
        any(not torch.equal(summed[k], ref[k]) for k in ref), "autograd's gradients summed over 9 + 13", "the tokens"
    )
