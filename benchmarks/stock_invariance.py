"""Which of vLLM's invariance claims stock vLLM-CPU already meets on this machine: the negative controls of
``tests/test_vllm_parity.py``, measured for the plugin on and off, side by side.

For each configuration (family, dtype, hidden size) one engine with the plugin off, then one with it on
(``max_num_batched_tokens=64``: chunked prefill, mixed batches; prefix caching on), each counting:

* ``alone_vs_batch``: of 40 prompts decoded greedily in one batch, how many give other logprobs decoded alone;
* ``prefix_cache``: whether a 134-token prompt's logprobs differ between a cold cache and a 128-token prefix hit;
* ``decode_vs_prompt``: of 6 sequences, how many decode logprobs differ from the same tokens scored as a prompt;
* ``engine_vs_trainer``: whether a chunk-prefilled 231-token prompt's logprobs differ from the zerokld trainer's.

A claim stock meets too cannot be proven by a test on this machine; these numbers say which. Writes JSON to
``--out``. Usage: ``python -m benchmarks.stock_invariance --out benchmarks/results/stock_invariance_cpu2.json``
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

SIZES = {  # hidden size -> (intermediate, heads, kv heads, head_dim)
    64: (128, 4, 2, 32), 128: (256, 4, 2, 32), 1024: (3072, 16, 8, 128)}


def _claims(llm, ckpt: str, dtype: str) -> dict:
    import torch
    from vllm import SamplingParams

    from titan_plugin import trainer_logprobs
    from zerokld_testing.engines import completion_logprobs, prompt_logprobs
    from zerokld_testing.prompts import random_prompts

    def greedy(n=12, **kw):
        return SamplingParams(max_tokens=n, temperature=0.0, logprobs=0, ignore_eos=True, **kw)

    def gen(prompts, sp):
        return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)

    out = {}
    prompts = random_prompts(40, seed=1)
    batch = gen(prompts, greedy())
    alone = 0
    for i, p in enumerate(prompts):
        llm.reset_prefix_cache()
        alone += not torch.equal(completion_logprobs(gen([p], greedy())[0]), completion_logprobs(batch[i]))
    out["alone_vs_batch"] = {"differing": alone, "of": len(prompts)}
    base = random_prompts(1, seed=2, lo=130, hi=131)[0]
    llm.reset_prefix_cache()
    cold = gen([base + [5, 6, 7, 8]], greedy())[0]
    llm.reset_prefix_cache()
    gen([base], greedy())
    warm = gen([base + [5, 6, 7, 8]], greedy())[0]
    out["prefix_cache"] = {"differs": not torch.equal(completion_logprobs(cold), completion_logprobs(warm)),
                           "cached_tokens": warm.num_cached_tokens or 0}
    ps = random_prompts(6, seed=3)
    outs = gen(ps, greedy(20))
    llm.reset_prefix_cache()
    scored = gen([p + list(o.outputs[0].token_ids) for p, o in zip(ps, outs)], greedy(1, prompt_logprobs=0))
    out["decode_vs_prompt"] = {"differing": sum(not torch.equal(completion_logprobs(o), prompt_logprobs(s, len(p)))
                                                for p, o, s in zip(ps, outs, scored)), "of": len(ps)}
    long_prompt = random_prompts(1, seed=4, lo=230, hi=231)[0]
    llm.reset_prefix_cache()
    got = prompt_logprobs(gen([long_prompt], greedy(1, prompt_logprobs=0))[0], 1)
    ref = trainer_logprobs(ckpt, [long_prompt], [1], dtype=dtype)[0]
    out["engine_vs_trainer"] = {"differs": not torch.equal(got, ref),
                                "max_abs_logprob_diff": (got - ref).abs().max().item()}
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/bench/stock_invariance.json")
    ap.add_argument("--configs", default="qwen3:float32:64,qwen3:bfloat16:64,llama:bfloat16:128,qwen3:float32:1024",
                    help="family:dtype:hidden_size, comma-separated")
    args = ap.parse_args(argv)
    from zerokld_testing import TinyModelSpec, make_tiny_checkpoint
    from zerokld_testing.engines import shutdown_llm, start_llm

    import torch

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for item in args.configs.split(","):
            family, dtype, hidden = item.split(":")
            inter, heads, kv, head_dim = SIZES[int(hidden)]
            spec = TinyModelSpec(family=family, hidden_size=int(hidden), intermediate_size=inter,
                                 num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                                 init_std=0.08 if int(hidden) <= 128 else 0.02)
            ckpt = str(make_tiny_checkpoint(Path(tmp) / item.replace(":", "_"), spec, seed=1, dtype=dtype))
            for plugin in (False, True):
                t0 = time.perf_counter()
                llm = start_llm(ckpt, dtype=dtype, batch_invariant=plugin, max_num_batched_tokens=64)
                try:
                    row = {"family": family, "dtype": dtype, "hidden_size": int(hidden),
                           "engine": "zerokld" if plugin else "stock", **_claims(llm, ckpt, dtype)}
                finally:
                    shutdown_llm(llm)
                row["seconds"] = round(time.perf_counter() - t0, 1)
                print(json.dumps(row), flush=True)
                rows.append(row)
    result = {"machine": {"platform": platform.platform(), "processor": platform.processor(),
                          "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                          "torch": torch.__version__}, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
