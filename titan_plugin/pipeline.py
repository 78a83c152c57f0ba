"""Pipeline parallelism for the RL trainer: TorchTitan's stages and schedule, fed rollouts in fixed-shape micro-batches.

TorchTitan splits the model into stages (``pipeline_llm``: the embedding and the first layers on stage 0, the last
layers, the final norm and the lm_head on the last) and builds a ``torch.distributed.pipelining`` schedule (GPipe,
1F1B, Interleaved1F1B) whose stages exchange activations point to point over the ``pp`` mesh dimension. Its
schedule keeps the shapes it inferred at its first step, so :class:`PipelineRunner` lays every batch out the same
way: ``training.local_batch_size`` rollouts per schedule step (micro-batches of ``pipeline_parallel_microbatch_size``
rollouts), each right-padded to ``training.seq_len`` positions; a batch of ``B`` rollouts is ``ceil(B / local)``
schedule steps, the last padded with empty rows (no labels: no loss, zero gradients).

Why the bits equal one rank's:

* forward: each layer runs on the same rows with the same batch-invariant kernels whichever stage holds it, so every
  log-prob is one rank's (padding rows and positions are never read by a real token: causal attention);
* gradients: every stage processes its micro-batches' backward in micro-batch order (GPipe, 1F1B and
  Interleaved1F1B all do), so the exact-accumulation chains (:mod:`titan_plugin.exact_accumulation`) of each stage's
  parameters see the tokens in batch order, as on one rank; the empty rows and padded positions add exact zeros;
* the gradient norm for clipping: every stage's per-parameter norms are gathered in stage order — the one-rank
  list of ``model.parameters()`` — and reduced as ``torch.nn.utils.get_total_norm`` does on one rank
  (:func:`total_grad_norm`), where TorchTitan's ``clip_grad_norm_`` sums the stages' squared norms (other bits).

The schedule's first step infers the stages' shapes by running a forward and backward of real micro-batches (and the
loss). :class:`PipelineRunner` runs that inference itself, before any gradient chain is attached and with the loss
in its metadata mode, so it adds nothing to a step's gradients and consumes no RL inputs.

Source: ``torchtitan/distributed/pipeline_parallel.py`` (``pipeline_llm``, ``_build_pipeline_schedule``),
``torch/distributed/pipelining/schedules.py`` (``step``, ``eval``; the stage initialisation
``_initialize_stage(s)`` is private API of the pinned torch), ``torch/nn/utils/clip_grad.py``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

__all__ = ["EXACT_SCHEDULES", "PipelineRunner", "total_grad_norm"]

#: schedules whose every stage runs its micro-batches' backward in micro-batch order, weight gradients included (the
#: zero-bubble schedules split them off and run them later: refused)
EXACT_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")


class PipelineRunner:
    """A trainer's pipeline schedule, driven with whole padded batches.

    Args:
        schedule: TorchTitan's ``pp_schedule``. model_parts: this rank's stages' modules.
        pp_group: the ``pp`` mesh dimension's process group. last_rank: its group rank holding the last stage.
        local_batch_size: rollouts per schedule step. seq_len: positions per rollout (``training.seq_len``).
        has_first_stage, has_last_stage: whether this rank holds the first / last stage.
    """

    def __init__(
        self,
        schedule,
        model_parts: list[torch.nn.Module],
        pp_group,
        last_rank: int,
        local_batch_size: int,
        seq_len: int,
        has_first_stage: bool,
        has_last_stage: bool,
    ) -> None:
        self.schedule = schedule
        self.model_parts = model_parts
        self.group = pp_group
        self.last_rank = last_rank
        self.local_batch_size = local_batch_size
        self.seq_len = seq_len
        self.first = has_first_stage
        self.last = has_last_stage
        self._ready = False  # the stages are initialised for a step with backward

    # --- layout ---------------------------------------------------------------------------------------------------

    def steps(self, rows: int) -> int:
        """Schedule steps for a batch of ``rows`` rollouts."""
        return max(1, math.ceil(rows / self.local_batch_size))

    def pad(self, t: torch.Tensor | None, value) -> torch.Tensor | None:
        """``[B, T]`` → ``[steps * local_batch_size, seq_len]``, padded with ``value`` (right and below).

        Raises:
            ValueError: ``T`` exceeds ``seq_len``."""
        if t is None:
            return None
        rows, cols = t.shape
        if cols > self.seq_len:
            raise ValueError(
                f"a rollout of {cols} positions does not fit the pipeline's seq_len {self.seq_len} "
                "(rl_trainer_config(seq_len=...))"
            )
        total = self.steps(rows) * self.local_batch_size
        return torch.nn.functional.pad(t, (0, self.seq_len - cols, 0, total - rows), value=value)

    def chunks(self, rows: int) -> Iterator[slice]:
        """The row slices of a padded batch (:meth:`pad` of ``rows`` rollouts) that one schedule step takes each."""
        for i in range(0, self.steps(rows) * self.local_batch_size, self.local_batch_size):
            yield slice(i, i + self.local_batch_size)

    # --- running --------------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _loss(self, loss_fn: Callable | None) -> Iterator[None]:
        """The schedule calls ``loss_fn`` on the last stage within the block (``None``: no loss), its own after."""
        s = self.schedule
        previous, s._loss_fn = s._loss_fn, loss_fn
        try:
            yield
        finally:
            s._loss_fn = previous

    def prepare(self, tokens: torch.Tensor, labels: torch.Tensor, metadata_loss: Callable) -> None:
        """The schedule's shape inference for a step with backward (a forward and backward of the first micro-batch),
        run now — before any chain is attached, outside the MoE layers' counted micro-batches — with
        ``metadata_loss`` as the loss; its stray gradients cleared. :meth:`train` runs it if it has not run."""
        if self._ready:
            return
        s = self.schedule
        mb = self.local_batch_size // s._n_microbatches
        args = (tokens[:mb],) if self.first else ()
        target = labels[:mb] if self.last else None
        with self._loss(metadata_loss):
            for stage in getattr(s, "_stages", None) or [s._stage]:  # as step() does before initialising
                stage.has_backward = s._has_backward
            if hasattr(s, "_initialize_stage"):
                s._initialize_stage(args, {}, target)
            else:
                s._initialize_stages(args, {}, target)
        for part in self.model_parts:
            for p in part.parameters():
                p.grad = None
        self._ready = True

    def train(
        self,
        tokens: torch.Tensor,
        labels: torch.Tensor,
        loss: Callable,
        metadata_loss: Callable,
        attach: Callable[[], None] | None = None,
    ) -> None:
        """One schedule step with backward over ``[local_batch_size, seq_len]`` ``tokens`` / ``labels``;
        ``loss(pred, labels) -> scalar`` is called on the last stage once per micro-batch, in order. ``attach``
        (the gradient chains') runs after the stages' shape inference, right before the step."""
        self.prepare(tokens, labels, metadata_loss)
        if attach is not None:
            attach()
        args = (tokens,) if self.first else ()
        with self._loss(loss):
            self.schedule.step(*args, target=labels if self.last else None, return_outputs=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """The last stage's output for ``[local_batch_size, seq_len]`` ``tokens`` (forward only; ``None`` on the
        other ranks). The next :meth:`train` initialises the stages for backward again."""
        self._ready = False
        args = (tokens,) if self.first else ()
        with self._loss(None):  # eval would score a loss on the last stage: it needs targets
            out = self.schedule.eval(*args)
        return out if self.last else None

    def share(self, obj):
        """``obj`` as the last stage's rank has it, on every rank of the pipeline."""
        box = [obj]
        dist.broadcast_object_list(box, group_src=self.last_rank, group=self.group)
        return box[0]


def total_grad_norm(grads: list[torch.Tensor], group) -> torch.Tensor:
    """The 2-norm of all ``grads`` as one rank computes it for the whole model.

    ``torch.nn.utils.get_total_norm(grads, foreach=True)`` on one rank takes each gradient's norm
    (``torch._foreach_norm``) and the norm of their stack. Here each rank takes its own gradients' norms, the ranks of
    ``group`` (the pipeline's, in stage order) gather them, and the norm of the concatenation is taken — the one-rank
    list in the one-rank order, so the same bits.

    Args:
        grads: float32 gradients (plain tensors), in parameter order. group: the ``pp`` process group.

    Returns:
        A float32 scalar tensor, the same on every rank.
    """
    local = torch.stack(torch._foreach_norm(grads)) if grads else torch.zeros(0)
    parts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, local, group=group)  # uneven lengths: gloo's all_gather needs equal ones
    return torch.linalg.vector_norm(torch.cat(parts))
