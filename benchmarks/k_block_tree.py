"""The TP-aligned K-block tree (``tp_k_block``) on one CPU process: block by block (before) vs the fused kernel (now)
vs stock ``F.linear``, forward and forward + backward, side by side in one run, medians; JSON with the machine.

Every row-parallel linear (``o_proj``, ``down_proj``), every column-parallel input gradient and every TP-split MoE
down projection with ``tp_k_block`` sums over ``K`` in this tree (:mod:`shared_numerics.tensor_parallel`), at TP 1
as at TP 2 — the trainer's and the engine's one-rank baseline pay it. Before: ``K / k_block`` float32 GEMMs of
``k_block`` columns (operands copied per block), the ``[K / k_block, M, N]`` partials stored and added in Python,
and a backward of two small GEMMs per block. Now (:func:`shared_numerics.tensor_parallel.k_block_tree`): one kernel
pass with each register tile's tree in a small stack, and one ``dX`` and one ``dW`` GEMM — the same bits (checked
here for every case, and by ``tests/test_k_block_tree.py``). Stock ``F.linear`` is not TP-invariant: it is the speed
a user gives up.

Usage: ``python -m benchmarks.k_block_tree --out benchmarks/results/k_block_tree_<machine>.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from benchmarks.timing import wall_times
from shared_numerics.machine import machine_facts

#: (tokens M, K, N): a Qwen3 hidden-512 layer's o_proj and down_proj at 8 x 256 tokens; decode- and prefill-sized
#: Qwen3-8B-like o_proj shards
SHAPES = [(2048, 512, 512), (2048, 1536, 512), (16, 4096, 1024), (256, 2048, 2048)]
K_BLOCKS = [16, 128]


def _median_s(fn, repeats: int) -> float:
    return statistics.median(wall_times(fn, repeats))


def run(repeats: int) -> dict:
    import torch.nn.functional as F

    import shared_numerics.tensor_parallel as sn_tp

    g = torch.Generator().manual_seed(0)
    rows = []
    for m, k, n in SHAPES:
        x = torch.randn(m, k, generator=g).requires_grad_()
        w = (torch.randn(n, k, generator=g) * 0.05).requires_grad_()
        dy = torch.randn(m, n, generator=g)
        for k_block in K_BLOCKS:
            fns = {
                "blocks": lambda kb=k_block: sn_tp.block_tree_sum(sn_tp.k_block_partials(x, w, kb)),
                "fused": lambda kb=k_block: sn_tp.k_block_tree(x, w, kb),
                "stock": lambda: F.linear(x, w),
            }
            row: dict = {"M": m, "K": k, "N": n, "k_block": k_block}
            outs = {}
            for name, fn in fns.items():
                y = fn()
                y.backward(dy)
                outs[name] = (y.detach(), x.grad.clone(), w.grad.clone())
                x.grad = w.grad = None
                with torch.no_grad():
                    row[f"{name}_forward_s"] = _median_s(fn, repeats)

                def step(fn=fn):
                    fn().backward(dy)
                    x.grad = w.grad = None

                row[f"{name}_forward_backward_s"] = _median_s(step, repeats)
            row["fused_bits_equal_blocks"] = all(
                torch.equal(a, b) for a, b in zip(outs["fused"], outs["blocks"], strict=True)
            )
            for what in ("forward", "forward_backward"):
                row[f"{what}_speedup_vs_blocks"] = row[f"blocks_{what}_s"] / row[f"fused_{what}_s"]
                row[f"{what}_fused_over_stock_speed"] = row[f"stock_{what}_s"] / row[f"fused_{what}_s"]
            print(row, flush=True)
            rows.append(row)
    return {"machine": machine_facts(), "threads": torch.get_num_threads(), "dtype": "float32", "rows": rows}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/bench/k_block_tree.json")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    result = run(args.repeats)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"-> {out}")
    return result


if __name__ == "__main__":
    main()
