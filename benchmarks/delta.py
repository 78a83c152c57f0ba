"""Delta snapshots on consecutive checkpoints of a real countdown RL run: size, encode/apply throughput, hot-swap.

1. Runs the countdown example (zerokld numerics, bf16, ``--full-every 1 --keep-snapshots``), so every step's weights
   are a full HF snapshot on disk (unless ``--run-dir`` points at such a run already).
2. For each pair of consecutive snapshots and each registered codec: delta bytes ÷ full bytes, bytes per changed
   element, encode and apply throughput in GB/s of model bytes (``write_incremental_snapshot`` /
   ``apply_incremental_snapshot``, files included), element density.
3. Hot-swap pause (``reload_weights`` + prefix-cache reset on a live engine) vs starting a new engine on the new
   weights.
4. Model scale (512 MiB of bf16 matrices, ~2% of the elements moved by 1-2 units in the last place): bytes per
   changed element, encode, in-place stage and commit (what a replica's workers run), host decode; GB/s of model
   bytes. ``--codecs-only`` runs this step alone and merges it into an existing ``--out``.

Medians go to ``--out`` (JSON). Usage: ``python -m benchmarks.delta --out benchmarks/results/delta.json``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from itertools import pairwise
from pathlib import Path

from shared_numerics.machine import machine_facts

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def _layer_scale(codecs: list[str], density: float, n: int = 4096) -> dict:
    """Codecs alone on one LLM-sized bf16 matrix (``n x n``) with the run's median element density: the tiny
    model's tensors are too small for throughput to mean much (per-tensor and file overheads dominate)."""
    import torch

    from zerokld_plugins import get_codec, resolve

    g = torch.Generator().manual_seed(0)
    w = (torch.randn(n, n, generator=g) * 0.02).to(torch.bfloat16)
    mask = torch.rand(n, n, generator=g) < density
    new = torch.where(mask, (w.float() * (1 + 0.01 * torch.randn(n, n, generator=g))).to(torch.bfloat16), w)
    changed = int((w.view(torch.int16) != new.view(torch.int16)).sum())
    a, b = w.view(torch.uint8).numpy().tobytes(), new.view(torch.uint8).numpy().tobytes()
    out = {"elements": n * n, "density": changed / (n * n)}
    for c in codecs:
        spec = get_codec(c)
        enc, dec = resolve(spec.encode), resolve(spec.decode)
        t_enc, t_dec = [], []
        for _ in range(3):
            t0 = time.perf_counter()
            payload = enc(a, b)
            t_enc.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            assert dec(a, payload) == b
            t_dec.append(time.perf_counter() - t0)
        out[c] = {
            "ratio": len(payload) / len(b),
            "bytes_per_changed": len(payload) / max(changed, 1),
            "encode_gbps": len(b) / statistics.median(t_enc) / 1e9,
            "decode_gbps": len(b) / statistics.median(t_dec) / 1e9,
        }
    return out


def _model_scale(codecs: list[str], density: float = 0.02, tensors: int = 16, n: int = 4096) -> dict:
    """The snapshot path at ~2% density on ``tensors`` bf16 ``n x n`` matrices (512 MiB by default), files included:
    encode (:func:`deltasync.write_incremental_snapshot`, the trainer), the in-place stage and commit passes
    (:func:`deltasync.apply_delta_in_place`, what a replica's workers run) and the host decode into a full snapshot
    (:func:`deltasync.apply_incremental_snapshot`); GB/s of model bytes. Each step moves ``density`` of the
    elements by +-1 or +-2 units in the last place (:func:`benchmarks.hotload._step`)."""
    import tempfile

    import numpy as np
    import torch

    from deltasync import (
        apply_delta_in_place,
        apply_incremental_snapshot,
        element_density,
        weight_bytes,
        write_full_snapshot,
        write_incremental_snapshot,
    )
    from deltasync.snapshot import ENCODE_THREADS
    from zerokld_testing import make_tokenizer

    from .hotload import _step

    g = torch.Generator().manual_seed(0)
    old = {f"w{i}": (torch.randn(n, n, generator=g) * 0.02).to(torch.bfloat16) for i in range(tensors)}
    new = _step(old, density, np.random.default_rng(0))
    changed, total = element_density(old, new)
    out = {"tensors": tensors, "model_bytes": 2 * total, "density": changed / total, "threads": ENCODE_THREADS}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        assets = tmp / "assets"
        assets.mkdir()
        make_tokenizer(str(assets))
        (assets / "config.json").write_text("{}")
        base = write_full_snapshot(old, assets, tmp / "base")
        for c in codecs:
            t0 = time.perf_counter()
            d = write_incremental_snapshot(base, new, tmp / c, compression_format=c)
            t_enc = time.perf_counter() - t0
            live = {k: v.clone() for k, v in old.items()}
            t0 = time.perf_counter()
            apply_delta_in_place(d, live)
            t_stage = time.perf_counter() - t0
            t0 = time.perf_counter()
            apply_delta_in_place(d, live, commit=True)
            t_commit = time.perf_counter() - t0
            assert all(torch.equal(live[k], new[k]) for k in new)
            t0 = time.perf_counter()
            apply_incremental_snapshot(base, d, tmp / f"{c}_applied")
            t_host = time.perf_counter() - t0
            shutil.rmtree(tmp / f"{c}_applied")
            size, mb = weight_bytes(d), out["model_bytes"]
            out[c] = {
                "ratio": size / mb,
                "bytes_per_changed": size / changed,
                "encode_gbps": mb / t_enc / 1e9,
                "in_place_stage_gbps": mb / t_stage / 1e9,
                "in_place_commit_gbps": mb / t_commit / 1e9,
                "host_apply_gbps": mb / t_host / 1e9,
                "encode_plus_commit_gbps": mb / (t_enc + t_commit) / 1e9,
            }
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/bench/delta.json")
    ap.add_argument("--run-dir", default=None, help="an existing run (<dir>/zerokld/sync/snapshots)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--swaps", type=int, default=5)
    ap.add_argument(
        "--codecs-only",
        action="store_true",
        help="only the model-scale codec figures (no run, no engines); merged into an existing --out",
    )
    ap.add_argument(
        "--lr",
        type=float,
        default=1e-6,
        help="GRPO learning rate of the run (1e-6: typical LLM RL; the "
        "example's 2e-4 moves most bf16 elements of its tiny model every step)",
    )
    args = ap.parse_args(argv)
    from deltasync import (
        apply_incremental_snapshot,
        element_density,
        read_snapshot_tensors,
        weight_bytes,
        write_incremental_snapshot,
    )
    from zerokld_plugins import registered

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.codecs_only:
        result = json.loads(out.read_text()) if out.exists() else {}
        result["model_scale_codecs"] = _model_scale(sorted(registered("codec")))
        out.write_text(json.dumps(result, indent=2))
        print(json.dumps(result["model_scale_codecs"], indent=2))
        return result
    run = Path(args.run_dir) if args.run_dir else Path("runs/bench/delta_run")
    snaps_dir = run / "zerokld" / "sync" / "snapshots"
    if not args.run_dir:
        from examples.countdown.run import main as countdown

        shutil.rmtree(run, ignore_errors=True)
        countdown(
            [
                "--out",
                str(run),
                "--runs",
                "zerokld",
                "--steps",
                str(args.steps),
                "--sft-steps",
                "30",
                "--full-every",
                "1",
                "--keep-snapshots",
                "--lr",
                str(args.lr),
            ]
        )
    snaps = sorted(p for p in snaps_dir.iterdir() if p.is_dir() and not p.name.endswith(".tmp"))
    codecs = sorted(registered("codec"))
    per: dict[str, dict[str, list[float]]] = {
        c: {"ratio": [], "bytes_per_changed": [], "encode_gbps": [], "apply_gbps": []} for c in codecs
    }
    densities = []
    work = out.parent / "delta_work"
    for a, b in pairwise(snaps):
        full = weight_bytes(b)
        changed, total = element_density(read_snapshot_tensors(a), read_snapshot_tensors(b))
        densities.append(changed / total)
        for c in codecs:
            shutil.rmtree(work, ignore_errors=True)
            t0 = time.perf_counter()
            d = write_incremental_snapshot(a, read_snapshot_tensors(b), work / "delta", compression_format=c)
            t_enc = time.perf_counter() - t0
            t0 = time.perf_counter()
            apply_incremental_snapshot(a, d, work / "applied")
            t_app = time.perf_counter() - t0
            size = weight_bytes(d)
            per[c]["ratio"].append(size / full)
            per[c]["bytes_per_changed"].append(size / max(changed, 1))
            per[c]["encode_gbps"].append(full / t_enc / 1e9)
            per[c]["apply_gbps"].append(full / t_app / 1e9)
    shutil.rmtree(work, ignore_errors=True)
    layer = _layer_scale(codecs, statistics.median(densities))
    result = {
        "machine": machine_facts(),
        "args": vars(args),
        "snapshots": len(snaps),
        "model_bytes": weight_bytes(snaps[-1]),
        "density_median": statistics.median(densities),
        "codecs": {c: {k: statistics.median(v) for k, v in m.items()} for c, m in per.items()},
        "layer_scale_codecs": layer,
        "model_scale_codecs": _model_scale(codecs),
    }

    from vllm_plugin.engines import reload_weights, shutdown_llm, start_llm

    restart, swap = [], []
    for i in range(min(args.swaps, len(snaps) - 1)):
        t0 = time.perf_counter()
        llm = start_llm(str(snaps[i]), dtype="bfloat16", max_model_len=256)
        restart.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        reload_weights(llm, str(snaps[i + 1]))
        swap.append(time.perf_counter() - t0)
        shutdown_llm(llm)
    result["hot_swap_seconds_median"] = statistics.median(swap)
    result["engine_restart_seconds_median"] = statistics.median(restart)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
