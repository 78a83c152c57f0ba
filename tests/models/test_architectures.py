"""Per-architecture folders (``zerokld_models``): the one HF-config reader, the one support check, Llama 3.x RoPE
scaling and Qwen2.5's q/k/v bias — each against Hugging Face ``transformers`` (the reference definition) and, for the
``rope_parameters``-only config, trainer == a real vLLM engine bitwise, with the negative controls that show each test
can fail."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from titan_plugin import trainer_logprobs
from zerokld_models import UnsupportedModelError, adapter_for, check_supported, read_model_config

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def test_reader_rope_base_from_rope_parameters_or_rope_theta():
    assert read_model_config(BASE).rope_theta == 10000.0
    assert read_model_config({**BASE, "rope_theta": 5e5}).rope_theta == 5e5
    only = read_model_config({**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert only.rope_theta == 1e6 and only.rope_scaling is None
    both = read_model_config({**BASE, "rope_parameters": {**LLAMA3, "rope_theta": 5e5}})
    assert both.rope_theta == 5e5 and both.rope_scaling.factor == 8.0
    old = read_model_config({**BASE, "rope_theta": 5e5, "rope_scaling": {**LLAMA3, "type": "llama3"}})
    assert old.rope_scaling.original_max_position_embeddings == 8192


def test_reader_reads_transformers_configs():
    """A ``PretrainedConfig`` (what vLLM hands a model) reads the same as its config.json."""
    from transformers import LlamaConfig

    hf = LlamaConfig(
        **{k: v for k, v in BASE.items() if k != "architectures"},
        rope_theta=5e5,
        rope_scaling=LLAMA3,
        architectures=["LlamaForCausalLM"],
    )
    cfg = read_model_config(hf)
    assert (cfg.rope_theta, cfg.rope_scaling.factor, cfg.head_dim) == (5e5, 8.0, 16)


def test_support_check_names_every_unsupported_feature():
    cfg = read_model_config(
        {**BASE, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "mlp_bias": True, "attention_bias": True}
    )
    with pytest.raises(UnsupportedModelError, match="yarn") as e:
        check_supported(cfg, adapter_for(cfg))
    assert "MLP bias" in str(e.value) and "attention bias" in str(e.value)
    qwen2 = read_model_config({**BASE, "architectures": ["Qwen2ForCausalLM"], "attention_bias": True})
    check_supported(qwen2, adapter_for(qwen2))  # Qwen2's q/k/v bias is part of its definition


def test_reader_and_support_check_on_glm_4_7_flash_configs():
    """GLM-4.7-Flash (``Glm4MoeLiteConfig``): the dense layers from ``mlp_layer_types`` (what HF builds from), GLM's
    sigmoid / ``noaux_tc`` router when the config does not name it; a layer pattern other than "dense first, then
    sparse", a ``first_k_dense_replace`` that disagrees with it (vLLM reads that one), and a partial rotary factor
    are refused by name."""
    from transformers import Glm4MoeLiteConfig

    hf = Glm4MoeLiteConfig(
        num_hidden_layers=4, n_routed_experts=8, mlp_layer_types=["dense", "dense", "sparse", "sparse"]
    )
    hf.architectures = ["Glm4MoeLiteForCausalLM"]
    cfg = read_model_config(hf)
    assert (cfg.first_k_dense_replace, cfg.scoring_func, cfg.topk_method) == (2, "sigmoid", "noaux_tc")
    assert (cfg.num_experts, cfg.kv_lora_rank, cfg.v_head_dim, cfg.rope_interleave) == (8, 512, 256, True)
    check_supported(cfg, adapter_for(cfg))
    d = {**hf.to_dict(), "first_k_dense_replace": 2, "mlp_layer_types": ["dense", "sparse", "dense", "sparse"]}
    bad = read_model_config({**d, "rope_parameters": {**d["rope_parameters"], "partial_rotary_factor": 0.5}})
    with pytest.raises(UnsupportedModelError) as e:
        check_supported(bad, adapter_for(bad))
    for what in ("mlp_layer_types ['dense', 'sparse', 'dense', 'sparse']", "first_k_dense_replace 2", "partial_rotary"):
        assert what in str(e.value)


def _hf_logprobs(ckpt: str, seqs: list[list[int]]) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for s in seqs:
            logits = model(torch.tensor([s])).logits[0, :-1].float()
            out.append(torch.log_softmax(logits, -1).gather(1, torch.tensor(s[1:])[:, None])[:, 0])
    return out


def _seqs(n: int, seed: int, length: int = 300) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 100) for _ in range(length)] for _ in range(n)]


def test_each_plugin_builds_its_side_from_the_declaration():
    """The folders only declare: vLLM's registry keeps its own class for every declared architecture (the declared
    ``vllm_base``, what a stock engine builds, untouched), and with the switch on the ``initialize_model`` seam builds
    the one class over the plan, which carries vLLM's LoRA interface and pickles by name; a declaration with an
    unknown RoPE kind is refused when it is made."""
    import pickle

    from vllm import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_lora

    from vllm_plugin.models.model import ZeroKLDForCausalLM
    from vllm_plugin.register import register
    from zerokld_plugins import ModelAdapterSpec, registered, resolve

    register()
    archs = registered("model")
    assert {
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "LlamaForCausalLM",
        "Qwen2ForCausalLM",
        "DeepseekV3ForCausalLM",
        "DeepseekV2ForCausalLM",
        "Glm4MoeLiteForCausalLM",
    } <= set(archs)
    for arch, reg in archs.items():
        stock = ModelRegistry._try_load_model_cls(arch)
        assert stock is resolve(reg.spec.vllm_base), arch
        assert not issubclass(stock, ZeroKLDForCausalLM)
    assert supports_lora(ZeroKLDForCausalLM)
    assert pickle.loads(pickle.dumps(ZeroKLDForCausalLM)) is ZeroKLDForCausalLM
    with pytest.raises(ValueError, match="rope must be"):
        ModelAdapterSpec(
            architecture="X",
            vllm_base="a:b",
            titan_model="a:b",
            titan_block="a:b",
            titan_state_dict_adapter="a:b",
            rope="yarn",
        )


@pytest.mark.titan
@pytest.mark.parametrize("family", ["qwen2", "llama31", "qwen3_rope_parameters"])
def test_trainer_is_the_transformers_model(checkpoint_factory, tmp_path, family):
    """The trainer's model is HF's (tolerance: different kernels); the config's RoPE settings matter at these
    positions: dropping them (the trainer's old reader: ``rope_theta`` only, default 10000, no scaling) moves the
    logprobs by far more than the tolerance."""
    ckpt = checkpoint_factory(family, "float32")
    seqs = _seqs(2, seed=3)
    ref = _hf_logprobs(ckpt, seqs)
    ours = trainer_logprobs(ckpt, seqs, [1, 1], dtype="float32")
    assert max((a - b).abs().max().item() for a, b in zip(ours, ref, strict=True)) < 1e-4
    # negative control: the same weights with the RoPE settings an rope_theta-only reader would have used
    plain = tmp_path / "plain"
    shutil.copytree(ckpt, plain)
    config = json.loads((plain / "config.json").read_text())
    for key in ("rope_theta", "rope_scaling", "rope_parameters"):
        config.pop(key, None)
    (plain / "config.json").write_text(json.dumps(config))
    wrong = trainer_logprobs(str(plain), seqs, [1, 1], dtype="float32")
    assert max((a - b).abs().max().item() for a, b in zip(wrong, ref, strict=True)) > 1e-3


@pytest.mark.titan
@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama", "llama31", "qwen3_moe"])
def test_stock_titan_build_is_the_transformers_model(checkpoint_factory, family):
    """The stock trainer (TorchTitan's own components, what the KL table and the stock RL run compare against) is
    HF's function of the weights, within kernel tolerance, in every architecture (Qwen3-MoE: TorchTitan's
    ``GroupedExperts`` computes the experts in bf16 whatever the model dtype, ``torchtitan/models/common/moe.py``, hence
    the wider bound). Negative control: casting the whole module (``nn.Module.to``, buffers included) makes llama3's
    complex RoPE cache real, so RoPE rotates nothing."""
    from titan_plugin.logprobs import sequence_logprobs
    from titan_plugin.models import build_titan_model

    ckpt = checkpoint_factory(family, "float32")
    seqs = _seqs(2, seed=4)
    ref = _hf_logprobs(ckpt, seqs)
    model, _, _ = build_titan_model(ckpt, dtype="float32", batch_invariant=False)
    model.eval()
    with torch.no_grad():
        stock = sequence_logprobs(model, seqs, [1, 1])
        assert max((a - b).abs().max().item() for a, b in zip(stock, ref, strict=True)) < (
            5e-2 if family == "qwen3_moe" else 1e-4
        )
        if family.startswith("llama"):
            model.to(torch.float32)  # what build_titan_model did before it cast parameters only
            wrong = sequence_logprobs(model, seqs, [1, 1])
            assert max((a - b).abs().max().item() for a, b in zip(wrong, ref, strict=True)) > 1e-2


@pytest.fixture(scope="module")
def rope_parameters_rollouts(engine_slot, checkpoint_factory):
    """A real zerokld vLLM engine (float32) on the ``rope_parameters``-only checkpoint, and 12 sampled rollouts."""
    from vllm import SamplingParams

    from vllm_plugin.engines import start_llm

    ckpt = checkpoint_factory("qwen3_rope_parameters", "float32")
    llm = engine_slot.get(
        ("zerokld", "qwen3_rope_parameters", "float32"), lambda: start_llm(ckpt, dtype="float32", batch_invariant=True)
    )
    rng = random.Random(9)
    prompts = [[1] + [rng.randrange(3, 100) for _ in range(rng.randrange(60, 200))] for _ in range(12)]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=16, temperature=1.0, logprobs=0, ignore_eos=True),
        use_tqdm=False,
    )
    return ckpt, outs


@pytest.mark.vllm
@pytest.mark.titan
def test_rope_parameters_only_config_trainer_equals_vllm(rope_parameters_rollouts, tmp_path):
    """config.json with the RoPE base only inside ``rope_parameters`` (transformers >= 4.56): vLLM and the trainer
    read it through the same reader, so sampled logprobs are the trainer's bit for bit. Negative control: the trainer
    on the same weights with the default base (what it read before there was one reader) gives other bits."""
    from shared_numerics.rollout import RolloutBatch

    ckpt, outs = rope_parameters_rollouts
    assert "rope_theta" not in json.loads(Path(ckpt, "config.json").read_text())
    batch = RolloutBatch.from_vllm(outs)
    train = trainer_logprobs(ckpt, batch.sequences, batch.prompt_lengths, dtype="float32")
    assert all(torch.equal(t, q) for t, q in zip(train, batch.sampler_logprobs, strict=True))
    default_base = tmp_path / "default_base"
    shutil.copytree(ckpt, default_base)
    config = json.loads((default_base / "config.json").read_text())
    config.pop("rope_parameters")
    (default_base / "config.json").write_text(json.dumps(config))
    wrong = trainer_logprobs(str(default_base), batch.sequences, batch.prompt_lengths, dtype="float32")
    assert sum(not torch.equal(t, q) for t, q in zip(wrong, batch.sampler_logprobs, strict=True)) == len(outs)


@pytest.mark.vllm
@pytest.mark.titan
def test_trainer_refuses_rollouts_of_an_engine_in_another_mode(rope_parameters_rollouts, tmp_path):
    """Every rollout carries the engine's numerics mode; a trainer in another mode (bf16 trainer, fp32 engine)
    refuses the batch with an error naming both modes, before any forward (weights and step unchanged). Control: the
    trainer in the engine's mode trains on the same batch, its training forward bitwise the sampler's logprobs."""
    from shared_numerics import NumericsMismatchError, NumericsMode
    from shared_numerics.rollout import RolloutBatch
    from titan_plugin.rl import RLTrainer, rl_trainer_config

    ckpt, outs = rope_parameters_rollouts
    engine_mode = NumericsMode.build(True, "float32")
    assert all(o.outputs[0].zerokld_numerics == engine_mode.to_dict() for o in outs)
    batch = RolloutBatch.from_vllm(outs, advantages=[1.0, -1.0] * 6)
    assert batch.numerics == engine_mode
    for dtype in ("bfloat16", "float32"):
        trainer = RLTrainer(rl_trainer_config(ckpt, str(tmp_path / dtype), dtype=dtype, lr=1e-3))
        try:
            if dtype == "bfloat16":
                before = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
                with pytest.raises(NumericsMismatchError) as e:
                    trainer.rl_step(batch)
                assert "dtype=bfloat16" in str(e.value) and "dtype=float32" in str(e.value)
                assert trainer.step == 0
                assert all(torch.equal(v, before[k]) for k, v in trainer.model.state_dict().items())
            else:
                out = trainer.rl_step(batch)
                assert all(
                    torch.equal(t, q) for t, q in zip(out["train_logprobs"], batch.sampler_logprobs, strict=True)
                )
        finally:
            trainer.close()


def test_factory_pads_the_vocabulary_to_vocab_size(tmp_path):
    """``TinyModelSpec.vocab_size`` (the benchmarks' 32k vocabulary): config, embedding, lm_head and tokenizer all have
    that many ids; the unpadded tokenizer's ids keep their tokens; a size below the tokenizer's own is refused."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from zerokld_testing import TinyModelSpec, make_tiny_checkpoint, make_tokenizer

    plain = make_tiny_checkpoint(tmp_path / "plain", TinyModelSpec())
    padded = make_tiny_checkpoint(tmp_path / "padded", TinyModelSpec(vocab_size=300))
    base = json.loads((plain / "config.json").read_text())["vocab_size"]
    assert base < 300 and json.loads((padded / "config.json").read_text())["vocab_size"] == 300
    weights = load_file(str(padded / "model.safetensors"))
    assert weights["model.embed_tokens.weight"].shape[0] == weights["lm_head.weight"].shape[0] == 300
    tok, tok_plain = AutoTokenizer.from_pretrained(str(padded)), AutoTokenizer.from_pretrained(str(plain))
    assert len(tok) == 300 and len(tok_plain) == base
    assert tok.convert_ids_to_tokens(list(range(base))) == tok_plain.convert_ids_to_tokens(list(range(base)))
    assert tok.convert_ids_to_tokens(299) == f"<|extra_{299 - base}|>"
    with pytest.raises(ValueError, match="below the tokenizer's own"):
        make_tokenizer(tmp_path / "tok", vocab_size=base - 1)
