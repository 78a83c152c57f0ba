"""Random token-id prompts for the tiny checkpoints (tests, benchmarks)."""
from __future__ import annotations

import random

__all__ = ["VOCAB_HI", "VOCAB_LO", "random_datums", "random_prompts"]

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
