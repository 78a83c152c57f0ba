"""The side-by-side table of a countdown run (``<out>/summary.md``): per run, train-inference KL, clipped tokens, reward
and held-out accuracy — the columns of Fireworks' zero-KLD comparison (KL ~0.013 and ~45% clipped without their
stack, 0 and 0% with it).

Reads each run's ``metrics.jsonl`` (one row per GRPO step, :func:`examples.countdown.run.run_rl`) and ``eval.jsonl``
(greedy held-out accuracy at step 0 and every ``--eval-every`` steps).
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["load_jsonl", "run_summary", "summary_markdown", "write_summary"]

WINDOW = 5  # steps averaged for "first" and "last" reward


def load_jsonl(path: str | Path) -> list[dict]:
    path = Path(path)
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def run_summary(run_dir: str | Path, side: str | None = None) -> dict:
    """One run's numbers: ``run_dir/metrics.jsonl`` and ``eval.jsonl``, or with ``side`` the copies a results
    folder keeps side by side, ``run_dir/<side>_metrics.jsonl`` and ``<side>_eval.jsonl``.

    Returns:
        ``steps``; ``k3_mean`` / ``k3_max`` over steps (each step's k3: mean over its sequences of the per-token
        ``exp(d) - d - 1``, nats); ``tokens_bitwise_different`` (sum) of ``num_tokens`` (sum); ``clipped_tokens`` and
        ``clipped_fraction`` (tokens whose ratio left the clip range, over the run); ``reward_first`` /
        ``reward_last`` (mean reward of the first / last ``WINDOW`` steps), ``reward_min`` (lowest step);
        ``eval_before`` / ``eval_after`` (held-out greedy accuracy at the first / last eval row, ``None`` without
        ``eval.jsonl``); ``tokens_by_staleness`` (``{versions behind the trainer: share of tokens}``, ``--async``: a
        row's ``tokens_by_staleness``, else its ``staleness`` for all its tokens, else 0); ``seconds`` (wall-clock
        of the RL loop, ``None`` if not recorded); ``step_seconds`` / ``rollout_seconds`` / ``train_seconds``: sums
        over steps 2.. (step 1 pays one-time warm-ups; ``None`` where a row lacks the field).

    Raises:
        ValueError: ``metrics.jsonl`` has no rows.
    """
    run_dir = Path(run_dir)
    prefix = f"{side}_" if side else ""
    rows = load_jsonl(run_dir / f"{prefix}metrics.jsonl")
    if not rows:
        raise ValueError(f"{run_dir.name}/{prefix}metrics.jsonl has no steps")
    evals = load_jsonl(run_dir / f"{prefix}eval.jsonl")
    rewards = [r["reward_mean"] for r in rows]
    n = min(WINDOW, len(rows))
    tokens = sum(r["num_tokens"] for r in rows)
    clipped = sum(r["clipped_fraction"] * r["num_tokens"] for r in rows)
    stale: dict[int, int] = {}
    for r in rows:  # per token when the row has it (a batch may span swaps), else the row's staleness
        for k, count in (r.get("tokens_by_staleness") or {r.get("staleness", 0): r["num_tokens"]}).items():
            stale[int(k)] = stale.get(int(k), 0) + count
    return {
        "steps": len(rows),
        "k3_mean": sum(r["k3"] for r in rows) / len(rows),
        "k3_max": max(r["k3"] for r in rows),
        "tokens_bitwise_different": sum(r["tokens_bitwise_different"] for r in rows),
        "num_tokens": tokens,
        "clipped_tokens": round(clipped),
        "clipped_fraction": clipped / max(tokens, 1),
        "reward_first": sum(rewards[:n]) / n,
        "reward_last": sum(rewards[-n:]) / n,
        "reward_min": min(rewards),
        "eval_before": evals[0]["accuracy"] if evals else None,
        "eval_after": evals[-1]["accuracy"] if evals else None,
        "tokens_by_staleness": {k: v / max(tokens, 1) for k, v in sorted(stale.items())},
        "seconds": rows[-1].get("elapsed_seconds"),
        **{
            key: (sum(r[key] for r in rows[1:]) if len(rows) > 1 and all(key in r for r in rows[1:]) else None)
            for key in ("step_seconds", "rollout_seconds", "train_seconds")
        },
    }


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%" if x == 0 or x >= 0.001 else f"{100 * x:.2g}%"


def summary_markdown(summaries: dict[str, dict], setup: list[str]) -> str:
    """The table (one line per run, in the order given) under a bullet list ``setup`` (configuration, machine)."""
    lines = (
        ["# Countdown GRPO: zerokld vs stock", ""]
        + [f"- {s}" for s in setup]
        + [
            "",
            (
                "| run | train-inference KL k3 (mean, max) | tokens bitwise different | clipped tokens "
                f"| reward first {WINDOW} → last {WINDOW} steps (min) | held-out greedy accuracy before → after |"
            ),
            "|---|---|---|---|---|---|",
        ]
    )
    for name, s in summaries.items():
        ev = "n/a" if s["eval_before"] is None else f"{_pct(s['eval_before'])} → {_pct(s['eval_after'])}"
        lines.append(
            f"| {name} | {s['k3_mean']:.3g}, {s['k3_max']:.3g} | {s['tokens_bitwise_different']} of "
            f"{s['num_tokens']} | {s['clipped_tokens']} ({_pct(s['clipped_fraction'])}) | "
            f"{s['reward_first']:.3f} → {s['reward_last']:.3f} "
            f"({s['reward_min']:.3f}) | {ev} |"
        )
    timed = {name: s["seconds"] for name, s in summaries.items() if s.get("seconds") is not None}
    if timed:
        lines += ["", "RL wall-clock: " + ", ".join(f"{name} {sec:.0f} s" for name, sec in timed.items())]
    per_step = {name: s for name, s in summaries.items() if s.get("step_seconds") is not None}
    if per_step:
        first = next(iter(per_step.values()))
        lines += [
            "",
            f"Per-step wall-clock, steps 2–{first['steps']}: "
            + "; ".join(
                f"{name} {s['step_seconds']:.1f} s (rollout {s['rollout_seconds'] or 0:.1f} s, train "
                f"{s['train_seconds'] or 0:.1f} s)"
                for name, s in per_step.items()
            ),
        ]
        if "zerokld" in per_step and "stock" in per_step and per_step["zerokld"]["step_seconds"] > 0:
            lines[-1] += (
                f": zerokld runs at **{per_step['stock']['step_seconds'] / per_step['zerokld']['step_seconds']:.2f}x**"
                " stock's speed"
            )
    if any(k > 0 for s in summaries.values() for k in s.get("tokens_by_staleness", {})):
        lines += [
            "",
            "Tokens by staleness (policy versions behind the trainer): "
            + "; ".join(
                f"{name}: " + ", ".join(f"{k}: {_pct(v)}" for k, v in s["tokens_by_staleness"].items())
                for name, s in summaries.items()
            ),
        ]
    return "\n".join(lines) + "\n"


def write_summary(out: str | Path, runs: list[str], setup: list[str]) -> tuple[Path, str]:
    """Write ``<out>/summary.md`` for the runs under ``out`` (``<out>/<run>/metrics.jsonl``); returns (path, text)."""
    out = Path(out)
    text = summary_markdown({name: run_summary(out / name) for name in runs}, setup)
    path = out / "summary.md"
    path.write_text(text)
    return path, text
