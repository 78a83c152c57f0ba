"""The OpenAI-compatible server (``python -m vllm.entrypoints.openai.api_server``) with the plugin switched on via
``--additional-config``: concurrent requests on loopback return the trainer's logprobs bit for bit."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch

from titan_plugin import trainer_logprobs

pytestmark = pytest.mark.vllm


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(engine_slot, checkpoint_factory, tmp_path_factory):
    engine_slot.close()  # one engine at a time on this machine
    ckpt = checkpoint_factory("qwen3", "bfloat16")
    port = _free_port()
    log = open(tmp_path_factory.mktemp("server") / "server.log", "w+")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", ckpt, "--dtype", "bfloat16",
           "--host", "127.0.0.1", "--port", str(port), "--gpu-memory-utilization", "0.3", "--max-model-len", "512",
           "--enforce-eager", "--max-num-batched-tokens", "64",
           "--additional-config", json.dumps({"zerokld": {"batch_invariant": True}})]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 240
    try:
        while time.time() < deadline:
            if proc.poll() is not None:
                log.seek(0)
                pytest.fail("server exited:\n" + log.read()[-4000:])
            try:
                if requests.get(base + "/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            time.sleep(1)
        else:
            pytest.fail("server did not become healthy in 240 s")
        yield base, ckpt
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


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
