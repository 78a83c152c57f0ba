"""TorchTitan's ``context_parallel_degree`` 2 with the zerokld attention: one rank's log-probs and training steps,
against stock TorchTitan at CP 2."""

from __future__ import annotations

import pytest
import torch

from tests.layouts.launch import check_trains_like, same_run, trainer_tp
from zerokld_testing.controls import stock_differs

pytestmark = pytest.mark.long  # minutes of TP 2 engines and trainers: `make test-long`


@pytest.mark.extended  # `make test-extended`: CP 2 == one rank is also compared by the CP training test
@pytest.mark.titan
@pytest.mark.tp
@pytest.mark.timeout(900)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_context_parallel_2_equals_one_rank(tmp_path, checkpoint_factory, dtype):
    """Issue 56 point 2: TorchTitan's ``context_parallel_degree`` 2 with the zerokld attention (each rank a contiguous
    half of every sequence, K/V all-gathered over the ``cp`` mesh dimension as a DTensor, the same fixed key-chunk
    order): every log-prob equals one rank's — which vLLM serves (``tests/models/test_vllm_parity.py``) — bit for bit,
    unfused and fused, on Qwen3 and on Qwen3-MoE with random routes replayed (R3, sliced like the tokens); CP 2 x DP 2
    on 4 ranks too. Negative controls: TorchTitan's own CP cannot
    run on CPU (its SDPA CP has no sharding strategy for the CPU flash-attention op), and the stock trainer's
    log-probs on one rank differ from these."""
    import numpy as np

    from titan_plugin import trainer_logprobs
    from zerokld_testing import random_prompts

    seqs = random_prompts(6, seed=51, lo=12, hi=90)  # lengths that do not split evenly: the last slice is padded
    lens = [len(s) // 2 for s in seqs]
    qwen3 = checkpoint_factory("qwen3", dtype)
    one = trainer_logprobs(qwen3, seqs, lens, dtype=dtype)
    for fused in (False, True):
        cp2 = trainer_tp(tmp_path, qwen3, dtype, 1, seqs, lens, tp_k_block=None, fused=fused, cp=2)["logprobs"]
        assert len(cp2) == len(one) == 6 and torch.equal(torch.cat(cp2), torch.cat(one)), fused
    layout = dict(nproc=4, split=True, cp=2)
    cp2dp2 = trainer_tp(tmp_path, qwen3, dtype, 1, seqs, lens, tp_k_block=None, **layout)["logprobs"]
    assert torch.equal(torch.cat(cp2dp2), torch.cat(one))
    moe = checkpoint_factory("qwen3_moe", dtype)
    rng = np.random.default_rng(51)
    routes = [[[rng.permutation(8)[:2].tolist() for _ in range(2)] for _ in range(len(s) - 1)] for s in seqs]
    replayed = trainer_logprobs(
        moe, seqs, lens, dtype=dtype, routed_experts=[np.array(r, dtype=np.int16) for r in routes]
    )
    cp2 = trainer_tp(tmp_path, moe, dtype, 1, seqs, lens, tp_k_block=None, routes=routes, cp=2)["logprobs"]
    assert torch.equal(torch.cat(cp2), torch.cat(replayed))
    stock = trainer_tp(tmp_path, qwen3, dtype, 1, seqs, lens, batch_invariant=False, cp=2, fails=True)
    assert "does not have a sharding strategy registered" in stock
    stock_one = trainer_logprobs(qwen3, seqs, lens, dtype=dtype, batch_invariant=False)
    stock_differs(
        not torch.equal(torch.cat(stock_one), torch.cat(one)), "TorchTitan's trainer vs vLLM's bits", "the prompts"
    )


@pytest.mark.titan
@pytest.mark.tp
@pytest.mark.timeout(900)
def test_context_parallel_2_trains_like_one_rank(tmp_path, checkpoint_factory):
    """Training under context parallelism gives one rank's bits (float32, two streamed steps), at CP 2, at CP 2 x
    DP 2 (4 ranks, each data-parallel pair its half of the rollouts) and at CP 2 x HSDP's two replicas
    (``data_parallel_replicate_degree`` 2): the log-probs, the step's log-probs and loss,
    every parameter's gradient, both gradient norms and every weight. Each rank runs the whole sequences' attention
    and its backward (``dq``, ``dk``, ``dv`` one rank's; it keeps its slices), and exact accumulation runs one rollout
    per pass, every pass replayed in one rank's token order (``titan_plugin.context_parallel``,
    ``ExactAccumulation``). Its earlier form caught a lost gradient term (``DTensor.full_tensor``'s own backward
    treats the gathered keys' gradient as replicated: a gradient norm 12% off). Negative control: with exact
    accumulation off (one pass, FSDP summing the ranks' gradients) CP 2's gradients differ from one rank's. GSPO (its
    sequence-level ratio would span the ranks) is refused."""
    from zerokld_testing import random_prompts

    ckpt = checkpoint_factory("qwen3", "float32")
    seqs = random_prompts(6, seed=53, lo=12, hi=90)
    lens = [len(s) // 2 for s in seqs]
    ref = {"tp": 1, "tp_k_block": None}
    cp_dp = {**ref, "cp": 2, "nproc": 4, "split": True}
    cp_hsdp = {**cp_dp, "dp_replicate": 2}  # HSDP: two replicas of FSDP over the cp ranks
    runs = check_trains_like(tmp_path, ckpt, seqs, ref, {**ref, "cp": 2}, cp_dp, cp_hsdp, exact=True)
    assert [run["exact_accumulation_off"] for run in runs] == [None] * 4
    assert runs[3]["parallel_dims"] == {"dp_replicate": 2, "dp_shard": 1, "cp": 2}  # HSDP's replicas, not FSDP
    one, cp2 = runs[:2]
    same = same_run(one, cp2, keys=("logprobs", "step_logprobs"), weights=False)
    assert all(same.values()) and one["loss"] == cp2["loss"], same
    spec = dict(train_step=True, streaming=True, grads=True, cp=2, exact=False)
    summed = trainer_tp(tmp_path, ckpt, "float32", 1, seqs, lens, tp_k_block=None, **spec)
    assert summed["grads"].keys() == one["grads"].keys()
    stock_differs(
        any(not torch.equal(g, summed["grads"][k]) for k, g in one["grads"].items()),
        "CP 2's gradients summed over the ranks (exact accumulation off) vs one rank's",
        "the prompts",
    )
    refused = trainer_tp(
        tmp_path, ckpt, "float32", 1, seqs, lens, tp_k_block=None, cp=2, loss_fn="gspo", refusal="train"
    )
    assert refused["refused"].startswith("NotImplementedError: GSPO under context parallelism")
