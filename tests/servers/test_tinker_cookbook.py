"""tinker-cookbook's ``math_rl`` recipe (arithmetic environment), unmodified, against zerokld (issue 38): the recipe's
own command line, with ``base_url`` at the training server, a LoRA model and a real ``vllm serve`` sampling each
step's snapshot (:mod:`examples.tinker_cookbook.math_rl`). The cookbook's own ``optim/kl_sample_train_v1`` and ``_v2``
are exactly 0 at every step; with the plugin off on both servers (negative control) they are not."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.titan]


@pytest.mark.extended  # `make test-extended`: the whole RL loop (~180 s on 2 cores); test_tinker_*.py drive the client
def test_cookbook_math_rl_logs_kl_sample_train_exactly_zero(engine_slot, tmp_path):
    from examples.tinker_cookbook.math_rl import main

    engine_slot.close()  # one engine at a time: each run starts its own vllm serve
    results = main(["--out", str(tmp_path), "--steps", "3"])
    zerokld, stock = results["zerokld"], results["stock"]
    assert [r["step"] for r in zerokld] == [0, 1, 2] and [r["step"] for r in stock] == [0, 1, 2]
    assert all(r["optim/kl_sample_train_v1"] == 0.0 and r["optim/kl_sample_train_v2"] == 0.0 for r in zerokld)
    assert any(r["optim/kl_sample_train_v2"] > 0.0 for r in stock)  # the cookbook sees the stock gap
