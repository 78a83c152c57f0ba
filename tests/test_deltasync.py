"""Snapshot protocol: arc_v2 interop with the public reference implementation (PyPI ``fireworks-delta-compression``)
in both directions, and refusals that publish nothing."""
from __future__ import annotations

import pytest
import torch

from deltasync import (
    DeltaError, apply_incremental_snapshot, read_snapshot_tensors, write_full_snapshot, write_incremental_snapshot,
)


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
    decoded = delta_decompress_dict_from_file(src=read_snapshot_tensors(base), diff_file=str(delta /
                                              "model.safetensors"), compression_format="arc_v2")
    assert decoded.keys() == new.keys() and all(torch.equal(decoded[k], new[k]) for k in new)


def test_we_read_the_reference_encoders_arc_v2(base_and_new, tmp_path):
    from fireworks_delta_compression import delta_compress_dicts_to_file

    base, new = base_and_new
    (tmp_path / "theirs").mkdir()
    delta_compress_dicts_to_file(src=read_snapshot_tensors(base), dst=new,
                                 diff_file=str(tmp_path / "theirs" / "model.safetensors"), compression_format="arc_v2")
    out = apply_incremental_snapshot(base, tmp_path / "theirs", tmp_path / "applied", compression_format="arc_v2")
    got = read_snapshot_tensors(out)
    assert all(torch.equal(got[k], new[k]) for k in new)


@pytest.mark.parametrize("fault", ["flipped_byte", "truncated", "wrong_base", "missing_tensor"])
def test_bad_delta_is_refused_and_nothing_is_published(base_and_new, tmp_path, fault):
    base, new = base_and_new
    delta = write_incremental_snapshot(base, new, tmp_path / "delta")
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
        from safetensors.torch import load_file, save_file
        from safetensors import safe_open

        with safe_open(str(shard), framework="pt") as f:
            meta = f.metadata()
        d = load_file(str(shard))
        d.pop(sorted(d)[0])
        save_file(d, str(shard), metadata=meta)
    with pytest.raises(DeltaError):
        apply_incremental_snapshot(apply_to, delta, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()


def test_writer_refuses_shape_or_dtype_change(base_and_new, tmp_path):
    base, new = base_and_new
    k = sorted(new)[0]
    with pytest.raises(DeltaError, match=k):
        write_incremental_snapshot(base, {**new, k: new[k].float()}, tmp_path / "d1")
    with pytest.raises(DeltaError, match="lacks"):
        write_incremental_snapshot(base, {**new, "extra.weight": torch.zeros(2)}, tmp_path / "d2")
    assert not (tmp_path / "d1.tmp").exists() and not (tmp_path / "d2.tmp").exists()


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
