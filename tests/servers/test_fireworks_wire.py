"""Fireworks' own serving clients, unmodified (``fireworks-ai==1.2.30``: ``DeploymentManager``, ``DeploymentSampler``),
against one real ``vllm serve`` with zerokld and its hot-load endpoint (issue 37 point 2): the account and deployment
lookups, full and delta hot-loads and their status polling, sampling through ``/inference/v1/completions`` whose
``sampling_logprob`` equals the trainer's log-prob bit for bit (negative control: TorchTitan's stock numerics differ),
prompt log-probs by echo, and refusals in the shapes the client understands, with nothing applied."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
import requests
import torch

from deltasync import apply_incremental_snapshot, read_snapshot_tensors, write_full_snapshot, write_incremental_snapshot
from shared_numerics import NumericsMode
from titan_plugin import trainer_logprobs
from vllm_plugin.serve import HotLoadServer
from zerokld_testing.fireworks import completion_logprobs_from_forward, sdk_datum

pytestmark = pytest.mark.vllm

API_KEY = "fw-zerokld-test"
DEPLOYMENT = "local"
NAME = "accounts/local/deployments/local"
HL = "/hot_load/v1/models/hot_load"
PROMPT = [1] + list(range(10, 40))
BASE_MODEL = "accounts/fireworks/models/tiny-qwen3"  # routing only: the server serves its --model


def _perturb(sd: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        k: torch.where(
            torch.rand(v.shape, generator=g) < 0.05, v + (torch.randn(v.shape, generator=g) * 0.02).to(v.dtype), v
        )
        for k, v in sd.items()
    }


@pytest.fixture(scope="module")
def env(engine_slot, checkpoint_factory, tmp_path_factory):
    engine_slot.close()
    ckpt = checkpoint_factory("qwen3", "bfloat16")
    tmp = tmp_path_factory.mktemp("fireworks")
    root, full = tmp / "snapshots", tmp / "expected"
    root.mkdir()
    stamp = NumericsMode.build(True, "bfloat16").to_dict()
    base = read_snapshot_tensors(ckpt)
    # the SDK's identities: <name>-<8 hex>
    write_full_snapshot(_perturb(base, 1), ckpt, root / "step-1-0a1b2c3d", numerics=stamp)
    s2 = _perturb(read_snapshot_tensors(root / "step-1-0a1b2c3d"), 2)
    write_incremental_snapshot(root / "step-1-0a1b2c3d", s2, root / "step-2-4e5f6a7b", numerics=stamp)
    apply_incremental_snapshot(root / "step-1-0a1b2c3d", root / "step-2-4e5f6a7b", full / "step-2-4e5f6a7b")
    server = HotLoadServer(ckpt, root, tmp / "state", tmp / "server.log", API_KEY, max_model_len=1024)
    server.start()
    yield server, ckpt, root, full
    server.stop()


def _manager(server, key: str = API_KEY):
    from fireworks.training.sdk import DeploymentManager

    return DeploymentManager(api_key=key, base_url=server.base)


def _sample(server, prompt, **kw):
    from fireworks.training.sdk import DeploymentSampler

    sampler = DeploymentSampler(inference_url=server.base, model=NAME, api_key=API_KEY)
    return asyncio.run(sampler.sample_with_prompt_tokens(prompt, **kw))


def _status(dm) -> dict:
    return dm.hotload_check_status(DEPLOYMENT, BASE_MODEL)["replicas"][0]


def test_manager_hot_loads_and_sampler_logprobs_equal_the_trainers(env):
    server, ckpt, root, full = env
    dm = _manager(server)
    assert dm.account_id == "local"  # GET /v1/accounts with X-Api-Key only: no private attribute needed
    info = dm.get(DEPLOYMENT)
    # the base model by name, never the server's --model path (issue 54 point 8; no --served-model-name here)
    assert (info.state, info.base_model, info.inference_model) == ("READY", Path(ckpt).name, NAME)
    assert dm.get("elsewhere") is None  # another deployment: 404, which the SDK reads as "none"

    assert dm.hotload_and_wait(DEPLOYMENT, BASE_MODEL, "step-1-0a1b2c3d", timeout_seconds=120)
    assert _status(dm)["current_snapshot_identity"] == "step-1-0a1b2c3d"
    meta = {
        "previous_snapshot_identity": "step-1-0a1b2c3d",
        "compression_format": "arc_v2",
        "checksum_format": "alder32",
    }
    assert dm.hotload_and_wait(
        DEPLOYMENT, BASE_MODEL, "step-2-4e5f6a7b", incremental_snapshot_metadata=meta, timeout_seconds=120
    )
    replica = _status(dm)
    assert replica["current_snapshot_identity"] == "step-2-4e5f6a7b" and replica["readiness"]

    served = str(full / "step-2-4e5f6a7b")
    samples = _sample(server, PROMPT, n=3, max_tokens=8, temperature=1.0, logprobs=True)
    assert len(samples) == 3
    seqs = [c.full_tokens for c in samples]
    assert all(
        s[: len(PROMPT)] == PROMPT
        and c.prompt_len == len(PROMPT)
        and len(c.sampling_logprobs) == c.completion_len == len(s) - len(PROMPT) > 0
        for s, c in zip(seqs, samples, strict=True)
    )
    ours = trainer_logprobs(served, seqs, [len(PROMPT)] * 3, dtype="bfloat16")
    stock = trainer_logprobs(served, seqs, [len(PROMPT)] * 3, dtype="bfloat16", batch_invariant=False)
    sampled = [torch.tensor(c.sampling_logprobs, dtype=torch.float32) for c in samples]
    assert all(torch.equal(t, s) for t, s in zip(ours, sampled, strict=True))  # KL exactly 0
    assert not all(torch.equal(t, s) for t, s in zip(stock, sampled, strict=True))  # negative control

    # compute_logprobs' way: echo with one token; prompt rows (after the first) are the trainer's prompt log-probs
    echoed = _sample(server, PROMPT, n=1, max_tokens=1, temperature=1.0, logprobs=True, echo=True)[0]
    assert echoed.logprobs_echoed and len(echoed.inference_logprobs) == len(PROMPT)
    prompt_lps = trainer_logprobs(served, [echoed.full_tokens], [1], dtype="bfloat16")[0]
    assert torch.equal(torch.tensor(echoed.inference_logprobs, dtype=torch.float32), prompt_lps)


def _post(server, body, headers=None, path=HL):
    return requests.post(
        server.base + path,
        json=body,
        timeout=120,
        headers={"Authorization": f"Bearer {API_KEY}", "fireworks-deployment": NAME, **(headers or {})},
    )


def test_refusals_change_nothing(env):
    server, ckpt, root, full = env
    dm = _manager(server)
    before = _status(dm)["current_snapshot_identity"]
    with pytest.raises(httpx.HTTPStatusError) as e:  # the SDK raises what the route answers
        _manager(server, key="wrong").hotload(DEPLOYMENT, BASE_MODEL, "step-1-0a1b2c3d")
    assert e.value.response.status_code == 401
    assert requests.get(server.base + "/v1/accounts", headers={"X-Api-Key": "wrong"}, timeout=30).status_code == 401
    models = requests.get(server.base + "/v1/models", headers={"X-Api-Key": API_KEY}, timeout=30)
    # no --served-model-name: the model is served under its directory's name, and no card shows a server path (issue
    # 54 point 8: vLLM's own id and root were the --model path); the path is still accepted as a request's model
    assert (
        models.status_code == 200
        and [(m["id"], m["root"]) for m in models.json()["data"]] == [(Path(ckpt).name, Path(ckpt).name)]
        and str(Path(ckpt).parent) not in models.text
    )
    for model in (ckpt, Path(ckpt).name):
        r = requests.post(
            server.base + "/v1/completions",
            json={"model": model, "prompt": PROMPT, "max_tokens": 1},
            headers={"X-Api-Key": API_KEY},
            timeout=60,
        )
        assert r.status_code == 200 and r.json()["model"] == Path(ckpt).name, r.text
    with pytest.raises(httpx.HTTPStatusError) as e:
        dm.hotload(DEPLOYMENT, BASE_MODEL, "no-such-snapshot")
    assert e.value.response.status_code == 404
    # not a deployment of this server; reset_prompt_cache not a boolean; a field of our own spelling
    assert (
        _post(server, {"identity": "step-1-0a1b2c3d"}, {"fireworks-deployment": "accounts/x/deployments/y"}).status_code
        == 404
    )
    r = _post(server, {"identity": "step-1-0a1b2c3d", "reset_prompt_cache": "all"})
    assert r.status_code == 400 and "true or false" in r.json()["error"]
    assert _post(server, {"identity": "step-1-0a1b2c3d", "lora_name": "a"}).status_code == 422
    # a snapshot that fails verification: refused (422), and the SDK's waiter stops on stage "error"
    bad = root / "bad-0c0ffee0"
    write_full_snapshot(
        {k: v[..., :1] for k, v in read_snapshot_tensors(root / "step-1-0a1b2c3d").items()},
        ckpt,
        bad,
        numerics=NumericsMode.build(True, "bfloat16").to_dict(),
    )
    with pytest.raises(httpx.HTTPStatusError) as e:
        dm.hotload(DEPLOYMENT, BASE_MODEL, "bad-0c0ffee0")
    assert e.value.response.status_code == 422
    replica = _status(dm)
    assert replica["loading_state"] == {"stage": "error", "target_snapshot_identity": "bad-0c0ffee0"}
    assert dm.wait_for_hotload(DEPLOYMENT, BASE_MODEL, "bad-0c0ffee0", timeout_seconds=30, poll_interval=1) is False
    # completions: another model, a feature zerokld does not serve, ``stream`` (or another boolean) not a JSON
    # boolean (issue 54 point 8: "yes", 1 and [true] were taken as true)
    for body, status in (
        ({"model": "accounts/x/deployments/y", "prompt": PROMPT, "max_tokens": 2}, 400),
        ({"model": NAME, "prompt": PROMPT, "max_tokens": 2, "images": ["data:,"]}, 400),
        ({"model": NAME, "prompt": PROMPT, "max_tokens": 2, "bogus": 1}, 400),
        *(({"model": NAME, "prompt": PROMPT, "max_tokens": 2, "stream": s}, 400) for s in ("yes", 1, [True], "true")),
        # the schema's other booleans too (issue 85 point 4: each was a 200)
        *(
            ({"model": NAME, "prompt": PROMPT, "max_tokens": 2, k: "yes"}, 400)
            for k in ("echo", "raw_output", "ignore_eos", "return_token_ids", "perf_metrics_in_response")
        ),
    ):
        r = _post(server, body, path="/inference/v1/completions")
        assert r.status_code == status, (body, r.text)
        assert str(ckpt) not in r.text  # the wrong model's answer names no server path
    assert replica["current_snapshot_identity"] == before == _status(dm)["current_snapshot_identity"]


def test_streamed_completion_is_one_complete_sse_stream(env):
    """``stream: true`` (what DeploymentSampler sends) answers SSE whose chunk carries every token id and log-prob,
    then ``[DONE]``; the snapshot that sampled it is named in the response header."""
    server = env[0]
    r = _post(
        server,
        {
            "model": NAME,
            "prompt": PROMPT,
            "max_tokens": 5,
            "temperature": 1.0,
            "stream": True,
            "logprobs": True,
            "raw_output": True,
            "top_k": 0,
            "top_p": 1.0,
        },
        path="/inference/v1/completions",
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line.removeprefix("data: ") for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) == 2
    choice = json.loads(events[0])["choices"][0]
    ids = choice["raw_output"]["completion_token_ids"]
    assert len(ids) == len(choice["logprobs"]["content"]) == 5
    assert all(row["sampling_logprob"] == row["logprob"] is not None for row in choice["logprobs"]["content"])
    assert r.headers["x-zerokld-snapshot-identity"]
    # another temperature: no sampling log-prob is claimed (the server returns the model's own)
    r = _post(
        server,
        {"model": NAME, "prompt": PROMPT, "max_tokens": 3, "temperature": 0.7, "logprobs": True},
        path="/inference/v1/completions",
    )
    assert r.status_code == 200
    assert all(row["sampling_logprob"] is None for row in r.json()["choices"][0]["logprobs"]["content"])


def test_every_int64_seed_samples_and_repeats(env):
    """vLLM takes any int64 ``seed``; each one samples, the same seed repeats its tokens, and the engine lives on.
    Negative control (found by tests/servers/test_server_fuzz.py, seen by hand): before shared_numerics.sampling took
    negative seeds, ``seed: -1377816`` raised inside the engine's step, the engine stopped, and every later request
    failed."""
    server = env[0]
    tokens = {}
    for seed in (-1377816, -(2**63), 2**63 - 1, 7):
        for _ in range(2):
            r = _post(
                server,
                {
                    "model": NAME,
                    "prompt": PROMPT,
                    "max_tokens": 6,
                    "temperature": 1.0,
                    "seed": seed,
                    "raw_output": True,
                },
                path="/inference/v1/completions",
            )
            assert r.status_code == 200, (seed, r.text)
            ids = r.json()["choices"][0]["raw_output"]["completion_token_ids"]
            assert tokens.setdefault(seed, ids) == ids, seed  # the seed, not the call, decides
    assert len({tuple(v) for v in tokens.values()}) == len(tokens)  # four seeds, four samples
    assert requests.get(server.base + "/health", timeout=10).status_code == 200


def test_protocol_maps_fireworks_spelling_onto_ours():
    """No server: the body mapping (booleans to reset modes, our own fields refused) and the status mapping (a
    failed newest load reads stage "error"; a failure older than the snapshot now serving does not)."""
    from deltasync.protocol import HotLoadError, Signal, fireworks_status

    sig = Signal.from_fireworks({"identity": "s-1", "reset_prompt_cache": False}, "sync")
    assert (sig.reset_prompt_cache, sig.transition) == ("none", "sync")
    assert Signal.from_fireworks({"identity": "s-1"}, "async").reset_prompt_cache == "all"
    for body, status in (
        ({"identity": "s-1", "reset_prompt_cache": "none"}, 400),
        ({"identity": "../x"}, 400),
        ({"identity": "s-1", "lora_name": "a"}, 422),
        (["s-1"], 422),
    ):
        with pytest.raises(HotLoadError) as e:
            Signal.from_fireworks(body, "async")
        assert e.value.status == status and "extra inputs are not permitted" not in str(e.value).lower()

    def replica(ready_since, failed_at):
        return {
            "replicas": [
                {
                    "current_snapshot_identity": "s-1",
                    "readiness": True,
                    "ready_since": ready_since,
                    "loading_state": {"stage": "idle", "target_snapshot_identity": None},
                    "last_error": {"identity": "s-2", "error": "refused", "at": failed_at},
                }
            ]
        }

    assert fireworks_status(replica(10.0, 11.0))["replicas"][0]["loading_state"] == {
        "stage": "error",
        "target_snapshot_identity": "s-2",
    }
    assert fireworks_status(replica(12.0, 11.0))["replicas"][0]["loading_state"]["stage"] == "idle"


def test_completion_request_mapping():
    from vllm_plugin.hotload.fireworks import FireworksRequestError, vllm_completion_request

    body = {
        "model": NAME,
        "prompt": PROMPT,
        "n": 1,
        "max_tokens": 4,
        "temperature": 1.0,
        "stream": True,
        "perf_metrics_in_response": True,
        "raw_output": True,
        "logprobs": True,
        "top_p": 1.0,
        "top_k": 0,
    }
    req = vllm_completion_request(body, "/ckpt", NAME)
    assert req == {
        "prompt": PROMPT,
        "n": 1,
        "max_tokens": 4,
        "temperature": 1.0,
        "top_p": 1.0,
        "model": "/ckpt",
        "stream": False,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "logprobs": 0,
    }
    assert vllm_completion_request({**body, "top_k": 20, "logprobs": 3}, "/ckpt", NAME)["top_k"] == 20
    assert "logprobs" not in vllm_completion_request({**body, "logprobs": False}, "/ckpt", NAME)
    with pytest.raises(FireworksRequestError, match="not served by zerokld"):
        vllm_completion_request({**body, "routing_matrix_format": "parquet_v1"}, "/ckpt", NAME)
    # a malformed top_logprobs is the client's error (a 400), not a ValueError of the server's (500 before issue 54)
    for top in ("3", [1], -1, True, 2.5):
        with pytest.raises(FireworksRequestError, match="top_logprobs"):
            vllm_completion_request({**body, "logprobs": None, "top_logprobs": top}, "/ckpt", NAME)
    assert vllm_completion_request({**body, "logprobs": None, "top_logprobs": 2}, "/ckpt", NAME)["logprobs"] == 2


@pytest.fixture(scope="module")
def training_server(env, tmp_path_factory):
    """``python -m titan_plugin.training_server`` on the same checkpoint, writing into the vLLM server's snapshot
    root; stopped by PID."""
    from titan_plugin.training_server import TrainingServerProcess

    _, ckpt, root, _ = env
    server = TrainingServerProcess(
        ckpt, root, API_KEY, tmp_path_factory.mktemp("trainer") / "trainer.log", ["--seq-gap-s", 3]
    )
    yield server.start()
    server.stop()


def test_sdk_rl_loop_trains_hot_loads_and_samples_with_zero_kl(env, training_server, monkeypatch, request):
    """The unmodified SDK end to end: ``FiretitanServiceClient`` trains on our TorchTitan server, ``WeightSyncer``
    saves each policy (base, then delta) and hot-loads it into the vLLM server, ``DeploymentSampler`` samples from it;
    the sampler's log-probs equal the training server's ``forward`` log-probs of the same tokens bit for bit, at
    every step (negative control: after the update, the trainer's log-probs of those tokens differ)."""
    from fireworks.training.sdk import AdamParams, FiretitanServiceClient, WeightSyncer

    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    server = env[0]
    svc = FiretitanServiceClient(base_url=training_server, api_key=API_KEY)
    request.addfinalizer(svc.close)  # its session heartbeat stops with the test
    tc = svc.create_training_client(base_model=BASE_MODEL)
    syncer = WeightSyncer(
        policy_client=tc,
        deploy_mgr=_manager(server),
        deployment_id=DEPLOYMENT,
        base_model=BASE_MODEL,
        hotload_timeout=120,
    )

    for step in range(2):
        syncer.save_and_hotload(f"policy-{step}")
        samples = _sample(server, PROMPT, n=2, max_tokens=6, temperature=1.0, logprobs=True)
        data = [
            sdk_datum(c.full_tokens, c.prompt_len, c.sampling_logprobs, adv)
            for c, adv in zip(samples, (1.0, -1.0), strict=True)
        ]
        sampled = [torch.tensor(c.sampling_logprobs, dtype=torch.float32) for c in samples]
        train = completion_logprobs_from_forward(tc, data, samples)
        assert [t.shape for t in train] == [s.shape for s in sampled]
        assert all(torch.equal(t, s) for t, s in zip(train, sampled, strict=True)), step  # KL exactly 0
        out = tc.forward_backward(data, "ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}).result()
        assert all(k.count(":") == 1 for k in out.metrics)
        tc.optim_step(AdamParams(learning_rate=1e-2)).result()
        moved = completion_logprobs_from_forward(tc, data, samples)
        assert not all(torch.equal(t, s) for t, s in zip(moved, sampled, strict=True))  # negative control
    ledger = requests.get(
        server.base + "/zerokld/v1/hot_load/ledger", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30
    ).json()
    kinds = {r["identity"]: r.get("kind") for r in ledger["rows"] if r["identity"].startswith("policy-")}
    assert sorted(kinds.values()) == ["full", "incremental"], kinds  # base, then a delta the replica verified


def test_training_server_refusals_apply_nothing(env, training_server):
    """Bad training requests are answered in the shapes the SDK understands — 401 without the key, 400 at submit
    (unknown model, a seq_id used twice), ``{"error", "category": "user"}`` from the future (unknown loss, ragged
    TensorData, out-of-vocabulary tokens — refused at submit, before anything runs —, a seq_id gap that never closes)
    — and change nothing: the model's log-probs after them equal before."""
    import time

    def post(path, body, key=API_KEY):
        return requests.post(f"{training_server}/api/v1/{path}", json=body, headers={"X-Api-Key": key}, timeout=60)

    def result(rid):
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            r = post("retrieve_future", {"request_id": rid, "allow_metadata_only": True}).json()
            if r.get("type") != "try_again":
                return r
        raise AssertionError("no result")

    assert post("create_session", {}, key="wrong").status_code == 401
    assert requests.post(f"{training_server}/api/v1/create_session", json={}, timeout=30).status_code == 401
    created = post(
        "create_model",
        {
            "session_id": "s",
            "model_seq_id": 0,
            "base_model": BASE_MODEL,
            "lora_config": {"rank": 0},
            "type": "create_model",
        },
    ).json()
    model = result(created["request_id"])["model_id"]
    tokens = PROMPT[:12]

    def datum(inputs=None, chunk_tokens=None):
        td = {"target_tokens": {"data": tokens[1:], "dtype": "int64", "shape": [11]}}
        return {
            "model_input": {"chunks": [{"type": "encoded_text", "tokens": chunk_tokens or tokens[:-1]}]},
            "loss_fn_inputs": inputs or td,
        }

    seq = iter(range(1, 100))

    def forward():
        rid = post(
            "forward",
            {"forward_input": {"data": [datum()], "loss_fn": "cross_entropy"}, "model_id": model, "seq_id": next(seq)},
        ).json()["request_id"]
        return result(rid)["loss_fn_outputs"][0]["logprobs"]["data"]

    before = forward()
    assert post("forward", {"forward_input": {"data": [datum()]}, "model_id": "nope", "seq_id": 1}).status_code == 400
    used = post("forward", {"forward_input": {"data": [datum()]}, "model_id": model, "seq_id": 1})
    assert used.status_code == 400 and "already used" in used.json()["detail"]
    ragged = {"target_tokens": {"data": tokens[1:], "dtype": "int64", "shape": [12]}}
    for spec, why in (
        ({"data": [datum()], "loss_fn": "no_such_loss"}, "no_such_loss"),
        ({"data": [datum(ragged)], "loss_fn": "cross_entropy"}, "shape"),
        ({"data": [datum(chunk_tokens=[10**9] * 11)], "loss_fn": "cross_entropy"}, "token ids"),
    ):
        rid = post("forward_backward", {"forward_backward_input": spec, "model_id": model, "seq_id": next(seq)}).json()[
            "request_id"
        ]
        answer = result(rid)
        assert answer.get("category") == "user" and why in answer["error"], answer
    # a gap in the numbering: the later request fails after --seq-gap-s, the missing seq_id stays expected
    expected = next(seq)
    rid = post(
        "forward",
        {"forward_input": {"data": [datum()], "loss_fn": "cross_entropy"}, "model_id": model, "seq_id": expected + 1},
    ).json()["request_id"]
    answer = result(rid)
    assert answer.get("category") == "user" and "never arrived" in answer["error"], answer
    seq = iter(range(expected, 100))
    assert forward() == before  # nothing was applied (no gradient accumulated, no step)


def test_sdk_checkpoints_adam_params_and_custom_loss(env, training_server, monkeypatch, request):
    """Through the unmodified SDK: ``forward_backward_custom`` (the SDK's two passes: ``forward``, then
    cross_entropy with signed weights ``-dLoss/dlogprobs``), ``optim_step`` with every AdamParams field (weights
    move; ``grad_norm:mean`` reported), ``save_state`` / ``list_checkpoints`` / ``load_state_with_optimizer``
    restoring the saved log-probs bit for bit."""
    from fireworks.training.sdk import AdamParams, FiretitanServiceClient

    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    svc = FiretitanServiceClient(base_url=training_server, api_key=API_KEY)
    request.addfinalizer(svc.close)
    tc = svc.create_training_client(base_model=BASE_MODEL)
    seqs = [PROMPT + list(range(50, 50 + k)) for k in (5, 9)]
    data = [sdk_datum(s, len(PROMPT), None, 1.0) for s in seqs]

    def logprobs():
        return [list(o["logprobs"].data) for o in tc.forward(data, "cross_entropy").result().loss_fn_outputs]

    before = logprobs()
    saved = tc.save_state("ckpt-0").result().path
    assert saved == "ckpt-0" and "ckpt-0" in tc.list_checkpoints()

    def loss_fn(batch, lps):  # a custom objective: minimise the completion tokens' mean log-prob
        w = [torch.tensor(d.loss_fn_inputs["weights"].data) for d in batch]
        return sum((lp * wi).sum() for lp, wi in zip(lps, w, strict=True)) / sum(x.sum() for x in w), {}

    tc.forward_backward_custom(data, loss_fn).result()
    step = tc.optim_step(
        AdamParams(learning_rate=5e-2, beta1=0.8, beta2=0.9, eps=1e-8, weight_decay=0.01, grad_clip_norm=1.0)
    ).result()
    assert step.metrics and "grad_norm:mean" in step.metrics
    after = logprobs()
    assert sum(map(sum, after)) < sum(map(sum, before))  # the custom loss moved the model its way
    tc.load_state_with_optimizer(saved).result()
    assert logprobs() == before


def test_training_server_killed_mid_step_resumes_at_the_last_optim_step(env, tmp_path, monkeypatch, request):
    """Issue 37 point 4: a training server with ``--state-dir`` is SIGKILLed after a forward_backward whose
    optim_step never came; restarted on the same state dir and port, the same SDK client (same model_id, its
    numbering going on) sees the model as it was after its last completed optim_step — bitwise — and trains on
    (negative control: the killed step's gradients would have moved it; the restored model has not)."""
    from fireworks.training.sdk import AdamParams, FiretitanServiceClient

    from titan_plugin.training_server import TrainingServerProcess

    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    _, ckpt, root, _ = env
    server = TrainingServerProcess(ckpt, root, API_KEY, tmp_path / "trainer.log", ["--state-dir", tmp_path / "state"])
    request.addfinalizer(server.stop)
    base = server.start()
    port = int(base.rsplit(":", 1)[1])
    svc = FiretitanServiceClient(base_url=base, api_key=API_KEY)
    request.addfinalizer(svc.close)
    tc = svc.create_training_client(base_model=BASE_MODEL)
    data = [sdk_datum(PROMPT + list(range(50, 50 + k)), len(PROMPT), None, 1.0) for k in (5, 9)]

    def logprobs():
        return [list(o["logprobs"].data) for o in tc.forward(data, "cross_entropy").result().loss_fn_outputs]

    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(AdamParams(learning_rate=5e-2)).result()
    after_step = logprobs()
    assert tc.save_state("named").result().path == "named"
    tc.forward_backward(data, "cross_entropy").result()  # the step in progress: its optim_step never comes
    server.stop(kill=True)
    server.start(port=port)
    server.stop(kill=True)  # killed again right after its restore: the registry must still hold everything
    server.start(port=port)
    assert logprobs() == after_step  # the last completed optim_step's state, nothing of the killed step
    assert "named" in tc.list_checkpoints()
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(AdamParams(learning_rate=5e-2)).result()
    assert logprobs() != after_step  # it trains on (and a step does move it: the control for the check above)
