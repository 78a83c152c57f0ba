"""Trainer forward + backward, ours ÷ TorchTitan stock, side by side in one run.

For each dtype, the same HF checkpoint (``--arch qwen3``: the project's factory at :func:`realistic_spec`: hidden
``--hidden``, ``--layers`` layers, ``hidden / 64`` heads of dim 64 with ``hidden / 256`` KV heads, FFN ``3 x hidden``,
vocabulary 32,768; ``--arch deepseek_v3``: :func:`deepseek_spec`, issue 55's size, TorchTitan's ``deepseek_v3`` with
MLA and DeepSeekMoE) is built twice with
:func:`titan_plugin.models.build_titan_model`: with zerokld's overrides (``batch_invariant=True``: zerokld linear,
attention, norms, SiLU, RoPE, log-softmax) and stock (TorchTitan's ``nn.Linear`` and SDPA). One step = the per-token
log-probs of ``--batch`` sequences of ``--seq-len`` tokens (:func:`titan_plugin.sequence_logprobs`, prompt length 1)
and ``backward()`` of their sum: the work of an RL ``train_step`` without the optimizer. Each timed ``--repeats`` times
after a warm-up on the current torch thread count (stock and ours alternate); medians in seconds and
``speed_ours_over_stock = stock_s / ours_s`` (1.0: no speed tax; the issue's target is >= 0.8).

The JSON records the machine (CPU model, ISA flags, threads). Usage:
``python -m benchmarks.trainer --out benchmarks/results/trainer_h1024_xeon_amx_cpu2.json``
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from shared_numerics.machine import machine_facts


def realistic_spec(hidden: int, layers: int, max_positions: int = 1024):
    """The benchmarks' Qwen3 at the issue's realistic small size: ``hidden`` and ``layers``, ``hidden / 64`` query
    heads of dim 64 with ``hidden / 256`` KV heads (16 / 4 at hidden 1024), FFN ``3 x hidden``, vocabulary 32,768
    (the factory tokenizer padded with filler tokens)."""
    from zerokld_testing import TinyModelSpec

    return TinyModelSpec(
        family="qwen3",
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 256),
        head_dim=64,
        max_position_embeddings=max(1024, max_positions),
        vocab_size=32768,
    )


def deepseek_spec(hidden: int, layers: int, max_positions: int = 1024):
    """DeepSeek-V3 at issue 55's realistic small size: ``hidden``, ``layers`` layers of which the first is dense,
    ``hidden / 64`` heads, q_lora_rank ``hidden / 2``, kv_lora_rank 512 + rope 64 (DeepSeek-V3's latent), nope 128 /
    v 128, 32 routed experts (intermediate ``hidden / 2``) top-4 in 4 groups of which 2 may be used, 1 shared expert,
    dense FFN ``3 x hidden``, vocabulary 32,768."""
    from zerokld_testing import DeepSeekSpec

    return DeepSeekSpec(
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        moe_intermediate_size=hidden // 2,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        q_lora_rank=hidden // 2,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        n_routed_experts=32,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=4,
        n_shared_experts=1,
        first_k_dense_replace=1,
        init_std=0.02,
        max_position_embeddings=max(1024, max_positions),
        vocab_size=32768,
    )


def _step(model, seqs: list[list[int]]) -> None:
    from titan_plugin import sequence_logprobs

    model.zero_grad(set_to_none=True)
    lps = sequence_logprobs(model, seqs, [1] * len(seqs))
    torch.stack([lp.sum() for lp in lps]).sum().backward()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/bench/trainer.json")
    ap.add_argument("--arch", choices=("qwen3", "deepseek_v3"), default="qwen3")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)

    from titan_plugin.models import build_titan_model
    from zerokld_testing import make_tiny_checkpoint

    if args.arch == "deepseek_v3":
        from zerokld_testing import make_deepseek_checkpoint as make

        spec = deepseek_spec(args.hidden, args.layers, args.seq_len)
    else:
        make = make_tiny_checkpoint
        spec = realistic_spec(args.hidden, args.layers, args.seq_len)
    rng = random.Random(0)
    seqs = [[1] + [rng.randrange(3, 100) for _ in range(args.seq_len - 1)] for _ in range(args.batch)]
    result = {"machine": machine_facts(), "args": vars(args), "runs": {}}
    for dtype in args.dtypes.split(","):
        # checkpoints go under runs/ (hundreds of MB at hidden 1024), never beside a results JSON
        ckpt = make(Path("runs/bench") / f"trainer_{args.arch}_{dtype}", spec, seed=0, dtype=dtype)
        models = {
            mode: build_titan_model(str(ckpt), dtype=dtype, batch_invariant=mode == "zerokld")[0]
            for mode in ("zerokld", "stock")
        }
        times: dict[str, list[float]] = {mode: [] for mode in models}
        for mode, model in models.items():  # warm-up (the CPU kernels build on first use)
            _step(model, seqs)
        for _ in range(args.repeats):
            for mode, model in models.items():
                t0 = time.perf_counter()
                _step(model, seqs)
                times[mode].append(time.perf_counter() - t0)
        per = {mode: {"all_s": ts, "median_s": statistics.median(ts)} for mode, ts in times.items()}
        per["speed_ours_over_stock"] = per["stock"]["median_s"] / per["zerokld"]["median_s"]
        result["runs"][dtype] = per
        print(
            f"{dtype}: forward+backward zerokld {per['zerokld']['median_s']:.3f} s, stock "
            f"{per['stock']['median_s']:.3f} s: {per['speed_ours_over_stock']:.2f}x",
            flush=True,
        )
        del models
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
