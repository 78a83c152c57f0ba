"""Exact streaming accumulation vs TorchTitan's batched ``train_step``, side by side in one run.

One GRPO batch (``--groups`` prompt groups of ``--group-size`` completions; prompt ``--prompt`` tokens, completions of
``--min-completion``..``--max-completion`` tokens, random token ids, on-policy PPO) on the trainer benchmark's model
(:func:`benchmarks.trainer.realistic_spec`: hidden ``--hidden``, ``--layers`` layers, ``hidden / 64`` heads of dim
64, ``hidden / 256`` KV heads, FFN ``3 x hidden``, vocabulary 32,768), one :class:`titan_plugin.rl.RLTrainer`
(TorchTitan, FSDP on one process, learning rate 0 so every step sees the same weights). Per dtype, each timed
``--repeats`` times after a warm-up, medians in seconds:

* ``rl_step``: TorchTitan's ``train_step`` on the whole batch (one batched forward and backward, optimizer step) —
  the reference: no exactness across groupings;
* ``streamed``: ``forward_backward`` once per prompt group as the groups arrive, then ``optim_step`` — exact
  (the same ``.grad`` bits as one call on the whole batch: checked every run);
* ``one_call``: ``forward_backward`` on the whole batch, then ``optim_step``;
* ``one_rollout_at_a_time`` (one run): the general exact way (``exact_accumulation`` off), for contrast.

``--stock``: also TorchTitan stock's ``train_step`` (``nn.Linear``, SDPA, its own LoRA / MoE; ``--repeats`` times) on
the same batch: ``rl_step_over_stock_rl_step`` and ``streamed_over_stock_rl_step`` are the speed tax of the zerokld
step and of exact streaming against it. (TorchTitan's float32 MoE at hidden 1024 did not fit in 24 GiB here.)

``--lora-rank R``: the same with LoRA adapters (rank ``R``, alpha ``R``) on every projection of a frozen base
(Tinker's LoRA training); ``--fp8 per_channel``: FP8 QAT projections; ``--moe-experts E``: a Qwen3-MoE of ``E``
experts (top-2, each expert's FFN ``hidden`` wide) in every layer.

``streamed_over_rl_step = rl_step_s / streamed_s`` is the throughput of exact streaming relative to the batched step
(the issue's target: >= 0.8). The JSON records the machine (CPU model, ISA flags, threads) and which way
``forward_backward`` took (``exact_accumulation``). Usage:
``python -m benchmarks.streaming --out benchmarks/results/streaming_h1024_xeon_amx_cpu2.json``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from shared_numerics.machine import machine_facts


def _batch(args, numerics):
    from shared_numerics.rollout import RolloutBatch

    rng = random.Random(0)
    n = args.groups * args.group_size
    seqs = [
        [1]
        + [
            rng.randrange(3, 90)
            for _ in range(args.prompt - 1 + rng.randrange(args.min_completion, args.max_completion + 1))
        ]
        for _ in range(n)
    ]
    return RolloutBatch(seqs, [args.prompt] * n, [rng.uniform(-1, 1) for _ in range(n)], numerics=numerics)


def _grads(trainer) -> dict[str, torch.Tensor]:
    return {
        n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
        for n, p in trainer.model.named_parameters()
        if p.grad is not None
    }


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_dtype(args, dtype: str, root: Path) -> dict:
    from benchmarks.trainer import realistic_spec
    from titan_plugin.lora import lora_converter_config
    from titan_plugin.rl import RLTrainer, rl_trainer_config
    from zerokld_testing import make_tiny_checkpoint

    spec = realistic_spec(args.hidden, args.layers, args.prompt + args.max_completion + 32)
    name = f"streaming_model_{args.hidden}_{dtype}"
    if args.moe_experts:  # every MLP an MoE of that many experts, top-2, each expert's FFN hidden wide
        spec = dataclasses.replace(
            spec,
            family="qwen3_moe",
            num_experts=args.moe_experts,
            num_experts_per_tok=2,
            moe_intermediate_size=args.hidden,
        )
        name += f"_moe{args.moe_experts}"
    ckpt = make_tiny_checkpoint(Path("runs/bench") / name, spec, seed=0, dtype=dtype)
    lora = lora_converter_config(rank=args.lora_rank, alpha=args.lora_rank) if args.lora_rank else None
    trainer = RLTrainer(
        rl_trainer_config(str(ckpt), str(root / f"dump_{dtype}"), dtype=dtype, lr=0.0, lora=lora, fp8=args.fp8)
    )
    try:
        batch = _batch(args, trainer.numerics)
        groups = [batch.select(range(s, s + args.group_size)) for s in range(0, len(batch), args.group_size)]

        def streamed():
            for g in groups:
                trainer.forward_backward(g)
            grads = _grads(trainer)
            trainer.optim_step()
            return grads

        def one_call():
            trainer.forward_backward(batch)
            grads = _grads(trainer)
            trainer.optim_step()
            return grads

        ref = one_call()  # warm-up (kernels build on first use) and the reference gradients
        trainer.rl_step(batch)
        times: dict[str, list[float]] = {"rl_step": [], "streamed": [], "one_call": []}
        bitwise = True
        for _ in range(args.repeats):
            times["rl_step"].append(_timed(lambda: trainer.rl_step(batch)))
            out = {}
            times["streamed"].append(_timed(lambda: out.update(g=streamed())))
            bitwise &= out["g"].keys() == ref.keys() and all(torch.equal(out["g"][k], ref[k]) for k in ref)
            times["one_call"].append(_timed(one_call))
        way = "batched chains" if trainer.exact_accumulation is not None else "one rollout at a time"
        off = trainer.exact_accumulation_off
        trainer.exact_accumulation = None
        per_rollout = _timed(one_call)
    finally:
        trainer.close()
    if args.stock:  # TorchTitan stock (nn.Linear, SDPA; stock LoRA / MoE), its train_step on the same batch
        trainer = RLTrainer(
            rl_trainer_config(
                str(ckpt),
                str(root / f"stock_{dtype}"),
                dtype=dtype,
                lr=0.0,
                lora=lora,
                batch_invariant=False,
                fused=False,
            )
        )
        try:
            trainer.rl_step(batch)
            times["stock_rl_step"] = [_timed(lambda: trainer.rl_step(batch)) for _ in range(args.repeats)]
        finally:
            trainer.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "exact_accumulation": way,
        "exact_accumulation_off": off,
        "all_s": times,
        "median_s": med,
        "one_rollout_at_a_time_s": per_rollout,
        "streamed_grads_bitwise_one_call": bitwise,
        "streamed_over_rl_step": med["rl_step"] / med["streamed"],
        "one_call_over_rl_step": med["rl_step"] / med["one_call"],
        "one_rollout_at_a_time_over_rl_step": med["rl_step"] / per_rollout,
        "completion_tokens": sum(len(s) - p for s, p in zip(batch.sequences, batch.prompt_lengths, strict=True)),
    }
    if args.stock:
        result["rl_step_over_stock_rl_step"] = med["stock_rl_step"] / med["rl_step"]
        result["streamed_over_stock_rl_step"] = med["stock_rl_step"] / med["streamed"]
    print(
        f"{dtype}: rl_step {med['rl_step']:.3f} s, streamed {med['streamed']:.3f} s "
        f"({result['streamed_over_rl_step']:.2f}x), one call {med['one_call']:.3f} s, one rollout at a time "
        f"{per_rollout:.3f} s; {way}; streamed == one call: {bitwise}"
        + (f"; stock rl_step {med['stock_rl_step']:.3f} s" if args.stock else ""),
        flush=True,
    )
    return result


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/bench/streaming.json")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--min-completion", type=int, default=32)
    ap.add_argument("--max-completion", type=int, default=192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="train LoRA adapters of this rank (alpha = rank) on every projection; 0: all parameters",
    )
    ap.add_argument("--fp8", default=None, help="FP8 QAT of the decoder projections: per_channel or block")
    ap.add_argument(
        "--stock",
        action="store_true",
        help="also time TorchTitan stock's train_step on the batch (not with --fp8: zerokld only)",
    )
    ap.add_argument(
        "--moe-experts",
        type=int,
        default=0,
        help="Qwen3-MoE: every MLP this many experts (top-2, each FFN hidden wide); 0: dense",
    )
    args = ap.parse_args(argv)
    if args.stock and args.fp8:
        ap.error("--stock with --fp8: TorchTitan stock has no FP8 QAT of zerokld's quantizer to compare with")
    result = {"machine": machine_facts(), "args": vars(args), "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in args.dtypes.split(","):
            result["runs"][dtype] = run_dtype(args, dtype, Path(tmp))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
