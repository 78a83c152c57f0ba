"""Batch-invariant GEMM (``linear`` and its backward): one persistent Triton kernel, one fixed tile config per dtype.

Every output tile ``[BLOCK_M, BLOCK_N]`` is computed by one program walking K in ``BLOCK_K`` steps in increasing
order into an fp32 accumulator; the bias is added in fp32 and the result rounded once to the output dtype. bf16/fp16
operands go straight into ``tl.dot`` (tensor cores: wgmma on Hopper, mma on Ampere) with fp32 accumulation — no
upcast; fp32 operands use ``input_precision="ieee"`` (exact fp32 products, no TF32). No split-K, no autotuning, no
shape-dependent choice of tile: the config is a function of the dtype alone (:data:`CONFIGS`), so a row's bits depend
only on the row, the weight and the K order — never on how many rows share the call. The kernel is persistent
(``grid = #SMs``, tiles in grouped order for L2 reuse), which changes only which program computes a tile.

Operands share one dtype: a weight of another dtype than ``x`` is rounded to ``x.dtype`` first (tensor-core operands
are one dtype; under FSDP mixed precision the weight already arrives in the compute dtype). Against the torch backend
(fixed-shape oneDNN calls on CPU) results agree to fp32 rounding of the products' sum, not bitwise.

The backward's ``dX = dY W`` is the same kernel (row-invariant); ``dW = dY^T X`` reduces over the call's tokens and
needs only determinism, so it is one ``torch.mm`` of that shape (cuBLAS is bitwise reproducible for a given shape and
GPU): on an H200 the Qwen3-8B-shaped layer's forward+backward went from 0.35x to 0.65x stock with it.

Source: Thinking Machines, "Defeating Nondeterminism in LLM Inference" (2025) persistent matmul; vLLM
``model_executor/determinism/batch_invariant.py`` (``matmul_kernel_persistent``, config 128x128x64, GROUP_M 8,
3 stages, 8 warps for bf16 — measured 451 TFLOP/s at 4096x4096->12288 on an H100, ``docs/design.md``; 128x256x64
measured faster here, see :data:`CONFIGS`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..gemm_autograd import linear_with

__all__ = ["CONFIGS", "GemmConfig", "gemm", "linear", "num_programs", "tile_offsets"]


@dataclass(frozen=True)
class GemmConfig:
    """One fixed tile configuration. ``block_k`` and the dot's input precision define the bits; the others only how
    fast they are computed (kept fixed as well: one compiled kernel per dtype)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_stages: int
    num_warps: int
    ieee: bool


#: bf16/fp16 128x256x64: measured on an H200 (``triton_gemm_configs`` of ``benchmarks/results/gpu_kernels_h200*.json``,
#: 4096 -> 12288, M = 4096): 676 TFLOP/s against 450 for vLLM's 128x128x64 in one run, 521-556 in the next (the
#: same config twice: the spread between runs); ``linear`` 0.66x -> 0.87x of cuBLAS, the same at M = 64
CONFIGS = {
    torch.bfloat16: GemmConfig(128, 256, 64, 8, 3, 8, ieee=False),
    torch.float16: GemmConfig(128, 256, 64, 8, 3, 8, ieee=False),
    torch.float32: GemmConfig(64, 64, 32, 8, 3, 4, ieee=True),
}
_INTERPRETER_PROGRAMS = 4


def num_programs(device: torch.device) -> int:
    """Persistent grid size: the device's SM count (a fixed small number under Triton's CPU interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _INTERPRETER_PROGRAMS


@triton.jit
def tile_offsets(tile_id, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """Row and column offsets ``[BM]``, ``[BN]`` of persistent tile ``tile_id`` in grouped order (``GROUP_M``
    row-tiles share column tiles in L2, as in Triton's matmul tutorial)."""
    num_pid_m = tl.cdiv(M, BM)
    num_pid_in_group = GROUP_M * tl.cdiv(N, BN)
    first_pid_m = (tile_id // num_pid_in_group) * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (tile_id % group_size_m)
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m * BM + tl.arange(0, BM), pid_n * BN + tl.arange(0, BN)


@triton.jit
def _gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    bias_ptr,
    M,
    N,
    K,
    sam,
    sak,
    sbk,
    sbn,
    scm,
    scn,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    LARGE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
):
    k_tiles = tl.cdiv(K, BK)
    rk0 = tl.arange(0, BK)
    for tile_id in tl.range(tl.program_id(0), tl.cdiv(M, BM) * tl.cdiv(N, BN), NUM_PROGRAMS, flatten=True):
        rm, rn = tile_offsets(tile_id, M, N, BM, BN, GROUP_M)
        if LARGE:
            rm = rm.to(tl.int64)
            rn = rn.to(tl.int64)
        # rows / columns past the edge read row / column 0 (their results are never stored)
        ra = tl.max_contiguous(tl.multiple_of(tl.where(rm < M, rm, 0), BM), BM)
        rb = tl.max_contiguous(tl.multiple_of(tl.where(rn < N, rn, 0), BN), BN)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(k_tiles):
            rk = ki * BK + rk0
            if LARGE:
                rk = rk.to(tl.int64)
            a = tl.load(a_ptr + ra[:, None] * sam + rk[None, :] * sak, mask=rk0[None, :] < K - ki * BK, other=0.0)
            b = tl.load(b_ptr + rk[:, None] * sbk + rb[None, :] * sbn, mask=rk0[:, None] < K - ki * BK, other=0.0)
            if IEEE:  # noqa: SIM108 - a constexpr if: Triton compiles only the branch taken
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        if HAS_BIAS:
            acc = acc + tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(
            c_ptr + rm[:, None] * scm + rn[None, :] * scn,
            acc.to(c_ptr.dtype.element_ty),
            mask=(rm[:, None] < M) & (rn[None, :] < N),
        )


def gemm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b (+ bias)``: ``a [M, K]``, ``b [K, N]`` (any strides, same dtype), fp32 accumulation, result
    ``[M, N]`` in ``out_dtype``. The tile config is :data:`CONFIGS` ``[a.dtype]``.

    Raises:
        TypeError: operands of different or unsupported dtypes.
    """
    if a.dtype != b.dtype or a.dtype not in CONFIGS:
        raise TypeError(f"gemm operands must share a dtype in {sorted(map(str, CONFIGS))}, got {a.dtype}, {b.dtype}")
    m, k = a.shape
    n = b.shape[1]
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return c
    if k == 0:
        return c.zero_() if bias is None else c.copy_(bias.to(out_dtype).expand(m, n))
    cfg = CONFIGS[a.dtype]
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    programs = min(num_programs(a.device), tiles)
    large = max(a.numel(), b.numel(), c.numel()) >= 2**31
    _gemm_kernel[(programs,)](
        a,
        b,
        c,
        bias if bias is not None else c,
        m,
        n,
        k,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        c.stride(0),
        c.stride(1),
        HAS_BIAS=bias is not None,
        IEEE=cfg.ieee,
        LARGE=large,
        BM=cfg.block_m,
        BN=cfg.block_n,
        BK=cfg.block_k,
        GROUP_M=cfg.group_m,
        NUM_PROGRAMS=programs,
        num_stages=cfg.num_stages,
        num_warps=cfg.num_warps,
    )
    return c


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Triton :func:`shared_numerics.linear.linear`: ``[..., K] x [N, K] (+ [N]) -> [..., N]`` in ``x.dtype``.

    The weight (and bias) are used in ``x.dtype`` (rounded if they arrive in another dtype). Differentiable
    (:func:`shared_numerics.gemm_autograd.linear_with`): ``dx = dy W`` on the same kernel (row-invariant),
    ``dW = dy^T x`` as one ``torch.mm`` (deterministic for its shape; see the module) and a column sum for the bias;
    ``dW`` comes back in the weight's dtype."""
    return linear_with(_row_gemm, x, weight, bias)


def _row_gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return gemm(a, b, a.dtype, bias)
