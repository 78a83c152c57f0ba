"""Test and example helpers. The tiny-checkpoint factory (no model hub needed) and its synthetic requests are the
top-level names, the only ones the example and the benchmarks import; the submodules are the tests' own helpers."""

from .checkpoints import TinyModelSpec, make_tiny_checkpoint, make_tokenizer
from .deepseek import DeepSeekSpec, make_deepseek_checkpoint
from .prompts import mixed_sampling_params, random_datums, random_prompts
from .qwen3_next import make_qwen3_next_checkpoint, realistic_qwen3_next

__all__ = [
    "DeepSeekSpec",
    "TinyModelSpec",
    "make_deepseek_checkpoint",
    "make_qwen3_next_checkpoint",
    "make_tiny_checkpoint",
    "make_tokenizer",
    "mixed_sampling_params",
    "random_datums",
    "random_prompts",
    "realistic_qwen3_next",
]
