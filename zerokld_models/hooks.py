"""zerokld_models' registrations (entry point ``zerokld_models`` in the ``zerokld`` group): one line per folder."""

from __future__ import annotations

from zerokld_plugins import hookimpl

from . import (
    deepseek_v2,
    deepseek_v3,
    deepseek_v32,
    glm4_moe,
    glm4_moe_lite,
    glm_moe_dsa,
    llama,
    qwen2,
    qwen3,
    qwen3_moe,
    qwen3_next,
)


@hookimpl
def zerokld_model_adapters():
    return [
        qwen3.ADAPTER,
        qwen3_moe.ADAPTER,
        llama.ADAPTER,
        qwen2.ADAPTER,
        deepseek_v3.ADAPTER,
        deepseek_v2.ADAPTER,
        glm4_moe_lite.ADAPTER,
        glm_moe_dsa.ADAPTER,
        deepseek_v32.ADAPTER,
        glm4_moe.ADAPTER,
        qwen3_next.ADAPTER,
    ]
