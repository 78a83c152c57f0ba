"""``benchmarks/linear.py`` runs end to end on tiny shapes and records what a reader needs to compare machines: CPU
model, ISA flags, thread count, the contract's row tile, and ours ÷ stock per row. Timings of so small a run mean
nothing and are not checked."""

from __future__ import annotations

import importlib
import json

import pytest

from shared_numerics.machine import ISA_FLAGS

pytestmark = pytest.mark.timeout(300)


def test_linear_benchmark_smoke_run(tmp_path):
    sl = importlib.import_module("shared_numerics.linear")  # the package exports a function of that name
    from benchmarks.linear import main

    out = tmp_path / "linear.json"
    main(["--out", str(out), "--ms", "1,33", "--k", "64", "--n", "48", "--repeats", "1", "--row-tiles", "8"])
    result = json.loads(out.read_text())
    machine = result["machine"]
    assert machine["cpu_model"] and machine["threads"] >= 1 and set(machine["isa_flags"]) <= set(ISA_FLAGS)
    assert result["row_tile"] == sl.ROW_TILE  # the sweep put the contract's tile back
    assert [(r["dtype"], r["M"], r["direction"]) for r in result["rows"]] == [
        (d, m, k) for d in ("float32", "bfloat16") for m in (1, 33) for k in ("forward", "forward_backward")
    ]
    for row in result["rows"]:
        assert set(row["ours"]) == {"8", str(sl.ROW_TILE)} and row["speed_ours_over_stock"] > 0
