"""Routing replay (R3, "Stabilizing MoE RL by aligning training and inference routers", arXiv 2510.11370) for the
TorchTitan side: feed the experts the rollout engine selected into the training forward.

vLLM returns them per completion as ``CompletionOutput.routed_experts`` (``enable_return_routed_experts``; on CPU
through :mod:`vllm_plugin.routing`): ``[len(seq) - 1, layers, top_k]`` int16 — one row per token that went through
the rollout's forward, i.e. every token but the last. The trainer's input for next-token prediction is exactly
``seq[:-1]``, so those rows line up with its positions; positions without a row (padding, or the last token when a
full sequence is scored) are routed afresh (``-1`` rows, :func:`shared_numerics.moe.moe_forward`). Gate weights are
always recomputed from the trainer's own router, so gradients reach it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch

from zerokld_plugins.errors import InvalidRequestError

__all__ = ["captured_routes", "counted_positions", "moe_layers", "pack_routes", "replay_routes"]


def moe_layers(model: torch.nn.Module) -> list:
    """The model's :class:`titan_plugin.overrides.ZeroKLDMoE` blocks in layer order."""
    from .overrides import ZeroKLDMoE

    return [m for m in model.modules() if isinstance(m, ZeroKLDMoE)]


def pack_routes(routed_experts: Sequence, seq_len: int) -> torch.Tensor:
    """Right-pad per-sequence routes into one ``[B, seq_len, layers, top_k]`` int64 tensor, ``-1`` where missing.

    Args:
        routed_experts: ``B`` arrays/tensors ``[n_i, layers, top_k]`` (``n_i <= seq_len``) — vLLM's
            ``CompletionOutput.routed_experts`` of each rollout.
        seq_len: ``T``, the padded length of the batch the model will see.

    Raises:
        ValueError: inconsistent layer / top-k shapes, or a sequence with more rows than ``seq_len``.
    """
    arrays = [torch.as_tensor(np.asarray(r), dtype=torch.int64) for r in routed_experts]
    if not arrays:
        raise InvalidRequestError("no routes given")
    shape = tuple(arrays[0].shape[1:])
    out = torch.full((len(arrays), seq_len, *shape), -1, dtype=torch.int64)
    for i, r in enumerate(arrays):
        if r.dim() != 3 or tuple(r.shape[1:]) != shape:
            raise InvalidRequestError(
                f"routes of sequence {i} have shape {tuple(r.shape)}; expected [n, {shape[0]}, {shape[1]}]"
            )
        if r.shape[0] > seq_len:
            raise InvalidRequestError(f"routes of sequence {i} cover {r.shape[0]} positions; the batch has {seq_len}")
        out[i, : r.shape[0]] = r
    return out


@contextmanager
def replay_routes(model: torch.nn.Module, routes: torch.Tensor | None) -> Iterator[None]:
    """Within the block, every MoE layer of ``model`` uses ``routes[:, :, layer]`` instead of its own top-k.

    Args:
        routes: ``[B, T, layers, top_k]`` int (:func:`pack_routes`); ``None`` does nothing. ``B, T`` must be the
            shape of the token batch the model is called on.

    Raises:
        ValueError: the model has no MoE layers, or the layer count / top-k differ.
    """
    if routes is None:
        yield
        return
    layers = moe_layers(model)
    if not layers:
        raise InvalidRequestError("routing replay needs an MoE model with the zerokld overrides")
    if routes.dim() != 4 or routes.shape[2] != len(layers) or routes.shape[3] != layers[0].router.top_k:
        raise InvalidRequestError(
            f"routes of shape {tuple(routes.shape)} do not fit {len(layers)} MoE layers with top-k "
            f"{layers[0].router.top_k}"
        )
    try:
        for i, layer in enumerate(layers):
            layer.replay_ids = routes[:, :, i]
        yield
    finally:
        for layer in layers:
            layer.replay_ids = None


@contextmanager
def counted_positions(model: torch.nn.Module, masks: Sequence[torch.Tensor] | None) -> Iterator[None]:
    """Within the block, the training forwards of every MoE layer of ``model`` count (TorchTitan's
    ``tokens_per_expert_E``, which its auxiliary-loss-free load balancing turns into the ``expert_bias_E`` update at
    the optimizer step) only the routes of the positions ``masks`` mark: the ``i``-th forward of each layer takes
    ``masks[i]`` (a pipeline stage runs its micro-batches in order). The trainer marks the rollouts' tokens, not
    their padding, so the counts — and the bias — are the same however the batch is padded, split over ranks or
    grouped into calls.

    Args:
        masks: ``[B, L]`` bool, one per training forward in the block, each the shape of its token batch; ``None``
            does nothing (every position counts, as TorchTitan's ``MoE``).

    Raises:
        RuntimeError: (in the forward) more training forwards than masks, or a mask of another shape.
    """
    layers = moe_layers(model) if masks is not None else []
    try:
        for layer in layers:
            layer.count_masks = list(masks)
        yield
    finally:
        for layer in layers:
            layer.count_masks = None


def captured_routes(model: torch.nn.Module) -> torch.Tensor:
    """The expert ids of the model's latest forward: ``[B, T, layers, top_k]`` int64."""
    layers = moe_layers(model)
    if not layers or any(m.last_ids is None for m in layers):
        raise InvalidRequestError("no MoE forward has run on this model")
    return torch.stack([m.last_ids for m in layers], dim=2)
