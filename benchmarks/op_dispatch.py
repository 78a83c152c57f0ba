"""What calling the CPU kernels as torch ops costs (issue 58 point 6), side by side in one run.

Times one decode-sized GEMM (``[M, K] x [N, K]ᵀ``, float32 and bf16 where this machine has the kernel) called five
ways, taking turns (:func:`benchmarks.timing.wall_times_interleaved`): the kernel through ctypes with the pointers
computed by hand (what the callers did before); ``shared_numerics.cpu_ops.gemm_abt`` (what they call now: on plain
tensors the op's checks and kernel without the dispatcher); the registered op through the dispatcher
(``torch.ops.zerokld.gemm_abt``: what fake tensors and ``torch.compile`` take); the same kernel wrapped by
:func:`torch.library.custom_op` (the heavier API, for reference); and ``F.linear`` (stock, the scale). JSON:
per-call medians in microseconds, each path's extra cost over the raw call, and the machine.

``python -m benchmarks.op_dispatch --out benchmarks/results/op_dispatch_<machine>.json``
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from benchmarks.timing import wall_times_interleaved
from shared_numerics import cpu_ops
from shared_numerics.gemm_cpu import amx_available, f32_available
from shared_numerics.machine import machine_facts


def _raw(lib, a, b, out):
    """The ctypes call as the callers made it before the ops (pointers and strides by hand, no checks)."""
    args = (a.data_ptr(), a.shape[0], a.shape[1], a.stride(0), 0, b.data_ptr(), b.shape[0], b.stride(0), 0, None)
    if a.dtype == torch.float32:
        return lib.zk_gemm_abt_f32(*args, out.data_ptr(), 0, out.stride(0), torch.get_num_threads(), 0)
    return lib.zk_gemm_abt_bf16(*args, out.data_ptr(), 0, 0, out.stride(0), torch.get_num_threads(), 0)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/bench/op_dispatch.json")
    ap.add_argument("--ms", default="1,8,64", help="rows M of the activation")
    ap.add_argument("--sizes", default="256,1024", help="K = N of the weight, one run per size")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args(argv)

    @torch.library.custom_op("zerokld_bench::gemm_abt", mutates_args=("out",))
    def custom(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
        _raw(cpu_ops._lib("gemm"), a, b, out)

    lib = cpu_ops._lib("gemm")
    dtypes = [dt for dt, ok in ((torch.float32, f32_available()), (torch.bfloat16, amx_available())) if ok]
    rows = []
    sizes, ms = [int(x) for x in args.sizes.split(",")], [int(x) for x in args.ms.split(",")]
    shapes = [(m, size) for size in sizes for m in ms]
    for dtype in dtypes:
        for m, size in shapes:
            a, b = torch.randn(m, size).to(dtype), torch.randn(size, size).to(dtype)
            out = torch.empty(m, size, dtype=torch.float32 if dtype == torch.float32 else torch.bfloat16)
            calls = {
                "ctypes": lambda a=a, b=b, out=out: _raw(lib, a, b, out),
                "zerokld": lambda a=a, b=b, out=out: cpu_ops.gemm_abt(a, b, None, out, False, False),
                "zerokld_op": lambda a=a, b=b, out=out: cpu_ops.gemm_abt.op(a, b, None, out, False, False),
                "custom_op": lambda a=a, b=b, out=out: custom(a, b, out),
                "F.linear": lambda a=a, b=b: torch.nn.functional.linear(a, b),
            }
            times = wall_times_interleaved(list(calls.values()), args.repeats)
            med = {name: statistics.median(t) * 1e6 for name, t in zip(calls, times, strict=True)}
            rows.append(
                {
                    "dtype": str(dtype).removeprefix("torch."),
                    "M": m,
                    "K": size,
                    "N": size,
                    "median_us": med,
                    "zerokld_over_ctypes_us": med["zerokld"] - med["ctypes"],
                    "op_over_ctypes_us": med["zerokld_op"] - med["ctypes"],
                    "custom_op_over_ctypes_us": med["custom_op"] - med["ctypes"],
                }
            )
            print(json.dumps(rows[-1]))
    result = {"machine": machine_facts(), "args": vars(args), "rows": rows}
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
