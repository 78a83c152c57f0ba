"""Counter-based sampling: the token drawn for a row is a pure function of (logits row, seed, output position).

Gumbel-max (``argmax(z + g)`` with ``g = -log(-log u)`` samples ``softmax(z)``) where the uniform ``u`` for vocabulary
index ``v`` is a keyed hash of ``(seed, position, v)`` — no generator state, so nothing depends on what else is in the
batch, on how a prefill was chunked, on whether the request was preempted and recomputed, or on how many threads ran.
Compare vLLM-CPU's ``TopKTopPSampler.forward_cpu``: ``torch.ops._C.fused_gumbel_argmax`` with one seed per row drawn
from ``torch.randint`` (unseeded) or from the request's ``torch.Generator`` (seeded), i.e. state advanced per step.

The hash is 32-bit integer mixing (two rounds of ``x ^= x >> 16; x *= 0x45d9f3b``) held in int64 tensors, so every
product stays below 2^63 and the bits are the same on every platform; ``u`` is one 32-bit hash word.
Temperature, top-k and top-p follow vLLM's semantics (``v1/sample/ops/topk_topp_sampler.py``): logits are divided by
the temperature in float32; top-k keeps every logit ``>=`` the k-th largest; top-p keeps the smallest prefix (by
descending probability, stable order) whose mass reaches ``p`` — always at least one token; the mass is summed in
exact fixed point (probabilities rounded to multiples of 2^-52, int64 prefix sums), so the kept set does not depend on
the device's scan algorithm. Every tensor is made on the logits' device (CPU or CUDA).
"""

from __future__ import annotations

import torch

__all__ = ["gumbel_noise", "sample_scaled", "sample_tokens", "scale_logits", "uniform_noise"]

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """32-bit integer hash of int64 values in ``[0, 2**32)``, in place (``x`` is consumed)."""
    x.bitwise_xor_(x >> 16).mul_(_MUL).bitwise_and_(_M32)
    x.bitwise_xor_(x >> 16).mul_(_MUL).bitwise_and_(_M32)
    return x.bitwise_xor_(x >> 16)


_INDEX_HASH: dict[tuple[int, str], torch.Tensor] = {}


def _index_hash(vocab_size: int, device: torch.device) -> torch.Tensor:
    """``mix32(v ^ c)`` for every vocabulary index ``v`` (``[1, V]`` int64), cached: it does not depend on the row."""
    key = (vocab_size, str(device))
    h = _INDEX_HASH.get(key)
    if h is None:
        if len(_INDEX_HASH) > 8:
            _INDEX_HASH.clear()
        h = _INDEX_HASH[key] = _mix32(torch.arange(vocab_size, dtype=torch.int64, device=device) ^ 0x632BE5AB)[None]
    return h


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform variates in the open interval (0, 1), one per (row, vocabulary index).

    ``u = (mix32(key ^ mix32(v ^ c)) + 0.5) / 2**32`` with ``key = mix32(mix32(mix32(seed_lo ^ c1) ^ seed_hi) ^
    position ^ c2)``: 32 bits per draw (the Gumbel tail is cut at ``-log(-log(1 - 2**-33))`` ≈ 22.9, an event of
    probability ~1e-10 per token).

    Args:
        seeds: ``[N]`` int64, any value (the request's sampling seed: vLLM's ``SamplingParams.seed`` takes the whole
            int64 range, as ``torch.Generator.manual_seed`` does). A seed is its 64 bits: a negative seed draws the
            noise of its two's-complement value, never an error (an error here would stop the engine mid-step).
        positions: ``[N]`` int64 ``>= 0``: the output position being sampled (0 for the first generated token).
        vocab_size: ``V``.

    Returns:
        ``[N, V]`` float64.

    Raises:
        ValueError: a negative position.
    """
    seeds = seeds.to(torch.int64).reshape(-1, 1)
    positions = positions.to(torch.int64).reshape(-1, 1)
    if bool((positions < 0).any()):
        raise ValueError("sampling positions must be non-negative")
    key = _mix32(_mix32((seeds & _M32) ^ 0x9E3779B9) ^ ((seeds >> 32) & _M32))
    key = _mix32(key ^ (positions & _M32) ^ 0x7F4A7C15)
    a = _mix32(key ^ _index_hash(vocab_size, seeds.device))
    return a.double().add_(0.5).div_(float(1 << 32))


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel variates ``-log(-log u)`` of :func:`uniform_noise`; ``[N, V]`` float64."""
    return uniform_noise(seeds, positions, vocab_size).log_().neg_().log_().neg_()


def _apply_top_k(z: torch.Tensor, top_k: torch.Tensor | None) -> torch.Tensor:
    if top_k is None:
        return z
    v = z.shape[-1]
    k = top_k.to(device=z.device, dtype=torch.int64).clamp(1, v).reshape(-1, 1)
    ordered = torch.sort(z, dim=-1, descending=True, stable=True).values
    kth = ordered.gather(-1, k - 1)
    return z.masked_fill(z < kth, float("-inf"))


_FIXED_POINT = float(1 << 52)


def _apply_top_p(z: torch.Tensor, top_p: torch.Tensor | None) -> torch.Tensor:
    if top_p is None:
        return z
    from . import log_softmax

    probs = torch.exp(log_softmax(z).double())
    order = torch.sort(probs, dim=-1, descending=True, stable=True).indices
    # the mass above each token, summed exactly: probabilities on a 2^-52 grid as int64 (integer addition is
    # associative, so no scan algorithm, device or row count can change a bit; the sum stays below 2^53)
    fixed = torch.round(probs.gather(-1, order) * _FIXED_POINT).to(torch.int64)
    before = (torch.cumsum(fixed, dim=-1) - fixed).double()
    p = top_p.to(device=z.device, dtype=torch.float64).reshape(-1, 1)
    # p >= 1 keeps everything exactly, so a row's result does not depend on whether another row asked for top-p
    drop_sorted = (before >= p * _FIXED_POINT) & (p < 1.0)
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return z.masked_fill(drop, float("-inf"))


def scale_logits(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``logits.float() / temperature`` per row (``[N, V]`` float32); rows with ``temperature <= 0`` (greedy rows,
    which vLLM stores as 0) are divided by 1."""
    t = temperature.float().reshape(-1, 1)
    return logits.float() / torch.where(t > 0, t, torch.ones_like(t))


def sample_scaled(
    z: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sample one token per row of temperature-scaled logits ``z [N, V]`` (float32): top-k, then top-p, then
    Gumbel-max with :func:`gumbel_noise`. ``top_k [N]`` int (``>= V`` keeps all) and ``top_p [N]`` float in
    ``(0, 1]`` (1 keeps all) may be ``None``. Returns ``[N]`` int64; row ``n`` depends only on row ``n`` of every
    argument."""
    z = _apply_top_p(_apply_top_k(z, top_k), top_p)
    scores = gumbel_noise(seeds.to(z.device), positions.to(z.device), z.shape[-1]).add_(z)
    return torch.argmax(scores, dim=-1)


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sample one token per row with counter-based Gumbel-max: :func:`scale_logits` then :func:`sample_scaled`.

    Args:
        logits: ``[N, V]`` (any float dtype; processed in float32).
        temperature: ``[N]`` float, each ``> 0`` (greedy rows are the caller's: vLLM takes ``argmax`` for
            ``temperature < 1e-5``).
        seeds, positions: ``[N]`` int64, see :func:`uniform_noise`.
        top_k: ``[N]`` int or ``None``; ``k >= V`` keeps every token.
        top_p: ``[N]`` float in ``(0, 1]`` or ``None``; ``1.0`` keeps every token.

    Returns:
        ``[N]`` int64 token ids; row ``n`` depends only on row ``n`` of every argument.

    Raises:
        ValueError: non-positive temperature, negative seed or position.
    """
    if bool((temperature <= 0).any()):
        raise ValueError("sample_tokens needs temperature > 0 (greedy rows use argmax)")
    return sample_scaled(scale_logits(logits, temperature), seeds, positions, top_k, top_p)
