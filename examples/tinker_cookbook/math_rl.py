"""tinker-cookbook's RL recipe ``math_rl`` (its arithmetic environment: no dataset download), unmodified, against
zerokld's two local servers — the TorchTitan training server (:mod:`titan_plugin.training_server`, tinker's wire) and
a ``vllm serve`` with zerokld's hot-load API that samples the snapshot each step saves — then the same with the plugin
off on both, for contrast::

    python -m examples.tinker_cookbook.math_rl            # runs/tinker_cookbook/summary.md

What runs is the recipe's own command line, as a Tinker user types it, with ``base_url`` at the local training server
and a tiny local model whose tokenizer carries Qwen3's chat specials (``renderer_name=qwen3``)::

    TINKER_API_KEY=tml-... python -m tinker_cookbook.recipes.math_rl.train base_url=http://127.0.0.1:PORT \\
        model_name=DIR renderer_name=qwen3 lora_rank=8 group_size=4 groups_per_batch=4 max_steps=4 max_tokens=8 \\
        loss_fn=importance_sampling learning_rate=1e-3 eval_every=0 save_every=0 log_path=DIR/run \\
        behavior_if_log_dir_exists=delete

The cookbook logs ``optim/kl_sample_train_v1`` (mean of sampler − trainer log-prob over the sampled tokens) and ``_v2``
(half the mean square) at every step from the sampler's log-probs and the trainer's ``forward_backward`` ones: with
zerokld both are exactly 0 at every step; with the plugin off they are not. The cookbook is installed without its
declared dependency ``tml-renderers>=0.4.1`` (not on PyPI; the ``qwen3`` renderer does not use it): ``make
install-test`` installs it with ``--no-deps`` and its other dependencies from the test extra.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from zerokld_testing import TinyModelSpec, make_tiny_checkpoint

KEY = "tml-local-example"  # tinker takes tml- keys only
MAX_LORA_RANK = 8
MODEL_SPEC = TinyModelSpec(family="qwen3", chat_tokens=True)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/tinker_cookbook")
    ap.add_argument("--runs", choices=["both", "zerokld", "stock"], default="both")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--groups-per-batch", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--lora-rank", type=int, default=8, help="0: full-parameter")
    ap.add_argument("--learning-rate", type=float, default=1e-3)
    ap.add_argument("--recipe-timeout-s", type=float, default=900)
    return ap.parse_args(argv)


def recipe_command(base_url: str, ckpt: Path, log_path: Path, args) -> list[str]:
    """The cookbook's own entry point and flags (nothing zerokld-specific but ``base_url``)."""
    return [
        sys.executable,
        "-m",
        "tinker_cookbook.recipes.math_rl.train",
        f"base_url={base_url}",
        f"model_name={ckpt}",
        "renderer_name=qwen3",
        f"lora_rank={args.lora_rank}",
        f"group_size={args.group_size}",
        f"groups_per_batch={args.groups_per_batch}",
        f"max_steps={args.steps}",
        f"max_tokens={args.max_tokens}",
        "loss_fn=importance_sampling",
        f"learning_rate={args.learning_rate}",
        "eval_every=0",
        "save_every=0",
        f"log_path={log_path}",
        "behavior_if_log_dir_exists=delete",
    ]


def run(mode: str, ckpt: Path, out: Path, args) -> list[dict]:
    """One run (``mode`` ``zerokld`` or ``stock``: the plugin off on both servers); its per-step rows from the
    cookbook's ``metrics.jsonl``.

    Raises:
        RuntimeError: the recipe failed (its output's tail attached).
    """
    from titan_plugin.training_server import TrainingServerProcess
    from vllm_plugin.serve import HotLoadServer

    run_dir = out / mode
    (run_dir / "snapshots").mkdir(parents=True, exist_ok=True)
    zerokld = mode == "zerokld"
    vllm = HotLoadServer(
        str(ckpt),
        run_dir / "snapshots",
        run_dir / "state",
        run_dir / "vllm.log",
        KEY,
        ("--enable-lora", "--max-loras", "2", "--max-lora-rank", str(MAX_LORA_RANK)),
        batch_invariant=zerokld,
    )
    vllm.start()
    try:
        trainer = TrainingServerProcess(
            ckpt,
            run_dir / "snapshots",
            KEY,
            run_dir / "trainer.log",
            ["--max-lora-rank", MAX_LORA_RANK, "--sampler-url", vllm.base, *([] if zerokld else ["--stock"])],
        )
        trainer.start()
        try:
            env = {
                **os.environ,
                "TINKER_API_KEY": KEY,
                "TINKER_TELEMETRY": "0",
                "HF_HUB_OFFLINE": "1",
                "HF_DATASETS_OFFLINE": "1",
            }
            t0 = time.time()
            proc = subprocess.run(
                recipe_command(trainer.base, ckpt, run_dir / "run", args),
                env=env,
                capture_output=True,
                text=True,
                timeout=args.recipe_timeout_s,
            )
            (run_dir / "recipe.log").write_text(proc.stdout + proc.stderr)
            if proc.returncode != 0:
                raise RuntimeError(f"the recipe failed ({mode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
            seconds = time.time() - t0
        finally:
            trainer.stop()
    finally:
        vllm.stop()
    rows = [json.loads(line) for line in (run_dir / "run" / "metrics.jsonl").read_text().splitlines() if line]
    keep = ("optim/kl_sample_train_v1", "optim/kl_sample_train_v2", "optim/entropy", "env/all/reward/total")
    rows = [{"step": r["step"], **{k: r[k] for k in keep if k in r}} for r in rows if "optim/kl_sample_train_v1" in r]
    for r in rows:
        r["recipe_seconds"] = seconds
    return rows


def summary(results: dict[str, list[dict]]) -> str:
    lines = ["| run | step | kl_sample_train_v1 | kl_sample_train_v2 | entropy |", "| --- | --- | --- | --- | --- |"]
    for mode, rows in results.items():
        for r in rows:
            lines.append(
                f"| {mode} | {r['step']} | {r['optim/kl_sample_train_v1']:.3g} | "
                f"{r['optim/kl_sample_train_v2']:.3g} | {r.get('optim/entropy', float('nan')):.3f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict[str, list[dict]]:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = make_tiny_checkpoint(out / "model", MODEL_SPEC, seed=0, dtype="bfloat16")
    results = {
        mode: run(mode, ckpt, out, args) for mode in (["zerokld", "stock"] if args.runs == "both" else [args.runs])
    }
    (out / "summary.json").write_text(json.dumps(results, indent=2))
    (out / "summary.md").write_text(summary(results))
    print(summary(results))
    return results


if __name__ == "__main__":
    main()
