"""``curves.png`` for the side-by-side countdown runs: reward, held-out accuracy, k3 and clipped fraction per step."""

from __future__ import annotations

from pathlib import Path

from examples.countdown.summary import load_jsonl

__all__ = ["plot_curves"]


def plot_curves(run_dirs: dict[str, Path], out_png: str | Path) -> Path:
    """Write a 2x2 figure, one line per run: mean reward, held-out greedy accuracy (``eval.jsonl``), train-inference
    k3 (symlog: an exact 0 sits on the axis) and clipped-token fraction, each against the GRPO step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    (ax_r, ax_e), (ax_k, ax_c) = axes
    for name, run_dir in run_dirs.items():
        rows = load_jsonl(Path(run_dir) / "metrics.jsonl")
        evals = load_jsonl(Path(run_dir) / "eval.jsonl")
        steps = [r["step"] for r in rows]
        ax_r.plot(steps, [r["reward_mean"] for r in rows], label=name)
        ax_e.plot([e["step"] for e in evals], [e["accuracy"] for e in evals], marker="o", label=name)
        ax_k.plot(steps, [r["k3"] for r in rows], label=name)
        ax_c.plot(steps, [r["clipped_fraction"] for r in rows], label=name)
    titles = [
        "reward (mean over rollouts)",
        "held-out accuracy (greedy)",
        "train-inference KL (k3, nats)",
        "clipped-token fraction",
    ]
    for ax, title in zip(axes.flat, titles, strict=True):
        ax.set_title(title)
        ax.set_xlabel("GRPO step")
        ax.legend()
        ax.grid(alpha=0.3)
    ax_k.set_yscale("symlog", linthresh=1e-8)
    ax_k.set_ylim(bottom=0)
    fig.tight_layout()
    out_png = Path(out_png)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png
