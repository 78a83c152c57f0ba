"""Compile the ``triton`` backend's kernels for NVIDIA GPUs on a machine without one, and report their resource use:
registers per thread, stack (spill) bytes, shared memory, and whether the main loops are software-pipelined.

Triton's interpreter proves the kernels' logic; this proves they *compile* for Hopper (sm_90a) with their fixed
configs, and shows the resource use that decides their speed (a kernel that spills registers, needs more shared memory
than an SM has, or loads synchronously is slow) — before any GPU is lent. It runs the backend's real host wrappers on
CPU tensors of Qwen3-8B-like shapes; each kernel launch is intercepted, specialised exactly as Triton's JIT would
specialise it (16-byte alignment, integers equal to 1, ``do_not_specialize``), compiled with Triton's compiler and the
``ptxas`` its wheel ships, and not run; the cubin's resource use is read back with the wheel's ``cuobjdump``.
``python -m zerokld_testing.triton_aot`` prints the table; ``tests/test_triton_compile.py`` asserts it. Must run
*without* ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["H100_SMEM", "KernelReport", "compile_launches", "scenarios"]

H100_SMEM = 227 * 1024  # bytes of shared memory one block may use on sm_90


@dataclass
class KernelReport:
    """One compiled kernel (the cubin Triton built, as ``cuobjdump -res-usage`` reads it); ``cp_async``/``tma`` count
    the asynchronous copies in its PTX (pipelined loads)."""

    scenario: str
    kernel: str
    registers: int
    stack_bytes: int  # per-thread local memory: register spills (0 for a kernel that fits its registers)
    shared_bytes: int
    num_warps: int
    wgmma: int
    cp_async: int
    tma: int


def _cuobjdump() -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")


@contextmanager
def _capture(arch: int, sink: list):
    """Within the block, every ``kernel[grid](...)`` compiles for ``sm_<arch>`` and appends ``(name, compiled)``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    original = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        binder = create_function_from_signature(self.signature, self.params, backend)
        bound_args, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound_args, specialization, options)
        compiled = triton.compile(
            ASTSource(self, signature, constexprs, attrs), target=target, options=options.__dict__
        )
        sink.append((self.fn.__name__, compiled))
        return compiled

    JITFunction.run = run
    try:
        yield
    finally:
        JITFunction.run = original


def _report(scenario: str, name: str, compiled) -> KernelReport:
    """Resource use of the cubin Triton built (what a GPU would load): ``cuobjdump -res-usage``."""
    ptx = compiled.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(compiled.asm["cubin"])
        out = subprocess.run([_cuobjdump(), "-res-usage", str(path)], check=True, capture_output=True, text=True).stdout
    usage = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return KernelReport(
        scenario,
        name,
        int(usage.group(1)),
        int(usage.group(2)),
        compiled.metadata.shared,
        compiled.metadata.num_warps,
        len(re.findall(r"wgmma\.mma_async", ptx)),
        len(re.findall(r"cp\.async\.(?:ca|cg)", ptx)),
        len(re.findall(r"cp\.async\.bulk", ptx)),
    )


def scenarios() -> dict:
    """Name -> callable running the backend's wrappers once at Qwen3-8B-like shapes (CPU tensors, nothing computed)."""
    from dataclasses import replace

    from shared_numerics.ops_triton import attention as A
    from shared_numerics.ops_triton import fp8 as F8
    from shared_numerics.ops_triton import matmul as M
    from shared_numerics.ops_triton.table import OPS as T

    bf16, fp32 = torch.bfloat16, torch.float32

    def e(*shape, dtype=bf16):
        return torch.empty(*shape, dtype=dtype)

    def attention(dtype):
        def run():
            q, k = e(1, 2048, 32, 128, dtype=dtype), e(1, 2048, 8, 128, dtype=dtype)
            q.requires_grad_()
            out = A.dense_causal_attention(q, k, k, 0.088)  # forward (in-program splits) ...
            out.backward(torch.empty_like(out))  # ... and the dQ / dK,dV kernels
            kv = e(256, 8, 16, 256, dtype=dtype)
            kc, vc = kv.split(128, dim=-1)
            qsl = torch.arange(5, dtype=torch.int32)
            A.paged_causal_attention(
                e(4, 32, 128, dtype=dtype),
                kc,
                vc,
                qsl,
                torch.full((4,), 1000),
                torch.zeros(4, 64, dtype=torch.int32),
                0.088,
                1,
                1000,
            )  # split-KV + combine

        return run

    return {
        "linear_bf16": lambda: T["linear"](e(4096, 4096), e(12288, 4096)),
        "linear_fp32": lambda: T["linear"](e(512, 1024, dtype=fp32), e(1024, 1024, dtype=fp32)),
        # the decode-size path (64-row tiles, one program each), as a GPU picks it at M = 64
        "linear_bf16_decode": lambda: M.gemm(e(64, 4096), e(4096, 12288), bf16, split=True),
        "linear_fp32_decode": lambda: M.gemm(e(8, 4096, dtype=fp32), e(4096, 1024, dtype=fp32), fp32, split=True),
        # the K-chunked variant (GemmConfig.k_chunk, not the default): split-K programs + the ordered chunk sum
        "linear_bf16_split_k": lambda: M.gemm(
            e(64, 12288), e(12288, 4096), bf16, split=True, config=replace(M.CONFIGS[bf16], k_chunk=2048, block_n=128)
        ),
        "attention_bf16": attention(bf16),
        "attention_fp32": attention(fp32),
        "fp8_per_channel": lambda: F8._gemm(
            e(4096, 4096, dtype=torch.float8_e4m3fn),
            e(4096, 1, dtype=fp32),
            e(12288, 4096, dtype=torch.float8_e4m3fn),
            e(12288, dtype=fp32),
            "per_channel",
            bf16,
        ),
        "fp8_block": lambda: F8._gemm(
            e(4096, 4096, dtype=torch.float8_e4m3fn),
            e(4096, 32, dtype=fp32),
            e(12288, 4096, dtype=torch.float8_e4m3fn),
            e(96, 32, dtype=fp32),
            "block",
            bf16,
        ),
        "fp8_quant": lambda: F8.quantize_fp8_activation(torch.zeros(64, 4096, dtype=bf16)),
        "norms": lambda: (
            T["add_rms_norm"](e(64, 4096), e(64, 4096), e(4096), 1e-6),
            T["rms_norm_rope"](e(64, 32, 128), e(128), 1e-6, e(64, 64, dtype=fp32), e(64, 64, dtype=fp32)),
        ),
        "rope_silu_logsoftmax": lambda: (
            T["apply_rope"](e(64, 32, 128), e(64, 64, dtype=fp32), e(64, 64, dtype=fp32)),
            T["silu_and_mul"](e(64, 12288), e(64, 12288)),
            T["log_softmax"](e(64, 151936)),
        ),
    }


def compile_launches(arch: int = 90, names: list[str] | None = None) -> list[KernelReport]:
    """Compile every kernel launch of the chosen scenarios for ``sm_<arch>``.

    Raises:
        RuntimeError: under ``TRITON_INTERPRET=1``; compilation errors as Triton / ptxas raise them.
    """
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("triton_aot needs compiled-mode kernels: unset TRITON_INTERPRET")
    reports = []
    for scenario, fn in scenarios().items():
        if names is not None and scenario not in names:
            continue
        sink: list = []
        with _capture(arch, sink):
            fn()
        seen = set()
        for name, compiled in sink:
            key = (name, compiled.hash)
            if key not in seen:
                seen.add(key)
                reports.append(_report(scenario, name, compiled))
    return reports


if __name__ == "__main__":
    import argparse
    import json
    from dataclasses import asdict

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--json", help="write the reports here as JSON")
    args = ap.parse_args()
    reports = compile_launches(args.arch)
    if args.json:
        import triton

        Path(args.json).write_text(
            json.dumps(
                {
                    "what": f"resource use of the triton backend's kernels compiled for sm_{args.arch}a "
                    "(no GPU: Triton's compiler and the ptxas / cuobjdump of its wheel), Qwen3-8B-like shapes",
                    "triton": triton.__version__,
                    "arch": args.arch,
                    "kernels": [asdict(r) for r in reports],
                },
                indent=1,
            )
        )
    for r in reports:
        print(
            f"{r.scenario:22s} {r.kernel:18s} regs {r.registers:3d}  stack {r.stack_bytes:5d}"
            f"  smem {r.shared_bytes:6d}  warps {r.num_warps}  wgmma {r.wgmma}  cp.async {r.cp_async}"
            f"  tma {r.tma}",
            flush=True,
        )
