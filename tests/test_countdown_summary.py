"""The countdown summary table (examples/countdown/summary.py) from hand-written metrics: every column's arithmetic."""

from __future__ import annotations

import json

import pytest

from examples.countdown.summary import run_summary, write_summary


def _write(run_dir, rewards, k3, diff, clipped, evals=None):
    run_dir.mkdir(parents=True)
    rows = [
        {
            "step": i + 1,
            "reward_mean": r,
            "k3": k,
            "tokens_bitwise_different": d,
            "num_tokens": 100,
            "clipped_fraction": c,
        }
        for i, (r, k, d, c) in enumerate(zip(rewards, k3, diff, clipped, strict=True))
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if evals is not None:
        (run_dir / "eval.jsonl").write_text("".join(json.dumps({"step": s, "accuracy": a}) + "\n" for s, a in evals))


def test_run_summary_columns(tmp_path):
    rewards = [0.1, 0.2, 0.1, 0.2, 0.1, 0.05, 0.5, 0.6, 0.5, 0.6, 0.7]
    _write(
        tmp_path / "stock",
        rewards,
        [1e-4] * 10 + [3e-3],
        [5] * 11,
        [0.0] * 10 + [0.5],
        evals=[(0, 0.25), (5, 0.3), (11, 0.5)],
    )
    s = run_summary(tmp_path / "stock")
    assert s["steps"] == 11
    assert s["reward_first"] == pytest.approx(0.14) and s["reward_last"] == pytest.approx(0.58)
    assert s["reward_min"] == 0.05
    assert s["k3_mean"] == pytest.approx((10 * 1e-4 + 3e-3) / 11) and s["k3_max"] == 3e-3
    assert s["tokens_bitwise_different"] == 55 and s["num_tokens"] == 1100
    assert s["clipped_fraction"] == pytest.approx(50 / 1100) and s["clipped_tokens"] == 50
    assert (s["eval_before"], s["eval_after"]) == (0.25, 0.5)


def test_markdown_table_and_file(tmp_path):
    _write(tmp_path / "zerokld", [0.2, 0.9], [0.0, 0.0], [0, 0], [0.0, 0.0], evals=[(0, 0.1), (2, 0.6)])
    _write(tmp_path / "stock", [0.2, 0.3], [1e-4, 2e-4], [7, 9], [0.1, 0.3])
    path, text = write_summary(tmp_path, ["zerokld", "stock"], ["machine: test"])
    assert path == tmp_path / "summary.md" and path.read_text() == text
    lines = text.splitlines()
    assert "- machine: test" in lines
    zk = next(x for x in lines if x.startswith("| zerokld"))
    stock = next(x for x in lines if x.startswith("| stock"))
    assert zk == "| zerokld | 0, 0 | 0 of 200 | 0 (0.0%) | 0.550 → 0.550 (0.200) | 10.0% → 60.0% |"
    assert stock == "| stock | 0.00015, 0.0002 | 16 of 200 | 40 (20.0%) | 0.250 → 0.250 (0.200) | n/a |"
    assert lines.index(zk) < lines.index(stock)


def test_async_staleness_and_wall_clock(tmp_path):
    """``--async`` rows carry ``staleness`` and ``elapsed_seconds``: the share of tokens per staleness and the RL
    wall-clock are printed under the table; a synchronous run without them prints neither."""
    _write(tmp_path / "sync", [0.2, 0.3], [0.0, 0.0], [0, 0], [0.0, 0.0])
    assert "staleness" not in write_summary(tmp_path, ["sync"], [])[1]
    run = tmp_path / "async"
    run.mkdir()
    rows = [
        {
            "step": i + 1,
            "reward_mean": 0.5,
            "k3": 0.0,
            "tokens_bitwise_different": 0,
            "num_tokens": n,
            "clipped_fraction": 0.0,
            "staleness": st,
            "elapsed_seconds": 10.0 * (i + 1),
        }
        for i, (st, n) in enumerate([(0, 100), (1, 100), (1, 150), (2, 150)])
    ]
    rows[2]["tokens_by_staleness"] = {"0": 50, "1": 100}  # a batch that spans a swap: counted per token
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = run_summary(run)
    assert s["tokens_by_staleness"] == {0: 0.3, 1: 0.4, 2: 0.3} and s["seconds"] == 40.0
    text = write_summary(tmp_path, ["async", "sync"], [])[1]
    assert "RL wall-clock: async 40 s" in text
    assert "async: 0: 30.0%, 1: 40.0%, 2: 30.0%; sync: 0: 100.0%" in text


def test_empty_run_is_refused(tmp_path):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="no steps"):
        run_summary(tmp_path / "r")
    with pytest.raises(ValueError):
        write_summary(tmp_path, ["r"], [])


def test_per_step_wall_clock_and_speed_ratio(tmp_path):
    """Steps 2.. of each run (step 1 pays warm-ups): summed step, rollout and train seconds, and stock ÷ zerokld."""
    for name, step in (("zerokld", 2.0), ("stock", 1.5)):
        run = tmp_path / name
        run.mkdir()
        rows = [
            {
                "step": i + 1,
                "reward_mean": 0.5,
                "k3": 0.0,
                "tokens_bitwise_different": 0,
                "num_tokens": 10,
                "clipped_fraction": 0.0,
                "step_seconds": 9.0 if i == 0 else step,
                "rollout_seconds": step / 2,
                "train_seconds": step / 4,
            }
            for i in range(5)
        ]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert run_summary(tmp_path / "stock")["step_seconds"] == 6.0
    text = write_summary(tmp_path, ["zerokld", "stock"], [])[1]
    assert (
        "Per-step wall-clock, steps 2–5: zerokld 8.0 s (rollout 4.0 s, train 2.0 s); stock 6.0 s (rollout 3.0 s, "
        "train 1.5 s): zerokld runs at **0.75x** stock's speed"
    ) in text


def test_demo_table_has_the_four_runs(tmp_path):
    """``make demo``'s table (examples/countdown/demo.py): zerokld and stock for bf16 and for FP8 rollouts, in that
    order, with each precision's speed ratio; a missing run is an error, not a shorter table."""
    from examples.countdown.demo import demo_markdown

    for folder, k3, step in (("bf16", 1e-5, 1.0), ("fp8_block", 4e-5, 1.5)):
        for mode in ("zerokld", "stock"):
            run = tmp_path / folder / mode
            run.mkdir(parents=True)
            rows = [
                {
                    "step": i + 1,
                    "reward_mean": 0.5,
                    "k3": 0.0 if mode == "zerokld" else k3,
                    "tokens_bitwise_different": 0 if mode == "zerokld" else 10,
                    "num_tokens": 10,
                    "clipped_fraction": 0.0,
                    "step_seconds": step * (2 if mode == "zerokld" else 1),
                }
                for i in range(3)
            ]
            (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = demo_markdown(tmp_path, seconds=300)
    rows = [x.split(" | ")[0] for x in text.splitlines() if x.startswith("| ") and "---" not in x][1:]
    assert rows == ["| zerokld, bf16", "| stock, bf16", "| zerokld, FP8 rollouts", "| stock, FP8 rollouts"]
    assert "| stock, FP8 rollouts | 4e-05, 4e-05 | 30 of 30 |" in text
    assert "bf16: zerokld 4.0 s, stock 2.0 s (**0.50x** stock's speed)" in text
    assert "`make demo` ran 300 s" in text
    (tmp_path / "fp8_block" / "stock" / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="no steps"):
        demo_markdown(tmp_path)
