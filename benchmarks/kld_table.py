"""Train-inference KL per model: for every supported architecture x dtype x FP8 serving on/off, the same prompts sampled
by a vLLM engine and scored by the TorchTitan trainer, zerokld vs stock side by side in one run.

Fireworks publishes such a table for its stack (k3 from ~1.25e-4 for Llama 3.3 70B to ~7e-3 for MiniMax-M2.5, stock
vLLM against its trainer); this is ours, on tiny checkpoints built by ``zerokld_testing`` (2 layers, hidden 128, one
per architecture: Qwen3, Qwen2.5-style Qwen2 with q/k/v bias, Llama, Qwen3-MoE with 8 experts top-2, DeepSeek-V3 with
MLA and DeepSeekMoE (:data:`DEEPSEEK_ARCHS`)).

Per row: 32 random prompts (8-150 tokens) sampled at temperature 1.0 (48 tokens each, no per-request seed) in one
batch by an engine that chunks prefills at 64 tokens with prefix caching on (a serving engine's normal load); then the
trainer scores every prompt + completion in one batch forward, and ``shared_numerics.logprob_diff_metrics`` compares:

* ``k3``: mean over sequences of the per-token mean of ``exp(d) - d - 1``, ``d = trainer - sampler`` log-prob (nats);
* ``max_abs_logprob_diff``: the largest ``|d|``;
* ``tokens_bitwise_equal``: share of completion tokens whose two float32 log-probs are equal bit for bit.

Engines: ``zerokld`` = vLLM with ``additional_config={"zerokld": {"batch_invariant": true}}`` against
:func:`titan_plugin.trainer_logprobs`; ``stock`` = vLLM's own kernels against TorchTitan's own components
(``build_titan_model(batch_invariant=False)``: ``nn.Linear``, SDPA attention, TorchTitan's MoE with its bf16 grouped
experts; ``tests/models/test_architectures.py`` checks each stock build against HF ``transformers``). FP8 on:
zerokld serves online FP8 per channel (``shared_numerics.fp8``) against the FP8 QAT trainer; stock serves vLLM's
``quantization="fp8_per_channel"`` against the high-precision trainer (the common production setting). zerokld's FP8
does not serve Qwen2's biased q/k/v projections in FP8 (``NO_FP8``), so it has no FP8 rows; DeepSeek-V3's FP8 rows
are DeepSeek's block granularity (``FP8_GRANULARITY``).
A configuration stock vLLM-CPU cannot run is recorded with its error.

Usage: ``python -m benchmarks.kld_table --out benchmarks/results/kld_table_cpu2`` (writes ``.json`` and ``.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from benchmarks.timing import machine_phrase
from shared_numerics.machine import machine_facts

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

ARCHS = {  # name in the table -> TinyModelSpec fields
    "qwen3": dict(family="qwen3"),
    "qwen2": dict(family="qwen2", tie_word_embeddings=True, rope_theta=1e6),
    "llama": dict(family="llama"),
    "qwen3_moe": dict(family="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64),
}
#: DeepSeek-V3 (MLA + DeepSeekMoE; zerokld_testing.DeepSeekSpec fields): YaRN, 2 of 4 expert groups, a dense
#: first layer, DeepSeek-V3's latent 512 + 64 (the one size stock vLLM-CPU serves MLA at without AMX)
DEEPSEEK_ARCHS = {
    "deepseek_v3": dict(
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        kv_lora_rank=512,
        yarn=True,
    ),
}
ARCHS.update({name: {} for name in DEEPSEEK_ARCHS})
NO_FP8 = {  # architectures zerokld does not serve in FP8 (vllm_plugin.config refuses them), so no FP8 rows
    "qwen2": "the FP8 GEMM is bias-free and Qwen2 has q/k/v biases",
}
#: FP8 granularity per architecture (default per channel): DeepSeek-V3 as DeepSeek ships it, 1x128 activation groups x
#: 128x128 weight blocks (stock: vLLM's ``quantization="fp8"`` with ``weight_block_size``-less online quantization
#: cannot do blocks; its FP8 rows record why)
FP8_GRANULARITY = {"deepseek_v3": "block"}
DIMS = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
)


def _sample(llm, prompts: list[list[int]]):
    from vllm import SamplingParams

    from vllm_plugin.engines import completion_logprobs

    sp = SamplingParams(max_tokens=48, temperature=1.0, logprobs=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs, strict=True)], [
        completion_logprobs(o) for o in outs
    ]


def _trainer(ckpt: str, seqs, plens, dtype: str, zerokld: bool, fp8: bool, granularity: str = "per_channel"):
    from titan_plugin import trainer_logprobs

    # stock, FP8 or not: a high-precision trainer (the common FP8-rollout setting)
    return trainer_logprobs(
        ckpt, seqs, plens, dtype=dtype, fp8=granularity if fp8 and zerokld else None, batch_invariant=zerokld
    )


def measure(
    ckpt: str,
    dtype: str,
    fp8: bool,
    zerokld: bool,
    prompts,
    mla_latent: int | None = None,
    granularity: str = "per_channel",
) -> dict:
    """One row: sample with the engine, score with the trainer, compare (``mla_latent``: an MLA model's latent size,
    ``kv_lora_rank + qk_rope_head_dim``, which decides whether stock vLLM-CPU serves it here:
    :func:`vllm_plugin.engines.stock_mla_available`; ``granularity``: zerokld's FP8 granularity)."""
    import shared_numerics as sn
    from vllm_plugin.engines import STOCK_MLA_UNAVAILABLE, shutdown_llm, start_llm, stock_mla_available

    if mla_latent is not None and not zerokld and not stock_mla_available(mla_latent):
        return {"error": STOCK_MLA_UNAVAILABLE}

    kw = ({"fp8": granularity} if zerokld else {"quantization": "fp8_per_channel"}) if fp8 else {}
    t0 = time.perf_counter()
    try:
        llm = start_llm(ckpt, dtype=dtype, batch_invariant=zerokld, max_num_batched_tokens=64, seed=0, **kw)
        try:
            seqs, served = _sample(llm, prompts)
        finally:
            shutdown_llm(llm)
    except Exception as e:  # recorded in the table: stock vLLM-CPU cannot serve this configuration
        if zerokld:
            raise
        return {"error": f"{type(e).__name__}: {e}"[:200]}
    train = _trainer(ckpt, seqs, [len(p) for p in prompts], dtype, zerokld, fp8, granularity)
    m = sn.logprob_diff_metrics(train, served)
    return {
        "k3": m["k3"],
        "k1": m["k1"],
        "max_abs_logprob_diff": m["max_abs_logprob_diff"],
        "tokens_bitwise_equal": 1.0 - m["tokens_bitwise_different"] / m["num_tokens"],
        "num_tokens": m["num_tokens"],
        "seconds": round(time.perf_counter() - t0, 1),
    }


def markdown(result: dict) -> str:
    """The table as GitHub markdown (one line per architecture x dtype x FP8 x engine)."""
    m = result["machine"]
    where = machine_phrase(m)
    lines = [
        "# Train-inference KL per model (`benchmarks/kld_table.py`)",
        "",
        f"Measured {result['date']} on {where}, torch {m['torch']}, vLLM {m['vllm']}: {result['workload']}.",
        "",
        (
            "| architecture | dtype | FP8 serving | engine + trainer | k3 (mean) | max \\|Δ log-prob\\| "
            "| tokens bitwise equal |"
        ),
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        fp8 = (r.get("granularity") or "on").replace("_", " ") if r["fp8"] else "off"
        head = f"| {r['arch']} | {r['dtype']} | {fp8} | {r['engine']} |"
        if r.get("error"):
            lines.append(f"{head} not served by stock vLLM-CPU: `{' '.join(r['error'].split())[:120]}` | | |")
        else:
            lines.append(
                f"{head} {r['k3']:.3e} | {r['max_abs_logprob_diff']:.3e} | {100 * r['tokens_bitwise_equal']:.2f}% |"
            )
    lines += [
        "",
        (
            "Stock Qwen3-MoE in float32: TorchTitan's `GroupedExperts` computes the experts in bf16 whatever the "
            "model dtype (`torchtitan/models/common/moe.py`), so its float32 rows carry bf16-sized differences."
        ),
    ]
    lines += [f"No FP8 rows for {a}: zerokld refuses it ({why})." for a, why in NO_FP8.items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/bench/kld_table", help="path stem: writes <out>.json and <out>.md")
    ap.add_argument("--archs", default=",".join(ARCHS))
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument(
        "--merge",
        default=None,
        help="a JSON lines file of rows measured earlier (same workload) to put first in the table",
    )
    args = ap.parse_args(argv)

    import vllm

    from zerokld_testing import (
        DeepSeekSpec,
        TinyModelSpec,
        make_deepseek_checkpoint,
        make_tiny_checkpoint,
        random_prompts,
    )

    prompts = random_prompts(32, seed=5, lo=8, hi=150)
    rows = [json.loads(x) for x in Path(args.merge).read_text().splitlines()] if args.merge else []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.archs.split(","):
            for dtype in args.dtypes.split(","):
                latent = None
                if arch in DEEPSEEK_ARCHS:
                    ds = DeepSeekSpec(**DEEPSEEK_ARCHS[arch])
                    latent = ds.kv_lora_rank + ds.qk_rope_head_dim
                    ckpt = str(make_deepseek_checkpoint(Path(tmp) / f"{arch}_{dtype}", ds, seed=1, dtype=dtype))
                else:
                    spec = TinyModelSpec(**{**DIMS, **ARCHS[arch]})
                    ckpt = str(make_tiny_checkpoint(Path(tmp) / f"{arch}_{dtype}", spec, seed=1, dtype=dtype))
                for fp8 in (False,) if arch in NO_FP8 else (False, True):
                    for zerokld in (True, False):
                        g = FP8_GRANULARITY.get(arch, "per_channel")
                        row = {
                            "arch": arch,
                            "dtype": dtype,
                            "fp8": fp8,
                            "engine": "zerokld" if zerokld else "stock",
                            "granularity": g if fp8 else None,
                            **measure(ckpt, dtype, fp8, zerokld, prompts, mla_latent=latent, granularity=g),
                        }
                        print(json.dumps(row), flush=True)
                        rows.append(row)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": {**machine_facts(), "vllm": vllm.__version__},
        "workload": "2-layer hidden-128 checkpoints, 32 prompts of 8-150 tokens, 48 sampled tokens each "
        "(temperature 1.0), prefills chunked at 64 tokens, one trainer batch",
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    table = markdown(result)
    out.with_suffix(".md").write_text(table)
    print(table)
    return result


if __name__ == "__main__":
    main()
