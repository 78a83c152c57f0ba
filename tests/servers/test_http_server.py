"""The OpenAI-compatible server (``python -m vllm.entrypoints.openai.api_server``) with the plugin switched on via
``--additional-config``: concurrent requests on loopback return the trainer's logprobs bit for bit."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch

from titan_plugin import trainer_logprobs
from vllm_plugin.serve import OpenAIServer, kv_cache_args

pytestmark = pytest.mark.vllm


def _serve(engine_slot, ckpt: str, dtype: str, log_dir, extra_args: tuple = ()):
    """``vllm serve`` (the OpenAI server module) on loopback with the plugin on; yields the base URL."""
    engine_slot.close()  # one engine at a time on this machine
    server = OpenAIServer(
        [
            "--model",
            ckpt,
            "--dtype",
            dtype,
            "--gpu-memory-utilization",
            "0.3",
            "--max-model-len",
            "512",
            "--enforce-eager",
            "--max-num-batched-tokens",
            "64",
            "--additional-config",
            json.dumps({"zerokld": {"batch_invariant": True}}),
            *kv_cache_args(),
            *extra_args,
        ],
        log_dir / "server.log",
    )
    server.start()
    try:
        yield server.base
    finally:
        server.stop()


@pytest.fixture(scope="module")
def server(engine_slot, checkpoint_factory, tmp_path_factory):
    ckpt = checkpoint_factory("qwen3", "bfloat16")
    for base in _serve(engine_slot, ckpt, "bfloat16", tmp_path_factory.mktemp("server")):
        yield base, ckpt


def test_concurrent_http_requests_match_trainer(server):
    base, ckpt = server
    import random

    rng = random.Random(21)
    prompts = [[1] + [rng.randrange(3, 100) for _ in range(rng.randrange(4, 100))] for _ in range(24)]

    def complete(p):
        r = requests.post(
            base + "/v1/completions",
            timeout=120,
            json={
                "model": ckpt,
                "prompt": p,
                "max_tokens": 16,
                "temperature": 1.0,
                "logprobs": 0,
                "ignore_eos": True,
                "return_tokens_as_token_ids": True,
            },
        )
        r.raise_for_status()
        lp = r.json()["choices"][0]["logprobs"]
        ids = [int(t.split(":")[1]) for t in lp["tokens"]]
        return ids, torch.tensor(lp["token_logprobs"], dtype=torch.float32)

    with ThreadPoolExecutor(max_workers=12) as pool:
        results = list(pool.map(complete, prompts))
    seqs = [p + ids for p, (ids, _) in zip(prompts, results, strict=True)]
    train = trainer_logprobs(ckpt, seqs, [len(p) for p in prompts], dtype="bfloat16")
    assert [i for i, (t, (_, lp)) in enumerate(zip(train, results, strict=True)) if not torch.equal(t, lp)] == []


@pytest.fixture(scope="module")
def moe_server(engine_slot, checkpoint_factory, tmp_path_factory):
    ckpt = checkpoint_factory("qwen3_moe", "float32")
    for base in _serve(
        engine_slot, ckpt, "float32", tmp_path_factory.mktemp("moe_server"), ("--enable-return-routed-experts",)
    ):
        yield base, ckpt


def test_completions_return_routes_and_seeds(moe_server):
    """``/v1/completions`` on a zerokld Qwen3-MoE server: each choice carries vLLM's ``routed_experts`` (base64
    ``.npy``) and our ``zerokld_seed``; replaying the routes in the trainer gives the returned logprobs, and sending
    the seed back reproduces the sample."""
    import base64
    import io

    import numpy as np

    base, ckpt = moe_server
    prompt = [1] + list(range(10, 90))

    def complete(**kw):
        r = requests.post(
            base + "/v1/completions",
            timeout=120,
            json={
                "model": ckpt,
                "prompt": prompt,
                "max_tokens": 12,
                "temperature": 1.0,
                "logprobs": 0,
                "ignore_eos": True,
                "return_tokens_as_token_ids": True,
                **kw,
            },
        )
        r.raise_for_status()
        return r.json()["choices"]

    choices = complete(n=2)
    assert len({c["zerokld_seed"] for c in choices}) == 2
    for c in choices:
        routes = np.load(io.BytesIO(base64.b64decode(c["routed_experts"])))
        ids = [int(t.split(":")[1]) for t in c["logprobs"]["tokens"]]
        assert routes.shape == (len(prompt) + len(ids) - 1, 2, 2)
        lp = torch.tensor(c["logprobs"]["token_logprobs"], dtype=torch.float32)
        train = trainer_logprobs(ckpt, [prompt + ids], [len(prompt)], dtype="float32", routed_experts=[routes])
        assert torch.equal(train[0], lp)
        again = complete(seed=c["zerokld_seed"])[0]
        assert again["logprobs"]["tokens"] == c["logprobs"]["tokens"]
        assert again["routed_experts"] == c["routed_experts"]
    # the typed batch the trainer consumes, built from the JSON: routes, logprobs and the engine's numerics stamp
    from shared_numerics import NumericsMode, RolloutBatch

    batch = RolloutBatch.from_openai([prompt, prompt], choices)
    assert batch.numerics == NumericsMode.build(True, "float32")
    train = trainer_logprobs(
        ckpt, batch.sequences, batch.prompt_lengths, dtype="float32", routed_experts=batch.routed_experts
    )
    assert all(torch.equal(t, q) for t, q in zip(train, batch.sampler_logprobs, strict=True))


def _dp_server(ckpt: str, dtype: str, log_path, batch_invariant: bool) -> OpenAIServer:
    config = {"zerokld": {"batch_invariant": True}} if batch_invariant else {}
    return OpenAIServer(
        [
            "--model",
            ckpt,
            "--dtype",
            dtype,
            "--gpu-memory-utilization",
            "0.3",
            "--max-model-len",
            "512",
            "--enforce-eager",
            "--max-num-batched-tokens",
            "64",
            "--data-parallel-size",
            "2",
            "--additional-config",
            json.dumps(config),
            *kv_cache_args(),
        ],
        log_path,
    )


def _engine_requests(base: str) -> dict[str, float]:
    """Finished requests per data-parallel engine, from vLLM's Prometheus metrics (label ``engine``)."""
    import re

    text = requests.get(base + "/metrics", timeout=30).text
    counts: dict[str, float] = {}
    for m in re.finditer(r"^vllm:request_success_total\{([^}]*)\} ([0-9.e+]+)$", text, re.M):
        engine = re.search(r'engine="(\d+)"', m.group(1)).group(1)
        counts[engine] = counts.get(engine, 0.0) + float(m.group(2))
    return counts


@pytest.mark.extended  # `make test-extended`: two DP 2 servers, ~140 s on 2 cores
def test_data_parallel_2_serves_the_trainers_logprobs(engine_slot, checkpoint_factory, tmp_path):
    """Issue 56 point 5: ``vllm serve --data-parallel-size 2`` (two engine cores, one CPU core each, vLLM's own DP
    coordinator balancing the requests): both engines serve, and every completion's log-probs equal the trainer's bit
    for bit, whichever engine and batch it landed in. Negative control: stock vLLM at DP 2 (plugin off) against the
    stock-free trainer differs."""
    import random

    engine_slot.close()
    ckpt = checkpoint_factory("qwen3", "bfloat16")
    rng = random.Random(22)
    prompts = [[1] + [rng.randrange(3, 100) for _ in range(rng.randrange(4, 100))] for _ in range(24)]
    lens = [len(p) for p in prompts]
    results = {}
    for batch_invariant in (True, False):
        server = _dp_server(ckpt, "bfloat16", tmp_path / f"dp2_{batch_invariant}.log", batch_invariant)
        server.start({"VLLM_CPU_OMP_THREADS_BIND": "0|1", **({} if batch_invariant else {"VLLM_PLUGINS": ""})})
        try:

            def complete(p, base=server.base):
                r = requests.post(
                    base + "/v1/completions",
                    timeout=120,
                    json={
                        "model": ckpt,
                        "prompt": p,
                        "max_tokens": 16,
                        "temperature": 1.0,
                        "logprobs": 0,
                        "ignore_eos": True,
                        "return_tokens_as_token_ids": True,
                    },
                )
                r.raise_for_status()
                lp = r.json()["choices"][0]["logprobs"]
                return [int(t.split(":")[1]) for t in lp["tokens"]], torch.tensor(
                    lp["token_logprobs"], dtype=torch.float32
                )

            with ThreadPoolExecutor(max_workers=12) as pool:
                results[batch_invariant] = list(pool.map(complete, prompts))
            if batch_invariant:
                per_engine = _engine_requests(server.base)
                assert sorted(per_engine) == ["0", "1"] and min(per_engine.values()) > 0, per_engine
        finally:
            server.stop()
    for batch_invariant, res in results.items():
        seqs = [p + ids for p, (ids, _) in zip(prompts, res, strict=True)]
        train = trainer_logprobs(ckpt, seqs, lens, dtype="bfloat16")
        same = torch.equal(torch.cat(train), torch.cat([lp for _, lp in res]))
        if batch_invariant:
            assert same
        else:
            from zerokld_testing.controls import stock_differs

            stock_differs(not same, "stock vLLM at data parallel 2 vs the zerokld trainer", "the prompts")
