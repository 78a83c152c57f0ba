"""oneMKL VML's first-call dispatch race (:mod:`shared_numerics.mkl_vml`, pytorch/pytorch#188792): a fresh process's
first multi-threaded float ``exp`` / ``cos`` / ``sqrt`` ... can compute one thread's chunk with a low-accuracy kernel.
After ``import shared_numerics`` the first call of every VML op is the same bits as every later call, and so is the
trainer's first forward (the symptom: a fresh trainer's first log-probs differed from its second's). The negative
control: the same first calls in fresh processes that never import zerokld, where the race shows.

The race is a matter of timing (measured on a 2-core Xeon, AVX-512, torch 2.13.0+cpu: the process's first VML call
wrong in 1 of 20 to 3 of 8 fresh processes; later first calls of other ops were right), so every claim here is over
many fresh processes, each run here and stopped by its PID (``subprocess.run``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import MKL_VML_NO_RACE_REASON

ROOT = Path(__file__).resolve().parent.parent

# each (op, dtype)'s first call over 4,096 elements (two 2,048-element chunks: both threads) vs its second; with
# "zerokld" imported first, also the RoPE table (shared_numerics.rope_cos_sin: float64 cos / sin rounded to float32)
PROBE = r"""
import json, sys
import torch
torch.set_num_threads(2)
if sys.argv[1] == "zerokld":
    import shared_numerics as sn
ops = sys.argv[2].split(",")
bad = []
for op in ops:
    for dt in (torch.float32, torch.float64):
        x = torch.linspace(0.05, 0.95, 4096, dtype=dt)
        f = getattr(torch, op)
        first = f(x)
        if not torch.equal(first, f(x)):
            bad.append(f"{op}/{str(dt).removeprefix('torch.')}")
if sys.argv[1] == "zerokld":
    from shared_numerics.rope import YarnScaling
    pos = torch.arange(4096)
    yarn = YarnScaling(factor=4.0, original_max_position_embeddings=128, mscale=0.707, mscale_all_dim=0.707)
    for scaling in (None, yarn):
        first = sn.rope_cos_sin(pos, 64, 10000.0, scaling)
        later = sn.rope_cos_sin(pos, 64, 10000.0, scaling)
        if not all(torch.equal(a, b) for a, b in zip(first, later, strict=True)):
            bad.append(f"rope_cos_sin/{type(scaling).__name__}")
print(json.dumps(bad))
"""


def _fresh_python(script: str, *args: str, timeout: float) -> str:
    """``script`` run with ``args`` in a fresh Python process (from the repository root): its last line of output."""
    proc = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def _first_calls(mode: str, ops) -> list[str]:
    """One fresh Python process (2 torch threads): the (op, dtype) pairs whose first call differed from the second."""
    return json.loads(_fresh_python(PROBE, mode, ",".join(ops), timeout=120))


@pytest.mark.timeout(300)
def test_first_calls_after_import_are_the_later_calls():
    """In fresh processes that import ``shared_numerics`` first, every VML op's first call in both precisions (and
    the RoPE table's) is bitwise its second call."""
    from shared_numerics.mkl_vml import VML_OPS

    bad = {i: r for i in range(8) if (r := _first_calls("zerokld", VML_OPS))}
    assert not bad, f"first calls with other bits after import shared_numerics (process: ops): {bad}"


@pytest.mark.long  # tens of fresh processes: the race is a matter of timing
@pytest.mark.timeout(600)
def test_without_zerokld_a_first_call_races():
    """The negative control: fresh processes that never import zerokld, each timing the same first call (float32
    ``acos``, the first op of the probe), until one computes other bits than its second call — at most 60."""
    for i in range(60):
        bad = _first_calls("stock", ["acos"])
        if bad:
            assert bad == ["acos/float32"], bad
            print(f"race in fresh process {i + 1}: {bad}")
            return
    pytest.skip(MKL_VML_NO_RACE_REASON)


@pytest.mark.long  # fresh trainer processes, ~7 s each
@pytest.mark.timeout(600)
def test_a_fresh_trainers_first_forward_is_its_second(tmp_path):
    """The symptom: a TorchTitan trainer built in a fresh process gives the same log-probs on its first forward as
    on its second (GLM-4.7-Flash's MLA with YaRN: its RoPE table is float64 cos / sin; 5 of 14 processes differed
    before the settling)."""
    from zerokld_testing.deepseek import GLM_4_7_FLASH_TIES, make_deepseek_checkpoint

    ckpt = tmp_path / "glm"
    make_deepseek_checkpoint(str(ckpt), GLM_4_7_FLASH_TIES, 3, "float32")
    script = r"""
import sys, torch
from titan_plugin.models import build_titan_model
ids = torch.tensor([[1] + list(range(10, 90)) + list(range(30, 50))])
model, _, _ = build_titan_model(sys.argv[1], dtype="float32")
with torch.no_grad():
    print("same" if torch.equal(model(ids), model(ids)) else "differ")
"""
    outcomes = [_fresh_python(script, str(ckpt), timeout=240) for _ in range(8)]
    assert outcomes == ["same"] * 8, outcomes
