"""TorchTitan's ``expert_parallel_degree`` 2 on Qwen3-MoE and DeepSeekMoE: the log-probs (R3 too) and training steps
of one rank, against stock TorchTitan's MoE at EP 2."""

from __future__ import annotations

import pytest
import torch

from tests.layouts.launch import check_trains_like_one_rank, trainer_tp
from zerokld_testing.controls import stock_differs

pytestmark = pytest.mark.long  # minutes of TP 2 engines and trainers: `make test-long`


def _check_expert_parallel_2(tmp_path, ckpt, dtype, experts, moe_layers, seed, stock):
    """TorchTitan's ``expert_parallel_degree`` 2 (each rank scoring its own half of 6 sequences) against one rank:
    the same log-probs, with random valid routes replayed (R3) too; an RL step trains through the exchange; TorchTitan's
    stock MoE (``stock``: its name, for the message) at EP 2 differs from one rank's (vLLM's) bits."""
    import numpy as np

    from titan_plugin import trainer_logprobs
    from zerokld_testing import random_prompts

    seqs = random_prompts(6, seed=seed, lo=12, hi=70)
    lens = [len(s) // 2 for s in seqs]
    one = trainer_logprobs(ckpt, seqs, lens, dtype=dtype)
    ep2 = trainer_tp(tmp_path, ckpt, dtype, 1, seqs, lens, tp_k_block=None, train_step=True, ep=2, split=True)
    assert ep2["expert_parallel_sizes"] == [2]  # every zerokld MoE block ran expert-parallel
    assert len(ep2["logprobs"]) == len(one) == 6 and torch.equal(torch.cat(ep2["logprobs"]), torch.cat(one))
    assert all(np.isfinite(loss) for loss in ep2["loss"])
    assert not torch.equal(torch.cat(ep2["after"]), torch.cat(one))  # the step moved the weights
    rng = np.random.default_rng(seed)  # R3: arbitrary valid routes ([len - 1, MoE layers, top_k], distinct per row)
    routes = [
        np.stack([np.stack([rng.permutation(experts)[:2] for _ in range(moe_layers)]) for _ in range(len(s) - 1)])
        .astype(np.int16)
        .tolist()
        for s in seqs
    ]
    replayed_one = trainer_logprobs(
        ckpt, seqs, lens, dtype=dtype, routed_experts=[np.array(r, dtype=np.int16) for r in routes]
    )
    assert not torch.equal(torch.cat(replayed_one), torch.cat(one))
    replayed = trainer_tp(tmp_path, ckpt, dtype, 1, seqs, lens, tp_k_block=None, ep=2, split=True, routes=routes)
    assert torch.equal(torch.cat(replayed["logprobs"]), torch.cat(replayed_one))
    stock_run = trainer_tp(tmp_path, ckpt, dtype, 1, seqs, lens, batch_invariant=False, ep=2, split=True)
    stock_differs(
        not torch.equal(torch.cat(stock_run["logprobs"]), torch.cat(one)),
        f"TorchTitan's stock {stock} at EP 2 vs the zerokld trainer (vLLM's bits)",
        "the prompts",
    )


@pytest.mark.extended  # `make test-extended`: EP 2 == one rank is also TP 2 x EP 2's
@pytest.mark.titan
@pytest.mark.tp
@pytest.mark.timeout(600)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_expert_parallel_2_equals_one_rank(tmp_path, checkpoint_factory, dtype):
    """Issue 56 point 3: TorchTitan's ``expert_parallel_degree`` 2 on Qwen3-MoE (two ranks, each holding 4 of the 8
    experts and scoring its own half of the sequences; token rows exchanged by all-to-all, combined on their token's
    rank in slot order): every log-prob equals one rank's over the whole batch bit for bit, also with routes replayed
    (R3: random valid routes, which change the log-probs), and an RL step trains through the exchange. Negative
    control: TorchTitan's stock MoE at EP 2 differs from these log-probs (one rank's, which vLLM serves:
    ``tests/models/test_vllm_parity.py``). (Stock at EP 2 equals stock at EP 1 at these shapes: its exchange keeps each
    expert's rows and the combine order too — the invariance stock lacks is batch invariance, not EP.)"""

    _check_expert_parallel_2(
        tmp_path, checkpoint_factory("qwen3_moe", dtype), dtype, experts=8, moe_layers=2, seed=31, stock="MoE"
    )


@pytest.mark.extended  # `make test-extended`: EP 2 == one rank is proven on Qwen3-MoE
@pytest.mark.titan
@pytest.mark.tp
@pytest.mark.timeout(900)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_expert_parallel_2_on_deepseekmoe_equals_one_rank(tmp_path, dtype):
    """Issue 56 point 3 on DeepSeek-V3 (MLA + DeepSeekMoE: grouped sigmoid routing with the selection bias, 8 routed
    experts in 4 groups, a shared expert, the first layer dense): TorchTitan's ``expert_parallel_degree`` 2, each rank
    holding 4 routed experts (the router, the bias and the shared expert replicated) and scoring its own sequences,
    gives every log-prob of one rank bit for bit, with routes replayed (R3) too, and an RL step trains through the
    exchange. Negative control: TorchTitan's stock ``deepseek_v3`` at EP 2 differs from these log-probs (one rank's,
    which vLLM serves: ``tests/models/test_deepseek.py``)."""

    from zerokld_testing import DeepSeekSpec, make_deepseek_checkpoint

    spec = DeepSeekSpec(hidden_size=64, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2)
    ckpt = str(make_deepseek_checkpoint(tmp_path / f"ds_{dtype}", spec, seed=3, dtype=dtype))
    moe_layers = spec.num_hidden_layers - spec.first_k_dense_replace
    _check_expert_parallel_2(tmp_path, ckpt, dtype, experts=8, moe_layers=moe_layers, seed=33, stock="deepseek_v3")


@pytest.mark.extended  # `make test-extended`: EP training is proven by TP 2 x EP 2 training
@pytest.mark.titan
@pytest.mark.tp
@pytest.mark.timeout(900)
def test_expert_parallel_2_trains_like_one_rank(tmp_path):
    """Issue 56 points 3 and 6: TorchTitan's ``expert_parallel_degree`` 2 on Qwen3-MoE (each rank 4 of the 8 experts
    and half the batch) trains with one rank's bits: each local expert's chain continues over the rows the EP exchange
    delivers (source rank 0's first: one rank's token order), the router, attention and norms' chains are handed
    between the data-parallel ranks; two streamed steps and ``rl_step`` give one rank's log-probs, gradient norms and
    weights. Negative control: TorchTitan's stock MoE at EP 2 ends with other weights than stock on one rank."""
    check_trains_like_one_rank(tmp_path, "qwen3_moe", "EP 2", ep=2)


@pytest.mark.extended  # `make test-extended`: EP training is proven by TP 2 x EP 2 training
@pytest.mark.titan
@pytest.mark.tp
@pytest.mark.timeout(900)
def test_expert_parallel_2_on_deepseek_trains_like_one_rank(tmp_path):
    """Issue 56 points 3 and 6 on DeepSeek-V3 (MLA + DeepSeekMoE, float32): at ``expert_parallel_degree`` 2 each rank
    holds 4 of the 8 routed experts and streams half the batch; MLA's absorbed ``kv_norm`` / ``wkv_b`` chains (one
    block per head and linear), the router's and the shared expert's are handed between the data-parallel ranks, each
    routed expert's continues over the rows the EP exchange delivers; the aux-loss-free bias update counts the whole
    batch's routes. Two streamed steps and ``rl_step`` give one rank's log-probs, gradient norms and weights bit for
    bit. Negative control: TorchTitan's stock ``deepseek_v3`` at EP 2 ends with other weights than stock on one
    rank."""
    from zerokld_testing import DeepSeekSpec, make_deepseek_checkpoint

    spec = DeepSeekSpec(hidden_size=64, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2)
    ckpt = str(make_deepseek_checkpoint(tmp_path / "ds", spec, seed=3, dtype="float32"))
    check_trains_like_one_rank(tmp_path, "deepseek", "EP 2 (deepseek_v3)", ckpt=ckpt, ep=2)
