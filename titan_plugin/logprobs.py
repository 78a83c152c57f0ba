"""``trainer_logprobs``: the trainer-side log-probs of completion tokens, from TorchTitan's model on zerokld ops."""

from __future__ import annotations

import torch

import shared_numerics as sn
from shared_numerics.rollout import RolloutBatch

from .models import build_titan_model
from .routing import pack_routes, replay_routes

__all__ = ["completion_logprobs", "logprob_scorer", "sequence_logprobs", "trainer_logprobs"]


def logprob_scorer(logits: torch.Tensor, lm_head: torch.nn.Module | None):
    """How the trainer turns its model's logits into selected-token log-probs (the plain and the loss path alike).
    The definition is the model's own, read from its lm_head, so the unfused path cannot disagree with the fused one
    (:class:`titan_plugin.overrides.ZeroKLDLMHead`).

    Args:
        logits: ``[..., V]`` tensor, or under tensor parallelism the lm_head's DTensor (``Shard(-1)``: vocab-parallel).
        lm_head: the model's lm_head. Its ``vocab_parallel`` set (:func:`titan_plugin.overrides.set_tp_k_block`,
            :attr:`shared_numerics.NumericsMode.tp_k_block`): the vocab-parallel log-softmax
            (:mod:`shared_numerics.vocab_parallel`, the definition vLLM's sampler uses under ``tp_k_block``) on this
            rank's vocabulary slice, no gathered logits. Otherwise (or ``None``): the logits gathered and
            :func:`shared_numerics.selected_logprobs` (TP 1 numerics; a stock TP trainer).

    Returns:
        ``(local_logits [..., V_local], score)`` with ``score(rows [N, V_local], token_ids [N]) -> [N]`` float32
        log-probs, differentiable; ``rows`` are rows of ``local_logits``.
    """
    import functools

    import shared_numerics.vocab_parallel as sn_vocab

    is_dtensor = hasattr(logits, "full_tensor")
    if not getattr(lm_head, "vocab_parallel", False):  # the logits gathered (differentiable) when vocab-parallel
        return (logits.full_tensor() if is_dtensor else logits), sn.selected_logprobs
    if not is_dtensor:
        return logits, sn_vocab.selected_logprobs
    from .tensor_parallel import vocab_shard

    local, kwargs = vocab_shard(logits)
    return local, functools.partial(sn_vocab.selected_logprobs, **kwargs)


def sequence_logprobs(
    model: torch.nn.Module,
    token_ids: list[list[int]],
    prompt_lengths: list[int],
    pad_id: int = 0,
    fused: bool = False,
    routed_experts=None,
) -> list[torch.Tensor]:
    """Per-sequence float32 log-probs of the tokens after each prompt, from one right-padded batch forward. The
    log-softmax is the one ``model.lm_head`` names (:func:`logprob_scorer`): vocab-parallel when the model was built
    with ``tp_k_block``.

    Args:
        model: a TorchTitan decoder (``model(tokens [B, T]) -> logits [B, T, V]``).
        token_ids: ``B`` sequences (prompt + completion) of token ids.
        prompt_lengths: ``B`` prompt lengths, each ``>= 1`` and ``<= len(seq)``.
        pad_id: id used to right-pad (never read: causal attention, pad positions are after every real token).
        fused: skip the model's lm_head and score only the completion tokens with the fused lm_head
            (``lm_head(h, targets=...)``, :class:`titan_plugin.overrides.ZeroKLDLMHead`); same bits.
        routed_experts: MoE models: per sequence, the rollout's ``[len(seq) - 1, layers, top_k]`` expert ids
            (vLLM ``CompletionOutput.routed_experts``) to replay instead of recomputing top-k
            (:mod:`titan_plugin.routing`); ``None`` routes afresh.

    Returns:
        ``B`` tensors, sequence ``i`` of shape ``[len(seq_i) - prompt_lengths[i]]``; entry ``j`` is
        ``log p(seq[p + j] | seq[:p + j])`` with ``p = prompt_lengths[i]``.

    Raises:
        ValueError: a prompt length outside ``[1, len(seq)]``.
    """
    tokens = RolloutBatch(token_ids, prompt_lengths).padded_tokens(pad_id)  # validates the lengths
    t = tokens.shape[1]
    routes = None if routed_experts is None else pack_routes(routed_experts, t)
    if fused:
        skip = getattr(model, "_skip_lm_head", False)  # a fused RLTrainer keeps it on; leave it as found
        model._skip_lm_head = True
        try:
            with replay_routes(model, routes):
                hidden = model(tokens)
        finally:
            model._skip_lm_head = skip
        return completion_logprobs(hidden, tokens, token_ids, prompt_lengths, model.lm_head, fused=True)
    with replay_routes(model, routes):
        logits = model(tokens)
    return completion_logprobs(logits, tokens, token_ids, prompt_lengths, model.lm_head)


def completion_logprobs(
    output: torch.Tensor,
    tokens: torch.Tensor,
    token_ids: list[list[int]],
    prompt_lengths: list[int],
    lm_head: torch.nn.Module | None,
    fused: bool = False,
) -> list[torch.Tensor]:
    """The completion tokens' log-probs from a decoder's output over right-padded ``tokens`` (the rows of
    :func:`sequence_logprobs`, also a pipeline's last stage's, :mod:`titan_plugin.pipeline`).

    Args:
        output: ``[B', T', V]`` logits or, ``fused``, ``[B', T', H]`` final hidden states (``B' >= B``,
            ``T' >= max len``: padding rows and positions are not read). tokens: ``[B', T']`` int64.
        token_ids, prompt_lengths: the ``B`` sequences and their prompt lengths.
        lm_head: the model's lm_head (fused: it scores the hidden states; unfused: it names the log-softmax,
            :func:`logprob_scorer`).

    Returns:
        As :func:`sequence_logprobs`.
    """
    if fused:
        hidden = lm_head.fused_input(output)
        return [
            lm_head(hidden[i, p - 1 : len(s) - 1], targets=tokens[i, p : len(s)])
            for i, (s, p) in enumerate(zip(token_ids, prompt_lengths, strict=True))
        ]
    logits, score = logprob_scorer(output, lm_head)
    return [
        score(logits[i, p - 1 : len(s) - 1], tokens[i, p : len(s)])
        for i, (s, p) in enumerate(zip(token_ids, prompt_lengths, strict=True))
    ]


@torch.no_grad()
def trainer_logprobs(
    checkpoint_dir: str,
    token_ids: list[list[int]],
    prompt_lengths: list[int],
    dtype: str = "bfloat16",
    fused: bool = False,
    fp8: str | None = None,
    routed_experts=None,
    batch_invariant: bool = True,
    tp_k_block: int | None = None,
) -> list[torch.Tensor]:
    """Load an HF checkpoint into TorchTitan's model with zerokld numerics (``batch_invariant=False``: TorchTitan's
    stock components, :func:`titan_plugin.models.build_titan_model`) and score completions.

    Args:
        checkpoint_dir: HF directory (``config.json`` + ``*.safetensors``), Qwen3 or Llama.
        token_ids: sequences (prompt + completion).
        prompt_lengths: prompt length of each sequence.
        dtype: ``"bfloat16"`` or ``"float32"``: parameter and activation dtype (match vLLM's ``--dtype``).
        fused: compute the completion log-probs with the fused lm_head (no ``[tokens, vocab]`` logits).
        fp8: FP8 QAT forward granularity (``"per_channel"`` / ``"block"``; ``None``: off): equal to vLLM serving this
            checkpoint with ``fp8`` of the same granularity or serving its :func:`titan_plugin.export_fp8_checkpoint`
            export.
        routed_experts: MoE checkpoints: the rollout's expert ids per sequence, replayed (see
            :func:`sequence_logprobs`).
        batch_invariant: the zerokld numerics (default); ``False`` is the stock trainer (no ``fp8``, no ``fused``).
        tp_k_block: the TP-size-invariant row-parallel sum (vLLM's ``additional_config`` ``tp_k_block``, any
            ``--tensor-parallel-size``), or ``None``.

    Returns:
        Per sequence, float32 ``[len(seq) - prompt_len]`` log-probs, bitwise equal to the logprobs vLLM returns with
        ``additional_config={"zerokld": {"batch_invariant": true}}`` for the same tokens and weights.

    Raises:
        shared_numerics.settings.ZeroKLDSettingsError: ``fp8`` without ``batch_invariant``, an unknown granularity.
    """
    model, _, _ = build_titan_model(
        checkpoint_dir, dtype=dtype, batch_invariant=batch_invariant, fp8=fp8, tp_k_block=tp_k_block
    )
    model.eval()
    return sequence_logprobs(model, token_ids, prompt_lengths, fused=fused, routed_experts=routed_experts)
