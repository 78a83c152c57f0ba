"""TorchTitan's trainer at ``tensor_parallel_degree`` 2 (``tp_k_block``), alone and with expert parallelism, FSDP and
HSDP: the log-probs, gradients, gradient norms and weights of TP 1, against stock TorchTitan at the same layouts."""

from __future__ import annotations

import pytest
import torch

from tests.layouts.launch import K_BLOCK, check_trains_like, same_run, trainer_tp
from zerokld_testing.controls import stock_differs

pytestmark = pytest.mark.long  # minutes of TP 2 engines and trainers: `make test-long`


@pytest.mark.extended  # `make test-extended`: the trainer's stock control is also trains_like_tp_1's
@pytest.mark.titan
@pytest.mark.tp
@pytest.mark.timeout(600)
def test_stock_trainer_tp2_differs_from_tp1(tmp_path, checkpoint_factory):
    """Negative control for the trainer: TorchTitan's stock components at TP 2 (row-parallel all-reduce) give other
    log-probs than at TP 1, for the same sequences and weights."""
    from zerokld_testing import random_prompts

    ckpt = checkpoint_factory("qwen3", "bfloat16")
    seqs = random_prompts(4, seed=21, lo=20, hi=60)
    lens = [len(s) // 2 for s in seqs]
    tp1 = trainer_tp(tmp_path, ckpt, "bfloat16", 1, seqs, lens, batch_invariant=False)["logprobs"]
    tp2 = trainer_tp(tmp_path, ckpt, "bfloat16", 2, seqs, lens, batch_invariant=False)["logprobs"]
    assert any(not torch.equal(a, b) for a, b in zip(tp1, tp2, strict=True))


@pytest.mark.titan
@pytest.mark.tp
@pytest.mark.timeout(900)
def test_glm5_sparse_attention_trains_at_tensor_parallel_2_x_expert_parallel_2_like_tp_1(tmp_path):
    """GLM-5's DeepSeek Sparse Attention in TorchTitan's ``deepseek_v3`` at TP 2 x EP 2 (``tp_k_block``, float32; TP on
    DeepSeekMoE needs EP, as for DeepSeek-V3): each rank two of the four MLA heads, the indexer whole on every rank
    (the same selection), the selecting rows' latent gradient added over the heads in the TP-aligned tree as the
    dense rows' is. Two streamed steps on sequences of 30-70 tokens (past ``index_topk`` 32) give TP 1's log-probs,
    every gradient, the gradient norms and every weight bit for bit; the indexer's weights (not trained) stay the
    checkpoint's, every other weight moves."""
    import dataclasses
    import glob

    from safetensors.torch import load_file

    from zerokld_testing import random_prompts
    from zerokld_testing.deepseek import GLM_4_7_FLASH_TIES, make_deepseek_checkpoint

    spec = dataclasses.replace(
        GLM_4_7_FLASH_TIES, architecture="GlmMoeDsaForCausalLM", index_topk_freq=2, vocab_size=128
    )
    ckpt = str(make_deepseek_checkpoint(tmp_path / "glm5", spec, seed=3))
    seqs = random_prompts(6, seed=51, lo=30, hi=70)
    assert sum(len(s) > spec.index_topk for s in seqs) >= 3
    lens = [len(s) // 2 for s in seqs]
    run = dict(train_step=True, weights=True, steps=2, streaming=True, grads=True)
    one, two = (trainer_tp(tmp_path, ckpt, "float32", tp, seqs, lens, ep=tp, **run) for tp in (1, 2))
    assert torch.equal(torch.cat(one["logprobs"]), torch.cat(two["logprobs"]))
    assert one["grads"].keys() == two["grads"].keys() and len(one["grads"]) > 10
    assert [k for k, g in one["grads"].items() if not torch.equal(g, two["grads"][k])] == []
    assert one["grad_norm"] == two["grad_norm"] and len(one["grad_norm"]) == 2
    assert one["weights"].keys() == two["weights"].keys()
    assert [k for k, w in one["weights"].items() if not torch.equal(w, two["weights"][k])] == []
    start = {}
    for f in glob.glob(f"{ckpt}/*.safetensors"):
        start.update(load_file(f))
    for name, w in one["weights"].items():
        moved = not torch.equal(w, start[name].float())
        assert moved != (".indexer." in name), name


@pytest.mark.titan
@pytest.mark.tp
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "layout",
    [
        # `make test-extended`, both: TP 2 x EP 2 training is proven on Qwen3-MoE (the same ExpertParallelInputs
        # exchange), DeepSeek-V3's forward at TP 2 x EP 2 by test_vllm_tp2_serves_deepseek_v3_as_the_trainer_...
        pytest.param({"tp": 2, "ep": 2}, marks=pytest.mark.extended),
        pytest.param({"tp": 2, "ep": 2, "nproc": 4, "split": True}, marks=pytest.mark.extended),
    ],
    ids=["tp2xep2", "fsdp2xtp2xep2"],
)
def test_deepseek_v3_tensor_parallel_2_x_expert_parallel_2_trains_like_tp_1(tmp_path, layout):
    """TorchTitan's ``deepseek_v3`` at TP 2 x EP 2 (``tp_k_block``, float32; MLA with YaRN, DeepSeekMoE with tied
    group scores and a shared expert): each rank two of the four heads (``wq_b`` and ``wkv_b`` by head, ``wq_a`` /
    ``wkv_a`` / the norms replicated), the experts whole on their EP rank, the shared expert split over its
    intermediate size. Every sum TP splits is the fixed tree: ``wo`` and the shared expert's ``w2`` forward, the
    query projections' and the shared expert's input gradients, and the latent's gradient — the keys' and values'
    gradients summed over the heads, which TP splits (``shared_numerics.mla.mla_dense_attention`` ``head_tree``); the
    MoE input's gradient adds router, shared and routed branches in one fixed order. Two streamed steps give TP 1's
    log-probs, gradients, gradient norms and weights bit for bit, with batched exact accumulation (``wkv_b``'s
    per-head chain holds this rank's heads). Negative control: TorchTitan's stock components at TP 2 x EP 2 give
    other log-probs than at TP 1."""
    from zerokld_testing import random_prompts
    from zerokld_testing.deepseek import DeepSeekSpec, make_deepseek_checkpoint

    spec = DeepSeekSpec(yarn=True, group_ties=True, vocab_size=128)  # 128: the lm_head's input gradient in the tree
    ckpt = str(make_deepseek_checkpoint(tmp_path / "ds", spec, seed=3))
    seqs = random_prompts(6, seed=51, lo=12, hi=60)
    runs = check_trains_like(tmp_path, ckpt, seqs, {"tp": 1}, dict(layout), exact=True)
    assert [run["exact_accumulation_off"] for run in runs] == [None, None]  # batched chains on both
    if layout.get("nproc"):
        return
    # stock TorchTitan at TP 2 x EP 2 (sequence parallel: an even padded length, 64) vs one rank
    seqs = [s[:64] for s in random_prompts(6, seed=37, lo=12, hi=70)]
    lens = [len(s) // 2 for s in seqs]
    stock = [
        trainer_tp(tmp_path, ckpt, "float32", tp, seqs, lens, batch_invariant=False, ep=tp)["logprobs"] for tp in (1, 2)
    ]
    stock_differs(
        not torch.equal(torch.cat(stock[0]), torch.cat(stock[1])),
        "TorchTitan's stock deepseek_v3 at TP 2 x EP 2 vs TP 1",
        "the prompts",
    )


@pytest.mark.titan
@pytest.mark.tp
@pytest.mark.timeout(900)
def test_tensor_parallel_2_x_expert_parallel_2_equals_one_rank(tmp_path, checkpoint_factory):
    """Issue 56 point 4, TP 2 x EP 2 on Qwen3-MoE (``tp_k_block``, bf16): TorchTitan borrows the TP ranks for EP, so
    both ranks hold the same tokens and 4 of the 8 whole experts each. Each rank exchanges only its share of the
    tokens' rows (first half / second half), its experts compute them with TP 1's down-projection tree, and the rows
    are all-gathered and combined in slot order on every rank. On 2 ranks (TP 2 x EP 2) and on 4 (FSDP 2 x TP 2 x
    EP 2, each data-parallel rank its half of the batch) every log-prob equals one rank's with the same
    ``tp_k_block`` (vLLM's at TP 1 and 2: ``test_vllm_tp2_equals_the_trainer_at_tp1_and_tp2``), with routes
    replayed (R3) too, and an RL step trains through it; two streamed float32 steps give one rank's gradients,
    gradient norms and weights bit for bit (each expert's gradient counted once; the MoE input's gradient adds each
    token's slots in slot order and the router's whole gradient on every rank), at TP 2 x EP 2 and at FSDP 2 x TP 2 x
    EP 2 (each data-parallel rank streaming its half of the batch, the experts' chains handed between the
    data-parallel ranks of each EP rank), all with batched exact accumulation. Negative control: TorchTitan's stock
    MoE at TP 2 x EP 2 differs from one rank's bits."""
    import dataclasses

    import numpy as np

    from tests.conftest import SPECS
    from titan_plugin import trainer_logprobs
    from zerokld_testing import make_tiny_checkpoint, random_prompts

    dtype = "bfloat16"
    ckpt = checkpoint_factory("qwen3_moe", dtype)
    # at most 64 tokens: stock TorchTitan's TP x EP (sequence parallel) fails on an odd padded length (65 here)
    seqs = [s[:64] for s in random_prompts(6, seed=37, lo=12, hi=70)]
    lens = [len(s) // 2 for s in seqs]
    one = trainer_logprobs(ckpt, seqs, lens, dtype=dtype, tp_k_block=K_BLOCK)
    two = trainer_tp(tmp_path, ckpt, dtype, 2, seqs, lens, train_step=True, ep=2)
    assert two["expert_parallel_sizes"] == [2]  # every zerokld MoE block ran expert-parallel
    assert len(two["logprobs"]) == len(one) == 6 and torch.equal(torch.cat(two["logprobs"]), torch.cat(one))
    assert np.all(np.isfinite(two["loss"]))
    assert not torch.equal(torch.cat(two["after"]), torch.cat(one))  # the step moved the weights
    four = trainer_tp(tmp_path, ckpt, dtype, 2, seqs, lens, train_step=True, ep=2, nproc=4, split=True)
    assert len(four["logprobs"]) == 6 and torch.equal(torch.cat(four["logprobs"]), torch.cat(one))
    assert np.all(np.isfinite(four["loss"]))
    rng = np.random.default_rng(37)  # R3: arbitrary valid routes ([len - 1, MoE layers, top_k], distinct per row)
    routes = [
        np.stack([np.stack([rng.permutation(8)[:2] for _ in range(2)]) for _ in range(len(s) - 1)])
        .astype(np.int16)
        .tolist()
        for s in seqs
    ]
    replayed_one = trainer_logprobs(
        ckpt, seqs, lens, dtype=dtype, tp_k_block=K_BLOCK, routed_experts=[np.array(r, dtype=np.int16) for r in routes]
    )
    assert not torch.equal(torch.cat(replayed_one), torch.cat(one))
    replayed = trainer_tp(tmp_path, ckpt, dtype, 2, seqs, lens, ep=2, routes=routes)
    assert torch.equal(torch.cat(replayed["logprobs"]), torch.cat(replayed_one))
    stock = trainer_tp(tmp_path, ckpt, dtype, 2, seqs, lens, batch_invariant=False, ep=2)
    stock_differs(
        not torch.equal(torch.cat(stock["logprobs"]), torch.cat(one)),
        "TorchTitan's stock MoE at TP 2 x EP 2 vs the zerokld trainer (vLLM's bits)",
        "the prompts",
    )
    # training: every expert's gradient once (each rank exchanges its share of the tokens, not all of them), every
    # gradient and weight one rank's bit for bit (a vocabulary of 128: the lm_head's input gradient takes the tree)
    ckpt = make_tiny_checkpoint(tmp_path / "v128", dataclasses.replace(SPECS["qwen3_moe"], vocab_size=128), seed=1)
    fsdp_tp_ep = {"tp": 2, "ep": 2, "nproc": 4, "split": True}  # FSDP 2 x TP 2 x EP 2: the experts' chains handed on
    runs = check_trains_like(tmp_path, str(ckpt), seqs, {"tp": 1}, {"tp": 2, "ep": 2}, fsdp_tp_ep, exact=True)
    assert [run["exact_accumulation_off"] for run in runs] == [None] * 3  # batched chains on every layout


@pytest.mark.titan
@pytest.mark.tp
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "family,ep",
    # `make test-extended`, all: TP 2 streaming is proven composed with FSDP (test_fsdp_2_x_tensor_parallel_2_
    # streams_like_tp_2: FSDP 2 x TP 2 streamed == TP 2 batched); these add Qwen3-MoE's TP-split experts, Qwen2, EP 2
    [
        pytest.param(*c, marks=pytest.mark.extended)
        for c in [("qwen3_moe", 1), ("qwen3", 1), ("qwen2", 1), ("qwen3_moe", 2)]
    ],
)
def test_tensor_parallel_2_streams_exactly(tmp_path, checkpoint_factory, family, ep):
    """Issue 56 point 6 under TP 2 (``tp_k_block``, float32): ``forward_backward`` in batched passes with exact
    accumulation — each rank's chains over its shards (column- and row-parallel weights, the vocab-parallel embedding
    and lm_head), the replicated norm gains' chains over every token (zerokld TP keeps the activations replicated),
    Qwen3's q/k-norm gains summed over the head shards when written — so one call on the batch and three calls on
    its slices leave the same gradients: the log-probs during and after two steps, the gradient norms and every
    weight are equal. Qwen2 adds the column-parallel biases; Qwen3-MoE at TP 2 each rank's half of every expert's
    intermediate size (the down projection's chain takes ``dYᵀ act`` of its subtree root) and the router's; at TP 2 x
    EP 2 each rank's 4 whole experts, whose chains continue over every token's rows (each rank exchanges its share of
    the replicated tokens; the down projections' chains take the TP-invariant tree's ``dYᵀ act``). Negative control:
    TorchTitan's stock TP 2 (x EP 2) — one batched step (``rl_step``) vs the same rollouts accumulated over three
    ``forward_backward`` calls — ends with other weights."""
    from zerokld_testing import random_prompts

    ckpt = checkpoint_factory(family, "float32")
    seqs = random_prompts(6, seed=51, lo=12, hi=60)
    if ep > 1:  # one even padded length in every call: stock TorchTitan's TP x EP fails on an odd one
        seqs = [(s * 5)[:65] for s in seqs]
    lens = [len(s) // 2 for s in seqs]
    common = dict(train_step=True, weights=True, steps=2, streaming=True, ep=ep)

    def run(batch_invariant=True, **spec):
        k_block = K_BLOCK if batch_invariant else None
        return trainer_tp(tmp_path, ckpt, "float32", 2, seqs, lens, batch_invariant, k_block, **{**common, **spec})

    whole, sliced = run(), run(stream_calls=3)
    assert whole["exact_accumulation_off"] is None and sliced["exact_accumulation_off"] is None  # batched chains
    same = same_run(whole, sliced, keys=("logprobs", "step_logprobs", "after"))
    assert all(same.values()), same
    assert len(whole["grad_norm"]) == 2 and whole["grad_norm"] == sliced["grad_norm"]
    assert not torch.equal(torch.cat(whole["after"]), torch.cat(whole["logprobs"]))  # the steps moved the weights
    if ep > 1:
        assert whole["expert_parallel_sizes"] == [2]  # every zerokld MoE block ran expert-parallel
    # (stock TP x EP cannot score the padded length of 65 tokens; it trains on 64: weights only)
    stock_spec = {"batch_invariant": False, "score": ep == 1}
    stock = same_run(run(**stock_spec, streaming=False), run(**stock_spec, stream_calls=3), keys=())
    stock_differs(
        not stock["weights"], f"TorchTitan at TP 2 x EP {ep}: one batched step vs three accumulated", "the prompts"
    )


@pytest.mark.titan
@pytest.mark.tp
@pytest.mark.timeout(900)
def test_tensor_parallel_2_trains_like_tp_1(tmp_path):
    """TP 2 training gives TP 1's bits (Qwen3, ``tp_k_block``, float32, two streamed steps): the log-probs before the
    steps, every parameter's gradient, both gradient norms and every weight after them. Every sum TP splits is the
    fixed tree: the row-parallel forward, the column-parallel projections' input gradients (``wq``/``wk``/``wv``,
    ``w1``/``w3``, the lm_head over a vocabulary of 128), the per-head q/k-norm gains; the gradient norm is taken
    over the whole gradients. With the fused lm_head loss too (its hidden states' gradient in the same tree, its
    rows' weight gradient in chains), TP 2 streaming the batch in three calls gives TP 1's one call, both with batched
    exact accumulation. This test's earlier, to-rounding form caught the embedding defect of 2026-11-28 (the
    first layer's attention-norm path contributed nothing to the embedding's gradient at TP 2). Negative
    control: TorchTitan's stock components train to other weights at TP 2 than at TP 1."""
    import dataclasses

    from tests.conftest import SPECS
    from zerokld_testing import make_tiny_checkpoint, random_prompts

    ckpt = str(make_tiny_checkpoint(tmp_path / "ckpt", dataclasses.replace(SPECS["qwen3"], vocab_size=128), seed=1))
    seqs = random_prompts(6, seed=51, lo=12, hi=60)
    check_trains_like(tmp_path, ckpt, seqs, {"tp": 1}, {"tp": 2}, exact=True)
    # the fused lm_head loss: TP 2 streaming the batch in three calls == TP 1 in one, both batched
    fused = check_trains_like(
        tmp_path, ckpt, seqs, {"tp": 1, "fused": True}, {"tp": 2, "fused": True, "stream_calls": 3}, exact=True
    )
    assert [run["exact_accumulation_off"] for run in fused] == [None, None]
    lens = [len(s) // 2 for s in seqs]
    stock = [
        trainer_tp(tmp_path, ckpt, "float32", tp, seqs, lens, False, None, True, weights=True, steps=2)["weights"]
        for tp in (1, 2)
    ]
    stock_differs(
        any(not torch.equal(stock[0][k], stock[1][k]) for k in stock[0]),
        "TorchTitan's stock trainer's weights after two float32 steps at TP 2 vs TP 1",
        "the prompts or the steps",
    )


@pytest.mark.titan
@pytest.mark.tp
@pytest.mark.timeout(900)
def test_fsdp_2_x_tensor_parallel_2_streams_like_tp_2(tmp_path, checkpoint_factory):
    """Issue 56 point 6 with FSDP and TP at once (4 ranks: FSDP 2 x TP 2, ``tp_k_block``, float32): each
    data-parallel rank streams its half of the batch in batched passes; each TP rank's shard chains are handed
    between its two data-parallel ranks, and every rank takes its FSDP block of its TP shard's sums. Two streamed steps
    and ``rl_step`` give TP 2's (one data-parallel rank's, the whole batch) log-probs before, during and after,
    gradient norms and every weight, bit for bit. Negative control: TorchTitan's stock components at FSDP 2 x TP 2
    end with other weights than stock TP 2."""
    from zerokld_testing import random_prompts

    ckpt = checkpoint_factory("qwen3", "float32")
    seqs = random_prompts(6, seed=53, lo=12, hi=60)
    lens = [len(s) // 2 for s in seqs]
    common = dict(train_step=True, weights=True, steps=2)

    def run(batch_invariant=True, **spec):
        k_block = K_BLOCK if batch_invariant else None
        return trainer_tp(tmp_path, ckpt, "float32", 2, seqs, lens, batch_invariant, k_block, **common, **spec)

    tp2 = run(streaming=True)
    fsdp = run(streaming=True, nproc=4, split=True)
    assert tp2["exact_accumulation_off"] is None and fsdp["exact_accumulation_off"] is None  # batched chains
    same = same_run(tp2, fsdp)
    assert all(same.values()), same
    assert len(tp2["grad_norm"]) == 2 and tp2["grad_norm"] == fsdp["grad_norm"]
    assert not torch.equal(torch.cat(tp2["after"]), torch.cat(tp2["logprobs"]))  # the steps moved the weights
    assert all(same_run(tp2, run(nproc=4, split=True)).values())  # rl_step: forward_backward + optim_step
    stock = same_run(run(batch_invariant=False), run(batch_invariant=False, nproc=4, split=True))
    stock_differs(not stock["weights"], "TorchTitan at FSDP 2 x TP 2 vs TP 2", "the prompts")


@pytest.mark.titan
@pytest.mark.tp
@pytest.mark.extended  # `make test-extended`: 8 ranks on CI's 2 cores; FSDP x TP streaming is proven above
@pytest.mark.timeout(1500)
def test_hsdp_x_tensor_parallel_2_streams_like_tp_2(tmp_path, checkpoint_factory):
    """HSDP x TP (8 ranks: 2 replicas x FSDP 2 x TP 2, float32): each TP shard's chains are handed over all four
    data-parallel ranks (replicas included: the one-rank batch is theirs in rank order), and each rank takes the block
    FSDP2 keeps over its replica's ``fsdp`` ranks — not a quarter over the whole ``batch`` mesh (which raised at
    ``write_grads``). Two streamed steps give TP 2's log-probs and every weight, bit for bit, batched."""
    from zerokld_testing import random_prompts

    ckpt = checkpoint_factory("qwen3", "float32")
    seqs = random_prompts(8, seed=59, lo=12, hi=48)
    lens = [len(s) // 2 for s in seqs]
    common = dict(train_step=True, weights=True, steps=2, streaming=True)
    tp2 = trainer_tp(tmp_path, ckpt, "float32", 2, seqs, lens, **common)
    hsdp = trainer_tp(tmp_path, ckpt, "float32", 2, seqs, lens, nproc=8, split=True, dp_replicate=2, **common)
    assert hsdp["parallel_dims"] == {"dp_replicate": 2, "dp_shard": 2, "cp": 1}
    assert tp2["exact_accumulation_off"] is None and hsdp["exact_accumulation_off"] is None  # batched chains
    same = same_run(tp2, hsdp)
    assert all(same.values()), same
    assert len(tp2["grad_norm"]) == 2 and tp2["grad_norm"] == hsdp["grad_norm"]
