"""A LoRA deployment through ``fireworks-ai``'s own clients, unmodified (issue 37): the training server trains a LoRA
model (``create_training_client(lora_rank=...)``), ``WeightSyncer`` saves each adapter and hot-loads it into a
``vllm serve --enable-lora`` whose ``hot_load.deployment_lora_name`` makes every Fireworks-spelled load a version of
that adapter, and ``DeploymentSampler`` samples the deployment — its log-probs are the training server's for the LoRA
model bit for bit at every step (negative control: after a step the base model's differ)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from titan_plugin import trainer_logprobs
from vllm_plugin.serve import HotLoadServer

pytestmark = [pytest.mark.vllm, pytest.mark.titan]

API_KEY = "fw-zerokld-lora"
MAX_RANK = 8
PROMPT = [1] + list(range(10, 40))
DEPLOYMENT = "local"
BASE_MODEL = "tiny-qwen3"


@pytest.fixture(scope="module")
def servers(engine_slot, checkpoint_factory, tmp_path_factory):
    from titan_plugin.training_server import TrainingServerProcess

    engine_slot.close()
    ckpt = checkpoint_factory("qwen3", "bfloat16")
    tmp = tmp_path_factory.mktemp("fireworks_lora")
    (tmp / "snapshots").mkdir()
    vllm = HotLoadServer(
        ckpt,
        tmp / "snapshots",
        tmp / "state",
        tmp / "server.log",
        API_KEY,
        ("--enable-lora", "--max-loras", "2", "--max-lora-rank", str(MAX_RANK)),
        hot_load={"deployment_lora_name": "policy"},
    )
    trainer = TrainingServerProcess(
        ckpt, tmp / "snapshots", API_KEY, tmp / "trainer.log", ["--max-lora-rank", MAX_RANK]
    )
    vllm.start()
    try:
        trainer.start()
        try:
            yield vllm, trainer.base, ckpt
        finally:
            trainer.stop()
    finally:
        vllm.stop()


def test_lora_deployment_samples_the_trainers_adapter_bitwise(servers, monkeypatch, request):
    from fireworks.training.sdk import (
        AdamParams,
        Datum,
        DeploymentManager,
        DeploymentSampler,
        FiretitanServiceClient,
        ModelInput,
        TensorData,
        WeightSyncer,
    )

    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    vllm, training_url, ckpt = servers
    svc = FiretitanServiceClient(base_url=training_url, api_key=API_KEY)
    request.addfinalizer(svc.close)  # its session heartbeat stops with the test
    tc = svc.create_training_client(base_model=BASE_MODEL, lora_rank=4)
    dm = DeploymentManager(api_key=API_KEY, base_url=vllm.base)
    syncer = WeightSyncer(
        policy_client=tc,
        deploy_mgr=dm,
        deployment_id=DEPLOYMENT,
        base_model=BASE_MODEL,
        hotload_timeout=120,
        lora_rank=4,
    )
    sampler = DeploymentSampler(
        inference_url=vllm.base, model=f"accounts/local/deployments/{DEPLOYMENT}", api_key=API_KEY
    )
    moved = False
    for step in range(2):
        syncer.save_and_hotload(f"adapter-{step}")
        replica = dm.hotload_check_status(DEPLOYMENT, BASE_MODEL)["replicas"][0]
        assert replica["loaded_adapters"][0]["status"] == "loaded"
        samples = asyncio.run(
            sampler.sample_with_prompt_tokens(PROMPT, n=2, max_tokens=6, temperature=1.0, logprobs=True)
        )
        data = []
        for c in samples:
            n = len(c.full_tokens) - 1
            data.append(
                Datum(
                    model_input=ModelInput.from_ints(c.full_tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": TensorData(data=c.full_tokens[1:], dtype="int64", shape=[n]),
                        "weights": TensorData(
                            data=[0.0] * (c.prompt_len - 1) + [1.0] * c.completion_len, dtype="float32", shape=[n]
                        ),
                    },
                )
            )
        fwd = tc.forward(data, "cross_entropy").result()
        train = [
            torch.tensor(o["logprobs"].data, dtype=torch.float32)[c.prompt_len - 1 :]
            for o, c in zip(fwd.loss_fn_outputs, samples, strict=True)
        ]
        sampled = [torch.tensor(c.sampling_logprobs, dtype=torch.float32) for c in samples]
        assert [t.shape for t in train] == [s.shape for s in sampled]
        assert all(torch.equal(t, s) for t, s in zip(train, sampled, strict=True)), step  # KL exactly 0
        base = trainer_logprobs(
            ckpt, [c.full_tokens for c in samples], [c.prompt_len for c in samples], dtype="bfloat16"
        )
        moved |= not all(torch.equal(b, s) for b, s in zip(base, sampled, strict=True))
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(AdamParams(learning_rate=5e-2)).result()
    assert moved  # negative control: the served adapter is not the base model
