"""The trainer's cost at each tested layout vs one rank, zerokld and stock side by side in one run (issue 56 point 8).

For each layout the same checkpoint and sequences go through :mod:`zerokld_testing.titan_tp` under ``torchrun``
(gloo on loopback, one process per rank): the batch's log-probs (``RLTrainer.forward_logprobs``, timed ``--repeats``
times after the first) and one RL step (``rl_step``), rank 0's wall clock between barriers, medians. Layouts:

* ``tp2``: TorchTitan ``tensor_parallel_degree`` 2 (Qwen3; zerokld with ``tp_k_block`` 16, the one-rank baseline
  with the same ``tp_k_block``, the numerics it must equal); every rank scores the whole batch;
* ``ep2``: ``expert_parallel_degree`` 2 (Qwen3-MoE, 8 experts top-2; each rank scores half the batch, the baseline
  one rank the whole batch);
* ``pp2``: ``pipeline_parallel_degree`` 2 (Qwen3, 1F1B, four micro-batches of two rollouts, float32: exact
  accumulation covers float32 on every CPU); its RL step is ``forward_backward`` + ``optim_step``, and so is the
  zerokld one-rank baseline's (the step it equals bit for bit);
* ``dp2``: FSDP over two data-parallel ranks (Qwen3, float32; each rank half the batch); zerokld's RL step is
  ``forward_backward`` + ``optim_step`` with the chains handed from rank to rank, as is its one-rank baseline's;
  stock's is ``rl_step`` (FSDP's reduce-scatter) against stock on one rank;
* ``cp2``: ``context_parallel_degree`` 2 (Qwen3; each rank a contiguous half of every sequence; its RL step is
  ``forward_backward`` + ``optim_step``); stock TorchTitan's CP cannot run on CPU (no sharding strategy for the CPU
  flash-attention op), so its row is the zerokld one alone;
* ``fsdp2xtp2``: FSDP 2 x TP 2 on four ranks (Qwen3, float32, ``tp_k_block`` 16; each data-parallel pair half the
  batch); zerokld's RL step is ``forward_backward`` (exact accumulation, the TP shards' chains handed between the
  data-parallel ranks) + ``optim_step``, as is its one-rank baseline's (with the same ``tp_k_block``); four ranks
  share the two cores;
* ``tp2xep2``: TP 2 x EP 2 (Qwen3-MoE, ``tp_k_block`` 16: TorchTitan borrows the TP ranks for EP; both ranks score
  the whole batch). A layout whose run fails (stock TorchTitan's TP x EP fails on an odd padded length) gets a row
  that says so.

``--layouts`` picks some of them (default: all); with ``--merge`` their rows replace those of an existing ``--out``
(same machine and workload; every row records the date it was measured).

``speed_vs_one_rank = one_rank_s / layout_s`` (above 1: the layout is faster). On a 2-core machine two ranks get one
core each while one rank gets both (``--threads``), so the figures say what the layout's communication and the
zerokld definitions cost here, not what it gains on more machines. The JSON records the machine (CPU model, ISA
flags, threads).

Usage: ``python -m benchmarks.layouts --out benchmarks/results/layouts_cpu2.json`` (writes ``.json`` and ``.md``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from shared_numerics.machine import machine_facts

#: what must match for ``--merge`` to keep an earlier run's rows: one CPU model name covers machines of other ISAs
#: (an AMD EPYC with AVX-512 and one with AVX2 only)
MERGE_MACHINE_KEYS = ("cpu_model", "isa_flags", "cores", "threads", "torch")


class LayoutFailed(RuntimeError):
    """A layout's ``torchrun`` exited with an error (its stderr's tail in the message)."""


def _failure_line(stderr: str) -> str:
    """The first exception line (``SomeError: message``) of a failed run's stderr, without its rank prefix (for the
    table), else its last line."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    named = [m.group(1) for ln in lines if (m := re.search(r"\b(\w+(?:Error|Exception): .*)", ln))]
    return (named[:1] or lines[-1:] or ["(no stderr)"])[0][:200]


def _run(tmp: Path, name: str, ckpt: str, dtype: str, seqs, lens, nproc: int, repeats: int, **spec) -> dict:
    spec.setdefault("train_step", True)
    path, out = tmp / f"{name}.json", tmp / f"{name}.pt"
    path.write_text(
        json.dumps(
            {
                "checkpoint": ckpt,
                "dtype": dtype,
                "sequences": seqs,
                "prompt_lengths": lens,
                "repeat": repeats,
                "tp": 1,
                "tp_k_block": None,
                **spec,
            }
        )
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc))}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(nproc),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            "--module",
            "zerokld_testing.titan_tp",
            str(path),
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=1800,
        env=env,
    )
    if proc.returncode:
        # the first exception line of the whole stderr (a rank's traceback can end before its last 3000 characters)
        raise LayoutFailed(f"{name}: torchrun failed: {_failure_line(proc.stderr)}\n{proc.stderr[-3000:]}")
    r = torch.load(out)
    return {
        "forward_s": statistics.median(r["seconds"]["forward"][1:] or r["seconds"]["forward"]),
        "step_s": r["seconds"]["step"][0] if "step" in r["seconds"] else None,
        "logprobs": r["logprobs"],
    }


def markdown(result: dict) -> str:
    """The table of a result (one line per layout x engine), with its machine and workload."""
    m, dt = result["machine"], result.get("dtype")
    lines = [
        "# The trainer at each layout vs one rank (`benchmarks/layouts.py`)",
        "",
        (
            f"Measured {result['date']} on {m['cpu_model']} ({', '.join(m['isa_flags']) or 'no AVX2'}; {m['cores']} "
            f"cores, {m['threads']} threads), torch {m['torch']}: {result['workload']}. Two ranks get one core each, "
            "one rank both; four ranks (fsdp2xtp2) share them, two per core."
        ),
        "",
        (
            "| layout | model | engine + trainer | forward: one rank / layout (s) | speed "
            "| RL step: one rank / layout (s) | speed | log-probs == one rank |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        model = r["arch"] if r.get("dtype", dt) == dt else f"{r['arch']} ({r['dtype']})"
        if r.get("failed"):
            lines.append(f"| {r['layout']} | {model} | {r['engine']} | fails: {r['failed']} | — | — | — | — |")
            continue
        step = "— | —"  # a layout without training (context parallelism: not yet)
        if r["step_s"] is not None:
            step = f"{r['one_rank_step_s']:.2f} / {r['step_s']:.2f} | {r['step_speed_vs_one_rank']:.2f}x"
        lines.append(
            f"| {r['layout']} | {model} | {r['engine']} | {r['one_rank_forward_s']:.2f} / "
            f"{r['forward_s']:.2f} | {r['forward_speed_vs_one_rank']:.2f}x | {step} | "
            f"{'yes' if r['logprobs_equal_one_rank'] else 'no'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/bench/layouts.json")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--layouts", default="", help="comma-separated layout names (default: all)")
    ap.add_argument(
        "--merge",
        action="store_true",
        help="replace only these layouts' rows in an existing --out (each row keeps the date it was measured)",
    )
    args = ap.parse_args(argv)

    from benchmarks.trainer import realistic_spec
    from zerokld_testing import DeepSeekSpec, make_deepseek_checkpoint, make_tiny_checkpoint

    rng = random.Random(0)
    seqs = [[1] + [rng.randrange(3, 30000) for _ in range(args.seq_len - 1)] for _ in range(args.batch)]
    lens = [args.seq_len // 2] * args.batch
    dense = realistic_spec(args.hidden, args.layers)
    moe = dataclasses.replace(
        dense, family="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=args.hidden
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="zerokld-layouts-") as tmp_name:
        tmp = Path(tmp_name)
        ckpts = {
            (name, dtype): str(make_tiny_checkpoint(tmp / f"{name}_{dtype}", spec, seed=0, dtype=dtype))
            for name, spec, dtype in (
                ("qwen3", dense, args.dtype),
                ("qwen3_moe", moe, args.dtype),
                ("qwen3", dense, "float32"),
            )
        }
        # DeepSeek-V3 at the same width and depth: MLA (8 heads, latent 256 + 64), DeepSeekMoE (8 experts top-2 in 4
        # groups, one shared), the first layer dense; a 32k vocabulary (the prompts' token ids)
        deepseek = DeepSeekSpec(
            hidden_size=args.hidden,
            intermediate_size=2 * args.hidden,
            moe_intermediate_size=args.hidden // 2,
            num_hidden_layers=args.layers,
            num_attention_heads=8,
            q_lora_rank=args.hidden // 2,
            qk_nope_head_dim=64,
            v_head_dim=64,
            vocab_size=32768,
            init_std=0.02,
        )
        ckpts["deepseek_v3", args.dtype] = str(
            make_deepseek_checkpoint(tmp / "deepseek_v3", deepseek, dtype=args.dtype)
        )
        pp = {"pp": 2, "pp_microbatches": 4, "pp_microbatch_size": 2, "seq_len": args.seq_len}
        layouts = {  # name: (checkpoint, dtype, ranks, the layout's spec, the one-rank baseline's spec)
            "tp2": ("qwen3", args.dtype, 2, {"tp": 2, "tp_k_block": 16}, {"tp_k_block": 16}),
            "ep2": ("qwen3_moe", args.dtype, 2, {"ep": 2, "split": True}, {}),
            "pp2": ("qwen3", "float32", 2, pp, {"streaming": True}),
            "cp2": ("qwen3", args.dtype, 2, {"cp": 2}, {}),
            "dp2": ("qwen3", "float32", 2, {"split": True, "streaming": True}, {"streaming": True}),
            "fsdp2xtp2": (
                "qwen3",
                "float32",
                4,
                {"tp": 2, "tp_k_block": 16, "split": True, "streaming": True},
                {"tp_k_block": 16, "streaming": True},
            ),
            "tp2xep2": ("qwen3_moe", args.dtype, 2, {"tp": 2, "tp_k_block": 16, "ep": 2}, {"tp_k_block": 16}),
            "tp2xep2_deepseek": (
                "deepseek_v3",
                args.dtype,
                2,
                {"tp": 2, "tp_k_block": 16, "ep": 2},
                {"tp_k_block": 16},
            ),
        }
        chosen = [n for n in args.layouts.split(",") if n] or list(layouts)
        unknown = sorted(set(chosen) - set(layouts))
        if unknown:
            raise SystemExit(f"unknown layouts {unknown}; expected some of {sorted(layouts)}")
        for layout, (arch, dtype, nproc, spec, base) in ((n, layouts[n]) for n in chosen):
            for zerokld in (True,) if layout == "cp2" else (True, False):  # stock CP: not on CPU
                stock = {} if zerokld else {"tp_k_block": None, "streaming": False}
                one = _run(
                    tmp,
                    f"{layout}_one_{zerokld}",
                    ckpts[arch, dtype],
                    dtype,
                    seqs,
                    lens,
                    1,
                    args.repeats,
                    batch_invariant=zerokld,
                    **{**base, **stock},
                )
                try:
                    par = _run(
                        tmp,
                        f"{layout}_{zerokld}",
                        ckpts[arch, dtype],
                        dtype,
                        seqs,
                        lens,
                        nproc,
                        args.repeats,
                        batch_invariant=zerokld,
                        **{**spec, **stock},
                    )
                except LayoutFailed as e:
                    par = {"failed": _failure_line(str(e))}
                row = {
                    "layout": layout,
                    "arch": arch,
                    "dtype": dtype,
                    "engine": "zerokld" if zerokld else "stock",
                    "ranks": nproc,
                }
                if "failed" in par:
                    row["failed"] = par["failed"]
                else:
                    row |= {
                        "one_rank_forward_s": one["forward_s"],
                        "forward_s": par["forward_s"],
                        "one_rank_step_s": one["step_s"],
                        "step_s": par["step_s"],
                        "forward_speed_vs_one_rank": one["forward_s"] / par["forward_s"],
                        "step_speed_vs_one_rank": None if par["step_s"] is None else one["step_s"] / par["step_s"],
                        "logprobs_equal_one_rank": bool(
                            torch.equal(torch.cat(one["logprobs"]), torch.cat(par["logprobs"]))
                        ),
                    }
                print(json.dumps(row), flush=True)
                rows.append(row)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine_facts(),
        "dtype": args.dtype,
        "workload": f"{args.batch} sequences of {args.seq_len} tokens, {args.dtype}, Qwen3 hidden {args.hidden} "
        f"x {args.layers} layers (MoE: 8 experts top-2), forward medians of {args.repeats - 1} "
        "timed runs after one, one RL step (pp2: float32, 1F1B, 4 micro-batches of 2; dp2, fsdp2xtp2: float32)",
        "rows": rows,
    }
    out = Path(args.out)
    for row in rows:
        row["date"] = result["date"]
    if args.merge and out.exists():  # the other layouts' rows as measured before (their dates kept)
        old = json.loads(out.read_text())
        same_machine = all(old["machine"].get(k) == result["machine"].get(k) for k in MERGE_MACHINE_KEYS)
        if not same_machine or old.get("workload") != result["workload"]:
            raise SystemExit(f"--merge: {out} was measured on another machine or workload")
        redone = {r["layout"] for r in rows}
        kept = [dict(r, date=r.get("date", old["date"])) for r in old["rows"] if r["layout"] not in redone]
        result["rows"] = kept + rows
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    return result


if __name__ == "__main__":
    main()
