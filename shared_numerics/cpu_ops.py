"""zerokld's compiled CPU kernels (``csrc/*.cpp``, :mod:`shared_numerics.cpu_kernels`) as torch ops.

Each kernel entry point is one op of the ``zerokld`` library (``torch.ops.zerokld.<name>``), defined with
:class:`torch.library.Library`: a schema (typed, named arguments; outputs written in place are ``Tensor(a!)``), a CPU
implementation that checks what the kernel relies on (dtypes, shapes, strides, devices) before it passes pointers to
the library through :mod:`ctypes`, and a fake implementation (:func:`torch.library.register_fake`: nothing to
allocate, the outputs are arguments) so the ops trace under ``FakeTensorMode`` and ``torch.compile``. A wrong
argument is a schema error (``RuntimeError`` naming the op's declaration) or a ``TypeError`` / ``ValueError`` from the
checks, never a pointer into the wrong memory. The callers (:mod:`shared_numerics.gemm_cpu`, ``attention_cpu``,
``fp8``, ``norm``, ``activation``, ``rope``) keep their own Python API; the bits are the kernels', unchanged.

Why ``Library.define`` + ``impl`` rather than :func:`torch.library.custom_op`, and why the callers skip the
dispatcher on plain tensors (:func:`_define`): per-call cost, measured side by side by ``benchmarks/op_dispatch.py``
(``benchmarks/results/op_dispatch_*.json``: the raw ctypes call, the checked call the callers make, the op through
the dispatcher, a ``custom_op``) — at decode a step makes a few hundred kernel calls of a few microseconds each.
Source: PyTorch, "Custom C++ and CUDA Operators" / ``torch.library`` (schemas, ``Tensor(a!)`` aliasing annotations,
fake implementations).

The table contents the attention ops read (block tables, query rows and positions) are trusted to index their
tensors: they come from vLLM's scheduler or from :mod:`shared_numerics.attention_cpu` itself; the paged op checks the
sequences against the block table in the kernel (``ValueError``).
"""

from __future__ import annotations

import ctypes
import functools
import itertools
from pathlib import Path
from typing import Any, NoReturn

import torch

from .cpu_kernels import DTYPE_CODES, load

__all__ = [
    "LIBRARY",
    "OPS",
    "amx_available",
    "attention_backward",
    "attention_forward",
    "causal_conv1d_silu",
    "fp8_dequantize_bf16",
    "fp8_quantize",
    "f32_available",
    "fp8_to_bf16",
    "gemm_abt",
    "gemm_has_amx",
    "gemm_has_f32",
    "gated_delta_rule",
    "gated_delta_rule_backward",
    "gemm_layout",
    "l2_normalize",
    "paged_attention_forward",
    "rms_norm",
    "rms_norm_backward",
    "rope",
    "silu_mul",
    "silu_mul_backward",
]

#: the ``zerokld`` operator library (``torch.ops.zerokld``)
LIBRARY = torch.library.Library("zerokld", "DEF")
#: op name → its schema, in definition order
OPS: dict[str, str] = {}

_vp, _i64, _int, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


@functools.cache
def _lib(name: str) -> ctypes.CDLL:
    """The compiled library ``csrc/<name>.cpp`` with every entry point's C signature."""
    lib = load(name)
    table: dict[str, dict[str, tuple[list, Any]]] = {
        "gemm": {
            "zk_gemm_abt_bf16": (
                [_vp, _i64, _i64, _i64, _int, _vp, _i64, _i64, _int, _vp, _vp, _int, _int, _i64, _int, _int],
                _int,
            ),
            "zk_gemm_abt_f32": (
                [_vp, _i64, _i64, _i64, _int, _vp, _i64, _i64, _int, _vp, _vp, _int, _i64, _int, _int],
                _int,
            ),
            "zk_gemm_abt_f32_bf16": (
                [_vp, _i64, _i64, _i64, _int, _vp, _i64, _i64, _int, _vp, _vp, _int, _i64, _int, _int],
                _int,
            ),
            "zk_gemm_f32_ktree": ([_vp, _i64, _i64, _i64, _int, _vp, _i64, _i64, _int, _vp, _i64, _int, _i64], _int),
            "zk_gemm_has_amx": ([], _int),
            "zk_gemm_has_f32": ([], _int),
        },
        "fp8": {
            "zk_fp8_quantize": ([_int, _vp, _i64, _i64, _i64, _i64, _vp, _vp, _vp, _int], _int),
            "zk_fp8_to_bf16": ([_vp, _i64, _vp, _int], None),
            "zk_fp8_dequantize_bf16": ([_vp, _vp, _i64, _i64, _i64, _vp, _int], None),
        },
        "pointwise": {
            "zk_silu_mul": ([_int, _vp, _vp, _i64, _vp, _int, _vp, _int], None),
            "zk_silu_mul_bwd": ([_int, _vp, _vp, _vp, _vp, _i64, _vp, _vp, _int, _int], None),
            "zk_rms_norm": ([_int, _vp, _i64, _i64, _i64, _vp, _f32, _vp, _int, _vp, _int], None),
            "zk_rms_norm_bwd": ([_int, _vp, _vp, _i64, _i64, _vp, _vp, _vp, _int, _vp, _int], None),
            "zk_rope": ([_int, _vp, _i64, _i64, _i64, _i64, _i64, _vp, _vp, _vp, _int], None),
        },
        "gdn": {
            "zk_gated_delta_rule": ([_i64, _vp, _i64, _i64, _i64, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _int], None),
            "zk_gated_delta_rule_bwd": ([_i64, _vp, _i64, _i64, _i64] + [_vp] * 14 + [_int], None),
            "zk_l2_normalize": ([_int, _vp, _i64, _i64, _i64, _i64, _f32, _f32, _vp, _int], None),
            "zk_causal_conv1d_silu": ([_int, _i64, _vp, _i64, _i64, _vp, _vp, _vp, _vp, _int], None),
        },
        "attention": {
            "zk_attention_fwd": (
                [_int, _int, _int, _int, _vp, _vp, _vp, _i64, _i64, _i64, _int, _vp, _i64, _vp, _vp, _i64, _vp, _vp]
                + [_f32, _vp, _vp, _vp, _int],
                _int,
            ),
            "zk_attention_paged_fwd": (
                [_int, _int, _int, _int, _vp, _i64, _vp, _vp, _i64, _i64, _i64, _int, _vp, _i64, _i64, _vp, _vp]
                + [_i64, _int, _int, _f32, _vp, _vp, _vp, _int],
                _int,
            ),
            "zk_attention_bwd": (
                [_int, _int, _int, _int, _vp, _vp, _vp, _i64, _i64, _i64, _int, _vp, _i64, _vp, _vp, _vp, _vp, _i64]
                + [_vp, _vp, _f32, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _int],
                _int,
            ),
        },
    }
    for fn, (argtypes, restype) in table[name].items():
        getattr(lib, fn).argtypes = argtypes
        getattr(lib, fn).restype = restype
    return lib


def gemm_has_amx() -> bool:
    """Whether this machine's build of ``csrc/gemm.cpp`` has the AMX kernel and the OS granted the tile state."""
    return bool(_lib("gemm").zk_gemm_has_amx())


def gemm_has_f32() -> bool:
    """Whether this machine's build of ``csrc/gemm.cpp`` has the float32 FMA kernel."""
    return bool(_lib("gemm").zk_gemm_has_f32())


@functools.lru_cache(maxsize=1)
def amx_available() -> bool:
    """Whether this machine runs the AMX kernel: the CPU has AMX-BF16 (``/proc/cpuinfo`` flags ``amx_bf16`` and
    ``amx_tile``), the compiler built the kernel with it and the OS granted the tile state. ``ZEROKLD_AMX=0`` turns it
    off (then :func:`shared_numerics.linear.linear` takes its oneDNN paths). A machine property, in the numerics
    contract (:func:`shared_numerics.linear.gemm_partition`)."""
    from zerokld_plugins import envs

    if not envs.ZEROKLD_AMX:
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    if "amx_bf16" not in flags or "amx_tile" not in flags:
        return False
    return gemm_has_amx()


@functools.lru_cache(maxsize=1)
def f32_available() -> bool:
    """Whether this machine runs the float32 kernel: the kernel was built with AVX-512F or with AVX2 + FMA (both give
    the same bits). ``ZEROKLD_F32_KERNEL=0`` turns it off (then float32 takes :mod:`shared_numerics.linear`'s oneDNN
    calls). A machine property, in the numerics contract."""
    from zerokld_plugins import envs

    return envs.ZEROKLD_F32_KERNEL and gemm_has_f32()


def _define(schema: str, fake_result=None):
    """Register ``zerokld::<schema>`` with the decorated CPU implementation and a fake one (outputs are arguments:
    nothing to allocate; it returns ``fake_result``, the op's success value).

    Returns the function the callers use (the module-level name of the decorated definition; the op itself is its
    ``.op``): on plain CPU tensors outside ``torch.compile`` it runs the implementation
    itself — the same checks, the same kernel, without the dispatcher's ~2 us (a decode-sized GEMM of a small model
    takes a few microseconds); on anything else (fake tensors, tensor subclasses, tracing) it calls the op,
    ``torch.ops.zerokld.<name>``, so the dispatcher routes it (fake implementation, compiled graph)."""
    name = schema.split("(", 1)[0]
    plain_types = (torch.Tensor, torch.nn.Parameter)

    def register(impl):
        LIBRARY.define(schema)
        LIBRARY.impl(name, impl, "CPU")
        torch.library.register_fake(f"zerokld::{name}", lambda *args, **kwargs: fake_result, lib=LIBRARY)
        OPS[name] = schema
        op = getattr(torch.ops.zerokld, name).default
        is_compiling = torch.compiler.is_compiling

        def call(*args):
            if type(args[0]) in plain_types and not is_compiling():
                return impl(*args)
            return op(*args)

        call.__name__ = call.__qualname__ = name
        call.__doc__ = impl.__doc__
        call.op = op  # type: ignore[attr-defined]
        return call

    return register


def _fail(op: str, what: str, t: torch.Tensor) -> None:
    raise TypeError(f"zerokld::{op}: {what}, got {tuple(t.shape)} {t.dtype} strides {t.stride()} on {t.device}")


def _cpu(op: str, name: str, t: torch.Tensor, dtypes: tuple, dim: int | None = None, contiguous: bool = False) -> None:
    """``t`` on the CPU, of one of ``dtypes``, ``dim``-dimensional, contiguous if asked."""
    if t is None:  # the dispatcher passes None for a missing tensor
        raise TypeError(f"zerokld::{op}: {name} must be a tensor, got None")
    if t.device.type != "cpu" or t.dtype not in dtypes or (dim is not None and t.dim() != dim):
        rank = f"{dim}-d " if dim is not None else ""
        _fail(op, f"{name} must be a {rank}CPU tensor of {', '.join(map(str, dtypes))}", t)
    if contiguous and not t.is_contiguous():
        _fail(op, f"{name} must be contiguous", t)


def _shape(op: str, name: str, t: torch.Tensor, shape: tuple) -> None:
    if tuple(t.shape) != tuple(shape):
        _fail(op, f"{name} must be {tuple(shape)}", t)


_FLOATS = (torch.float32, torch.bfloat16)
_ANY_FLOAT = (torch.float32, torch.bfloat16, torch.float16)
_F32 = (torch.float32,)
_I64 = (torch.int64,)


def gemm_layout(t: torch.Tensor) -> tuple[int, int] | None:
    """``(row stride, k-major)`` of a 2-d ``[rows, K]`` GEMM operand the kernel reads in place — K contiguous
    (``(s0, 0)``), or rows contiguous, a transposed view such as ``w.t()`` (``(s1, 1)``) — else ``None`` (the caller
    copies it: :func:`shared_numerics.gemm_cpu.gemm_abt`)."""
    (rows, k), (s0, s1) = t.shape, t.stride()
    if s1 == 1 and s0 >= k and s0 > 0:
        return s0, 0
    if s0 == 1 and s1 >= rows and s1 > 0:
        return s1, 1
    return None


def _operand(op: str, name: str, t: torch.Tensor) -> tuple[int, int]:
    """:func:`gemm_layout` of ``t``, or the refusal naming it."""
    layout = gemm_layout(t)
    if layout is None:
        _fail(op, f"{name} must have K or its rows contiguous", t)
        raise AssertionError  # unreachable
    return layout


def _gemm_abt_refusal(a, b, bias, out, transpose, accumulate) -> NoReturn:
    """Raise the error that names what :func:`gemm_abt`'s one-expression test refused."""
    op = "gemm_abt"
    _cpu(op, "a", a, _FLOATS, 2)
    _cpu(op, "b", b, (a.dtype,), 2)
    if a.shape[1] != b.shape[1] or a.shape[1] == 0:
        raise ValueError(f"zerokld::{op}: A is {tuple(a.shape)} and B {tuple(b.shape)}: K differs or is 0")
    _operand(op, "a", a), _operand(op, "b", b)
    _cpu(op, "out", out, _F32 if a.dtype == torch.float32 or accumulate else _FLOATS, 2)
    _shape(op, "out", out, (b.shape[0], a.shape[0]) if transpose else (a.shape[0], b.shape[0]))
    if out.stride(1) != 1 or out.stride(0) < out.shape[1]:
        _fail(op, "out must have contiguous rows", out)
    if accumulate and (transpose or bias is not None):
        raise ValueError(f"zerokld::{op}: accumulate takes no bias and no transpose")
    if bias is not None:
        _cpu(op, "bias", bias, _F32, 1, contiguous=True)
        _shape(op, "bias", bias, (a.shape[0],))
    raise AssertionError("zerokld::gemm_abt: refused arguments that its checks accept")


_FP32, _BF16 = torch.float32, torch.bfloat16


@functools.cache
def _bf16_on_amx() -> bool:
    """Whether bf16 GEMMs take the AMX kernel here (:func:`amx_available`); otherwise the FMA kernel with bf16 operands
    (the float32 chains of their exact upcasts)."""
    return amx_available()


@_define("gemm_abt(Tensor a, Tensor b, Tensor? bias, Tensor(a!) out, bool transpose, bool accumulate) -> ()")
def gemm_abt(a, b, bias, out, transpose, accumulate):
    """``out = A · Bᵀ (+ bias[:, None])`` (or its transpose), or with ``accumulate`` ``out += A · Bᵀ`` continuing each
    element's chain: ``csrc/gemm.cpp`` (:func:`shared_numerics.gemm_cpu.gemm_abt`, ``gemm_abt_accumulate``). ``a``
    ``[I, K]`` and ``b`` ``[J, K]`` float32 or bf16 (one dtype), each with K or its rows contiguous; ``out`` ``[I, J]``
    (``[J, I]`` transposed) with contiguous rows, float32 (or bf16 for bf16 inputs); ``bias`` float32 ``[I]``. bf16
    inputs take the AMX kernel where :func:`shared_numerics.gemm_cpu.amx_available` holds, else the FMA kernel on
    their exact float32 widening (a bf16 ``out`` then gets the float32 result rounded by torch, as ``.to(bf16)``)."""
    # one expression on the hot path (a decode GEMM of a small model takes microseconds); the refusal names the fault
    if a is None or b is None or out is None:
        _gemm_abt_refusal(a, b, bias, out, transpose, accumulate)
    dt, od = a.dtype, out.dtype
    ash, bsh, osh = a.shape, b.shape, out.shape
    ok = (
        a.is_cpu and b.is_cpu and out.is_cpu and len(ash) == 2 and len(bsh) == 2 and len(osh) == 2
        and (dt is _FP32 or dt is _BF16) and b.dtype is dt
        and (od is _FP32 or (od is _BF16 and dt is _BF16 and not accumulate))
        and ash[1] == bsh[1] and ash[1] > 0
        and (osh[0], osh[1]) == ((bsh[0], ash[0]) if transpose else (ash[0], bsh[0]))
        and not (accumulate and (transpose or bias is not None))
        and (bias is None or (bias.is_cpu and bias.dtype is _FP32 and bias.is_contiguous() and bias.shape == ash[:1]))
    )  # fmt: skip
    if ok:
        ost = out.stride()
        ok = ost[1] == 1 and ost[0] >= osh[1]
    a_layout = gemm_layout(a) if ok else None
    b_layout = gemm_layout(b) if ok else None
    if a_layout is None or b_layout is None:
        _gemm_abt_refusal(a, b, bias, out, transpose, accumulate)
    bias_ptr = None if bias is None else bias.data_ptr()
    args = (a.data_ptr(), ash[0], ash[1], *a_layout, b.data_ptr(), bsh[0], *b_layout, bias_ptr, out.data_ptr())
    lib, threads = _lib("gemm"), torch.get_num_threads()
    if dt is _FP32:
        rc = lib.zk_gemm_abt_f32(*args, int(transpose), ost[0], threads, int(accumulate))
    elif _bf16_on_amx():
        code = 0 if od is _FP32 else 1
        rc = lib.zk_gemm_abt_bf16(*args, code, int(transpose), ost[0], threads, int(accumulate))
    elif od is _FP32:
        rc = lib.zk_gemm_abt_f32_bf16(*args, int(transpose), ost[0], threads, int(accumulate))
    else:  # bf16 out: the float32 result, rounded by torch
        f32 = torch.empty(osh, dtype=_FP32)
        rc = lib.zk_gemm_abt_f32_bf16(*args[:-1], f32.data_ptr(), int(transpose), osh[1], threads, 0)
        if rc == 0:
            out.copy_(f32)
    if rc != 0:
        raise RuntimeError(
            f"zerokld GEMM: this machine's build of csrc/gemm.cpp has no {dt} kernel "
            "(see amx_available / f32_available)"
        )


@_define("gemm_f32_ktree(Tensor a, Tensor b, Tensor(a!) out, int k_block) -> ()")
def gemm_f32_ktree(a, b, out, k_block):
    """``out [J, I]`` = the TP-aligned tree (:func:`shared_numerics.tensor_parallel.block_tree_sum`) over the
    ``k_block``-wide K blocks of ``B · Aᵀ``'s float32 partials, each an FMA chain from zero: ``csrc/gemm.cpp``
    ``zk_gemm_f32_ktree``. ``a`` ``[I, K]``, ``b`` ``[J, K]`` float32 with K or their rows contiguous; ``out``
    float32 with contiguous rows; ``k_block`` divides K."""
    op = "gemm_f32_ktree"
    _cpu(op, "a", a, _F32, 2)
    _cpu(op, "b", b, _F32, 2)
    _cpu(op, "out", out, _F32, 2)
    (i_rows, k), j_rows = a.shape, b.shape[0]
    if b.shape[1] != k or k == 0 or k_block <= 0 or k % k_block:
        _fail(op, f"K must match, be non-zero and a multiple of k_block {k_block}", b)
    _shape(op, "out", out, (j_rows, i_rows))
    if out.stride(1) != 1 or out.stride(0) < i_rows:
        _fail(op, "out must have contiguous rows", out)
    a_layout, b_layout = _operand(op, "a", a), _operand(op, "b", b)
    rc = _lib("gemm").zk_gemm_f32_ktree(
        a.data_ptr(), i_rows, k, *a_layout, b.data_ptr(), j_rows, *b_layout, out.data_ptr(), out.stride(0),
        torch.get_num_threads(), k_block,
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError("zerokld GEMM: this machine's build of csrc/gemm.cpp has no float32 kernel (f32_available)")


@_define("fp8_quantize(Tensor x, int group, Tensor(a!)? codes, Tensor(b!)? values, Tensor(c!) scales) -> bool", True)
def fp8_quantize(x, group, codes, values, scales):
    """FP8 (e4m3) quantization of ``x [M, K]`` (K contiguous) in groups of ``group`` along K: the ``uint8`` codes
    and / or their bf16 values ``[M, K]`` and the float32 scales ``[M, ceil(K / group)]``. Returns ``False`` when
    ``x`` holds inf or NaN (``csrc/fp8.cpp`` ``zk_fp8_quantize``)."""
    op = "fp8_quantize"
    _cpu(op, "x", x, _ANY_FLOAT, 2)
    m, k = x.shape
    if x.stride(1) != 1 or group <= 0 or m == 0 or k == 0:
        _fail(op, f"x must be non-empty with K contiguous (group {group})", x)
    if codes is not None:
        _cpu(op, "codes", codes, (torch.uint8,), 2, contiguous=True)
        _shape(op, "codes", codes, (m, k))
    if values is not None:
        _cpu(op, "values", values, (torch.bfloat16,), 2, contiguous=True)
        _shape(op, "values", values, (m, k))
    _cpu(op, "scales", scales, _F32, 2, contiguous=True)
    _shape(op, "scales", scales, (m, -(-k // group)))
    rc = _lib("fp8").zk_fp8_quantize(
        DTYPE_CODES[x.dtype],
        x.data_ptr(),
        m,
        k,
        x.stride(0),
        group,
        None if codes is None else codes.data_ptr(),
        None if values is None else values.data_ptr(),
        scales.data_ptr(),
        torch.get_num_threads(),
    )
    return rc == 0


@_define("fp8_to_bf16(Tensor codes, Tensor(a!) out) -> ()")
def fp8_to_bf16(codes, out):
    """The bf16 values (exact) of ``float8_e4m3fn`` codes, any shape, contiguous (``zk_fp8_to_bf16``)."""
    op = "fp8_to_bf16"
    _cpu(op, "codes", codes, (torch.float8_e4m3fn, torch.uint8), contiguous=True)
    _cpu(op, "out", out, (torch.bfloat16,), contiguous=True)
    _shape(op, "out", out, codes.shape)
    _lib("fp8").zk_fp8_to_bf16(codes.data_ptr(), codes.numel(), out.data_ptr(), torch.get_num_threads())


@_define("fp8_dequantize_bf16(Tensor values, Tensor scales, int group, Tensor(a!) out) -> ()")
def fp8_dequantize_bf16(values, scales, group, out):
    """``(values.float() * scale).to(bf16)`` of an activation's bf16 code values ``[M, K]`` with scales
    ``[M, ceil(K / group)]`` (``zk_fp8_dequantize_bf16``)."""
    op = "fp8_dequantize_bf16"
    _cpu(op, "values", values, (torch.bfloat16,), 2, contiguous=True)
    m, k = values.shape
    if group <= 0:
        raise ValueError(f"zerokld::{op}: group must be positive, got {group}")
    _cpu(op, "scales", scales, _F32, 2, contiguous=True)
    _shape(op, "scales", scales, (m, -(-k // group)))
    _cpu(op, "out", out, (torch.bfloat16,), 2, contiguous=True)
    _shape(op, "out", out, (m, k))
    _lib("fp8").zk_fp8_dequantize_bf16(
        values.data_ptr(), scales.data_ptr(), m, k, group, out.data_ptr(), torch.get_num_threads()
    )


def _same(op: str, ref: torch.Tensor, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        _cpu(op, name, t, (ref.dtype,), contiguous=True)
        _shape(op, name, t, ref.shape)


@_define("silu_mul(Tensor gate, Tensor up, Tensor(a!) y, Tensor(b!)? s) -> ()")
def silu_mul(gate, up, y, s):
    """``y = silu(gate) * up`` (and ``s = sigmoid(gate)`` float32), elementwise over contiguous tensors of one shape
    (``csrc/pointwise.cpp`` ``zk_silu_mul``)."""
    op = "silu_mul"
    _cpu(op, "gate", gate, _ANY_FLOAT, contiguous=True)
    _same(op, gate, up=up)
    _cpu(op, "y", y, _FLOATS, contiguous=True)
    _shape(op, "y", y, gate.shape)
    if s is not None:
        _cpu(op, "s", s, _F32, contiguous=True)
        _shape(op, "s", s, gate.shape)
    _lib("pointwise").zk_silu_mul(
        DTYPE_CODES[gate.dtype],
        gate.data_ptr(),
        up.data_ptr(),
        gate.numel(),
        y.data_ptr(),
        DTYPE_CODES[y.dtype],
        None if s is None else s.data_ptr(),
        torch.get_num_threads(),
    )


@_define("silu_mul_backward(Tensor gate, Tensor up, Tensor s, Tensor dy, Tensor(a!) dgate, Tensor(b!) dup) -> ()")
def silu_mul_backward(gate, up, s, dy, dgate, dup):
    """``dgate = (dy up)(s + (gate s)(1 - s))``, ``dup = dy (gate s)`` in float32, one pass (``zk_silu_mul_bwd``)."""
    op = "silu_mul_backward"
    _cpu(op, "gate", gate, _ANY_FLOAT, contiguous=True)
    _same(op, gate, up=up, dy=dy)
    _cpu(op, "s", s, _F32, contiguous=True)
    _shape(op, "s", s, gate.shape)
    _cpu(op, "dgate", dgate, _FLOATS, contiguous=True)
    _same(op, dgate, dup=dup)
    _shape(op, "dgate", dgate, gate.shape)
    _lib("pointwise").zk_silu_mul_bwd(
        DTYPE_CODES[gate.dtype],
        gate.data_ptr(),
        up.data_ptr(),
        s.data_ptr(),
        dy.data_ptr(),
        gate.numel(),
        dgate.data_ptr(),
        dup.data_ptr(),
        DTYPE_CODES[dgate.dtype],
        torch.get_num_threads(),
    )


@_define("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!) y, Tensor(b!)? rstd) -> ()")
def rms_norm(x, weight, eps, y, rstd):
    """``y = x * rsqrt(mean(x²) + eps) * weight`` per row of ``x [rows, H]`` (H contiguous), ``rstd`` each row's
    ``rsqrt(ms + eps)`` float32 (``zk_rms_norm``)."""
    op = "rms_norm"
    _cpu(op, "x", x, _ANY_FLOAT, 2)
    rows, h = x.shape
    if x.stride(1) != 1:
        _fail(op, "x must have H contiguous", x)
    _cpu(op, "weight", weight, _F32, 1, contiguous=True)
    _shape(op, "weight", weight, (h,))
    _cpu(op, "y", y, _FLOATS, 2, contiguous=True)
    _shape(op, "y", y, (rows, h))
    if rstd is not None:
        _cpu(op, "rstd", rstd, _F32, 1, contiguous=True)
        _shape(op, "rstd", rstd, (rows,))
    _lib("pointwise").zk_rms_norm(
        DTYPE_CODES[x.dtype],
        x.data_ptr(),
        rows,
        h,
        x.stride(0),
        weight.data_ptr(),
        float(eps),
        y.data_ptr(),
        int(y.dtype == torch.bfloat16),
        None if rstd is None else rstd.data_ptr(),
        torch.get_num_threads(),
    )


@_define("rms_norm_backward(Tensor x, Tensor dy, Tensor weight, Tensor rstd, Tensor(a!) dx, Tensor(b!)? dweight) -> ()")
def rms_norm_backward(x, dy, weight, rstd, dx, dweight):
    """RMSNorm's backward over contiguous ``x``, ``dy [rows, H]``: ``dx`` and (accumulated into, float32)
    ``dweight [H]`` (``zk_rms_norm_bwd``)."""
    op = "rms_norm_backward"
    _cpu(op, "x", x, _ANY_FLOAT, 2, contiguous=True)
    _same(op, x, dy=dy)
    rows, h = x.shape
    _cpu(op, "weight", weight, _F32, 1, contiguous=True)
    _shape(op, "weight", weight, (h,))
    _cpu(op, "rstd", rstd, _F32, 1, contiguous=True)
    _shape(op, "rstd", rstd, (rows,))
    _cpu(op, "dx", dx, _FLOATS, 2, contiguous=True)
    _shape(op, "dx", dx, (rows, h))
    if dweight is not None:
        _cpu(op, "dweight", dweight, _F32, 1, contiguous=True)
        _shape(op, "dweight", dweight, (h,))
    _lib("pointwise").zk_rms_norm_bwd(
        DTYPE_CODES[x.dtype],
        x.data_ptr(),
        dy.data_ptr(),
        rows,
        h,
        weight.data_ptr(),
        rstd.data_ptr(),
        dx.data_ptr(),
        DTYPE_CODES[dx.dtype],
        None if dweight is None else dweight.data_ptr(),
        torch.get_num_threads(),
    )


@_define("rope(Tensor x, Tensor cos, Tensor sin, Tensor(a!) out) -> ()")
def rope(x, cos, sin, out):
    """Rotary embedding (rotate-half) of ``x [N, heads, D]`` (D contiguous) with ``cos``, ``sin`` ``[N, D / 2]``
    float32 into contiguous ``out`` (``zk_rope``)."""
    op = "rope"
    _cpu(op, "x", x, _FLOATS, 3)
    n, heads, d = x.shape
    if x.stride(2) != 1 or d % 2:
        _fail(op, "x must have an even, contiguous last dim", x)
    _cpu(op, "cos", cos, _F32, 2, contiguous=True)
    _shape(op, "cos", cos, (n, d // 2))
    _same(op, cos, sin=sin)
    _cpu(op, "out", out, (x.dtype,), 3, contiguous=True)
    _shape(op, "out", out, x.shape)
    _lib("pointwise").zk_rope(
        DTYPE_CODES[x.dtype],
        x.data_ptr(),
        n,
        heads,
        d,
        x.stride(0),
        x.stride(1),
        cos.data_ptr(),
        sin.data_ptr(),
        out.data_ptr(),
        torch.get_num_threads(),
    )


def _attention_common(op, q, k, v, num_kv_heads):
    _cpu(op, "q", q, _ANY_FLOAT, 3, contiguous=True)
    _cpu(op, "k", k, (q.dtype,))
    _cpu(op, "v", v, (q.dtype,))
    if num_kv_heads <= 0 or q.shape[1] % num_kv_heads:
        raise ValueError(f"zerokld::{op}: {q.shape[1]} query heads not a multiple of {num_kv_heads} kv heads")


def _attention_out(op, q, out, m, l):
    _cpu(op, "out", out, _F32, 3, contiguous=True)
    _shape(op, "out", out, q.shape)
    for name, t in (("m", m), ("l", l)):
        if t is not None:
            _cpu(op, name, t, _F32, 2, contiguous=True)
            _shape(op, name, t, q.shape[:2])


def _dense_layout(op, q, k, v, num_kv_heads, strides, block_size, block_table, q_row, q_pos, block_q0, block_nq):
    """Check the dense (block-table) layout both dense ops share; return the kernels' leading arguments (dtype,
    heads, head dim, the q / k / v pointers, the K/V strides, the block table, the query rows and positions)."""
    _attention_common(op, q, k, v, num_kv_heads)
    for name, t in (("block_table", block_table), ("q_row", q_row), ("q_pos", q_pos)):
        _cpu(op, name, t, _I64, contiguous=True)
    for name, t in (("q_row", q_row), ("q_pos", q_pos)):
        _shape(op, name, t, q.shape[:1])
    _cpu(op, "block_q0", block_q0, _I64, 1, contiguous=True)
    _same(op, block_q0, block_nq=block_nq)
    return (
        DTYPE_CODES[q.dtype], q.shape[1], num_kv_heads, q.shape[2], q.data_ptr(), k.data_ptr(), v.data_ptr(),
        *strides, block_size, block_table.data_ptr(), block_table.shape[-1], q_row.data_ptr(), q_pos.data_ptr(),
    )  # fmt: skip


@_define(
    "attention_forward(Tensor q, Tensor k, Tensor v, int num_kv_heads, int kv_block_stride, int kv_head_stride, "
    "int kv_slot_stride, int block_size, Tensor block_table, Tensor q_row, Tensor q_pos, Tensor block_q0, "
    "Tensor block_nq, float scale, Tensor(a!) out, Tensor(b!) m, Tensor(c!) l) -> int",
    0,
)
def attention_forward(
    q, k, v, num_kv_heads, kv_block_stride, kv_head_stride, kv_slot_stride, block_size, block_table, q_row, q_pos,
    block_q0, block_nq, scale, out, m, l
):  # fmt: skip
    """Causal attention of ``q [Nq, Hq, D]`` over the keys its block table names, query blocks ``block_q0`` /
    ``block_nq``, float32 ``out``, row max ``m`` and sum ``l``; returns the kernel's code (0: done)
    (``csrc/attention.cpp`` ``zk_attention_fwd``)."""
    op = "attention_forward"
    strides = (kv_block_stride, kv_head_stride, kv_slot_stride)
    lead = _dense_layout(op, q, k, v, num_kv_heads, strides, block_size, block_table, q_row, q_pos, block_q0, block_nq)
    _attention_out(op, q, out, m, l)
    return _lib("attention").zk_attention_fwd(
        *lead,
        block_q0.numel(),
        block_q0.data_ptr(),
        block_nq.data_ptr(),
        float(scale),
        out.data_ptr(),
        m.data_ptr(),
        l.data_ptr(),
        torch.get_num_threads(),
    )


@_define(
    "paged_attention_forward(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_table, "
    "Tensor query_start_loc, Tensor seq_lens, int q_tile, float scale, Tensor(a!) out) -> int",
    0,
)
def paged_attention_forward(q, key_cache, value_cache, block_table, query_start_loc, seq_lens, q_tile, scale, out):
    """vLLM's paged layout: ``q [Nq, Hq, D]``, caches ``[blocks, Hkv, block_size, D]`` with equal strides, the
    metadata int32 or int64 as vLLM keeps it; returns the kernel's code (0: done; 2: the queries are not in order;
    3: a sequence reaches past its block-table row) (``zk_attention_paged_fwd``)."""
    op = "paged_attention_forward"
    _cpu(op, "key_cache", key_cache, (q.dtype,), 4)
    _attention_common(op, q, key_cache, value_cache, key_cache.shape[1])
    if key_cache.stride() != value_cache.stride() or key_cache.stride(-1) != 1 or key_cache.shape[3] != q.shape[2]:
        _fail(op, "the caches must share strides, with D contiguous and equal to q's", value_cache)
    idx = block_table.dtype
    if idx not in (torch.int32, torch.int64):
        _fail(op, "block_table must be int32 or int64", block_table)
    _cpu(op, "block_table", block_table, (idx,), 2)
    if block_table.stride(1) != 1:
        _fail(op, "block_table must have contiguous columns", block_table)
    _cpu(op, "query_start_loc", query_start_loc, (idx,), 1, contiguous=True)
    _cpu(op, "seq_lens", seq_lens, (idx,), 1, contiguous=True)
    n_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != n_seqs + 1 or block_table.shape[0] < n_seqs:
        raise ValueError(
            f"zerokld::{op}: query_start_loc {tuple(query_start_loc.shape)}, seq_lens {tuple(seq_lens.shape)} and "
            f"block_table {tuple(block_table.shape)} do not fit one batch"
        )
    _attention_out(op, q, out, None, None)
    sb, sh, sp, _ = key_cache.stride()
    return _lib("attention").zk_attention_paged_fwd(
        DTYPE_CODES[q.dtype],
        q.shape[1],
        key_cache.shape[1],
        q.shape[2],
        q.data_ptr(),
        q.shape[0],
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        sb,
        sh,
        sp,
        key_cache.shape[2],
        block_table.data_ptr(),
        block_table.stride(0),
        block_table.shape[1],
        query_start_loc.data_ptr(),
        seq_lens.data_ptr(),
        n_seqs,
        int(idx == torch.int32),
        q_tile,
        float(scale),
        out.data_ptr(),
        None,
        None,
        torch.get_num_threads(),
    )


@_define(
    "attention_backward(Tensor q, Tensor k, Tensor v, int num_kv_heads, int kv_block_stride, int kv_head_stride, "
    "int kv_slot_stride, int block_size, Tensor block_table, Tensor q_row, Tensor q_pos, Tensor block_q0, "
    "Tensor block_nq, Tensor seq_b0, Tensor seq_b1, float scale, Tensor out, Tensor dout, Tensor m, Tensor l, "
    "Tensor(a!) dq, Tensor(b!) dk, Tensor(c!) dv) -> int",
    0,
)
def attention_backward(
    q, k, v, num_kv_heads, kv_block_stride, kv_head_stride, kv_slot_stride, block_size, block_table, q_row, q_pos,
    block_q0, block_nq, seq_b0, seq_b1, scale, out, dout, m, l, dq, dk, dv
):  # fmt: skip
    """FlashAttention-2's backward of :func:`attention_forward` over dense sequences (query blocks ``seq_b0[i]`` ..
    ``seq_b1[i] - 1`` of sequence ``i``): float32 ``dq``, ``dk``, ``dv`` (zeroed by the caller; ``dk``/``dv`` with
    ``k``'s / ``v``'s shapes and strides); returns the kernel's code (``zk_attention_bwd``)."""
    op = "attention_backward"
    strides = (kv_block_stride, kv_head_stride, kv_slot_stride)
    lead = _dense_layout(op, q, k, v, num_kv_heads, strides, block_size, block_table, q_row, q_pos, block_q0, block_nq)
    _cpu(op, "seq_b0", seq_b0, _I64, 1, contiguous=True)
    _same(op, seq_b0, seq_b1=seq_b1)
    _attention_out(op, q, out, m, l)
    _attention_out(op, q, dout, None, None)
    _attention_out(op, q, dq, None, None)
    for name, t, ref_name, ref in (("dk", dk, "k", k), ("dv", dv, "v", v)):
        _cpu(op, name, t, _F32)
        # the strides of size-1 dimensions never address memory (a contiguous view of a slice keeps its parent's)
        strided = [(a, b) for a, b, n in zip(t.stride(), ref.stride(), t.shape, strict=True) if n > 1]
        if t.shape != ref.shape or any(a != b for a, b in strided):
            _fail(op, f"{name} must have the shape and strides of {ref_name}", t)
    return _lib("attention").zk_attention_bwd(
        *lead,
        block_q0.data_ptr(),
        block_nq.data_ptr(),
        seq_b0.numel(),
        seq_b0.data_ptr(),
        seq_b1.data_ptr(),
        float(scale),
        out.data_ptr(),
        dout.data_ptr(),
        m.data_ptr(),
        l.data_ptr(),
        dq.data_ptr(),
        dk.data_ptr(),
        dv.data_ptr(),
        torch.get_num_threads(),
    )


@_define(
    "gated_delta_rule(Tensor cu_seqlens, Tensor q, Tensor k, Tensor v, Tensor decay, Tensor beta, Tensor(a!) state, "
    "Tensor(b!) out) -> ()"
)
def gated_delta_rule(cu_seqlens, q, k, v, decay, beta, state, out):
    """The gated delta rule over ``N`` sequences (``zk_gated_delta_rule``): sequence ``n``'s tokens are rows
    ``cu_seqlens[n] .. cu_seqlens[n + 1] - 1`` (int64 ``[N + 1]``, nondecreasing, from 0 to ``T``) of ``q``, ``k``
    ``[T, H, dk]``, ``v``, ``out`` ``[T, H, dv]``, ``decay`` (``exp(g)``) and ``beta`` ``[T, H]``; ``state``
    ``[N, H, dk, dv]``, each sequence's updated in place. Float32, contiguous."""
    op = "gated_delta_rule"
    _cpu(op, "cu_seqlens", cu_seqlens, (torch.int64,), 1, contiguous=True)
    _cpu(op, "q", q, _F32, 3, contiguous=True)
    t, h, dk = q.shape
    _cpu(op, "k", k, _F32, 3, contiguous=True)
    _shape(op, "k", k, (t, h, dk))
    _cpu(op, "v", v, _F32, 3, contiguous=True)
    dv = v.shape[2]
    _shape(op, "v", v, (t, h, dv))
    for name, x in (("decay", decay), ("beta", beta)):
        _cpu(op, name, x, _F32, 2, contiguous=True)
        _shape(op, name, x, (t, h))
    n = cu_seqlens.numel() - 1
    _cpu(op, "state", state, _F32, 4, contiguous=True)
    _shape(op, "state", state, (n, h, dk, dv))
    _cpu(op, "out", out, _F32, 3, contiguous=True)
    _shape(op, "out", out, (t, h, dv))
    bounds = cu_seqlens.tolist()
    if n < 0 or bounds[0] != 0 or bounds[-1] != t or any(b < a for a, b in zip(bounds, bounds[1:], strict=False)):
        raise ValueError(f"zerokld::{op}: cu_seqlens must rise from 0 to {t}, got {bounds[:8]}")
    _lib("gdn").zk_gated_delta_rule(
        n,
        cu_seqlens.data_ptr(),
        h,
        dk,
        dv,
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        decay.data_ptr(),
        beta.data_ptr(),
        state.data_ptr(),
        out.data_ptr(),
        torch.get_num_threads(),
    )


@_define("causal_conv1d_silu(Tensor cu_seqlens, Tensor x, Tensor weight, Tensor(a!) state, Tensor(b!) y) -> ()")
def causal_conv1d_silu(cu_seqlens, x, weight, state, y):
    """Causal depthwise conv1d with SiLU over ``N`` sequences (``zk_causal_conv1d_silu``): sequence ``n``'s tokens are
    rows ``cu_seqlens[n] .. cu_seqlens[n + 1] - 1`` (int64 ``[N + 1]``, from 0 to ``T``) of ``x``, ``y`` ``[T, C]``
    (float32 or bfloat16, one dtype); ``weight`` ``[C, K]`` float32; ``state`` ``[N, K - 1, C]`` in ``x``'s dtype,
    each sequence's previous inputs, replaced in place by its last ``K - 1``. Contiguous."""
    op = "causal_conv1d_silu"
    _cpu(op, "cu_seqlens", cu_seqlens, (torch.int64,), 1, contiguous=True)
    _cpu(op, "x", x, _FLOATS, 2, contiguous=True)
    t, c = x.shape
    _cpu(op, "weight", weight, _F32, 2, contiguous=True)
    kw = weight.shape[1]
    _shape(op, "weight", weight, (c, kw))
    n = cu_seqlens.numel() - 1
    for name, tensor, shape in (("state", state, (n, kw - 1, c)), ("y", y, (t, c))):
        _cpu(op, name, tensor, (x.dtype,), len(shape), contiguous=True)
        _shape(op, name, tensor, shape)
    bounds = cu_seqlens.tolist()
    if n < 0 or kw < 1 or bounds[0] != 0 or bounds[-1] != t or any(b < a for a, b in itertools.pairwise(bounds)):
        raise ValueError(f"zerokld::{op}: cu_seqlens must rise from 0 to {t}, got {bounds[:8]}")
    _lib("gdn").zk_causal_conv1d_silu(
        DTYPE_CODES[x.dtype],
        n,
        cu_seqlens.data_ptr(),
        c,
        kw,
        x.data_ptr(),
        weight.data_ptr(),
        state.data_ptr(),
        y.data_ptr(),
        torch.get_num_threads(),
    )


@_define(
    "gated_delta_rule_backward(Tensor cu_seqlens, Tensor q, Tensor k, Tensor v, Tensor decay, Tensor beta, "
    "Tensor state, Tensor dout, Tensor dfinal, Tensor(a!) dq, Tensor(b!) dk, Tensor(c!) dv, Tensor(d!) ddecay, "
    "Tensor(e!) dbeta, Tensor(f!) dstate) -> ()"
)
def gated_delta_rule_backward(cu_seqlens, q, k, v, decay, beta, state, dout, dfinal, dq, dk, dv, ddecay, dbeta, dstate):
    """The gradients of :func:`gated_delta_rule` (``zk_gated_delta_rule_bwd``): inputs as its (``state``: the states
    before the first tokens, read only), ``dout`` ``[T, H, dv]`` and ``dfinal`` ``[N, H, dk, dv]`` the gradients of
    its outputs; written: ``dq``, ``dk``, ``dv``, ``ddecay``, ``dbeta``, ``dstate`` (the initial states'), shaped as
    the inputs. Float32, contiguous."""
    op = "gated_delta_rule_backward"
    _cpu(op, "cu_seqlens", cu_seqlens, (torch.int64,), 1, contiguous=True)
    _cpu(op, "q", q, _F32, 3, contiguous=True)
    t, h, dkk = q.shape
    dvv = v.shape[2] if v.dim() == 3 else -1
    n = cu_seqlens.numel() - 1
    shapes = {
        "k": (k, (t, h, dkk)), "v": (v, (t, h, dvv)), "decay": (decay, (t, h)), "beta": (beta, (t, h)),
        "state": (state, (n, h, dkk, dvv)), "dout": (dout, (t, h, dvv)), "dfinal": (dfinal, (n, h, dkk, dvv)),
        "dq": (dq, (t, h, dkk)), "dk": (dk, (t, h, dkk)), "dv": (dv, (t, h, dvv)), "ddecay": (ddecay, (t, h)),
        "dbeta": (dbeta, (t, h)), "dstate": (dstate, (n, h, dkk, dvv)),
    }  # fmt: skip
    for name, (x, shape) in shapes.items():
        _cpu(op, name, x, _F32, len(shape), contiguous=True)
        _shape(op, name, x, shape)
    bounds = cu_seqlens.tolist()
    if n < 0 or bounds[0] != 0 or bounds[-1] != t or any(b < a for a, b in itertools.pairwise(bounds)):
        raise ValueError(f"zerokld::{op}: cu_seqlens must rise from 0 to {t}, got {bounds[:8]}")
    ptrs = (q, k, v, decay, beta, state, dout, dfinal, dq, dk, dv, ddecay, dbeta, dstate)
    _lib("gdn").zk_gated_delta_rule_bwd(
        n, cu_seqlens.data_ptr(), h, dkk, dvv, *(x.data_ptr() for x in ptrs), torch.get_num_threads()
    )


@_define("l2_normalize(Tensor x, float eps, float divisor, Tensor(a!) y) -> ()")
def l2_normalize(x, eps, divisor, y):
    """``y = x * rsqrt(tree_sum(x^2) + eps) / divisor`` per row of ``x`` ``[T, heads, d]`` (float32 or bfloat16; its
    last dimension contiguous, its heads adjacent: a head-major slice of a wider row, e.g. q of a mixed ``q|k|v``);
    ``y`` ``[T, heads, d]`` float32, contiguous (``zk_l2_normalize``)."""
    op = "l2_normalize"
    _cpu(op, "x", x, _FLOATS, 3)
    t, heads, d = x.shape
    if x.stride(2) != 1 or (heads > 1 and x.stride(1) != d):
        raise ValueError(f"zerokld::{op}: x needs contiguous heads of d elements, got strides {x.stride()}")
    _cpu(op, "y", y, _F32, 3, contiguous=True)
    _shape(op, "y", y, (t, heads, d))
    _lib("gdn").zk_l2_normalize(
        DTYPE_CODES[x.dtype], x.data_ptr(), t, heads, d, x.stride(0), eps, divisor, y.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
