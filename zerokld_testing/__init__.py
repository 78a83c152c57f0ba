"""Test and example helpers: the tiny-checkpoint factory (no model hub needed)."""
from .checkpoints import TinyModelSpec, make_tiny_checkpoint, make_tokenizer

__all__ = ["TinyModelSpec", "make_tiny_checkpoint", "make_tokenizer"]
