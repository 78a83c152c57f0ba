"""Batch-invariant multi-LoRA linear layer: ``y = linear(x, W, b) + scaling[a] * linear(linear(x, A[a]), B[a])`` with
the adapter ``a`` chosen per row (``-1``: the base layer only).

Each row's bits depend only on that row, its adapter's weights and the base weights — never on which other rows, or
rows of which other adapters, share the call: the rows of one adapter are gathered and go through the backend's
row-invariant ``linear`` (shrink ``x @ A^T``, then expand ``h @ B^T``), and the per-row result is scattered back.

Arithmetic (mirrors PEFT's ``peft/tuners/lora/layer.py`` ``Linear.forward``:
``result = base_layer(x); result = result + lora_B(lora_A(x)) * scaling``, every op in the activation dtype):
the base output, the shrink and the expand are each rounded once to ``x.dtype`` (each is a ``linear``); then
``delta = round(expand * scaling)`` and ``y = round(base + delta)``, both computed in float32 and rounded once — what
ATen does for a bf16 ``*`` and ``+`` on CPU, and what the Triton table does on GPU, so the two sides share it.
:func:`add_lora` is the second half alone (adapters added to a given base output): the serving engine runs it after
its base projection, in place of vLLM's punica ``add_lora_linear`` (:mod:`vllm_plugin.lora`). vLLM folds each
adapter's scaling into its ``lora_B`` when it loads the adapter (``round(B * scaling)``, then scaling 1); the trainer
(:class:`titan_plugin.lora.ZeroKLDLoRALinear`) folds the same way, so both sides call this op with scaling 1.

Adapters are stacked as vLLM stacks them (``LoRAModelManager``): ``lora_a [L, R, K]``, ``lora_b [L, N, R]`` with ``R``
the engine's ``max_lora_rank``; an adapter of rank ``r < R`` is zero-padded (rows ``r..R`` of ``A``, columns of
``B``). The padded rank is part of the definition (the shrink/expand GEMMs reduce over it): the trainer stacks its
adapter to the same ``R`` to reproduce the engine's bits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .linear import linear as _linear

__all__ = ["add_lora", "add_lora_with", "lora_linear", "lora_linear_with"]


def _scalings(scaling, n_adapters: int) -> torch.Tensor:
    s = torch.as_tensor(scaling, dtype=torch.float32).reshape(-1)
    if s.numel() != n_adapters:
        raise ValueError(f"scaling has {s.numel()} entries for {n_adapters} adapters")
    return s


def _check_adapters(
    x: torch.Tensor, n: int, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling, adapter_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    k = x.shape[-1]
    if lora_a.dim() != 3 or lora_b.dim() != 3 or lora_a.shape[0] != lora_b.shape[0]:
        raise ValueError(
            f"lora_a must be [L, R, K] and lora_b [L, N, R]; got {tuple(lora_a.shape)} and {tuple(lora_b.shape)}"
        )
    n_adapters, rank = lora_a.shape[0], lora_a.shape[1]
    if lora_a.shape[2] != k or tuple(lora_b.shape[1:]) != (n, rank):
        raise ValueError(
            f"adapter shapes {tuple(lora_a.shape)}, {tuple(lora_b.shape)} do not fit x [..., {k}] and "
            f"{n} outputs (expected [L, R, {k}] and [L, {n}, R])"
        )
    if tuple(adapter_ids.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"adapter_ids has shape {tuple(adapter_ids.shape)}; x's rows are {tuple(x.shape[:-1])}")
    ids = adapter_ids.reshape(-1).to(torch.int64)
    if ids.numel() and (int(ids.min()) < -1 or int(ids.max()) >= n_adapters):
        raise ValueError(f"adapter ids must be in [-1, {n_adapters}); got {int(ids.min())}..{int(ids.max())}")
    return ids, _scalings(scaling, n_adapters)


def _chained(linear: Callable, x: torch.Tensor, weight: torch.Tensor, chain) -> torch.Tensor:
    return linear(x, weight) if chain is None else linear(x, weight, weight_chain=chain)


def add_lora_with(
    linear: Callable,
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: torch.Tensor | Sequence[float],
    adapter_ids: torch.Tensor,
    adapter_chains: Sequence | None = None,
) -> torch.Tensor:
    """:func:`add_lora` on a backend's row-invariant ``linear`` (``adapter_chains``: see :func:`lora_linear`; the
    backend's ``linear`` then takes ``weight_chain``)."""
    n = y.shape[-1]
    if tuple(y.shape[:-1]) != tuple(x.shape[:-1]) or y.dtype != x.dtype:
        raise ValueError(f"y {tuple(y.shape)} {y.dtype} must have x's rows {tuple(x.shape[:-1])} and dtype {x.dtype}")
    ids, scales = _check_adapters(x, n, lora_a, lora_b, scaling, adapter_ids)
    if adapter_chains is not None and len(adapter_chains) != lora_a.shape[0]:
        raise ValueError(f"adapter_chains has {len(adapter_chains)} entries for {lora_a.shape[0]} adapters")
    lead = x.shape[:-1]
    x2, y2 = x.reshape(-1, x.shape[-1]), y.reshape(-1, n)

    def delta(a: int, x_rows: torch.Tensor) -> torch.Tensor:
        """``round(scaling[a] * linear(linear(x_rows, A[a]), B[a]))``, the adapter's chains fed (ATen's ``x.dtype``
        ``*`` computes in float32 and rounds once)."""
        chain_a, chain_b = (None, None) if adapter_chains is None else adapter_chains[a]
        h = _chained(linear, x_rows, lora_a[a].to(x.dtype), chain_a)
        d = _chained(linear, h, lora_b[a].to(x.dtype), chain_b)
        scale = float(scales[a])
        return d if scale == 1.0 else d * scale

    adapters = torch.unique(ids).tolist()
    # (ATen's x.dtype ``+`` computes in float32 and rounds once: ``round(y + delta)``)
    if len(adapters) == 1 and adapters[0] >= 0:  # every row on one adapter (a trainer's batch): no gather / scatter
        return (y2 + delta(adapters[0], x2)).reshape(*lead, n)
    rows_out, deltas = [], []
    for a in adapters:
        if a < 0:
            continue
        rows = (ids == a).nonzero().squeeze(1)
        deltas.append(delta(a, x2.index_select(0, rows)))
        rows_out.append(rows)
    if deltas:
        rows = torch.cat(rows_out)
        y2 = y2.index_copy(0, rows, y2.index_select(0, rows) + torch.cat(deltas))
    return y2.reshape(*lead, n)


def lora_linear_with(
    linear: Callable,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: torch.Tensor | Sequence[float],
    adapter_ids: torch.Tensor,
    adapter_chains: Sequence | None = None,
) -> torch.Tensor:
    """:func:`lora_linear` on a backend's row-invariant ``linear`` (``linear(x, weight, bias)``, rounding to
    ``x.dtype``); each backend's op table binds its own."""
    k, n = x.shape[-1], weight.shape[0]
    _check_adapters(x, n, lora_a, lora_b, scaling, adapter_ids)
    y = linear(x.reshape(-1, k), weight, bias).reshape(*x.shape[:-1], n)
    return add_lora_with(linear, y, x, lora_a, lora_b, scaling, adapter_ids, adapter_chains)


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: torch.Tensor | Sequence[float],
    adapter_ids: torch.Tensor,
) -> torch.Tensor:
    """The adapter half of :func:`lora_linear` on an already computed base output ``y = linear(x, W, b)``: rows
    with an adapter become ``round(y + round(scaling * linear(linear(x, A), B)))``, base rows stay ``y``. What the
    serving engine runs after its base projection (vLLM's ``punica_wrapper.add_lora_linear`` seam).

    Args:
        y: ``[..., N]`` base output, ``x.dtype``; x, lora_a, lora_b, scaling, adapter_ids: as :func:`lora_linear`.

    Returns:
        A new ``[..., N]`` tensor (``y`` is not modified).

    Raises:
        ValueError: inconsistent shapes or dtypes, an adapter id outside ``[-1, L)``, ``scaling`` not of length ``L``.
    """
    return add_lora_with(_linear, y, x, lora_a, lora_b, scaling, adapter_ids)


def lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: torch.Tensor | Sequence[float],
    adapter_ids: torch.Tensor,
    adapter_chains: Sequence | None = None,
) -> torch.Tensor:
    """Batch-invariant multi-LoRA ``linear`` (see the module docstring for the arithmetic).

    Args:
        x: ``[..., K]`` float32 or bfloat16.
        weight: ``[N, K]`` base weight (frozen in LoRA training); bias: optional ``[N]``.
        lora_a: ``[L, R, K]`` stacked ``lora_A`` weights (PEFT ``lora_A.weight`` is ``[r, K]``), zero-padded to ``R``.
        lora_b: ``[L, N, R]`` stacked ``lora_B`` weights (PEFT ``lora_B.weight`` is ``[N, r]``).
        scaling: ``[L]`` per-adapter scale, float32 (PEFT: ``lora_alpha / r``; rsLoRA ``lora_alpha / sqrt(r)``).
        adapter_ids: ``x.shape[:-1]`` integer adapter index per row, ``-1`` for the base layer alone (vLLM's
            ``token_lora_mapping`` convention).
        adapter_chains: exact accumulation over micro-batches (:mod:`shared_numerics.grad_chain`): one pair
            ``(chain_a, chain_b)`` per adapter, :class:`~shared_numerics.grad_chain.GradChain` s of ``[R, K]`` and
            ``[N, R]`` (or ``None`` s) that the gradients of ``lora_a[a]`` and ``lora_b[a]`` continue — over the
            adapter's rows in row order; nothing is returned to autograd for those two. Requirements (and errors) as
            :func:`shared_numerics.linear` 's ``weight_chain``: bf16 needs a multiple of
            :data:`~shared_numerics.grad_chain.CHAIN_K_MULTIPLE` rows per adapter.

    Returns:
        ``[..., N]`` in ``x.dtype``. Differentiable in ``x``, the adapters and the base weights.

    Raises:
        ValueError: inconsistent shapes, an adapter id outside ``[-1, L)``, ``scaling`` not of length ``L``, or
            ``adapter_chains`` not of length ``L``.
    """
    return lora_linear_with(_linear, x, weight, bias, lora_a, lora_b, scaling, adapter_ids, adapter_chains)
