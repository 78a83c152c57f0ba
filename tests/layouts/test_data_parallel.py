"""TorchTitan's data parallelism (FSDP 2, each rank half the batch): two streamed steps and ``rl_step`` end with one
rank's weights, against stock TorchTitan at DP 2."""

from __future__ import annotations

import pytest

from tests.layouts.launch import check_trains_like_one_rank

pytestmark = pytest.mark.long  # minutes of TP 2 engines and trainers: `make test-long`


@pytest.mark.extended  # `make test-extended`: DP 2 trains exactly in the CP 2 x DP 2 run too
@pytest.mark.titan
@pytest.mark.tp
@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_data_parallel_2_trains_like_one_rank(tmp_path, family):
    """Issue 56 point 6: FSDP over two data-parallel ranks (gloo), each streaming its own half of the batch through
    ``forward_backward`` (one batched forward and backward per call, exact accumulation with the chains handed from
    rank 0 to rank 1), then ``optim_step``, twice: the log-probs before, during and after the steps, each step's
    gradient norm and every HF weight are one rank's bit for bit (its ``forward_backward`` on the whole batch) — for
    Qwen3 and Qwen3-MoE (router and experts). ``rl_step`` at DP 2 takes the same path and gives the same bits.
    Negative control: TorchTitan's stock components at DP 2 (FSDP's reduce-scatter of each rank's gradients) end
    with other weights than stock on one rank."""
    check_trains_like_one_rank(tmp_path, family, "DP 2")
