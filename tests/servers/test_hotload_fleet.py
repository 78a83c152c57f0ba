"""A fleet of two real ``vllm serve`` replicas on loopback pulling from one snapshot root in S3 (moto on loopback;
issue 17 points 2 and 3): the trainer writes each snapshot locally and uploads it (``SnapshotWriter(publish_url=)``),
the replicas download it (resumable, every file checked against its published SHA-256), and the trainer's
:class:`deltasync.HotLoadClient` signals both at once; when one refuses an incremental snapshot (its chain diverged),
that replica alone gets a full snapshot of the same weights, the client says which, and the fleet serves the same
bits again (same weights digest, bitwise the same log-probs from both); the next snapshot is full for all. Status
and ledger rows name their replica; each replica's ledger is its own."""

from __future__ import annotations

import pytest
import requests
import torch

from deltasync import HotLoadClient, SnapshotWriter, publish_dir, read_snapshot_tensors, write_full_snapshot
from vllm_plugin.serve import HotLoadServer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

API_KEY = "sk-zerokld-fleet"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
HL = "/zerokld/v1/hot_load"
PROMPT = [1] + list(range(10, 40))


def _perturbed(sd: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        k: torch.where(
            torch.rand(v.shape, generator=g) < 0.05, v + (torch.randn(v.shape, generator=g) * 0.02).to(v.dtype), v
        )
        for k, v in sd.items()
    }


@pytest.fixture(scope="module")
def fleet(engine_slot, checkpoint_factory, tmp_path_factory, s3_server):
    engine_slot.close()
    ckpt = checkpoint_factory("qwen3", "bfloat16")
    tmp = tmp_path_factory.mktemp("fleet")
    root = f"{s3_server}/fleet"
    # two engines on this machine at once: 1 GiB of KV cache each instead of 30% of the memory
    servers = [
        HotLoadServer(
            ckpt, root, tmp / f"state{i}", tmp / f"server{i}.log", API_KEY, ("--kv-cache-memory-bytes", str(1 << 30))
        )
        for i in range(2)
    ]
    try:
        for s in servers:
            s.start()
        yield ckpt, root, tmp, servers
    finally:
        for s in servers:
            s.stop()


def _greedy(server: HotLoadServer) -> tuple[list[int], torch.Tensor, str]:
    r = requests.post(
        server.base + "/v1/completions",
        headers=AUTH,
        timeout=120,
        json={
            "model": server.ckpt,
            "prompt": PROMPT,
            "max_tokens": 8,
            "temperature": 0.0,
            "logprobs": 0,
            "ignore_eos": True,
            "return_tokens_as_token_ids": True,
        },
    )
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    return (
        [int(t.split(":")[1]) for t in lp["tokens"]],
        torch.tensor(lp["token_logprobs"]),
        r.headers["x-zerokld-snapshot-identity"],
    )


def test_a_diverged_replica_falls_back_to_full_and_the_fleet_stays_consistent(fleet):
    ckpt, root, tmp, servers = fleet
    urls = [s.base for s in servers]
    client = HotLoadClient(urls, api_key=API_KEY)
    writer = SnapshotWriter(tmp / "out", ckpt, full_every=100, cache_dir=tmp / "writer_cache", publish_url=root)
    base = read_snapshot_tensors(ckpt)
    assert client.fleet_status()["consistent"]

    first = client.push(writer, "f1", _perturbed(base, 1))
    assert (first.snapshot.kind, first.fallback) == ("full", [])
    # replica 1's chain diverges: it is sent a snapshot the trainer's writer never wrote
    publish_dir(write_full_snapshot(_perturbed(base, 99), ckpt, tmp / "r1-only"), f"{root}/r1-only")
    assert requests.post(urls[1] + HL, headers=AUTH, json={"identity": "r1-only"}, timeout=300).status_code == 200
    assert not client.fleet_status()["consistent"]

    res = client.push(writer, "f2", _perturbed(base, 2))
    assert res.fallback == [urls[1]] and res.snapshot.identity == "f2-full" and res.snapshot.kind == "full"
    assert len(res.refused) == 1 and res.refused[0].startswith(urls[1]) and "out-of-order" in res.refused[0]
    status = client.fleet_status()
    assert status["consistent"], status
    rows = status["replicas"]
    assert [r["current_snapshot_identity"] for r in rows] == ["f2", "f2-full"]
    assert rows[0]["weights_digest"] == rows[1]["weights_digest"] and rows[0]["replica"] != rows[1]["replica"]
    assert rows[1]["last_error"]["identity"] == "f2" and "out-of-order" in rows[1]["last_error"]["error"]
    served = [_greedy(s) for s in servers]  # the same bits from both replicas
    assert served[0][0] == served[1][0] and torch.equal(served[0][1], served[1][1])
    assert [s[2] for s in served] == ["f2", "f2-full"]

    third = client.push(writer, "f3", _perturbed(base, 3))  # full for all: the chains meet again
    assert (third.snapshot.kind, third.fallback) == ("full", [])
    assert [r["current_snapshot_identity"] for r in client.fleet_status()["replicas"]] == ["f3", "f3"]
    fourth = client.push(writer, "f4", _perturbed(base, 4))
    assert (fourth.snapshot.kind, fourth.fallback) == ("incremental", [])
    for s, r in zip(servers, client.fleet_status()["replicas"], strict=True):  # each ledger is its replica's own
        led = requests.get(s.base + HL + "/ledger", headers=AUTH, timeout=30).json()
        assert led["replica"] == r["replica"] and {row["replica"] for row in led["rows"]} == {r["replica"]}
    led1 = requests.get(urls[1] + HL + "/ledger", headers=AUTH, timeout=30).json()
    # the refused out-of-order delta changed nothing, so it is in the refusal ring, not among the loads
    assert [row["identity"] for row in led1["rows"]] == ["f1", "r1-only", "f2-full", "f3", "f4"]
    assert [row["identity"] for row in led1["refusals"]] == ["f2"] and "out-of-order" in led1["refusals"][0]["error"]
