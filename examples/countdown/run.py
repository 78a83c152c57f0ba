"""GRPO on the countdown task, twice side by side: ``--runs zerokld`` (batch-invariant numerics on both sides) and
``--runs stock``.

One command (``python -m examples.countdown.run``, or ``make demo``) builds a tiny Qwen3 checkpoint, warm-starts it with
SFT on solver answers (TorchTitan trainer, shared by both runs), then for each numerics mode runs GRPO with rollouts
from a real vLLM engine (plugin on / off) and training in TorchTitan's ``Trainer`` (zerokld overrides on / stock
components).

Defaults (chosen so that RL visibly learns on 2 CPU cores in a few minutes; measured in docs/demo.md): countdown with 2
numbers in 1..10 and targets built with ``+ - *``, an easy countdown where this 4-layer, hidden-128, character-level
model learns within minutes (``--numbers 3,4 --max-number 100 --ops +-*/`` is the public Countdown-Tasks-3to4
difficulty, where this model stayed at ~1.5% correct with a flat reward; with 3 numbers in 1..10 reward rose only 0.14
-> 0.29 in 60 steps); a deliberately short SFT warm start (30 steps x 64 answers: the format and ~25% held-out accuracy,
so RL has something to improve); GRPO 50 steps x 28 prompts x 8 samples at temperature 1.0, PPO clip [0.8, 1.2], Adam lr
1e-3 (2e-3 first collapsed then oscillated; 32 prompts per step learned more, +0.40 reward, but took 9.5-10 minutes
end to end where 28 take 8). 128 held-out problems (never in SFT or RL data) are decoded greedily before RL and every
10 steps.

``--fp8`` serves in FP8 (zerokld: the shared FP8 quantizer on both sides, QAT in the trainer; stock: vLLM's own FP8
against a bf16 trainer). ``--moe`` uses a Qwen3-MoE checkpoint (8 experts, top-2): the zerokld run returns each
rollout's routed experts from vLLM and replays them in the training forward (R3); the stock run is vLLM's FusedMoE
against TorchTitan's own MoE. Outputs under ``--out`` (default ``runs/countdown``): ``{zerokld,stock}/metrics.jsonl``
(one line per RL step), ``{zerokld,stock}/eval.jsonl`` (held-out accuracy), ``summary.md`` (the side-by-side table,
also printed) and ``curves.png``. Runs one engine at a time (2-core machines).

``--async K`` pipelines each run (:mod:`examples.countdown.pipeline`): a rollout thread owns the engine and generates
the next K batches while the trainer trains, loading every new policy version through the hot-load protocol between
two generations; each batch records the version and snapshot identity that sampled it, the PPO ratio is taken
against those sampling log-probs, and the metrics compare them bitwise with the trainer's log-probs under that
same snapshot (``k3``; ``k3_vs_current_policy`` is the policy lag). ``--async 0`` (default) is synchronous RL.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import time
from pathlib import Path

import torch
from tqdm import tqdm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from examples.countdown import served
from examples.countdown.served import stock_fp8_quantization
from examples.countdown.task import Problem, format_prompt, generate_problems, reward
from shared_numerics.linear import gemm_partition
from shared_numerics.machine import ISA_FLAGS, cpu_model, isa_flags, path_switches
from zerokld_testing import TinyModelSpec, make_tiny_checkpoint

MODEL_SPEC = TinyModelSpec(
    family="qwen3",
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=256,
    init_std=0.02,
)

MOE_SPEC = TinyModelSpec(
    family="qwen3_moe",
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=256,
    init_std=0.02,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/countdown", help="output root")
    ap.add_argument(
        "--runs",
        choices=["both", "zerokld", "stock"],
        default="both",
        help="zerokld: vLLM and TorchTitan with batch_invariant on; stock: both off",
    )
    ap.add_argument("--steps", type=int, default=50, help="GRPO steps per run")
    ap.add_argument(
        "--server",
        action="store_true",
        help="roll out from a live `vllm serve` (OpenAI server on loopback, hot-load endpoint) instead of "
        "the offline engine: weights are pushed over HTTP, also while requests are in flight (with "
        "--async), and each response says which tokens each snapshot sampled",
    )
    ap.add_argument(
        "--async",
        dest="async_k",
        type=int,
        default=0,
        metavar="K",
        help="pipelined RL: generate the next K batches while the trainer trains (rollouts at most K "
        "policy versions stale; the PPO ratio is taken against the sampling policy's log-probs); 0: "
        "synchronous",
    )
    ap.add_argument(
        "--tis-cap",
        type=float,
        default=None,
        help="truncated importance sampling: each token's loss "
        "times min(exp(trainer - sampler logprob), CAP) (for stale rollouts with --async)",
    )
    ap.add_argument(
        "--mis",
        default=None,
        metavar="LOW,HIGH",
        help="masked importance sampling: drop tokens whose trainer/sampler probability ratio is outside [LOW, HIGH]",
    )
    ap.add_argument("--prompts-per-step", type=int, default=28)
    ap.add_argument("--group-size", type=int, default=8, help="completions per prompt (GRPO group)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--numbers", default="2", help="how many numbers a problem has (one of these, uniformly)")
    ap.add_argument("--max-number", type=int, default=10, help="numbers are drawn from 1..max-number")
    ap.add_argument("--ops", default="+-*", help="operators the generator builds targets with")
    ap.add_argument(
        "--eval-size",
        type=int,
        default=128,
        help="held-out problems (never trained on), scored greedily before RL and every --eval-every steps",
    )
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--sft-steps", type=int, default=30)
    ap.add_argument("--sft-batch", type=int, default=64)
    ap.add_argument("--sft-lr", type=float, default=3e-3)
    ap.add_argument("--lr", type=float, default=1e-3, help="GRPO learning rate")
    ap.add_argument(
        "--loss-fn",
        default="ppo",
        help="a loss registered through the zerokld plugin hooks (python -m zerokld_plugins lists them)",
    )
    ap.add_argument(
        "--fused",
        action="store_true",
        help="fused lm_head log-probs in the zerokld trainer (no [tokens, vocab] logits)",
    )
    ap.add_argument("--clip-low", type=float, default=0.8)
    ap.add_argument("--clip-high", type=float, default=1.2)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--full-every",
        type=int,
        default=10,
        help="weight sync: a full snapshot every N steps, arc_v2 incremental snapshots in between",
    )
    ap.add_argument(
        "--keep-snapshots",
        action="store_true",
        help="keep every shipped snapshot under <out>/<run>/sync/snapshots (benchmarks/delta.py reads them)",
    )
    ap.add_argument(
        "--fp8",
        choices=["per_channel", "block"],
        default=None,
        help="serve in FP8. zerokld: vLLM quantizes online with shared_numerics.fp8 and the trainer runs "
        "FP8 QAT with the same math; stock: vLLM's own online FP8 (quantization=fp8_per_channel / "
        "fp8_per_block) and a high-precision trainer. On CPUs without AMX-FP8, vLLM runs per-channel "
        "through torch._scaled_mm (~20x slower than bf16 here) and per-block as W8A16 "
        "(CPUFp8BlockScaledMMKernel, bf16 speed)",
    )
    ap.add_argument(
        "--lora",
        type=int,
        default=0,
        metavar="RANK",
        help="GRPO on LoRA adapters of this rank (alpha = 2 x rank; q/k/v/o and MLP) over the frozen SFT "
        "model, vLLM serving each step's adapter (enable_lora); 0: full-parameter",
    )
    ap.add_argument(
        "--moe",
        action="store_true",
        help="Qwen3-MoE checkpoint; the zerokld run replays the rollout's "
        "routed experts in training (routing replay, R3)",
    )
    ap.add_argument(
        "--no-routing-replay",
        action="store_true",
        help="with --moe: recompute top-k in training instead of replaying the rollout's routes",
    )
    args = ap.parse_args(argv)
    if args.lora and (args.server or args.async_k or args.moe or args.fp8):
        ap.error(
            "--lora runs synchronously on the offline engine, dense bf16/fp32: without --server, --async, --moe "
            "and --fp8"
        )
    if args.server and args.moe:
        ap.error("--server with --moe: the example replays routed experts from the offline engine only")
    if args.moe and args.fp8:
        ap.error("--moe with --fp8: zerokld serves MoE experts in bf16/fp32 only")
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


def evaluate(engine, problems: list[Problem], tok: Tok, max_tokens: int) -> dict:
    """Greedy decoding on ``problems`` (an :mod:`examples.countdown.served` engine): ``accuracy`` (share with reward
    1.0) and ``reward_mean``."""
    comps = engine.greedy([tok.prompt(p) for p in problems], max_tokens)
    rewards = [reward(tok.decode(c), p) for c, p in zip(comps, problems, strict=True)]
    return {"accuracy": sum(r == 1.0 for r in rewards) / len(rewards), "reward_mean": sum(rewards) / len(rewards)}


def sft_warm_start(base: Path, out: Path, args, tok: Tok) -> Path:
    """Supervised warm start on solver answers (advantage-1 on-policy steps = token-mean cross-entropy)."""
    from shared_numerics.rollout import RolloutBatch
    from titan_plugin.rl import RLTrainer, rl_trainer_config

    trainer = RLTrainer(
        rl_trainer_config(str(base), str(out / "sft_dump"), dtype=args.dtype, lr=args.sft_lr, loss_fn="cross_entropy")
    )
    problems = task_problems(
        args,
        max(args.sft_steps * args.sft_batch // 4, args.sft_batch),
        seed=args.seed + 1000,
        exclude=held_out(eval_problems(args)),
    )
    rng = random.Random(args.seed)
    try:
        for _ in tqdm(range(args.sft_steps), desc="SFT warm start", unit="step"):
            batch = rng.sample(problems, args.sft_batch)
            seqs = [tok.prompt(p) + tok.answer(p) for p in batch]
            trainer.rl_step(RolloutBatch(seqs, [len(tok.prompt(p)) for p in batch], [1.0] * len(batch)))
        return trainer.save_hf(out / "sft", args.dtype)
    finally:
        trainer.close()


def corrections(args) -> dict:
    """``RLLoss`` corrections from ``--tis-cap`` / ``--mis`` (:class:`shared_numerics.losses.CorrectionConfig`)."""
    out = {} if args.tis_cap is None else {"tis_cap": args.tis_cap}
    if args.mis:
        low, high = (float(x) for x in args.mis.split(","))
        out.update(mis_low=low, mis_high=high)
    return out


def loss_fn_config(args) -> dict:
    """``loss_fn_config`` for the chosen loss: clip thresholds for ``ppo``, nothing otherwise."""
    return {"clip_low_threshold": args.clip_low, "clip_high_threshold": args.clip_high} if args.loss_fn == "ppo" else {}


def engine_lora_rank(rank: int) -> int:
    """vLLM's ``max_lora_rank`` for an adapter of ``rank``: the smallest value vLLM accepts
    (``vllm.config.lora.MaxLoRARanks``) that holds it; the trainer pads its adapters to the same rank."""
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    fits = [r for r in get_args(MaxLoRARanks) if r >= rank]
    if not fits:
        raise ValueError(f"LoRA rank {rank} exceeds vLLM's largest max_lora_rank {max(get_args(MaxLoRARanks))}")
    return min(fits)


def run_rl(numerics: str, init: Path, out: Path, args, tok: Tok) -> Path:
    """One GRPO run (synchronous, or pipelined with ``--async K``; offline engine, or ``vllm serve`` with
    ``--server``); returns the metrics.jsonl path."""
    from examples.countdown.served import OfflineEngine, ServedEngine
    from examples.countdown.sync import AdapterSync, DeltaSync
    from titan_plugin.lora import lora_converter_config
    from titan_plugin.rl import RLTrainer, numerics_mode, rl_trainer_config
    from vllm_plugin.engines import shutdown_llm, start_llm

    zk = numerics == "zerokld"
    run_dir = out / numerics
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics_path = run_dir / "metrics.jsonl"
    metrics_path.write_text("")
    replay = args.moe and zk and not args.no_routing_replay
    config = rl_trainer_config(
        str(init),
        str(run_dir / "dump"),
        dtype=args.dtype,
        lr=args.lr,
        batch_invariant=zk,
        loss_fn=args.loss_fn,
        loss_fn_config=loss_fn_config(args),
        fused=args.fused and zk,
        fp8=args.fp8 if zk else None,
        corrections=corrections(args),
        lora=lora_converter_config(rank=args.lora, alpha=2.0 * args.lora, max_rank=engine_lora_rank(args.lora))
        if args.lora
        else None,
    )
    sync_kw = dict(full_every=args.full_every, keep_snapshots=args.keep_snapshots, numerics=numerics_mode(config))
    if args.server:
        sync = DeltaSync(run_dir / "sync", args.dtype, init, **sync_kw)
        engine = ServedEngine(init, args.dtype, zk, sync, run_dir / "server.log", seed=args.seed, fp8=args.fp8)
        stop_engine = engine.stop
    else:
        engine_kw = {}
        if args.fp8:
            engine_kw = {"fp8": args.fp8} if zk else {"quantization": stock_fp8_quantization(args.fp8)}
        if replay:
            engine_kw["enable_return_routed_experts"] = True
        if args.lora:
            engine_kw.update(enable_lora=True, max_loras=1, max_lora_rank=engine_lora_rank(args.lora))
        llm = start_llm(str(init), dtype=args.dtype, batch_invariant=zk, max_model_len=256, seed=args.seed, **engine_kw)
        sync = (
            AdapterSync(run_dir / "adapters", args.dtype, init, llm, **sync_kw)
            if args.lora
            else DeltaSync(run_dir / "sync", args.dtype, init, llm, **sync_kw)
        )
        engine = OfflineEngine(llm, sync)
        stop_engine = lambda: shutdown_llm(llm)
    trainer = None
    try:
        trainer = RLTrainer(config)
        _rl_loop(trainer, engine, sync, init, run_dir, args, tok, replay)
    finally:
        if trainer is not None:
            trainer.close()
        stop_engine()
    return metrics_path


def _rl_loop(trainer, engine, sync, init: Path, run_dir: Path, args, tok: Tok, replay: bool) -> None:
    """The GRPO steps of :func:`run_rl` (metrics rows, held-out evaluations), with the rollout worker."""
    from examples.countdown.pipeline import RolloutWorker

    metrics_path = run_dir / "metrics.jsonl"
    held = eval_problems(args)
    problems = task_problems(args, args.steps * args.prompts_per_step, seed=args.seed + 7, exclude=held_out(held))
    eval_path = run_dir / "eval.jsonl"
    eval_path.write_text("")

    def groups(step: int) -> list[Problem]:
        batch = problems[(step - 1) * args.prompts_per_step : step * args.prompts_per_step]
        return [p for p in batch for _ in range(args.group_size)]

    def evaluate_version(version: int) -> None:
        if version % args.eval_every == 0 or version == args.steps:
            with eval_path.open("a") as f:
                f.write(json.dumps({"step": version, **evaluate(engine, held, tok, args.max_tokens)}) + "\n")

    def generate(step: int):
        return engine.sample([tok.prompt(p) for p in groups(step)], args.max_tokens, routed_experts=replay)

    evaluate_version(0)
    if args.server:  # the trainer pushes (HTTP, while requests are in flight) and evaluates; the worker only gates
        worker = RolloutWorker(args.steps, args.async_k, generate, lambda version, weights: {})
    else:  # the worker owns the engine: it loads each version between two generate calls, and evaluates
        worker = RolloutWorker(
            args.steps, args.async_k, generate, lambda version, weights: sync.push(weights, version), evaluate_version
        )
    zk = trainer.numerics.batch_invariant
    scorer = SnapshotScorer(init, run_dir / "versions", args, zk, replay, keep=args.async_k + 2)
    rows: list[dict] = []  # written once the engine has loaded the step's weights (the row carries the sync stats)

    def flush(final: bool = False) -> None:
        while rows and (final or rows[0]["step"] in worker.loaded):
            row = rows.pop(0)
            with metrics_path.open("a") as f:
                f.write(json.dumps({**row, **worker.loaded.get(row["step"], {})}) + "\n")

    worker.start()
    t_start = time.perf_counter()
    try:
        bar = tqdm(
            range(1, args.steps + 1),
            desc=f"GRPO [{run_dir.name}]" + (f" async {args.async_k}" if args.async_k else ""),
            unit="step",
        )
        for step in bar:
            t0 = time.perf_counter()
            gen = worker.next_batch()
            t_wait = time.perf_counter() - t0
            row = train_step(trainer, gen, groups(step), tok, args, scorer, step, sync.versions)
            scorer.keep_version(step, trainer.hf_weights(args.dtype))
            if args.server:
                row.update(sync.push(scorer.weights(step), step))
                evaluate_version(step)
            worker.publish(step, sync.write(trainer, step) if args.lora else scorer.weights(step))
            row.update(
                {
                    "rollout_wait_seconds": t_wait,
                    "step_seconds": time.perf_counter() - t0,
                    "elapsed_seconds": time.perf_counter() - t_start,
                }
            )
            rows.append(row)
            flush()
            bar.set_postfix(
                reward=f"{row['reward_mean']:.3f}",
                k3=f"{row['k3']:.2e}",
                diff_tok=row["tokens_bitwise_different"],
                stale=row["staleness"],
            )
        worker.join()
        if worker.error is not None:
            raise RuntimeError("the rollout worker failed") from worker.error
        flush(final=True)
    finally:
        worker.stop()
        worker.join(timeout=600)
        scorer.close()


class SnapshotScorer:
    """The trainer's log-probs under the policy version that produced a batch: the last ``keep`` versions' weights
    are kept (in memory, and as HF snapshot directories when a stale batch needs scoring) and scored with
    :func:`titan_plugin.trainer_logprobs` (the run's numerics: zerokld or stock components)."""

    def __init__(self, init: Path, root: Path, args, zk: bool, replay: bool, keep: int) -> None:
        self.init, self.root, self.args, self.zk, self.replay, self.keep = init, root, args, zk, replay, keep
        self._weights: dict[int, dict] = {}

    def keep_version(self, version: int, weights: dict) -> None:
        self._weights[version] = weights
        for v in [v for v in self._weights if v <= version - self.keep]:
            del self._weights[v]
            shutil.rmtree(self.root / f"v{v:05d}", ignore_errors=True)

    def weights(self, version: int) -> dict:
        return self._weights[version]

    def logprobs(self, version: int, rollouts) -> list:
        from deltasync import write_full_snapshot
        from titan_plugin import trainer_logprobs

        d = self.root / f"v{version:05d}"
        src = (
            self.init
            if version == 0
            else (d if d.exists() else write_full_snapshot(self._weights[version], self.init, d))
        )
        return trainer_logprobs(
            str(src),
            rollouts.sequences,
            rollouts.prompt_lengths,
            dtype=self.args.dtype,
            fp8=self.args.fp8 if self.zk else None,
            batch_invariant=self.zk,
            routed_experts=rollouts.routed_experts if self.replay else None,
        )

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def train_step(
    trainer, gen, group: list[Problem], tok: Tok, args, scorer: SnapshotScorer, step: int, versions: dict[str, int]
) -> dict:
    """One GRPO step on a generated batch; the metrics row.

    ``k1``/``k3``/``tokens_bitwise_different`` compare each token's sampler log-prob with the trainer's under the
    snapshot that sampled that token (``gen.spans``; ``versions`` maps identities to policy versions): the numerics
    gap, 0 for zerokld. ``k3_vs_current_policy`` compares with the trainer's current weights (policy lag, > 0 for
    stale tokens); ``tokens_by_staleness`` counts tokens per versions-behind, ``staleness`` is the largest.

    Raises:
        ValueError: a rollout's spans do not cover its completion.
    """
    import shared_numerics as sn
    from titan_plugin.losses import grpo_advantages

    batch = gen.batch
    comps = [s[p:] for s, p in zip(batch.sequences, batch.prompt_lengths, strict=True)]
    rewards = torch.tensor([reward(tok.decode(c), p) for c, p in zip(comps, group, strict=True)])
    rollouts = dataclasses.replace(batch, advantages=grpo_advantages(rewards, args.group_size).tolist())
    t0 = time.perf_counter()
    res = trainer.rl_step(rollouts)  # refuses rollouts sampled in another numerics mode
    t_train = time.perf_counter() - t0
    spans = [[(versions[identity], a, b) for identity, a, b in sp] for sp in gen.spans]
    for i, (sp, c) in enumerate(zip(spans, comps, strict=True)):
        if [a for _, a, _ in sp] + [len(c)] != [0] + [b for _, _, b in sp]:
            raise ValueError(f"rollout {i}: snapshot spans {sp} do not cover its {len(c)} tokens")
    scored = {
        v: res["train_logprobs"] if v == step - 1 else scorer.logprobs(v, rollouts)
        for v in sorted({v for sp in spans for v, _, _ in sp})
    }
    at_version = [
        torch.cat([scored[v][i][a:b] for v, a, b in sp]) if sp else torch.zeros(0) for i, sp in enumerate(spans)
    ]
    stale: dict[int, int] = {}
    for sp in spans:
        for v, a, b in sp:
            stale[step - 1 - v] = stale.get(step - 1 - v, 0) + b - a
    kl = sn.logprob_diff_metrics(at_version, rollouts.sampler_logprobs, args.clip_low, args.clip_high)
    lag = sn.logprob_diff_metrics(res["train_logprobs"], rollouts.sampler_logprobs)
    return {
        "step": step,
        "reward_mean": rewards.mean().item(),
        "reward_correct_fraction": (rewards == 1.0).float().mean().item(),
        "policy_version": gen.version,
        "snapshot_identities": sorted({identity for sp in gen.spans for identity, _, _ in sp}),
        "staleness": max(stale, default=0),
        "tokens_by_staleness": {str(k): n for k, n in sorted(stale.items())},
        "k1": kl["k1"],
        "k3": kl["k3"],
        "max_abs_logprob_diff": kl["max_abs_logprob_diff"],
        "tokens_bitwise_different": kl["tokens_bitwise_different"],
        "num_tokens": kl["num_tokens"],
        "k3_vs_current_policy": lag["k3"],
        "clipped_fraction": res["clipped"] / max(res["num_tokens"], 1),
        "grad_zeroed_fraction": res["grad_zeroed"] / max(res["num_tokens"], 1),
        "routing_replay": rollouts.routed_experts is not None,
        "rollout_seconds": gen.rollout_seconds,
        "train_seconds": t_train,
    }


def setup_lines(args, init_spec: TinyModelSpec, seconds: float) -> list[str]:
    """The configuration the summary table states (task, model, algorithm, what each run is, the machine)."""
    import platform

    stock = (
        "stock: the same algorithm, data and seeds on vLLM's own kernels (plugin off) and TorchTitan's stock "
        "components (nn.Linear, SDPA attention: TorchTitan's default flex attention has no CPU path"
        + (", TorchTitan's MoE" if args.moe else "")
        + ")"
    )
    zk = (
        'zerokld: vLLM with `additional_config={"zerokld": {"batch_invariant": true}}` + TorchTitan with the '
        "zerokld overrides"
    )
    if args.fp8:
        stock += f"; vLLM serves FP8 (`quantization={stock_fp8_quantization(args.fp8)}`) against a {args.dtype} trainer"
        zk += f"; vLLM serves FP8 ({args.fp8}, shared quantizer) against FP8 QAT in the trainer"
    if args.moe:
        zk += "; routed experts replayed in training (R3)" if not args.no_routing_replay else "; top-k recomputed"
    if args.lora:
        stock += "; TorchTitan's own LoRAConverter, vLLM's punica LoRA kernels"
        zk += "; LoRA projections on shared_numerics.lora_linear (trainer) / add_lora (vLLM)"
    return [
        (
            f"task: countdown, {args.numbers.replace(',', ' or ')} numbers in 1..{args.max_number}, targets built with "
            f"`{args.ops}`; reward 1 for a correct expression, 0.1 for a well-formed wrong one, "
            f"0 without an answer tag; {args.eval_size} held-out problems scored greedily"
        ),
        (
            f"model: tiny {init_spec.family} ({init_spec.num_hidden_layers} layers, hidden {init_spec.hidden_size}, "
            f"character tokenizer), {args.dtype}; SFT warm start {args.sft_steps} steps x "
            f"{args.sft_batch} solver answers (lr {args.sft_lr})"
        ),
        f"GRPO: {args.steps} steps x {args.prompts_per_step} prompts x {args.group_size} samples (temperature 1.0, "
        f"{args.max_tokens} tokens max), loss `{args.loss_fn}` {loss_fn_config(args)}"
        + (f" with corrections {corrections(args)}" if corrections(args) else "")
        + f", lr {args.lr}, "
        + (
            f"LoRA rank {args.lora} (alpha {2 * args.lora}; q/k/v/o and MLP) on the frozen SFT model, each step's "
            "adapter served as a new vLLM LoRARequest"
            if args.lora
            else f"weights synced every step (full every {args.full_every})"
        )
        + (
            f"; pipelined (--async {args.async_k}): the next {args.async_k} batches are generated while the trainer "
            f"trains, rollouts at most {args.async_k} policy versions stale, the PPO ratio against the sampling "
            "policy's log-probs"
            if args.async_k
            else ""
        ),
        zk,
        stock,
        f"machine: {cpu_model()}, {os.cpu_count()} CPU cores (ISA: {', '.join(isa_flags()) or 'none'} of "
        f"{'/'.join(ISA_FLAGS)}), {platform.platform()}, torch {torch.__version__}; zerokld's GEMM path "
        f"`{gemm_partition()}`"
        + (
            f", emulating an older CPU's path ({' '.join(f'{k}={v}' for k, v in path_switches().items())})"
            if path_switches()
            else ""
        )
        + f"; {seconds:.0f} s from SFT to the last step",
        (
            "bit-reproducibility: a rerun gives the same bits on the same CPU ISA, thread counts (torch's and "
            "ZEROKLD_GEMM_THREADS) and package versions "
            "(constraints.txt); on another ISA (e.g. AMX or AVX512-BF16 instead of AVX2) both runs still compare as "
            "above (zerokld: 0 tokens different) but every figure of the trajectory differs"
        ),
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
    skipped = []
    if args.fp8 and "stock" in modes and not served.stock_fp8_available(args.fp8):
        if modes == ["stock"]:
            raise SystemExit(served.STOCK_FP8_UNAVAILABLE)
        modes.remove("stock")
        skipped.append(served.STOCK_FP8_UNAVAILABLE)
        print(skipped[-1])
    for m in modes:
        run_rl(m, init, out, args, tok)
    from examples.countdown.plots import plot_curves
    from examples.countdown.summary import write_summary

    png = plot_curves({m: out / m for m in modes}, out / "curves.png")
    path, text = write_summary(out, modes, setup_lines(args, spec, time.perf_counter() - t0) + skipped)
    print(text)
    print(f"wrote {path}, {png} and {', '.join(str(out / m / 'metrics.jsonl') for m in modes)}")


if __name__ == "__main__":
    main()
