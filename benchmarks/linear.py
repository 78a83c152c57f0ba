"""One linear layer, ours ÷ stock, side by side in one run: ``shared_numerics.linear`` vs
``torch.nn.functional.linear``.

For each dtype (float32, bfloat16) and each row count ``M`` (default 1, 16, 32, 256, 2048) at ``K = N = 1024``:

* forward: ``y = linear(x, W)`` (no autograd);
* forward + backward: ``y = linear(x, W)``, ``y.backward(g)`` with ``x`` and ``W`` requiring grad (the trainer's
  two backward GEMMs, ``dX = dY W`` and ``dW = dY^T X``).

Stock and ours take turns in each of ``--repeats`` rounds (:func:`benchmarks.timing.wall_times_interleaved`: each
timing covers as many back-to-back calls as fill 20 ms, so that sub-millisecond calls are not jitter-bound) after a
warm-up, on the current torch thread count; medians in seconds per call and
``speed_ours_over_stock = stock_s / ours_s`` (1.0: no speed tax; the issue's target is >= 0.7). ``--row-tiles``
re-runs ours with other fixed row tiles (``shared_numerics.linear.ROW_TILE``: the float32 oneDNN calls of a CPU
without AVX-512) to show the trade-off between decode (few rows, padded to one tile) and prefill/training (many
tiles); the numerics contract uses the module's value.

The JSON records the machine (:func:`shared_numerics.machine.machine_facts`: CPU model, ISA flags, threads): stock
picks AMX / AVX512-BF16 kernels where the CPU has them, so ratios differ a lot between machines. ``gemm_partition``
records ours: the float32 path (``fmachain``: the compiled kernel; ``onednn``: pinned oneDNN calls), the bf16 path
(``amx``: the compiled AMX kernel; ``fp32``: the float32 kernel on the exact upcasts) and the pinned oneDNN
thread count (``ZEROKLD_GEMM_THREADS``, used by the oneDNN paths only). Usage:
``python -m benchmarks.linear --out benchmarks/results/linear_xeon_amx_cpu2.json``
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.timing import wall_times_interleaved
from shared_numerics.machine import machine_facts


def _fwd(fn, x, w):
    def run():
        with torch.no_grad():
            fn(x, w)

    return run


def _fwd_bwd(fn, x, w, g):
    xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()

    def run():
        xg.grad = wg.grad = None
        fn(xg, wg).backward(g)

    return run


def measure(m: int, k: int, n: int, dtype: torch.dtype, repeats: int, row_tiles: list[int]) -> list[dict]:
    """Rows of one ``(M, K, N, dtype)``: forward and forward+backward, stock and ours at each row tile."""
    sl = importlib.import_module("shared_numerics.linear")  # the package exports a function of that name

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * k**-0.5).to(dtype)
    g = torch.randn(m, n, generator=gen).to(dtype)
    rows = []
    for direction, make in (
        ("forward", lambda fn: _fwd(fn, x, w)),
        ("forward_backward", lambda fn: _fwd_bwd(fn, x, w, g)),
    ):
        contract_tile = sl.ROW_TILE
        try:
            runs = {}
            for tile in row_tiles:  # stock and ours take turns within each round
                sl.ROW_TILE = tile
                stock, ours = wall_times_interleaved([make(F.linear), make(sl.linear)], repeats)
                runs[str(tile)] = (stock, ours)
        finally:
            sl.ROW_TILE = contract_tile
        stock = runs[str(contract_tile)][0]
        row = {
            "dtype": str(dtype).removeprefix("torch."),
            "M": m,
            "K": k,
            "N": n,
            "direction": direction,
            "stock_s": statistics.median(stock),
            "stock_all": stock,
            "ours": {},
        }
        for tile, (st, ours) in runs.items():
            row["ours"][tile] = {
                "ours_s": statistics.median(ours),
                "ours_all": ours,
                "speed_ours_over_stock": statistics.median(st) / statistics.median(ours),
            }
        row["row_tile"] = contract_tile
        row["speed_ours_over_stock"] = row["ours"][str(contract_tile)]["speed_ours_over_stock"]
        print(
            f"{row['dtype']:9s} M={m:5d} {direction:16s} stock {row['stock_s'] * 1e3:8.2f} ms  ours "
            + "  ".join(f"R{t}: {v['speed_ours_over_stock']:.2f}x" for t, v in row["ours"].items()),
            flush=True,
        )
        rows.append(row)
    return rows


def main(argv=None) -> dict:
    sl = importlib.import_module("shared_numerics.linear")  # the package exports a function of that name

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/bench/linear.json")
    ap.add_argument("--ms", default="1,16,32,256,2048", help="row counts M")
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--row-tiles", default="", help="extra fixed row tiles to compare (the contract's is always run)")
    args = ap.parse_args(argv)
    tiles = sorted({sl.ROW_TILE, *(int(t) for t in args.row_tiles.split(",") if t)})
    rows = []
    for dtype in args.dtypes.split(","):
        for m in (int(v) for v in args.ms.split(",")):
            rows.extend(measure(m, args.k, args.n, getattr(torch, dtype), args.repeats, tiles))
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine_facts(),
        "args": vars(args),
        "row_tile": sl.ROW_TILE,
        "gemm_partition": sl.gemm_partition(),
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
