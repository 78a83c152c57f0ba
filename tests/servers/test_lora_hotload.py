"""LoRA adapters hot-swapped through the hot-load API on a real ``vllm serve --enable-lora`` (issue 18 point 4).

The trainer (real TorchTitan LoRA clients) pushes adapter versions with :class:`deltasync.HotLoadClient` — the first
of each adapter full (a PEFT directory), the next ones ``arc_v2`` deltas against the served version — while clients
keep requesting two adapters and the base model concurrently. Each version is its own vLLM adapter
(``<lora_name>@<identity>``): a request finishes on the version it was admitted with, so no response mixes versions,
every response is bitwise the trainer's log-probs for the version its ``model`` field names, and bitwise what the same
request gets served alone. Control: vLLM's own in-place reload (``/v1/load_lora_adapter`` with ``load_inplace``)
under a running stream gives a response that matches neither version. Refused adapter snapshots leave the served
version untouched; a restart restores every adapter's last version, verified.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import torch

from deltasync import HotLoadClient, SnapshotWriter, read_snapshot_tensors
from shared_numerics.rollout import RolloutBatch
from vllm_plugin.serve import HotLoadServer
from zerokld_testing import random_datums, random_prompts

pytestmark = [pytest.mark.vllm, pytest.mark.titan, pytest.mark.timeout(900)]

API_KEY = "sk-zerokld-lora"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
HL = "/zerokld/v1/hot_load"
MAX_RANK = 8
ADAPTERS = {"A": (4, 8.0, 11), "B": (8, 16.0, 12)}  # name: (rank, alpha, seed)
VERSIONS = 4  # v1 full, then deltas; v4 is pushed under a running stream
# with a 20-token prompt, near --max-model-len 1024. The stream's steps are slowed (STEP_DELAY_S each,
# HotLoadServer.slowed_steps) until a token has arrived after the mid-stream action returned, so the stream outlasts
# the action on any machine: unslowed, streams of 480 and of 1,000 tokens each ended in CI before the swap returned
# (the last one 3.6 s after the action started: on 2 cores a running engine leaves the API server little CPU)
STREAM_TOKENS = 1000
STEP_DELAY_S = 0.05
MAX_MODEL_LEN = 1024


class Env:
    """The server, the trainer's adapter versions (PEFT dirs) and a LoRA training client per adapter (to score)."""

    def __init__(
        self, server: HotLoadServer, ckpt: str, clients: dict, versions: dict[str, list[Path]], tmp: Path
    ) -> None:
        self.server, self.ckpt, self.clients, self.versions, self.tmp = server, ckpt, clients, versions, tmp
        self.hl = HotLoadClient(server.base, api_key=API_KEY)
        self.writers = {
            n: SnapshotWriter(server.root, versions[n][0], full_every=100, cache_dir=tmp / f"cache-{n}")
            for n in versions
        }

    def push(self, name: str, v: int):
        """Push version ``v`` (1-based) of adapter ``name``; the :class:`deltasync.PushResult`."""
        return self.hl.push(
            self.writers[name], f"{name}-v{v}", read_snapshot_tensors(self.versions[name][v - 1]), lora_name=name
        )

    def current(self, name: str) -> int:
        """The version of adapter ``name`` the server serves (0: none)."""
        status = requests.get(self.server.base + HL + "/status", headers=AUTH, timeout=30).json()["replicas"][0]
        identity = status["lora_adapters"].get(name, {}).get("current_snapshot_identity")
        return int(identity.rsplit("-v", 1)[1]) if identity else 0

    def ensure(self, name: str) -> int:
        """Version 1 of ``name`` pushed if the server serves none; the version served."""
        if (v := self.current(name)) == 0:
            self.push(name, 1)
            v = 1
        return v

    def dir_of(self, model: str) -> Path | None:
        """The PEFT directory of the adapter version a response's ``model`` names (``None``: the base model)."""
        if model == Path(self.ckpt).name:  # the base model answers under its directory's name, never its path
            return None
        name, identity = model.split("@")
        return self.versions[name][int(identity.rsplit("-v", 1)[1]) - 1]


@pytest.fixture(scope="module")
def env(engine_slot, checkpoint_factory, tmp_path_factory):
    from titan_plugin import TrainingClient

    engine_slot.close()
    ckpt = checkpoint_factory("qwen3", "bfloat16")
    tmp = tmp_path_factory.mktemp("lora_hotload")
    clients, versions = {}, {}
    try:
        for name, (rank, alpha, seed) in ADAPTERS.items():
            c = clients[name] = TrainingClient.create_lora(
                ckpt,
                rank=rank,
                alpha=alpha,
                max_rank=MAX_RANK,
                learning_rate=2e-2,
                seed=seed,
                dump_folder=str(tmp / f"train-{name}"),
            )
            versions[name] = []
            for v in range(1, VERSIONS + 1):
                c.forward_backward(random_datums(100 * seed + v), "cross_entropy")
                c.optim_step()
                versions[name].append(Path(c.save_weights_for_sampler(f"{name}-v{v}")))
        (tmp / "snapshots").mkdir()
        server = HotLoadServer(
            ckpt,
            tmp / "snapshots",
            tmp / "state",
            tmp / "server.log",
            API_KEY,
            ("--enable-lora", "--max-loras", "3", "--max-cpu-loras", "4", "--max-lora-rank", str(MAX_RANK)),
            max_model_len=MAX_MODEL_LEN,
        )
        server.start(extra_env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})  # the control's in-place reloads
        try:
            yield Env(server, ckpt, clients, versions, tmp)
        finally:
            server.stop()
    finally:
        for c in clients.values():
            c.close()


def _complete(env: Env, model: str, prompt: list[int], seed: int, max_tokens: int = 24) -> dict:
    r = requests.post(
        env.server.base + "/v1/completions",
        headers=AUTH,
        timeout=300,
        json={
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 1.0,
            "seed": seed,
            "logprobs": 0,
            "ignore_eos": True,
            "return_tokens_as_token_ids": True,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    lp = body["choices"][0]["logprobs"]
    return {
        "model": body["model"],
        "tokens": [int(t.split(":")[1]) for t in lp["tokens"]],
        "logprobs": torch.tensor(lp["token_logprobs"], dtype=torch.float32),
        "done": time.monotonic(),
    }


def _stream(env: Env, model: str, prompt: list[int], seed: int, max_tokens: int, action) -> dict:
    """A streamed completion; ``action()`` runs in a thread once the first token has arrived, while the stream is
    read on. The engine's steps are slowed (:data:`STEP_DELAY_S`) from before the request until a token arrives more
    than 0.3 s after ``action`` returned (or the stream ends). Returns ``late``: how many tokens arrived more than 0.3 s
    after ``action`` returned, and ``timing``: the seconds the action and the whole stream took (for the failure
    message)."""
    with env.server.slowed_steps(STEP_DELAY_S):
        return _slowed_stream(env, model, prompt, seed, max_tokens, action)


def _slowed_stream(env: Env, model: str, prompt: list[int], seed: int, max_tokens: int, action) -> dict:
    """:func:`_stream` within its slowed steps."""
    r = requests.post(
        env.server.base + "/v1/completions",
        headers=AUTH,
        timeout=300,
        stream=True,
        json={
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 1.0,
            "seed": seed,
            "logprobs": 0,
            "ignore_eos": True,
            "return_tokens_as_token_ids": True,
            "stream": True,
        },
    )
    assert r.status_code == 200, r.text
    tokens, lps, models, arrivals, returned, started = [], [], set(), [], [], []
    worker = threading.Thread(
        target=lambda: (started.append(time.monotonic()), action(), returned.append(time.monotonic()))
    )
    for line in r.iter_lines():
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        models.add(chunk["model"])
        lp = chunk["choices"][0].get("logprobs") or {}
        tokens += [int(t.split(":")[1]) for t in lp.get("tokens", [])]
        lps += lp.get("token_logprobs", [])
        arrivals += [time.monotonic()] * len(lp.get("tokens", []))
        if tokens and not worker.ident:
            worker.start()
        if returned and arrivals and arrivals[-1] > returned[0] + 0.3:
            env.server.release_steps()  # a token after the action: the rest may come at full speed
    worker.join(timeout=120)
    assert returned, "the mid-stream action did not finish"
    return {
        "models": models,
        "tokens": tokens,
        "logprobs": torch.tensor(lps, dtype=torch.float32),
        "late": sum(a > returned[0] + 0.3 for a in arrivals),
        "timing": {"action_s": returned[0] - started[0], "stream_after_action_start_s": arrivals[-1] - started[0]},
    }


def _score(env: Env, prompts, results) -> list[torch.Tensor]:
    """The trainer's log-probs of each response's completion under the adapter version its ``model`` names (the
    base model's: base-only forward)."""
    scores: list = [None] * len(results)
    groups: dict = {}
    for i, res in enumerate(results):
        groups.setdefault(env.dir_of(res["model"]), []).append(i)
    for folder, idx in groups.items():
        client = env.clients["A" if folder is None else folder.name.split("-")[0]]
        if folder is not None:
            client.trainer.load_lora(folder)
        batch = RolloutBatch([prompts[i] + results[i]["tokens"] for i in idx], [len(prompts[i]) for i in idx])
        for i, lp in zip(idx, client.trainer.forward_logprobs(batch, base_only=folder is None), strict=True):
            scores[i] = lp
    return scores


def test_adapter_versions_swapped_under_load_leak_nothing(env):
    """Versions 2 and 3 of both adapters arrive as arc_v2 deltas while 6 clients keep requesting A, B and the base
    model (until 12 more requests after the last swap). Every response is bitwise the trainer's for the version it
    names and bitwise the same request served alone (versions still served), and the versions alternated under
    the load."""
    first = [env.push(n, 1) for n in ADAPTERS]
    assert [p.snapshot.kind for p in first] == ["full", "full"]
    models = ["A", "B", env.ckpt]
    prompts = random_prompts(120, seed=51, lo=4, hi=60)

    def job(i):  # requests go on until 12 after the last swap (a fixed list of 120 once ran out before it)
        return models[i % 3], prompts[i % len(prompts)], 700 + i

    results: dict[int, dict] = {}
    counter, stop_at, swaps = itertools.count(), [600], []

    def client():
        while (i := next(counter)) < stop_at[0]:
            results[i] = _complete(env, *job(i))

    def trainer():  # deltas pushed one after another while requests run
        while len(results) < 3:
            time.sleep(0.05)
        for v in (2, 3):
            for name in ADAPTERS:
                res = env.push(name, v)
                swaps.append((name, v, res.snapshot.kind, res.refused))
                time.sleep(0.3)
        stop_at[0] = min(stop_at[0], len(results) + 12)

    with ThreadPoolExecutor(max_workers=7) as pool:
        futures = [pool.submit(client) for _ in range(6)] + [pool.submit(trainer)]
        for f in futures:
            f.result()
    assert swaps == [
        ("A", 2, "incremental", []),
        ("B", 2, "incremental", []),
        ("A", 3, "incremental", []),
        ("B", 3, "incremental", []),
    ]
    order = sorted(results)
    served = [results[i]["model"] for i in order]
    assert {m for m in served if m.startswith("A@")} >= {"A@A-v1", "A@A-v3"}, served
    assert {m for m in served if m.startswith("B@")} >= {"B@B-v1", "B@B-v3"}, served
    for i in order:
        m = job(i)[0]
        assert results[i]["model"] == Path(env.ckpt).name if m == env.ckpt else results[i]["model"].startswith(m + "@")
    scores = _score(env, [job(i)[1] for i in order], [results[i] for i in order])
    mismatched = [
        results[i]["model"] for s, i in zip(scores, order, strict=True) if not torch.equal(s, results[i]["logprobs"])
    ]
    assert mismatched == []
    # the same requests alone, for the versions still served (v3 of both, and the base model)
    for i in order:
        r = results[i]
        if r["model"] in ("A@A-v3", "B@B-v3", Path(env.ckpt).name):
            alone = _complete(env, *job(i))
            assert (alone["model"], alone["tokens"]) == (r["model"], r["tokens"])
            assert torch.equal(alone["logprobs"], r["logprobs"])
    status = requests.get(env.server.base + HL + "/status", headers=AUTH, timeout=30).json()["replicas"][0]
    assert {n: a["current_snapshot_identity"] for n, a in status["lora_adapters"].items()} == {"A": "A-v3", "B": "B-v3"}
    led = requests.get(env.server.base + HL + "/ledger", headers=AUTH, params={"lora_name": "B"}, timeout=30).json()
    assert [(r["identity"], r["kind"], r["readiness"]) for r in led["rows"]] == [
        ("B-v1", "full", "ready"),
        ("B-v2", "incremental", "ready"),
        ("B-v3", "incremental", "ready"),
    ]
    assert (
        requests.get(env.server.base + HL + "/ledger", headers=AUTH, params={"lora_name": "Z"}, timeout=30).status_code
        == 404
    )


def test_a_stream_spanning_an_adapter_swap_keeps_its_version(env):
    """A is swapped to its next version (a delta) after the first token of a running stream on A: the whole stream
    stays on the version it was admitted with — every log-prob the trainer's under that version — and the next
    request gets the new one."""
    v = env.ensure("A")
    prompt = random_prompts(1, seed=61, lo=20, hi=21)[0]
    writer = env.writers["A"]
    # the delta is written before the stream starts, so the mid-stream action is the hot-load signal alone (the
    # encoding, on the same 2 busy cores, once made a 480-token stream finish before the swap did)
    info = writer.write(f"A-v{v + 1}", read_snapshot_tensors(env.versions["A"][v]))
    assert info.kind == "incremental"
    res = _stream(env, "A", prompt, 17, STREAM_TOKENS, lambda: (env.hl.signal(info, "A"), writer.confirm(info)))
    assert res["late"] > 0, res["timing"]
    assert res["models"] == {f"A@A-v{v}"}
    assert torch.equal(_score(env, [prompt], [{"model": f"A@A-v{v}", "tokens": res["tokens"]}])[0], res["logprobs"])
    assert _complete(env, "A", prompt, 17, max_tokens=4)["model"] == f"A@A-v{v + 1}"


def test_negative_control_vllm_in_place_reload_mixes_versions(env):
    """vLLM's own hot-swap (``/v1/load_lora_adapter`` with ``load_inplace``) of adapter C from version 1 to 2 under a
    running stream: the response's log-probs are neither version 1's nor version 2's (it mixed them)."""
    v1, v2 = env.versions["A"][0], env.versions["A"][1]

    def load(path: Path, inplace: bool) -> None:
        r = requests.post(
            env.server.base + "/v1/load_lora_adapter",
            headers=AUTH,
            timeout=120,
            json={"lora_name": "C", "lora_path": str(path), "load_inplace": inplace},
        )
        assert r.status_code == 200, r.text

    load(v1, False)
    prompt = random_prompts(1, seed=62, lo=20, hi=21)[0]
    res = _stream(env, "C", prompt, 18, STREAM_TOKENS, lambda: load(v2, True))
    assert res["late"] > 0 and res["models"] == {"C"}, (res["timing"], res["models"])
    scores = [_score(env, [prompt], [{"model": f"A@A-v{v}", "tokens": res["tokens"]}])[0] for v in (1, 2)]
    assert not torch.equal(scores[0], res["logprobs"]) and not torch.equal(scores[1], res["logprobs"])


def _snap(env: Env, name: str, tensors: dict, assets: Path | None = None) -> str:
    from deltasync import write_full_snapshot

    write_full_snapshot(tensors, assets or env.versions["A"][0], env.server.root / name)
    return name


def test_bad_adapter_snapshots_are_refused_and_the_served_version_stays(env):
    """Refused, with the served version of A (and its bits) unchanged: a delta against a version A does not serve
    (409), a delta as the first version of a new adapter (409), a corrupt full snapshot (422), a model snapshot sent
    as an adapter (422), an adapter above the engine's ``max_lora_rank`` (422, refused by vLLM's loader), an invalid
    ``lora_name`` (400). Each refusal is a row of that adapter's ledger."""
    env.ensure("A")
    prompt = random_prompts(1, seed=63, lo=10, hi=11)[0]
    before = _complete(env, "A", prompt, 19, max_tokens=8)
    a_tensors = read_snapshot_tensors(env.versions["A"][0])

    def signal(body: dict) -> requests.Response:
        return requests.post(env.server.base + HL, headers=AUTH, json=body, timeout=120)

    served = before["model"].split("@")[1]
    delta = {"previous_snapshot_identity": "A-never", "compression_format": "arc_v2", "checksum_format": "alder32"}
    (env.server.root / "A-bad-chain").mkdir()  # exists; refused on the chain before it is opened
    assert (
        signal({"identity": "A-bad-chain", "lora_name": "A", "incremental_snapshot_metadata": delta}).status_code == 409
    )
    assert (
        signal({"identity": "A-bad-chain", "lora_name": "N", "incremental_snapshot_metadata": delta}).status_code == 409
    )
    corrupt = _snap(env, "A-corrupt", a_tensors)
    f = env.server.root / corrupt / "adapter_model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-3] ^= 0x40
    f.write_bytes(bytes(raw))
    r = signal({"identity": corrupt, "lora_name": "A"})
    assert r.status_code == 422 and "checksum" in r.json()["error"], r.text
    model_snap = _snap(env, "A-model", read_snapshot_tensors(env.ckpt), Path(env.ckpt))
    r = signal({"identity": model_snap, "lora_name": "A"})
    assert r.status_code == 422 and "adapter_config.json" in r.json()["error"], r.text
    wide = env.tmp / "wide"  # rank 16 > --max-lora-rank 8
    wide.mkdir()
    cfg = json.loads((env.versions["A"][0] / "adapter_config.json").read_text())
    (wide / "adapter_config.json").write_text(json.dumps({**cfg, "r": 16, "lora_alpha": 32}))
    g = torch.Generator().manual_seed(0)
    wide_tensors = {
        k: torch.randn(*((16, v.shape[1]) if "lora_A" in k else (v.shape[0], 16)), generator=g).to(v.dtype) * 0.01
        for k, v in a_tensors.items()
    }
    r = signal({"identity": _snap(env, "A-wide", wide_tensors, wide), "lora_name": "A"})
    assert r.status_code == 422 and "rank" in r.json()["error"].lower(), r.text
    assert signal({"identity": "A-v9", "lora_name": "../A"}).status_code == 400
    led = requests.get(env.server.base + HL + "/ledger", headers=AUTH, params={"lora_name": "A"}, timeout=30).json()
    assert [r["identity"] for r in led["refusals"]] == ["A-bad-chain"]  # refused before loading: the ring
    assert [r["identity"] for r in led["rows"] if r["readiness"] == "failed"] == ["A-corrupt", "A-model", "A-wide"]
    after = _complete(env, "A", prompt, 19, max_tokens=8)
    assert after["model"] == f"A@{served}" and after["tokens"] == before["tokens"]
    assert torch.equal(after["logprobs"], before["logprobs"])


@pytest.mark.extended  # `make test-extended`: restarts are test_hotload.py's (~50 s)
def test_restart_restores_every_adapter_version(env):
    """After a restart the server serves each adapter's last version again (verified against the ledger's digest):
    the same request gets the same version and bits as before the restart."""
    for n in ADAPTERS:
        env.ensure(n)
    prompt = random_prompts(1, seed=64, lo=10, hi=11)[0]
    before = {n: _complete(env, n, prompt, 20, max_tokens=8) for n in ADAPTERS}
    env.server.stop()
    env.server.start(extra_env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    for n in ADAPTERS:
        after = _complete(env, n, prompt, 20, max_tokens=8)
        assert (after["model"], after["tokens"]) == (before[n]["model"], before[n]["tokens"])
        assert torch.equal(after["logprobs"], before[n]["logprobs"])
