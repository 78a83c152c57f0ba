"""Every route of both servers fuzzed from their OpenAPI documents with Schemathesis (issue 54 point 6): bodies,
query strings and headers generated from each route's schema — ones that fit it and ones that do not (Schemathesis'
positive and negative modes) —, a fixed seed and example budget. No answer is a 5xx, none hangs (each call has a
timeout), ``/health`` answers after every route, and the server's memory stays bounded. The API key is sent with every
call and left out of the document the fuzzer reads (its negative mode would otherwise spend most examples on 401s; the
key is tested in tests/test_fireworks_wire.py and tests/test_hotload.py).

* The training server (``python -m titan_plugin.training_server``): bodies from tinker 0.38's own request models
  (:func:`titan_plugin.training_server.request_schemas`), ``model_id`` pointing at a real model half of the time so
  that the calls reach the trainer's checks. Negative control (run by hand, the note of issue 54): the same fuzz
  against the server before issue 54's fix answered 17 of ~2,000 calls with a 500 (``model_id`` as a list or an
  object).
* The vLLM server with zerokld and its hot-load endpoint (:class:`vllm_plugin.serve.HotLoadServer`): vLLM's own
  routes and the hot-load and Fireworks routes (their bodies and headers: :func:`deltasync.protocol.
  openapi_operations`, :data:`vllm_plugin.hotload.fireworks.COMPLETIONS_SCHEMA`), with the real deployment name, a
  real snapshot identity and the served model half of the time so that calls reach the loads and the sampler. One 5xx
  is vLLM's by design and allowed: ``501`` from ``/v1/systemone`` ("The model does not support the structured
  decision API").
"""
from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import requests

pytestmark = [pytest.mark.long, pytest.mark.timeout(1500)]

API_KEY = "fw-zerokld-fuzz"
EXAMPLES = 60  # per route and mode
SEED = 54


def _peak_mib(pid: int) -> float:
    return int(next(line.split()[1] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                    if line.startswith("VmHWM"))) / 1024


def _fuzz(url: str, doc: dict, headers: dict, aim, allowed=frozenset()) -> dict:
    """Fuzz every operation of OpenAPI ``doc`` against ``url``, both modes; ``aim(case, pick)`` may point a generated
    case at real objects (``pick``: the seeded random source). Returns the status-code counts; asserts no 5xx other
    than ``allowed`` ``(path, status)`` pairs and ``/health`` after every route."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, seed, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    doc.pop("security", None)
    doc.get("components", {}).pop("securitySchemes", None)
    schema = schemathesis.openapi.from_dict(doc)
    pick = random.Random(SEED)
    failures, statuses = [], {}
    for result in schema.get_all_operations():
        op = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @seed(SEED)
            @settings(max_examples=EXAMPLES, deadline=None, database=None,
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(mode))
            def fuzz(case):
                aim(case, pick)
                r = case.call(base_url=url, headers=headers, timeout=60)
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                if r.status_code >= 500 and (op.path, r.status_code) not in allowed:
                    failures.append((case.method, case.path, r.status_code, r.text[:300], str(case.body)[:300]))

            try:
                fuzz()
            except Unsatisfiable:  # nothing to make invalid (a route without parameters or body)
                assert mode == GenerationMode.NEGATIVE, op.path
            assert requests.get(url + "/health", timeout=10).status_code == 200, op.path
    print("status codes:", dict(sorted(statuses.items())))
    assert failures == [], failures[:5]
    start = time.monotonic()
    assert requests.get(url + "/health", timeout=10).status_code == 200
    assert time.monotonic() - start < 10
    return statuses


@pytest.mark.titan
def test_every_training_server_route_survives_schema_fuzzing(checkpoint_factory, tmp_path):
    from titan_plugin.training_server import TrainingServerProcess

    (tmp_path / "snapshots").mkdir()
    proc = TrainingServerProcess(checkpoint_factory("qwen3", "bfloat16"), tmp_path / "snapshots", API_KEY,
                                 tmp_path / "server.log", ["--seq-gap-s", 5, "--max-models", 4,
                                                           "--max-body-bytes", 4 << 20])
    url = proc.start()
    headers = {"X-Api-Key": API_KEY}
    try:
        created = requests.post(url + "/api/v1/create_model", json={"base_model": "tiny"}, headers=headers,
                                timeout=60).json()
        while True:
            done = requests.post(url + "/api/v1/retrieve_future", json={"request_id": created["request_id"]},
                                 headers=headers, timeout=60).json()
            if done.get("type") != "try_again":
                break
        model = done["model_id"]
        doc = requests.get(url + "/openapi.json", timeout=30).json()
        assert doc["paths"]["/api/v1/forward"]["post"]["requestBody"]  # the bodies are described

        def aim(case, pick):
            if isinstance(case.body, dict) and "model_id" in case.body and pick.random() < 0.5:
                case.body["model_id"] = model  # reach the model's own checks too

        statuses = _fuzz(url, doc, headers, aim)
        assert sum(statuses.values()) >= EXAMPLES * 20 and statuses.get(200) and statuses.get(400)
        peak = _peak_mib(proc.proc.pid)
        assert peak < 6 * 1024, f"server peak memory {peak:.0f} MiB"
    finally:
        proc.stop()
    assert "Traceback" not in (tmp_path / "server.log").read_text(errors="replace")


@pytest.mark.vllm
def test_every_vllm_server_route_survives_schema_fuzzing(engine_slot, checkpoint_factory, tmp_path):
    from deltasync import read_snapshot_tensors, write_full_snapshot, write_incremental_snapshot
    from deltasync.protocol import FIREWORKS_DEPLOYMENT_HEADER, FIREWORKS_HOT_LOAD, PREFIX
    from shared_numerics import NumericsMode
    from vllm_plugin.serve import HotLoadServer

    engine_slot.close()
    ckpt = checkpoint_factory("qwen3", "bfloat16")
    root = tmp_path / "snapshots"
    root.mkdir()
    stamp = NumericsMode.build(True, "bfloat16").to_dict()
    base = read_snapshot_tensors(ckpt)
    write_full_snapshot({k: v + 1 if k.endswith("norm.weight") else v for k, v in base.items()}, ckpt,
                        root / "step-1", numerics=stamp)
    write_incremental_snapshot(root / "step-1", base, root / "step-2", numerics=stamp)
    server = HotLoadServer(ckpt, root, tmp_path / "state", tmp_path / "server.log", API_KEY, max_model_len=256)
    server.start()
    deployment = "accounts/local/deployments/local"
    try:
        doc = requests.get(server.base + "/openapi.json", timeout=30).json()
        for method, path in (("post", PREFIX), ("post", FIREWORKS_HOT_LOAD), ("post", "/inference/v1/completions")):
            assert doc["paths"][path][method]["requestBody"], path  # our routes' bodies are described
        models = requests.get(server.base + "/v1/models", headers={"X-Api-Key": API_KEY}, timeout=30).json()
        assert models["data"][0]["id"] == Path(ckpt).name  # no server path (issue 54 point 4)
        assert str(tmp_path) not in str(models) and ckpt not in str(models)

        def aim(case, pick):
            if case.headers and FIREWORKS_DEPLOYMENT_HEADER in case.headers and pick.random() < 0.5:
                case.headers[FIREWORKS_DEPLOYMENT_HEADER] = deployment
            if not isinstance(case.body, dict) or pick.random() < 0.5:
                return
            if "identity" in case.body:  # a real snapshot: full, or the delta on it
                case.body["identity"] = pick.choice(["step-1", "step-2"])
            if "model" in case.body:
                case.body["model"] = deployment if case.path == "/inference/v1/completions" else Path(ckpt).name

        pid = server.proc.pid
        statuses = _fuzz(server.base, doc, {"Authorization": f"Bearer {API_KEY}"}, aim,
                         allowed={("/v1/systemone", 501)})
        assert sum(statuses.values()) >= EXAMPLES * 20 and statuses.get(200) and statuses.get(400)
        peak = _peak_mib(pid)
        assert peak < 8 * 1024, f"API server peak memory {peak:.0f} MiB"
    finally:
        server.stop()
    log = (tmp_path / "server.log").read_text(errors="replace")
    assert "Exception in ASGI application" not in log
