"""Per-token RL loss formulas (Tinker semantics: per token, summed; normalisation is the caller's named choice).

Every loss here depends only on per-token quantities — the trainer's log-prob ``l`` of the target token (from
:func:`shared_numerics.selected_logprobs`, bitwise what vLLM reported), the sampler's log-prob ``q``, the advantage
``A`` — and returns ``(loss [N], flags)`` where ``flags`` holds boolean ``[N]`` tensors such as ``clipped`` (ratio
outside the bounds) and ``grad_zeroed`` (the clipped branch was taken: no gradient). ``r = exp(l - q)``.

| name                    | per-token loss                                    | source                                |
|-------------------------|---------------------------------------------------|---------------------------------------|
| ``cross_entropy``       | ``-w * l`` (``w`` = the advantages)               | SFT                                   |
| ``importance_sampling`` | ``-r * A``                                        | Tinker ``importance_sampling``        |
| ``ppo``                 | ``-min(r A, clip(r, lo, hi) A)``                  | PPO (Schulman 2017); GRPO (Shao 2024) |
| ``dapo``                | ``ppo`` with clip-higher (0.8, 1.28)              | Yu et al. 2025 (DAPO)                 |
| ``dr_grpo``             | ``ppo``; advantages not std-scaled, sum / (G L)   | Liu et al. 2025 (Dr. GRPO)            |
| ``gspo``                | ``-min(s A, clip(s, 1-lo, 1+hi) A)`` per token,   | Zheng et al. 2025 (GSPO), token form  |
|                         | ``s = sg(exp(mean_seq(l - q))) * exp(l - sg(l))`` |                                       |
| ``cispo``               | ``-sg(clip(r, lo, hi)) * A * l``                  | MiniMax-M1 2025 (CISPO)               |
| ``dro``                 | ``-(l A - beta/2 (l - q)^2)``                     | Richemond et al. 2024 (DRO)           |

Normalisation (token mean over the global batch, plain sum, or a constant such as ``G * L_max`` for Dr.GRPO) is a
separate, named choice of the caller (:class:`titan_plugin.losses.RLLoss`).

The registrations (name, formula, config schema) go through the ``zerokld`` pluggy hooks
(:mod:`shared_numerics.hooks`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict

from zerokld_plugins.errors import InvalidRequestError

__all__ = [
    "CorrectionConfig",
    "apply_corrections",
    "dapo_dynamic_sampling_keep",
    "overlong_penalty",
    "CISPOConfig",
    "DROConfig",
    "GSPOConfig",
    "LossBatch",
    "NoConfig",
    "PPOConfig",
    "cispo_loss",
    "cross_entropy_loss",
    "DAPOConfig",
    "dro_loss",
    "dr_grpo_advantages",
    "grpo_advantages",
    "gspo_loss",
    "importance_sampling_loss",
    "NORMALIZATIONS",
    "normalize_loss",
    "ppo_loss",
]


@dataclass(frozen=True)
class LossBatch:
    """Per-token context a loss may need beyond ``(l, q, A)``: ``seq_ids [N]`` int64 (which sequence each token
    belongs to, ``0..num_seqs-1``), ``num_seqs`` and ``weights`` (``[N]`` float32, non-negative: Tinker's per-token
    loss weights, the loss mask; ``None`` = every token weighs 1). The caller multiplies each token's loss by its
    weight; a formula with a sequence-level term (GSPO's sequence ratio) averages it with these weights."""

    seq_ids: torch.Tensor
    num_seqs: int
    weights: torch.Tensor | None = None

    @staticmethod
    def single(n: int, device=None) -> LossBatch:
        return LossBatch(torch.zeros(n, dtype=torch.long, device=device), 1)


def segment_mean(
    values: torch.Tensor, seq_ids: torch.Tensor, num_seqs: int, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-sequence (weighted) mean of ``values [N]`` (``seq_ids [N]`` in ``0..num_seqs-1``), float32
    ``[num_seqs]``: ``sum(w v) / sum(w)`` per sequence, ``w = weights [N]`` (``None``: ones, the plain mean).

    Deterministic on every device, in float64. On CPU each sequence's sum runs over its own tokens in order
    (``index_add_``, sequential there), so a sequence's mean has the same bits in any batch — what the trainer's exact
    accumulation over micro-batches needs. Elsewhere (``index_add_`` on CUDA adds in arrival order) tokens are grouped
    by a stable sort, summed by one float64 prefix sum (a scan, no atomics), and each sequence's sum is a difference
    of two prefix sums. Sequences without tokens (or with zero total weight) get 0."""
    counts = torch.bincount(seq_ids, minlength=num_seqs)

    def sums(x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":
            return x.new_zeros(num_seqs, dtype=torch.float64).index_add_(0, seq_ids, x.double())
        order = torch.sort(seq_ids, stable=True).indices
        ends = torch.cumsum(counts, 0)
        prefix = torch.cat([x.new_zeros(1, dtype=torch.float64), torch.cumsum(x[order].double(), 0)])
        return prefix[ends] - prefix[ends - counts]

    if weights is None:
        return (sums(values) / counts.clamp(min=1)).float()
    w = weights.to(values.device)
    total = sums(w)
    return torch.where(total > 0, sums(values * w) / torch.where(total > 0, total, 1.0), 0.0).float()


class NoConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PPOConfig(BaseModel):
    """Absolute ratio bounds (Tinker's names)."""

    model_config = ConfigDict(extra="forbid")
    clip_low_threshold: float = 0.8
    clip_high_threshold: float = 1.2


class CISPOConfig(PPOConfig):
    clip_low_threshold: float = 0.0
    clip_high_threshold: float = 4.0


class GSPOConfig(BaseModel):
    """Clip range around 1 for the sequence ratio: ``[1 - clip_low, 1 + clip_high]``."""

    model_config = ConfigDict(extra="forbid")
    clip_low: float = 0.2
    clip_high: float = 0.2


class DROConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    beta: float = 0.05


class DAPOConfig(PPOConfig):
    """DAPO's clip-higher bounds."""

    clip_high_threshold: float = 1.28


def grpo_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """Group-normalised advantages ``(R - mean_group) / (std_group + eps)`` (population std).

    Args:
        rewards: ``[N]``, ``N`` a multiple of ``group_size``; consecutive rows form a group (same prompt).

    Returns:
        ``[N]`` float32; a group whose rewards are all equal gets zeros.
    """
    r = rewards.float().reshape(-1, group_size)
    a = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, unbiased=False, keepdim=True) + eps)
    return a.reshape(-1)


def dr_grpo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Dr.GRPO advantages: ``R - mean_group`` (no std scaling)."""
    r = rewards.float().reshape(-1, group_size)
    return (r - r.mean(dim=1, keepdim=True)).reshape(-1)


def _no_flags(x: torch.Tensor) -> dict[str, torch.Tensor]:
    z = torch.zeros_like(x, dtype=torch.bool)
    return {"clipped": z, "grad_zeroed": z}


def cross_entropy_loss(logp, sampler_logp, adv, cfg: NoConfig, batch: LossBatch | None = None):
    """``-w * l`` with the per-token weights passed as advantages."""
    return -adv * logp, _no_flags(logp)


def importance_sampling_loss(logp, sampler_logp, adv, cfg: NoConfig, batch: LossBatch | None = None):
    """``-exp(l - q) * A``."""
    return -torch.exp(logp - sampler_logp) * adv, _no_flags(logp)


def ppo_loss(logp, sampler_logp, adv, cfg: PPOConfig, batch: LossBatch | None = None):
    """``-min(r A, clip(r, lo, hi) A)`` with ``r = exp(l - q)``; flags ``clipped`` and ``grad_zeroed``."""
    lo, hi = cfg.clip_low_threshold, cfg.clip_high_threshold
    ratio = torch.exp(logp - sampler_logp)
    unclipped = ratio * adv
    clipped = ratio.clamp(lo, hi) * adv
    outside = (ratio < lo) | (ratio > hi)
    return -torch.minimum(unclipped, clipped), {"clipped": outside, "grad_zeroed": outside & (clipped < unclipped)}


def cispo_loss(logp, sampler_logp, adv, cfg: CISPOConfig, batch: LossBatch | None = None):
    """``-sg(clip(r, lo, hi)) * A * l``: every token keeps a gradient; the clipped weight only scales it."""
    ratio = torch.exp(logp - sampler_logp)
    lo, hi = cfg.clip_low_threshold, cfg.clip_high_threshold
    outside = (ratio < lo) | (ratio > hi)
    w = ratio.clamp(lo, hi).detach()
    return -w * adv * logp, {"clipped": outside, "grad_zeroed": torch.zeros_like(outside)}


def dro_loss(logp, sampler_logp, adv, cfg: DROConfig, batch: LossBatch | None = None):
    """``-(l A - beta/2 (l - q)^2)``."""
    return -(logp * adv - 0.5 * cfg.beta * (logp - sampler_logp) ** 2), _no_flags(logp)


def gspo_loss(logp, sampler_logp, adv, cfg: GSPOConfig, batch: LossBatch | None = None):
    """GSPO token form: the sequence ratio ``s = exp(mean over the sequence of (l - q))`` carries the value, each
    token's ``exp(l - sg(l))`` carries the gradient; clipping (``[1 - clip_low, 1 + clip_high]``) is per sequence.
    The mean is weighted by ``batch.weights`` (the loss mask) when given: masked tokens (weight 0) do not enter it."""
    batch = batch or LossBatch.single(logp.numel(), logp.device)
    d = (logp - sampler_logp).detach()
    mean_d = segment_mean(d, batch.seq_ids.to(d.device), batch.num_seqs, batch.weights)
    s_seq = torch.exp(mean_d)[batch.seq_ids]
    s_tok = s_seq * torch.exp(logp - logp.detach())
    lo, hi = 1.0 - cfg.clip_low, 1.0 + cfg.clip_high
    unclipped = s_tok * adv
    clipped = s_tok.clamp(lo, hi) * adv
    outside = (s_seq < lo) | (s_seq > hi)
    return -torch.minimum(unclipped, clipped), {"clipped": outside, "grad_zeroed": outside & (clipped < unclipped)}


class CorrectionConfig(BaseModel):
    """Loss-independent per-token terms, applied after the loss formula (all off by default).

    Attributes:
        kl_beta: weight of the k3 reference-KL term ``beta * (exp(ref - l) - (ref - l) - 1)`` (needs reference
            log-probs; Schulman 2020 "Approximating KL Divergence"; GRPO's KL penalty).
        tis_cap: truncated importance sampling: multiply each token's loss by ``min(exp(sg(l) - q), tis_cap)``, the
            train/inference correction of Yao et al. 2025 ("Your efficient RL framework secretly brings you
            off-policy RL training").
        mis_low, mis_high: masked importance sampling: drop tokens whose ``exp(sg(l) - q)`` lies outside
            ``[mis_low, mis_high]``; dropped tokens leave the normaliser too.
    """

    model_config = ConfigDict(extra="forbid")
    kl_beta: float = 0.0
    tis_cap: float | None = None
    mis_low: float | None = None
    mis_high: float | None = None


def apply_corrections(
    tok_loss: torch.Tensor,
    logp: torch.Tensor,
    sampler_logp: torch.Tensor,
    cfg: CorrectionConfig,
    ref_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply :class:`CorrectionConfig` to a per-token loss.

    Returns:
        ``(loss [N], keep [N] bool)``: masked tokens have loss 0 and ``keep`` False (exclude them from the normaliser).

    Raises:
        ValueError: ``kl_beta > 0`` without reference log-probs.
    """
    keep = torch.ones_like(logp, dtype=torch.bool)
    ratio = torch.exp(logp.detach() - sampler_logp)
    if cfg.tis_cap is not None:
        tok_loss = tok_loss * ratio.clamp(max=cfg.tis_cap)
    if cfg.mis_low is not None or cfg.mis_high is not None:
        lo = cfg.mis_low if cfg.mis_low is not None else 0.0
        hi = cfg.mis_high if cfg.mis_high is not None else float("inf")
        keep = (ratio >= lo) & (ratio <= hi)
        tok_loss = torch.where(keep, tok_loss, torch.zeros((), dtype=tok_loss.dtype))
    if cfg.kl_beta:
        if ref_logp is None:
            raise InvalidRequestError("kl_beta > 0 needs reference log-probs")
        d = ref_logp - logp
        tok_loss = tok_loss + cfg.kl_beta * torch.where(keep, torch.exp(d) - d - 1, torch.zeros((), dtype=d.dtype))
    return tok_loss, keep


def dapo_dynamic_sampling_keep(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """DAPO dynamic sampling: ``[N]`` bool, False for every member of a group whose rewards are all equal (zero
    advantage, no learning signal); the caller refills the batch with other groups. Yu et al. 2025 (DAPO) §3.2."""
    r = rewards.float().reshape(-1, group_size)
    informative = r.amax(dim=1) != r.amin(dim=1)
    return informative.repeat_interleave(group_size)


def overlong_penalty(lengths: torch.Tensor, max_length: int, cache_length: int) -> torch.Tensor:
    """DAPO soft overlong punishment added to the reward: 0 up to ``max_length - cache_length`` tokens, then a linear
    ramp to -1 at ``max_length``, -1 beyond. Yu et al. 2025 (DAPO) eq. 13."""
    lengths = lengths.float()
    start = max_length - cache_length
    ramp = (start - lengths) / cache_length
    return torch.where(
        lengths <= start, torch.zeros_like(lengths), torch.where(lengths <= max_length, ramp, -torch.ones_like(lengths))
    )


NORMALIZATIONS = ("token_mean", "sum", "constant")


def normalize_loss(
    loss_sum: torch.Tensor, normalization: str, num_tokens=None, normalizer: float = 1.0
) -> torch.Tensor:
    """Turn the summed token losses of a (micro)batch into the step's loss.

    Args:
        loss_sum: scalar, the sum of the per-token losses (after :func:`apply_corrections`).
        normalization: ``"token_mean"`` (divide by ``num_tokens``, the completion tokens of the *global* batch that
            kept their loss — DAPO's token-level mean, TorchTitan's ``global_valid_tokens``), ``"sum"`` (Tinker's
            raw sum; the caller owns the scale) or ``"constant"`` (divide by ``normalizer``, e.g. ``G * L_max`` for
            Dr.GRPO).
        num_tokens: int or scalar tensor, for ``token_mean``; ``None`` leaves the sum (TorchTitan divides later).
        normalizer: for ``constant``.

    Raises:
        ValueError: unknown ``normalization``.
    """
    if normalization not in NORMALIZATIONS:
        raise InvalidRequestError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")
    if normalization == "token_mean" and num_tokens is not None:
        return loss_sum / torch.as_tensor(num_tokens).clamp(min=1)
    if normalization == "constant":
        return loss_sum / normalizer
    return loss_sum
