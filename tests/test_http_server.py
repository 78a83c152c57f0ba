"""The OpenAI-compatible server (``python -m vllm.entrypoints.openai.api_server``) with the plugin switched on via
``--additional-config``: concurrent requests on loopback return the trainer's logprobs bit for bit."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch

from titan_plugin import trainer_logprobs
from vllm_plugin.serve import OpenAIServer
from vllm_plugin.serve import kv_cache_args

pytestmark = pytest.mark.vllm


def _serve(engine_slot, ckpt: str, dtype: str, log_dir, extra_args: tuple = ()):
    """``vllm serve`` (the OpenAI server module) on loopback with the plugin on; yields the base URL."""
    engine_slot.close()  # one engine at a time on this machine
    server = OpenAIServer(["--model", ckpt, "--dtype", dtype, "--gpu-memory-utilization", "0.3",
                           "--max-model-len", "512", "--enforce-eager", "--max-num-batched-tokens", "64",
                           "--additional-config", json.dumps({"zerokld": {"batch_invariant": True}}), *kv_cache_args(),
                           *extra_args],
                          log_dir / "server.log")
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
        r = requests.post(base + "/v1/completions", timeout=120, json={
            "model": ckpt, "prompt": p, "max_tokens": 16, "temperature": 1.0, "logprobs": 0, "ignore_eos": True,
            "return_tokens_as_token_ids": True})
        r.raise_for_status()
        lp = r.json()["choices"][0]["logprobs"]
        ids = [int(t.split(":")[1]) for t in lp["tokens"]]
        return ids, torch.tensor(lp["token_logprobs"], dtype=torch.float32)

    with ThreadPoolExecutor(max_workers=12) as pool:
        results = list(pool.map(complete, prompts))
    seqs = [p + ids for p, (ids, _) in zip(prompts, results)]
    train = trainer_logprobs(ckpt, seqs, [len(p) for p in prompts], dtype="bfloat16")
    assert [i for i, (t, (_, lp)) in enumerate(zip(train, results)) if not torch.equal(t, lp)] == []


@pytest.fixture(scope="module")
def moe_server(engine_slot, checkpoint_factory, tmp_path_factory):
    ckpt = checkpoint_factory("qwen3_moe", "float32")
    for base in _serve(engine_slot, ckpt, "float32", tmp_path_factory.mktemp("moe_server"),
                       ("--enable-return-routed-experts",)):
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
        r = requests.post(base + "/v1/completions", timeout=120, json={
            "model": ckpt, "prompt": prompt, "max_tokens": 12, "temperature": 1.0, "logprobs": 0, "ignore_eos": True,
            "return_tokens_as_token_ids": True, **kw})
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
    train = trainer_logprobs(ckpt, batch.sequences, batch.prompt_lengths, dtype="float32",
                             routed_experts=batch.routed_experts)
    assert all(torch.equal(t, q) for t, q in zip(train, batch.sampler_logprobs))
