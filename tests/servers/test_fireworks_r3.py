"""Routing replay (R3) on Fireworks' wire, with the unmodified SDK (``fireworks-ai==1.2.30``; issue 37 point 1, "MoE
routing matrices where the datum carries them"): a Qwen3-MoE ``vllm serve`` with zerokld and vLLM's
``--enable-return-routed-experts`` answers ``include_routing_matrix`` with one ``routing_matrix`` per log-prob row,
``DeploymentSampler`` collects them, a datum carries them as ``model_input.routing_matrices``, and the training server
replays them: the trainer's log-probs equal the sampler's bit for bit, other routes change them (negative control: the
replay is applied), and malformed routes are refused with nothing applied. The encoding's unit tests run without a
server."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch

API_KEY = "fw-zerokld-r3"
DEPLOYMENT = "local"
NAME = "accounts/local/deployments/local"
BASE_MODEL = "accounts/fireworks/models/tiny-qwen3-moe"  # routing only: the server serves its --model
PROMPT = [1] + list(range(10, 40))


def _decode(matrix: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(matrix)), allow_pickle=False)


def _vllm_reply(prompt, ids, routes):
    """A vLLM ``/v1/completions`` reply as the Fireworks route requests it (token ids, legacy log-probs)."""
    from vllm.utils.serial_utils import numpy2base64

    tokens = [f"token_id:{t}" for t in ids]
    return {
        "id": "cmpl-1",
        "created": 0,
        "usage": {},
        "choices": [
            {
                "index": 0,
                "text": "",
                "finish_reason": "length",
                "prompt_token_ids": prompt,
                "token_ids": ids,
                "logprobs": {"tokens": tokens, "token_logprobs": [-0.5] * len(ids), "top_logprobs": None},
                "routed_experts": None if routes is None else numpy2base64(routes),
            }
        ],
    }


def test_completion_rows_carry_the_routes_of_the_forward_that_produced_them():
    """Row of position q: the routes vLLM recorded at input position q - 1 (``[layers, top_k]``, vLLM's base64
    ``.npy``); with echo, prompt rows too and ``""`` for the first token; a server without routes refuses (400), routes
    that do not cover the tokens are a server error (500); ``include_routing_matrix`` needs ``logprobs``."""
    from vllm_plugin.hotload.fireworks import FireworksRequestError, fireworks_completion, vllm_completion_request

    prompt, ids = [1, 5, 6, 7], [8, 9, 10]
    routes = np.arange(6 * 2 * 2, dtype=np.int16).reshape(6, 2, 2) % 4  # positions 0..5 = P + C - 1
    body = {"model": NAME, "prompt": prompt, "logprobs": True, "include_routing_matrix": True}
    assert vllm_completion_request(body, "/ckpt", NAME)["logprobs"] == 0
    with pytest.raises(FireworksRequestError, match="needs logprobs"):
        vllm_completion_request({**body, "logprobs": False}, "/ckpt", NAME)

    rows = fireworks_completion(_vllm_reply(prompt, ids, routes), body, NAME)["choices"][0]["logprobs"]["content"]
    assert [r["token_id"] for r in rows] == ids
    assert all(np.array_equal(_decode(r["routing_matrix"]), routes[len(prompt) - 1 + j]) for j, r in enumerate(rows))
    assert _decode(rows[0]["routing_matrix"]).dtype == np.int16

    echoed = dict(_vllm_reply(prompt, ids, routes))
    echoed["choices"][0]["logprobs"] = {
        "tokens": [f"token_id:{t}" for t in prompt + ids],
        "token_logprobs": [None] + [-0.5] * 6,
        "top_logprobs": None,
    }
    rows = fireworks_completion(echoed, {**body, "echo": True}, NAME)["choices"][0]["logprobs"]["content"]
    assert rows[0]["routing_matrix"] == ""
    assert all(np.array_equal(_decode(r["routing_matrix"]), routes[q - 1]) for q, r in enumerate(rows) if q)

    plain = fireworks_completion(_vllm_reply(prompt, ids, routes), {**body, "include_routing_matrix": False}, NAME)
    assert "routing_matrix" not in plain["choices"][0]["logprobs"]["content"][0]
    with pytest.raises(FireworksRequestError, match="records no routes") as err:
        fireworks_completion(_vllm_reply(prompt, ids, None), body, NAME)
    assert err.value.status == 400
    with pytest.raises(FireworksRequestError, match="routes cover") as err:
        fireworks_completion(_vllm_reply(prompt, ids, routes[:4]), body, NAME)
    assert err.value.status == 500


def test_routes_of_decodes_and_refuses():
    """The training server's reading of ``routing_matrices``: the rows stacked in position order, ``""`` -> a row of
    -1 (routed afresh), all ``""`` -> nothing to replay; refused: a dense model, a count other than the positions',
    strings that are not base64 ``.npy``, non-integer or differently shaped arrays, experts outside ``[0, E)``."""
    from titan_plugin.training_server import UserError, datums, routes_of
    from vllm_plugin.hotload.fireworks import routing_matrix

    r = np.array([[[0, 1], [2, 3]], [[3, 2], [1, 0]]], dtype=np.int16)
    got = routes_of([routing_matrix(r[0]), "", routing_matrix(r[1])], 3, 4, "d")
    assert got.dtype == np.int64 and np.array_equal(got, np.stack([r[0], np.full((2, 2), -1), r[1]]))
    assert routes_of(["", ""], 2, 4, "d") is None
    bad = [
        ([routing_matrix(r[0])], 3, 4, "routing matrices for 3 positions"),
        ([routing_matrix(r[0])], 1, None, "no experts"),
        (["not base64!"], 1, 4, "not base64"),
        ([base64.b64encode(b"abc").decode()], 1, 4, "not base64"),
        ([routing_matrix(r[0].astype(np.float32))], 1, 4, "expected integer"),
        ([routing_matrix(r[0]), routing_matrix(r[0][:1])], 2, 4, "expected integer"),
        ([routing_matrix(r[0] + 1)], 1, 4, r"outside \[0, 4\)"),
        ("abc", 3, 4, "list of strings"),
    ]
    for matrices, n, e, match in bad:
        with pytest.raises(UserError, match=match):
            routes_of(matrices, n, e, "d")
    datum = {
        "model_input": {
            "chunks": [{"type": "encoded_text", "tokens": [1, 2]}],
            "routing_matrices": [routing_matrix(r[0]), routing_matrix(r[1])],
        },
        "loss_fn_inputs": {},
    }
    assert np.array_equal(datums([datum], 10, 4)[0]["loss_fn_inputs"]["routed_experts"], r.astype(np.int64))
    parquet = {
        **datum,
        "model_input": {
            **datum["model_input"],
            "routing_matrices": None,
            "routing_matrix_format": "parquet_v1",
            "routing_references": {"files": []},
        },
    }
    with pytest.raises(UserError, match="parquet_v1"):
        datums([parquet], 10, 4)


@pytest.fixture(scope="module")
def servers(engine_slot, checkpoint_factory, tmp_path_factory):
    """A Qwen3-MoE zerokld ``vllm serve`` recording routes, and ``python -m titan_plugin.training_server`` on the same
    checkpoint writing into its snapshot root; both stopped by PID."""
    from titan_plugin.training_server import TrainingServerProcess
    from vllm_plugin.serve import HotLoadServer

    engine_slot.close()
    ckpt = checkpoint_factory("qwen3_moe", "bfloat16")
    tmp = tmp_path_factory.mktemp("fireworks_r3")
    root = tmp / "snapshots"
    root.mkdir()
    vllm = HotLoadServer(
        ckpt,
        root,
        tmp / "state",
        tmp / "server.log",
        API_KEY,
        max_model_len=512,
        extra_args=("--enable-return-routed-experts",),
    )
    vllm.start()
    trainer = TrainingServerProcess(ckpt, root, API_KEY, tmp / "trainer.log", ["--seq-gap-s", 3])
    try:
        yield vllm, trainer.start(), ckpt
    finally:
        trainer.stop()
        vllm.stop()


@pytest.mark.vllm
def test_sdk_routing_matrices_are_replayed_by_the_trainer(servers, monkeypatch, request):
    """The training server advertises router replay; ``DeploymentSampler`` with ``include_routing_matrix`` and echo
    gives one routing matrix per training position; the training server's ``forward`` with them gives the sampler's
    log-probs bit for bit; shifted experts (valid ids, other routes) change those log-probs (the replay is applied,
    not ignored); experts outside the model's are refused as the user's error and the next call is unaffected."""
    from fireworks.training.sdk import (
        Datum,
        DeploymentManager,
        DeploymentSampler,
        FiretitanServiceClient,
        ModelInput,
        TensorData,
        WeightSyncer,
    )

    from vllm_plugin.hotload.fireworks import routing_matrix

    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    vllm, trainer_url, ckpt = servers
    svc = FiretitanServiceClient(base_url=trainer_url, api_key=API_KEY)
    request.addfinalizer(svc.close)
    tc = svc.create_training_client(base_model=BASE_MODEL)
    assert tc.supports_router_replay is True  # the trainer's answer for an MoE model
    WeightSyncer(
        policy_client=tc,
        deploy_mgr=DeploymentManager(api_key=API_KEY, base_url=vllm.base),
        deployment_id=DEPLOYMENT,
        base_model=BASE_MODEL,
        hotload_timeout=120,
    ).save_and_hotload("policy-0")
    sampler = DeploymentSampler(inference_url=vllm.base, model=NAME, api_key=API_KEY)
    samples = asyncio.run(
        sampler.sample_with_prompt_tokens(
            PROMPT, n=2, max_tokens=6, temperature=1.0, logprobs=True, echo=True, include_routing_matrix=True
        )
    )
    num_experts = json.loads((Path(ckpt) / "config.json").read_text())["num_experts"]

    def data(shift: int = 0, expert: int | None = None):
        out = []
        for c in samples:
            n = len(c.full_tokens) - 1
            matrices = list(c.routing_matrices)
            assert len(matrices) == n and all(matrices)  # P + C - 1 rows: every training position
            if shift or expert is not None:  # the completion's positions get other experts
                for p in range(c.prompt_len - 1, n):
                    ids = _decode(matrices[p])
                    ids = (ids + shift) % num_experts if expert is None else np.full_like(ids, expert)
                    matrices[p] = routing_matrix(ids)
            out.append(
                Datum(
                    model_input=ModelInput.from_ints(c.full_tokens[:-1], routing_matrices=matrices),
                    loss_fn_inputs={"target_tokens": TensorData(data=c.full_tokens[1:], dtype="int64", shape=[n])},
                )
            )
        return out

    def completion_lps(batch):
        fwd = tc.forward(batch, "cross_entropy").result()
        return [
            torch.tensor(o["logprobs"].data, dtype=torch.float32)[c.prompt_len - 1 :]
            for o, c in zip(fwd.loss_fn_outputs, samples, strict=True)
        ]

    sampled = [torch.tensor(c.sampling_logprobs[c.prompt_len - 1 :], dtype=torch.float32) for c in samples]
    assert all(s.numel() == c.completion_len for s, c in zip(sampled, samples, strict=True))
    replayed = completion_lps(data())
    assert all(torch.equal(t, s) for t, s in zip(replayed, sampled, strict=True))  # KL exactly 0, routes replayed
    other = completion_lps(data(shift=1))
    assert not any(torch.equal(t, s) for t, s in zip(other, sampled, strict=True))  # negative control
    with pytest.raises(Exception, match=r"outside \[0, "):
        tc.forward(data(expert=num_experts), "cross_entropy").result()
    assert all(torch.equal(t, s) for t, s in zip(completion_lps(data()), sampled, strict=True))
