"""Snapshot protocol: arc_v2 interop with the public reference implementation (PyPI ``fireworks-delta-compression``)
in both directions, and refusals that publish nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deltasync import (
    DeltaError,
    apply_incremental_snapshot,
    read_snapshot_tensors,
    write_full_snapshot,
    write_incremental_snapshot,
)
from deltasync.protocol import DEFAULT_COMPRESSION_FORMAT

CODECS = ["arc_v2", "zkd_sparse_v1", "zkd_sparse_v2"]


def _moved(old: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    new = {}
    for k, v in old.items():
        n = v.clone()
        flat = n.view(-1)
        idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 50),), generator=g)
        flat[idx] = (flat[idx].float() * 1.01 + 1e-3).to(n.dtype)
        new[k] = n
    return new


@pytest.fixture
def base_and_new(checkpoint_factory):
    base = checkpoint_factory("qwen3", "bfloat16")
    return base, _moved(read_snapshot_tensors(base), seed=1)


def test_reference_decoder_reads_our_arc_v2(base_and_new, tmp_path):
    from fireworks_delta_compression import delta_decompress_dict_from_file

    base, new = base_and_new
    delta = write_incremental_snapshot(base, new, tmp_path / "delta")
    decoded = delta_decompress_dict_from_file(
        src=read_snapshot_tensors(base), diff_file=str(delta / "model.safetensors"), compression_format="arc_v2"
    )
    assert decoded.keys() == new.keys() and all(torch.equal(decoded[k], new[k]) for k in new)


def test_we_read_the_reference_encoders_arc_v2(base_and_new, tmp_path):
    from fireworks_delta_compression import delta_compress_dicts_to_file

    base, new = base_and_new
    (tmp_path / "theirs").mkdir()
    delta_compress_dicts_to_file(
        src=read_snapshot_tensors(base),
        dst=new,
        diff_file=str(tmp_path / "theirs" / "model.safetensors"),
        compression_format="arc_v2",
    )
    with pytest.raises(DeltaError, match="delta.json"):  # no integrity digests: refused unless asked for
        apply_incremental_snapshot(base, tmp_path / "theirs", tmp_path / "applied", compression_format="arc_v2")
    out = apply_incremental_snapshot(
        base, tmp_path / "theirs", tmp_path / "applied", compression_format="arc_v2", require_digests=False
    )
    got = read_snapshot_tensors(out)
    assert all(torch.equal(got[k], new[k]) for k in new)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("fault", ["flipped_byte", "truncated", "wrong_base", "missing_tensor"])
def test_bad_delta_is_refused_and_nothing_is_published(base_and_new, tmp_path, fault, codec):
    base, new = base_and_new
    delta = write_incremental_snapshot(base, new, tmp_path / "delta", compression_format=codec)
    shard = delta / "model.safetensors"
    apply_to = base
    if fault == "flipped_byte":
        raw = bytearray(shard.read_bytes())
        raw[-10] ^= 0xFF
        shard.write_bytes(bytes(raw))
    elif fault == "truncated":
        shard.write_bytes(shard.read_bytes()[:-100])
    elif fault == "wrong_base":
        apply_to = write_full_snapshot(_moved(read_snapshot_tensors(base), seed=2), base, tmp_path / "other")
    else:
        from safetensors import safe_open
        from safetensors.torch import load_file, save_file

        with safe_open(str(shard), framework="pt") as f:
            meta = f.metadata()
        d = load_file(str(shard))
        d.pop(sorted(d)[0])
        save_file(d, str(shard), metadata=meta)
    with pytest.raises(DeltaError):
        apply_incremental_snapshot(apply_to, delta, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / ".staging" / "out.tmp").exists()


def test_writer_refuses_shape_or_dtype_change(base_and_new, tmp_path):
    base, new = base_and_new
    k = sorted(new)[0]
    with pytest.raises(DeltaError, match=k):
        write_incremental_snapshot(base, {**new, k: new[k].float()}, tmp_path / "d1")
    with pytest.raises(DeltaError, match="lacks"):
        write_incremental_snapshot(base, {**new, "extra.weight": torch.zeros(2)}, tmp_path / "d2")
    assert not any((tmp_path / ".staging").iterdir())  # nothing half-written left in the staging namespace


def test_a_float32_held_tensor_of_a_bf16_checkpoint_round_trips_full_and_delta(checkpoint_factory, tmp_path):
    """Issue 85 point 3: DeepSeekMoE's selection bias stored bf16 in the served checkpoint (``save_pretrained`` of a
    model cast to bf16) is held float32 by both models; the trainer's float32 bias (moved by load balancing) passes
    the full snapshot's spec check, a delta against the bf16 base encodes the float32 widening and decodes to the
    trainer's bits on the host and in place against the float32 parameter. Any other tensor widened to float32 is
    still refused (it would be cast on load)."""
    from deltasync import SnapshotError, apply_delta_in_place, tensor_spec, verify_full_snapshot

    bias, gate = "model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.1.mlp.gate.weight"
    g = torch.Generator().manual_seed(0)
    old = {bias: torch.randn(8, generator=g).bfloat16(), gate: torch.randn(8, 16, generator=g).bfloat16()}
    base = write_full_snapshot(old, checkpoint_factory("qwen3", "bfloat16"), tmp_path / "base")
    new = {bias: old[bias].float() + 1e-3, gate: (old[gate].float() * 1.01).bfloat16()}  # 1e-3: not a bf16 value
    assert not torch.equal(new[bias].bfloat16().float(), new[bias])
    full = write_full_snapshot(new, base, tmp_path / "full")
    verify_full_snapshot(full, tensor_spec(base), check_data=True)
    widened = write_full_snapshot({**new, gate: new[gate].float()}, base, tmp_path / "widened")
    with pytest.raises(SnapshotError, match=gate):
        verify_full_snapshot(widened, tensor_spec(base))
    delta = write_incremental_snapshot(base, new, tmp_path / "delta")
    decoded = read_snapshot_tensors(apply_incremental_snapshot(base, delta, tmp_path / "decoded"))
    assert all(decoded[k].dtype == new[k].dtype and torch.equal(decoded[k], new[k]) for k in new)
    live = {bias: old[bias].float(), gate: old[gate].clone()}  # what vLLM's model holds
    apply_delta_in_place(delta, live, commit=True)
    assert all(torch.equal(live[k], new[k]) for k in new)


def _cli(*args):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "deltasync", *map(str, args)], capture_output=True, text=True)


def test_cli_diff_apply_verify_inspect_and_refusal(base_and_new, tmp_path):
    import json

    base, new = base_and_new
    newdir = write_full_snapshot(new, base, tmp_path / "new")
    r = _cli("diff", "--base", base, "--new", newdir, "--out", tmp_path / "delta")
    assert r.returncode == 0 and "% of the full snapshot" in r.stdout
    r = _cli("apply", "--base", base, "--delta", tmp_path / "delta", "--out", tmp_path / "applied")
    assert r.returncode == 0
    got = read_snapshot_tensors(tmp_path / "applied")
    assert all(torch.equal(got[k], new[k]) for k in new)
    assert _cli("verify", tmp_path / "delta").stdout.startswith("ok: incremental")
    info = json.loads(_cli("inspect", tmp_path / "applied").stdout)
    assert info["kind"] == "full" and info["tensors"] == len(new)
    shard = tmp_path / "delta" / "model.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-5] ^= 0x55
    shard.write_bytes(bytes(raw))
    r = _cli("apply", "--base", base, "--delta", tmp_path / "delta", "--out", tmp_path / "bad")
    assert r.returncode == 1 and r.stderr.startswith("deltasync: ") and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "bad").exists()
    r = _cli("verify", tmp_path)
    assert r.returncode == 1 and "neither a full snapshot" in r.stderr


def _hashes(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    import hashlib

    return {
        k: hashlib.sha256(v.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest() for k, v in tensors.items()
    }


def _chain_round_trip(base: str, tmp_path, remote: str, codec: str, n: int = 30) -> list[str]:
    """Trainer: SnapshotWriter (full every 10) -> publish_dir(remote); replica: fetch_dir -> apply onto what it
    holds. Every step's decoded weights must hash equal to the trainer's."""
    from deltasync import SnapshotWriter, fetch_dir, publish_dir

    writer = SnapshotWriter(
        tmp_path / "out", base, full_every=10, compression_format=codec, cache_dir=tmp_path / "cache"
    )
    held = base
    weights = read_snapshot_tensors(base)
    kinds = []
    for step in range(n):
        weights = _moved(weights, seed=100 + step)
        info = writer.write(f"s{step:03d}", weights)
        url = publish_dir(info.path, f"{remote}/s{step:03d}")
        got = fetch_dir(url, tmp_path / "replica" / "incoming" / info.identity)
        if info.kind == "incremental":
            got = apply_incremental_snapshot(held, got, tmp_path / "replica" / "held" / info.identity)
        assert _hashes(read_snapshot_tensors(got)) == _hashes(weights), f"step {step}"
        writer.confirm(info)
        held = got
        kinds.append(info.kind)
    assert kinds.count("full") == 3 and kinds[0] == "full"
    return kinds


@pytest.mark.parametrize("codec", CODECS)
def test_chain_of_30_snapshots_round_trips_bit_exact_local(checkpoint_factory, tmp_path, codec):
    _chain_round_trip(checkpoint_factory("qwen3", "bfloat16"), tmp_path, str(tmp_path / "bucket"), codec)


# S3 is the same storage path for every format: the default format in the default run, the others
# `make test-extended` (each format's chain round-trips locally above)
@pytest.mark.parametrize(
    "codec",
    [c if c == DEFAULT_COMPRESSION_FORMAT else pytest.param(c, marks=pytest.mark.extended) for c in CODECS],
)
def test_chain_of_30_snapshots_round_trips_bit_exact_s3(checkpoint_factory, tmp_path, s3_server, codec):
    _chain_round_trip(checkpoint_factory("qwen3", "bfloat16"), tmp_path, f"{s3_server}/{codec}", codec)


def test_incomplete_upload_is_refused(checkpoint_factory, tmp_path, s3_server):
    from deltasync import SnapshotError, fetch_dir, publish_dir
    from deltasync.storage import COMPLETE_MARKER, filesystem_for

    url = publish_dir(checkpoint_factory("qwen3", "bfloat16"), f"{s3_server}/partial")
    filesystem_for(url).rm_file(f"{url}/{COMPLETE_MARKER}")  # as if the uploader died before the commit marker
    with pytest.raises(SnapshotError, match="not a completely published"):
        fetch_dir(url, tmp_path / "got")
    assert not (tmp_path / "got").exists()


def test_sparse_codec_is_denser_than_arc_v2(checkpoint_factory, tmp_path):
    """On layer-sized bf16 tensors with ~2% of the elements changed (an RL step); on tiny tensors it falls back to
    the plain XOR stream, so it is never much larger."""
    g = torch.Generator().manual_seed(3)
    old = {f"w{i}": torch.randn(1024, 1024, generator=g).to(torch.bfloat16) for i in range(2)}
    base = write_full_snapshot(old, checkpoint_factory("qwen3", "bfloat16"), tmp_path / "base")
    new = _moved(old, seed=4)
    a = write_incremental_snapshot(base, new, tmp_path / "a", compression_format="arc_v2")
    b = write_incremental_snapshot(base, new, tmp_path / "b", compression_format="zkd_sparse_v1")
    c = write_incremental_snapshot(base, new, tmp_path / "c", compression_format="zkd_sparse_v2")
    size = lambda d: (d / "model.safetensors").stat().st_size
    assert size(c) < size(b) < 0.75 * size(a)
    for d in (b, c):
        got = read_snapshot_tensors(apply_incremental_snapshot(base, d, tmp_path / f"applied_{d.name}"))
        assert all(torch.equal(got[k], new[k]) for k in new)


def test_sparse_v2_round_trips_every_word_pattern():
    """Differences of either sign, wrapping ones (0x0001 -> 0xFFFF), sign flips, odd byte lengths (byte words),
    empty and tiny tensors, dense and sparse payloads: decode(base, encode(base, new)) == new."""
    import numpy as np

    from deltasync.codecs import sparse_v2_decode, sparse_v2_encode

    rng = np.random.default_rng(0)
    cases = [(b"", b""), (b"\x01\x02\x03", b"\x01\x05\x03"), (bytes(4 << 20), bytes([255]) * (4 << 20))]
    for size, every in ((1 << 20, 50), (1 << 20, 2), (3 << 19, 7)):
        a = rng.integers(0, 1 << 16, size=size, dtype=np.uint16)
        b = a.copy()
        b[::every] += rng.integers(1, 1 << 16, size=b[::every].size, dtype=np.uint16)
        cases.append((a.tobytes(), b.tobytes()))
        cases.append((a.tobytes()[:-1], b.tobytes()[:-1]))  # odd length: byte words
    for base, new in cases:
        assert bytes(sparse_v2_decode(base, sparse_v2_encode(base, new))) == new
    with pytest.raises(ValueError, match="bytes"):
        sparse_v2_decode(cases[-2][0][:-2], sparse_v2_encode(cases[-2][0], cases[-2][1]))


@pytest.mark.parametrize("codec", CODECS)
def test_delta_applied_in_place_equals_the_new_weights(base_and_new, tmp_path, codec):
    """Issue 17 point 1: ``apply_delta_in_place`` decodes against live tensors, one at a time; the stage pass
    writes nothing, the commit pass leaves exactly the new bits (and names the tensors whose bits changed); the
    digest of the per-tensor SHA-256 it verified is the full snapshot's weights digest."""
    from deltasync import apply_delta_in_place, checksums_digest, weights_digest

    base, new = base_and_new
    delta = write_incremental_snapshot(base, new, tmp_path / "delta", compression_format=codec)
    live = read_snapshot_tensors(base)
    before = {k: v.clone() for k, v in live.items()}
    staged = apply_delta_in_place(delta, live)
    assert all(torch.equal(live[k], before[k]) for k in live) and staged["changed"] == []
    done = apply_delta_in_place(delta, live, commit=True)
    assert all(torch.equal(live[k], new[k]) for k in new)
    assert set(done["changed"]) == {k for k in new if not torch.equal(new[k], before[k])}
    full = write_full_snapshot(new, base, tmp_path / "full")
    assert checksums_digest(done["sha256"]) == weights_digest(full)


@pytest.mark.parametrize("fault", ["wrong_base", "flipped_byte", "missing_tensor", "non_finite"])
def test_delta_in_place_refusal_leaves_the_live_tensors_bit_for_bit(base_and_new, tmp_path, fault):
    """A refused stage pass writes nothing. Negative control (wrong base): the codec alone decodes the payload onto
    the wrong base without complaint — only the per-tensor checksum refuses it. A NaN in the new weights is refused
    as a full snapshot's would be, unless ``allow_non_finite``."""
    from deltasync import apply_delta_in_place
    from deltasync.codecs import arc_v2_decode
    from deltasync.snapshot import _raw

    base, new = base_and_new
    if fault == "non_finite":
        new = dict(new)
        name = sorted(new)[-1]
        new[name] = new[name].clone()
        new[name].view(-1)[3] = float("nan")
    delta = write_incremental_snapshot(base, new, tmp_path / "delta")
    live = read_snapshot_tensors(base)
    if fault == "non_finite":
        assert apply_delta_in_place(delta, {k: v.clone() for k, v in live.items()}, allow_non_finite=True)
    if fault == "wrong_base":
        live = _moved(live, seed=9)
        from safetensors import safe_open

        with safe_open(str(delta / "model.safetensors"), framework="pt") as f:
            name = f.keys()[0]
            assert len(arc_v2_decode(_raw(live[name]), _raw(f.get_tensor(name)))) == live[name].nbytes  # no error
    elif fault == "flipped_byte":
        raw = bytearray((delta / "model.safetensors").read_bytes())
        raw[-10] ^= 0xFF
        (delta / "model.safetensors").write_bytes(bytes(raw))
    else:
        live.pop(next(iter(live)))
    before = {k: v.clone() for k, v in live.items()}
    with pytest.raises(DeltaError):
        apply_delta_in_place(delta, live)
    assert all(torch.equal(live[k], before[k]) for k in live)


_BOMB_RSS = r"""
import resource, sys, zstandard
from deltasync.codecs import arc_v2_decode, sparse_decode, sparse_v2_decode
size = 1 << 30  # the frame declares (and really holds) 1 GiB of zeros: ~33 KB compressed
co = zstandard.ZstdCompressor(level=1).compressobj(size=size)
zeros = bytes(64 << 20)
payload = b"".join([co.compress(zeros) for _ in range(size // len(zeros))] + [co.flush()])
base = bytes(4096)
start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    if sys.argv[1] == "stock":  # what arc_v2 decoding did before: max_output_size is ignored for sized frames
        out = zstandard.ZstdDecompressor().decompress(payload, max_output_size=len(base) + 1)
        print("accepted", len(out))
        raise SystemExit
    elif sys.argv[1] == "arc_v2":
        arc_v2_decode(base, payload)
    elif sys.argv[1] == "zkd_sparse_v2":
        sparse_v2_decode(base, b"\x00" + payload)
    else:
        sparse_decode(base, b"\x00" + payload)
    print("accepted")
except Exception as e:
    print("refused", type(e).__name__)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - start) // 1024)  # MiB added to the peak
"""


@pytest.mark.timeout(120)
def test_decompression_bomb_is_refused_within_bounded_memory():
    """Issue 21 row 4: a tiny zstd frame declaring 1 GiB is refused after at most ~1 MiB of output (streaming
    ``bounded_decompress``, peak RSS growth < 64 MiB); negative control: zstandard's own
    ``decompress(max_output_size=4097)`` returns the whole declared gigabyte."""
    import subprocess
    import sys

    def run(mode):
        out = subprocess.run([sys.executable, "-c", _BOMB_RSS, mode], capture_output=True, text=True, timeout=100)
        assert out.returncode == 0, out.stderr
        verdict, grown = out.stdout.split("\n")[:2]
        return verdict, int(grown)

    out = subprocess.run([sys.executable, "-c", _BOMB_RSS, "stock"], capture_output=True, text=True, timeout=100)
    assert out.stdout.split("\n")[0] == f"accepted {1 << 30}", out  # 1 GiB materialized despite a 4097-byte limit
    for mode in ("arc_v2", "zkd_sparse_v1", "zkd_sparse_v2"):
        verdict, grown = run(mode)
        assert verdict.startswith("refused ValueError") and grown < 64, (mode, verdict, grown)


def test_staging_is_a_separate_namespace(base_and_new, tmp_path):
    """Issue 21 point 2: snapshots are assembled and retired under ``.staging/`` beside them, a name no identity can
    take, so publishing (or replacing) ``col`` never touches another snapshot's directory, whatever its name."""
    from deltasync import validate_identity
    from deltasync.ledger import IdentityError

    base, new = base_and_new
    root = tmp_path / "root"
    (root / "col.tmp").mkdir(parents=True)  # an unrelated directory with a would-be staging name survives
    (root / "col.tmp" / "keep").write_text("x")
    write_incremental_snapshot(base, new, root / "col")
    write_full_snapshot(new, base, root / "col")  # replaced: the old one is retired inside .staging
    assert sorted(p.name for p in root.iterdir()) == [".staging", "col", "col.tmp"]
    assert (root / "col.tmp" / "keep").read_text() == "x" and not any((root / ".staging").iterdir())
    for name in (".staging", "col.tmp", "col.old"):
        with pytest.raises(IdentityError):
            validate_identity(name)


def test_lora_adapter_snapshots_full_and_delta_round_trip(tmp_path):
    """A PEFT adapter directory as a snapshot: the full one keeps PEFT's layout (``adapter_config.json`` +
    ``adapter_model.safetensors``, what vLLM's LoRA loader reads) with the checksummed spec; an arc_v2 delta of the
    next version decodes onto it bit for bit into the same layout. Refused: a config that is not LoRA's, and assets
    that are neither a model nor an adapter."""
    import json

    from deltasync import SnapshotError, verify_adapter_config, verify_full_snapshot
    from deltasync.snapshot import tensor_spec

    g = torch.Generator().manual_seed(0)
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    v1 = {
        f"{prefix}.lora_A.weight": torch.randn(4, 64, generator=g).bfloat16(),
        f"{prefix}.lora_B.weight": torch.randn(64, 4, generator=g).bfloat16(),
    }
    assets = tmp_path / "peft"
    assets.mkdir()
    (assets / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]})
    )
    full = write_full_snapshot(v1, assets, tmp_path / "a-v1")
    assert sorted(p.name for p in full.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "model.weight.spec.json",
    ]
    assert verify_adapter_config(full)["r"] == 4
    verify_full_snapshot(full, tensor_spec(full), check_data=True)
    v2 = _moved(v1, seed=2)
    delta = write_incremental_snapshot(full, v2, tmp_path / "a-v2")
    assert sorted(p.name for p in delta.iterdir()) == ["adapter_model.safetensors", "delta.json"]
    out = apply_incremental_snapshot(full, delta, tmp_path / "a-v2-full")
    verify_adapter_config(out)
    got = read_snapshot_tensors(out)
    assert got.keys() == v2.keys() and all(torch.equal(got[k], v2[k]) for k in v2)
    for bad in (
        {"peft_type": "IA3", "r": 4, "lora_alpha": 8},
        {"peft_type": "LORA", "r": 0, "lora_alpha": 8},
        {"peft_type": "LORA", "r": 4},
    ):
        (full / "adapter_config.json").write_text(json.dumps(bad))
        with pytest.raises(SnapshotError, match="not a LoRA config"):
            verify_adapter_config(full)
    (full / "adapter_config.json").unlink()
    with pytest.raises(SnapshotError, match="adapter_config.json"):
        verify_adapter_config(full)
    with pytest.raises(FileNotFoundError, match="neither config.json nor adapter_config.json"):
        write_full_snapshot(v1, tmp_path / "a-v2", tmp_path / "nowhere")


def test_a_state_dir_is_one_replicas_alone(checkpoint_factory, tmp_path):
    """Two replicas on one state directory (e.g. both left on the default under a shared snapshot root) would
    overwrite each other's ledger: the second is refused, naming the holder, until the first gives it up. The lock
    is an OS file lock, so a crashed holder frees it too."""
    from deltasync import HotLoadConfig, Replica, StateDirInUseError

    ckpt = checkpoint_factory("qwen3", "bfloat16")
    (tmp_path / "snapshots").mkdir()
    cfg = HotLoadConfig(snapshot_root=str(tmp_path / "snapshots"))
    first = Replica(None, cfg, ckpt, replica_id="host:8001")  # no engine is touched before a signal
    with pytest.raises(StateDirInUseError, match="host:8001"):
        Replica(None, cfg, ckpt, replica_id="host:8002")
    other = Replica(None, cfg.model_copy(update={"state_dir": str(tmp_path / "state2")}), ckpt, replica_id="h:2")
    assert other.status()["replicas"][0]["replica"] == "h:2"
    first.close()
    Replica(None, cfg, ckpt, replica_id="host:8002").close()
    other.close()


def test_fetch_resumes_an_interrupted_download_and_checks_every_file(
    checkpoint_factory, tmp_path, s3_server, monkeypatch
):
    """A download that breaks off mid-file (here: the connection drops after 3 chunks) leaves its partial files in
    the staging namespace and publishes nothing; the next fetch reads only the missing bytes (ranged reads) and the
    result is the published directory, every file checked against its SHA-256. A file replaced in the bucket after
    publication (same size, other bytes) is refused; a marker naming a path outside the snapshot is refused; a marker
    of the earlier name → size format is still read."""
    import hashlib
    import json

    from deltasync import SnapshotError, fetch_dir, publish_dir, storage
    from deltasync.storage import COMPLETE_MARKER, filesystem_for

    monkeypatch.setattr(storage, "CHUNK_BYTES", 64 << 10)
    src = checkpoint_factory("qwen3", "bfloat16")
    url = publish_dir(src, f"{s3_server}/resumable")
    total = sum(p.stat().st_size for p in Path(src).iterdir() if p.is_file())
    seen: list[int] = []

    def dropping(n: int) -> None:
        seen.append(n)
        if len(seen) == 3:
            raise ConnectionError("connection reset by peer")

    with pytest.raises(ConnectionError):
        fetch_dir(url, tmp_path / "got", max_concurrency=1, progress=dropping)
    assert not (tmp_path / "got").exists()
    partial = sum(p.stat().st_size for p in (tmp_path / ".staging" / "got.part").iterdir())
    assert 0 < partial < total
    resumed: list[int] = []
    got = fetch_dir(url, tmp_path / "got", max_concurrency=3, progress=resumed.append)
    assert sum(resumed) == total - partial
    digest = lambda d: {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(d).iterdir()) if p.is_file()
    }
    assert digest(got) == digest(src)

    fs = filesystem_for(url)
    body = bytearray(fs.cat_file(f"{url}/model.safetensors"))
    body[-5] ^= 0x01
    fs.pipe_file(f"{url}/model.safetensors", bytes(body))  # replaced after publication: same size
    with pytest.raises(SnapshotError, match="SHA-256"):
        fetch_dir(url, tmp_path / "got2")
    assert not (tmp_path / "got2").exists()

    marker = json.loads(fs.cat_file(f"{url}/{COMPLETE_MARKER}"))
    fs.pipe_file(f"{url}/{COMPLETE_MARKER}", json.dumps({**marker, "../escape": {"size": 1}}).encode())
    with pytest.raises(SnapshotError, match="not a file of the snapshot"):
        fetch_dir(url, tmp_path / "got3")
    old = {name: m["size"] for name, m in marker.items() if name != "model.safetensors"}
    fs.pipe_file(f"{url}/{COMPLETE_MARKER}", json.dumps(old).encode())  # an earlier version's marker
    assert sorted(p.name for p in fetch_dir(url, tmp_path / "got4").iterdir()) == sorted(old)


_FULL_DISK_SCRIPT = r"""
import errno, os, sys, torch
from pathlib import Path
from deltasync import SnapshotWriter, read_snapshot_tensors, verify_full_snapshot, tensor_spec
ckpt, disk = sys.argv[1], Path(sys.argv[2])
tensors = {k: v + 1 for k, v in read_snapshot_tensors(ckpt).items()}
writer = SnapshotWriter(disk / "root", ckpt, cache_dir=disk / "cache")
size = sum(f.stat().st_size for f in Path(ckpt).iterdir() if f.is_file())
st = os.statvfs(disk)
(disk / "filler").write_bytes(b"\0" * (st.f_bavail * st.f_frsize - size - size // 2))  # room for one copy only
try:
    writer.write("s1", tensors)
    raise SystemExit("the write did not fail")
except OSError as e:
    assert e.errno == errno.ENOSPC, e
assert not (disk / "root" / "s1").exists() and not (disk / "cache" / "s1").exists()
assert not any((disk / "root" / ".staging").iterdir())
(disk / "filler").unlink()
info = writer.write("s1", tensors)  # the retry works
verify_full_snapshot(info.path, tensor_spec(ckpt), check_data=True)
print("FULL-DISK-OK")
"""


@pytest.mark.timeout(300)
def test_snapshot_writer_on_a_full_disk_publishes_nothing_and_retries(checkpoint_factory, tmp_path):
    """Held-out row 6, trainer side: a snapshot root that fills up mid-write (a real 4 MiB tmpfs in a private mount
    namespace) raises ENOSPC and leaves nothing under the identity (the old copytree left half a snapshot, and the
    retry failed with FileExistsError); with space again the same write succeeds and verifies."""
    import subprocess
    import sys

    from zerokld_testing.servers import tmpfs_prefix

    ckpt = checkpoint_factory("qwen3", "bfloat16")
    disk = tmp_path / "disk"
    disk.mkdir()
    out = subprocess.run(
        [*tmpfs_prefix(disk, "4m"), sys.executable, "-c", _FULL_DISK_SCRIPT, ckpt, str(disk)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert "FULL-DISK-OK" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]


def test_an_adler32_preserving_edit_is_refused_at_restore(tmp_path):
    """Held-out row 5, the restart path: :func:`verify_full_snapshot` (what a restore runs on the replica's copy)
    refuses bytes edited to keep every Adler-32, by their SHA-256."""
    import zlib

    from safetensors.torch import load_file, save_file

    from deltasync import SnapshotError, tensor_spec, verify_full_snapshot

    g = torch.Generator().manual_seed(0)
    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "config.json").write_text("{}")
    snap = write_full_snapshot({"w": torch.randn(64, 64, generator=g)}, assets, tmp_path / "s")
    verify_full_snapshot(snap, tensor_spec(snap), check_data=True)
    t = load_file(str(snap / "model.safetensors"))
    raw = bytearray(t["w"].numpy().tobytes())
    adler = zlib.adler32(raw)
    i = next(i for i in range(len(raw) - 2) if raw[i] < 255 and raw[i + 1] >= 2 and raw[i + 2] < 255)
    raw[i] += 1
    raw[i + 1] -= 2
    raw[i + 2] += 1
    assert zlib.adler32(raw) == adler
    save_file(
        {"w": torch.frombuffer(raw, dtype=torch.float32).reshape(64, 64).clone()}, str(snap / "model.safetensors")
    )
    with pytest.raises(SnapshotError, match="sha256"):
        verify_full_snapshot(snap, tensor_spec(snap), check_data=True)
