"""``make demo``: the countdown example side by side twice — bf16 rollouts, then FP8 rollouts — and one table of the
four runs (the seeds' table: with vs without zero KLD, bf16 and FP8).

* bf16: ``python -m examples.countdown.run --out <out>/bf16`` (rollouts and training in bf16);
* FP8 rollouts: ``python -m examples.countdown.run --out <out>/fp8_block --fp8 block`` (stock: vLLM's own online
  ``fp8_per_block`` serving against the bf16 TorchTitan trainer, as production runs it; zerokld: the shared FP8
  quantizer in vLLM and FP8 QAT in the trainer).

Same data, seeds, steps and hyper-parameters in every run (the example's defaults; extra arguments go to both runs).
Writes each run's outputs under ``<out>/{bf16,fp8_block}/`` and ``<out>/summary.md`` (the four-row table, also printed).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

__all__ = ["PRECISIONS", "demo_markdown", "main"]

#: (output folder, label in the table, extra arguments of examples.countdown.run)
PRECISIONS = [("bf16", "bf16", []), ("fp8_block", "FP8 rollouts", ["--fp8", "block"])]


def demo_markdown(out: Path, seconds: float | None = None) -> str:
    """The four-row table of the runs under ``out`` (``<out>/<precision>/{zerokld,stock}``) with each precision's
    setup lines and speed ratio; a stock run that did not run (FP8 on a CPU without AMX) is a setup line saying why.
    Raises ``ValueError`` for a run without metrics
    (:func:`examples.countdown.summary.run_summary`)."""
    from examples.countdown.served import STOCK_FP8_UNAVAILABLE
    from examples.countdown.summary import run_summary, summary_markdown

    summaries, ratios, missing = {}, [], []
    for folder, label, _ in PRECISIONS:
        # (a stock run a CPU cannot run — vLLM-CPU's FP8 without AMX — has no metrics; its summary says why)
        runs = {
            mode: run_summary(out / folder / mode)
            for mode in ("zerokld", "stock")
            if (out / folder / mode / "metrics.jsonl").exists() or mode == "zerokld"
        }
        for mode, s in runs.items():
            summaries[f"{mode}, {label}"] = s
        if "stock" not in runs:
            missing.append(f"{label}: {STOCK_FP8_UNAVAILABLE}")
        z, st = runs["zerokld"].get("step_seconds"), runs.get("stock", {}).get("step_seconds")
        if z and st:
            ratios.append(f"{label}: zerokld {z:.1f} s, stock {st:.1f} s (**{st / z:.2f}x** stock's speed)")
    setup = [
        f"{label}: `{' '.join(['python -m examples.countdown.run', *extra])}` — setup and curves: "
        f"`{folder}/summary.md`, `{folder}/curves.png`"
        for folder, label, extra in PRECISIONS
    ] + missing
    text = summary_markdown(summaries, setup).replace(
        "# Countdown GRPO: zerokld vs stock", "# Countdown GRPO: zerokld vs stock, bf16 and FP8 rollouts"
    )
    if ratios:
        text += "\nRL steps 2–last, wall-clock per precision: " + "; ".join(ratios) + "\n"
    if seconds is not None:
        text += f"\n`make demo` ran {seconds:.0f} s (both precisions, SFT included; not the install).\n"
    return text


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/countdown", help="output root")
    args, rest = ap.parse_known_args(argv)
    from examples.countdown import run

    out = Path(args.out)
    t0 = time.perf_counter()
    for folder, _, extra in PRECISIONS:
        run.main(["--out", str(out / folder), *extra, *rest])
    text = demo_markdown(out, time.perf_counter() - t0)
    (out / "summary.md").write_text(text)
    print(text)
    print(f"wrote {out / 'summary.md'}")
    return text


if __name__ == "__main__":
    main()
