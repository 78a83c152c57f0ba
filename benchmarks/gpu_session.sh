#!/usr/bin/env bash
# One lent GPU session's checks, in the order that matters (see DEVELOPERS.md "GPU"): the decode-size GEMM benchmark
# (benchmarks/gpu_gemm.py: every decode tile checked bitwise, CUDA-graph and eager times vs cuBLAS), the GPU parity
# matrix (tests/test_cuda.py), then the kernel benchmark (every op vs stock; JSONs named by the device).
# Usage on the GPU machine, from the repository root: bash benchmarks/gpu_session.sh OUTDIR [BENCH_S] [TESTS_S] [GEMM_S]
# Needs torch + triton + pytest (+ pytest-timeout) + pydantic; no vLLM, TorchTitan or network.
set -u
out=${1:?output folder}; bench_s=${2:-200}; tests_s=${3:-250}; gemm_s=${4:-150}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 ZEROKLD_CUDA_TESTS=1
# the CPU GEMM kernels are not used on a GPU run: no C++ build at import
export ZEROKLD_F32_KERNEL=0 ZEROKLD_AMX=0
py=${PYTHON:-python3}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$out/gpu.txt" 2>&1
$py -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" \
  >>"$out/gpu.txt" 2>&1
cat "$out/gpu.txt"
name=$($py -c "import torch; print(torch.cuda.get_device_name().split()[1].lower())" 2>/dev/null || echo gpu)
timeout "$gemm_s" $py -m benchmarks.gpu_gemm --out "$out/gpu_gemm_$name.json" >"$out/gemm.log" 2>&1
echo "gemm benchmark rc=$?"; tail -n 12 "$out/gemm.log"
timeout "$tests_s" $py -m pytest -p no:cacheprovider -o timeout=150 -q -rfE --durations=12 -m cuda \
  tests/test_cuda.py --junitxml="$out/cuda_tests.xml" >"$out/cuda_tests.log" 2>&1
echo "tests rc=$?"; tail -n 30 "$out/cuda_tests.log"
timeout "$bench_s" $py -m benchmarks.gpu_kernels --out "$out/gpu_kernels_$name.json" >"$out/bench.log" 2>&1
echo "benchmark rc=$?"; tail -n 25 "$out/bench.log"
