"""The CPU kernels as torch ops (issue 58 point 6): ``torch.ops.zerokld.*`` (:mod:`shared_numerics.cpu_ops`).

What the registration buys, each checked here: a wrong argument is a schema error or a checked ``TypeError`` /
``ValueError`` (the raw ctypes call took a pointer and wrote wherever it pointed); the ops run on fake tensors and
inside ``torch.compile`` (``fullgraph=True``: the op is one node of the graph) with the eager bits. That the bits are
the kernels' own is what the rest of the suite checks (test_numerics, test_gemm_cpu, test_fp8, test_isa_paths, ...).
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from shared_numerics import cpu_ops, gemm_cpu
from shared_numerics.activation import silu_and_mul
from shared_numerics.fp8 import quantize_fp8_activation
from shared_numerics.norm import rms_norm

pytestmark = pytest.mark.timeout(600)


def test_every_kernel_entry_point_is_a_registered_op_with_its_schema():
    names = [
        "gemm_abt",
        "gemm_f32_ktree",
        "fp8_quantize",
        "fp8_to_bf16",
        "fp8_dequantize_bf16",
        "silu_mul",
        "silu_mul_backward",
        "rms_norm",
        "rms_norm_backward",
        "rope",
        "attention_forward",
        "paged_attention_forward",
        "attention_backward",
        "gated_delta_rule",
        "causal_conv1d_silu",
        "gated_delta_rule_backward",
        "l2_normalize",
    ]
    assert list(cpu_ops.OPS) == names
    for name, schema in cpu_ops.OPS.items():
        assert str(getattr(torch.ops.zerokld, name).default._schema) == f"zerokld::{schema}"


def test_argument_mistakes_are_errors_not_memory_writes():
    a, b = torch.randn(8, 32), torch.randn(4, 32)
    out = torch.empty(8, 4)
    with pytest.raises(TypeError, match="out must be a tensor, got None"):  # bias and out swapped
        torch.ops.zerokld.gemm_abt(a, b, out, None, False, False)
    with pytest.raises(RuntimeError, match=r"zerokld::gemm_abt\(Tensor a"):  # an int where a tensor goes
        torch.ops.zerokld.gemm_abt(a, 32, None, out, False, False)
    with pytest.raises(RuntimeError, match="missing value for argument 'accumulate'"):
        torch.ops.zerokld.gemm_abt(a, b, None, out, False)
    small = torch.full((2, 4), 7.0)  # the kernel would write 8 x 4 floats from its first element
    with pytest.raises(TypeError, match=r"out must be \(8, 4\)"):
        torch.ops.zerokld.gemm_abt(a, b, None, small, False, False)
    assert torch.equal(small, torch.full((2, 4), 7.0))
    with pytest.raises(TypeError, match="b must be"):
        torch.ops.zerokld.gemm_abt(a, b.double(), None, out, False, False)
    with pytest.raises(ValueError, match="K differs"):
        torch.ops.zerokld.gemm_abt(a, torch.randn(4, 16), None, out, False, False)
    x = torch.randn(3, 64)
    with pytest.raises(TypeError, match=r"weight must be \(64,\)"):
        torch.ops.zerokld.rms_norm(x, torch.ones(32), 1e-6, torch.empty(3, 64), None)
    with pytest.raises(TypeError, match=r"scales must be \(3, 1\)"):
        torch.ops.zerokld.fp8_quantize(x, 64, None, None, torch.empty(3, 2))
    with pytest.raises(TypeError, match="out must be"):
        torch.ops.zerokld.rope(torch.randn(4, 2, 8), torch.ones(4, 4), torch.ones(4, 4), torch.empty(4, 2, 4))
    q, v, gates = torch.randn(5, 2, 8), torch.randn(5, 2, 4), torch.rand(5, 2)
    state, cu = torch.full((1, 2, 8, 3), 7.0), torch.tensor([0, 5])  # the kernel would write 1 x 2 x 8 x 4 floats
    with pytest.raises(TypeError, match=r"state must be \(1, 2, 8, 4\)"):
        torch.ops.zerokld.gated_delta_rule(cu, q, q, v, gates, gates, state, torch.empty(5, 2, 4))
    assert torch.equal(state, torch.full((1, 2, 8, 3), 7.0))
    with pytest.raises(ValueError, match="cu_seqlens must rise from 0 to 5"):  # rows past the tensors
        torch.ops.zerokld.gated_delta_rule(
            torch.tensor([0, 9]),
            q,
            q,
            v,
            gates,
            gates,
            state[..., :1].expand(1, 2, 8, 4).contiguous(),
            torch.empty(5, 2, 4),
        )
    x, conv_state = torch.randn(5, 6), torch.full((1, 2, 6), 7.0)  # the kernel would write 1 x 3 x 6 floats
    with pytest.raises(TypeError, match=r"state must be \(1, 3, 6\)"):
        torch.ops.zerokld.causal_conv1d_silu(cu, x, torch.randn(6, 4), conv_state, torch.empty(5, 6))
    assert torch.equal(conv_state, torch.full((1, 2, 6), 7.0))
    with pytest.raises(ValueError, match="contiguous heads"):  # rows the kernel would read past
        torch.ops.zerokld.l2_normalize(torch.randn(5, 8, 2).transpose(1, 2), 1e-6, 1.0, torch.empty(5, 2, 8))


def test_the_ops_run_on_fake_tensors():
    with FakeTensorMode() as mode:
        a, b = mode.from_tensor(torch.randn(7, 64)), mode.from_tensor(torch.randn(5, 64, dtype=torch.float32))
        y = gemm_cpu.gemm_abt(a, b)
        assert type(y) is FakeTensor and tuple(y.shape) == (7, 5)
        x, w = mode.from_tensor(torch.randn(3, 64)), mode.from_tensor(torch.randn(64))
        assert tuple(rms_norm(x, w, 1e-6).shape) == (3, 64)
        g = mode.from_tensor(torch.randn(3, 16))
        assert tuple(silu_and_mul(g, g).shape) == (3, 16)
        q, s = quantize_fp8_activation(x, "block")
        assert tuple(q.shape) == (3, 64) and tuple(s.shape) == (3, 1)


def test_the_ops_compile_into_one_graph_with_the_eager_bits():
    a, b, bias = torch.randn(7, 64), torch.randn(5, 64), torch.randn(7)

    def gemm(a, b, bias):
        out = torch.empty(5, 7)
        torch.ops.zerokld.gemm_abt(a, b, bias, out, True, False)
        return out * 2

    compiled = torch.compile(gemm, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(a, b, bias), gemm(a, b, bias))
    x, w = torch.randn(3, 64), torch.randn(64)
    eager = rms_norm(x, w, 1e-6)
    assert torch.equal(torch.compile(lambda x, w: rms_norm(x, w, 1e-6))(x, w), eager)
    g, u = torch.randn(5, 48), torch.randn(5, 48)
    assert torch.equal(torch.compile(silu_and_mul)(g, u), silu_and_mul(g, u))


_IN_FLIGHT = r"""
import os, sys, torch, torch.distributed as dist
import torch.distributed._functional_collectives as fc
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
import shared_numerics as sn
from shared_numerics.activation import silu_and_mul

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
torch.manual_seed(0)
w, proj = torch.randn(64), torch.randn(48, 64)
ops = {
    "rms_norm": lambda t: sn.rms_norm(t, w, 1e-6),
    "linear": lambda t: sn.linear(t, proj),
    "silu_and_mul": lambda t: silu_and_mul(t, t * 2),
}
for name, op in ops.items():
    grads = []
    for in_flight in (True, False):
        x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
        y = x * 3
        if in_flight:  # what DTensor.to_local() of an all-reduced activation hands the kernels under TP
            y = DTensor.from_local(fc.all_reduce(y, "sum", mesh.get_group()), mesh, [Replicate()], run_check=False)
            y = y.to_local()
            assert type(y).__name__ == "AsyncCollectiveTensor", type(y)
        out = op(y)
        assert out.grad_fn is not None, f"{name}: the output is cut from the graph"
        (out.float() * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1]), name
print("ok")
"""


def test_kernels_on_an_in_flight_collective_keep_its_gradient(tmp_path):
    """Under TorchTitan TP the embedding's output is all-reduced, and ``DTensor.to_local()`` hands the first layer's
    norm an ``AsyncCollectiveTensor`` whose autograd history is the wrapper's. The kernels must differentiate through
    it: waiting on it and computing on the inner tensor cut the graph, and TP training lost the first layer's whole
    attention-norm path from the embedding's gradient (the 2026-11-28 defect, 77% of the embedding's update). RMSNorm,
    the linear and SiLU-and-mul on such an input give the same gradient, bit for bit, as on a plain tensor.
    (A subprocess: the one-rank gloo group stays out of this one.)"""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "in_flight.py"
    script.write_text(_IN_FLIGHT)
    proc = subprocess.run([sys.executable, str(script), str(port)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


@pytest.mark.timeout(60)
def test_attention_backward_takes_a_sliced_single_sequence():
    """A batch of one sliced out of a longer sequence (its contiguous view keeps the parent's stride on the size-1
    batch dimension, which never addresses memory) back-propagates like its copy: the kernel entry's stride check
    once refused it (found when context parallelism's keys were a slice)."""
    from shared_numerics.attention_cpu import dense_attention_cpu

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 40, h, 32, generator=g) for h in (4, 2, 2))
    dy = torch.randn(1, 20, 4, 32, generator=g)
    grads = []
    for sliced in (True, False):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        parts = [t[:, :20] if sliced else t[0, :20].clone().unsqueeze(0) for t in leaves]
        assert parts[1].is_contiguous() and (parts[1].stride(0) == 40 * 2 * 32) == sliced
        dense_attention_cpu(*parts, 32**-0.5).backward(dy)
        grads.append([t.grad for t in leaves])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
