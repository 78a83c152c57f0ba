"""Hot-load on a real ``vllm serve`` (OpenAI server on loopback) with the ``zerokld_hotload`` endpoint plugin: full and
incremental (arc_v2) snapshots swap in place, zero-KLD survives every swap, bad snapshots are refused while the old
weights keep serving bit-identical logprobs, sync/async transitions, and a restart comes back consistent."""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from pathlib import Path

import pytest
import requests
import torch
import zstandard
from safetensors import safe_open
from safetensors.torch import save_file

from deltasync import apply_incremental_snapshot, read_snapshot_tensors, write_full_snapshot, write_incremental_snapshot
from shared_numerics import NumericsMode
from titan_plugin import trainer_logprobs
from vllm_plugin.serve import HotLoadServer

pytestmark = pytest.mark.vllm

API_KEY = "sk-zerokld-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
HL = "/zerokld/v1/hot_load"
PROMPT = [1] + list(range(10, 40))
MAX_MODEL_LEN = 1024  # the tiny checkpoints' max_position_embeddings
# the sync-drain test's in-flight request: as long as the context allows, each engine step slowed by STEP_DELAY_S
# (HotLoadServer.slowed_steps) until the drain has been seen, so it outlasts the signal's verification on any machine
STEP_DELAY_S = 0.05
LONG = MAX_MODEL_LEN - len(PROMPT) - 3


class Server(HotLoadServer):
    """The hot-load server under test (:class:`vllm_plugin.serve.HotLoadServer`) with this module's requests."""

    def __init__(self, ckpt: str, root: Path, state: Path, log: Path) -> None:
        super().__init__(ckpt, root, state, log, API_KEY, max_model_len=MAX_MODEL_LEN)

    def signal(
        self,
        identity: str,
        previous: str | None = None,
        headers: dict | None = None,
        compression_format: str = "arc_v2",
        **body,
    ):
        body = {"identity": identity, **body}
        if previous is not None:
            body["incremental_snapshot_metadata"] = {
                "previous_snapshot_identity": previous,
                "compression_format": compression_format,
                "checksum_format": "alder32",
            }
        return requests.post(self.base + HL, json=body, headers={**AUTH, **(headers or {})}, timeout=300)

    def get(self, path: str, **kw):
        return requests.get(self.base + path, headers=AUTH, timeout=60, **kw)

    def logprobs(self, prompt=PROMPT, max_tokens: int = 8) -> tuple[list[int], torch.Tensor, str]:
        r = requests.post(
            self.base + "/v1/completions",
            headers=AUTH,
            timeout=120,
            json={
                "model": self.ckpt,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "logprobs": 0,
                "ignore_eos": True,
                "return_tokens_as_token_ids": True,
            },
        )
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        toks = [int(t.split(":")[1]) for t in lp["tokens"]]
        return (
            toks,
            torch.tensor(lp["token_logprobs"], dtype=torch.float32),
            r.headers.get("x-zerokld-snapshot-identity"),
        )


def _perturb(sd: dict, seed: int, scale: float = 0.02) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in sd.items():
        mask = torch.rand(v.shape, generator=g) < 0.05  # ~5% of the elements change, as in an RL step
        out[k] = torch.where(mask, v + (torch.randn(v.shape, generator=g) * scale).to(v.dtype), v)
    return out


@pytest.fixture(scope="module")
def env(engine_slot, checkpoint_factory, tmp_path_factory):
    engine_slot.close()
    ckpt = checkpoint_factory("qwen3", "bfloat16")
    tmp = tmp_path_factory.mktemp("hotload")
    root, state, full = tmp / "snapshots", tmp / "state", tmp / "expected"
    root.mkdir()
    base = read_snapshot_tensors(ckpt)
    # s1 carries the trainer's numerics stamp (a bf16 CPU trainer: the server's mode) and must load
    write_full_snapshot(_perturb(base, 1), ckpt, root / "s1", numerics=NumericsMode.build(True, "bfloat16").to_dict())
    server = Server(ckpt, root, state, tmp / "server.log")
    server.start()
    yield server, ckpt, root, full
    server.stop()


def _dir_of(identity: str, ckpt: str, root: Path, full: Path) -> Path:
    """The full weights ``identity`` names: decoded under ``full``, a full snapshot under ``root``, or the initial
    ``--model`` checkpoint (whatever state the tests before left the server in)."""
    return next((d for d in (full / identity, root / identity) if d.exists()), Path(ckpt))


def _expected(root: Path, full: Path, identity: str, previous_full: Path) -> Path:
    """The full snapshot a delta decodes to (computed independently of the server)."""
    out = full / identity
    if not out.exists():
        apply_incremental_snapshot(previous_full, root / identity, out)
    return out


def _check_serving(server: Server, snapshot: Path, identity: str) -> None:
    toks, lps, served_by = server.logprobs()
    assert served_by == identity
    assert torch.equal(trainer_logprobs(str(snapshot), [PROMPT + toks], [len(PROMPT)], dtype="bfloat16")[0], lps)


def test_full_then_incremental_swaps_keep_zero_kld(env):
    server, ckpt, root, full = env
    assert server.get(HL + "/status").json()["replicas"][0]["current_snapshot_identity"] == "initial"
    before = server.logprobs()
    r = server.signal("s1")
    assert r.status_code == 200, r.text
    assert r.json()["readiness"] == "ready" and r.json()["kind"] == "full"
    _check_serving(server, root / "s1", "s1")
    assert not torch.equal(server.logprobs()[1], before[1])
    prev = root / "s1"
    for i in (2, 3):
        write_incremental_snapshot(prev, _perturb(read_snapshot_tensors(prev), i), root / f"s{i}")
        r = server.signal(f"s{i}", previous=f"s{i - 1}")
        assert r.status_code == 200, r.text
        prev = _expected(root, full, f"s{i}", prev)
        _check_serving(server, prev, f"s{i}")
    st = server.get(HL + "/status").json()["replicas"][0]
    rows = server.get(HL + "/ledger").json()["rows"]
    assert st == {
        "replica": f"{socket.gethostname()}:{server.base.rsplit(':', 1)[1]}",
        "current_snapshot_identity": "s3",
        "weights_digest": rows[-1]["weights_digest"],
        "ready_since": rows[-1]["timestamps"]["ready"],
        "readiness": True,
        "loading_state": {"stage": "idle", "target_snapshot_identity": None},
        "last_error": None,
        "lora_adapters": {},
    }
    assert {r["replica"] for r in rows} == {st["replica"]}
    assert [(r["identity"], r["kind"], r["readiness"]) for r in rows] == [
        ("s1", "full", "ready"),
        ("s2", "incremental", "ready"),
        ("s3", "incremental", "ready"),
    ]
    assert {"signaled", "verified", "paused", "loaded", "ready"} <= rows[-1]["timestamps"].keys()


def _bad_snapshots(root: Path, full: Path, current: str, ckpt: str) -> dict:
    """name -> (signal kwargs, expected status): each must be refused."""
    cur = _dir_of(current, ckpt, root, full)

    def ckpt_of(_):  # a real checkpoint outside the snapshot root (the --model directory)
        return ckpt

    cur_t = read_snapshot_tensors(cur)
    cases = {}

    def full_snap(name, tensors):
        write_full_snapshot(tensors, cur, root / name)

    t = dict(cur_t)
    t.pop(sorted(t)[0])
    full_snap("bad-missing", t)
    cases["missing tensor"] = ({"identity": "bad-missing"}, 422)
    full_snap("bad-extra", {**cur_t, "model.layers.0.extra.weight": torch.zeros(2, dtype=torch.bfloat16)})
    cases["extra tensor"] = ({"identity": "bad-extra"}, 422)
    name = "model.layers.0.mlp.up_proj.weight"
    full_snap("bad-dtype", {**cur_t, name: cur_t[name].float()})
    cases["dtype change"] = ({"identity": "bad-dtype"}, 422)
    full_snap("bad-shape", {**cur_t, name: cur_t[name][:-1].contiguous()})
    cases["shape change"] = ({"identity": "bad-shape"}, 422)
    full_snap("bad-trunc", cur_t)
    shard = root / "bad-trunc" / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    cases["truncated shard"] = ({"identity": "bad-trunc"}, 422)
    write_incremental_snapshot(cur, _perturb(cur_t, 50), root / "bad-flip")
    shard = root / "bad-flip" / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0x5A
    shard.write_bytes(bytes(data))
    cases["flipped byte"] = ({"identity": "bad-flip", "previous": current}, 422)
    other = _perturb(cur_t, 51)  # a delta made against another base, claiming the served one
    write_full_snapshot(other, cur, root / "bad-otherbase-src")
    write_incremental_snapshot(root / "bad-otherbase-src", _perturb(other, 52), root / "bad-wrongbase")
    cases["wrong base"] = ({"identity": "bad-wrongbase", "previous": current}, 422)
    write_incremental_snapshot(cur, _perturb(cur_t, 53), root / "bad-order")
    cases["out-of-order chain"] = ({"identity": "bad-order", "previous": "s1"}, 409)
    cases["replay"] = ({"identity": "s2", "previous": "s1"}, 409)
    cases["identity with /"] = ({"identity": "a/b"}, 400)
    cases["identity with .."] = ({"identity": ".."}, 400)
    cases["unknown snapshot"] = ({"identity": "nope"}, 404)
    # issue 21 rows 3, 6-9: non-finite weights, corrupt bytes of a full snapshot, a tensor in two shards, files that
    # are not regular files inside the root (symlinks out, a FIFO), a full snapshot without checksums
    nan = dict(cur_t)
    nan[name] = nan[name].clone()
    nan[name].view(-1)[7] = float("nan")
    full_snap("bad-nan", nan)
    cases["non-finite weights"] = ({"identity": "bad-nan"}, 422)
    full_snap("bad-bits", cur_t)
    shard = root / "bad-bits" / "model.safetensors"
    data = bytearray(shard.read_bytes())
    for i in range(64):  # 64 bytes in the data region flipped by one bit: still finite bf16 mostly, wrong bits
        data[-4000 - 2 * i] ^= 0x01
    shard.write_bytes(bytes(data))
    cases["flipped bytes in a full snapshot"] = ({"identity": "bad-bits"}, 422)
    full_snap("bad-dup", cur_t)
    save_file({name: nan[name]}, str(root / "bad-dup" / "model-extra.safetensors"))
    cases["tensor in two shards"] = ({"identity": "bad-dup"}, 422)
    full_snap("bad-link", cur_t)
    (root / "bad-link" / "model.safetensors").unlink()
    (root / "bad-link" / "model.safetensors").symlink_to(Path(ckpt_of(cur)) / "model.safetensors")
    cases["symlinked weights file"] = ({"identity": "bad-link"}, 422)
    (root / "bad-linkdir").symlink_to(Path(ckpt_of(cur)), target_is_directory=True)
    cases["symlinked snapshot dir"] = ({"identity": "bad-linkdir"}, 422)
    full_snap("bad-fifo", cur_t)
    (root / "bad-fifo" / "model.safetensors").unlink()
    os.mkfifo(root / "bad-fifo" / "model.safetensors")
    cases["FIFO as weights file"] = ({"identity": "bad-fifo"}, 422)
    shutil.copytree(cur, root / "bad-nochecksums")
    (root / "bad-nochecksums" / "model.weight.spec.json").unlink(missing_ok=True)
    cases["full snapshot without checksums"] = ({"identity": "bad-nochecksums"}, 422)
    # row 4: a delta whose payload for one tensor is a ~130 KB zstd frame declaring (and holding) 4 GiB of zeros
    write_incremental_snapshot(cur, _perturb(cur_t, 55), root / "bad-bomb")
    shard = root / "bad-bomb" / "model.safetensors"
    with safe_open(str(shard), framework="pt") as fh:
        payloads, meta = {k: fh.get_tensor(k) for k in fh.keys()}, fh.metadata()
    co = zstandard.ZstdCompressor(level=1).compressobj(size=4 << 30)
    zeros = bytes(64 << 20)
    bomb = b"".join([co.compress(zeros) for _ in range(64)] + [co.flush()])
    payloads[name] = torch.frombuffer(bytearray(bomb), dtype=torch.uint8)
    save_file(payloads, str(shard), metadata=meta)
    cases["zstd bomb (4 GiB declared)"] = ({"identity": "bad-bomb", "previous": current}, 422)
    # weights a trainer produced under other numerics (FP8 QAT) than the server's (bf16): refused, naming both
    write_full_snapshot(
        _perturb(cur_t, 54),
        cur,
        root / "bad-numerics",
        numerics=NumericsMode.build(True, "bfloat16", "per_channel").to_dict(),
    )
    cases["other numerics mode"] = ({"identity": "bad-numerics"}, 422)
    return cases


def _peak_rss_mib(pid: int) -> int:
    """The process's peak resident set (``VmHWM``), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) // 1024
    raise AssertionError("no VmHWM")


def test_faults_are_refused_and_serving_is_unchanged(env):
    server, ckpt, root, full = env
    current = server.get(HL + "/status").json()["replicas"][0]["current_snapshot_identity"]
    reference = server.logprobs()
    peak_before = _peak_rss_mib(server.proc.pid)  # the API server: where the replica decodes deltas
    r = requests.post(server.base + HL, json={"identity": "s9"}, timeout=30)
    assert r.status_code == 401  # no API key
    assert requests.get(server.base + HL + "/ledger", timeout=30).status_code == 401
    for case, (kw, status) in _bad_snapshots(root, full, current, ckpt).items():
        led = server.get(HL + "/ledger").json()
        n_rows, n_refused = len(led["rows"]), len(led["refusals"])
        r = server.signal(**kw)
        assert r.status_code == status, f"{case}: {r.status_code} {r.text}"
        assert r.json()["error"], case
        if case == "other numerics mode":
            assert "fp8=per_channel" in r.json()["error"] and "fp8=off" in r.json()["error"], r.json()["error"]
        now = server.logprobs()
        assert now[0] == reference[0] and torch.equal(now[1], reference[1]) and now[2] == current, case
        # every refusal is recorded with its error: a load that began as a failed row, a signal refused before
        # loading (400, 404, 409) in the bounded refusals ring
        led = server.get(HL + "/ledger").json()
        before_loading = status in (400, 404, 409)
        rows = led["refusals"] if before_loading else led["rows"]
        assert len(rows) == (min(n_refused + 1, 64) if before_loading else n_rows + 1), case
        assert rows[-1]["readiness"] == "failed" and rows[-1]["error"], case
        assert rows[-1]["identity"] == kw["identity"], case
    assert server.get(HL + "/status").json()["replicas"][0]["current_snapshot_identity"] == current
    assert _peak_rss_mib(server.proc.pid) - peak_before < 1024  # the 4 GiB bomb never materialized


def test_malformed_signals_are_refused_and_recorded_bounded(env):
    """Signals that must never load (issue 21 rows 2, 5, 11, 13, 14, 16): each refused with its status, serving
    unchanged, a bounded ledger row that keeps the claimed previous identity; vLLM's auth rules (scheme in any case)."""
    server, ckpt, root, full = env
    current = server.get(HL + "/status").json()["replicas"][0]["current_snapshot_identity"]
    reference = server.logprobs()
    huge = "a" * 5_000_000
    cases = {
        "trailing newline": (("nl\n",), {}, {}, 400),
        "5 MB identity": ((huge,), {}, {}, 400),
        "staging suffix": (("col.tmp",), {}, {}, 400),
        "reserved initial": (("initial",), {}, {}, 409),
        "reset ''": (("r-empty",), {"reset_prompt_cache": ""}, {}, 400),
        "reset null": (("r-null",), {"reset_prompt_cache": None}, {}, 400),
        "reset false": (("r-false",), {"reset_prompt_cache": False}, {}, 400),
        "reset ' all'": (("r-space",), {"reset_prompt_cache": " all"}, {}, 400),
        "drain nan": (
            ("d-nan",),
            {},
            {"x-zerokld-hot-load-transition": "sync", "x-zerokld-hot-load-drain-timeout": "nan"},
            422,
        ),
        "drain -1": (
            ("d-neg",),
            {},
            {"x-zerokld-hot-load-transition": "sync", "x-zerokld-hot-load-drain-timeout": "-1"},
            422,
        ),
        "drain text": (
            ("d-text",),
            {},
            {"x-zerokld-hot-load-transition": "sync", "x-zerokld-hot-load-drain-timeout": "soon"},
            422,
        ),
        "previous recorded": (("no-such", "claimed-prev"), {}, {}, 404),
    }
    for case, (args, body, headers, status) in cases.items():
        r = server.signal(*args, headers=headers, **body)
        assert r.status_code == status, f"{case}: {r.status_code} {r.text[:300]}"
        assert len(r.text) < 2000, case  # the identity is never echoed whole
        row = server.get(HL + "/ledger").json()["refusals"][-1]  # refused before loading: the bounded ring
        assert row["readiness"] == "failed" and len(row["identity"]) < 300, case
        if len(args) > 1:
            assert row["previous_identity"] == args[1], case
    now = server.logprobs()
    assert now[0] == reference[0] and torch.equal(now[1], reference[1]) and now[2] == current
    assert len(json.dumps(server.get(HL + "/ledger").json())) < 100_000
    for scheme in ("bearer", "BEARER"):  # vLLM: the scheme is case-insensitive, the token is not
        assert (
            requests.get(
                server.base + HL + "/status", headers={"Authorization": f"{scheme} {API_KEY}"}, timeout=30
            ).status_code
            == 200
        )
    assert (
        requests.get(
            server.base + HL + "/status", headers={"Authorization": f"Bearer {API_KEY.upper()}"}, timeout=30
        ).status_code
        == 401
    )


def test_ledger_reset_requires_full(env):
    server, ckpt, root, full = env
    current = server.get(HL + "/status").json()["replicas"][0]["current_snapshot_identity"]
    cur = _dir_of(current, ckpt, root, full)
    assert requests.delete(server.base + HL + "/ledger", headers=AUTH, timeout=30).json()["full_required"] is True
    write_incremental_snapshot(cur, _perturb(read_snapshot_tensors(cur), 60), root / "r1-delta")
    r = server.signal("r1-delta", previous=current)
    assert r.status_code == 409 and "must be full" in r.json()["error"]
    write_full_snapshot(_perturb(read_snapshot_tensors(cur), 61), cur, root / "r1")
    assert server.signal("r1").status_code == 200
    _check_serving(server, root / "r1", "r1")


def _stream(
    server: Server,
    prompt: list[int],
    max_tokens: int,
    started: threading.Event | None = None,
    stop: threading.Event | None = None,
) -> tuple[int, str | None]:
    """A streamed completion: ``(chunks with text, finish reason)``; ``started`` is set at the first chunk (the
    request is in flight on the engine); once ``stop`` is set the client disconnects at the next chunk (vLLM aborts
    the request; the finish reason stays ``None``)."""
    r = requests.post(
        server.base + "/v1/completions",
        headers=AUTH,
        stream=True,
        timeout=600,
        json={
            "model": server.ckpt,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 1.0,
            "ignore_eos": True,
            "stream": True,
        },
    )
    assert r.status_code == 200, r.text
    n, finish = 0, None
    for line in r.iter_lines():
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            choice = json.loads(line[6:])["choices"][0]
            n += 1 if choice.get("text") is not None else 0
            finish = choice.get("finish_reason") or finish
            if started is not None:
                started.set()
            if stop is not None and stop.is_set():
                r.close()
                break
    return n, finish


def _timed_completion(
    server: Server, prompt: list[int], max_tokens: int, n: int = 1
) -> tuple[requests.Response, float]:
    """A non-streamed completion (``n`` samples) and the wall-clock time its answer arrived."""
    r = requests.post(
        server.base + "/v1/completions",
        headers=AUTH,
        timeout=600,
        json={
            "model": server.ckpt,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 1.0,
            "ignore_eos": True,
            "n": n,
        },
    )
    assert r.status_code == 200, r.text
    return r, time.time()


def _metric(server: Server, name: str) -> float:
    """The sum of vLLM's metric ``name`` over its label sets (``/metrics``: behind the key with hot-load on)."""
    text = requests.get(server.base + "/metrics", headers=AUTH, timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def _generated(server: Server) -> float:
    """Tokens the engine has generated so far (vLLM's ``vllm:generation_tokens`` counter), once it runs nothing: the
    baseline of :func:`_wait_running`. Fails if the engine does not go idle within 120 s."""
    deadline = time.monotonic() + 120
    while _metric(server, "vllm:num_requests_running") > 0:
        assert time.monotonic() < deadline, "the engine still runs other requests"
        time.sleep(0.02)
    return _metric(server, "vllm:generation_tokens_total")


def _wait_running(server: Server, request, before: float) -> None:
    """Return once the engine has generated a token of ``request`` (a future sent after ``before = _generated(server)``
    was read on an idle engine): the generation counter moved past ``before``. Fail if ``request`` ends first. (The
    running-requests gauge alone says only that some request runs: a fresh-clone suite's sync swap then found nothing
    to drain — the cause was not established; the gauge does return to 0 after a finished request.)"""
    deadline = time.monotonic() + 120
    while _metric(server, "vllm:generation_tokens_total") <= before:
        assert time.monotonic() < deadline and not request.done(), "the long request never ran"
        time.sleep(0.02)


def test_async_swaps_under_concurrent_streams_lose_no_request(env):
    server, ckpt, root, full = env
    current = server.get(HL + "/status").json()["replicas"][0]["current_snapshot_identity"]
    prev = _dir_of(current, ckpt, root, full)
    names = []
    for i in range(20):  # a chain of 20 deltas
        name = f"a{i:02d}"
        write_incremental_snapshot(prev, _perturb(read_snapshot_tensors(prev), 100 + i), root / name)
        prev = _expected(root, full, name, prev)
        names.append(name)
    with ThreadPoolExecutor(16) as pool:
        streams = [pool.submit(_stream, server, [1] + list(range(5, 5 + 10 + i)), 120) for i in range(16)]
        time.sleep(1.0)
        last = current
        for name in names:
            r = server.signal(name, previous=last)
            assert r.status_code == 200, r.text
            last = name
        results = [f.result() for f in streams]
    assert all(finish == "length" and n >= 100 for n, finish in results), results
    _check_serving(server, prev, names[-1])


def _complete(server: Server, prompt: list[int], max_tokens: int) -> tuple[list[int], torch.Tensor, list, str]:
    """A greedy non-streaming completion: tokens, logprobs, the choice's ``weight_versions``, the identity header."""
    r = requests.post(
        server.base + "/v1/completions",
        headers=AUTH,
        timeout=300,
        json={
            "model": server.ckpt,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "logprobs": 0,
            "ignore_eos": True,
            "return_tokens_as_token_ids": True,
        },
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    toks = [int(t.split(":")[1]) for t in choice["logprobs"]["tokens"]]
    return (
        toks,
        torch.tensor(choice["logprobs"]["token_logprobs"], dtype=torch.float32),
        choice["weight_versions"],
        r.headers["x-zerokld-snapshot-identity"],
    )


def _stream_spans(
    server: Server, prompt: list[int], max_tokens: int, started: threading.Event | None = None
) -> tuple[list[list], str, list[int], torch.Tensor]:
    """A streamed completion: every chunk's ``weight_versions`` (in order), the identity header, the tokens and their
    log-probs; ``started`` is set when the first chunk with a choice arrives."""
    r = requests.post(
        server.base + "/v1/completions",
        headers=AUTH,
        stream=True,
        timeout=600,
        json={
            "model": server.ckpt,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 1.0,
            "ignore_eos": True,
            "stream": True,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
        },
    )
    assert r.status_code == 200, r.text
    spans, tokens, lps = [], [], []
    for line in r.iter_lines():
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            choices = json.loads(line[6:])["choices"]
            if choices:
                spans.append(choices[0].get("weight_versions"))
                lp = choices[0].get("logprobs") or {}
                tokens += [int(t.split(":")[1]) for t in lp.get("tokens", [])]
                lps += lp.get("token_logprobs", [])
                if started is not None:
                    started.set()
    return spans, r.headers["x-zerokld-snapshot-identity"], tokens, torch.tensor(lps, dtype=torch.float32)


def test_async_swaps_attribute_every_token_to_its_snapshot(env):
    """Issue 21 row 10: under concurrent load through 6 async swaps, every response names the snapshot(s) that
    sampled its tokens. Non-streaming: the header and the choice's ``weight_versions`` agree, and the tokens of
    every span have exactly that span's snapshot's trainer logprobs (the whole response when it spans no swap; the
    old-weights prefix and, the paused request's KV recomputed under the new weights, each later span when it
    does: what async RL needs to score a response that spans a swap); negative control: the snapshot the client saw
    serving when it sent the request (the old header's label) gives other logprobs wherever it differs. Streaming: every
    chunk carries contiguous spans over the tokens so far, in swap order, and a stream across the swaps says where it
    switched."""
    server, ckpt, root, full = env
    current = server.get(HL + "/status").json()["replicas"][0]["current_snapshot_identity"]
    snapshots = {current: _dir_of(current, ckpt, root, full)}
    order, prev = [current], snapshots[current]
    for i in range(6):
        name = f"t{i}"
        write_full_snapshot(_perturb(read_snapshot_tensors(prev), 700 + i, scale=0.2), prev, root / name)
        snapshots[name] = prev = root / name
        order.append(name)
    serving = [current]  # what the client knows is serving when it sends (the admission-time label)
    done = threading.Event()
    results: list[tuple] = []

    def load(seed: int):
        i = seed
        while not done.is_set():
            sent_under, prompt = serving[0], [1] + list(range(20, 28 + i % 7))
            results.append((sent_under, prompt, *_complete(server, prompt, 6 + i % 11)))
            i += 1

    with ThreadPoolExecutor(12) as pool:
        loaders = [pool.submit(load, k) for k in range(4)]
        streams = []
        for i, name in enumerate(order[1:]):
            # a 400-token stream in flight at every swap: started under the serving snapshot, the swap signalled once
            # its first token is out (not after fixed sleeps: with faster decode streams finished before the swaps)
            started = threading.Event()
            streams.append(pool.submit(_stream_spans, server, [1] + list(range(5, 15 + i % 3)), 400, started))
            assert started.wait(120)
            r = server.signal(name)
            assert r.status_code == 200, r.text
            serving[0] = name
            time.sleep(0.3)
        done.set()
        for f in loaders:
            f.result()
        stream_results = [f.result() for f in streams]

    groups: dict[str, list] = {}
    for row in results:
        sent_under, prompt, toks, lps, spans, header = row
        versions = [sp["version"] for sp in spans]
        assert header == ",".join(versions)
        assert spans[0]["start"] == 0 and spans[-1]["end"] == len(toks)
        assert all(a["end"] == b["start"] for a, b in pairwise(spans))
        assert [order.index(v) for v in versions] == sorted(order.index(v) for v in versions)
        groups.setdefault(versions[0], []).append(row)
    relabeled, later = 0, {}
    for row in results:  # tokens after a swap: the paused request's KV is recomputed under the new snapshot
        for sp in row[4][1:]:
            later.setdefault(sp["version"], []).append((row, sp))
    for version, spans_of in later.items():
        refs = trainer_logprobs(
            str(snapshots[version]),
            [r[1] + r[2] for r, _ in spans_of],
            [len(r[1]) for r, _ in spans_of],
            dtype="bfloat16",
        )
        for ((_, _, _, lps, _, header), sp), ref in zip(spans_of, refs, strict=True):
            assert torch.equal(ref[sp["start"] : sp["end"]], lps[sp["start"] : sp["end"]]), (version, header, sp)
    for version, rows in groups.items():  # one trainer load per snapshot
        refs = trainer_logprobs(
            str(snapshots[version]), [r[1] + r[2] for r in rows], [len(r[1]) for r in rows], dtype="bfloat16"
        )
        for (sent_under, prompt, toks, lps, spans, header), ref in zip(rows, refs, strict=True):
            k = spans[0]["end"]
            assert torch.equal(ref[:k], lps[:k]), (version, header)
            if sent_under != version and len(spans) == 1:
                relabeled += 1
                wrong = trainer_logprobs(str(snapshots[sent_under]), [prompt + toks], [len(prompt)], dtype="bfloat16")[
                    0
                ]
                assert not torch.equal(wrong, lps)  # the admission-time label would have been a lie
    assert later  # some responses spanned a swap, and their later spans were checked
    print(
        f"{len(results)} responses, {sum(len(r[4]) > 1 for r in results)} spanning a swap, "
        f"{relabeled} sent under one snapshot and sampled wholly by the next"
    )
    for chunks, header, _, _ in stream_results:
        assert chunks and all(chunks) and header == chunks[0][0]["version"]
        for a, b in pairwise(chunks):
            assert b[-1]["end"] >= a[-1]["end"] and [sp["version"] for sp in b[: len(a)]] == [sp["version"] for sp in a]
        final = chunks[-1]
        assert final[0]["start"] == 0 and final[-1]["end"] == 400
        assert all(a["end"] == b["start"] for a, b in pairwise(final))
    print(f"{sum(len(r[0][-1]) > 1 for r in stream_results)} of {len(stream_results)} streams spanning a swap")
    assert any(len(r[0][-1]) > 1 for r in stream_results)  # a stream switched mid-way, and says where
    # chat completions carry the same attribution
    r = requests.post(
        server.base + "/v1/chat/completions",
        headers=AUTH,
        timeout=120,
        json={
            "model": server.ckpt,
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 4,
            "temperature": 0.0,
            "ignore_eos": True,
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["weight_versions"] == [{"version": order[-1], "start": 0, "end": 4}]
    assert r.headers["x-zerokld-snapshot-identity"] == order[-1]


def test_sync_transition_425_exactly_while_swapping(env):
    server, ckpt, root, full = env
    current = server.get(HL + "/status").json()["replicas"][0]["current_snapshot_identity"]
    cur = _dir_of(current, ckpt, root, full)
    write_full_snapshot(_perturb(read_snapshot_tensors(cur), 200), cur, root / "y1")
    write_full_snapshot(_perturb(read_snapshot_tensors(cur), 201), cur, root / "y2")
    # drain timeout exceeded by a long in-flight request: 425, nothing changes, ledger records it. In flight = the
    # engine runs it (_wait_running), its steps slowed until the 425 has come (HotLoadServer.slowed_steps): unslowed,
    # requests of 990 and of 4,060 tokens each ended in CI before the signal was verified (the second was first seen
    # running 11.5 s after it was sent, 0.05 s before it ended). Not streamed: on 2 cores a stream's per-token SSE
    # work starved the API server until the engine had finished
    with ThreadPoolExecutor(1) as pool:
        with server.slowed_steps(STEP_DELAY_S):
            before = _generated(server)
            long = pool.submit(_timed_completion, server, PROMPT, LONG, 1)
            _wait_running(server, long, before)
            r = server.signal(
                "y1", headers={"x-zerokld-hot-load-transition": "sync", "x-zerokld-hot-load-drain-timeout": "0.2"}
            )
        assert r.status_code == 425, r.text
        assert long.result()[0].json()["choices"][0]["finish_reason"] == "length"
    row = server.get(HL + "/ledger").json()["rows"][-1]  # the 425 is recorded, with its reason
    assert row["identity"] == "y1" and row["readiness"] == "failed" and "drain timeout" in row["error"]
    assert server.get(HL + "/status").json()["replicas"][0]["current_snapshot_identity"] == current
    assert server.logprobs()[2] == current
    # a sync swap that drains: new requests during it get 425; before and after, 200
    statuses: list[int] = []
    stop = threading.Event()

    invocations: list[int] = []
    polling = threading.Event()

    def poll():
        while not stop.is_set():
            r = requests.post(
                server.base + "/v1/completions",
                headers=AUTH,
                timeout=120,
                json={"model": server.ckpt, "prompt": PROMPT, "max_tokens": 1},
            )
            statuses.append(r.status_code)
            if r.status_code == 425:  # the drain window seen: the in-flight request may now finish at full speed
                server.release_steps()
            r = requests.post(
                server.base + "/invocations",
                headers=AUTH,
                timeout=120,
                json={  # row 15
                    "model": server.ckpt,
                    "prompt": PROMPT,
                    "max_tokens": 1,
                },
            )
            invocations.append(r.status_code)
            polling.set()

    with ThreadPoolExecutor(3) as pool:
        # the drain window lasts as long as the in-flight request, whose steps are slowed until the poller has seen a
        # 425 (at most LONG * STEP_DELAY_S, ~50 s, if no 425 ever came); the signal goes out once the engine has
        # generated a token of it (_wait_running)
        with server.slowed_steps(STEP_DELAY_S):
            before = _generated(server)
            t_sent = time.monotonic()
            long = pool.submit(_timed_completion, server, PROMPT, LONG, 1)
            _wait_running(server, long, before)
            t_running = time.monotonic() - t_sent
            poller = pool.submit(poll)
            t_signal = time.monotonic()
            r = server.signal(
                "y2", headers={"x-zerokld-hot-load-transition": "sync", "x-zerokld-hot-load-drain-timeout": "120"}
            )
        t_swapped = time.monotonic()
        assert polling.wait(60), "the poller got no response"
        time.sleep(0.5)
        stop.set()
        poller.result()
        assert r.status_code == 200, r.text
        done, ended = long.result()
        assert done.json()["choices"][0]["finish_reason"] == "length"  # it finished, on the old weights
        assert done.headers["x-zerokld-snapshot-identity"] == current
    row = server.get(HL + "/ledger").json()["rows"][-1]
    assert ended >= row["timestamps"]["verified"], (  # the precondition of what follows: there was a drain window
        f"the in-flight request ended {row['timestamps']['verified'] - ended:.2f} s before the signal was verified "
        f"(the signal took {t_swapped - t_signal:.2f} s; the engine was seen running it {t_running:.2f} s after it "
        "was sent)"
    )
    assert 425 in statuses and set(statuses) <= {200, 425}, (
        f"statuses {statuses}; the sync signal took {t_swapped - t_signal:.2f} s; ledger: "
        f"{server.get(HL + '/ledger').json()['rows'][-1]}"
    )
    assert 425 in invocations and set(invocations) <= {200, 425} and invocations[-1] == 200
    assert statuses[-1] == 200
    first_425 = statuses.index(425)
    assert all(s == 425 for s in statuses[first_425 : len(statuses) - statuses[::-1].index(425)])  # one 425 window
    _check_serving(server, root / "y2", "y2")


def test_trainer_client_cadence_and_fallback_to_full(env, tmp_path):
    """SnapshotWriter + HotLoadClient: full first, incremental against the last loaded identity, full every 3; a
    ledger reset on the replica makes the next incremental refused (409) and the client falls back to full."""
    from deltasync import HotLoadClient, SnapshotWriter

    server, ckpt, root, full = env
    writer = SnapshotWriter(root, ckpt, full_every=3, cache_dir=tmp_path / "cache")
    client = HotLoadClient(server.base, api_key=API_KEY)
    weights = read_snapshot_tensors(ckpt)
    kinds = []
    for step in range(5):
        weights = _perturb(weights, 300 + step)
        res = client.push(writer, f"w{step}", weights)
        kinds.append(res.snapshot.kind)
        assert res.refused == [] and res.swap_seconds > 0
        if res.snapshot.kind == "incremental":
            assert res.snapshot.bytes < 0.5 * res.snapshot.full_bytes and 0 < res.snapshot.density < 0.2
        _check_serving(server, writer.cache / res.snapshot.identity, res.snapshot.identity)
    assert kinds == ["full", "incremental", "incremental", "full", "incremental"]
    assert requests.delete(server.base + HL + "/ledger", headers=AUTH, timeout=30).status_code == 200
    weights = _perturb(weights, 400)
    res = client.push(writer, "w5", weights)
    assert res.snapshot.kind == "full" and res.snapshot.identity == "w5-full" and "must be full" in res.refused[0]
    _check_serving(server, writer.cache / "w5-full", "w5-full")


def test_killed_during_the_weight_copy_restarts_into_a_consistent_state(env):
    """SIGKILL inside the in-place weight copy itself: the armed fault hook (:mod:`vllm_plugin.faults`) pauses the
    model's ``load_weights`` after its third tensor, the live parameters mixing two snapshots, and says so in a marker
    file; the kill lands there. The restarted server serves the previous snapshot, bit for bit, and the ledger says
    the interrupted load failed. Then the same snapshot loads fine."""
    server, ckpt, root, full = env
    current = server.get(HL + "/status").json()["replicas"][0]["current_snapshot_identity"]
    expected = _dir_of(current, ckpt, root, full)
    write_incremental_snapshot(expected, _perturb(read_snapshot_tensors(expected), 500), root / "k1")
    reference = server.logprobs()
    arm, marker = server.copy_fault_arm, Path(str(server.copy_fault_arm) + ".copying")
    arm.write_text("")
    try:
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(
                lambda: requests.post(
                    server.base + HL,
                    headers=AUTH,
                    timeout=300,
                    json={"identity": "k1", "incremental_snapshot_metadata": {"previous_snapshot_identity": current}},
                )
            )
            deadline = time.time() + 120
            while not marker.exists():
                assert time.time() < deadline and not pending.done(), "the swap never reached the weight copy: " + (
                    pending.result().text if pending.done() else ""
                )
                time.sleep(0.05)
            assert server.get(HL + "/status").json()["replicas"][0]["loading_state"]["stage"] == "loading"
            server.stop(kill=True)
            with pytest.raises(requests.RequestException):
                pending.result()
    finally:
        arm.unlink(missing_ok=True)
        marker.unlink(missing_ok=True)
    server.start()
    rows = server.get(HL + "/ledger").json()["rows"]
    assert rows[-1]["identity"] == "k1" and rows[-1]["readiness"] == "failed" and "interrupted" in rows[-1]["error"]
    assert server.get(HL + "/status").json()["replicas"][0]["current_snapshot_identity"] == current
    again = server.logprobs()
    assert again[0] == reference[0] and torch.equal(again[1], reference[1]) and again[2] == current
    _check_serving(server, expected, current)
    assert server.signal("k1", previous=current).status_code == 200  # not a replay: it never became ready
    _check_serving(server, _expected(root, full, "k1", expected), "k1")


def test_deltas_apply_in_place_on_the_workers_and_replay_after_restart(env):
    """Issue 17 point 1: an incremental snapshot is decoded by the engine's worker against its own parameters and
    written into them (the ledger says ``applied: in_place``; no full snapshot is written anywhere; the weights
    digest, computed from the delta's checksums, is the digest of the full snapshot the trainer would have
    written); two deltas in a row (zkd_sparse_v2, then arc_v2) serve bitwise the trainer's logprobs. The replica
    keeps its own copy of each delta, so after the trainer deleted them a restart rebuilds the weights from the
    chain's full snapshot plus the deltas, bit for bit. Negative control: without the replica's copy of the first
    delta the chain cannot be replayed — the restart falls back and the ledger says what was lost."""
    from deltasync import weights_digest

    server, ckpt, root, full = env
    current = server.get(HL + "/status").json()["replicas"][0]["current_snapshot_identity"]
    head = _dir_of(current, ckpt, root, full)
    write_incremental_snapshot(
        head, _perturb(read_snapshot_tensors(head), 900), root / "ip1", compression_format="zkd_sparse_v2"
    )
    r = server.signal("ip1", previous=current, compression_format="zkd_sparse_v2")
    assert r.status_code == 200, r.text
    ip1 = _expected(root, full, "ip1", head)
    assert r.json()["applied"] == "in_place" and r.json()["weights_digest"] == weights_digest(ip1)
    write_incremental_snapshot(ip1, _perturb(read_snapshot_tensors(ip1), 901), root / "ip2")
    r = server.signal("ip2", previous="ip1")
    assert r.status_code == 200 and r.json()["applied"] == "in_place", r.text
    ip2 = _expected(root, full, "ip2", ip1)
    assert r.json()["weights_digest"] == weights_digest(ip2)
    assert not (server.state / "materialized" / "ip1").exists() and not (server.state / "materialized" / "ip2").exists()
    _check_serving(server, ip2, "ip2")
    server.stop()
    shutil.rmtree(root / "ip1")
    shutil.rmtree(root / "ip2")  # the trainer's retention removed the published deltas
    server.start()
    assert server.get(HL + "/status").json()["replicas"][0]["current_snapshot_identity"] == "ip2"
    _check_serving(server, ip2, "ip2")
    server.stop()
    shutil.rmtree(server.state / "fetched" / "ip1")
    server.start()
    now = server.get(HL + "/status").json()["replicas"][0]["current_snapshot_identity"]
    assert now not in ("ip1", "ip2")
    rows = server.get(HL + "/ledger").json()["rows"]
    assert rows[-1]["kind"] == "restore" and "ip1" in rows[-1]["error"] and "gone" in rows[-1]["error"]
    _check_serving(server, _dir_of(now, ckpt, root, full), now)


LONG_PROMPT = [1] + list(range(3, 100)) * 2  # 195 tokens: whole KV blocks for the prefix cache to keep


def _cached_tokens(server: Server, prompt: list[int], session: str | None = None) -> int:
    """Prompt tokens vLLM served from its prefix cache (``usage.prompt_tokens_details.cached_tokens``) for a request
    of ``session`` (the OpenAI ``user`` field; ``None``: no session)."""
    r = requests.post(
        server.base + "/v1/completions",
        headers=AUTH,
        timeout=120,
        json={
            "model": server.ckpt,
            "prompt": prompt,
            "max_tokens": 1,
            "temperature": 0.0,
            **({"user": session} if session else {}),
        },
    )
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] or 0


def test_reset_prompt_cache_modes_observed_on_the_prefix_cache(env):
    """Each ``reset_prompt_cache`` mode, seen in vLLM's prefix cache and in the log-probs of a stream running across
    the swap. Idle: after ``none`` a prompt cached before the swap is still a cache hit (old-weights KV kept, as
    asked; the row says no reset); after ``all`` it is computed afresh; after ``new_session`` it is computed afresh
    for requests without a session and for a new session (``user``), but still a hit for a session seen before the
    swap. Running stream (its ``weight_versions`` span both snapshots): ``all`` preempts it and recomputes its KV with
    the new weights, so every token sampled after the swap has bitwise the trainer's log-prob under the new snapshot;
    ``new_session`` keeps its KV (the tokens after the swap attend to old-weights KV: the trainer's full recompute
    under the new snapshot differs), and the stream runs to its last token either way."""
    server, ckpt, root, full = env
    current = server.get(HL + "/status").json()["replicas"][0]["current_snapshot_identity"]
    base = _dir_of(current, ckpt, root, full)
    weights = read_snapshot_tensors(base)
    for i, mode in enumerate(("none", "new_session", "all")):
        write_full_snapshot(_perturb(weights, 800 + i), base, root / f"pc-{mode}")
    # one prompt per probe (each probe is the first request of its prompt since the swap); all cached before it
    alices, other = [1] + list(range(3, 100, 2)) * 4, [1] + list(range(99, 2, -1)) * 2
    for mode in ("none", "new_session", "all"):
        for prompt, session in ((LONG_PROMPT, None), (alices, "alice"), (other, None)):
            _cached_tokens(server, prompt, session)
            assert _cached_tokens(server, prompt, session) > 0, "not in the prefix cache before the swap"
        r = server.signal(f"pc-{mode}", reset_prompt_cache=mode)
        assert r.status_code == 200, r.text
        assert r.json()["prompt_cache_reset"] is (mode != "none")
        # a hit can only be a prefix cached with the earlier weights
        cached = {
            "no session": _cached_tokens(server, LONG_PROMPT),
            "alice": _cached_tokens(server, alices, "alice"),
            "new session": _cached_tokens(server, other, f"new-after-{mode}"),
        }
        expect = {"no session": mode == "none", "alice": mode != "all", "new session": mode == "none"}
        assert {s: c > 0 for s, c in cached.items()} == expect, (mode, cached)
    for i, mode in enumerate(("new_session", "all")):
        for attempt in range(2):
            # One CI run (2 cores, full suite) once saw a stream whose every token the server attributed to the new
            # snapshot although the client had its first chunk before sending the swap; not reproduced in 3 local
            # runs. The first attempt's diagnostics are reported (a warning in the test summary), then retried once.
            identity = f"pc-run-{mode}-{attempt}"
            write_full_snapshot(_perturb(weights, 810 + 2 * i + attempt), base, root / identity)
            started = threading.Event()
            prompt = [1] + list(range(5, 15))
            with ThreadPoolExecutor(1) as pool:
                pending = pool.submit(_stream_spans, server, prompt, 400, started)
                assert started.wait(120), "the stream produced no token"
                r = server.signal(identity, reset_prompt_cache=mode)
                chunks, first, tokens, lps = pending.result()
            assert r.status_code == 200, r.text
            spans = chunks[-1]

            def seen() -> str:  # evaluated only to report a failure
                return (
                    f"{len(chunks)} chunks, first {chunks[0]}, header {first!r}, last {spans}, row {r.text}, "
                    f"ledger tail {server.get(HL + '/ledger').json()['rows'][-3:]}"
                )

            if len(spans) >= 2 or attempt == 1:
                break
            warnings.warn("reset_prompt_cache stream did not span the swap; retrying once: " + seen(), stacklevel=1)
        assert first != identity, "the first token, streamed before the swap, is attributed to it: " + seen()
        assert len(spans) >= 2 and spans[-1]["version"] == identity and spans[-1]["end"] == 400, seen()
        row = r.json()
        assert row["prompt_cache_reset"] is True and "prompt_cache_reset_error" not in row
        after = slice(spans[-1]["start"], spans[-1]["end"])  # the tokens sampled with the new snapshot
        rescored = trainer_logprobs(str(root / identity), [prompt + tokens], [len(prompt)], dtype="bfloat16")[0]
        assert torch.equal(rescored[after], lps[after]) is (mode == "all"), mode


@pytest.mark.extended  # `make test-extended`: three server starts (~110 s on 2 cores); the replay test restarts too
def test_restart_verifies_the_snapshot_it_restores(env):
    """Issue 21 row 12: a restart serves the ledger's snapshot only if its bits are the ones loaded (checksums and
    the ledger's weights digest). Replaced bits (a valid snapshot, other weights, same identity): the newest earlier
    snapshot that verifies serves instead (v1, not v2), the ledger says so. Every snapshot gone: the ``--model``
    weights serve under the initial identity, the ledger says so. Never a crash. Negative control: the replaced bits
    really are other weights (other trainer logprobs)."""
    server, ckpt, root, full = env
    base = Path(ckpt)
    full.mkdir(exist_ok=True)
    write_full_snapshot(_perturb(read_snapshot_tensors(base), 800), base, root / "v1")
    write_full_snapshot(_perturb(read_snapshot_tensors(base), 801), base, root / "v2")
    assert server.signal("v1").status_code == 200 and server.signal("v2").status_code == 200
    v1, v2 = root / "v1", root / "v2"
    shutil.copytree(v1, full / "v1-kept")
    shutil.copytree(v2, full / "v2-orig")
    server.stop()
    write_full_snapshot(_perturb(read_snapshot_tensors(v2), 802), v2, full / "v2-other")
    kept = server.state / "materialized" / "v2"  # the replica's own verified copy: what a restart restores
    shutil.rmtree(kept)
    shutil.copytree(full / "v2-other", kept)  # same identity, other (self-consistent) weights
    server.start()
    assert server.get(HL + "/status").json()["replicas"][0]["current_snapshot_identity"] == "v1"
    _check_serving(server, full / "v1-kept", "v1")
    toks = server.logprobs()[0]
    seq = [PROMPT + toks]
    assert not torch.equal(
        trainer_logprobs(str(full / "v2-orig"), seq, [len(PROMPT)], dtype="bfloat16")[0],
        trainer_logprobs(str(full / "v2-other"), seq, [len(PROMPT)], dtype="bfloat16")[0],
    )
    rows = server.get(HL + "/ledger").json()["rows"]
    assert rows[-1]["kind"] == "restore" and rows[-1]["identity"] == "v1" and "v2" in rows[-1]["error"]
    assert [r["readiness"] for r in rows if r["identity"] == "v2"][-1] == "failed"
    server.stop()
    for d in [*root.iterdir(), server.state / "materialized", server.state / "fetched"]:  # every snapshot gone
        shutil.rmtree(d) if d.is_dir() and not d.is_symlink() else d.unlink(missing_ok=True)
    server.start()
    assert server.get(HL + "/status").json()["replicas"][0]["current_snapshot_identity"] == "initial"
    _check_serving(server, Path(ckpt), "initial")
    rows = server.get(HL + "/ledger").json()["rows"]
    assert rows[-1]["kind"] == "restore" and rows[-1]["identity"] == "initial" and "gone" in rows[-1]["error"]
    write_full_snapshot(_perturb(read_snapshot_tensors(ckpt), 803), ckpt, root / "v3")
    assert server.signal("v3").status_code == 200  # the replica goes on from there
    _check_serving(server, root / "v3", "v3")


def test_every_serving_route_is_guarded_while_hot_load_is_on(env):
    """Issue 21 row 15: SageMaker's ``/invocations`` (vLLM leaves it open even with ``--api-key``) needs the key
    with hot-load on, and answers with the identity header; probes (``/health``, ``/ping``) stay open. Issue 85
    point 4: ``/metrics`` needs the key too, and its text names the served model, never the ``--model`` path
    (vLLM's labels carried it in every series)."""
    server = env[0]
    current = server.get(HL + "/status").json()["replicas"][0]["current_snapshot_identity"]
    body = {"model": server.ckpt, "prompt": PROMPT, "max_tokens": 2, "temperature": 0.0}
    assert requests.post(server.base + "/invocations", json=body, timeout=60).status_code == 401
    r = requests.post(server.base + "/invocations", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.headers["x-zerokld-snapshot-identity"] == current, r.text
    assert (
        requests.post(server.base + "/tokenize", json={"model": server.ckpt, "prompt": "a"}, timeout=60).status_code
        == 401
    )
    assert requests.get(server.base + "/health", timeout=60).status_code == 200
    assert requests.get(server.base + "/ping", timeout=60).status_code == 200
    assert requests.get(server.base + "/metrics", timeout=60).status_code == 401
    metrics = requests.get(server.base + "/metrics", headers=AUTH, timeout=60)
    assert metrics.status_code == 200 and "vllm:num_requests_running" in metrics.text, metrics.text[:300]
    assert str(server.ckpt) not in metrics.text and str(Path(server.ckpt).resolve()) not in metrics.text
    assert f'model_name="{Path(server.ckpt).name}"' in metrics.text
    wrong = {"Authorization": f"Bearer {API_KEY}x"}  # a wrong key is refused on every guarded route
    for method, path in [
        ("post", "/v1/completions"),
        ("post", "/invocations"),
        ("post", HL),
        ("get", HL + "/status"),
        ("get", HL + "/ledger"),
        ("delete", HL + "/ledger"),
        ("get", "/metrics"),
    ]:
        assert requests.request(method, server.base + path, json=body, headers=wrong, timeout=60).status_code == 401, (
            path
        )


def test_api_key_from_vllm_env_guards_every_hot_load_route(env):
    """Issue 21 row 1: a server keyed only by vLLM's ``VLLM_API_KEY`` (no ``--api-key``) guards the hot-load routes
    exactly as vLLM guards ``/v1``: 401 without the key on signal, status, ledger GET and DELETE; 200 with it."""
    server = env[0]
    before = server.get(HL + "/ledger").json()
    server.stop()
    server.start(extra_env={"VLLM_API_KEY": API_KEY}, api_key_flag=False)
    base = server.base
    assert requests.get(base + "/v1/models", timeout=30).status_code == 401  # vLLM's own guard is on
    assert requests.post(base + HL, json={"identity": "k9"}, timeout=30).status_code == 401
    assert requests.get(base + HL + "/status", timeout=30).status_code == 401
    assert requests.get(base + HL + "/ledger", timeout=30).status_code == 401
    assert requests.delete(base + HL + "/ledger", timeout=30).status_code == 401
    assert server.get(HL + "/status").status_code == 200
    after = server.get(HL + "/ledger").json()  # the refused POST and DELETE changed nothing
    assert (after["full_required"], len(after["rows"])) == (before["full_required"], len(before["rows"]))
