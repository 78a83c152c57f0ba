"""Synthetic requests for the tiny checkpoints (tests, benchmarks): random token-id prompts in the tiny tokenizer's
vocabulary, Tinker datums, a batch of varied sampling settings."""

from __future__ import annotations

import random

__all__ = ["VOCAB_HI", "VOCAB_LO", "mixed_sampling_params", "random_datums", "random_prompts"]

VOCAB_LO, VOCAB_HI = 3, 100  # printable characters of the tiny tokenizer (zerokld_testing.checkpoints)


def random_prompts(n: int, seed: int, lo: int = 4, hi: int = 120) -> list[list[int]]:
    """``n`` prompts: BOS (id 1) then ``lo..hi-1`` ids drawn from ``[VOCAB_LO, VOCAB_HI)``; a pure function of
    ``seed`` (``random.Random``)."""
    rng = random.Random(seed)
    return [[1] + [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def random_datums(seed: int, n: int = 6) -> list[dict]:
    """``n`` Tinker datums over random sequences (BOS then 12..39 ids): ``model_input`` and next-token
    ``loss_fn_inputs["target_tokens"]`` only (what ``cross_entropy`` needs); a pure function of ``seed``."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        s = [1] + [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(rng.randrange(12, 40))]
        out.append({"model_input": s[:-1], "loss_fn_inputs": {"target_tokens": s[1:]}})
    return out


def mixed_sampling_params(i: int, seed: int | None = None, max_tokens: int = 24, **kw):
    """Request ``i``'s ``vllm.SamplingParams`` in a batch whose settings vary (cycling temperature 1.0; 0.7 with
    top-k 20; 1.3 with top-p 0.9; 0.9 with top-k 40 and top-p 0.8), one logprob per token, ``ignore_eos``; ``kw``
    overrides any of them."""
    from vllm import SamplingParams

    settings = [
        dict(temperature=1.0),
        dict(temperature=0.7, top_k=20),
        dict(temperature=1.3, top_p=0.9),
        dict(temperature=0.9, top_k=40, top_p=0.8),
    ][i % 4]
    return SamplingParams(max_tokens=max_tokens, logprobs=0, ignore_eos=True, seed=seed, **{**settings, **kw})
