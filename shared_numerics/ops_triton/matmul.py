"""Batch-invariant GEMM (``linear`` and its backward): a persistent Triton kernel and a decode-size one, the same bits.

Every output element is the sum of ``BLOCK_K``-wide dots in increasing K order in an fp32 accumulator (with
``k_chunk``: per fixed K chunk, the chunks' partials added in order); the bias is added in fp32 and the result rounded
once to the output dtype. bf16/fp16 operands go straight into ``tl.dot`` (tensor cores: wgmma on Hopper, mma on
Ampere) with fp32 accumulation — no upcast; fp32 operands use ``input_precision="ieee"`` (exact fp32 products, no
TF32). No autotuning; ``BLOCK_K`` and the chunking are functions of the dtype alone (:data:`CONFIGS`), so a row's
bits depend only on the row, the weight and the K order — never on how many rows share the call.

Two paths, picked by M (:func:`use_split_path`): the persistent one (``grid = #SMs``, 128 x 256 tiles in grouped
order for L2 reuse) and, for decode-size M, one program per 64-row tile as wide as the SMs allow
(:func:`split_tile_n`; rows past M are not read, tiles in column-major order). An element's sum does not depend on the
tile it is computed in (each warpgroup issues wgmma on 64-row slices; the rows and columns beside it do not enter
it): checked on an H200 at every tile width (``tests/test_cuda.py``, ``benchmarks/gpu_gemm.py``), so the choice
changes only the speed — at M = 1-64 on the Qwen3-8B shapes, 0.74-1.06x of cuBLAS instead of 0.28x
(``benchmarks/results/gpu_gemm_h200.json``).

Operands share one dtype: a weight of another dtype than ``x`` is rounded to ``x.dtype`` first (tensor-core operands
are one dtype; under FSDP mixed precision the weight already arrives in the compute dtype). Against the torch backend
(fixed-shape oneDNN calls on CPU) results agree to fp32 rounding of the products' sum, not bitwise.

The backward's ``dX = dY W`` is the same kernel (row-invariant); ``dW = dY^T X`` reduces over the call's tokens and
needs only determinism, so it is one ``torch.mm`` of that shape (cuBLAS is bitwise reproducible for a given shape and
GPU): on an H200 the Qwen3-8B-shaped layer's forward+backward went from 0.35x to 0.65x stock with it.

Source: Thinking Machines, "Defeating Nondeterminism in LLM Inference" (2025) persistent matmul (and its point that
split-K is batch-invariant when the split does not depend on M); vLLM
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

__all__ = [
    "CONFIGS",
    "SPLIT_FILL",
    "GemmConfig",
    "gemm",
    "linear",
    "num_programs",
    "split_tile_n",
    "tile_offsets",
    "use_split_path",
]


@dataclass(frozen=True)
class GemmConfig:
    """One fixed tile configuration. ``block_k``, ``k_chunk`` and the dot's input precision define the bits; the
    others only how fast they are computed.

    Two paths compute the same bits (:func:`gemm` picks one by M, which is allowed only because the bits do not
    depend on it): the persistent path (``block_m`` x ``block_n`` tiles, ``group_m``, stages, warps) and the
    decode-size path, one program per ``split_m`` x ``split_n`` tile (the widest of ``split_n`` that still gives
    every SM a tile) and, with ``k_chunk``, per K chunk. A tile's element sums the same ``block_k``-wide dots in the
    same order whatever the tile's shape (each warpgroup issues wgmma on 64-row slices; an element's sum does not
    depend on how many rows or columns share the instruction): checked on the GPU across these tiles by
    ``benchmarks/gpu_gemm.py`` and ``tests/test_cuda.py``.

    ``k_chunk``: ``None`` sums K in one run of dots; an int sums K in ``k_chunk``-wide chunks, each from a zero fp32
    accumulator, added to the total in chunk order — the decode-size path then computes the chunks in parallel
    programs (split-K whose split is fixed by K alone, never by M) and one ordered sum."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_stages: int
    num_warps: int
    ieee: bool
    k_chunk: int | None = None
    split_m: int = 64
    split_n: tuple[int, ...] = (128, 64, 32)
    split_stages: tuple[int, ...] = (6, 8, 10)
    split_warps: int = 4

    def __post_init__(self):
        if self.k_chunk is not None and self.k_chunk % self.block_k:
            raise ValueError(f"k_chunk {self.k_chunk} must be a multiple of block_k {self.block_k}")
        if len(self.split_stages) != len(self.split_n):
            raise ValueError("split_stages gives one stage count per split_n width")


#: bf16/fp16 128x256x64: measured on an H200 (``triton_gemm_configs`` of ``benchmarks/results/gpu_kernels_h200*.json``,
#: 4096 -> 12288, M = 4096): 676 TFLOP/s against 450 for vLLM's 128x128x64 in one run, 521-556 in the next (the
#: same config twice: the spread between runs); ``linear`` 0.66x -> 0.87x of cuBLAS.
CONFIGS = {
    torch.bfloat16: GemmConfig(128, 256, 64, 8, 3, 8, ieee=False),
    torch.float16: GemmConfig(128, 256, 64, 8, 3, 8, ieee=False),
    torch.float32: GemmConfig(64, 64, 32, 8, 3, 4, ieee=True, split_n=(64, 32), split_stages=(3, 3), split_warps=8),
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
def _chunk_dot(a_ptr, b_ptr, ra, rb, k0, k1, M, K, sam, sak, sbk, sbn, IEEE, LARGE, MASK_ROWS, BM, BN, BK):
    """fp32 ``A[ra, k0:k1] @ B[k0:k1, rb]`` (``K``: the operands' full depth, for the masks): ``BK``-wide dots in
    increasing K from a zero accumulator — a whole K or one chunk's partial, the same bits on both paths.
    ``MASK_ROWS``: rows ``>= M`` are not read (zeros) — the decode-size path, where a tile of 64 rows may hold one
    token: clamping them to a valid row instead had every program read the same row, a hot spot that halved the
    speed at M = 1 on an H200."""
    rk0 = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for ki in range(tl.cdiv(k1 - k0, BK)):
        kk = k0 + ki * BK
        rk = kk + rk0
        if LARGE:
            rk = rk.to(tl.int64)
        if MASK_ROWS:  # noqa: SIM108 - a constexpr if
            a_mask = (ra[:, None] < M) & (rk0[None, :] < K - kk)
        else:
            a_mask = rk0[None, :] < K - kk
        a = tl.load(a_ptr + ra[:, None] * sam + rk[None, :] * sak, mask=a_mask, other=0.0)
        b = tl.load(b_ptr + rk[:, None] * sbk + rb[None, :] * sbn, mask=rk0[:, None] < K - kk, other=0.0)
        if IEEE:  # noqa: SIM108 - a constexpr if: Triton compiles only the branch taken
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _finish(total, c_ptr, bias_ptr, rm, rn, M, N, scm, scn, HAS_BIAS):
    """Both paths' epilogue: the bias added in fp32, one rounding to the output dtype, the tile's valid elements
    stored."""
    if HAS_BIAS:
        total = total + tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(
        c_ptr + rm[:, None] * scm + rn[None, :] * scn,
        total.to(c_ptr.dtype.element_ty),
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )


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
    KCHUNK: tl.constexpr,
    CHUNKED: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
):
    """Persistent path: each program walks its tiles; a tile's K in one run of dots, or (``CHUNKED``) its K chunks
    in order, chunk partials summed into a zero fp32 total in chunk order."""
    for tile_id in tl.range(tl.program_id(0), tl.cdiv(M, BM) * tl.cdiv(N, BN), NUM_PROGRAMS, flatten=not CHUNKED):
        rm, rn = tile_offsets(tile_id, M, N, BM, BN, GROUP_M)
        if LARGE:
            rm = rm.to(tl.int64)
            rn = rn.to(tl.int64)
        # rows / columns past the edge read row / column 0 (their results are never stored)
        ra = tl.max_contiguous(tl.multiple_of(tl.where(rm < M, rm, 0), BM), BM)
        rb = tl.max_contiguous(tl.multiple_of(tl.where(rn < N, rn, 0), BN), BN)
        if CHUNKED:
            total = tl.zeros((BM, BN), dtype=tl.float32)
            for k0 in range(0, K, KCHUNK):
                k1 = tl.minimum(k0 + KCHUNK, K)
                total += _chunk_dot(
                    a_ptr, b_ptr, ra, rb, k0, k1, M, K, sam, sak, sbk, sbn, IEEE, LARGE, False, BM, BN, BK
                )
        else:
            total = _chunk_dot(a_ptr, b_ptr, ra, rb, 0, K, M, K, sam, sak, sbk, sbn, IEEE, LARGE, False, BM, BN, BK)
        _finish(total, c_ptr, bias_ptr, rm, rn, M, N, scm, scn, HAS_BIAS)


@triton.jit
def _gemm_split_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    bias_ptr,
    ws_ptr,
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
    DIRECT: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    KCHUNK: tl.constexpr,
    CHUNKED: tl.constexpr,
):
    """Decode-size path: program ``(tile, chunk)`` computes one chunk's fp32 partial of one tile into the workspace
    ``[chunks, M, N]`` or, with one chunk (``DIRECT``), finishes the tile as the persistent path does. Tiles in
    column-major order: the row tiles of one column block run side by side and share its weight columns in L2."""
    num_pid_m = tl.cdiv(M, BM)
    pid_m = tl.program_id(0) % num_pid_m
    pid_n = tl.program_id(0) // num_pid_m
    chunk = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    if LARGE:
        rm = rm.to(tl.int64)
        rn = rn.to(tl.int64)
    ra = tl.max_contiguous(tl.multiple_of(rm, BM), BM)
    rb = tl.max_contiguous(tl.multiple_of(tl.where(rn < N, rn, 0), BN), BN)
    if CHUNKED:
        k0 = chunk * KCHUNK
        k1 = tl.minimum(k0 + KCHUNK, K)
    else:
        k0 = 0
        k1 = K
    part = _chunk_dot(a_ptr, b_ptr, ra, rb, k0, k1, M, K, sam, sak, sbk, sbn, IEEE, LARGE, True, BM, BN, BK)
    if DIRECT:
        if CHUNKED:
            total = tl.zeros((BM, BN), dtype=tl.float32)
            total += part
        else:
            total = part
        _finish(total, c_ptr, bias_ptr, rm, rn, M, N, scm, scn, HAS_BIAS)
    else:
        tl.store(ws_ptr + (chunk * M + rm[:, None]) * N + rn[None, :], part, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _chunk_sum_kernel(ws_ptr, c_ptr, bias_ptr, M, N, CHUNKS, scm, scn, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """The split path's reduction: ``total = 0; total += partial[c]`` for c in chunk order, bias, one rounding —
    the persistent path's epilogue, element by element."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for c in range(CHUNKS):
        total += tl.load(ws_ptr + c * M * N + offs, mask=mask, other=0.0)
    rm = offs // N
    rn = offs % N
    if HAS_BIAS:
        total = total + tl.load(bias_ptr + rn, mask=mask, other=0.0).to(tl.float32)
    tl.store(c_ptr + rm * scm + rn * scn, total.to(c_ptr.dtype.element_ty), mask=mask)


#: the share of the SMs a launch's tiles must fill: below it the decode-size path is taken, and its tile width is
#: the widest that fills it (the FP8 GEMM's tile choice uses it too)
SPLIT_FILL = 0.7


def use_split_path(m: int, n: int, cfg: GemmConfig, device: torch.device) -> bool:
    """The decode-size path for at most one row tile of ``split_m`` rows, or when the persistent path's tiles would
    leave more than 30% of the SMs idle. Either path gives the same bits: the choice (a function of M) changes only
    the speed (measured at M = 128..512: ``mid_m`` of ``benchmarks/results/gpu_gemm_h200.json``)."""
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    return m <= cfg.split_m or tiles < SPLIT_FILL * num_programs(device)


def split_tile_n(m: int, n: int, cfg: GemmConfig, device: torch.device, chunks: int = 1) -> int:
    """The decode-size path's tile width: the widest of ``cfg.split_n`` whose tiles (times K chunks) fill 70% of the
    SMs, else the narrowest."""
    for bn in cfg.split_n:
        if triton.cdiv(m, cfg.split_m) * triton.cdiv(n, bn) * chunks >= SPLIT_FILL * num_programs(device):
            return bn
    return cfg.split_n[-1]


def gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    *,
    config: GemmConfig | None = None,
    split: bool | None = None,
    split_n: int | None = None,
) -> torch.Tensor:
    """``a @ b (+ bias)``: ``a [M, K]``, ``b [K, N]`` (any strides, same dtype), fp32 accumulation, result
    ``[M, N]`` in ``out_dtype``. The tile config is :data:`CONFIGS` ``[a.dtype]`` (``config`` overrides it: the
    benchmark's sweeps). ``split`` forces the decode-size path (True) or the persistent one (False), ``split_n`` the
    decode-size tile width; by default :func:`use_split_path` and :func:`split_tile_n` pick them. The bits are the
    same whichever is picked.

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
    cfg = config or CONFIGS[a.dtype]
    chunked = cfg.k_chunk is not None
    large = max(a.numel(), b.numel(), c.numel()) >= 2**31
    strides = (a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1))
    bias_arg = bias if bias is not None else c
    if split if split is not None else use_split_path(m, n, cfg, a.device):
        chunks = triton.cdiv(k, cfg.k_chunk) if chunked else 1
        direct = chunks == 1
        ws = c if direct else torch.empty((chunks, m, n), dtype=torch.float32, device=a.device)
        large = large or ws.numel() >= 2**31
        bn = split_n or split_tile_n(m, n, cfg, a.device, chunks)
        _gemm_split_kernel[(triton.cdiv(m, cfg.split_m) * triton.cdiv(n, bn), chunks)](
            a,
            b,
            c,
            bias_arg,
            ws,
            m,
            n,
            k,
            *strides,
            HAS_BIAS=bias is not None,
            IEEE=cfg.ieee,
            LARGE=large,
            DIRECT=direct,
            BM=cfg.split_m,
            BN=bn,
            BK=cfg.block_k,
            KCHUNK=cfg.k_chunk or cfg.block_k,
            CHUNKED=chunked,
            num_stages=cfg.split_stages[cfg.split_n.index(bn)] if bn in cfg.split_n else cfg.split_stages[-1],
            num_warps=cfg.split_warps,
        )
        if not direct:
            block = 1024
            _chunk_sum_kernel[(triton.cdiv(m * n, block),)](
                ws, c, bias_arg, m, n, chunks, c.stride(0), c.stride(1), HAS_BIAS=bias is not None, BLOCK=block
            )
        return c
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    programs = min(num_programs(a.device), tiles)
    _gemm_kernel[(programs,)](
        a,
        b,
        c,
        bias_arg,
        m,
        n,
        k,
        *strides,
        HAS_BIAS=bias is not None,
        IEEE=cfg.ieee,
        LARGE=large,
        BM=cfg.block_m,
        BN=cfg.block_n,
        BK=cfg.block_k,
        KCHUNK=cfg.k_chunk or cfg.block_k,
        CHUNKED=chunked,
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
