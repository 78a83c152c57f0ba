"""The FP8 serving checkpoint: an HF directory whose decoder linears hold :mod:`shared_numerics.fp8` codes.

Layout (same file names and tensor names as the high-precision checkpoint it was made from):

* ``config.json`` gains ``"quantization_config": {"quant_method": "zerokld_fp8", "fmt": "e4m3",
  "activation_scheme": "dynamic", "granularity": "per_channel" | "block", "weight_block_size": [128, 128] | null,
  "modules_to_not_convert": ["lm_head", "embed_tokens", "norm"]}`` — the HF ``quantization_config`` convention
  (``transformers`` ``FineGrainedFP8Config`` / vLLM ``Fp8Config`` use the same keys for the same meanings).
* each decoder projection ``…{q,k,v,o,gate,up,down}_proj.weight`` (MoE: each routed and shared expert's; MLA:
  also ``q_a_proj``, ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj``) is stored as ``float8_e4m3fn`` ``[N, K]``
  codes, with ``….weight_scale`` (float32, ``[N]`` per channel, ``[ceil(N/128), ceil(K/128)]`` per block) next to
  it; every other tensor (embeddings, norms, lm_head, MoE routers and DeepSeek's selection bias) is copied
  unchanged.

vLLM serves it with the zerokld plugin (``vllm_plugin.fp8`` registers ``zerokld_fp8`` with vLLM's quantization
registry); codes and scales are exactly what online quantization of the source checkpoint computes. The export
(file I/O) is :func:`zerokld_models.fp8_export.export_fp8_checkpoint`; this module defines the format.
"""

from __future__ import annotations

from .fp8 import BLOCK, GRANULARITIES, Fp8QuantizationError

__all__ = ["FP8_PROJECTIONS", "QUANT_METHOD", "is_fp8_projection", "parse_quantization_config", "quantization_config"]

QUANT_METHOD = "zerokld_fp8"
FP8_PROJECTIONS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    # MLA (DeepSeek-V2/V3): DeepSeek's own FP8 checkpoints quantize these too; the router (mlp.gate)
    # stays high precision
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_b_proj",
)


def is_fp8_projection(name: str) -> bool:
    """Whether HF tensor ``name`` is a decoder projection weight that FP8 mode quantizes."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in FP8_PROJECTIONS and ".layers." in name


def quantization_config(granularity: str = "per_channel") -> dict:
    """The ``config.json`` ``quantization_config`` block for ``granularity``."""
    if granularity not in GRANULARITIES:
        raise Fp8QuantizationError(f"unknown FP8 granularity {granularity!r}; expected one of {GRANULARITIES}")
    return {
        "quant_method": QUANT_METHOD,
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "granularity": granularity,
        "weight_block_size": [BLOCK, BLOCK] if granularity == "block" else None,
        "modules_to_not_convert": ["lm_head", "embed_tokens", "norm"],
    }


def parse_quantization_config(cfg: dict) -> str:
    """Validate a ``zerokld_fp8`` ``quantization_config`` and return its granularity.

    Raises:
        Fp8QuantizationError: another method, or a field this format does not define.
    """
    if cfg.get("quant_method") != QUANT_METHOD:
        raise Fp8QuantizationError(f"not a {QUANT_METHOD} checkpoint: quant_method={cfg.get('quant_method')!r}")
    if cfg.get("fmt", "e4m3") != "e4m3" or cfg.get("activation_scheme", "dynamic") != "dynamic":
        raise Fp8QuantizationError(f"{QUANT_METHOD} supports fmt=e4m3 with dynamic activations only, got {cfg}")
    granularity = cfg.get("granularity", "per_channel")
    if granularity not in GRANULARITIES:
        raise Fp8QuantizationError(f"unknown FP8 granularity {granularity!r}; expected one of {GRANULARITIES}")
    expected = [BLOCK, BLOCK] if granularity == "block" else None
    if cfg.get("weight_block_size") not in (expected, tuple(expected) if expected else None):
        raise Fp8QuantizationError(f"weight_block_size {cfg.get('weight_block_size')} does not match {granularity}")
    return granularity
