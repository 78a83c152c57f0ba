"""Cost of the counter-based sampler ÷ vLLM-CPU's own sampler, on the same logits, one sampling step.

For each ``[batch, vocab]`` shape: float32 logits at temperature 1 (no top-k/top-p) and with top-k 50 + top-p 0.9,
timed ``--repeats`` times after a warm-up on the current thread count:

* ours: ``shared_numerics.sampling.sample_tokens`` (hash noise for every vocabulary entry, Gumbel-max; top-k/top-p
  by stable sorts);
* stock: vLLM's ``TopKTopPSampler`` (``v1/sample/ops/topk_topp_sampler.py``), which on CPU is
  ``torch.ops._C.fused_gumbel_argmax`` with per-row random seeds (and vLLM's own top-k/top-p masking).

Writes medians (seconds per step) and the ratio ours/stock as JSON. Usage:
``python -m benchmarks.sampler --out benchmarks/results/sampler_cpu2.json``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch

from benchmarks.timing import wall_times
from shared_numerics.machine import machine_facts

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="8x32000,64x32000,64x151936", help="BATCHxVOCAB,...")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="runs/bench/sampler.json")
    args = ap.parse_args(argv)

    import vllm._custom_ops  # noqa: F401 - loads vllm._C: torch.ops._C.fused_gumbel_argmax
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    from shared_numerics.sampling import sample_tokens

    stock = TopKTopPSampler()
    results = []
    for shape in args.shapes.split(","):
        b, v = (int(x) for x in shape.split("x"))
        logits = torch.randn(b, v, generator=torch.Generator().manual_seed(0)) * 3
        temp = torch.ones(b)
        seeds = torch.arange(b, dtype=torch.int64) * 7919
        pos = torch.full((b,), 17, dtype=torch.int64)
        for label, k, p in (("plain", None, None), ("top_k50_top_p0.9", torch.full((b,), 50), torch.full((b,), 0.9))):
            ours = wall_times(lambda: sample_tokens(logits, temp, seeds, pos, k, p), args.repeats)
            theirs = wall_times(lambda: stock(logits.clone(), {}, k, p), args.repeats)
            row = {
                "batch": b,
                "vocab": v,
                "case": label,
                "ours_s": statistics.median(ours),
                "stock_s": statistics.median(theirs),
                "ours_all": ours,
                "stock_all": theirs,
            }
            row["ratio_ours_over_stock"] = row["ours_s"] / row["stock_s"]
            results.append(row)
            print(
                f"{b}x{v} {label}: ours {row['ours_s'] * 1e3:.1f} ms, stock {row['stock_s'] * 1e3:.1f} ms, "
                f"ratio {row['ratio_ours_over_stock']:.1f}"
            )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine_facts(), "results": results}, indent=2))


if __name__ == "__main__":
    main()
