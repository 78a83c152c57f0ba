"""GRPO on countdown with Fireworks' own SDK, unmodified, against two local servers — zerokld's TorchTitan training
server (:mod:`titan_plugin.training_server`) and a ``vllm serve`` with zerokld's hot-load endpoint — then the same
loop with the plugin off on both, for contrast::

    python -m examples.fireworks_sdk.grpo --steps 8          # runs/fireworks_sdk/summary.md

Per step: ``WeightSyncer.save_and_hotload`` (a base snapshot, then arc_v2 deltas, hot-loaded into the server),
``DeploymentSampler`` samples a group per prompt at temperature 1 with log-probs, GRPO advantages from the countdown
reward, ``forward`` scores the same tokens on the trainer — the client-side train-inference gap printed is
``sampling_logprob - forward logprob`` over the completion tokens (k1 mean, max |.|, and the share of tokens that
are bitwise equal) — then ``forward_backward(ppo)`` and ``optim_step``. Before GRPO, a short supervised warm start
through the same SDK (``forward_backward(cross_entropy)`` on solver answers). Nothing here is zerokld-specific except
the servers' command lines; the client code is what a Fireworks user writes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("TINKER_TELEMETRY", "0")

from examples.countdown.run import MODEL_SPEC, Tok
from examples.countdown.task import generate_problems, reward
from zerokld_testing import make_tiny_checkpoint

KEY = "fw-local-example"
DEPLOYMENT = "local"
BASE_MODEL = "tiny-qwen3-countdown"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/fireworks_sdk")
    ap.add_argument("--runs", choices=["both", "zerokld", "stock"], default="both")
    ap.add_argument("--steps", type=int, default=8, help="GRPO steps per run")
    ap.add_argument("--prompts-per-step", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--sft-steps", type=int, default=20)
    ap.add_argument("--sft-batch", type=int, default=32)
    ap.add_argument("--sft-lr", type=float, default=3e-3)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def start_servers(ckpt: Path, run_dir: Path, zerokld: bool) -> tuple[str, str, list]:
    """The vLLM server (hot-load endpoint on; ``batch_invariant`` as ``zerokld``) and the training server on the same
    snapshot root. Returns ``(inference_url, training_url, servers)``."""
    from titan_plugin.training_server import TrainingServerProcess
    from vllm_plugin.serve import OpenAIServer

    root = run_dir / "snapshots"
    root.mkdir(parents=True, exist_ok=True)
    section = {
        "batch_invariant": zerokld,
        "hot_load": {"snapshot_root": str(root), "state_dir": str(run_dir / "state")},
    }
    vllm = OpenAIServer(
        [
            "--model",
            str(ckpt),
            "--dtype",
            "bfloat16",
            "--gpu-memory-utilization",
            "0.3",
            "--max-model-len",
            "256",
            "--enforce-eager",
            "--api-key",
            KEY,
            "--additional-config",
            json.dumps({"zerokld": section}),
        ],
        run_dir / "vllm.log",
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_PLUGINS": "zerokld,zerokld_hotload"},
    )
    trainer = TrainingServerProcess(ckpt, root, KEY, run_dir / "trainer.log", [] if zerokld else ["--stock"])
    vllm.start()
    try:
        trainer.start()
    except BaseException:
        vllm.stop()
        raise
    return vllm.base, trainer.base, [trainer, vllm]


def stop(servers: list) -> None:
    """Stop the servers this script started (by PID; the vLLM server's process group)."""
    for server in servers:
        server.stop()


def datum(tokens: list[int], prompt_len: int, sampler_lps: list[float] | None, advantage: float):
    """Tinker's datum: inputs ``tokens[:-1]``, targets ``tokens[1:]``, weights on the completion only."""
    from fireworks.training.sdk import Datum, ModelInput, TensorData

    n = len(tokens) - 1
    completion = n - prompt_len + 1
    inputs = {
        "target_tokens": TensorData(data=tokens[1:], dtype="int64", shape=[n]),
        "weights": TensorData(data=[0.0] * (prompt_len - 1) + [1.0] * completion, dtype="float32", shape=[n]),
    }
    if sampler_lps is not None:
        inputs["logprobs"] = TensorData(data=[0.0] * (prompt_len - 1) + list(sampler_lps), dtype="float32", shape=[n])
        inputs["advantages"] = TensorData(data=[advantage] * n, dtype="float32", shape=[n])
    return Datum(model_input=ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def run(mode: str, ckpt: Path, out: Path, args, tok: Tok) -> dict:
    """One run (``mode`` ``zerokld`` or ``stock``); per-step rows to ``<out>/<mode>/metrics.jsonl``."""
    from fireworks.training.sdk import (
        AdamParams,
        DeploymentManager,
        DeploymentSampler,
        FiretitanServiceClient,
        WeightSyncer,
    )

    run_dir = out / mode
    run_dir.mkdir(parents=True, exist_ok=True)
    inference_url, training_url, servers = start_servers(ckpt, run_dir, zerokld=mode == "zerokld")
    rows, svc = [], None
    try:
        svc = FiretitanServiceClient(base_url=training_url, api_key=KEY)
        tc = svc.create_training_client(base_model=BASE_MODEL)
        dm = DeploymentManager(api_key=KEY, base_url=inference_url)
        syncer = WeightSyncer(
            policy_client=tc, deploy_mgr=dm, deployment_id=DEPLOYMENT, base_model=BASE_MODEL, hotload_timeout=300
        )
        sampler = DeploymentSampler(
            inference_url=inference_url, model=f"accounts/{dm.account_id}/deployments/{DEPLOYMENT}", api_key=KEY
        )
        rng = random.Random(args.seed)
        problems = generate_problems(400, seed=args.seed, max_number=10, counts=(2,), ops="+-*")
        for _ in range(args.sft_steps):  # supervised warm start through the same SDK
            batch = rng.sample(problems, args.sft_batch)
            data = [datum(tok.prompt(p) + tok.answer(p), len(tok.prompt(p)), None, 1.0) for p in batch]
            tc.forward_backward(data, "cross_entropy").result()
            tc.optim_step(AdamParams(learning_rate=args.sft_lr)).result()
        for step in range(args.steps):
            t0 = time.time()
            syncer.save_and_hotload(f"step-{step}")
            group = rng.sample(problems, args.prompts_per_step)
            samples = asyncio.run(_sample_groups(sampler, [tok.prompt(p) for p in group], args))
            data, diffs, rewards = [], [], []
            for p, comps in zip(group, samples, strict=True):
                rs = [reward(tok.decode(c.full_tokens[c.prompt_len :]), p) for c in comps]
                mean, std = statistics.fmean(rs), statistics.pstdev(rs)
                rewards += rs
                data += [
                    datum(c.full_tokens, c.prompt_len, c.sampling_logprobs, (r - mean) / (std + 1e-6))
                    for c, r in zip(comps, rs, strict=True)
                ]
            comps = [c for cs in samples for c in cs]
            fwd = tc.forward(data, "cross_entropy").result()
            for o, c in zip(fwd.loss_fn_outputs, comps, strict=True):
                train = o["logprobs"].data[c.prompt_len - 1 :]
                diffs += [s - t for s, t in zip(c.sampling_logprobs, train, strict=True)]
            tc.forward_backward(data, "ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}).result()
            tc.optim_step(AdamParams(learning_rate=args.lr)).result()
            row = {
                "step": step,
                "reward_mean": statistics.fmean(rewards),
                "kl_k1": statistics.fmean(diffs),
                "max_abs_logprob_diff": max(abs(d) for d in diffs),
                "bitwise_equal_share": sum(d == 0.0 for d in diffs) / len(diffs),
                "tokens": len(diffs),
                "seconds": time.time() - t0,
            }
            rows.append(row)
            print(
                f"[{mode}] step {step}: reward {row['reward_mean']:.3f}  k1 {row['kl_k1']:+.3e}  "
                f"max|diff| {row['max_abs_logprob_diff']:.3e}  bitwise equal {row['bitwise_equal_share']:.1%}",
                flush=True,
            )
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    finally:
        if svc is not None:
            svc.close()  # its session heartbeat stops before the server does
        stop(servers)
    return {"mode": mode, "rows": rows}


async def _sample_groups(sampler, prompts: list[list[int]], args) -> list:
    return await asyncio.gather(
        *(
            sampler.sample_with_prompt_tokens(
                p, n=args.group_size, max_tokens=args.max_tokens, temperature=1.0, logprobs=True
            )
            for p in prompts
        )
    )


def summary(results: list[dict]) -> str:
    lines = [
        "| run | steps | reward (first → last) | max \\|sampler − trainer\\| log-prob | bitwise-equal tokens |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in results:
        rows = r["rows"]
        if not rows:
            continue
        equal = sum(x["bitwise_equal_share"] * x["tokens"] for x in rows) / sum(x["tokens"] for x in rows)
        lines.append(
            f"| {r['mode']} | {len(rows)} | {rows[0]['reward_mean']:.3f} → {rows[-1]['reward_mean']:.3f} | "
            f"{max(x['max_abs_logprob_diff'] for x in rows):.3e} | {equal:.1%} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> str:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = make_tiny_checkpoint(out / "base", MODEL_SPEC, seed=args.seed, dtype="bfloat16")
    tok = Tok(ckpt)
    modes = ["zerokld", "stock"] if args.runs == "both" else [args.runs]
    results = [run(m, ckpt, out, args, tok) for m in modes]
    text = summary(results)
    (out / "summary.md").write_text(text)
    print(text)
    return text


if __name__ == "__main__":
    main()
