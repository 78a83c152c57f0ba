"""Cost of the TP-size-invariant row-parallel sum vs stock's all-reduce, measured at TP 2 on CPU, tabulated for 8 GPUs.

Measured (two processes, one core each, a gloo process group on loopback; side by side in one run, medians):

* ``comm``: the collective alone: stock's all-reduce of the ``[M, N]`` activation-dtype output vs our all-gather of
  each rank's float32 subtree root ``[1, M, N]`` (:mod:`shared_numerics.tensor_parallel`);
* ``layer``: a whole row-parallel layer with ``K`` split over the two ranks: stock (one GEMM over the rank's ``K/2``
  columns with :func:`shared_numerics.linear`, rounded, all-reduced) vs ours
  (:func:`shared_numerics.tensor_parallel.row_parallel_linear` with ``k_block``: per-block float32 GEMMs, the rank's
  subtree, the gather, the top of the tree).

* ``vocab``: selected-token log-probs from vocab-parallel logits ``[M, V/2]`` per rank (``V`` = Qwen3's 151936):
  stock (Megatron's ``vocab_parallel_cross_entropy``: float32 ``exp`` and sum, all-reduces of the max, the sum and
  the picked logit) vs ours (:func:`shared_numerics.vocab_parallel.selected_logprobs`: float64 ``exp``, the exact
  int64 limb sums, all-gathers of the max, the ``[M, 2]`` limb sums and the picked logit); and at TP 1 (one
  process, full ``V``) ours vs the float64 tree of :func:`shared_numerics.selected_logprobs`.

On paper (no GPU collective was run): bytes each rank receives per row-parallel layer and the bandwidth term of the
time on 8 GPUs over NVLink (inputs in the JSON: per-direction link bandwidth, ``TP``, ``M``, ``N``):

* stock ring all-reduce of bf16: ``2 (TP-1)/TP * M N * 2`` bytes;
* ours, all-gather of float32 roots: ``(TP-1) * M N * 4`` bytes (``TP`` times the all-reduce);
* ours with an all-to-all instead (each rank gets every rank's float32 root for its ``N/TP`` columns, sums them with
  the tree, then a bf16 all-gather of the result, not implemented): ``(TP-1)/TP * M N * (4 + 2)`` bytes (1.5x).

Usage: ``python -m benchmarks.tp_reduction --out benchmarks/results/tp_reduction_cpu2.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
from pathlib import Path

from shared_numerics.machine import machine_facts

SHAPES = [  # (M tokens, K = full input width, N = output width): decode-sized and prefill-sized batches
    (16, 2048, 2048),
    (256, 2048, 2048),
    (16, 4096, 1024),
    (1024, 1024, 1024),
]
K_BLOCK = 128
VOCAB, VOCAB_TOKENS = 151936, [16, 256]  # Qwen3's vocabulary; decode- and prefill-sized batches
PAPER = {
    "tp": 8,
    "link_GBps_per_direction": 450.0,
    "hidden": 4096,
    "source": "H100 SXM NVLink 4: 900 GB/s bidirectional per GPU (NVIDIA H100 datasheet); Qwen3-8B hidden 4096",
    "tokens": [1, 64, 256, 8192],
}


def _rank(rank: int, world: int, port: int, dtype_name: str, repeats: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import shared_numerics as sn
    import shared_numerics.vocab_parallel as vp
    from benchmarks.timing import wall_times
    from shared_numerics.tensor_parallel import row_parallel_linear

    dtype = getattr(torch, dtype_name)

    def gather(root):
        parts = [torch.empty_like(root) for _ in range(world)]
        dist.all_gather(parts, root.contiguous())
        return torch.cat(parts)

    rows = []
    for m, k, n in SHAPES:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(m, k, generator=g).to(dtype)
        w = torch.randn(n, k, generator=g).to(dtype)
        kl = k // world
        xs, ws = x[:, rank * kl : (rank + 1) * kl].contiguous(), w[:, rank * kl : (rank + 1) * kl].contiguous()
        y = torch.randn(m, n, generator=g).to(dtype)
        root = torch.randn(1, m, n, generator=g)

        def stock_comm():
            t = y.clone()
            dist.all_reduce(t)

        def ours_comm():
            gather(root)

        def stock_layer():
            t = sn.linear(xs, ws)
            dist.all_reduce(t)

        def ours_layer():
            row_parallel_linear(xs, ws, k_block=K_BLOCK, gather=gather)

        res = {"M": m, "K": k, "N": n}
        for name, fn in (
            ("stock_comm", stock_comm),
            ("ours_comm", ours_comm),
            ("stock_layer", stock_layer),
            ("ours_layer", ours_layer),
        ):
            dist.barrier()
            res[name + "_ms"] = statistics.median(wall_times(fn, repeats, warmup=2)) * 1e3
        res["bytes_received_stock"] = 2 * (world - 1) / world * m * n * y.element_size()
        res["bytes_received_ours"] = (world - 1) * m * n * 4
        rows.append(res)
    vocab_rows = []
    for m in VOCAB_TOKENS:
        g = torch.Generator().manual_seed(1)
        v_local = VOCAB // world
        z = (torch.randn(m, v_local, generator=g) * 3).to(dtype)
        t = torch.randint(0, VOCAB, (m,), generator=g)
        start = rank * v_local

        def stock_vocab():
            zf = z.float()
            mx = zf.amax(-1)
            dist.all_reduce(mx, op=dist.ReduceOp.MAX)
            e = torch.exp(zf - mx.unsqueeze(-1))
            total = e.sum(-1)
            dist.all_reduce(total)
            local = t - start
            owned = (local >= 0) & (local < v_local)
            picked = torch.where(owned, zf.gather(-1, local.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1), 0.0)
            dist.all_reduce(picked)
            return picked - mx - torch.log(total)

        def ours_vocab():
            vp.selected_logprobs(z, t, vocab_start=start, vocab_size=VOCAB, gather=gather)

        res = {"M": m, "V": VOCAB, "V_local": v_local}
        for name, fn in (("stock_vocab", stock_vocab), ("ours_vocab", ours_vocab)):
            dist.barrier()
            res[name + "_ms"] = statistics.median(wall_times(fn, repeats, warmup=2)) * 1e3
        res["bytes_received_stock"] = 3 * 2 * (world - 1) / world * m * 4
        res["bytes_received_ours"] = (world - 1) * m * (4 + 16 + 4)
        if rank == 0:  # TP 1, full vocabulary: the new definition vs the float64 tree it replaces under tp_k_block
            zf = torch.cat([z, z], dim=-1)
            res["tp1_tree_ms"] = statistics.median(wall_times(lambda: sn.selected_logprobs(zf, t), repeats)) * 1e3
            res["tp1_ours_ms"] = statistics.median(wall_times(lambda: vp.selected_logprobs(zf, t), repeats)) * 1e3
        vocab_rows.append(res)
    if rank == 0:
        Path(out_dir, "rows.json").write_text(json.dumps({"layers": rows, "vocab": vocab_rows}))
    dist.destroy_process_group()


def _paper() -> list[dict]:
    tp, bw, n = PAPER["tp"], PAPER["link_GBps_per_direction"] * 1e9, PAPER["hidden"]
    out = []
    for m in PAPER["tokens"]:
        stock = 2 * (tp - 1) / tp * m * n * 2
        gather = (tp - 1) * m * n * 4
        a2a = (tp - 1) / tp * m * n * (4 + 2)
        out.append(
            {
                "M": m,
                "N": n,
                "bytes_stock_allreduce_bf16": stock,
                "bytes_ours_allgather_fp32": gather,
                "bytes_ours_alltoall_fp32_plus_allgather_bf16": a2a,
                "us_stock": stock / bw * 1e6,
                "us_ours_allgather": gather / bw * 1e6,
                "us_ours_alltoall": a2a / bw * 1e6,
            }
        )
    return out


def main() -> None:
    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/tp_reduction_cpu2.json")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    result = {
        "machine": {**machine_facts(), "tp": 2, "backend": "gloo (loopback), one thread per rank"},
        "k_block": K_BLOCK,
        "measured": {},
        "measured_vocab_parallel": {},
        "paper_8gpu_nvlink": {"inputs": PAPER, "rows": _paper()},
    }
    for dtype in ("bfloat16", "float32"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with tempfile.TemporaryDirectory() as d:
            mp.spawn(_rank, args=(2, port, dtype, args.repeats, d), nprocs=2, join=True)
            got = json.loads(Path(d, "rows.json").read_text())
        rows, vocab_rows = got["layers"], got["vocab"]
        for r in rows:
            r["comm_ratio"] = r["ours_comm_ms"] / r["stock_comm_ms"]
            r["layer_ratio"] = r["ours_layer_ms"] / r["stock_layer_ms"]
        for r in vocab_rows:
            r["vocab_ratio"] = r["ours_vocab_ms"] / r["stock_vocab_ms"]
            r["tp1_ratio_vs_tree"] = r["tp1_ours_ms"] / r["tp1_tree_ms"]
        result["measured"][dtype] = rows
        result["measured_vocab_parallel"][dtype] = vocab_rows
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    for dtype, rows in result["measured"].items():
        for r in rows:
            print(
                f"{dtype} M={r['M']} K={r['K']} N={r['N']}: comm stock {r['stock_comm_ms']:.3f} ms ours "
                f"{r['ours_comm_ms']:.3f} ms (x{r['comm_ratio']:.2f}); layer stock {r['stock_layer_ms']:.2f} ms "
                f"ours {r['ours_layer_ms']:.2f} ms (x{r['layer_ratio']:.2f})"
            )
    for dtype, rows in result["measured_vocab_parallel"].items():
        for r in rows:
            print(
                f"{dtype} vocab-parallel M={r['M']} V={r['V']}: stock {r['stock_vocab_ms']:.2f} ms ours "
                f"{r['ours_vocab_ms']:.2f} ms (x{r['vocab_ratio']:.2f}); TP 1 tree {r['tp1_tree_ms']:.2f} ms ours "
                f"{r['tp1_ours_ms']:.2f} ms (x{r['tp1_ratio_vs_tree']:.2f})"
            )


if __name__ == "__main__":
    main()
