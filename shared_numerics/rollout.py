"""The typed batch of rollouts the trainer consumes: :class:`RolloutBatch`.

Built once from the rollout engine's outputs (:meth:`RolloutBatch.from_vllm` reads vLLM ``RequestOutput`` s, offline
or as OpenAI ``/v1/completions`` JSON choices through :meth:`RolloutBatch.from_openai`) and consumed as is by
``RLTrainer.rl_step`` / ``forward_backward`` and ``TrainingClient.forward_backward``. It carries what the step needs
(tokens, loss mask, advantages, sampler log-probs, MoE routes) and what makes it checkable: the snapshot identity the
engine served and the engine's :class:`shared_numerics.NumericsMode`. :meth:`RolloutBatch.check_numerics` refuses a
batch sampled under other numerics than the trainer's before anything is computed.

:meth:`RolloutBatch.pack` is the one packing of rollouts into the next-token training layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from zerokld_plugins.errors import InvalidRequestError

from .mode import NumericsMode, check_same_numerics

__all__ = ["IGNORE_INDEX", "RolloutBatch", "common_numerics", "decode_routes"]

IGNORE_INDEX = -100  # label of positions without a loss (torch cross-entropy's / TorchTitan's ``IGNORE_INDEX``)


def _completion_logprobs(completion) -> torch.Tensor:
    if completion.logprobs is None:
        raise InvalidRequestError("rollout has no logprobs: sample with SamplingParams(logprobs=0)")
    return torch.tensor(
        [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids, strict=True)], dtype=torch.float32
    )


def decode_routes(encoded: str):
    """Routes as vLLM encodes them (``routed_experts`` of a completion choice, and zerokld's per-row
    ``routing_matrix``): base64 of an array's ``.npy`` bytes (``vllm.utils.serial_utils.numpy2base64``) -> the numpy
    array (no pickles).

    Raises:
        ValueError: not base64 (``binascii.Error``, a ValueError) or not ``.npy`` bytes; EOFError: empty bytes.
    """
    import base64
    import io

    import numpy as np

    return np.load(io.BytesIO(base64.b64decode(encoded, validate=True)), allow_pickle=False)


@dataclass
class RolloutBatch:
    """``B`` rollouts.

    Attributes:
        sequences: ``B`` lists of token ids, prompt + completion.
        prompt_lengths: ``B`` ints in ``[1, len(seq)]``; the completion (the loss mask) is ``seq[p:]``.
        advantages: ``B`` entries, a float (broadcast over the completion) or a float ``[len(seq) - p]`` tensor;
            ``None`` = zeros (set them later with ``dataclasses.replace(batch, advantages=...)``,
            which validates them).
        sampler_logprobs: ``B`` float32 ``[len(seq) - p]`` tensors, the engine's log-probs of the sampled tokens;
            ``None`` = on-policy (ratio 1: SFT, or a loss that ignores them).
        routed_experts: MoE: ``B`` arrays ``[len(seq) - 1, layers, top_k]`` (vLLM ``routed_experts``); else ``None``.
        loss_weights: ``B`` float32 ``[len(seq) - p]`` tensors, finite and non-negative: each completion token's loss
            is multiplied by its weight (Tinker's ``loss_fn_inputs["weights"]``: any mask — several completion
            segments of a multi-turn episode, tool outputs at 0); ``None`` = every completion token weighs 1.
        ref_logprobs: ``B`` float32 ``[len(seq) - p]`` tensors, the reference policy's log-probs of the completion
            tokens (e.g. the base model's, :func:`titan_plugin.lora.disable_adapter`), for the loss's k3 KL term
            (``kl_beta``); ``None`` = not given.
        snapshot_identity: the weights that produced the rollouts (hot-load identity, ``x-zerokld-snapshot-identity``).
        numerics: the engine's :class:`NumericsMode` (``None``: the engine stamped none, i.e. ran without zerokld).

    Raises (constructor):
        ValueError: list lengths differ, a prompt length is out of range, or a per-token tensor has the wrong length.
    """

    sequences: list[list[int]]
    prompt_lengths: list[int]
    advantages: list | None = None
    sampler_logprobs: list[torch.Tensor] | None = None
    routed_experts: list | None = None
    snapshot_identity: str | None = None
    numerics: NumericsMode | None = None
    loss_weights: list[torch.Tensor] | None = None
    ref_logprobs: list[torch.Tensor] | None = None

    def __post_init__(self) -> None:
        n = len(self.sequences)
        if not n:
            raise InvalidRequestError("empty rollout batch")
        for name in (
            "prompt_lengths",
            "advantages",
            "sampler_logprobs",
            "routed_experts",
            "loss_weights",
            "ref_logprobs",
        ):
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise InvalidRequestError(f"{name} has {len(value)} entries for {n} rollouts")
        for i, (s, p) in enumerate(zip(self.sequences, self.prompt_lengths, strict=True)):
            if not 1 <= p <= len(s):
                raise InvalidRequestError(f"rollout {i}: prompt length {p} outside [1, {len(s)}]")
            if self.advantages is not None:
                a = self.advantages[i]
                if isinstance(a, torch.Tensor) and a.numel() != len(s) - p:
                    raise InvalidRequestError(f"rollout {i}: {a.numel()} advantages for {len(s) - p} completion tokens")
            for name in ("sampler_logprobs", "ref_logprobs"):
                lp = getattr(self, name)
                if lp is not None and lp[i].numel() != len(s) - p:
                    raise InvalidRequestError(
                        f"rollout {i}: {lp[i].numel()} {name.replace('_', ' ')} for {len(s) - p} completion tokens"
                    )
            if self.loss_weights is not None:
                w = self.loss_weights[i]
                if w.numel() != len(s) - p:
                    raise InvalidRequestError(
                        f"rollout {i}: {w.numel()} loss weights for {len(s) - p} completion tokens"
                    )
                if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
                    raise InvalidRequestError(f"rollout {i}: loss weights must be finite and non-negative")
        if isinstance(self.numerics, dict):
            self.numerics = NumericsMode.from_dict(self.numerics)

    def __len__(self) -> int:
        return len(self.sequences)

    @classmethod
    def from_vllm(
        cls, outputs: Sequence[Any], advantages: list | None = None, snapshot_identity: str | None = None
    ) -> RolloutBatch:
        """From vLLM ``RequestOutput`` s (``LLM.generate``; first completion of each), sampled with
        ``SamplingParams(logprobs=0)``. Reads ``prompt_token_ids``, ``outputs[0].token_ids`` / ``logprobs`` /
        ``routed_experts`` and the zerokld stamp ``outputs[0].zerokld_numerics``.

        Raises:
            ValueError: no logprobs, or the outputs carry different numerics modes.
        """
        comps = [o.outputs[0] for o in outputs]
        routes = (
            [c.routed_experts for c in comps]
            if all(getattr(c, "routed_experts", None) is not None for c in comps)
            else None
        )
        return cls(
            sequences=[list(o.prompt_token_ids) + list(c.token_ids) for o, c in zip(outputs, comps, strict=True)],
            prompt_lengths=[len(o.prompt_token_ids) for o in outputs],
            advantages=advantages,
            sampler_logprobs=[_completion_logprobs(c) for c in comps],
            routed_experts=routes,
            snapshot_identity=snapshot_identity,
            numerics=common_numerics([getattr(c, "zerokld_numerics", None) for c in comps]),
        )

    @classmethod
    def from_openai(
        cls,
        prompts: Sequence[Sequence[int]],
        choices: Sequence[dict],
        advantages: list | None = None,
        snapshot_identity: str | None = None,
    ) -> RolloutBatch:
        """From ``/v1/completions`` JSON choices (one per prompt, in order; requested with ``logprobs: 0`` and either
        ``return_token_ids: true`` or ``return_tokens_as_token_ids: true``): the completion's token ids, its
        ``logprobs.token_logprobs``, vLLM's ``routed_experts`` (base64 ``.npy``) if present and the zerokld stamp
        ``zerokld_numerics``. ``snapshot_identity``: the response's ``x-zerokld-snapshot-identity`` header.

        Raises:
            ValueError: a choice lacks token ids or logprobs, or the choices carry different numerics modes.
        """
        if len(prompts) != len(choices):
            raise InvalidRequestError(f"{len(prompts)} prompts for {len(choices)} choices")
        seqs, lps, routes = [], [], []
        for p, c in zip(prompts, choices, strict=True):
            logprobs = c.get("logprobs") or {}
            ids = c.get("token_ids")
            if ids is None and all(str(t).startswith("token_id:") for t in logprobs.get("tokens") or [None]):
                ids = [int(str(t).split(":", 1)[1]) for t in logprobs["tokens"]]
            if ids is None or logprobs.get("token_logprobs") is None:
                raise InvalidRequestError(
                    "choice without token ids or logprobs: request logprobs and return_token_ids "
                    "(or return_tokens_as_token_ids)"
                )
            seqs.append(list(p) + [int(t) for t in ids])
            lps.append(torch.tensor(logprobs["token_logprobs"], dtype=torch.float32))
            r = c.get("routed_experts")
            routes.append(decode_routes(r) if isinstance(r, str) else r)
        return cls(
            sequences=seqs,
            prompt_lengths=[len(p) for p in prompts],
            advantages=advantages,
            sampler_logprobs=lps,
            routed_experts=routes if all(r is not None for r in routes) else None,
            snapshot_identity=snapshot_identity,
            numerics=common_numerics([c.get("zerokld_numerics") for c in choices]),
        )

    def select(self, indices: Sequence[int]) -> RolloutBatch:
        """The rollouts at ``indices`` (in that order) as a batch with the same identity and numerics stamp: a
        micro-batch of this batch.

        Raises:
            IndexError: an index outside ``[-B, B)``; ValueError: no index.
        """

        def pick(values):
            return None if values is None else [values[i] for i in indices]

        return replace(
            self,
            sequences=pick(self.sequences),
            prompt_lengths=pick(self.prompt_lengths),
            advantages=pick(self.advantages),
            sampler_logprobs=pick(self.sampler_logprobs),
            routed_experts=pick(self.routed_experts),
            loss_weights=pick(self.loss_weights),
            ref_logprobs=pick(self.ref_logprobs),
        )

    def check_numerics(self, trainer: NumericsMode) -> None:
        """Refuse rollouts sampled under other numerics than ``trainer``'s.

        Raises:
            shared_numerics.NumericsMismatchError: naming both modes (nothing has been computed).
        """
        check_same_numerics(trainer, self.numerics, "the trainer", "rollout batch")

    def pack(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The next-token training layout, right-padded to ``T = max(len(seq)) - 1``: ``tokens [B, T]`` int64
        (inputs), ``labels [B, T]`` int64 (the next token on completion positions, :data:`IGNORE_INDEX` elsewhere:
        the loss mask), ``advantages [B, T]`` and sampler log-probs ``[B, T]`` float32 (zeros outside completions;
        zeros when not given), and the loss weights ``[B, T]`` float32 (0 outside completions; ``None`` when the
        batch has no ``loss_weights``: every completion token weighs 1)."""
        n, t = len(self), max(len(s) for s in self.sequences) - 1
        tokens = torch.zeros(n, t, dtype=torch.long)
        labels = torch.full((n, t), IGNORE_INDEX, dtype=torch.long)
        adv, q = torch.zeros(n, t), torch.zeros(n, t)
        weights = None if self.loss_weights is None else torch.zeros(n, t)
        for i, (s, p) in enumerate(zip(self.sequences, self.prompt_lengths, strict=True)):
            st = torch.tensor(s, dtype=torch.long)
            tokens[i, : len(s) - 1] = st[:-1]
            labels[i, p - 1 : len(s) - 1] = st[p:]
            if self.advantages is not None:
                a = self.advantages[i]
                adv[i, p - 1 : len(s) - 1] = a if isinstance(a, torch.Tensor) else float(a)
            if self.sampler_logprobs is not None:
                q[i, p - 1 : len(s) - 1] = self.sampler_logprobs[i]
            if weights is not None and self.loss_weights is not None:
                weights[i, p - 1 : len(s) - 1] = self.loss_weights[i]
        return tokens, labels, adv, q, weights

    def pack_ref(self) -> torch.Tensor | None:
        """The reference log-probs in :meth:`pack`'s layout: ``[B, T]`` float32, zeros outside completions;
        ``None`` when the batch has no ``ref_logprobs``."""
        if self.ref_logprobs is None:
            return None
        ref = torch.zeros(len(self), max(len(s) for s in self.sequences) - 1)
        for i, (s, p) in enumerate(zip(self.sequences, self.prompt_lengths, strict=True)):
            ref[i, p - 1 : len(s) - 1] = self.ref_logprobs[i]
        return ref

    def padded_tokens(self, pad_id: int = 0) -> torch.Tensor:
        """``[B, max(len(seq))]`` int64, each whole sequence right-padded with ``pad_id`` (the scoring layout:
        position ``j`` predicts ``j + 1``)."""
        tokens = torch.full((len(self), max(len(s) for s in self.sequences)), pad_id, dtype=torch.long)
        for i, s in enumerate(self.sequences):
            tokens[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        return tokens


def common_numerics(stamps: list) -> NumericsMode | None:
    """The one mode every stamp (a :class:`NumericsMode` dict, or ``None`` = unstamped) names; ``None`` for none.

    Raises:
        ValueError: the stamps name different modes (stamped and unstamped rollouts mixed included).
    """
    modes = {None if s is None else NumericsMode.from_dict(s) for s in stamps}
    if len(modes) > 1:
        raise InvalidRequestError(f"rollouts from different numerics modes in one batch: {sorted(map(str, modes))}")
    return modes.pop() if modes else None
