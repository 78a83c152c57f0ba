"""GPU decode-size GEMMs (issue 57 point 1): the Triton GEMM vs cuBLAS ``F.linear`` at M in {1, 8, 64, 256, 4096} on
the Qwen3-8B shapes (4096 -> 12288, 12288 -> 4096, 4096 -> 151936), bf16 — side by side in one run, medians, JSON
with the device name.

Two timings per case: ``graph`` (20 calls captured in one CUDA graph and replayed: kernel time alone, what vLLM's
decode replays) and ``eager`` (one call between two CUDA events with the GPU idle before it: the host's launch cost
included). Ratios are ``stock / ours`` (1.0 = as fast as cuBLAS).

Every decode-size variant (tile width ``split_n``, stages, and K-chunked split-K ``k_chunk``) is checked bitwise
against the persistent path's rows of the same K order at M = 4096 before it is timed; a variant whose rows differ
is reported and not eligible. ``F.linear``'s own row invariance is recorded beside (the stock control).

Usage (GPU): ``python -m benchmarks.gpu_gemm --out benchmarks/results/gpu_gemm_h200.json``. Without a GPU,
``--smoke`` (with ``TRITON_INTERPRET=1``) runs every step at tiny shapes under Triton's interpreter with wall-clock
timers (checks the script; its timings mean nothing); otherwise it writes ``{"skipped": ...}`` and exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path

import torch

from benchmarks.timing import cuda_event_ms

SHAPES = ((4096, 12288), (12288, 4096), (4096, 4096), (4096, 151936))  # (K, N): Qwen3-8B gate/up, down, o, lm_head
SMALL_M = (1, 8, 64, 256)
LARGE_M = 4096


def graph_ms(fn, calls: int = 20, replays: int = 7) -> float:
    """Median per-call time of ``fn`` captured ``calls`` times in one CUDA graph, over ``replays`` replays."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / calls)
    del g
    return statistics.median(times)


def wall_ms(fn, calls: int = 1, replays: int = 1, repeats: int = 1) -> float:
    """The smoke run's timer (CPU, interpreter): one call's wall time."""
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def _timed(timers: dict, ours, stock, flops) -> dict:
    out = {}
    for how, timer in timers.items():
        t_o, t_s = timer(ours), timer(stock)
        out[how] = {
            "ours_ms": t_o,
            "stock_ms": t_s,
            "stock_over_ours": t_s / t_o,
            "ours_tflops": flops / t_o / 1e9,
            "stock_tflops": flops / t_s / 1e9,
        }
    return out


def _with_stages(cfg, bn: int, stages: int):
    st = list(cfg.split_stages)
    st[cfg.split_n.index(bn)] = stages
    return dataclasses.replace(cfg, split_stages=tuple(st))


def variants(base) -> dict:
    """Decode-size variants to check and time: name -> (config, split_n). The K-chunked ones carry their own
    persistent tile (128 x 128: a chunked 128 x 256 tile spills its two accumulators)."""
    out = {}
    for bn, stages in ((128, (6, 8)), (64, (8, 12)), (32, (10, 16))):
        for st in stages:
            out[f"bn{bn}_s{st}"] = (_with_stages(base, bn, st), bn)
    chunked = dataclasses.replace(base, k_chunk=2048, block_n=128, num_stages=4)
    for bn in (128, 64):
        out[f"kchunk2048_bn{bn}"] = (chunked, bn)
    return out


def host_us(fn, calls: int = 200) -> float:
    """Host time per call of ``fn`` in a loop (microseconds): the launch cost, when it exceeds the kernel's."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def mid_m(mm, F, timer, dev, dt, shapes, ms) -> dict:
    """Between decode and prefill (M = 128..512): the persistent path against the decode-size path at each tile
    width, bits checked against the persistent rows — the data :func:`~shared_numerics.ops_triton.matmul.use_split_path`
    is chosen by."""
    g = torch.Generator(device=dev).manual_seed(3)
    base = mm.CONFIGS[dt]
    out: dict = {}
    for k, n in shapes:
        w = (torch.randn(n, k, generator=g, device=dev) * 0.02).to(dt)
        for m in ms:
            x = torch.randn(m, k, generator=g, device=dev).to(dt)
            ref = mm.gemm(x, w.t(), dt, split=False)
            row = {
                "stock_ms": timer(lambda x=x: F.linear(x, w)),
                "persistent_ms": timer(lambda x=x: mm.gemm(x, w.t(), dt, split=False)),
                "default": "decode" if mm.use_split_path(m, n, base, x.device) else "persistent",
            }
            for bn in base.split_n:
                row[f"decode_bn{bn}_ms"] = timer(lambda x=x, bn=bn: mm.gemm(x, w.t(), dt, split=True, split_n=bn))
                row[f"decode_bn{bn}_bitwise"] = bool(torch.equal(mm.gemm(x, w.t(), dt, split=True, split_n=bn), ref))
            out[f"{k}->{n} M{m}"] = row
            print("mid M", k, n, m, row, flush=True)
    return out


FP8_CONFIGS = {
    "128x128x128_s2_w8": dict(BM=128, BN=128, BK=128, GROUP_M=8, num_stages=2, num_warps=8),  # before 2026-11-29
    "128x128x128_s3_w8": dict(BM=128, BN=128, BK=128, GROUP_M=8, num_stages=3, num_warps=8),
    "128x128x128_s4_w4": dict(BM=128, BN=128, BK=128, GROUP_M=8, num_stages=4, num_warps=4),
    "128x256x128_s3_w8": dict(BM=128, BN=256, BK=128, GROUP_M=8, num_stages=3, num_warps=8),
    "256x128x128_s3_w8": dict(BM=256, BN=128, BK=128, GROUP_M=8, num_stages=3, num_warps=8),
    "64x128x128_s4_w4": dict(BM=64, BN=128, BK=128, GROUP_M=8, num_stages=4, num_warps=4),
}


def fp8_configs(timer, dev, dt, ms) -> dict:
    """The FP8 GEMM's tile config vs alternatives (per-channel and blockwise scales, 4096 -> 12288), each checked
    bitwise against the current config's output; stock: ``torch._scaled_mm`` with per-row scales."""
    from shared_numerics.ops_triton import fp8 as F8

    g = torch.Generator(device=dev).manual_seed(4)
    w = (torch.randn(12288, 4096, generator=g, device=dev) * 0.02).to(dt)
    out: dict = {"current": dict(F8.FP8_CONFIGS)}
    for gran in ("per_channel", "block"):
        qw, sw = F8.quantize_fp8_weight(w, gran)
        for m in ms:
            x = torch.randn(m, 4096, generator=g, device=dev).to(dt)
            qx, sx = F8.quantize_fp8_activation(x, gran)
            ref = F8._gemm(qx, sx, qw, sw, gran, dt)
            row: dict = {
                "default_ms": timer(lambda qx=qx, sx=sx, qw=qw, sw=sw, gran=gran: F8._gemm(qx, sx, qw, sw, gran, dt))
            }
            if gran == "per_channel":
                qr, sr = F8.quantize_fp8_weight(x)  # per-row scales for _scaled_mm

                def stock(qr=qr, sr=sr, qw=qw, sw=sw):
                    return torch._scaled_mm(
                        qr, qw.t(), scale_a=sr.unsqueeze(1), scale_b=sw.float().unsqueeze(0), out_dtype=dt
                    )

                row["stock_ms"] = timer(stock)
            for name, cfg in FP8_CONFIGS.items():
                try:
                    same = bool(torch.equal(F8._gemm(qx, sx, qw, sw, gran, dt, cfg), ref))
                    t = timer(
                        lambda qx=qx, sx=sx, qw=qw, sw=sw, gran=gran, cfg=cfg: F8._gemm(qx, sx, qw, sw, gran, dt, cfg)
                    )
                    row[name] = {"ms": t, "bitwise_current": same}
                except Exception as e:  # noqa: BLE001 - a config that does not fit: report it
                    row[name] = {"error": f"{type(e).__name__}: {e}"[:200]}
            out[f"{gran} M{m}"] = row
            print("fp8", gran, m, row, flush=True)
    return out


def run(args) -> dict:
    import torch.nn.functional as F
    import triton

    from shared_numerics.ops_triton import matmul as mm
    from shared_numerics.ops_triton.table import OPS as T

    dev, dt = ("cpu" if args.smoke else "cuda"), torch.bfloat16
    shapes, small_m, large_m = (((64, 96), (160, 64)), (1, 8), 80) if args.smoke else (SHAPES, SMALL_M, LARGE_M)
    # graph: kernel time; eager: one call with the host's launch cost (benchmarks.timing.cuda_event_ms)
    timers = {"graph": wall_ms, "eager": wall_ms} if args.smoke else {"graph": graph_ms, "eager": cuda_event_ms}
    timer = timers["graph"]
    g = torch.Generator(device=dev).manual_seed(0)
    base = mm.CONFIGS[dt]
    result: dict = {
        "device": "cpu (Triton interpreter: timings meaningless)" if args.smoke else torch.cuda.get_device_name(),
        "sms": mm.num_programs(torch.device(dev)),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "default_config": dataclasses.asdict(base),
        "shapes": {},
    }
    for k, n in shapes:
        t0 = time.time()
        key = f"{k}->{n}"
        w = (torch.randn(n, k, generator=g, device=dev) * 0.02).to(dt)
        x = torch.randn(large_m, k, generator=g, device=dev).to(dt)
        full = mm.gemm(x, w.t(), dt, split=False)
        stock_full = F.linear(x, w)
        case: dict = {"default": {}, "variants": {}, "stock_rows_invariant": {}}
        for m in (*small_m, large_m):
            xm = x[:m].contiguous()
            split = mm.use_split_path(m, n, base, x.device)
            res = {"path": f"decode bn{mm.split_tile_n(m, n, base, x.device)}" if split else "persistent"}
            res["rows_equal_m4096"] = bool(torch.equal(T["linear"](xm, w), full[:m]))
            res.update(_timed(timers, lambda xm=xm: T["linear"](xm, w), lambda xm=xm: F.linear(xm, w), 2 * m * n * k))
            if m == 1 and not args.smoke:
                res["host_us_per_call"] = {
                    "ours": host_us(lambda xm=xm: T["linear"](xm, w)),
                    "ours_gemm": host_us(lambda xm=xm: mm.gemm(xm, w.t(), dt)),
                    "stock": host_us(lambda xm=xm: F.linear(xm, w)),
                }
            case["default"][f"M{m}"] = res
            case["stock_rows_invariant"][f"M{m}"] = bool(torch.equal(F.linear(xm, w), stock_full[:m]))
            print(key, m, res, flush=True)
        refs = {None: full}
        for name, (cfg, bn) in variants(base).items():
            if args.smoke and name not in ("bn128_s6", "bn32_s10", "kchunk2048_bn128"):
                continue
            if n > 20000 and cfg.k_chunk is not None:
                continue  # lm_head: the chunked variants' workspace is M x 151936 x chunks; skip (time)
            try:
                if cfg.k_chunk not in refs:
                    refs[cfg.k_chunk] = mm.gemm(x, w.t(), dt, config=cfg, split=False)
                    xl = x
                    t_l = timer(lambda cfg=cfg, xl=xl: mm.gemm(xl, w.t(), dt, config=cfg, split=False), calls=5)
                    t_s = timer(lambda xl=xl: F.linear(xl, w), calls=5)
                    case["variants"][f"persistent_kchunk{cfg.k_chunk}_M{large_m}"] = {
                        "ours_ms": t_l,
                        "stock_ms": t_s,
                        "stock_over_ours": t_s / t_l,
                    }
                ref = refs[cfg.k_chunk]
                v: dict = {}
                for m in small_m[:3]:
                    xm = x[:m].contiguous()
                    same = bool(torch.equal(mm.gemm(xm, w.t(), dt, config=cfg, split=True, split_n=bn), ref[:m]))
                    same &= bool(
                        torch.equal(
                            mm.gemm(x[100 : 100 + m], w.t(), dt, config=cfg, split=True, split_n=bn), ref[100 : 100 + m]
                        )
                    )
                    t_o = timer(
                        lambda xm=xm, cfg=cfg, bn=bn: mm.gemm(xm, w.t(), dt, config=cfg, split=True, split_n=bn)
                    )
                    t_s = timer(lambda xm=xm: F.linear(xm, w))
                    v[f"M{m}"] = {
                        "rows_equal_persistent": same,
                        "ours_ms": t_o,
                        "stock_ms": t_s,
                        "stock_over_ours": t_s / t_o,
                    }
                case["variants"][name] = v
            except Exception as e:  # noqa: BLE001 - a variant that fails to compile or run: report it, go on
                case["variants"][name] = {"error": f"{type(e).__name__}: {e}"[:300]}
            print(key, name, case["variants"][name], flush=True)
        case["seconds"] = time.time() - t0
        result["shapes"][key] = case
        w = x = full = stock_full = refs = None  # free the GPU memory before the next shape
        if not args.smoke:
            torch.cuda.empty_cache()
    mid_shapes = shapes if args.smoke else shapes[:3]
    result["mid_m"] = mid_m(mm, F, timer, dev, dt, mid_shapes, (16, 32) if args.smoke else (128, 256, 512))
    result["fp8_configs"] = {} if args.smoke else fp8_configs(timer, dev, dt, (1, 64, 4096))
    return result


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/bench/gpu_gemm.json")
    ap.add_argument("--smoke", action="store_true", help="no GPU: tiny shapes on CPU under Triton's interpreter")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--smoke needs TRITON_INTERPRET=1 in the environment (set before Python starts)")
        result = run(args)
    elif not torch.cuda.is_available():
        result = {"skipped": "no CUDA device on this machine"}
    else:
        result = run(args)
    out.write_text(json.dumps(result, indent=1))
    print(f"-> {out}")
    return result


if __name__ == "__main__":
    main()
