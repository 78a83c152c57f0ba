"""Curves (reward, k3, clipped fraction per step) for the side-by-side countdown runs, and a text summary."""
from __future__ import annotations

import json
from pathlib import Path

__all__ = ["load_metrics", "plot_curves", "summarize"]


def load_metrics(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_curves(paths: dict[str, Path], out_png: str | Path) -> Path:
    """Write a 1x3 figure (reward_mean, k3, clipped_fraction vs step), one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name, path in paths.items():
        rows = load_metrics(path)
        steps = [r["step"] for r in rows]
        axes[0].plot(steps, [r["reward_mean"] for r in rows], label=name)
        axes[1].plot(steps, [r["k3"] for r in rows], label=name)
        axes[2].plot(steps, [r["clipped_fraction"] for r in rows], label=name)
    for ax, title in zip(axes, ["reward (mean)", "train-inference KL (k3)", "clipped-token fraction"]):
        ax.set_title(title)
        ax.set_xlabel("GRPO step")
        ax.legend()
        ax.grid(alpha=0.3)
    axes[1].set_yscale("symlog", linthresh=1e-12)
    fig.tight_layout()
    out_png = Path(out_png)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png


def summarize(paths: dict[str, Path]) -> str:
    lines = []
    for name, path in paths.items():
        rows = load_metrics(path)
        if not rows:
            continue
        k3 = [r["k3"] for r in rows]
        lines.append(
            f"{name:8s} steps={len(rows)} reward first={rows[0]['reward_mean']:.3f} last={rows[-1]['reward_mean']:.3f} "
            f"k3 max={max(k3):.3e} tokens_bitwise_different total={sum(r['tokens_bitwise_different'] for r in rows)} "
            f"clipped mean={sum(r['clipped_fraction'] for r in rows) / len(rows):.4f} "
            f"step_seconds mean={sum(r['step_seconds'] for r in rows) / len(rows):.2f}"
        )
    return "\n".join(lines)
