"""``benchmarks/gpu_kernels.py`` and ``benchmarks/gpu_gemm.py`` run end to end (``--smoke``: tiny shapes, CPU,
Triton's interpreter), so a lent GPU session can run them as they are: every case present, our rows batch invariant
in every case that checks them, every target of the issue reported. The timings of a smoke run mean nothing and are
not checked."""

from __future__ import annotations

import json

import pytest


@pytest.mark.extended  # `make test-extended`: the GPU benchmark on the interpreter (~30 s)
def test_gpu_benchmark_smoke_run(tmp_path):
    from benchmarks.gpu_kernels import TARGETS, main

    out = tmp_path / "gpu.json"
    result = main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text())["device"].startswith("cpu (Triton interpreter")
    for op in (
        "linear",
        "linear_cublas",
        "linear_cublas_rows128",
        "lora_linear",
        "fp8_linear",
        "rms_norm",
        "add_rms_norm",
        "rms_norm_rope",
        "silu_and_mul",
        "log_softmax",
        "selected_logprobs",
    ):
        for m in ("M4", "M40"):
            case = result["ops"][op][m]
            assert "error" not in case or op == "fp8_linear", (op, m, case)  # torch._scaled_mm may be GPU-only
            assert case.get("ours_rows_invariant", True) is True
    assert result["attention"]["decode"]["ours_kv_gb_per_s"] > 0
    assert set(result["layer"]) == set(result["layer_cublas"]) == {"forward", "forward_backward"}
    current = result["triton_attention_configs"]["current"]
    assert all(current[f"{case}_bitwise_current"] for case in ("prefill", "fwd_bwd", "decode")), current
    assert len(result["targets"]) == len(TARGETS) and all(t["value"] is not None for t in result["targets"].values())


def test_gpu_gemm_benchmark_smoke_run(tmp_path):
    """``benchmarks/gpu_gemm.py --smoke``: every shape and M timed, the default path's rows and every decode variant's
    rows bitwise the persistent path's (on the interpreter: the algorithm; the GPU run proves the bits)."""
    from benchmarks.gpu_gemm import main

    out = tmp_path / "gemm.json"
    result = main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text())["device"].startswith("cpu (Triton interpreter")
    assert len(result["shapes"]) == 2
    for case in result["shapes"].values():
        assert len(case["default"]) == 3 and all(r["rows_equal_m4096"] for r in case["default"].values())
        variants = [
            r
            for v in case["variants"].values()
            for r in v.values()
            if isinstance(r, dict) and "rows_equal_persistent" in r
        ]
        assert variants and all(r["rows_equal_persistent"] for r in variants)
    assert result["mid_m"] and all(
        r[f"decode_bn{bn}_bitwise"] for r in result["mid_m"].values() for bn in (128, 64, 32)
    )
