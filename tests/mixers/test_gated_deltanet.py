"""The Gated DeltaNet token mixer's arithmetic (:mod:`shared_numerics.gated_deltanet`): HF's layer within float32
rounding; one sequence's tokens the same bits whether prefilled at once, in chunks that end anywhere, or decoded one
by one; stock's prefill (chunked) and decode (recurrent) giving other bits for the same tokens."""

from __future__ import annotations

import itertools

import pytest
import torch

from shared_numerics.gated_deltanet import gated_deltanet_core
from zerokld_testing.controls import stock_differs

pytestmark = pytest.mark.timeout(300)

# (Hk, d_k, Hv, d_v): value heads > key heads with unequal head sizes; equal heads
SHAPES = [(2, 16, 4, 24), (3, 32, 3, 32)]


def _hf_layer(dims, seed: int):
    """HF's ``Qwen3NextGatedDeltaNet`` (layer 0 of a tiny ``Qwen3NextConfig``), float32, every parameter random
    (``A_log``, ``dt_bias`` and the norm weight too: their init values would hide a misplaced one)."""
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    hk, dk, hv, dv = dims
    cfg = Qwen3NextConfig(
        hidden_size=64,
        linear_num_key_heads=hk,
        linear_key_head_dim=dk,
        linear_num_value_heads=hv,
        linear_value_head_dim=dv,
        linear_conv_kernel_dim=4,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        rms_norm_eps=1e-6,
    )
    torch.manual_seed(seed)
    layer = Qwen3NextGatedDeltaNet(cfg, 0).float().eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 1.0))
        layer.A_log.copy_(torch.rand_like(layer.A_log) * 2 - 1)
    return layer


def _inputs(layer, x: torch.Tensor, dtype):
    """The projections HF's forward computes before its conv (its own ``fix_query_key_value_ordering``), in ``dtype``:
    ``(mixed_qkv [T, C], z [T, Hv*dv], a [T, Hv], b [T, Hv])``, and the layer's parameters as ours take them."""
    with torch.no_grad():
        q, k, v, z, b, a = layer.fix_query_key_value_ordering(layer.in_proj_qkvz(x[None]), layer.in_proj_ba(x[None]))
        mixed = torch.cat([t.reshape(t.shape[1], -1) for t in (q, k, v)], dim=-1)
        params = {
            "conv1d_weight": layer.conv1d.weight[:, 0, :].to(dtype),
            "A_log": layer.A_log.to(dtype),
            "dt_bias": layer.dt_bias.to(dtype),
            "norm_weight": layer.norm.weight.to(dtype),
        }
        return (mixed.to(dtype), z[0].reshape(x.shape[0], -1).to(dtype), a[0].to(dtype), b[0].to(dtype)), params


def _dims(layer):
    return (layer.num_k_heads, layer.head_k_dim, layer.num_v_heads, layer.head_v_dim)


def _ours(layer, inputs, params, lo: int, hi: int, conv=None, rec=None):
    mixed, z, a, b = (t[lo:hi] for t in inputs)
    return gated_deltanet_core(mixed, z, a, b, params, _dims(layer), layer.layer_norm_epsilon, conv, rec)


@pytest.mark.parametrize("dims", SHAPES, ids=["hv4_hk2", "hv3_hk3"])
def test_ours_is_hfs_layer_within_float32_rounding(dims):
    """Our definition is the model's: float32, 150 tokens (three of HF's 64-token chunks), the whole layer (HF's
    projections and ``out_proj`` around ours, outputs of order 1) within 1e-4 of HF's ``forward`` (its chunked prefill:
    a triangular solve and cumulative decays, another rounding than the recurrence's); the recurrent state within
    1e-5 of HF's recurrent path on the same inputs."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

    layer = _hf_layer(dims, seed=1)
    x = torch.randn(150, 64, generator=torch.Generator().manual_seed(2))
    inputs, params = _inputs(layer, x, torch.float32)
    out, _, state = _ours(layer, inputs, params, 0, 150)
    with torch.no_grad():
        ref = layer(x[None])[0]
        ours = layer.out_proj(out)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-4)
    # HF's recurrent path on ours's conv and gates: the state and the core output (before the gated norm)
    from shared_numerics.gated_deltanet import causal_conv1d, gdn_gates

    hk, dk, hv, dv = dims
    y, _ = causal_conv1d(inputs[0], params["conv1d_weight"])
    q, k, v = torch.split(y, [hk * dk, hk * dk, hv * dv], dim=-1)
    q, k = (t.reshape(150, hk, dk).repeat_interleave(hv // hk, dim=1) for t in (q, k))
    g, beta = gdn_gates(inputs[2], inputs[3], params["A_log"], params["dt_bias"])
    _, hf_state = torch_recurrent_gated_delta_rule(
        q[None],
        k[None],
        v.reshape(1, 150, hv, dv),
        g[None],
        beta[None],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    torch.testing.assert_close(state, hf_state[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("dims", SHAPES, ids=["hv4_hk2", "hv3_hk3"])
def test_prefill_in_any_chunks_and_decode_are_the_same_bits(dims, dtype):
    """One sequence of 100 tokens: prefilled at once, prefilled in two chunks split at 1, 37, 64 and 99 tokens (the
    cache carried between them), in chunks of 16 (vLLM's chunked prefill at a small budget), and decoded one token at
    a time after a 10-token prefill: every output row and the final conv and recurrent states are the same bits."""
    layer = _hf_layer(dims, seed=3)
    x = torch.randn(100, 64, generator=torch.Generator().manual_seed(4))
    inputs, params = _inputs(layer, x, dtype)
    whole, conv, rec = _ours(layer, inputs, params, 0, 100)
    assert whole.shape[0] == 100 and whole.dtype == dtype and rec.dtype == torch.float32

    def run(bounds):
        outs, c, r = [], None, None
        for lo, hi in zip(bounds, bounds[1:], strict=False):
            o, c, r = _ours(layer, inputs, params, lo, hi, c, r)
            outs.append(o)
        return torch.cat(outs), c, r

    for bounds in (
        [0, 1, 100],
        [0, 37, 100],
        [0, 64, 100],
        [0, 99, 100],
        list(range(0, 101, 16)) + [100],
        [0, *range(10, 101)],
    ):
        got, c, r = run(bounds)
        assert got.shape == whole.shape
        assert torch.equal(got, whole), f"split at {bounds[:4]}...: rows differ"
        assert torch.equal(c, conv) and torch.equal(r, rec)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_serving_steps_layer_is_each_sequence_alone(dtype):
    """:func:`gated_deltanet_varlen` over a step of four sequences at different points (a decode, a first prefill
    chunk, a later chunk, a decode after a long prefill), the caches written in place: every sequence's rows and both
    of its states are the bits of the one-sequence layer; the tokens before each step were computed alone too."""
    from shared_numerics.gated_deltanet import gated_deltanet_varlen

    layer = _hf_layer(SHAPES[0], seed=12)
    x = torch.randn(4 * 60, 64, generator=torch.Generator().manual_seed(13))
    inputs, params = _inputs(layer, x, dtype)
    seqs = [(0, 20, 21), (60, 60, 77), (120, 130, 150), (180, 239, 240)]  # (start, step from, step to)
    caches = [_ours(layer, inputs, params, s0, lo) if lo > s0 else (None, None, None) for s0, lo, _ in seqs]
    hk, dk, hv, dv = _dims(layer)
    c = inputs[0].shape[1]
    conv = torch.stack([cc if cc is not None else torch.zeros(3, c, dtype=dtype) for _, cc, _ in caches])
    rec = torch.stack([rr if rr is not None else torch.zeros(hv, dk, dv) for _, _, rr in caches])
    rows = torch.cat([torch.arange(lo, hi) for _, lo, hi in seqs])
    lens = [hi - lo for _, lo, hi in seqs]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    step = [t[rows] for t in inputs]
    with torch.no_grad():  # a serving step (the float32 parameters here are HF's, requiring grad)
        eps = layer.layer_norm_epsilon
        out, conv2, rec2 = gated_deltanet_varlen(*step, params, _dims(layer), eps, cu, conv, rec, inplace=True)
    assert conv2 is conv and rec2 is rec and out.shape == (sum(lens), hv * dv)
    for n, (s0, lo, hi) in enumerate(seqs):
        _, cc, rr = caches[n]
        alone, c_alone, r_alone = _ours(layer, inputs, params, lo, hi, cc, rr)
        assert torch.equal(out[cu[n] : cu[n + 1]], alone) and torch.equal(conv[n], c_alone)
        assert torch.equal(rec[n], r_alone)


def test_stock_chunked_prefill_and_recurrent_decode_differ():
    """Negative control: HF's own two paths (``torch_chunk_gated_delta_rule`` for a prefill, the recurrent one for
    decode — vLLM-CPU's ``chunk_gated_delta_rule_cpu`` / ``fused_sigmoid_gating_delta_rule_update_cpu`` split the
    same way) give other bits for the same 100 tokens: prefilled at once vs 37 prefilled and the rest decoded, and
    prefilled at once vs prefilled in two chunks split at 37."""
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    gen = torch.Generator().manual_seed(5)
    t, h, dk, dv = 100, 4, 32, 32
    q, k = (torch.randn(1, t, h, dk, generator=gen) for _ in range(2))
    v = torch.randn(1, t, h, dv, generator=gen)
    g = -torch.rand(1, t, h, generator=gen)
    beta = torch.rand(1, t, h, generator=gen)
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    whole, _ = torch_chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    head, s = torch_chunk_gated_delta_rule(q[:, :37], k[:, :37], v[:, :37], g[:, :37], beta[:, :37], **kw)
    tail, _ = torch_chunk_gated_delta_rule(
        q[:, 37:], k[:, 37:], v[:, 37:], g[:, 37:], beta[:, 37:], initial_state=s, **kw
    )
    decoded = []
    for i in range(37, t):
        o, s = torch_recurrent_gated_delta_rule(
            q[:, i : i + 1],
            k[:, i : i + 1],
            v[:, i : i + 1],
            g[:, i : i + 1],
            beta[:, i : i + 1],
            initial_state=s,
            **kw,
        )
        decoded.append(o)
    decoded = torch.cat(decoded, dim=1)
    chunked = torch.cat([head, tail], dim=1)
    assert decoded.shape == whole[:, 37:].shape == (1, t - 37, h, dv) and chunked.shape == whole.shape
    stock_differs(not torch.equal(decoded, whole[:, 37:]), "GDN chunked prefill vs recurrent decode", "the shapes")
    stock_differs(not torch.equal(chunked, whole), "GDN prefill split at 37 vs whole", "the split")


def test_refuses_shapes_that_do_not_match():
    """Value heads not a multiple of key heads, a q|k|v width or a state that does not match: ``ValueError``."""
    dims = (2, 8, 3, 8)
    mixed, z, a, b = torch.zeros(4, 2 * 16 + 24), torch.zeros(4, 24), torch.zeros(4, 3), torch.zeros(4, 3)
    params = {
        "conv1d_weight": torch.zeros(56, 4),
        "A_log": torch.zeros(3),
        "dt_bias": torch.zeros(3),
        "norm_weight": torch.ones(8),
    }
    with pytest.raises(ValueError, match="not a multiple"):
        gated_deltanet_core(mixed, z, a, b, params, dims, 1e-6)
    dims = (1, 8, 3, 8)
    with pytest.raises(ValueError, match="width"):
        gated_deltanet_core(mixed, z, a, b, params, dims, 1e-6)
    mixed = torch.zeros(4, 16 + 24)
    params["conv1d_weight"] = torch.zeros(40, 4)
    with pytest.raises(ValueError, match="conv state"):
        gated_deltanet_core(mixed, z, a, b, params, dims, 1e-6, conv_state=torch.zeros(2, 40))
    with pytest.raises(ValueError, match="recurrent state"):
        gated_deltanet_core(mixed, z, a, b, params, dims, 1e-6, recurrent_state=torch.zeros(3, 8, 9))


@pytest.mark.parametrize(
    "layer_types",
    [
        ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
        ["full_attention", "linear_attention", "linear_attention", "full_attention"],
    ],
    ids=["3_to_1", "mixed"],
)
def test_a_hybrids_plan_is_its_layer_types_and_hfs_layers(layer_types):
    """The plan of a hybrid is data: each layer's mixer is the one its ``layer_types`` entry names — Gated DeltaNet
    (``"recurrent"`` cache: the conv state ``[K - 1, conv channels]`` and the float32 ``[Hv, d_k, d_v]`` state, the
    shapes of HF's ``conv1d`` and recurrent state) or grouped-query attention (``"paged_kv"``) — as HF's
    ``Qwen3NextModel`` builds them, in a 3:1 pattern and another; the bytes one sequence's cache holds per Gated
    DeltaNet layer; the registered declaration supported (Qwen3-Next's folder); ``layer_types`` that do not cover
    every layer, or name an undeclared type, refused."""
    import dataclasses

    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextModel

    from zerokld_models import UnsupportedModelError, adapter_for, layer_plan, read_model_config, unsupported_features
    from zerokld_models.mixers import GatedDeltaNet

    hf_config = Qwen3NextConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=len(layer_types),
        layer_types=layer_types,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_num_value_heads=4,
        linear_value_head_dim=24,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        architectures=["Qwen3NextForCausalLM"],
    )
    cfg = read_model_config(hf_config)
    adapter = adapter_for(cfg)
    plan = layer_plan(cfg, adapter)
    hf = Qwen3NextModel(hf_config).layers
    assert len(plan) == len(hf) == len(layer_types)
    for layer, ref in zip(plan, hf, strict=True):
        state = dict(layer.mixer.state)
        if hasattr(ref, "linear_attn"):
            gdn = ref.linear_attn
            assert (layer.mixer.kind, layer.mixer.cache) == ("gated_deltanet", "recurrent")
            c, _, k = gdn.conv1d.weight.shape
            assert state == {"conv": (k - 1, c), "recurrent": (gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim)}
            assert layer.mixer.component.rotary_dim(cfg) is None and not layer.mixer.component.context_parallel
        else:
            assert (layer.mixer.kind, layer.mixer.cache) == ("gqa", "paged_kv")
            assert state["k"] == (cfg.num_key_value_heads, cfg.head_dim)
    assert [layer.mixer.kind == "gated_deltanet" for layer in plan] == [t == "linear_attention" for t in layer_types]
    # bf16 activations: conv 3 x (2*2*16 + 4*24) x 2 bytes + recurrent 4 x 16 x 24 x 4 bytes
    assert GatedDeltaNet.state_bytes(cfg, 2) == 3 * 160 * 2 + 4 * 16 * 24 * 4
    assert unsupported_features(cfg, adapter) == []
    for bad in (layer_types[:-1], [*layer_types[:-1], "sliding_attention"]):
        with pytest.raises(UnsupportedModelError, match="layer_types"):
            layer_plan(dataclasses.replace(cfg, layer_types=tuple(bad)), adapter)


@pytest.mark.parametrize("dk,dv", [(16, 24), (24, 40), (128, 128)], ids=["dk16", "dk24", "dk128"])
def test_compiled_recurrence_is_the_torch_definition_bit_for_bit(dk, dv, threads):
    """``csrc/gdn.cpp`` (what runs on CPU, in the engine and the trainer) gives the torch ops' bits (the definition
    as written, what other devices run), a head dimension that is not a power of two included (the tree's zero
    padding), value widths that leave a partial block of 16 columns, at 1 and 2 threads; the state passed in is not
    modified."""
    from shared_numerics.gated_deltanet import _rule_torch, gated_delta_rule, l2_normalize

    gen = torch.Generator().manual_seed(7)
    t, h = 40, 3
    q = l2_normalize(torch.randn(t, h, dk, generator=gen)) / dk**0.5
    k = l2_normalize(torch.randn(t, h, dk, generator=gen))
    v = torch.randn(t, h, dv, generator=gen)
    g, beta = -torch.rand(t, h, generator=gen), torch.rand(t, h, generator=gen)
    state = torch.randn(h, dk, dv, generator=gen)
    before = state.clone()
    cu = torch.tensor([0, t])
    ref_o, ref_s = _rule_torch(q, k, v, torch.exp(g.double()).float(), beta, cu, state[None])
    o, s = gated_delta_rule(q, k, v, g, beta, state)
    assert o.shape == ref_o.shape == (t, h, dv)
    assert torch.equal(o, ref_o) and torch.equal(s, ref_s[0])
    assert torch.equal(state, before)


def test_a_serving_steps_sequences_are_each_the_same_bits_as_alone():
    """:func:`gated_delta_rule_varlen` over a step's sequences (decodes of one token, prefill chunks, an empty one),
    compiled: each sequence's rows and state are the bits of that sequence alone and of the torch ops; in place, the
    states are written into the cache given (a float32 one only)."""
    from shared_numerics.gated_deltanet import _rule_torch, gated_delta_rule, gated_delta_rule_varlen, l2_normalize

    gen = torch.Generator().manual_seed(8)
    lens, h, dk, dv = [1, 17, 0, 1, 40, 3], 2, 24, 16
    t = sum(lens)
    q = l2_normalize(torch.randn(t, h, dk, generator=gen)) / dk**0.5
    k = l2_normalize(torch.randn(t, h, dk, generator=gen))
    v, g, beta = torch.randn(t, h, dv, generator=gen), -torch.rand(t, h, generator=gen), torch.rand(t, h, generator=gen)
    states = torch.randn(len(lens), h, dk, dv, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    o, s = gated_delta_rule_varlen(q, k, v, g, beta, cu, states)
    assert o.shape == (t, h, dv) and s.shape == states.shape
    ref_o, ref_s = _rule_torch(q, k, v, torch.exp(g.double()).float(), beta, cu, states)
    assert torch.equal(o, ref_o) and torch.equal(s, ref_s)
    for n, (lo, hi) in enumerate(itertools.pairwise(cu.tolist())):
        alone_o, alone_s = gated_delta_rule(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], states[n])
        assert torch.equal(alone_o, o[lo:hi]) and torch.equal(alone_s, s[n])
    cache = states.clone()  # a serving cache: the states written where they are
    o2, s2 = gated_delta_rule_varlen(q, k, v, g, beta, cu, cache, inplace=True)
    assert s2 is cache and torch.equal(cache, s) and torch.equal(o2, o)
    with pytest.raises(ValueError, match="contiguous float32"):  # a copy would be written, not the cache
        gated_delta_rule_varlen(q, k, v, g, beta, cu, states.bfloat16(), inplace=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_compiled_conv_is_the_torch_definition_bit_for_bit(dtype, threads):
    """The conv1d + SiLU kernel (``csrc/gdn.cpp``, what runs without autograd on CPU) gives the torch ops' bits (what
    the trainer's autograd runs) for a step's sequences: decodes, prefill chunks shorter than the kernel's reach into
    the state (1 and 2 tokens with ``K = 4``), an empty one, 40 channels (a partial block of 16); at 1 and 2 threads;
    each sequence's rows and new state are its bits alone; in place, the states land in the cache given."""
    from shared_numerics.gated_deltanet import causal_conv1d, causal_conv1d_varlen

    gen = torch.Generator().manual_seed(9)
    lens, c, kw = [1, 2, 0, 17, 1, 5], 40, 4
    t = sum(lens)
    x = torch.randn(t, c, generator=gen).to(dtype)
    w = torch.randn(c, kw, generator=gen).to(dtype)
    states = torch.randn(len(lens), kw - 1, c, generator=gen).to(dtype)
    before = states.clone()
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    y, s = causal_conv1d_varlen(x, w, cu, states)
    assert y.shape == (t, c) and y.dtype == dtype and torch.equal(states, before)
    with torch.enable_grad():
        ref_y, ref_s = causal_conv1d_varlen(x.clone().requires_grad_(), w, cu, states)
    assert torch.equal(y, ref_y.detach()) and torch.equal(s, ref_s.detach())
    for n, (lo, hi) in enumerate(itertools.pairwise(cu.tolist())):
        alone_y, alone_s = causal_conv1d(x[lo:hi], w, states[n])
        assert torch.equal(alone_y, y[lo:hi]) and torch.equal(alone_s, s[n])
    cache = states.clone()
    y2, s2 = causal_conv1d_varlen(x, w, cu, cache, inplace=True)
    assert s2 is cache and torch.equal(cache, s) and torch.equal(y2, y)


def test_compiled_backward_is_the_gradient_of_the_definition(threads):
    """Under autograd on CPU the recurrence runs the kernel forward (the engine's bits) and its compiled backward:
    every input's gradient (q, k, v, the gates through ``exp``, the initial states) matches torch autograd through
    the definition's torch ops within float32 rounding, over sequences longer than a checkpoint interval (32 tokens)
    and an empty one; the same gradients bit for bit on a second run."""
    from shared_numerics.gated_deltanet import _rule_torch, gated_delta_rule_varlen, l2_normalize

    gen = torch.Generator().manual_seed(10)
    lens, h, dk, dv = [70, 0, 5], 2, 16, 24
    t = sum(lens)
    leaves = [
        l2_normalize(torch.randn(t, h, dk, generator=gen)) / dk**0.5,
        l2_normalize(torch.randn(t, h, dk, generator=gen)),
        torch.randn(t, h, dv, generator=gen),
        -torch.rand(t, h, generator=gen),
        torch.rand(t, h, generator=gen),
        torch.randn(len(lens), h, dk, dv, generator=gen) * 0.3,
    ]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    w_o, w_s = torch.randn(t, h, dv, generator=gen), torch.randn(len(lens), h, dk, dv, generator=gen)

    def grads(fn):
        xs = [x.clone().requires_grad_() for x in leaves]
        o, s = fn(*xs)
        ((o * w_o).sum() + (s * w_s).sum()).backward()
        return o.detach(), [x.grad for x in xs]

    o, ours = grads(lambda q, k, v, g, b, s: gated_delta_rule_varlen(q, k, v, g, b, cu, s))
    ref_o, ref = grads(lambda q, k, v, g, b, s: _rule_torch(q, k, v, torch.exp(g.double()).float(), b, cu, s))
    assert torch.equal(o, ref_o)
    for name, a, b in zip(("q", "k", "v", "g", "beta", "state"), ours, ref, strict=True):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)
    _, again = grads(lambda q, k, v, g, b, s: gated_delta_rule_varlen(q, k, v, g, b, cu, s))
    assert all(torch.equal(a, b) for a, b in zip(ours, again, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_compiled_l2_norm_is_the_torch_definition_bit_for_bit(dtype, threads):
    """The L2 norm kernel (what runs without autograd on CPU) on q's and k's head-major slices of the conv output
    gives the torch ops' bits (the trainer's autograd path), divided by ``sqrt(d_k)`` or not, a head size that is not
    a power of two included."""
    from shared_numerics.gated_deltanet import l2_normalize

    gen = torch.Generator().manual_seed(11)
    for heads, d in ((3, 24), (2, 128)):
        y = torch.randn(37, 3 * heads * d + 5, generator=gen).to(dtype)
        for lo, divisor in ((0, d**0.5), (heads * d, 1.0)):
            x = y[:, lo : lo + heads * d].reshape(37, heads, d)  # a strided view, as the conv output's slices
            ours = l2_normalize(x, divisor=divisor)
            with torch.enable_grad():
                ref = l2_normalize(x.clone().requires_grad_(), divisor=divisor)
            assert ours.dtype == torch.float32 and ours.shape == (37, heads, d)
            assert torch.equal(ours, ref.detach())


@pytest.mark.parametrize("lens", [[1, 1, 1, 1], [2, 0, 2, 1]], ids=["decode", "two_per_sequence"])
def test_a_decode_steps_wide_rows_are_the_torch_definition_bit_for_bit(lens, threads):
    """A decode step (at most two tokens per sequence) with ``d_v`` a multiple of 128 streams whole state rows
    through the kernel instead of blocks of 16 columns: the torch ops' bits, each sequence's those of it alone."""
    from shared_numerics.gated_deltanet import _rule_torch, gated_delta_rule, gated_delta_rule_varlen, l2_normalize

    gen = torch.Generator().manual_seed(14)
    h, dk, dv = 2, 64, 256
    t = sum(lens)
    q = l2_normalize(torch.randn(t, h, dk, generator=gen)) / dk**0.5
    k = l2_normalize(torch.randn(t, h, dk, generator=gen))
    v, g, beta = torch.randn(t, h, dv, generator=gen), -torch.rand(t, h, generator=gen), torch.rand(t, h, generator=gen)
    states = torch.randn(len(lens), h, dk, dv, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    o, s = gated_delta_rule_varlen(q, k, v, g, beta, cu, states)
    ref_o, ref_s = _rule_torch(q, k, v, torch.exp(g.double()).float(), beta, cu, states)
    assert o.shape == (t, h, dv) and torch.equal(o, ref_o) and torch.equal(s, ref_s)
    for n, (lo, hi) in enumerate(itertools.pairwise(cu.tolist())):
        alone_o, alone_s = gated_delta_rule(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], states[n])
        assert torch.equal(alone_o, o[lo:hi]) and torch.equal(alone_s, s[n])
