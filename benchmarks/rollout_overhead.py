"""Rollout throughput with the zerokld plugin ÷ stock vLLM-CPU, same model, same batch, prefill and decode apart.

The model: :func:`benchmarks.trainer.realistic_spec` (the issue's realistic size at the defaults: hidden 1024 x 8
layers, 16 heads of dim 64 / 4 KV heads, vocabulary 32,768; ``--family qwen3_moe``: every MLP 8 experts, top-2;
``--family deepseek_v3``: :func:`benchmarks.trainer.deepseek_spec`, MLA over the latent cache (512 + 64) and
DeepSeekMoE; stock vLLM-CPU serves it with its AMX MLA kernels where AMX exists, its reference ``CPU_MLA`` elsewhere;
``--family qwen3_next``: :func:`zerokld_testing.qwen3_next.realistic_qwen3_next`, 3 Gated DeltaNet layers : 1 gated
attention layer, stock with its C++ chunked-prefill and recurrent-decode kernels).
For each dtype, one engine with the plugin on and one with it off (started one after the other: 2-core machines),
each measured ``--repeats`` times after a warm-up:

* prefill: ``--batch`` prompts of ``--prompt-len`` tokens, ``max_tokens=1``, prefix cache reset before each repeat;
  tokens/s = prompt tokens / seconds.
* decode: ``--batch`` prompts of ``--decode-context`` tokens (8: short, the paged attention's share small; 1024 or
  more: each step reads that much KV cache per sequence), ``max_tokens=--decode-len`` (ignore_eos) minus the same with
  ``max_tokens=1``, both with the prompts' KV already in the prefix cache (one ``max_tokens=1`` pass after a reset
  puts it there), so the difference holds the decode steps and not two long prefills' noise (with the cache reset, an
  8 x 1024-token prefill's +-10% moved the decode estimate by +-15%); tokens/s = batch * (decode_len - 1) / seconds.

Writes JSON (medians, all repeats, ratios plugin/stock) to ``--out``. Usage:
``python -m benchmarks.rollout_overhead --out runs/bench/rollout_overhead.json``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import time
from pathlib import Path

from shared_numerics.machine import machine_facts

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def _measure(llm, args) -> dict:
    from vllm import SamplingParams

    rng = random.Random(0)
    long_prompts = [[1] + [rng.randrange(3, 100) for _ in range(args.prompt_len - 1)] for _ in range(args.batch)]
    short_prompts = [[1] + [rng.randrange(3, 100) for _ in range(args.decode_context - 1)] for _ in range(args.batch)]
    one = SamplingParams(max_tokens=1, temperature=args.temperature, ignore_eos=True)
    many = SamplingParams(max_tokens=args.decode_len, temperature=args.temperature, ignore_eos=True)

    def timed(prompts, sp, reset: bool = True) -> float:
        if reset:
            llm.reset_prefix_cache()
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return time.perf_counter() - t0

    timed(long_prompts[:4], one)  # warm-up
    timed(short_prompts[:4], many)
    prefill, decode = [], []
    for _ in range(args.repeats):
        prefill.append(args.batch * args.prompt_len / timed(long_prompts, one))
        timed(short_prompts, one)  # the prompts' KV into the prefix cache
        t_many, t_one = timed(short_prompts, many, reset=False), timed(short_prompts, one, reset=False)
        decode.append(args.batch * (args.decode_len - 1) / max(t_many - t_one, 1e-9))
    return {
        "prefill_tokens_per_s": prefill,
        "decode_tokens_per_s": decode,
        "prefill_median": statistics.median(prefill),
        "decode_median": statistics.median(decode),
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/bench/rollout_overhead.json")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-len", type=int, default=32)
    ap.add_argument("--decode-context", type=int, default=8, help="prompt tokens before each decode sequence")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument(
        "--family",
        choices=["qwen3", "qwen3_moe", "deepseek_v3", "qwen3_next"],
        default="qwen3",
        help="qwen3_moe: 8 experts, top-2, expert FFN width = hidden; deepseek_v3: MLA + DeepSeekMoE; qwen3_next: "
        "Gated DeltaNet + gated attention (3:1)",
    )
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="> 0 samples (the zerokld side then runs its counter-based sampler; stock its own)",
    )
    ap.add_argument("--routes", action="store_true", help="zerokld side also returns routed experts (MoE)")
    args = ap.parse_args(argv)

    from benchmarks.trainer import deepseek_spec, realistic_spec
    from vllm_plugin.engines import STOCK_MLA_UNAVAILABLE, shutdown_llm, start_llm, stock_mla_available
    from zerokld_testing import make_deepseek_checkpoint, make_tiny_checkpoint

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    max_len = max(1024, args.prompt_len, args.decode_context + args.decode_len)
    spec = realistic_spec(args.hidden, args.layers, max_len)
    if args.family == "qwen3_moe":  # every MLP an MoE: 8 experts, top-2, each expert's FFN hidden wide
        spec = dataclasses.replace(spec, family="qwen3_moe", moe_intermediate_size=args.hidden)
    make, latent = make_tiny_checkpoint, None  # latent: an MLA model's cache values per token
    if args.family == "deepseek_v3":
        spec, make = deepseek_spec(args.hidden, args.layers, max_len), make_deepseek_checkpoint
        latent = spec.kv_lora_rank + spec.qk_rope_head_dim
    result = {"machine": machine_facts(), "args": vars(args), "runs": {}}
    for dtype in args.dtypes.split(","):
        # checkpoints go under runs/ (hundreds of MB at hidden 1024), never beside a results JSON
        path = Path("runs/bench") / f"bench_{args.family}_{dtype}"
        if args.family == "qwen3_next":
            from zerokld_testing import make_qwen3_next_checkpoint, realistic_qwen3_next

            changes = {**realistic_qwen3_next(args.hidden, args.layers), "max_position_embeddings": max_len}
            ckpt = make_qwen3_next_checkpoint(path, dtype, seed=0, **changes)
        else:
            ckpt = make(path, spec, seed=0, dtype=dtype)
        per = {}
        for mode in ("zerokld", "stock"):
            if mode == "stock" and latent is not None and not stock_mla_available(latent):
                per["stock"] = {"unavailable": STOCK_MLA_UNAVAILABLE}
                continue
            extra = {"enable_return_routed_experts": True} if args.routes and mode == "zerokld" else {}
            llm = start_llm(str(ckpt), dtype=dtype, batch_invariant=mode == "zerokld", max_model_len=max_len, **extra)
            try:
                per[mode] = _measure(llm, args)
            finally:
                shutdown_llm(llm)
        result["runs"][dtype] = per
        if "unavailable" in per["stock"]:
            print(
                f"{dtype}: zerokld prefill {per['zerokld']['prefill_median']:.0f} tok/s, decode "
                f"{per['zerokld']['decode_median']:.0f} tok/s; stock unavailable here",
                flush=True,
            )
            continue
        per["ratio_prefill"] = per["zerokld"]["prefill_median"] / per["stock"]["prefill_median"]
        per["ratio_decode"] = per["zerokld"]["decode_median"] / per["stock"]["decode_median"]
        print(f"{dtype}: prefill ratio {per['ratio_prefill']:.3f}  decode ratio {per['ratio_decode']:.3f}", flush=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
