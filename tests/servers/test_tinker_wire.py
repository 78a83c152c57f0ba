"""tinker 0.38's training wire on the zerokld training server (issue 38, first part: the training calls), with the
official client, unmodified (``tinker==0.38.0``): ``client/config``, protobuf ``forward`` / ``forward_backward``
requests (zstd too) and protobuf results, ``optim_step``; the log-probs are the trainer's own, bit for bit, and
malformed protobuf is refused with nothing applied. Sampling sessions: ``tests/servers/test_tinker_sampling.py``."""

from __future__ import annotations

import numpy as np
import pytest
import requests
import torch

from titan_plugin import tinker_proto

API_KEY = "tml-zerokld-test"  # tinker accepts only tml- (or JWT) keys
PROMPT = [1] + list(range(10, 30))


def _datum(tokens, prompt_len, extra=None):
    from tinker import types

    n = len(tokens) - 1
    inputs = {
        "target_tokens": types.TensorData(data=tokens[1:], dtype="int64", shape=[n]),
        "weights": types.TensorData(
            data=[0.0] * (prompt_len - 1) + [1.0] * (n - prompt_len + 1), dtype="float32", shape=[n]
        ),
    }
    for k, v in (extra or {}).items():
        inputs[k] = types.TensorData(data=list(v), dtype="float32", shape=[n])
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def test_requests_and_results_convert_both_ways():
    """A request encoded by tinker's own ``request_conv`` (float and string loss configs, int64 / float32 tensors,
    zstd or plain) reads back as the JSON body of the same call; a result encoded here decodes with tinker's own
    ``response_conv`` to the same values; unreadable bodies are WireErrors."""
    import zstandard
    from tinker import types
    from tinker.proto import tinker_public_pb2 as pb
    from tinker.proto.request_conv import forward_backward_request_to_proto
    from tinker.proto.response_conv import deserialize_forward_backward_output

    datum = _datum(PROMPT + [40, 41], len(PROMPT), {"advantages": [0.5] * (len(PROMPT) + 1)})
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[datum], loss_fn="ppo", loss_fn_config={"clip_low_threshold": 0.8, "mode": "x"}
        ),
        model_id="model-1",
        seq_id=7,
    )
    raw = forward_backward_request_to_proto(req).SerializeToString()
    for body, enc in ((raw, None), (zstandard.ZstdCompressor().compress(raw), "zstd")):
        got = tinker_proto.forward_backward_request(body, enc)
        assert got["model_id"] == "model-1" and got["seq_id"] == 7 and got["forward_only"] is False
        spec = got["forward_backward_input"]
        assert spec["loss_fn"] == "ppo" and spec["loss_fn_config"] == {"clip_low_threshold": 0.8, "mode": "x"}
        (d,) = spec["data"]
        assert d["model_input"]["chunks"] == [{"type": "encoded_text", "tokens": PROMPT + [40]}]
        assert d["loss_fn_inputs"]["target_tokens"] == {
            "data": PROMPT[1:] + [40, 41],
            "dtype": "int64",
            "shape": [len(PROMPT) + 1],
        }
        assert d["loss_fn_inputs"]["advantages"]["data"] == [0.5] * (len(PROMPT) + 1)
    lps = [[-0.25, -1.5], [-3.0]]
    out = deserialize_forward_backward_output(
        tinker_proto.forward_backward_output(
            {
                "loss_fn_output_type": "ppo",
                "metrics": {"loss:sum": 2.5},
                "loss_fn_outputs": [{"logprobs": {"data": v, "dtype": "float32", "shape": [len(v)]}} for v in lps],
            }
        )
    )
    assert out.metrics == {"loss:sum": 2.5} and out.loss_fn_output_type == "ppo"
    assert [o["logprobs"].data for o in out.loss_fn_outputs] == lps

    bad = pb.ForwardBackwardRequest()
    bad.ParseFromString(raw)
    bad.data[0].loss_fn_inputs["weights"].dtype = 99
    for body, enc, match in (
        (b"\xff\xff\xff", None, "not a tinker ForwardBackwardRequest"),
        (raw, "gzip", "Content-Encoding"),
        (b"nope", "zstd", "does not decompress"),
        (bad.SerializeToString(), None, "unknown dtype"),
    ):
        with pytest.raises(tinker_proto.WireError, match=match):
            tinker_proto.forward_backward_request(body, enc)


@pytest.fixture(scope="module")
def server(checkpoint_factory, tmp_path_factory):
    """``python -m titan_plugin.training_server`` (a tml- key), stopped by PID."""
    from titan_plugin.training_server import TrainingServerProcess

    ckpt = checkpoint_factory("qwen3", "bfloat16")
    tmp = tmp_path_factory.mktemp("tinker")
    (tmp / "snapshots").mkdir()
    proc = TrainingServerProcess(ckpt, tmp / "snapshots", API_KEY, tmp / "trainer.log", ["--seq-gap-s", 3])
    yield proc.start(), ckpt
    proc.stop()


@pytest.mark.titan
def test_tinker_client_trains_on_the_protobuf_wire(server, monkeypatch, request):
    """The unmodified tinker client (zstd-compressed protobuf, as the server's client/config asks): a LoRA training
    client; ``forward`` (protobuf, forward_only) gives the base model's log-probs (LoRA B = 0) equal to TorchTitan's
    own bit for bit; ``forward_backward`` with ``importance_sampling`` and ``ppo`` (its clip thresholds) answers
    per-token log-probs and ``name:reduction`` metrics; a body that is not protobuf is refused at submit (400) and
    changes nothing; ``optim_step`` changes the log-probs (negative control: the update was applied); an uncompressed
    protobuf forward sent by hand gets its result as protobuf, the client's log-probs."""
    import tinker
    from tinker import types

    from titan_plugin import trainer_logprobs

    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    url, ckpt = server
    svc = tinker.ServiceClient(base_url=url, api_key=API_KEY)
    request.addfinalizer(lambda: svc.close("success"))  # its session heartbeat stops with the test
    tc = svc.create_lora_training_client(base_model=ckpt, rank=4).result()
    seqs = [PROMPT + [41, 42, 43], PROMPT[:12] + [50, 51]]
    data = [_datum(s, len(PROMPT) if i == 0 else 12) for i, s in enumerate(seqs)]

    def logprobs():
        out = tc.forward(data, "cross_entropy").result()
        return [torch.tensor(np.asarray(o["logprobs"].data), dtype=torch.float32) for o in out.loss_fn_outputs]

    base = logprobs()
    want = trainer_logprobs(ckpt, seqs, [1, 1], dtype="bfloat16")  # every target of each sequence
    assert [b.shape for b in base] == [w.shape for w in want]
    assert all(torch.equal(b, w) for b, w in zip(base, want, strict=True))

    extra = [{"advantages": [1.0 if i == 0 else -1.0] * b.numel(), "logprobs": b.tolist()} for i, b in enumerate(base)]
    rl = [_datum(s, len(PROMPT) if i == 0 else 12, extra[i]) for i, s in enumerate(seqs)]
    for loss, cfg in (
        ("importance_sampling", None),
        ("ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
        ("cispo", None),
        ("dro", {"beta": 0.1}),
        ("gspo", None),
    ):  # every tinker loss served
        out = tc.forward_backward(rl, loss, cfg).result()
        assert all(k.count(":") == 1 for k in out.metrics) and out.metrics, loss
        assert [len(o["logprobs"].data) for o in out.loss_fn_outputs] == [b.numel() for b in base]
    dynamic = requests.post(
        url + "/api/v1/client/dynamic_config",
        json={"sdk_version": "0.38.0"},
        timeout=30,
        headers={"X-Api-Key": API_KEY},
    )
    assert types.ClientDynamicConfigResponse.model_validate(dynamic.json()) == types.ClientDynamicConfigResponse()
    headers = {"X-Api-Key": API_KEY, "Content-Type": tinker_proto.CONTENT_TYPE}
    r = requests.post(url + "/api/v1/forward_backward", data=b"\x08\xff", timeout=30, headers=headers)
    assert r.status_code == 400 and "ForwardBackwardRequest" in r.json()["detail"]
    from tinker.proto.request_conv import forward_backward_request_to_proto

    wrong = forward_backward_request_to_proto(
        types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
            model_id=tc.model_id,
            seq_id=10**6,
        )
    )
    wrong.data[0].loss_fn_inputs["weights"].dtype = 99  # a dtype tinker's schema does not have
    r = requests.post(url + "/api/v1/forward_backward", data=wrong.SerializeToString(), timeout=30, headers=headers)
    assert r.status_code == 400 and "unknown dtype" in r.json()["detail"]
    assert all(torch.equal(a, b) for a, b in zip(logprobs(), base, strict=True))  # nothing applied
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    moved = logprobs()
    assert not any(torch.equal(a, b) for a, b in zip(moved, base, strict=True))
    saved = tc.save_state("tinker-state").result().path  # checkpoint calls: save_weights / load_weights
    tc.forward_backward(rl, "importance_sampling").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert not any(torch.equal(a, b) for a, b in zip(logprobs(), moved, strict=True))
    with pytest.warns(FutureWarning):  # (tinker 0.38 deprecates load_state for create_training_client_from_state)
        tc.load_state_with_optimizer(saved).result()
    assert all(torch.equal(a, b) for a, b in zip(logprobs(), moved, strict=True))  # back at the saved state
    # the same forward by hand, uncompressed, as the last call (the client would wait for the turn of the number
    # taken from it): the result comes back as protobuf
    from tinker.proto.response_conv import deserialize_forward_backward_output

    seq_id = tc._get_request_id() + 1  # the client's next number
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
        model_id=tc.model_id,
        seq_id=seq_id,
    )
    raw = forward_backward_request_to_proto(req)
    raw.forward_only = True
    r = requests.post(url + "/api/v1/forward_backward", data=raw.SerializeToString(), timeout=30, headers=headers)
    assert r.status_code == 200, r.text
    while True:
        res = requests.post(
            url + "/api/v1/retrieve_future",
            json={"request_id": r.json()["request_id"]},
            headers={"X-Api-Key": API_KEY},
            timeout=60,
        )
        if res.headers["content-type"] != "application/json" or res.json().get("type") != "try_again":
            break
    assert res.headers["content-type"] == tinker_proto.CONTENT_TYPE, res.text
    by_hand = deserialize_forward_backward_output(res.content).loss_fn_outputs
    assert all(
        torch.equal(torch.tensor(np.asarray(o["logprobs"].data), dtype=torch.float32), b)
        for o, b in zip(by_hand, moved, strict=True)
    )


@pytest.mark.titan
def test_unknown_loss_fails_the_request_as_the_users(server, monkeypatch, request):
    """A loss tinker knows but zerokld does not register (``stable_reinforce``) fails its future as the user's error,
    naming the registered losses (the client raises ``RequestFailedError``), and nothing was applied."""
    import tinker

    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    url, ckpt = server
    svc = tinker.ServiceClient(base_url=url, api_key=API_KEY)
    request.addfinalizer(lambda: svc.close("success"))  # its session heartbeat stops with the test
    tc = svc.create_lora_training_client(base_model=ckpt, rank=4).result()
    datum = _datum(
        PROMPT + [41, 42],
        len(PROMPT),
        {"advantages": [1.0] * (len(PROMPT) + 1), "logprobs": [-1.0] * (len(PROMPT) + 1)},
    )
    with pytest.raises(tinker.RequestFailedError, match="registered") as err:
        tc.forward_backward([datum], "stable_reinforce").result()
    from tinker.types.request_error_category import RequestErrorCategory

    assert err.value.category == RequestErrorCategory.User
