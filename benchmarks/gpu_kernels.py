"""GPU: each zerokld Triton kernel vs the stock torch / cuBLAS op, and end-to-end rollout throughput plugin ÷ stock.

Runs as is on a CUDA machine; without one it writes ``{"skipped": reason}`` and exits 0 (CI machines have no GPU).

* kernels — medians over ``--repeats`` timed runs (CUDA events, after warm-up) at an LLM-like shape
  (``--tokens`` rows, ``--hidden``, ``--vocab``): ``linear`` vs ``torch.nn.functional.linear`` (cuBLAS), ``rms_norm``
  vs ``torch.nn.functional.rms_norm``, ``silu_and_mul`` vs ``F.silu(g) * u``, ``log_softmax`` vs
  ``torch.log_softmax``, dense causal attention vs ``F.scaled_dot_product_attention(is_causal=True)``, ``fp8_linear``
  vs ``torch._scaled_mm`` (where supported); ratio = stock time ÷ ours (higher is better for us).
* end to end (``--e2e``; needs a CUDA build of vLLM): :mod:`benchmarks.rollout_overhead` on the GPU.

Usage: ``python -m benchmarks.gpu_kernels --out runs/bench/gpu_kernels.json``
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch


def _time(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _kernels(args) -> dict:
    import torch.nn.functional as F

    from shared_numerics.ops_triton.table import OPS as T

    dev, dt = "cuda", getattr(torch, args.dtype)
    n, h, v, inter = args.tokens, args.hidden, args.vocab, 3 * args.hidden
    x = torch.randn(n, h, device=dev, dtype=dt)
    w = torch.randn(inter, h, device=dev, dtype=dt) * 0.02
    nw = torch.ones(h, device=dev, dtype=dt)
    g, u = torch.randn(n, inter, device=dev, dtype=dt), torch.randn(n, inter, device=dev, dtype=dt)
    z = torch.randn(min(n, 1024), v, device=dev, dtype=dt)
    b, t, hq, hk, d = max(1, n // 1024), min(n, 1024), h // 128, max(1, h // 512), 128
    q = torch.randn(b, t, hq, d, device=dev, dtype=dt)
    k = torch.randn(b, t, hk, d, device=dev, dtype=dt)
    vv = torch.randn(b, t, hk, d, device=dev, dtype=dt)
    cases = {
        "linear": (lambda: T["linear"](x, w), lambda: F.linear(x, w)),
        "rms_norm": (lambda: T["rms_norm"](x, nw, 1e-6), lambda: F.rms_norm(x, (h,), nw, 1e-6)),
        "silu_and_mul": (lambda: T["silu_and_mul"](g, u), lambda: F.silu(g) * u),
        "log_softmax": (lambda: T["log_softmax"](z), lambda: torch.log_softmax(z.float(), -1)),
        "dense_causal_attention": (
            lambda: T["dense_causal_attention"](q, k, vv, d ** -0.5),
            lambda: F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), vv.transpose(1, 2),
                                                   is_causal=True, enable_gqa=True)),
    }
    qw, sw = T["quantize_fp8_weight"](w)

    def scaled_mm():
        qx, sx = T["quantize_fp8_weight"](x)  # per-row scales, the same quantizer
        return torch._scaled_mm(qx, qw.t(), scale_a=sx.unsqueeze(1), scale_b=sw.unsqueeze(0), out_dtype=dt)

    cases["fp8_linear"] = (lambda: T["fp8_linear"](x, qw, sw), scaled_mm)
    out = {}
    for name, (ours, stock) in cases.items():
        try:
            t_ours, t_stock = _time(ours, args.repeats), _time(stock, args.repeats)
            out[name] = {"ours_ms": t_ours, "stock_ms": t_stock, "stock_over_ours": t_stock / t_ours}
        except Exception as e:  # noqa: BLE001 - report and go on with the other kernels
            out[name] = {"error": f"{type(e).__name__}: {e}"}
        print(name, out[name], flush=True)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/bench/gpu_kernels.json")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--e2e", action="store_true", help="also run benchmarks.rollout_overhead on the GPU")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        result = {"skipped": "no CUDA device on this machine"}
    else:
        result = {"device": torch.cuda.get_device_name(), "args": vars(args), "kernels": _kernels(args)}
        if args.e2e:
            try:
                from benchmarks.rollout_overhead import main as rollout

                result["e2e"] = rollout(["--out", str(out.with_name("gpu_rollout_overhead.json")), "--dtypes",
                                         args.dtype, "--hidden", "1024", "--layers", "8"])
            except Exception as e:  # noqa: BLE001 - e.g. a CPU-only vLLM build
                result["e2e"] = {"skipped": f"{type(e).__name__}: {e}"}
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result.get("skipped") or "done"), f"-> {out}")
    return result


if __name__ == "__main__":
    main()
