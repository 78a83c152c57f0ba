"""TorchTitan's ``pipeline_parallel_degree`` 2 (its ``pipeline_llm`` stages and ``torch.distributed.pipelining``
schedules), alone and with data parallelism: one rank's bits; and the schedules it refuses because they cannot stay
exact."""

from __future__ import annotations

import pytest
import torch

from tests.layouts.launch import pipeline_checkpoint, same_run, trainer_tp
from zerokld_testing.controls import stock_differs

pytestmark = pytest.mark.long  # minutes of TP 2 engines and trainers: `make test-long`


@pytest.mark.titan
@pytest.mark.tp
@pytest.mark.timeout(900)
def test_pipeline_parallel_2_equals_one_rank(tmp_path):
    """Issue 56 point 1: TorchTitan's ``pipeline_parallel_degree`` 2 (its ``pipeline_llm`` stages and the
    ``torch.distributed.pipelining`` schedules 1F1B, Interleaved1F1B and GPipe, with micro-batches of one and two
    rollouts) gives one rank's log-probs bit for bit — before, during and after RL steps — and after two
    ``rl_step``s every weight of the model (HF names, gathered from both stages) equals one rank's after the same
    two streamed steps (``forward_backward`` + ``optim_step``, exact accumulation); with the fused lm_head loss on
    the last stage too (1F1B). The sequences have different
    lengths; the schedule sees each padded to ``seq_len``. Negative control: TorchTitan's stock components at PP 2
    (micro-batches of two rollouts, autograd accumulating their gradients) end the same steps with other weights
    and other log-probs than stock on one rank."""
    from zerokld_testing import random_prompts

    ckpt = pipeline_checkpoint(tmp_path)
    seqs = random_prompts(6, seed=41, lo=12, hi=60)
    lens = [len(s) // 2 for s in seqs]
    common = dict(train_step=True, weights=True, steps=2, seq_len=64)

    def run(nproc=None, batch_invariant=True, **layout):
        return trainer_tp(
            tmp_path, ckpt, "float32", 1, seqs, lens, batch_invariant, None, nproc=nproc, **common, **layout
        )

    one = run(streaming=True)
    assert not torch.equal(torch.cat(one["after"]), torch.cat(one["logprobs"]))  # the steps moved the weights
    for layout in (
        dict(pp_schedule="1F1B", pp_microbatches=4),
        dict(pp_schedule="Interleaved1F1B", pp_microbatches=2, pp_microbatch_size=2),
        dict(pp_schedule="GPipe", pp_microbatches=2),
    ):
        same = same_run(one, run(pp=2, **layout))
        assert all(same.values()), (layout, same)
    # the fused lm_head loss: the last stage scores its hidden states with lm_head(h, targets=...)
    fused = same_run(run(streaming=True, fused=True), run(pp=2, pp_schedule="1F1B", pp_microbatches=4, fused=True))
    assert all(fused.values()), fused
    stock_one = run(batch_invariant=False, streaming=True)
    stock_pp = run(batch_invariant=False, pp=2, pp_microbatches=2, pp_microbatch_size=2)
    same = same_run(stock_one, stock_pp)
    stock_differs(not same["weights"], "TorchTitan's trainer at PP 2 (micro-batches of 2) vs one rank", "the prompts")


@pytest.mark.extended  # `make test-extended`: PP 2 on Qwen3 is the default instance
@pytest.mark.titan
@pytest.mark.tp
@pytest.mark.timeout(900)
def test_pipeline_parallel_2_on_qwen3_moe_equals_one_rank(tmp_path):
    """Issue 56 point 1 on Qwen3-MoE (every layer a top-2 MoE, one layer per stage): at PP 2 (1F1B, four
    micro-batches) the log-probs and the weights after an RL step — the router's and every expert's included — are
    one rank's bit for bit."""
    from zerokld_testing import random_prompts

    ckpt = pipeline_checkpoint(tmp_path, "qwen3_moe")
    seqs = random_prompts(6, seed=43, lo=12, hi=60)
    lens = [len(s) // 2 for s in seqs]
    common = dict(train_step=True, weights=True, seq_len=64)
    one = trainer_tp(tmp_path, ckpt, "float32", 1, seqs, lens, tp_k_block=None, streaming=True, **common)
    pp = trainer_tp(tmp_path, ckpt, "float32", 1, seqs, lens, tp_k_block=None, pp=2, pp_microbatches=4, **common)
    same = same_run(one, pp)
    assert all(same.values()), same


@pytest.mark.extended  # `make test-extended`: DP 2 and PP 2 are each proven alone
@pytest.mark.titan
@pytest.mark.tp
@pytest.mark.timeout(900)
def test_data_parallel_2_x_pipeline_parallel_2_equals_one_rank(tmp_path):
    """Issue 56 point 4, DP 2 x PP 2 on 4 ranks (gloo): FSDP over two data-parallel ranks, each pair a two-stage
    pipeline (1F1B) training on its own half of the sequences: the log-probs before, during and after two RL steps,
    the gradient norms and every HF weight are one rank's bit for bit (the stages' chains handed from data-parallel
    rank to rank). Negative control: TorchTitan's stock components at the same layout give other log-probs than
    vLLM's (one rank's) and other weights than stock on one rank."""
    from zerokld_testing import random_prompts

    ckpt = pipeline_checkpoint(tmp_path)
    seqs = random_prompts(6, seed=45, lo=12, hi=60)
    lens = [len(s) // 2 for s in seqs]
    common = dict(train_step=True, weights=True, steps=2, seq_len=64)
    one = trainer_tp(tmp_path, ckpt, "float32", 1, seqs, lens, tp_k_block=None, streaming=True, **common)
    layout = dict(nproc=4, split=True, pp=2, pp_microbatches=2, **common)
    mine = trainer_tp(tmp_path, ckpt, "float32", 1, seqs, lens, tp_k_block=None, streaming=True, **layout)
    same = same_run(one, mine)
    assert all(same.values()), same
    assert len(mine["grad_norm"]) == 2 and one["grad_norm"] == mine["grad_norm"]
    stock = trainer_tp(tmp_path, ckpt, "float32", 1, seqs, lens, batch_invariant=False, **layout)
    stock_differs(
        not torch.equal(torch.cat(stock["logprobs"]), torch.cat(one["logprobs"])),
        "TorchTitan at DP 2 x PP 2 vs vLLM's bits",
        "the prompts",
    )
    stock_one = trainer_tp(tmp_path, ckpt, "float32", 1, seqs, lens, batch_invariant=False, **common)
    stock_differs(not same_run(stock_one, stock)["weights"], "TorchTitan at DP 2 x PP 2 vs one rank", "the prompts")


@pytest.mark.titan
@pytest.mark.tp
@pytest.mark.timeout(900)
def test_pipeline_parallel_refuses_what_it_cannot_keep_exact(tmp_path):
    """Under PP 2, a call the pipeline cannot keep exact is refused with the reason, nothing run: routing replay
    (R3: the routes would have to follow the micro-batches; not yet), and an RL step in bf16 on a CPU whose bf16
    GEMMs cannot run exact accumulation (AVX-512 without AMX); where they can, bf16 steps equal one rank's."""
    import numpy as np

    from shared_numerics.grad_chain import chain_available
    from zerokld_testing import TinyModelSpec, make_tiny_checkpoint, random_prompts

    seqs = random_prompts(4, seed=47, lo=12, hi=60)
    lens = [len(s) // 2 for s in seqs]
    moe = pipeline_checkpoint(tmp_path, "qwen3_moe")
    rng = np.random.default_rng(47)
    routes = [[[rng.permutation(8)[:2].tolist() for _ in range(2)] for _ in range(len(s) - 1)] for s in seqs]
    pp = dict(pp=2, pp_microbatches=2, seq_len=64)
    refused = trainer_tp(
        tmp_path, moe, "float32", 1, seqs, lens, tp_k_block=None, routes=routes, refusal="logprobs", **pp
    )
    assert refused["refused"].startswith("NotImplementedError: routing replay (R3) under pipeline parallelism")
    bf16 = str(make_tiny_checkpoint(tmp_path / "bf16", TinyModelSpec(num_hidden_layers=4), seed=1, dtype="bfloat16"))
    if chain_available(torch.bfloat16):
        one = trainer_tp(
            tmp_path, bf16, "bfloat16", 1, seqs, lens, tp_k_block=None, streaming=True, train_step=True, weights=True
        )
        two = trainer_tp(
            tmp_path, bf16, "bfloat16", 1, seqs, lens, tp_k_block=None, train_step=True, weights=True, **pp
        )
        same = same_run(one, two)
        assert all(same.values()), same
    else:
        refused = trainer_tp(tmp_path, bf16, "bfloat16", 1, seqs, lens, tp_k_block=None, refusal="train", **pp)
        assert refused["refused"].startswith("NotImplementedError: training under pipeline parallelism needs exact")
