"""zerokld's compiled CPU kernels (``shared_numerics/csrc/*.cpp``): built once per machine with the system C++
compiler, loaded through :mod:`ctypes`.

Why compiled: the attention's fixed per-query arithmetic (:mod:`shared_numerics.attention`) written as torch ops
costs tens of elementwise passes per key chunk over padded tiles (measured: 5-6 ms per layer for one demo decode step
of 224 sequences, two thirds of the rollout). One loop nest per (query block, kv head) does it in one pass.

Build: ``$CXX`` (default ``g++``) ``-O3 -march=native -ffp-contract=off -fno-fast-math -std=c++17 -shared -fPIC
-fopenmp``, never ``-ffast-math`` — the compiler may vectorise across independent lanes but never reorder a reduction
or fuse a multiply-add, so the arithmetic is the source's. ``-march=native`` makes the library this machine's: trainer
and engine on one machine load the same file. ``ZEROKLD_CPU_MARCH`` replaces ``native`` (e.g. ``x86-64-v3``: AVX2 +
FMA, the kernels of an AVX2-only CPU, built and run on a newer one; see docs/tests.md, "CPU paths"). ``-fopenmp`` links
``libgomp.so.1``: loaded after torch (this module imports it), the kernel resolves to torch's own OpenMP runtime and
shares its thread team. The library is cached under ``$ZEROKLD_CACHE_DIR`` (default ``~/.cache/zerokld``), named by a
hash of the source and the headers of ``csrc/``, the flags, the compiler's version and the CPU's model and ISA flags,
written to a temporary name and renamed (concurrent first builds from several processes are safe).

Raises (:func:`load`): RuntimeError naming the compiler and its error output when the build fails or no compiler is
found.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch  # loaded first: the kernels bind to torch's libgomp

from zerokld_plugins import envs

__all__ = ["COMPILER_PACKAGE", "DTYPE_CODES", "FLAGS", "flags", "load", "on_local_shards", "plain"]

#: element types the kernels read (their ``dtype`` argument)
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-std=c++17", "-shared", "-fPIC", "-fopenmp")
#: Debian / Ubuntu package of the default compiler (named in the error raised without one)
COMPILER_PACKAGE = "g++"
_SRC = Path(__file__).resolve().parent / "csrc"


def _cpu_id() -> str:
    """The CPU's model and ISA flags (``-march=native`` code is only valid on the CPU that built it; a cache shared
    between machines keeps one library per CPU kind)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        import platform

        return platform.processor() or platform.machine()
    return "|".join(sorted({line for line in lines if line.startswith(("model name", "flags"))}))


def flags() -> tuple[str, ...]:
    """:data:`FLAGS` with ``-march=`` set from ``ZEROKLD_CPU_MARCH`` (default ``native``)."""
    march = envs.ZEROKLD_CPU_MARCH
    return tuple(f"-march={march}" if f == "-march=native" else f for f in FLAGS)


def _cache_dir() -> Path:
    return envs.ZEROKLD_CACHE_DIR


@functools.cache
def load(name: str) -> ctypes.CDLL:
    """The compiled ``csrc/<name>.cpp`` (built on first use on this machine; see the module).

    Raises:
        RuntimeError: no C++ compiler (the message names the package to install), or the build failed (the
            compiler's output is in the message).
    """
    source = (_SRC / f"{name}.cpp").read_bytes()
    source += b"".join(h.name.encode() + h.read_bytes() for h in sorted(_SRC.glob("*.h")))  # the shared headers
    cxx = os.environ.get("CXX") or "g++"
    exe = shutil.which(cxx)
    if exe is None:
        raise RuntimeError(
            f"zerokld's CPU kernel {name}.cpp is built on first use and needs a C++ compiler; "
            f"{cxx!r} was not found on PATH (install it: `apt-get install {COMPILER_PACKAGE}` on "
            "Debian / Ubuntu; or set CXX to a C++17 compiler)"
        )
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    build_flags = flags()
    key = hashlib.sha256(source + repr(build_flags).encode() + version.encode() + _cpu_id().encode()).hexdigest()[:16]
    cache = _cache_dir()
    target = cache / f"{name}-{key}.so"
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f"{name}-", suffix=".so", dir=cache)
        os.close(fd)
        try:
            proc = subprocess.run(
                [exe, *build_flags, "-o", tmp, str(_SRC / f"{name}.cpp")], capture_output=True, text=True
            )
            if proc.returncode != 0:
                raise RuntimeError(
                    f"building zerokld's CPU kernel {name}.cpp with {cxx} failed:\n{proc.stderr[-4000:]}"
                )
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return ctypes.CDLL(str(target))


def plain(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` as a plain CPU ``torch.Tensor`` whose ``data_ptr`` holds its values, or ``None`` (the kernels then must
    not run on it): a plain tensor or a ``Parameter`` (any subclass) as is; a fake tensor (``FakeTensorMode``,
    ``torch.compile``'s tracing) as is, since the kernels are torch ops with fake implementations
    (:mod:`shared_numerics.cpu_ops`); an ``AsyncCollectiveTensor`` (what ``DTensor.to_local()`` returns while a
    collective is in flight) waited, or cloned when it carries gradient history (a clone is an op on the wrapper,
    so autograd links the plain result to it; the inner tensor is cut from the graph); any other subclass
    (``DTensor``, functional tensors) ``None``."""
    if type(t) is torch.Tensor or (isinstance(t, torch.nn.Parameter) and type(t.data) is torch.Tensor):
        return (
            t if t.device.type == "cpu" else None
        )  # (vLLM's parameter classes subclass Parameter; FSDP's hold DTensors)
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    if type(t) is FakeTensor:
        return t if t.device.type == "cpu" else None

    if isinstance(t, AsyncCollectiveTensor):
        if t.requires_grad and torch.is_grad_enabled():
            # its autograd history is the wrapper's (e.g. DTensor.to_local() of a redistributed activation: the
            # embedding's all-reduced output under TP); wait() would hand back the inner tensor, cut from the graph,
            # and the gradient of every op on it would be lost. A clone is an op on the wrapper: a plain tensor
            # that autograd links to it.
            return plain(t.clone())
        return plain(t.wait())
    return None


def on_local_shards(fn, tensors: tuple, allowed_shard_dims: tuple[int, ...]):
    """``fn(*locals)`` for ``DTensor`` inputs that share one mesh and one placement (each ``Replicate`` or ``Shard``
    of a dim in ``allowed_shard_dims``, for ops that are independent along it), wrapped back as a ``DTensor`` of the
    first input's placements, shape and stride; ``None`` when the inputs are not DTensors.

    Raises:
        NotImplementedError: DTensors on different meshes or placements, or sharded along another dimension (the
            message names them).
    """
    from torch.distributed.tensor import DTensor

    if not any(isinstance(t, DTensor) for t in tensors):
        return None
    first = tensors[0]
    if not all(
        isinstance(t, DTensor) and t.device_mesh == first.device_mesh and t.placements == first.placements
        for t in tensors
    ):
        raise NotImplementedError(
            "zerokld CPU kernel: DTensor inputs must share one mesh and one placement, got "
            + ", ".join(str(getattr(t, "placements", "plain tensor")) for t in tensors)
        )
    for p in first.placements:
        if p.is_shard() and p.dim % first.ndim not in tuple(d % first.ndim for d in allowed_shard_dims):
            raise NotImplementedError(
                f"zerokld CPU kernel: DTensor sharded as {first.placements}; only dims "
                f"{allowed_shard_dims} may be sharded for this op"
            )
    out = fn(*(t.to_local() for t in tensors))
    return DTensor.from_local(
        out, first.device_mesh, first.placements, run_check=False, shape=first.shape, stride=first.stride()
    )
