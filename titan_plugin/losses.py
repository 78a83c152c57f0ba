"""RL losses as one TorchTitan ``BaseLoss`` that runs any loss registered through the ``zerokld`` hooks.

Unfused, it reads the model's ``[B, T, V]`` logits; fused (``fused=True``), the model skips its lm_head and the loss
calls ``lm_head(hidden, targets=...)`` (:class:`titan_plugin.overrides.ZeroKLDLMHead`) on the completion tokens only —
the same log-prob bits, no ``[tokens, vocab]`` tensor. Per token (Tinker semantics), summed, divided by the global
number of completion tokens (TorchTitan's ``global_valid_tokens``: a token mean over the batch)::

    l_t = selected_logprobs(logits_t, target_t)      # shared_numerics: bitwise what vLLM reports (vocab-parallel
                                                     # on this rank's slice with tp_k_block)
    loss_t, flags_t = token_loss(l_t, q_t, A_t, cfg)   # the registered formula, e.g. ppo (GRPO)

The RL inputs (advantages, sampler log-probs ``q``) are not labels, so the trainer hands them over with
:meth:`RLLoss.set_rl_inputs` right before each step; the loss keeps the training forward's log-probs and the flags in
:attr:`RLLoss.last`. Formulas: :mod:`shared_numerics.losses`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torchtitan.components.loss import IGNORE_INDEX, BaseLoss

from shared_numerics.losses import (
    NORMALIZATIONS,
    CorrectionConfig,
    LossBatch,
    apply_corrections,
    grpo_advantages,
    normalize_loss,
)
from zerokld_plugins import get_loss, resolve
from zerokld_plugins.errors import InvalidRequestError

from .logprobs import logprob_scorer

__all__ = ["RLLoss", "grpo_advantages"]


class RLLoss(BaseLoss):
    @dataclass(kw_only=True, slots=True)
    class Config(BaseLoss.Config):
        loss_fn: str = "ppo"
        loss_fn_config: dict = field(default_factory=dict)
        fused: bool = False
        normalization: str = "token_mean"
        """``token_mean`` (sum / completion tokens of the global batch), ``sum`` (Tinker's raw sum) or ``constant``
        (sum / ``normalizer``, e.g. ``G * L_max`` for Dr.GRPO)."""
        normalizer: float = 1.0
        corrections: dict = field(default_factory=dict)
        """:class:`shared_numerics.losses.CorrectionConfig` fields: ``kl_beta`` (k3 reference KL), ``tis_cap``,
        ``mis_low``/``mis_high`` (masked tokens leave the ``token_mean`` normaliser)."""

    def __init__(self, config: Config, *, compile_config=None):
        self.config = config
        if config.normalization not in NORMALIZATIONS:
            raise InvalidRequestError(f"normalization must be one of {NORMALIZATIONS}, got {config.normalization!r}")
        spec = get_loss(config.loss_fn)  # UnknownNameError at build time, listing the registered losses
        self.token_loss = resolve(spec.token_loss)
        self.loss_cfg = resolve(spec.config_schema).model_validate(config.loss_fn_config)
        self.corrections = CorrectionConfig.model_validate(config.corrections)
        self._inputs: list[tuple] = []  # set_rl_inputs' queue: one entry per call, in order
        self.lm_head: torch.nn.Module | None = None
        self.last: dict = {}

    def set_lm_head(self, lm_head: torch.nn.Module) -> None:
        """The model's lm_head. Fused: called as ``lm_head(hidden [N, H], targets=[N]) -> logprobs [N]``; unfused:
        it names the log-softmax (vocab-parallel under ``tp_k_block``, :func:`titan_plugin.logprobs.logprob_scorer`).
        Without it, unfused log-probs are the TP 1 definition."""
        self.lm_head = lm_head

    def set_rl_inputs(
        self,
        advantages: torch.Tensor,
        sampler_logprobs: torch.Tensor | None,
        ref_logprobs: torch.Tensor | None = None,
        weights: torch.Tensor | None = None,
    ) -> None:
        """Advantages and sampler log-probs for the next step, both ``[B, T]`` aligned with the labels.

        ``sampler_logprobs=None`` means on-policy (``q = stop_gradient(l)``, ratio 1). ``ref_logprobs`` ``[B, T]``:
        reference-policy log-probs for the ``kl_beta`` term. ``weights`` ``[B, T]`` (non-negative; ``None``: 1 on
        every labelled position): each token's loss, KL term included, is multiplied by its weight (Tinker's
        ``weights``); weight-0 tokens are scored but count in neither the ``token_mean`` normaliser nor the
        clipped / grad-zeroed flags, and GSPO's sequence ratio averages over the weighted tokens.

        Calls queue up: each loss call takes the oldest inputs, so a pipeline schedule's micro-batches (the last
        stage calls the loss once per micro-batch, in order) can be given theirs up front.
        """
        self._inputs.append((advantages, sampler_logprobs, ref_logprobs, weights))

    def clear_rl_inputs(self) -> None:
        """Drop queued inputs no call took (a failed step's)."""
        self._inputs.clear()

    @staticmethod
    def metadata_loss(pred: torch.Tensor, labels: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """A scalar that depends on ``pred`` (zero gradients), for a pipeline schedule's shape inference
        (:mod:`titan_plugin.pipeline`): it takes no RL inputs and records nothing."""
        return pred.float().sum() * 0.0

    def __call__(self, pred: torch.Tensor, labels: torch.Tensor, global_valid_tokens=None, **kwargs):
        if not self._inputs:
            raise RuntimeError("RLLoss needs set_rl_inputs(advantages, sampler_logprobs) before each step")
        adv_all, sampler_all, ref_all, weights_all = self._inputs.pop(0)
        mask = labels != IGNORE_INDEX
        if self.config.fused:
            if self.lm_head is None:
                raise RuntimeError("fused RLLoss needs set_lm_head(model.lm_head) and a model run with _skip_lm_head")
            logp = self.lm_head(self.lm_head.fused_input(pred)[mask], targets=labels[mask])
        else:  # vocab-parallel logits: this rank's slice (the lm_head's vocab_parallel) or gathered
            pred, score = logprob_scorer(pred, self.lm_head)
            logp = score(pred[mask], labels[mask])
        q = logp.detach() if sampler_all is None else sampler_all.to(pred.device)[mask]
        adv = adv_all.to(pred.device)[mask]
        w = None if weights_all is None else weights_all.to(device=pred.device, dtype=torch.float32)[mask]
        batch = LossBatch(seq_ids=torch.nonzero(mask)[:, 0], num_seqs=mask.shape[0], weights=w)
        tok_loss, flags = self.token_loss(logp, q, adv, self.loss_cfg, batch)
        ref = None if ref_all is None else ref_all.to(pred.device)[mask]
        tok_loss, keep = apply_corrections(tok_loss, logp, q, self.corrections, ref)
        weighted = torch.ones_like(mask[mask]) if w is None else w > 0
        if w is not None:
            tok_loss = tok_loss * w
        keep = keep & weighted
        kept = None if global_valid_tokens is None else global_valid_tokens - int((~keep).sum())  # masked tokens
        loss = normalize_loss(tok_loss.sum(), self.config.normalization, kept, self.config.normalizer)
        zeros = torch.zeros_like(weighted)
        self.last = {
            "train_logprobs": logp.detach(),
            "mask": mask,
            "weighted": weighted,
            "kept": int(keep.sum()),
            "token_losses": tok_loss.detach(),
            "clipped": flags.get("clipped", zeros) & weighted,
            "grad_zeroed": flags.get("grad_zeroed", zeros) & weighted,
            "loss": loss.detach(),
        }
        return loss, {}
