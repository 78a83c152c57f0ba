"""What each CPU path gives, and what needs a compiler.

* Reading and writing snapshots (``deltasync``, ``python -m deltasync``) and the architecture descriptions
  (``zerokld_models``) need no C++ compiler: the kernels are built on first use of a kernel, never at import. A kernel
  needed where there is no compiler is a RuntimeError that names the package to install.
* The AVX2 build of the kernels (``ZEROKLD_CPU_MARCH=x86-64-v3``: what an AVX2-only CPU builds) gives the AVX-512
  build's bits for every op whose contract is ISA-free (docs/tests.md, "CPU paths"): float32 linear forward and
  backward, bf16 upcast to it, attention (dense and paged), RMSNorm, SiLU-and-mul, the FP8 quantizer, the Gated
  DeltaNet layer (conv, L2 norm, recurrence). The two run in
  separate processes (a process loads one build); ATen and oneDNN are held to AVX2 too (``ATEN_CPU_CAPABILITY``,
  ``ONEDNN_MAX_CPU_ISA``), and a stock negative control shows those switches do change stock's bits.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parent.parent
#: the switches that put a process on the AVX2 path (docs/tests.md, "CPU paths"); bf16 linears upcast on both sides
AVX2 = {"ZEROKLD_CPU_MARCH": "x86-64-v3", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def _run(code: str, env: dict, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_snapshots_and_architectures_need_no_compiler(tmp_path):
    """``import deltasync`` / ``zerokld_models`` / ``shared_numerics`` and ``python -m deltasync diff / apply / verify /
    inspect`` with no compiler on PATH and an empty kernel cache; a kernel then is a clear error naming g++.
    Negative control: the same kernel call with the compiler on PATH builds and runs."""
    from zerokld_testing import TinyModelSpec, make_tiny_checkpoint

    base = make_tiny_checkpoint(tmp_path / "base", TinyModelSpec(family="qwen3"), seed=1, dtype="float32")
    new = make_tiny_checkpoint(tmp_path / "new", TinyModelSpec(family="qwen3"), seed=2, dtype="float32")
    (tmp_path / "bin").mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("CXX", "ZEROKLD_CACHE_DIR")}
    env.update(PATH=str(tmp_path / "bin"), ZEROKLD_CACHE_DIR=str(tmp_path / "kernels"))
    imports = _run(
        "import deltasync, zerokld_models, shared_numerics, zerokld_plugins\n"
        "from deltasync import Replica, SnapshotWriter\n"
        "from zerokld_models import read_model_config\n"
        f"print(read_model_config({str(base)!r}).architecture)",
        env,
    )
    assert imports.returncode == 0 and imports.stdout.split() == ["Qwen3ForCausalLM"], imports.stderr[-3000:]
    cli = [sys.executable, "-m", "deltasync"]
    for args in (
        ["diff", "--base", str(base), "--new", str(new), "--out", str(tmp_path / "delta")],
        ["apply", "--base", str(base), "--delta", str(tmp_path / "delta"), "--out", str(tmp_path / "out")],
        ["verify", str(tmp_path / "delta")],
        ["inspect", str(tmp_path / "out")],
    ):
        proc = subprocess.run(cli + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (args[0], proc.stderr[-3000:])
    from safetensors.torch import load_file

    applied = {k: v for f in sorted((tmp_path / "out").glob("*.safetensors")) for k, v in load_file(f).items()}
    wanted = {k: v for f in sorted(new.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert applied.keys() == wanted.keys() and all(torch.equal(applied[k], wanted[k]) for k in wanted)
    assert not (tmp_path / "kernels").exists() or not any((tmp_path / "kernels").iterdir())  # nothing was built
    kernel = "import torch, shared_numerics as sn\nprint(sn.linear(torch.ones(2, 4), torch.ones(3, 4)).sum().item())"
    refused = _run(kernel, env)
    assert refused.returncode != 0
    last = refused.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError") and "gemm.cpp" in last and "apt-get install g++" in last, last
    env["PATH"] = os.environ["PATH"]  # negative control: with the compiler the same call builds and runs
    built = _run(kernel, env)
    assert built.returncode == 0 and float(built.stdout) == 24.0, built.stderr[-3000:]


def _probe(out: str) -> None:
    """Every ISA-free op of the CPU path on fixed inputs, saved to ``out`` (run in a subprocess per build)."""
    import shared_numerics as sn
    from shared_numerics.fp8 import quantize_fp8_activation, quantize_fp8_weight
    from shared_numerics.linear import gemm_partition

    g = torch.Generator().manual_seed(7)
    res = {"partition": gemm_partition()}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        for m, k, n in ((1, 96, 200), (9, 1000, 70), (300, 256, 530)):
            x = torch.randn(m, k, generator=g).to(dtype).requires_grad_()
            w = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype).requires_grad_()
            b = torch.randn(n, generator=g).to(dtype)
            y = sn.linear(x, w, b)
            y.backward(torch.randn(y.shape, generator=g).to(dtype))
            res.update({f"linear_{name}_{m}x{k}x{n}": y.detach(), f"dx_{name}_{m}": x.grad, f"dw_{name}_{m}": w.grad})
        q, kk, v = (torch.randn(2, 150, h, 64, generator=g).to(dtype) for h in (8, 2, 2))
        res[f"dense_attention_{name}"] = sn.dense_causal_attention(q, kk, v, 64**-0.5)
        cache = torch.randn(15, 2, 32, 128, generator=g).to(dtype)
        kc, vc = cache.split(64, dim=-1)
        qd = torch.randn(3, 8, 64, generator=g).to(dtype)
        res[f"paged_attention_{name}"] = sn.paged_causal_attention(
            qd,
            kc,
            vc,
            torch.arange(4),
            torch.tensor([1, 45, 130]),
            torch.randperm(15, generator=g).reshape(3, 5),
            64**-0.5,
        )
        x = torch.randn(37, 512, generator=g).to(dtype)
        res[f"rms_norm_{name}"] = sn.rms_norm(x, torch.rand(512, generator=g).to(dtype) + 0.5, 1e-6)
        res[f"silu_and_mul_{name}"] = sn.silu_and_mul(x, torch.randn(37, 512, generator=g).to(dtype))
        res[f"fp8_activation_{name}"] = [
            t.view(torch.uint8) if t.dtype.itemsize == 1 else t for t in quantize_fp8_activation(x * 40)
        ]
        res[f"fp8_weight_{name}"] = [
            t.view(torch.uint8) if t.dtype.itemsize == 1 else t for t in quantize_fp8_weight(x[:32] * 3)
        ]
        # the Gated DeltaNet layer's kernels: conv + SiLU, L2 norm, the recurrence (prefill blocks and decode rows)
        from shared_numerics.gated_deltanet import gated_deltanet_varlen

        hk, dk, hv, dv = 2, 64, 2, 128
        c = 2 * hk * dk + hv * dv
        lens = torch.tensor([40, 1, 3])
        params = {
            "conv1d_weight": torch.randn(c, 4, generator=g).to(dtype),
            "A_log": torch.rand(hv, generator=g).to(dtype),
            "dt_bias": torch.rand(hv, generator=g).to(dtype),
            "norm_weight": torch.rand(dv, generator=g).to(dtype),
        }
        for step in (lens, torch.ones(3, dtype=torch.int64)):
            t = int(step.sum())
            mixed, z = torch.randn(t, c, generator=g).to(dtype), torch.randn(t, hv * dv, generator=g).to(dtype)
            a_, b_ = (torch.randn(t, hv, generator=g).to(dtype) for _ in range(2))
            cu = torch.cat([torch.zeros(1, dtype=torch.int64), step.cumsum(0)])
            conv = torch.randn(3, 3, c, generator=g).to(dtype)
            rec = torch.randn(3, hv, dk, dv, generator=g)
            res[f"gated_deltanet_{name}_{t}"] = list(
                gated_deltanet_varlen(mixed, z, a_, b_, params, (hk, dk, hv, dv), 1e-6, cu, conv, rec)
            )
    # stock, for the negative control: ATen's and oneDNN's own kernels follow the ISA switches
    xs = torch.randn(64, 4096, generator=g)
    res["stock"] = [
        torch.softmax(xs * 7, -1),
        torch.nn.functional.silu(xs),
        xs.exp(),
        torch.nn.functional.linear(xs[:8].bfloat16(), xs[8:40].bfloat16()),
    ]
    torch.save(res, out)


@pytest.mark.requires_avx512f
def test_avx2_build_gives_the_avx512_bits(tmp_path):
    """The AVX2 path (``AVX2`` above) and this machine's AVX-512 build give the same bits for every op on the ISA-free
    contract, bf16 on the float32 kernel on both sides (no AMX), at 2 threads. Negative
    control (upstream behaviour, ``stock_differs``): stock's own ops give other bits under the same switches."""
    from zerokld_testing.controls import stock_differs

    got = {}
    for name, extra in (("avx512", {}), ("avx2", AVX2)):
        env = {k: v for k, v in os.environ.items() if k not in AVX2}
        env.update(
            extra,
            ZEROKLD_AMX="0",
            ZEROKLD_CACHE_DIR=str(tmp_path / "kernels"),
            OMP_NUM_THREADS="2",
        )
        out = tmp_path / f"{name}.pt"
        proc = _run(f"from tests.test_isa_paths import _probe; _probe({str(out)!r})", env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        got[name] = torch.load(out)
    built = sorted(p.name.split("-")[0] for p in (tmp_path / "kernels").glob("*.so"))
    assert built.count("gemm") == 2 and built.count("attention") == 2, built  # two builds, one per process
    a, b = got["avx512"], got["avx2"]
    assert a.keys() == b.keys() and a["partition"] == b["partition"] == "threads=1,f32=fmachain,bf16=fp32"

    def flat(v):
        return v if isinstance(v, list) else [v]

    differ = [
        k
        for k in a
        if k not in ("partition", "stock")
        if len(flat(a[k])) != len(flat(b[k]))
        or not all(torch.equal(s, t) for s, t in zip(flat(a[k]), flat(b[k]), strict=True))
    ]
    assert differ == []
    stock_differs(
        any(not torch.equal(s, t) for s, t in zip(a["stock"], b["stock"], strict=True)),
        "softmax / silu / exp / bf16 linear under ATEN_CPU_CAPABILITY=avx2 + ONEDNN_MAX_CPU_ISA=AVX2",
        "the stock ops or their sizes",
    )


def test_only_declared_capability_skips_pass(tmp_path):
    """A test marked with a capability this machine lacks (``requires_cuda`` here) skips with its declared reason and
    the run passes; any other skip fails the run, naming the test (tests/conftest.py). Run as a pytest of its own
    with this suite's conftest as a plugin."""
    probe = (
        "import pytest\n\n\n@pytest.mark.requires_cuda\ndef test_declared():\n    pass\n\n\n"
        "def test_passes():\n    pass\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "ZEROKLD_CUDA_TESTS"}

    def run(source: str) -> subprocess.CompletedProcess:
        (tmp_path / "test_probe.py").write_text(source)
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-rs",
                "-p",
                "no:cacheprovider",
                "-p",
                "tests.conftest",
                "--rootdir",
                str(tmp_path),
                str(tmp_path / "test_probe.py"),
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    declared = run(probe)
    assert declared.returncode == 0 and "1 passed, 1 skipped" in declared.stdout, declared.stdout[-2000:]
    undeclared = run(probe + '\n\ndef test_undeclared():\n    pytest.skip("a reason nobody declared")\n')
    assert undeclared.returncode == 1, undeclared.stdout[-2000:]
    assert "skips not on the allow-list" in undeclared.stdout and "test_undeclared" in undeclared.stdout
    assert "test_declared: " not in undeclared.stdout
