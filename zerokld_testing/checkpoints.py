"""Tiny HF-format checkpoints (config.json + tokenizer + safetensors) built locally with a seed.

The machines that run this project reach no model hub, so tests and the countdown example build their models here:
an HF ``Qwen3ForCausalLM``, ``Qwen3MoeForCausalLM`` or ``LlamaForCausalLM`` directory with any dimensions, random init,
and a character-level tokenizer made with the ``tokenizers`` library (every printable ASCII character is one token, plus
a few specials and the tags ``<answer>``/``</answer>``; with ``chat_tokens``, Qwen3's chat specials too, each one token,
after them). vLLM and TorchTitan load these directories as they would a downloaded model.

Layout follows HF ``transformers`` (``config.json`` fields of ``Qwen3Config`` / ``LlamaConfig``; weight names of
``modeling_qwen3.py`` / ``modeling_qwen3_moe.py`` / ``modeling_llama.py``; MoE experts stored one tensor per
expert, ``mlp.experts.{e}.{gate,up,down}_proj.weight``, and the router as ``mlp.gate.weight``, as Qwen3-MoE
checkpoints on the hub are).
"""

from __future__ import annotations

import json
import string
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from zerokld_models.checkpoint import write_checkpoint

__all__ = [
    "CHAT_SPECIAL_TOKENS",
    "CHAT_TOKENS",
    "SPECIAL_TOKENS",
    "TinyModelSpec",
    "make_tiny_checkpoint",
    "make_tokenizer",
]

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>"]
#: every printable ASCII character but the control whitespace, one token each
_CHARS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
EXTRA_TOKENS = ["<answer>", "</answer>"]
#: Qwen3's chat-template specials (``tokenizer_config.json`` of Qwen/Qwen3-8B), for chat renderers (tinker-cookbook's
#: ``qwen3`` renderer asserts ``<|im_end|>`` is one token); ``<|im_end|>`` is then the EOS token, as in Qwen3
CHAT_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]


@dataclass
class TinyModelSpec:
    """Dimensions of a tiny decoder. ``family`` is ``"qwen3"`` (q/k RMSNorm), ``"qwen3_moe"`` (Qwen3 attention, every
    layer's MLP a top-k routed MoE, no shared expert, as Qwen3-MoE), ``"llama"`` or ``"qwen2"`` (Qwen2/Qwen2.5: q, k
    and v projections with a bias).

    ``rope_scaling``: an HF ``rope_scaling`` dict (Llama 3.x: ``{"rope_type": "llama3", "factor": ...}``);
    ``rope_parameters_only``: write the RoPE settings only as transformers >= 4.56 does, in ``rope_parameters``
    (``rope_theta`` and the scaling inside it, no top-level ``rope_theta``). ``chat_tokens``: the tokenizer has
    Qwen3's chat specials (:data:`CHAT_SPECIAL_TOKENS`, :data:`CHAT_TOKENS`; ids after the others, which keep theirs)
    and ``<|im_end|>`` is the EOS token.

    ``vocab_size``: the vocabulary padded with filler tokens to that size (None: the tokenizer's ~100 tokens).

    MoE fields (``qwen3_moe`` only): ``num_experts``, ``num_experts_per_tok`` (top-k), ``moe_intermediate_size``,
    ``norm_topk_prob``; ``router_ties``: copy router row ``2j`` into row ``2j + 1`` (experts keep distinct weights),
    so every token's scores for those two experts are exactly equal and only the tie-break decides which one runs.
    """

    family: str = "qwen3"
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 1024
    tie_word_embeddings: bool = False
    init_std: float = 0.08
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    norm_topk_prob: bool = True
    router_ties: bool = False
    rope_scaling: dict | None = None
    rope_parameters_only: bool = False
    chat_tokens: bool = False
    vocab_size: int | None = None


def make_tokenizer(out_dir: str | Path, chat_tokens: bool = False, vocab_size: int | None = None) -> int:
    """Write a character-level ``tokenizer.json`` + ``tokenizer_config.json`` into ``out_dir`` (``chat_tokens``: with
    Qwen3's chat specials, ``<|im_end|>`` the EOS token; ``vocab_size``: filler tokens ``<|extra_N|>`` after all the
    others, up to that many ids, so that a benchmark's lm_head and log-softmax have a real model's width).

    Returns:
        The vocabulary size (specials + printable ASCII + answer tags [+ chat tokens] [+ fillers]).

    Raises:
        ValueError: ``vocab_size`` smaller than the tokens without fillers.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + _CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.add_tokens(EXTRA_TOKENS)
    eos = "<|eos|>"
    if chat_tokens:
        tok.add_special_tokens(CHAT_SPECIAL_TOKENS)
        tok.add_tokens(CHAT_TOKENS)
        eos = "<|im_end|>"
    if vocab_size is not None:
        base = tok.get_vocab_size()
        if vocab_size < base:
            raise ValueError(f"vocab_size {vocab_size} is below the tokenizer's own {base} tokens")
        tok.add_tokens([f"<|extra_{i}|>" for i in range(vocab_size - base)])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": eos,
        "pad_token": "<|pad|>",
        "unk_token": "?",
        "model_max_length": 4096,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<|bos|>", "eos_token": eos, "pad_token": "<|pad|>", "unk_token": "?"})
    )
    return tok.get_vocab_size()


def _eos_id(spec: TinyModelSpec) -> int:
    """The EOS token's id: ``<|eos|>`` (2), or ``<|im_end|>`` with chat tokens (after the specials, the printable
    characters, the answer tags and ``<|endoftext|>``, ``<|im_start|>``)."""
    if not spec.chat_tokens:
        return 2
    return len(SPECIAL_TOKENS) + len(_CHARS) + len(EXTRA_TOKENS) + CHAT_SPECIAL_TOKENS.index("<|im_end|>")


def _hf_config(spec: TinyModelSpec, vocab_size: int, dtype: str) -> dict:
    arch = {
        "qwen3": ("Qwen3ForCausalLM", "qwen3"),
        "qwen3_moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
        "llama": ("LlamaForCausalLM", "llama"),
        "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    }
    if spec.family not in arch:
        raise ValueError(f"unknown family {spec.family!r}; expected one of {sorted(arch)}")
    name, model_type = arch[spec.family]
    cfg = {
        "architectures": [name],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "attention_bias": False,
        "torch_dtype": dtype,
        "bos_token_id": 1,
        "eos_token_id": _eos_id(spec),
        "pad_token_id": 0,
    }
    if spec.family == "llama":
        cfg["mlp_bias"] = False
    if spec.family == "qwen2":
        del cfg["attention_bias"], cfg["head_dim"]  # Qwen2Config has neither: q/k/v always carry a bias
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=spec.num_hidden_layers)
    if spec.rope_scaling:
        cfg["rope_scaling"] = dict(spec.rope_scaling)
    if spec.rope_parameters_only:
        cfg["rope_parameters"] = {
            "rope_theta": cfg.pop("rope_theta"),
            "rope_type": "default",
            **cfg.pop("rope_scaling", {}),
        }
    if spec.family == "qwen3_moe":
        cfg.update(
            num_experts=spec.num_experts,
            num_experts_per_tok=spec.num_experts_per_tok,
            moe_intermediate_size=spec.moe_intermediate_size,
            norm_topk_prob=spec.norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            output_router_logits=False,
            router_aux_loss_coef=0.001,
        )
    return cfg


def _moe_weights(prefix: str, spec: TinyModelSpec, rnd) -> dict[str, torch.Tensor]:
    h, inter = spec.hidden_size, spec.moe_intermediate_size
    gate = rnd(spec.num_experts, h) * 8  # sharp enough that tokens disagree on experts
    if spec.router_ties:
        gate[1::2] = gate[0::2][: gate[1::2].shape[0]]
    w = {prefix + "mlp.gate.weight": gate.contiguous()}
    for e in range(spec.num_experts):
        q = f"{prefix}mlp.experts.{e}."
        w[q + "gate_proj.weight"] = rnd(inter, h)
        w[q + "up_proj.weight"] = rnd(inter, h)
        w[q + "down_proj.weight"] = rnd(h, inter)
    return w


def make_tiny_checkpoint(
    out_dir: str | Path, spec: TinyModelSpec | None = None, seed: int = 0, dtype: str = "float32"
) -> Path:
    """Build an HF checkpoint directory.

    Args:
        out_dir: directory to create (an existing one is replaced; written atomically by
            :func:`zerokld_models.checkpoint.write_checkpoint`).
        spec: dimensions and family; defaults to a 2-layer Qwen3 of hidden size 64.
        seed: ``torch.Generator`` seed for the random init (normal, std ``spec.init_std``; norms = 1).
        dtype: ``"float32"`` or ``"bfloat16"``, stored dtype and ``torch_dtype``.

    Returns:
        ``Path(out_dir)`` holding ``config.json``, ``generation_config.json``, tokenizer files,
        ``model.safetensors`` and ``zerokld_spec.json``.
    """
    spec = spec or TinyModelSpec()
    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    out = Path(out_dir)
    with tempfile.TemporaryDirectory(prefix="zerokld-tokenizer-") as tok_dir:
        vocab = make_tokenizer(tok_dir, spec.chat_tokens, spec.vocab_size)
        return _write(out, spec, seed, dtype, tdtype, vocab, tok_dir)


def _write(
    out: Path, spec: TinyModelSpec, seed: int, dtype: str, tdtype: torch.dtype, vocab: int, tok_dir: str
) -> Path:
    cfg = _hf_config(spec, vocab, dtype)
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * spec.init_std).to(tdtype)

    h, hd, nq, nkv, inter = (
        spec.hidden_size,
        spec.head_dim,
        spec.num_attention_heads,
        spec.num_key_value_heads,
        spec.intermediate_size,
    )
    # tied: the embedding is also the output head; at std 1 the next-token entropy was ~1e-12 nats (every sampled
    # token's logprob 0, comparisons vacuous); 3 * init_std gives ~1.7 nats, as the untied models' lm_head does
    emb_std = 3 * spec.init_std if spec.tie_word_embeddings else 1.0
    w: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": (torch.randn(vocab, h, generator=g) * emb_std).to(tdtype)
    }
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(h, dtype=tdtype)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=tdtype)
        w[p + "self_attn.q_proj.weight"] = rnd(nq * hd, h)
        w[p + "self_attn.k_proj.weight"] = rnd(nkv * hd, h)
        w[p + "self_attn.v_proj.weight"] = rnd(nkv * hd, h)
        w[p + "self_attn.o_proj.weight"] = rnd(h, nq * hd)
        if spec.family == "qwen2":
            for name, n in (("q", nq * hd), ("k", nkv * hd), ("v", nkv * hd)):
                w[p + f"self_attn.{name}_proj.bias"] = rnd(n) * 4
        if spec.family in ("qwen3", "qwen3_moe"):
            w[p + "self_attn.q_norm.weight"] = torch.ones(hd, dtype=tdtype)
            w[p + "self_attn.k_norm.weight"] = torch.ones(hd, dtype=tdtype)
        if spec.family == "qwen3_moe":
            w.update(_moe_weights(p, spec, rnd))
            continue
        w[p + "mlp.gate_proj.weight"] = rnd(inter, h)
        w[p + "mlp.up_proj.weight"] = rnd(inter, h)
        w[p + "mlp.down_proj.weight"] = rnd(h, inter)
    w["model.norm.weight"] = torch.ones(h, dtype=tdtype)
    if not spec.tie_word_embeddings:
        w["lm_head.weight"] = rnd(vocab, h) * 4

    def extra_files(tmp: Path) -> None:
        (tmp / "generation_config.json").write_text(
            json.dumps({"bos_token_id": 1, "eos_token_id": _eos_id(spec), "pad_token_id": 0})
        )
        (tmp / "zerokld_spec.json").write_text(json.dumps({**asdict(spec), "seed": seed, "dtype": dtype}, indent=2))

    return write_checkpoint(out, {"model.safetensors": w}, assets_dir=tok_dir, config=cfg, finalize=extra_files)
