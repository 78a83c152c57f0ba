"""Synchronous vs pipelined (``--async K``) vs streaming RL on the countdown model, zerokld numerics, in one run.

Two measurements, written to one JSON (``--out``):

``runs``: the countdown example (:mod:`examples.countdown.run`, ``--runs zerokld``) with ``--async 0`` (sync),
``1`` and ``2``, the same SFT warm start, data and seeds: steps/hour from the RL loop's wall-clock, median seconds
the trainer waited for rollouts and spent training per step, the reward trajectory against wall-clock, held-out
accuracy, k3 against the sampling snapshot (0 for every token, checked) and the share of tokens by staleness.

``streaming``: one GRPO batch (``--prompts`` x ``--group-size`` completions, per-request seeds, so the zerokld
sampler gives the same tokens however the requests are batched), trainer input whole vs streamed:

* whole: generate the whole batch, then one ``RLTrainer.forward_backward`` (first result = last result);
* streamed: a thread generates one prompt group (``--group-size`` completions) per ``generate`` call and the trainer
  runs ``forward_backward`` on each group as it arrives (first result after the first group).

It reports first-result and all-results latency (median of ``--repeats``) and checks that both leave the same
gradient bits. Also ``rl_step`` (TorchTitan's batched ``train_step``) vs ``forward_backward`` (exact accumulation:
batched chains where the kernels cover the model, else one rollout at a time; ``benchmarks/streaming.py`` measures it
at a realistic size) on the same batch: the cost of exact accumulation on this machine.

Writes ``<out>.json``, ``<out>.md`` (the tables) and ``<out>.png`` (reward against wall-clock, sync vs async).

Usage: ``python -m benchmarks.async_rl --out benchmarks/results/async_rl_cpu2.json``; ``--render JSON`` rewrites the
markdown and the plot of an earlier result.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.timing import machine_phrase
from shared_numerics.machine import machine_facts

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def _countdown_runs(root: Path, steps: int, ks: list[int]) -> dict:
    from examples.countdown.run import main
    from examples.countdown.summary import load_jsonl, run_summary

    out = {}
    for k in ks:
        run_root = root / f"async{k}"
        main(["--out", str(run_root), "--runs", "zerokld", "--steps", str(steps), "--async", str(k)])
        rows = load_jsonl(run_root / "zerokld" / "metrics.jsonl")
        s = run_summary(run_root / "zerokld")
        if any(r["k3"] != 0.0 or r["tokens_bitwise_different"] for r in rows):
            raise AssertionError(f"--async {k}: a token's sampler log-prob differs from its snapshot's")
        out[f"async {k}" if k else "sync"] = {
            "steps": len(rows),
            "seconds": s["seconds"],
            "steps_per_hour": 3600 * len(rows) / s["seconds"],
            "median_rollout_wait_seconds": statistics.median(r["rollout_wait_seconds"] for r in rows),
            "median_train_seconds": statistics.median(r["train_seconds"] for r in rows),
            "reward_first": s["reward_first"],
            "reward_last": s["reward_last"],
            "eval_before": s["eval_before"],
            "eval_after": s["eval_after"],
            "tokens_by_staleness": s["tokens_by_staleness"],
            "reward_vs_seconds": [[round(r["elapsed_seconds"], 2), r["reward_mean"]] for r in rows],
        }
        print(
            json.dumps({k: v for k, v in out[f"async {k}" if k else "sync"].items() if k != "reward_vs_seconds"}),
            flush=True,
        )
    return out


def _streaming(root: Path, prompts: int, group: int, repeats: int) -> dict:
    import torch
    from vllm import SamplingParams

    from examples.countdown.run import MODEL_SPEC, Tok, task_problems
    from examples.countdown.task import reward
    from shared_numerics.rollout import RolloutBatch
    from titan_plugin.losses import grpo_advantages
    from titan_plugin.rl import RLTrainer, rl_trainer_config
    from vllm_plugin.engines import shutdown_llm, start_llm
    from zerokld_testing import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(root / "model", MODEL_SPEC, seed=0, dtype="bfloat16")
    tok = Tok(ckpt)
    args = argparse.Namespace(numbers="2", max_number=10, ops="+-*")
    problems = task_problems(args, prompts, seed=3)
    requests = [
        (
            {"prompt_token_ids": tok.prompt(p)},
            SamplingParams(max_tokens=32, temperature=1.0, logprobs=0, seed=1000 * i + j),
            p,
        )
        for i, p in enumerate(problems)
        for j in range(group)
    ]
    llm = start_llm(str(ckpt), dtype="bfloat16", batch_invariant=True, max_model_len=256)
    trainer = RLTrainer(rl_trainer_config(str(ckpt), str(root / "dump"), dtype="bfloat16", lr=0.0))

    def generate(reqs):  # whole prompt groups: GRPO advantages are per group, so any grouping gives the same
        outs = llm.generate([r for r, _, _ in reqs], [s for _, s, _ in reqs], use_tqdm=False)
        rewards = torch.tensor(
            [reward(tok.decode(list(o.outputs[0].token_ids)), p) for o, (_, _, p) in zip(outs, reqs, strict=True)]
        )
        return RolloutBatch.from_vllm(outs, grpo_advantages(rewards, group).tolist())

    def grads():
        g = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        trainer.optim_step()  # lr 0: zeroes the gradients, weights unchanged
        return g

    def whole():
        t0 = time.perf_counter()
        trainer.forward_backward(generate(requests))
        t = time.perf_counter() - t0
        return t, t, grads()

    def streamed():
        q: queue.Queue = queue.Queue()

        def produce():
            for i in range(0, len(requests), group):
                q.put(generate(requests[i : i + group]))

        t0 = time.perf_counter()
        threading.Thread(target=produce, daemon=True).start()
        first = None
        for _ in range(0, len(requests), group):
            trainer.forward_backward(q.get())
            first = first or time.perf_counter() - t0
        return first, time.perf_counter() - t0, grads()

    try:
        res: dict = {"whole": [], "streamed": []}
        ref = None
        for _ in range(repeats):
            for name, fn in (("whole", whole), ("streamed", streamed)):
                first, last, g = fn()
                res[name].append((first, last))
                ref = ref or g
                if any(not torch.equal(g[k], ref[k]) for k in ref):
                    raise AssertionError(f"{name}: gradients differ from the first run's")
        batch = generate(requests)
        costs: dict = {"rl_step": [], "forward_backward": []}
        for _ in range(repeats):
            t0 = time.perf_counter()
            trainer.rl_step(batch)
            costs["rl_step"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            trainer.forward_backward(batch)
            trainer.optim_step()
            costs["forward_backward"].append(time.perf_counter() - t0)
    finally:
        trainer.close()
        shutdown_llm(llm)
    med = {
        name: {
            "first_result_seconds": statistics.median(f for f, _ in v),
            "all_results_seconds": statistics.median(x for _, x in v),
        }
        for name, v in res.items()
    }
    out = {
        "completions": len(requests),
        "group_size": group,
        "repeats": repeats,
        **med,
        "first_result_speedup": med["whole"]["first_result_seconds"] / med["streamed"]["first_result_seconds"],
        "gradients_bitwise_equal": True,
        "train_step_seconds": {k: statistics.median(v) for k, v in costs.items()},
    }
    out["exact_accumulation_cost_ratio"] = (
        out["train_step_seconds"]["forward_backward"] / out["train_step_seconds"]["rl_step"]
    )
    print(json.dumps(out), flush=True)
    return out


def markdown(result: dict) -> str:
    """The result as GitHub markdown: one line per countdown run, then the streaming comparison."""
    m, st = result["machine"], result["streaming"]
    lines = [
        "# Sync vs async vs streaming RL (`benchmarks/async_rl.py`)",
        "",
        (
            f"Measured {result['date']} on {machine_phrase(m)}, torch {m['torch']}, vLLM {m['vllm']}; zerokld "
            "numerics, bf16, the countdown example's defaults."
        ),
        "",
    ]
    if result["runs"]:
        lines += [
            (
                "| run | RL seconds | steps/hour | median rollout wait / train s per step | reward first 5 → last 5 "
                "| held-out accuracy before → after | tokens by staleness |"
            ),
            "|---|---|---|---|---|---|---|",
        ]
        for name, r in result["runs"].items():
            stale = ", ".join(f"{k}: {100 * v:.0f}%" for k, v in r["tokens_by_staleness"].items())
            lines.append(
                f"| {name} | {r['seconds']:.0f} | {r['steps_per_hour']:.0f} | "
                f"{r['median_rollout_wait_seconds']:.2f} / {r['median_train_seconds']:.2f} | "
                f"{r['reward_first']:.3f} → {r['reward_last']:.3f} | {100 * r['eval_before']:.1f}% → "
                f"{100 * r['eval_after']:.1f}% | {stale} |"
            )
        lines += [
            "",
            (
                "Every run's sampled tokens equal the trainer's log-probs under the snapshot that sampled them "
                "(k3 = 0, checked by the script). Reward against wall-clock: the `.png` next to this file."
            ),
            "",
        ]
    lines += [
        (
            f"Streaming trainer input, one GRPO batch of {st['completions']} completions (groups of "
            f"{st['group_size']}), median of {st['repeats']}:"
        ),
        "",
        "| trainer input | first result s | all results s |",
        "|---|---|---|",
        f"| whole batch | {st['whole']['first_result_seconds']:.2f} | {st['whole']['all_results_seconds']:.2f} |",
        (
            f"| streamed per group | {st['streamed']['first_result_seconds']:.2f} | "
            f"{st['streamed']['all_results_seconds']:.2f} |"
        ),
        "",
        (
            f"Gradients bitwise equal: {st['gradients_bitwise_equal']}. Exact accumulation "
            "vs TorchTitan's batched `train_step` on the same batch: "
            f"{st['train_step_seconds']['forward_backward']:.2f} s vs {st['train_step_seconds']['rl_step']:.2f} s "
            f"({st['exact_accumulation_cost_ratio']:.1f}x)."
        ),
    ]
    return "\n".join(lines) + "\n"


def render(result: dict, out: Path) -> None:
    """Write ``out`` (JSON) with ``.md`` and ``.png`` beside it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    if result["runs"]:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 5))
        for name, r in result["runs"].items():
            t, y = zip(*r["reward_vs_seconds"], strict=True)
            ax.plot(t, y, label=name)
        ax.set_xlabel("wall-clock seconds since the first GRPO step")
        ax.set_ylabel("reward (mean over the step's rollouts)")
        ax.set_title("countdown GRPO, zerokld: sync vs async")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=100)
        plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/bench/async_rl.json")
    ap.add_argument("--steps", type=int, default=50, help="GRPO steps per countdown run")
    ap.add_argument("--async", dest="ks", default="0,1,2", help="the --async values to run (0 = sync)")
    ap.add_argument("--prompts", type=int, default=32, help="streaming: prompts in the batch")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-runs", action="store_true", help="only the streaming measurement")
    ap.add_argument("--render", default=None, help="a result JSON to render again (no measurement)")
    args = ap.parse_args(argv)
    if args.render:
        result = json.loads(Path(args.render).read_text())
        render(result, Path(args.render))
        return result

    import vllm

    with tempfile.TemporaryDirectory(prefix="zerokld-async-bench-") as tmp:
        streaming = _streaming(Path(tmp) / "streaming", args.prompts, args.group_size, args.repeats)
        runs = {} if args.skip_runs else _countdown_runs(Path(tmp), args.steps, [int(k) for k in args.ks.split(",")])
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": {**machine_facts(), "vllm": vllm.__version__},
        "streaming": streaming,
        "runs": runs,
    }
    render(result, Path(args.out))
    return result


if __name__ == "__main__":
    main()
