"""The Triton kernels compile for Hopper (sm_90a) with their fixed configs, and their resource use makes them runnable
and fast there: no kernel asks for more shared memory than an H100 block may use, the tensor-core kernels issue wgmma
with pipelined asynchronous loads, and nothing spills registers beyond the stated bounds.

Compiled with Triton's compiler and the ptxas its wheel ships, no GPU needed (``zerokld_testing/triton_aot.py``); the
backend's host wrappers run on CPU tensors of Qwen3-8B-like shapes and each launch is specialised as the JIT would.
Runs in a subprocess: the rest of the suite imports Triton in interpreter mode.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from zerokld_testing.triton_aot import H100_SMEM

ROOT = Path(__file__).resolve().parents[1]
TENSOR_CORE = {
    ("linear_bf16", "_gemm_kernel"),
    ("linear_bf16_decode", "_gemm_split_kernel"),
    ("linear_bf16_split_k", "_gemm_split_kernel"),
    ("attention_bf16", "_attn_fwd"),
    ("attention_bf16", "_attn_bwd_dq"),
    ("attention_bf16", "_attn_bwd_dkv"),
    ("fp8_per_channel", "_fp8_gemm"),
    ("fp8_block", "_fp8_gemm"),
}
# per-thread spill (stack) bytes allowed: the attention kernels sit at the 255-register ceiling (two fp32
# accumulators); everything else must fit its registers
STACK_BOUND = {"attention_bf16": 256, "attention_fp32": 512}


def test_kernels_compile_for_sm90_within_h100_resources(tmp_path):
    out = tmp_path / "aot.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run(
        [sys.executable, "-m", "zerokld_testing.triton_aot", "--arch", "90", "--json", str(out)],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
        timeout=600,
    )
    reports = json.loads(out.read_text())["kernels"]
    kernels = {(r["scenario"], r["kernel"]) for r in reports}
    assert kernels >= TENSOR_CORE and ("attention_bf16", "_attn_combine") in kernels
    assert ("linear_bf16_split_k", "_chunk_sum_kernel") in kernels
    for r in reports:
        where = f"{r['scenario']}/{r['kernel']}"
        assert r["shared_bytes"] <= H100_SMEM, where
        assert r["stack_bytes"] <= STACK_BOUND.get(r["scenario"], 0), where
        if (r["scenario"], r["kernel"]) in TENSOR_CORE:
            assert r["wgmma"] > 0 and r["cp_async"] > 0, where
