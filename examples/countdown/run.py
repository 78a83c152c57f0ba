"""GRPO on the countdown task, twice side by side: ``--runs zerokld`` (batch-invariant numerics on both sides) and
``--runs stock``.

One command (``python -m examples.countdown.run``, or ``make demo``) builds a tiny Qwen3 checkpoint, warm-starts it with
SFT on solver answers (TorchTitan trainer, shared by both runs), then for each numerics mode runs GRPO with rollouts from
a real vLLM engine (plugin on / off) and training in TorchTitan's ``Trainer`` (zerokld overrides on / stock components).

Defaults (chosen so that RL visibly learns on 2 CPU cores in a few minutes; measured in README): countdown with 2
numbers in 1..10 and targets built with ``+ - *``, an easy countdown where this 4-layer, hidden-128, character-level
model learns within minutes (``--numbers 3,4 --max-number 100 --ops +-*/`` is the public Countdown-Tasks-3to4
difficulty, where this model stayed at ~1.5% correct with a flat reward; with 3 numbers in 1..10 reward rose only 0.14
-> 0.29 in 60 steps); a deliberately short SFT warm start (30 steps x 64 answers: the format and ~25% held-out accuracy,
so RL has something to improve); GRPO 50 steps x 32 prompts x 8 samples at temperature 1.0, PPO clip [0.8, 1.2], Adam lr
1e-3 (2e-3 first collapsed then oscillated). 128 held-out problems (never in SFT or RL data) are decoded greedily before
RL and every 10 steps.

``--fp8`` serves in FP8 (zerokld: the shared FP8 quantizer on both sides, QAT in the trainer; stock: vLLM's own FP8
against a bf16 trainer). ``--moe`` uses a Qwen3-MoE checkpoint (8 experts, top-2): the zerokld run returns each
rollout's routed experts from vLLM and replays them in the training forward (R3); the stock run is vLLM's FusedMoE
against TorchTitan's own MoE. Outputs under ``--out`` (default ``runs/countdown``): ``{zerokld,stock}/metrics.jsonl``
(one line per RL step), ``{zerokld,stock}/eval.jsonl`` (held-out accuracy), ``summary.md`` (the side-by-side table,
also printed) and ``curves.png``. Runs one engine at a time (2-core machines).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

import torch
from tqdm import tqdm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from examples.countdown.task import Problem, format_prompt, generate_problems, reward  # noqa: E402
from zerokld_testing import TinyModelSpec, make_tiny_checkpoint  # noqa: E402

MODEL_SPEC = TinyModelSpec(family="qwen3", hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                           init_std=0.02)

MOE_SPEC = TinyModelSpec(family="qwen3_moe", hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, max_position_embeddings=256, init_std=0.02,
                         num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/countdown", help="output root")
    ap.add_argument("--runs", choices=["both", "zerokld", "stock"], default="both",
                    help="zerokld: vLLM and TorchTitan with batch_invariant on; stock: both off")
    ap.add_argument("--steps", type=int, default=50, help="GRPO steps per run")
    ap.add_argument("--prompts-per-step", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=8, help="completions per prompt (GRPO group)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--numbers", default="2", help="how many numbers a problem has (one of these, uniformly)")
    ap.add_argument("--max-number", type=int, default=10, help="numbers are drawn from 1..max-number")
    ap.add_argument("--ops", default="+-*", help="operators the generator builds targets with")
    ap.add_argument("--eval-size", type=int, default=128, help="held-out problems (never trained on), scored "
                    "greedily before RL and every --eval-every steps")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--sft-steps", type=int, default=30)
    ap.add_argument("--sft-batch", type=int, default=64)
    ap.add_argument("--sft-lr", type=float, default=3e-3)
    ap.add_argument("--lr", type=float, default=1e-3, help="GRPO learning rate")
    ap.add_argument("--loss-fn", default="ppo", help="a loss registered through the zerokld plugin hooks "
                    "(python -m zerokld_plugins lists them)")
    ap.add_argument("--fused", action="store_true", help="fused lm_head log-probs in the zerokld trainer (no "
                    "[tokens, vocab] logits)")
    ap.add_argument("--clip-low", type=float, default=0.8)
    ap.add_argument("--clip-high", type=float, default=1.2)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--full-every", type=int, default=10, help="weight sync: a full snapshot every N steps, arc_v2 "
                    "incremental snapshots in between")
    ap.add_argument("--keep-snapshots", action="store_true", help="keep every shipped snapshot under "
                    "<out>/<run>/sync/snapshots (benchmarks/delta.py reads them)")
    ap.add_argument("--fp8", choices=["per_channel", "block"], default=None,
                    help="serve in FP8. zerokld: vLLM quantizes online with shared_numerics.fp8 and the trainer runs "
                    "FP8 QAT with the same math; stock: vLLM's own FP8 (quantization=fp8_per_channel) and a "
                    "high-precision trainer (per_channel only)")
    ap.add_argument("--moe", action="store_true", help="Qwen3-MoE checkpoint; the zerokld run replays the rollout's "
                    "routed experts in training (routing replay, R3)")
    ap.add_argument("--no-routing-replay", action="store_true", help="with --moe: recompute top-k in training "
                    "instead of replaying the rollout's routes")
    args = ap.parse_args(argv)
    if args.moe and args.fp8:
        ap.error("--moe with --fp8: zerokld serves MoE experts in bf16/fp32 only")
    if args.fp8 == "block" and args.runs != "zerokld":
        ap.error("--fp8 block: vLLM-CPU has no stock per-block FP8 to compare with; add --runs zerokld")
    return args


class Tok:
    """Character-level encode/decode with the checkpoint's own tokenizer (``tokenizers``)."""

    def __init__(self, ckpt: Path) -> None:
        from tokenizers import Tokenizer

        self.tk = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
        self.bos, self.eos = self.tk.token_to_id("<|bos|>"), self.tk.token_to_id("<|eos|>")

    def prompt(self, p: Problem) -> list[int]:
        return [self.bos] + self.tk.encode(format_prompt(p), add_special_tokens=False).ids

    def answer(self, p: Problem) -> list[int]:
        return self.tk.encode(f"<answer>{p.solution}</answer>", add_special_tokens=False).ids + [self.eos]

    def decode(self, ids: list[int]) -> str:
        return self.tk.decode(ids, skip_special_tokens=False)


def task_problems(args, n: int, seed: int, exclude=frozenset()) -> list[Problem]:
    """``n`` problems of the configured difficulty (``--numbers``, ``--max-number``, ``--ops``)."""
    counts = tuple(int(x) for x in args.numbers.split(","))
    return generate_problems(n, seed=seed, max_number=args.max_number, counts=counts, ops=args.ops, exclude=exclude)


def eval_problems(args) -> list[Problem]:
    """The held-out set: its (numbers, target) pairs never appear in SFT or RL data."""
    return task_problems(args, args.eval_size, seed=args.seed + 99)


def held_out(problems: list[Problem]) -> frozenset:
    """The ``(numbers, target)`` pairs of ``problems`` (what ``generate_problems(exclude=...)`` takes)."""
    return frozenset((p.numbers, p.target) for p in problems)


def evaluate(llm, problems: list[Problem], tok: Tok, max_tokens: int) -> dict:
    """Greedy decoding on ``problems``: ``accuracy`` (share with reward 1.0) and ``reward_mean``."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    outs = llm.generate([{"prompt_token_ids": tok.prompt(p)} for p in problems], sp, use_tqdm=False)
    rewards = [reward(tok.decode(list(o.outputs[0].token_ids)), p) for o, p in zip(outs, problems)]
    return {"accuracy": sum(r == 1.0 for r in rewards) / len(rewards), "reward_mean": sum(rewards) / len(rewards)}


def sft_warm_start(base: Path, out: Path, args, tok: Tok) -> Path:
    """Supervised warm start on solver answers (advantage-1 on-policy steps = token-mean cross-entropy)."""
    from shared_numerics.rollout import RolloutBatch
    from titan_plugin.rl import RLTrainer, rl_trainer_config

    trainer = RLTrainer(rl_trainer_config(str(base), str(out / "sft_dump"), dtype=args.dtype, lr=args.sft_lr,
                                          loss_fn="cross_entropy"))
    problems = task_problems(args, max(args.sft_steps * args.sft_batch // 4, args.sft_batch), seed=args.seed + 1000,
                             exclude=held_out(eval_problems(args)))
    rng = random.Random(args.seed)
    try:
        for _ in tqdm(range(args.sft_steps), desc="SFT warm start", unit="step"):
            batch = rng.sample(problems, args.sft_batch)
            seqs = [tok.prompt(p) + tok.answer(p) for p in batch]
            trainer.rl_step(RolloutBatch(seqs, [len(tok.prompt(p)) for p in batch], [1.0] * len(batch)))
        return trainer.save_hf(out / "sft", args.dtype)
    finally:
        trainer.close()


def loss_fn_config(args) -> dict:
    """``loss_fn_config`` for the chosen loss: clip thresholds for ``ppo``, nothing otherwise."""
    return ({"clip_low_threshold": args.clip_low, "clip_high_threshold": args.clip_high} if args.loss_fn == "ppo"
            else {})


def run_rl(numerics: str, init: Path, out: Path, args, tok: Tok) -> Path:
    """One GRPO run; returns the metrics.jsonl path."""
    from vllm import SamplingParams

    import shared_numerics as sn
    from examples.countdown.sync import DeltaSync
    from shared_numerics.rollout import RolloutBatch
    from titan_plugin.losses import grpo_advantages
    from titan_plugin.rl import RLTrainer, rl_trainer_config
    from zerokld_testing.engines import shutdown_llm, start_llm

    zk = numerics == "zerokld"
    run_dir = out / numerics
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics_path = run_dir / "metrics.jsonl"
    metrics_path.write_text("")
    engine_kw = ({"fp8": args.fp8} if zk else {"quantization": "fp8_per_channel"}) if args.fp8 else {}
    replay = args.moe and zk and not args.no_routing_replay
    if replay:
        engine_kw["enable_return_routed_experts"] = True
    llm = start_llm(str(init), dtype=args.dtype, batch_invariant=zk, max_model_len=256, seed=args.seed, **engine_kw)
    trainer = RLTrainer(rl_trainer_config(str(init), str(run_dir / "dump"), dtype=args.dtype, lr=args.lr,
                                          batch_invariant=zk, loss_fn=args.loss_fn,
                                          loss_fn_config=loss_fn_config(args), fused=args.fused and zk,
                                          fp8=args.fp8 if zk else None))
    sync = DeltaSync(run_dir / "sync", args.dtype, init, llm, full_every=args.full_every,
                     keep_snapshots=args.keep_snapshots, numerics=trainer.numerics)
    held = eval_problems(args)
    problems = task_problems(args, args.steps * args.prompts_per_step, seed=args.seed + 7, exclude=held_out(held))
    eval_path = run_dir / "eval.jsonl"
    eval_path.write_text(json.dumps({"step": 0, **evaluate(llm, held, tok, args.max_tokens)}) + "\n")
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, logprobs=0)
    try:
        bar = tqdm(range(1, args.steps + 1), desc=f"GRPO [{numerics}]", unit="step")
        for step in bar:
            t0 = time.perf_counter()
            batch = problems[(step - 1) * args.prompts_per_step: step * args.prompts_per_step]
            group = [p for p in batch for _ in range(args.group_size)]
            prompts = [tok.prompt(p) for p in group]
            outs = llm.generate([{"prompt_token_ids": x} for x in prompts], sp, use_tqdm=False)
            t_roll = time.perf_counter() - t0
            comps = [list(o.outputs[0].token_ids) for o in outs]
            rewards = torch.tensor([reward(tok.decode(c), p) for c, p in zip(comps, group)])
            adv = grpo_advantages(rewards, args.group_size)
            rollouts = RolloutBatch.from_vllm(outs, adv.tolist(), snapshot_identity=sync.identity)
            if not replay:
                rollouts.routed_experts = None
            res = trainer.rl_step(rollouts)  # refuses rollouts sampled in another numerics mode
            sampler_lp = rollouts.sampler_logprobs
            kl = sn.logprob_diff_metrics(res["train_logprobs"], sampler_lp, args.clip_low, args.clip_high)
            t_train = time.perf_counter() - t0 - t_roll
            sync_stats = sync.push(trainer, llm, step)
            row = {
                "step": step,
                "reward_mean": rewards.mean().item(),
                "reward_correct_fraction": (rewards == 1.0).float().mean().item(),
                "k1": kl["k1"],
                "k3": kl["k3"],
                "max_abs_logprob_diff": kl["max_abs_logprob_diff"],
                "tokens_bitwise_different": kl["tokens_bitwise_different"],
                "num_tokens": kl["num_tokens"],
                "clipped_fraction": res["clipped"] / max(res["num_tokens"], 1),
                "grad_zeroed_fraction": res["grad_zeroed"] / max(res["num_tokens"], 1),
                "routing_replay": replay,
                "rollout_seconds": t_roll,
                "train_seconds": t_train,
                **sync_stats,
                "step_seconds": time.perf_counter() - t0,
            }
            with metrics_path.open("a") as f:
                f.write(json.dumps(row) + "\n")
            if step % args.eval_every == 0 or step == args.steps:
                with eval_path.open("a") as f:
                    f.write(json.dumps({"step": step, **evaluate(llm, held, tok, args.max_tokens)}) + "\n")
            bar.set_postfix(reward=f"{row['reward_mean']:.3f}", k3=f"{row['k3']:.2e}",
                            diff_tok=row["tokens_bitwise_different"])
    finally:
        trainer.close()
        shutdown_llm(llm)
    return metrics_path


def setup_lines(args, init_spec: TinyModelSpec, seconds: float) -> list[str]:
    """The configuration the summary table states (task, model, algorithm, what each run is, the machine)."""
    import platform

    stock = ("stock: the same algorithm, data and seeds on vLLM's own kernels (plugin off) and TorchTitan's stock "
             "components (nn.Linear, SDPA attention: TorchTitan's default flex attention has no CPU path"
             + (", TorchTitan's MoE" if args.moe else "") + ")")
    zk = ("zerokld: vLLM with `additional_config={\"zerokld\": {\"batch_invariant\": true}}` + TorchTitan with the "
          "zerokld overrides")
    if args.fp8:
        stock += f"; vLLM serves FP8 (`quantization=fp8_per_channel`) against a {args.dtype} trainer"
        zk += f"; vLLM serves FP8 ({args.fp8}, shared quantizer) against FP8 QAT in the trainer"
    if args.moe:
        zk += "; routed experts replayed in training (R3)" if not args.no_routing_replay else "; top-k recomputed"
    return [
        f"task: countdown, {args.numbers.replace(',', ' or ')} numbers in 1..{args.max_number}, targets built with "
        f"`{args.ops}`; reward 1 for a correct expression, 0.1 for a well-formed wrong one, 0 without an answer tag; "
        f"{args.eval_size} held-out problems scored greedily",
        f"model: tiny {init_spec.family} ({init_spec.num_hidden_layers} layers, hidden {init_spec.hidden_size}, "
        f"character tokenizer), {args.dtype}; SFT warm start {args.sft_steps} steps x {args.sft_batch} solver answers "
        f"(lr {args.sft_lr})",
        f"GRPO: {args.steps} steps x {args.prompts_per_step} prompts x {args.group_size} samples (temperature 1.0, "
        f"{args.max_tokens} tokens max), loss `{args.loss_fn}` {loss_fn_config(args)}, lr {args.lr}, "
        f"weights synced every step (full every {args.full_every})",
        zk, stock,
        f"machine: {os.cpu_count()} CPU cores, {platform.platform()}, torch {torch.__version__}; "
        f"{seconds:.0f} s from SFT to the last step",
    ]


def main(argv=None) -> None:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    spec = MOE_SPEC if args.moe else MODEL_SPEC
    base = make_tiny_checkpoint(out / "base", spec, seed=args.seed, dtype=args.dtype)
    tok = Tok(base)
    t0 = time.perf_counter()
    init = sft_warm_start(base, out, args, tok) if args.sft_steps > 0 else base
    modes = ["zerokld", "stock"] if args.runs == "both" else [args.runs]
    for m in modes:
        run_rl(m, init, out, args, tok)
    from examples.countdown.plots import plot_curves
    from examples.countdown.summary import write_summary

    png = plot_curves({m: out / m for m in modes}, out / "curves.png")
    path, text = write_summary(out, modes, setup_lines(args, spec, time.perf_counter() - t0))
    print(text)
    print(f"wrote {path}, {png} and {', '.join(str(out / m / 'metrics.jsonl') for m in modes)}")


if __name__ == "__main__":
    main()
