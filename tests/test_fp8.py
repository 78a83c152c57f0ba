"""FP8 quantizer and GEMM (shared_numerics.fp8): definition, edge cases, batch invariance, QAT == serving, and negative
controls against vLLM's native FP8 quantizer, torchao's fake-quant and ``torch._scaled_mm``."""

from __future__ import annotations

import pytest
import torch

import shared_numerics as sn
from shared_numerics.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    FP8_MIN_SCALE,
    Fp8QuantizationError,
    dequantize_fp8_weight,
    quantize_fp8_activation,
    quantize_fp8_weight,
)
from zerokld_testing.controls import stock_differs

GRANULARITIES = ["per_channel", "block"]
DTYPES = [torch.float32, torch.bfloat16]


def _data(m=37, k=200, n=150, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g).to(dtype), (torch.randn(n, k, generator=g) * 0.05).to(dtype))


def test_round_to_nearest_even_and_clamp():
    # amax 448 -> scale exactly 1, so codes are the values themselves
    x = torch.tensor([[448.0, 1.0625, 1.1875, -1.0625, 240.0, 0.0, -448.0]])
    q, s = quantize_fp8_activation(x)
    assert s.item() == 1.0
    assert q.float().tolist() == [[448.0, 1.0, 1.25, -1.0, 240.0, 0.0, -448.0]]  # ties go to the even mantissa
    # beyond ±448 after scaling: clamped to ±448, never NaN
    w = torch.tensor([[1000.0, -1000.0, 999.9, 1.0]])
    q, s = quantize_fp8_activation(w)
    assert not q.float().isnan().any()
    assert q.float()[0, :3].abs().max().item() == FP8_MAX


def _e4m3_grid() -> torch.Tensor:
    """Every finite e4m3fn value in increasing order."""
    v = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    return torch.unique(v[torch.isfinite(v)])


def test_compiled_quantizer_is_the_torch_definition():
    """csrc/fp8.cpp's quantizer (what CPU serving and QAT run) against the definition as torch ops, bit for bit: every
    bf16 value within ±448 and, in float32, every midpoint between neighbouring e4m3 values (the ties) and the floats
    just beside them, with the scale exactly 1 (amax 448); random data of both granularities, K with a partial last
    block, float32 and bf16 inputs."""
    from shared_numerics.fp8 import (
        _dequantize_activation,
        _dequantize_activation_bf16,
        _quantize_activation_torch,
        fp8_values,
    )

    grid = _e4m3_grid()
    mid = (grid[1:] + grid[:-1]) / 2
    ties = torch.cat(
        [mid, torch.nextafter(mid, torch.full_like(mid, -1e9)), torch.nextafter(mid, torch.full_like(mid, 1e9))]
    )
    bf = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    bf = bf[torch.isfinite(bf) & (bf.abs() <= FP8_MAX)]
    cases = [(torch.cat([torch.tensor([FP8_MAX]), v]).unsqueeze(0), "per_channel") for v in (ties, bf)]
    g = torch.Generator().manual_seed(3)
    for granularity in GRANULARITIES:
        for dtype in DTYPES:
            x = torch.randn(33, 300, generator=g) * torch.logspace(-12, 6, 300)
            cases.append((x.to(dtype), granularity))
    for x, granularity in cases:
        q, s = quantize_fp8_activation(x, granularity)
        q0, s0 = _quantize_activation_torch(x, granularity)
        assert torch.equal(s, s0)
        assert torch.equal(q.view(torch.uint8), q0.view(torch.uint8)), (
            q.view(torch.uint8) != q0.view(torch.uint8)
        ).sum()
        assert torch.equal(fp8_values(q).view(torch.int16), q0.float().to(torch.bfloat16).view(torch.int16))
        if x.shape[0] > 1:  # the QAT backward's compiled dequantization: (q * s) rounded to bf16, as torch does it
            deq = _dequantize_activation(q0, s0, granularity).to(torch.bfloat16)
            assert torch.equal(
                _dequantize_activation_bf16(fp8_values(q), s, granularity).view(torch.int16), deq.view(torch.int16)
            )


def test_fp8_values_table():
    from shared_numerics.fp8 import fp8_values

    codes = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE)
    v, ref = fp8_values(codes).float(), codes.float()
    assert torch.equal(torch.isnan(v), torch.isnan(ref)) and torch.equal(v[~torch.isnan(v)], ref[~torch.isnan(ref)])
    assert torch.equal(torch.signbit(v), torch.signbit(ref))  # -0 stays -0


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_gemm_path_of_this_machine(granularity):
    """On a CPU with AMX the GEMM multiplies the codes' bf16 values on the AMX kernel; elsewhere their float32 values
    on the FMA kernel. Both compute the same exact products (4-bit significands) and differ only in accumulation, so
    they agree to float32 rounding; fp8_linear and QAT take the machine's path."""
    from shared_numerics.fp8 import _gemm, _gemm_amx, _on_amx, fp8_values
    from shared_numerics.gemm_cpu import amx_available

    x, w = _data(m=40, k=300, n=70)
    qx, sx = quantize_fp8_activation(x, granularity)
    qw, sw = quantize_fp8_weight(w, granularity)
    assert _on_amx(x, qw) == amx_available()
    fma = _gemm(qx, sx, qw, sw, granularity)
    y = sn.fp8_linear(x, qw, sw, granularity)
    if amx_available():
        amx = _gemm_amx(fp8_values(qx), sx, fp8_values(qw), sw, granularity)
        torch.testing.assert_close(amx, fma, rtol=1e-5, atol=1e-5 * fma.abs().max().item())
        assert torch.equal(y, amx.to(x.dtype))
    else:
        assert torch.equal(y, fma.to(x.dtype))


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_all_zero_rows_are_safe(granularity):
    x = torch.zeros(3, 130)
    q, s = quantize_fp8_activation(x, granularity)
    assert torch.equal(q.float(), x) and bool((s == FP8_MIN_SCALE).all())
    qw, sw = quantize_fp8_weight(torch.zeros(5, 130), granularity)
    assert torch.equal(qw.float(), torch.zeros(5, 130)) and bool((sw == FP8_MIN_SCALE).all())
    y = sn.fp8_linear(x, qw, sw, granularity)
    assert torch.equal(y, torch.zeros(3, 5))


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_refused(bad):
    x = torch.randn(4, 16)
    x[2, 3] = bad
    with pytest.raises(Fp8QuantizationError, match="inf or NaN"):
        quantize_fp8_activation(x)
    with pytest.raises(Fp8QuantizationError, match="inf or NaN"):
        quantize_fp8_weight(x, "block")
    qw, sw = quantize_fp8_weight(torch.randn(3, 16))
    with pytest.raises(Fp8QuantizationError, match="inf or NaN"):
        sn.fp8_linear(x, qw, sw)


def test_bad_arguments_refused():
    with pytest.raises(Fp8QuantizationError, match="granularity"):
        quantize_fp8_activation(torch.randn(2, 4), "per_tensor")
    with pytest.raises(Fp8QuantizationError, match=r"\[N, K\]"):
        quantize_fp8_weight(torch.randn(2, 3, 4))
    with pytest.raises(Fp8QuantizationError, match="float8_e4m3fn"):
        sn.fp8_linear(torch.randn(2, 4), torch.randn(3, 4), torch.ones(3))


def test_subnormals_tiny_and_huge_scales():
    # codes in e4m3's subnormal range (|q| < 2^-6, step 2^-9), round-to-nearest-even there too
    x = torch.tensor([[448.0, 2.0**-9, 1.5 * 2.0**-9, 2.5 * 2.0**-9, 2.0**-11, 3 * 2.0**-10]])
    q, _ = quantize_fp8_activation(x)
    assert q.float().tolist() == [[448.0, 2.0**-9, 2 * 2.0**-9, 2 * 2.0**-9, 0.0, 2 * 2.0**-9]]
    # tiny amax: the scale floor applies, values come out as small codes (or 0) and nothing divides by ~0
    tiny = torch.tensor([[1e-10, -3e-8, 0.0]])
    q, s = quantize_fp8_activation(tiny)
    assert s.item() == pytest.approx(FP8_MIN_SCALE) and torch.isfinite(q.float()).all()
    assert q.float()[0, 1].item() < 0
    # huge values: finite scale, codes within ±448, dequantized max equals the input max
    huge = torch.tensor([[3e38, -1e38, 1.0]])
    q, s = quantize_fp8_activation(huge)
    assert torch.isfinite(s).all() and q.float().abs().max().item() == FP8_MAX
    assert (q.float() * s)[0, 0].item() == pytest.approx(3e38, rel=1e-6)


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_linear_batch_invariant_and_qat_equals_serving(granularity, dtype):
    x, w = _data(dtype=dtype)
    qw, sw = sn.quantize_fp8_weight(w, granularity)
    y = sn.fp8_linear(x, qw, sw, granularity)
    assert y.dtype == dtype and y.shape == (37, 150)
    for k in (1, 5, 16, 17):
        assert torch.equal(sn.fp8_linear(x[:k], qw, sw, granularity), y[:k])
    assert torch.equal(sn.fp8_linear(x[20:21], qw, sw, granularity), y[20:21])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(sn.fp8_linear(x, qw, sw, granularity), y)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(sn.fp8_linear_qat(x, w, granularity), y)
    # and it is an FP8 approximation of the high-precision product
    ref = torch.nn.functional.linear(x.float(), w.float())
    assert (y.float() - ref).abs().max().item() < 0.1 * ref.abs().max().item()


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_qat_backward_is_straight_through(granularity):
    x, w = _data(m=9, k=130, n=20, dtype=torch.float32)
    x.requires_grad_(True)
    w.requires_grad_(True)
    gy = torch.randn(9, 20, generator=torch.Generator().manual_seed(1))
    sn.fp8_linear_qat(x, w, granularity).backward(gy)
    qx, sx = quantize_fp8_activation(x.detach(), granularity)
    x_dq = qx.float() * (sx if granularity == "per_channel" else sx.repeat_interleave(128, dim=1)[:, :130])
    w_dq = dequantize_fp8_weight(*quantize_fp8_weight(w.detach(), granularity), granularity)
    torch.testing.assert_close(x.grad, gy @ w_dq)
    torch.testing.assert_close(w.grad, gy.t() @ x_dq)
    grads = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    sn.fp8_linear_qat(x, w, granularity).backward(gy)
    assert torch.equal(x.grad, grads[0]) and torch.equal(w.grad, grads[1])  # deterministic


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_qat_backward_bf16(granularity):
    """bf16 activations: the straight-through gradients at bf16 precision (on AMX: bf16 GEMMs of dY and the
    dequantized operands), close to the float32 formula, deterministic, rows of dX independent of the batch."""
    x, w = _data(m=50, k=300, n=140, dtype=torch.bfloat16)
    gy = torch.randn(50, 140, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)

    def grads(rows):
        xx, ww = x[rows].clone().requires_grad_(True), w.clone().requires_grad_(True)
        sn.fp8_linear_qat(xx, ww, granularity).backward(gy[rows])
        return xx.grad, ww.grad

    gx, gw = grads(slice(None))
    assert gx.dtype == gw.dtype == torch.bfloat16
    qx, sx = quantize_fp8_activation(x, granularity)
    x_dq = qx.float() * (sx if granularity == "per_channel" else sx.repeat_interleave(128, dim=1)[:, :300])
    w_dq = dequantize_fp8_weight(*quantize_fp8_weight(w, granularity), granularity)
    ref_x, ref_w = gy.float() @ w_dq, gy.float().t() @ x_dq
    assert (gx.float() - ref_x).abs().max() <= 0.02 * ref_x.abs().max()
    assert (gw.float() - ref_w).abs().max() <= 0.02 * ref_w.abs().max()
    again = grads(slice(None))
    assert torch.equal(again[0], gx) and torch.equal(again[1], gw)
    assert torch.equal(grads(slice(7, 19))[0], gx[7:19])


def test_negative_control_vllm_native_quantizer_differs():
    """vLLM's native per-token path multiplies by 1/s; ours divides: on bf16 activations some codes differ."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with set_current_vllm_config(VllmConfig()):
        vq, vs = QuantFP8(static=False, group_shape=GroupShape.PER_TOKEN).forward_native(x)
    q, s = quantize_fp8_activation(x)
    assert torch.equal(vs, s)  # same scales ...
    stock_differs(
        not torch.equal(vq.float(), q.float()), "vLLM's QuantFP8 codes vs the shared quantizer's", "the input"
    )  # ... different codes


def test_negative_control_torchao_fake_quant_differs():
    """torchao computes the scale in the input dtype with no floor: different values on bf16, NaN on a zero row."""
    from torchao.quantization.granularity import PerRow
    from torchao.quantization.qat import Float8FakeQuantizeConfig, Float8FakeQuantizer

    fq = Float8FakeQuantizer(Float8FakeQuantizeConfig(dtype=FP8_DTYPE, granularity=PerRow()))
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    q, s = quantize_fp8_activation(x)
    stock_differs(not torch.equal(fq(x), (q.float() * s).to(torch.bfloat16)), "torchao's FP8 fake-quant", "the input")
    assert fq(torch.zeros(2, 512, dtype=torch.bfloat16)).isnan().any()


def test_negative_control_scaled_mm_differs_from_fp8_linear():
    x, w = _data(m=64, k=512, n=256)
    qx, sx = quantize_fp8_activation(x)
    qw, sw = quantize_fp8_weight(w)
    ref = torch._scaled_mm(qx, qw.t(), scale_a=sx, scale_b=sw.unsqueeze(0), out_dtype=torch.bfloat16)
    stock_differs(not torch.equal(ref, sn.fp8_linear(x, qw, sw)), "torch._scaled_mm vs fp8_linear", "the shapes")


def test_export_and_quantization_config(tmp_path):
    import json

    from safetensors.torch import load_file

    from shared_numerics.fp8_checkpoint import is_fp8_projection, parse_quantization_config, quantization_config
    from zerokld_models.fp8_export import export_fp8_checkpoint
    from zerokld_testing import TinyModelSpec, make_tiny_checkpoint

    src = make_tiny_checkpoint(tmp_path / "src", TinyModelSpec(), seed=3, dtype="bfloat16")
    out = export_fp8_checkpoint(src, tmp_path / "fp8", "block")
    assert parse_quantization_config(json.loads((out / "config.json").read_text())["quantization_config"]) == "block"
    hp, q = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    for name, t in hp.items():
        if is_fp8_projection(name):
            codes, scales = quantize_fp8_weight(t, "block")
            assert torch.equal(q[name].float(), codes.float()) and torch.equal(q[name + "_scale"], scales)
        else:
            assert torch.equal(q[name], t)
    assert (out / "tokenizer.json").exists()
    with pytest.raises(Fp8QuantizationError, match="already quantized"):
        export_fp8_checkpoint(out, tmp_path / "again")
    with pytest.raises(FileExistsError):
        export_fp8_checkpoint(src, out)
    with pytest.raises(Fp8QuantizationError, match="not a zerokld_fp8"):
        parse_quantization_config({"quant_method": "fp8"})
    with pytest.raises(Fp8QuantizationError, match="weight_block_size"):
        parse_quantization_config({**quantization_config("per_channel"), "weight_block_size": [64, 64]})
