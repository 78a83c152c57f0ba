"""Mixture-of-Experts router and expert computation with a deterministic, batch-invariant definition.

* Router (:func:`route_topk`): ``scores = softmax(router_logits)`` through :func:`shared_numerics.log_softmax` (float64
  normaliser, fixed tree), then the ``k`` highest scores by a **stable** descending sort, so exact ties go to the
  lowest expert id — never ``torch.topk``'s implementation-defined order (vLLM-CPU's ``CPURouter`` takes top-k on raw
  logits with ``sorted=False``; HF softmaxes then top-k: equal in exact math, but a bf16 tie flipped 1 row in 20,000,
  ``docs/design.md`` §4). Optional renormalisation of the selected weights (Qwen3-MoE ``norm_topk_prob``) in fp32.
* Experts (:func:`moe_experts`): every token's expert FFN is ``down(silu(gate x) * up x)`` with
  :func:`shared_numerics.linear`, whose fixed row tiles make a token's result independent of how many tokens its
  expert received; the ``k`` expert outputs are combined in slot order (rank of the routing score), weights applied
  and summed in fp32, rounded once to the activation dtype.

* DeepSeekMoE router (:func:`route_grouped_topk`, DeepSeek-V3 / Kimi K2 / GLM-MoE ``noaux_tc``): float32 sigmoid
  scores (:func:`shared_numerics.reduce.sigmoid64`); the selection bias (``e_score_correction_bias``) added for the
  choice only; each group's score the sum of its two highest biased scores; the ``topk_group`` best groups, then the
  ``k`` best experts inside them — both by stable descending sorts, so exact ties go to the lowest group id and then
  the lowest expert id (HF and vLLM use ``torch.topk``, whose order on ties is implementation-defined); weights from
  the unbiased scores, normalised by a left-to-right sum (+ 1e-20, as HF), times ``routed_scaling_factor``. Shared
  experts are one dense SwiGLU added to the routed sum in float32 after the slots (:func:`deepseek_moe_forward`).

FP8 experts (``fp8=`` a granularity of :mod:`shared_numerics.fp8`): every expert's projections are the shared FP8
GEMM of that expert's own codes (one weight per expert, as DeepSeek's FP8 checkpoints store them) — served codes and
scales on vLLM, the high-precision weights quantized in the forward with a straight-through gradient in the trainer
(QAT), the same forward bits; the routers stay high precision.

Routing replay (R3, arXiv 2510.11370): pass recorded ``expert_ids`` to :func:`moe_experts` instead of recomputing
them; the weights are still gathered from the current scores (:func:`gather_route_weights`), so gradients flow.
Source: HF ``modeling_qwen3_moe.py`` (``Qwen3MoeSparseMoeBlock``); vLLM ``fused_moe`` (``topk_softmax``).
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch

from .reduce import sigmoid64

if TYPE_CHECKING:
    from .fp8 import Granularity

__all__ = [
    "ExpertParallel",
    "deepseek_moe_forward",
    "gather_route_weights",
    "grouped_route_weights",
    "moe_experts",
    "moe_forward",
    "route_grouped_topk",
    "route_topk",
]


def _linear(x: torch.Tensor, weight: torch.Tensor, chain=None) -> torch.Tensor:
    """The backend's ``linear``; with a :class:`~shared_numerics.grad_chain.GradChain`, the CPU backend's, which
    feeds it the weight's gradient."""
    if chain is None:
        from . import linear

        return linear(x, weight)
    from .linear import linear as cpu_linear

    return cpu_linear(x, weight, weight_chain=chain)


def _expert_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    chain=None,
    fp8: Granularity | None = None,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One expert projection: :func:`_linear`; with ``fp8`` (a granularity) the FP8 GEMM — of served codes
    (``weight`` the ``float8_e4m3fn`` codes, ``scale`` their scales: :func:`shared_numerics.fp8_linear`) or, without
    ``scale``, of the high-precision weight's codes with a straight-through gradient
    (:func:`shared_numerics.fp8_linear_qat`, the trainer's QAT): the same forward bits."""
    if fp8 is None:
        return _linear(x, weight, chain)
    if scale is not None:
        from . import fp8_linear

        return fp8_linear(x, weight, scale, fp8)
    if chain is not None:
        from .fp8 import fp8_linear_qat as cpu_fp8_linear_qat

        return cpu_fp8_linear_qat(x, weight, fp8, weight_chain=chain)
    from . import fp8_linear_qat

    return fp8_linear_qat(x, weight, fp8)


def _scores(router_logits: torch.Tensor) -> torch.Tensor:
    from . import log_softmax

    return torch.exp(log_softmax(router_logits).double()).float()


def route_topk(router_logits: torch.Tensor, k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing with lowest-id tie-break.

    Args:
        router_logits: ``[N, E]`` any float dtype.
        k: experts per token (``1 <= k <= E``).
        renormalize: divide the selected scores by their sum (Qwen3-MoE ``norm_topk_prob``).

    Returns:
        ``(expert_ids [N, k] int64, weights [N, k] float32)``, slot 0 the highest score.

    Raises:
        ValueError: ``k`` out of range.
    """
    scores = _scores(router_logits)
    ids = _topk_ids(scores, k)
    return ids, gather_route_weights(scores, ids, renormalize)


def _topk_ids(scores: torch.Tensor, k: int) -> torch.Tensor:
    e = scores.shape[-1]
    if not 1 <= k <= e:
        raise ValueError(f"top-k {k} outside [1, {e}]")
    order = torch.sort(-scores, dim=-1, stable=True).indices  # stable: equal scores keep ascending expert id
    return order[:, :k].contiguous()


def gather_route_weights(scores: torch.Tensor, expert_ids: torch.Tensor, renormalize: bool = True) -> torch.Tensor:
    """The routing weights of given experts (``[N, k]`` float32) from softmax ``scores [N, E]``: the replay path
    (recorded ids, current scores). Differentiable in ``scores``."""
    w = scores.gather(-1, expert_ids)
    if renormalize:
        total = w[:, 0:1]
        for j in range(1, w.shape[1]):  # fixed left-to-right order
            total = total + w[:, j : j + 1]
        w = w / total
    return w


def moe_experts(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    k_block: int | None = None,
    gather=None,
    chains=None,
    shared_out: torch.Tensor | None = None,
    fp8: Granularity | None = None,
    scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    expert_parallel: ExpertParallel | None = None,
) -> torch.Tensor:
    """Weighted sum of each token's experts.

    Args:
        x: ``[N, H]`` activations (float32 / bfloat16).
        expert_ids: ``[N, k]`` int64 (from :func:`route_topk`, or recorded for replay).
        weights: ``[N, k]`` float32 routing weights.
        w_gate, w_up: ``[E, I, H]``; w_down: ``[E, H, I]`` (HF ``experts.{e}.{gate,up,down}_proj.weight`` stacked).
        k_block: ``None``: each expert's down projection is one :func:`shared_numerics.linear`. An int
            (:attr:`shared_numerics.NumericsMode.tp_k_block`): it sums over ``I`` in the fixed TP-aligned tree of
            :mod:`shared_numerics.tensor_parallel`, so the experts can be tensor-parallel (``I`` sharded: this rank's
            ``w_gate/w_up [E, I/TP, H]`` and ``w_down [E, H, I/TP]``).
        gather: with ``k_block`` under tensor parallelism, the all-gather of every rank's float32 subtree roots
            ``[1, N*k, H] -> [TP, N*k, H]`` (see :func:`~shared_numerics.tensor_parallel.row_parallel_linear`),
            applied before the routing weights; ``None`` at TP 1.
        chains: exact accumulation over micro-batches (:mod:`shared_numerics.grad_chain`): ``(gate, up, down)``
            :class:`~shared_numerics.grad_chain.GradChain` s of the three stacked weights' shapes (with
            ``float32_products`` for bf16: an expert's tokens are any number) that the experts' weight gradients
            continue, expert ``e``'s over its tokens in token order; nothing is returned to autograd for the three.
            With ``k_block`` the down projection's chain takes ``dYᵀ act`` of the tree's float32 root
            (:func:`shared_numerics.grad_chain.chained_weight_grad`): a whole expert's (TP x EP), or on TP-split
            experts (``gather``) this rank's subtree root, whose gradient is the whole output's, so each rank's
            chains are TP 1's slices (the gate/up rows, the down columns it holds). A CPU where
            :func:`~shared_numerics.grad_chain.chain_available` holds.
        shared_out: ``[N, H]`` the shared experts' output (DeepSeekMoE; the gated shared expert), added in float32
            after the slots.
        fp8: ``None``, or the FP8 granularity (``"per_channel"`` / ``"block"``) of every expert projection: each is
            :func:`shared_numerics.fp8_linear` of its own codes (one expert's weight ``[I, H]`` is one FP8 weight,
            quantized alone, as DeepSeek's checkpoints store it). Without ``scales`` the three weights are
            high-precision and quantized here with a straight-through gradient (QAT,
            :func:`shared_numerics.fp8_linear_qat`); with ``scales = (gate, up, down)`` (each ``[E, ...]``, one
            expert's scales per row) they are the served ``float8_e4m3fn`` codes. Not with ``k_block``.
        expert_parallel: :class:`ExpertParallel`: the experts are split over ranks (``w_*`` / ``scales`` are this
            rank's ``E / EP`` consecutive experts); each (token, slot) row is sent to its expert's rank, computed
            there and sent back, then combined here as on one rank — the same bits at any EP size. Not with
            ``k_block`` under tensor parallelism (``gather``); with ``k_block`` alone (TP x EP: every expert whole on
            its rank) each row sums with TP 1's tree. With ``chains`` (of this rank's ``E / EP`` experts), each local
            expert's chain continues over the rows it receives, source rank 0's first: one rank's token order for the
            ranks' batches concatenated.

    Returns:
        ``[N, H]`` in ``x.dtype``; row ``n`` depends only on ``x[n]``, its ids and weights (and with ``k_block``, not on
        the TP size; with ``expert_parallel``, not on the EP size). Differentiable.

    Raises:
        ValueError: ``fp8`` with ``k_block``, ``scales`` without ``fp8``,
            ``expert_parallel`` with ``k_block`` and ``gather``, or where no kernel covers ``x.dtype`` (as
            :func:`shared_numerics.linear` 's ``weight_chain``); an expert id beyond the experts held (``E``, or
            ``E / EP`` on each of the EP ranks).
        shared_numerics.fp8.Fp8QuantizationError: non-finite activations or weights under ``fp8``.
    """
    from .tensor_parallel import reduce_over_ranks

    if fp8 is not None and k_block is not None:
        raise ValueError("FP8 experts are single-rank (k_block None): the TP-invariant tree sums a bf16/fp32 GEMM")
    if scales is not None and fp8 is None:
        raise ValueError("expert scales without an FP8 granularity")
    if expert_parallel is not None and k_block is not None and gather is not None:
        raise ValueError("expert parallelism with tensor-parallel experts (k_block with gather) is not implemented")
    n, k = expert_ids.shape
    flat_ids = expert_ids.reshape(-1)
    # one row per (token, slot), the token's rows in slot order: each row goes to one expert, so its gradient is
    # placed, never summed, and each token's input gradient adds its slots in slot order (_SlotRows) — the same
    # bits whichever rank computes which expert
    x = _SlotRows.apply(x, k)
    flat_rows = torch.arange(n * k, device=x.device)
    held = w_gate.shape[0] * (1 if expert_parallel is None else expert_parallel.size)  # every rank holds E / EP
    if flat_ids.numel() and int(flat_ids.max()) >= held:
        raise ValueError(f"expert id {int(flat_ids.max())} beyond the {held} experts held here")
    if expert_parallel is not None:  # rows to their experts' ranks, computed there, back in flat order
        outs = expert_parallel.run(
            x,
            flat_rows,
            flat_ids,
            w_gate.shape[0],
            # the local experts' chains (E / EP each): rows arrive in one rank's order (see ExpertParallel)
            # with k_block (TP x EP: whole experts), each row's float32 root, rounded below as at TP 1
            lambda rx, rows, ids: _expert_rows(rx, rows, ids, w_gate, w_up, w_down, k_block, chains, fp8, scales),
            group=k,
        )
    else:
        outs = _expert_rows(x, flat_rows, flat_ids, w_gate, w_up, w_down, k_block, chains, fp8, scales)
    if k_block is not None:  # each expert output rounded once after the cross-rank tree, as without k_block
        outs = reduce_over_ranks(outs, gather).to(x.dtype).float()
    outs = outs.reshape(n, k, -1) * weights.unsqueeze(-1)
    acc = outs[:, 0]
    for j in range(1, k):  # slot order, fp32
        acc = acc + outs[:, j]
    if shared_out is not None:
        acc = acc + shared_out.float()
    return acc.to(x.dtype)


class _SlotRows(torch.autograd.Function):
    """``x [N, H] -> [N k, H]``, each token's row once per slot (token-major); backward: each token's ``k`` slot
    gradients added in slot order, in ``x.dtype``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, k: int) -> torch.Tensor:
        ctx.k = k
        return x.repeat_interleave(k, 0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        slots = grad.reshape(-1, ctx.k, grad.shape[-1])
        acc = slots[:, 0]
        for j in range(1, ctx.k):
            acc = acc + slots[:, j]
        return acc.contiguous(), None


def _expert_rows(
    x: torch.Tensor,
    flat_rows: torch.Tensor,
    flat_ids: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    k_block: int | None,
    chains,
    fp8: Granularity | None,
    scales,
) -> torch.Tensor:
    """``[R, H]`` float32: row ``r`` is expert ``flat_ids[r]``'s output for ``x[flat_rows[r]]`` (rounded to
    ``x.dtype``; with ``k_block`` this rank's float32 subtree root); ``w_*[e]`` is expert ``e``."""
    from . import silu_and_mul
    from .grad_chain import chained_weight_grad
    from .tensor_parallel import k_block_tree

    # one view per expert (unbind: its backward is one stack, not one zero-filled [E, ...] gradient per expert)
    gates, ups, downs = w_gate.unbind(0), w_up.unbind(0), w_down.unbind(0)
    sg, su, sd = (None, None, None) if scales is None else scales
    sels, ys = [], []
    for e in torch.unique(flat_ids).tolist():  # any grouping gives the same rows (row-invariant linear)
        sel = torch.nonzero(flat_ids == e).squeeze(1)
        xe = x[flat_rows[sel]]
        gate, up, down = (None, None, None) if chains is None else (c.part(e) for c in chains)
        act = silu_and_mul(
            _expert_linear(xe, gates[e], gate, fp8, None if sg is None else sg[e]),
            _expert_linear(xe, ups[e], up, fp8, None if su is None else su[e]),
        )
        if k_block is None:
            ye = _expert_linear(act, downs[e], down, fp8, None if sd is None else sd[e]).float()
        elif down is None:  # this rank's subtree root over its I columns, float32 (rounded after the cross-rank tree)
            ye = k_block_tree(act, downs[e], k_block)
        else:  # the root (a whole expert's, or this rank's subtree's: its gradient is the output's); the weight
            # gradient dYᵀ act (any column blocking: the same sums) into the chain
            ye = chained_weight_grad(k_block_tree(act, downs[e].detach(), k_block), act, down)
        sels.append(sel)
        ys.append(ye)
    outs = x.new_zeros((flat_ids.shape[0], x.shape[1]), dtype=torch.float32)
    if sels:  # every (token, slot) is one expert's: the rows are placed, never summed
        outs = outs.index_put((torch.cat(sels),), torch.cat(ys))
    return outs


class ExpertParallel:
    """Expert parallelism for :func:`moe_experts`: this rank (``rank`` of ``size``) holds experts ``[rank * E_local,
    (rank + 1) * E_local)``; ``all_to_all(t, output_splits, input_splits)`` exchanges rows of ``t`` over the EP group
    (``None`` splits: equal ones), differentiable (its backward the reverse exchange), as
    ``torch.distributed._functional_collectives.all_to_all_single_autograd``.

    Rows go to their expert's rank grouped by destination, in flat (token, slot) order within each group; the rank
    computes each received row with its expert (:func:`shared_numerics.linear`'s row tiles: a row's bits do not
    depend on which other rows share its GEMM) and sends the rows back in the order they came; they are combined on
    the token's rank in slot order, as on one rank. Each expert's weight gradient is one GEMM over its rows in the
    order received: source rank 0's, then rank 1's, ... — a single rank's order for the ranks' batches concatenated.
    Source: TorchTitan ``AllToAllTokenDispatcher`` (the same exchange; its combine is ``scatter_add``).

    ``gather_rows`` (tensor parallelism with EP over the same ranks: every rank holds the same tokens): rank ``r``
    exchanges only the rows of its share of the tokens (tokens ``[r N / size, (r + 1) N / size)``, so the ranks'
    shares concatenated are the batch in order, and an expert's rows arrive in one rank's order), and
    ``gather_rows(rows, sizes)`` concatenates the ranks' outputs ``[sizes[r], H]`` in rank order (its backward: this
    rank's slice of the gradient, which every rank has whole). The input's gradient through the experts is then this
    rank's share's: a partial sum over the ranks (exact zeros elsewhere)."""

    def __init__(self, rank: int, size: int, all_to_all, gather_rows=None) -> None:
        self.rank, self.size, self.all_to_all, self.gather_rows = rank, size, all_to_all, gather_rows

    def run(
        self,
        x: torch.Tensor,
        flat_rows: torch.Tensor,
        flat_ids: torch.Tensor,
        local_experts: int,
        compute,
        group: int = 1,
    ) -> torch.Tensor:
        """``[R, H]`` float32 expert outputs of the rows ``x[flat_rows]`` with experts ``flat_ids`` (global ids),
        computed on their experts' ranks by ``compute(rows_x, row_index, local_ids)``. With ``gather_rows``,
        ``flat_rows`` must be non-decreasing (token order), and the shares are cut between groups of ``group`` rows
        of ``x`` (a token's slot rows: one rank's share holds all of a token's)."""
        if self.gather_rows is None:
            return self._exchange(x, flat_rows, flat_ids, local_experts, compute)
        n = x.shape[0] // group
        bounds = [(n * r) // self.size * group for r in range(self.size + 1)]  # token shares, in rank order
        at = torch.tensor(bounds, dtype=flat_rows.dtype, device=flat_rows.device)
        cuts: list[int] = torch.searchsorted(flat_rows, at).tolist()
        lo, hi = cuts[self.rank], cuts[self.rank + 1]
        own = self._exchange(x, flat_rows[lo:hi], flat_ids[lo:hi], local_experts, compute)
        return self.gather_rows(own, [b - a for a, b in itertools.pairwise(cuts)])

    def _exchange(
        self, x: torch.Tensor, flat_rows: torch.Tensor, flat_ids: torch.Tensor, local_experts: int, compute
    ) -> torch.Tensor:
        dest = torch.div(flat_ids, local_experts, rounding_mode="floor")  # ids in range: moe_experts checks them
        order = torch.sort(dest, stable=True).indices
        send = torch.bincount(dest, minlength=self.size)
        recv = self.all_to_all(send, None, None).tolist()
        sent = send.tolist()
        rx = self.all_to_all(x[flat_rows[order]], recv, sent)
        rids = self.all_to_all(flat_ids[order], recv, sent) - self.rank * local_experts
        y = compute(rx, torch.arange(rx.shape[0], device=x.device), rids)
        back = self.all_to_all(y, sent, recv)  # in the order sent
        return back.index_select(0, torch.argsort(order))


#: DeepSeekMoE's scoring functions: ``"sigmoid"`` (DeepSeek-V3, ``topk_method="noaux_tc"``: a group's score is the
#: sum of its two best experts) and ``"softmax"`` (DeepSeek-V2, ``"group_limited_greedy"``: a group's score is its
#: best expert's; ``"greedy"`` is the one-group case)
SCORINGS = ("sigmoid", "softmax")


def _deepseek_scores(router_logits: torch.Tensor, scoring: str) -> torch.Tensor:
    if scoring == "sigmoid":
        return sigmoid64(router_logits)
    if scoring == "softmax":
        return _scores(router_logits)
    raise ValueError(f"DeepSeekMoE scoring {scoring!r}: expected one of {SCORINGS}")


def route_grouped_topk(
    router_logits: torch.Tensor,
    bias: torch.Tensor | None,
    k: int,
    n_group: int,
    topk_group: int,
    scoring: str = "sigmoid",
) -> torch.Tensor:
    """DeepSeekMoE's group-limited top-k, deterministic: the expert ids only (weights: :func:`grouped_route_weights`).

    Args:
        router_logits: ``[N, E]`` (float32: DeepSeek's router runs in float32).
        bias: ``[E]`` ``e_score_correction_bias`` (selection only; DeepSeek-V3), or ``None``.
        k: experts per token; n_group: groups (``E % n_group == 0``); topk_group: groups a token may use.
        scoring: ``"sigmoid"`` (DeepSeek-V3 ``noaux_tc``: sigmoid scores, a group scores the sum of its two best) or
            ``"softmax"`` (DeepSeek-V2 ``group_limited_greedy``: softmax scores, a group scores its best; with one
            group, ``greedy``).

    Returns:
        ``[N, k]`` int64 expert ids, slot 0 the highest (biased) score; exact ties: lowest group id, then lowest
        expert id. Source: HF ``modeling_deepseek_v3.DeepseekV3TopkRouter``, ``modeling_deepseek_v2.
        DeepseekV2TopkRouter`` (the same selection up to tie order).

    Raises:
        ValueError: ``E`` not a multiple of ``n_group``, ``topk_group`` outside ``[1, n_group]``, ``k`` larger than
            the experts of ``topk_group`` groups, an unknown ``scoring``.
    """
    n, e = router_logits.shape
    if e % n_group or not 1 <= topk_group <= n_group or not 1 <= k <= topk_group * (e // n_group):
        raise ValueError(
            f"{e} experts in {n_group} groups, top-{topk_group} groups, top-{k} experts: not a valid "
            "group-limited routing"
        )
    choice = _deepseek_scores(router_logits, scoring)
    if bias is not None:
        choice = choice + bias.float()
    if n_group == 1:
        return _topk_ids(choice, k)
    size = e // n_group
    best = torch.sort(choice.view(n, n_group, size), dim=-1, descending=True, stable=True).values
    # softmax (or one expert per group): the group's best; else the two highest, summed in that order
    group_scores = best[..., 0] if scoring == "softmax" or size == 1 else best[..., 0] + best[..., 1]
    groups = _topk_ids(group_scores, topk_group)
    allowed = torch.zeros((n, n_group), dtype=torch.bool, device=choice.device).scatter(1, groups, True)
    masked = choice.masked_fill(~allowed.repeat_interleave(size, dim=1), float("-inf"))
    return _topk_ids(masked, k)


def grouped_route_weights(
    router_logits: torch.Tensor, expert_ids: torch.Tensor, renormalize: bool, scaling: float, scoring: str = "sigmoid"
) -> torch.Tensor:
    """The DeepSeekMoE routing weights ``[N, k]`` float32 of ``expert_ids``: the unbiased scores (``scoring`` as in
    :func:`route_grouped_topk`), normalised by their left-to-right sum + 1e-20 (``renormalize``, HF
    ``norm_topk_prob``), times ``scaling`` (``routed_scaling_factor``). Differentiable in ``router_logits`` (also
    for replayed ids)."""
    w = _deepseek_scores(router_logits, scoring).gather(-1, expert_ids)
    if renormalize:
        total = w[:, 0:1]
        for j in range(1, w.shape[1]):  # fixed left-to-right order
            total = total + w[:, j : j + 1]
        w = w / (total + 1e-20)
    return w * scaling


def deepseek_moe_forward(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    bias: torch.Tensor | None,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    shared,
    top_k: int,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    scaling: float,
    expert_ids: torch.Tensor | None = None,
    scoring: str = "sigmoid",
    fp8: Granularity | None = None,
    scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    expert_parallel: ExpertParallel | None = None,
    chains: dict | None = None,
    k_block: int | None = None,
    gather=None,
    experts_input=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One DeepSeekMoE block (HF ``DeepseekV3MoE`` / ``DeepseekV2Moe``): float32 router logits
    ``linear(x.float(), router_weight.float())``, :func:`route_grouped_topk` (or replayed ``expert_ids``, rows of
    ``-1`` routed afresh), the routed experts (:func:`moe_experts`, ``fp8`` / ``scales`` as there) and the shared
    experts (one dense SwiGLU, added in float32 after the routed slots): ``shared = (gate [I_s, H], up [I_s, H],
    down [H, I_s])`` weights, or the module computing it (``[N, H] -> [N, H]``: ``down(silu_and_mul(gate x, up x))``
    with the host's projections — FP8 ones under FP8), or ``None``. The router is never quantized (DeepSeek's FP8
    checkpoints keep ``mlp.gate`` in high precision). ``expert_parallel``: the routed experts split over ranks as in
    :func:`moe_experts` (``w_*`` this rank's ``E / EP``; the router, the bias and the shared experts replicated, each
    rank routing and combining its own tokens), bitwise one rank's. ``chains``: exact accumulation, as
    :func:`moe_forward` takes them (the router's chain continues the float32 logits' weight gradient over all ``N``
    tokens; a shared-experts module feeds its own chains). ``k_block``, ``gather``: tensor-parallel routed experts
    (``w_*`` this rank's ``I / TP`` of each) summed over ``I`` in the fixed TP-aligned tree, as :func:`moe_experts`
    takes them; the shared experts must then be a module, whose down projection sums with the same tree (a
    row-parallel linear).
    ``experts_input``: a function applied to the routed experts' branch of ``x`` (the identity in the forward; under
    TP x EP one whose backward sums the ranks' shares of that branch's gradient). ``x``'s gradient adds its three
    branches in one fixed order — router, then shared experts, then routed experts — whatever the autograd graph
    around them (at every TP size the same bits).

    Returns:
        ``(out [N, H] in x.dtype, expert_ids [N, top_k] int64)``.

    Raises:
        ValueError: as :func:`route_grouped_topk` and :func:`moe_experts`; replayed ids of the wrong shape or outside
            ``[0, E)``; ``shared`` weights with ``k_block``.
    """
    from . import silu_and_mul

    x_router, x_shared, x_experts = _OrderedBranches.apply(x, 3) if x.requires_grad else (x, x, x)
    if experts_input is not None:
        x_experts = experts_input(x_experts)
    logits = _linear(x_router.float(), router_weight.float(), None if chains is None else chains["router"])
    ids = route_grouped_topk(logits, bias, top_k, n_group, topk_group, scoring)
    if expert_ids is not None:
        ids = _replayed(ids, expert_ids, router_weight.shape[0])
    shared_out = None
    if callable(shared):
        shared_out = shared(x_shared)
    elif shared is not None:
        if k_block is not None:
            raise ValueError("DeepSeekMoE shared-expert weights with k_block: pass the module (row-parallel down_proj)")
        sg, su, sd = shared
        shared_out = _linear(silu_and_mul(_linear(x_shared, sg), _linear(x_shared, su)), sd)
    out = moe_experts(
        x_experts,
        ids,
        grouped_route_weights(logits, ids, renormalize, scaling, scoring),
        w_gate,
        w_up,
        w_down,
        chains=None if chains is None else (chains["w_gate"], chains["w_up"], chains["w_down"]),
        shared_out=shared_out,
        fp8=fp8,
        scales=scales,
        expert_parallel=expert_parallel,
        k_block=k_block,
        gather=gather,
    )
    return out, ids


class _OrderedBranches(torch.autograd.Function):
    """``x -> n`` views of ``x`` (one per consumer); backward: their gradients added in branch order, left to right
    (a branch without a gradient counts as zeros) — a fixed order where autograd's own accumulation follows the
    graph."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, n: int):
        return tuple(x.view_as(x) for _ in range(n))

    @staticmethod
    def backward(ctx, *grads):
        present = [g for g in grads if g is not None]
        if not present:
            return None, None
        acc = present[0]
        for g in present[1:]:
            acc = acc + g
        return acc, None


def _replayed(ids: torch.Tensor, expert_ids: torch.Tensor, e: int) -> torch.Tensor:
    """``ids`` with the recorded rows of ``expert_ids`` put in (a row of ``-1``: keep the fresh route)."""
    rec = expert_ids.to(device=ids.device, dtype=torch.int64)
    if tuple(rec.shape) != tuple(ids.shape):
        raise ValueError(f"replayed expert ids have shape {tuple(rec.shape)}, expected {tuple(ids.shape)}")
    fresh = (rec == -1).all(dim=-1, keepdim=True)
    if bool(((rec < 0) & ~fresh).any()) or (rec.numel() and int(rec.max()) >= e):
        raise ValueError(f"replayed expert ids outside [0, {e}) (a row of -1 means: route afresh)")
    return torch.where(fresh, ids, rec)


def moe_forward(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    top_k: int,
    renormalize: bool = True,
    expert_ids: torch.Tensor | None = None,
    k_block: int | None = None,
    gather=None,
    experts_x: torch.Tensor | None = None,
    chains: dict | None = None,
    fp8: Granularity | None = None,
    scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    expert_parallel: ExpertParallel | None = None,
    shared=None,
    shared_gate: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sparse MoE block (Qwen3-MoE ``Qwen3MoeSparseMoeBlock``): router, top-k, experts, combine; with ``shared``
    the sigmoid-gated shared expert of Qwen3-Next / Qwen3.5-MoE / Qwen2-MoE (``Qwen3NextSparseMoeBlock``).

    Args:
        x: ``[N, H]`` activations.
        router_weight: ``[E, H]`` (HF ``mlp.gate.weight``); router logits are ``linear(x, router_weight)`` in
            ``x.dtype``, scores their float32 softmax.
        w_gate, w_up, w_down: stacked expert weights, see :func:`moe_experts`.
        top_k: experts per token.
        renormalize: Qwen3-MoE ``norm_topk_prob``.
        expert_ids: ``[N, top_k]`` recorded routes to replay (R3) instead of recomputing top-k; the weights are
            still gathered from this forward's scores. A row of ``-1`` is routed afresh (e.g. padding, or the last
            token of a sequence, whose routes a rollout never computes).
        k_block, gather: tensor-parallel experts with the TP-size-invariant sum, see :func:`moe_experts` (the
            router is replicated).
        experts_x: the experts' input if not ``x`` itself: the same values on another autograd path (under
            tensor parallelism the router's gradient is complete on every rank, the experts' a partial sum).
        chains: exact accumulation (:mod:`shared_numerics.grad_chain`): ``{"router": [E, H] chain, "w_gate", "w_up",
            "w_down": the experts' chains}`` (see :func:`moe_experts`); the router's gradient continues its chain
            over all ``N`` tokens (bf16: ``N`` a multiple of :data:`~shared_numerics.grad_chain.CHAIN_K_MULTIPLE`).
        fp8, scales: FP8 experts (QAT or served codes), see :func:`moe_experts`; the router stays high precision.
        expert_parallel: the experts split over ranks (``w_*`` this rank's), see :func:`moe_experts`; the router is
            replicated and ``expert_ids`` stay global ids.
        shared, shared_gate: the gated shared expert: ``shared = (gate [I_s, H], up [I_s, H], down [H, I_s])``
            weights or the module computing ``down(silu_and_mul(gate x, up x))`` (``[N, H] -> [N, H]``, the host's
            projections); ``shared_gate`` ``[1, H]`` (HF ``shared_expert_gate.weight``). Its output
            :func:`shared_numerics.activation.sigmoid_gate` ``(shared(x), linear(x, shared_gate))`` is added in
            float32 after the routed slots. ``x``'s gradient then adds its branches in one fixed order: router,
            shared expert's gate, shared expert, routed experts. Not with ``k_block`` (weights) or ``chains``.

    Returns:
        ``(out [N, H] in x.dtype, expert_ids [N, top_k] int64)`` — the ids used (recomputed or replayed).

    Raises:
        ValueError: replayed ids of the wrong shape or outside ``[0, E)``.
    """
    shared_out = None
    if shared is not None:
        from . import silu_and_mul
        from .activation import sigmoid_gate

        if shared_gate is None or chains is not None or (k_block is not None and not callable(shared)):
            raise ValueError("a gated shared expert needs shared_gate, no chains, and a module under k_block")
        x_router, x_gate, x_shared, x_routed = _OrderedBranches.apply(x, 4) if x.requires_grad else (x,) * 4
        if callable(shared):
            s_out = shared(x_shared)
        else:
            sg, su, sd = shared
            s_out = _linear(silu_and_mul(_linear(x_shared, sg), _linear(x_shared, su)), sd)
        shared_out = sigmoid_gate(s_out, _linear(x_gate, shared_gate))
        x, experts_x = x_router, x_routed if experts_x is None else experts_x
    scores = _scores(_linear(x, router_weight, None if chains is None else chains["router"]))
    ids = _topk_ids(scores, top_k)
    if expert_ids is not None:
        ids = _replayed(ids, expert_ids, router_weight.shape[0])
    return moe_experts(
        x if experts_x is None else experts_x,
        ids,
        gather_route_weights(scores, ids, renormalize),
        w_gate,
        w_up,
        w_down,
        k_block,
        gather,
        None if chains is None else (chains["w_gate"], chains["w_up"], chains["w_down"]),
        shared_out=shared_out,
        fp8=fp8,
        scales=scales,
        expert_parallel=expert_parallel,
    ), ids
