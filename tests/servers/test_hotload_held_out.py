"""Held-out hot-load failures (issue 35 rows 3-9) on one real ``vllm serve`` whose state dir is a 24 MiB tmpfs in the
server's own mount namespace (a disk that really fills up): the bytes verified are the bytes loaded (a file swapped
after the check never serves, a FIFO is refused at open), an index must name every tensor and shard, a SHA-256 per
tensor catches an edit that keeps every Adler-32, a full disk is a clean 507, no answer carries an absolute path,
``new_session`` isolation covers ``/invocations`` and refuses routes that take no salt, an empty transition header is
400, refused signals live in a bounded ring and the ledger file is appended to."""

from __future__ import annotations

import json
import os
import threading
import zlib
from pathlib import Path

import pytest
import requests
import torch
from safetensors.torch import load_file, save_file

from deltasync import read_snapshot_tensors, weights_digest, write_full_snapshot
from titan_plugin import trainer_logprobs
from vllm_plugin.serve import HotLoadServer
from zerokld_models.checkpoint import INDEX_FILE
from zerokld_testing.servers import tmpfs_prefix

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

API_KEY = "sk-zerokld-held-out"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
HL = "/zerokld/v1/hot_load"
PROMPT = [1] + list(range(10, 40))
LONG_PROMPT = [1] + list(range(3, 100)) * 2  # 195 tokens: whole KV blocks for the prefix cache to keep


def _perturb(sd: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: (v.float() + torch.randn(v.shape, generator=g) * 0.02).to(v.dtype) for k, v in sd.items()}


class Env:
    def __init__(self, server: HotLoadServer, ckpt: str, root: Path, tmp: Path) -> None:
        self.server, self.ckpt, self.root, self.tmp = server, ckpt, root, tmp

    @property
    def state(self) -> Path:
        """The state dir as the server sees it (its tmpfs), from this process."""
        return Path(f"/proc/{self.server.proc.pid}/root") / str(self.server.state).lstrip("/")

    def signal(self, identity: str, headers: dict | None = None, **body):
        return requests.post(
            self.server.base + HL, json={"identity": identity, **body}, headers={**AUTH, **(headers or {})}, timeout=300
        )

    def get(self, path: str) -> dict:
        r = requests.get(self.server.base + path, headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    def current(self) -> str:
        return self.get(HL + "/status")["replicas"][0]["current_snapshot_identity"]

    def logprobs(
        self, route: str = "/v1/completions", prompt=PROMPT, **extra
    ) -> tuple[list[int], torch.Tensor, str, dict]:
        r = requests.post(
            self.server.base + route,
            headers=AUTH,
            timeout=120,
            json={
                "model": self.ckpt,
                "prompt": prompt,
                "max_tokens": 6,
                "temperature": 0.0,
                "logprobs": 0,
                "ignore_eos": True,
                "return_tokens_as_token_ids": True,
                **extra,
            },
        )
        assert r.status_code == 200, r.text
        data = r.json()
        lp = data["choices"][0]["logprobs"]
        return (
            [int(t.split(":")[1]) for t in lp["tokens"]],
            torch.tensor(lp["token_logprobs"]),
            r.headers.get("x-zerokld-snapshot-identity"),
            data.get("usage") or {},
        )

    def check_serving(self, snapshot: Path) -> None:
        toks, lps, _, _ = self.logprobs()
        ref = trainer_logprobs(str(snapshot), [PROMPT + toks], [len(PROMPT)], dtype="bfloat16")[0]
        assert torch.equal(ref, lps)

    def unchanged(self, before) -> None:
        now = self.logprobs()
        assert now[0] == before[0] and torch.equal(now[1], before[1]) and now[2] == before[2]


@pytest.fixture(scope="module")
def env(engine_slot, checkpoint_factory, tmp_path_factory):
    engine_slot.close()
    ckpt = checkpoint_factory("qwen3", "bfloat16")
    tmp = tmp_path_factory.mktemp("held_out")
    root, state = tmp / "snapshots", tmp / "state"
    root.mkdir()
    state.mkdir()
    server = HotLoadServer(ckpt, root, state, tmp / "server.log", API_KEY)
    server.prefix = tmpfs_prefix(state, "24m")
    server.start()
    yield Env(server, ckpt, root, tmp)
    server.stop()


def test_a_file_swapped_after_the_check_never_serves(env):
    """Row 3: the published ``model.safetensors`` is replaced (atomic rename) over and over by NaN weights while the
    signal runs: the load either serves exactly the good snapshot's bits (the trainer's log-probs, its digest in
    the ledger) or is refused with the old weights serving — never NaN, never other bits under the checked identity.
    A FIFO in place of the weights is refused at open (422) instead of freezing the server."""
    base = read_snapshot_tensors(env.ckpt)
    good = write_full_snapshot(_perturb(base, 1), env.ckpt, env.tmp / "good")
    nan = {k: torch.full_like(v, float("nan")) for k, v in base.items()}
    save_file(nan, str(env.tmp / "nan.safetensors"), metadata={"format": "pt"})
    target = env.root / "race"
    for attempt in range(3):
        ident = f"race{attempt}"
        target = env.root / ident
        write_full_snapshot(_perturb(base, 1), env.ckpt, target)
        before = env.logprobs()
        stop = threading.Event()

        def flip():
            n = 0
            while not stop.is_set():
                src = env.tmp / "nan.safetensors" if n % 2 == 0 else good / "model.safetensors"
                tmp = target / f".swap{n}"
                tmp.write_bytes(src.read_bytes())
                os.replace(tmp, target / "model.safetensors")
                n += 1

        t = threading.Thread(target=flip)
        t.start()
        try:
            r = env.signal(ident)
        finally:
            stop.set()
            t.join()
        if r.status_code == 200:
            assert env.current() == ident
            env.check_serving(good)
            assert r.json()["weights_digest"] == weights_digest(good)
        else:
            assert r.status_code == 422, r.text
            env.unchanged(before)
    fifo = env.root / "fifo"
    write_full_snapshot(_perturb(base, 2), env.ckpt, fifo)
    (fifo / "model.safetensors").unlink()
    os.mkfifo(fifo / "model.safetensors")
    before = env.logprobs()
    r = env.signal("fifo")
    assert r.status_code == 422 and "regular file" in r.json()["error"], r.text
    env.unchanged(before)


def test_an_index_must_name_every_tensor_and_shard(env):
    """Row 4: two shards whose index names only the first one: refused (vLLM would load only the indexed shard and
    keep the previous values of the rest)."""
    base = read_snapshot_tensors(env.ckpt)
    snap = write_full_snapshot(_perturb(base, 3), env.ckpt, env.tmp / "one-shard")
    out = env.root / "two-shards"
    out.mkdir()
    for f in snap.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(snap / "model.safetensors"))
    names = sorted(tensors)
    first, second = names[: len(names) // 2], names[len(names) // 2 :]
    save_file({k: tensors[k] for k in first}, str(out / "model-00001-of-00002.safetensors"))
    save_file({k: tensors[k] for k in second}, str(out / "model-00002-of-00002.safetensors"))
    (out / INDEX_FILE).write_text(json.dumps({"weight_map": {k: "model-00001-of-00002.safetensors" for k in first}}))
    before = env.logprobs()
    r = env.signal("two-shards")
    assert r.status_code == 422 and INDEX_FILE in r.json()["error"], r.text
    env.unchanged(before)
    # the same shards with a complete index load
    (out / INDEX_FILE).write_text(
        json.dumps(
            {
                "weight_map": {
                    **{k: "model-00001-of-00002.safetensors" for k in first},
                    **{k: "model-00002-of-00002.safetensors" for k in second},
                }
            }
        )
    )
    (env.root / "two-shards-ok").mkdir()
    for f in out.iterdir():
        (env.root / "two-shards-ok" / f.name).write_bytes(f.read_bytes())
    r = env.signal("two-shards-ok")
    assert r.status_code == 200, r.text
    env.check_serving(snap)


def adler_preserving_edit(raw: bytearray) -> None:
    """Change three consecutive bytes by +1, -2, +1: Adler-32's sums A and B are unchanged."""
    for i in range(len(raw) - 2):
        if raw[i] < 255 and raw[i + 1] >= 2 and raw[i + 2] < 255:
            raw[i] += 1
            raw[i + 1] -= 2
            raw[i + 2] += 1
            return
    raise AssertionError("no byte triple to edit")


def test_an_edit_that_keeps_every_adler32_is_refused(env):
    """Row 5: ``lm_head`` bytes edited so every tensor keeps its Adler-32 (the spec's transport checksums still
    match): the per-tensor SHA-256 refuses it; the old weights keep serving."""
    snap = write_full_snapshot(_perturb(read_snapshot_tensors(env.ckpt), 4), env.ckpt, env.root / "edited")
    tensors = load_file(str(snap / "model.safetensors"))
    raw = bytearray(tensors["lm_head.weight"].view(torch.uint8).numpy().tobytes())
    adler = zlib.adler32(raw)
    adler_preserving_edit(raw)
    assert zlib.adler32(raw) == adler
    tensors["lm_head.weight"] = (
        torch.frombuffer(raw, dtype=torch.uint8).view(torch.bfloat16).reshape(tensors["lm_head.weight"].shape).clone()
    )
    save_file(tensors, str(snap / "model.safetensors"), metadata={"format": "pt"})
    before = env.logprobs()
    r = env.signal("edited")
    assert r.status_code == 422 and "sha256" in r.json()["error"], r.text
    env.unchanged(before)


def test_a_full_disk_is_a_clean_refusal(env):
    """Row 6: the state dir's disk full — while the snapshot is copied in (no room for it) and before anything can
    be written (not even the ledger row): 507 with a short message, no staged leftovers, the ledger unchanged on
    disk, the old weights serving; with space again the same snapshot loads."""
    snap = write_full_snapshot(_perturb(read_snapshot_tensors(env.ckpt), 5), env.ckpt, env.root / "big")
    size = sum(f.stat().st_size for f in snap.iterdir())
    filler = env.state / "filler"
    st = os.statvfs(env.state)
    free = st.f_bavail * st.f_frsize
    filler.write_bytes(b"\0" * max(0, free - size // 2))  # room for the ledger row, not for the copy
    before = env.logprobs()
    ledger_before = (env.state / "ledger.jsonl").read_bytes()
    r = env.signal("big")
    assert r.status_code == 507 and len(r.text) < 400, r.text
    assert "/" not in r.json()["error"].replace("s3://", ""), r.text
    env.unchanged(before)
    assert not (env.state / "materialized" / "big").exists()
    staging = env.state / "materialized" / ".staging"
    assert not staging.exists() or not any(staging.iterdir())
    assert (env.state / "ledger.jsonl").read_bytes().startswith(ledger_before)  # appended to, never rewritten
    with open(filler, "ab") as f:  # now nothing fits, not even a ledger line
        try:
            f.write(b"\0" * (8 << 20))
            f.flush()
        except OSError:
            pass
    r = env.signal("big")
    assert r.status_code == 507, r.text
    assert env.current() == before[2]
    filler.unlink()
    assert env.signal("big").status_code == 200
    env.check_serving(snap)


def test_new_session_isolation_covers_invocations_and_refuses_unsalted_routes(env):
    """Row 8: after a ``new_session`` swap, a session-less ``/invocations`` request (SageMaker's route) reuses no
    prefix computed with the old weights, and routes that take no salt (``/v1/responses``) are refused while the
    isolation is in force; an ``all`` swap lifts it."""
    base = read_snapshot_tensors(env.ckpt)
    write_full_snapshot(_perturb(base, 6), env.ckpt, env.root / "ns1")
    write_full_snapshot(_perturb(base, 7), env.ckpt, env.root / "ns2")
    write_full_snapshot(_perturb(base, 8), env.ckpt, env.root / "ns3")
    assert env.signal("ns1").status_code == 200
    env.logprobs("/invocations", LONG_PROMPT)
    again = env.logprobs("/invocations", LONG_PROMPT)[3]
    assert again["prompt_tokens_details"]["cached_tokens"] > 0  # the prefix cache is on and hit
    assert env.signal("ns2", reset_prompt_cache="new_session").status_code == 200
    after = env.logprobs("/invocations", LONG_PROMPT)
    assert after[2] == "ns2" and after[3]["prompt_tokens_details"]["cached_tokens"] == 0
    r = requests.post(
        env.server.base + "/v1/responses",
        headers=AUTH,
        timeout=60,
        json={"model": env.ckpt, "input": "abc", "max_output_tokens": 2},
    )
    assert r.status_code == 409 and "new_session" in r.json()["error"], r.text
    assert (
        requests.post(
            env.server.base + "/tokenize", headers=AUTH, timeout=60, json={"model": env.ckpt, "prompt": "abc"}
        ).status_code
        == 200
    )
    assert env.signal("ns3", reset_prompt_cache="all").status_code == 200
    r = requests.post(
        env.server.base + "/v1/responses",
        headers=AUTH,
        timeout=60,
        json={"model": env.ckpt, "input": "abc", "max_output_tokens": 2},
    )
    assert r.status_code != 409, r.text


def test_transition_header_refusal_ring_and_paths(env):
    """Row 9: an empty transition header is 400 (not async); 100 refused signals leave the ledger's rows and file
    unchanged and keep the newest 64 in ``refusals``. Row 7: no answer, ledger or status carries an absolute path."""
    write_full_snapshot(_perturb(read_snapshot_tensors(env.ckpt), 9), env.ckpt, env.root / "hdr")
    r = env.signal("hdr", headers={"x-zerokld-hot-load-transition": ""})
    assert r.status_code == 400 and "transition" in r.json()["error"], r.text
    ledger_file = env.state / "ledger.jsonl"
    rows, size = len(env.get(HL + "/ledger")["rows"]), ledger_file.stat().st_size
    for i in range(100):
        assert env.signal(f"missing-{i}").status_code == 404
    led = env.get(HL + "/ledger")
    assert len(led["rows"]) == rows and ledger_file.stat().st_size == size
    assert [r["identity"] for r in led["refusals"][-3:]] == ["missing-97", "missing-98", "missing-99"]
    assert len(led["refusals"]) == 64
    status = env.get(HL + "/status")
    assert status["replicas"][0]["last_error"]["identity"] == "missing-99"
    text = json.dumps(led) + json.dumps(status)
    for p in (str(env.tmp), str(env.root), str(env.server.state), "/proc/"):
        assert p not in text
