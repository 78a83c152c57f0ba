"""The measured figures of README.md and docs/, generated from ``benchmarks/results/``.

Each generated block sits between ``<!-- results: NAME -->`` and ``<!-- /results -->`` in a Markdown file; this module
renders block ``NAME`` from the committed results (JSON, and the countdown demo's ``metrics.jsonl`` through
:func:`examples.countdown.summary.run_summary`), each table with the machine (CPU model, ISA flags, threads, or the GPU)
and the date it was measured; and the tables some benchmarks write beside their JSON (``kld_table*.md``,
``layouts_*.md``, ``async_rl*.md``: :data:`STANDALONE`). ``python -m benchmarks.tables`` (``make results-tables``)
rewrites every block; ``--check`` changes nothing and exits 1 naming the blocks that differ
(``tests/test_results_tables.py`` runs it, so a committed table always equals what this script makes of the committed
results). Ratios are speeds: zerokld ÷ stock, > 1 is faster.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

from examples.countdown.summary import run_summary, summary_markdown

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
#: the Markdown files that hold generated blocks
FILES = (
    "README.md",
    "docs/index.md",
    "docs/demo.md",
    "docs/benchmarks.md",
    "docs/hotload.md",
    "docs/deepseek.md",
    "docs/layouts.md",
)
BLOCK = re.compile(r"(<!-- results: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /results -->)", re.S)
#: the countdown demo's results, one folder per CPU path (``make demo`` on that machine; ``run.json``: date, machine)
DEMOS = (
    ("AMX (Intel Xeon)", "make_demo_xeon_amx_cpu2"),
    ("AVX-512 + AVX512-BF16, no AMX (AMD EPYC)", "make_demo_amd_epyc_avx512bf16_cpu2"),
    ("AVX2, emulated on that AMD EPYC (`make demo CPU_PATH=avx2`)", "make_demo_avx2_emulated_amd_epyc_cpu2"),
)
PRECISIONS = (("bf16", "bf16"), ("fp8_block", "FP8 rollouts"))


def _load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _x(r: float | None) -> str:
    return "—" if r is None else f"{r:.2f}x"


def _g(v: float) -> str:
    return "0" if v == 0 else f"{v:.3g}"


def _date(d: dict) -> str:
    return d.get("date") or d.get("machine", {}).get("date") or "date not recorded"


def _model(cpu_model: str) -> str:
    """A CPU model name for a table cell (``"Intel(R) Xeon(R) Processor"`` -> ``"Intel Xeon"``)."""
    return cpu_model.replace("(R)", "").replace(" Processor", "")


def machine(d: dict) -> str:
    """``"<CPU model>, <ISA flags>, <cores> cores / <threads> threads, torch <version>, <date>"`` of a result's
    ``machine`` (:func:`shared_numerics.machine.machine_facts`) and ``date``; a GPU result: its ``device``, torch and
    Triton versions."""
    if "device" in d:
        return f"{d['device']}, torch {d['torch']}, Triton {d['triton']}, {_date(d)}"
    m = d["machine"]
    if not m.get("cpu_model"):  # an early result: the CPU model and ISA were not recorded
        return f"CPU model not recorded, {m.get('cores', '?')} cores, {_date(d)}"
    isa = " + ".join(f.upper().replace("_", "-") for f in m["isa_flags"]) or "no AVX2"
    return f"{m['cpu_model']}, {isa}, {m['cores']} cores / {m['threads']} threads, torch {m['torch']}, {_date(d)}"


def machine_short(d: dict) -> str:
    """``"<CPU model> (<widest ISA path>), <cores> cores, <date>"``: :func:`machine` for a table cell."""
    if "device" in d:
        return f"{d['device']}, {_date(d)}"
    m = d["machine"]
    flags = set(m.get("isa_flags") or ())
    isa = "AMX" if "amx_bf16" in flags else "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "x86-64"
    return f"{_model(m.get('cpu_model', 'CPU'))} ({isa}), {m.get('cores', '?')} cores, {_date(d)}"


def _demo(folder: str) -> dict:
    """``{precision: {"zerokld"|"stock": run_summary or None}}`` and ``run`` (``run.json``) of one demo folder."""
    out: dict = {"run": json.loads((RESULTS / folder / "run.json").read_text())}
    for prec, _ in PRECISIONS:
        out[prec] = {}
        for side in ("zerokld", "stock"):
            path = RESULTS / folder / prec / f"{side}_metrics.jsonl"
            out[prec][side] = run_summary(path.parent, side) if path.exists() else None
    return out


def _speed(s: dict) -> float | None:
    """stock's seconds per RL step (steps 2..) ÷ zerokld's."""
    z, st = s.get("zerokld"), s.get("stock")
    if not z or not st or not z["step_seconds"] or not st["step_seconds"]:
        return None
    return (st["step_seconds"] / (st["steps"] - 1)) / (z["step_seconds"] / (z["steps"] - 1))


def demo_paths() -> list[str]:
    """docs/demo.md: ``make demo`` on each CPU path."""
    rows = [
        (
            "| CPU path | k3 zerokld / stock, bf16 | zerokld tokens different, bf16 | RL step, bf16 (zerokld ÷ stock) "
            "| FP8 rollouts: k3 zerokld / stock | RL step, FP8 | machine, date |"
        ),
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label, folder in DEMOS:
        d = _demo(folder)
        b, f = d["bf16"], d["fp8_block"]
        fp8_stock = _g(f["stock"]["k3_mean"]) if f["stock"] else "stock not run (vLLM-CPU's block FP8 needs AMX)"
        rows.append(
            f"| {label} | {_g(b['zerokld']['k3_mean'])} / {_g(b['stock']['k3_mean'])} "
            f"| {b['zerokld']['tokens_bitwise_different']} of {b['zerokld']['num_tokens']} | {_x(_speed(b))} "
            f"| {_g(f['zerokld']['k3_mean'])} / {fp8_stock} | {_x(_speed(f))} "
            f"| {d['run']['machine'].split(',')[0]}, {d['run']['date']} (`benchmarks/results/{folder}/`) |"
        )
    return rows


def demo_runs() -> list[str]:
    """docs/demo.md: the four runs on the first CPU path (the demo's own summary table)."""
    label, folder = DEMOS[0]
    d = _demo(folder)
    summaries = {
        f"{side}, {name}": d[prec][side] for prec, name in PRECISIONS for side in ("zerokld", "stock") if d[prec][side]
    }
    table = [line for line in summary_markdown(summaries, []).splitlines() if line.startswith("|")]
    per_step = ", ".join(
        f"{name}: zerokld {d[prec]['zerokld']['step_seconds']:.1f} s, stock {d[prec]['stock']['step_seconds']:.1f} s "
        f"(**{_x(_speed(d[prec]))}** stock's speed)"
        for prec, name in PRECISIONS
        if d[prec]["stock"]
    )
    return [
        f"Measured on {d['run']['machine']}, {d['run']['date']} (`benchmarks/results/{folder}/`).",
        "",
        *table,
        "",
        f"RL steps 2–{d['bf16']['zerokld']['steps']}, wall-clock: {per_step}.",
    ]


def _kld_largest() -> tuple[float, dict[str, float]]:
    """``(zerokld's largest k3, stock's largest k3 per serving kind: a dtype or "FP8")`` over the KL tables."""
    ours, stock = 0.0, {}
    for path in sorted(RESULTS.glob("kld_table*.json")):
        for r in json.loads(path.read_text())["rows"]:
            if r.get("k3") is None:
                continue
            if r.get("engine", "").startswith("zerokld"):
                ours = max(ours, r["k3"])
            elif r.get("engine", "").startswith("stock"):
                key = "FP8" if r.get("fp8") else r.get("dtype", "")
                stock[key] = max(stock.get(key, 0.0), r["k3"])
    return ours, stock


def headline(docs: str = "docs/") -> list[str]:
    """README.md (``docs`` the docs folder, relative to the page) and the site's front page (``""``): the headline
    figures."""
    label, folder = DEMOS[0]
    d = _demo(folder)
    b, f = d["bf16"], d["fp8_block"]
    roll = _load("rollout_overhead_h1024_xeon_amx.json")
    trainer = _load("trainer_h1024_xeon_amx_cpu2.json")
    gemm = _load("gpu_gemm_h200.json")
    ds_trainer, ds_roll = (_load(name) for name in DEEPSEEK_SPEED)
    decode, prefill = _gemm_range(gemm, ("M1", "M8", "M64")), _gemm_range(gemm, ("M4096",))
    ours_kl, stock_kl = _kld_largest()
    cpu = _model(d["run"]["machine"].split(",")[0])
    return [
        "| what | zerokld | stock | measured on |",
        "| --- | --- | --- | --- |",
        (
            f"| countdown GRPO, bf16: k3, tokens different | {_g(b['zerokld']['k3_mean'])}, "
            f"{b['zerokld']['tokens_bitwise_different']} of {b['zerokld']['num_tokens']} "
            f"| {_g(b['stock']['k3_mean'])}, "
            f"{b['stock']['tokens_bitwise_different']} of {b['stock']['num_tokens']} "
            f"| {cpu}, {d['run']['date']} ([demo]({docs}demo.md)) |"
        ),
        f"| countdown GRPO, bf16: RL step speed | {_x(_speed(b))} stock | 1x | same run |",
        (
            f"| countdown GRPO, FP8 rollouts: k3; RL step speed | {_g(f['zerokld']['k3_mean'])}; {_x(_speed(f))} stock "
            f"| {_g(f['stock']['k3_mean'])}; 1x | same run |"
        ),
        (
            f"| KL per model and dtype (largest k3 over `benchmarks/results/kld_table_*`) | {_g(ours_kl)} "
            f"| {', '.join(f'{k} {_g(v)}' for k, v in sorted(stock_kl.items()))} | [benchmarks]({docs}benchmarks.md) |"
        ),
        (
            f"| rollout tokens/s at hidden 1024, batch 32, bf16 (prefill / decode) "
            f"| {_x(roll['runs']['bfloat16']['ratio_prefill'])} / {_x(roll['runs']['bfloat16']['ratio_decode'])} stock "
            f"| 1x | {machine_short(roll)} |"
        ),
        (
            f"| trainer forward + backward at hidden 1024 (bf16 / fp32) "
            f"| {_x(trainer['runs']['bfloat16']['speed_ours_over_stock'])} / "
            f"{_x(trainer['runs']['float32']['speed_ours_over_stock'])} stock | 1x | {machine_short(trainer)} |"
        ),
        (
            f"| DeepSeek-V3 at hidden 1024, bf16: rollout prefill / decode; trainer forward + backward "
            f"| {_x(ds_roll['runs']['bfloat16'].get('ratio_prefill'))} / "
            f"{_x(ds_roll['runs']['bfloat16'].get('ratio_decode'))}; "
            f"{_x(ds_trainer['runs']['bfloat16']['speed_ours_over_stock'])} stock | 1x | {machine_short(ds_roll)} "
            f"([DeepSeek]({docs}deepseek.md)) |"
        ),
        (
            f"| GPU linear (Triton), Qwen3-8B shapes, M = 1-64 / 4096, kernel time | {decode} / {prefill} cuBLAS "
            f"| 1x | {machine_short(gemm)} ([GPU]({docs}benchmarks.md#gpu)) |"
        ),
    ]


def _gemm_range(d: dict, ms: tuple[str, ...]) -> str:
    """``"lo-hix"``: the CUDA-graph speed ratios of ``gpu_gemm`` over its shapes at the given M."""
    r = [c["default"][m]["graph"]["stock_over_ours"] for c in d["shapes"].values() for m in ms]
    return f"{min(r):.2f}-{max(r):.2f}x"


def gpu_gemm() -> list[str]:
    """docs/benchmarks.md: the decode-size GEMMs (``benchmarks/gpu_gemm.py``), stock ÷ ours."""
    name = "gpu_gemm_h200.json"
    d = _load(name)
    ms = next(iter(d["shapes"].values()))["default"]
    bits = [
        r["rows_equal_persistent"]
        for c in d["shapes"].values()
        for v in c["variants"].values()
        for r in v.values()
        if isinstance(r, dict) and "rows_equal_persistent" in r
    ]
    rows = [
        (
            f"Measured on {machine(d)} (`benchmarks/results/{name}`), bf16, cuBLAS `F.linear` time ÷ the Triton "
            "GEMM's: kernel time (20 calls replayed in one CUDA graph, as vLLM's decode replays them) and, in "
            "brackets, one eager call with the host's launch cost:"
        ),
        "",
        "| K → N | " + " | ".join(m.replace("M", "M = ") for m in ms) + " |",
        "| --- |" + " --- |" * len(ms),
    ]
    for shape, c in d["shapes"].items():
        cells = [
            f"{_x(r['graph']['stock_over_ours'])} ({_x(r['eager']['stock_over_ours'])})" for r in c["default"].values()
        ]
        rows.append(f"| {shape.replace('->', ' → ')} | " + " | ".join(cells) + " |")
    fp8 = d.get("fp8_configs") or {}
    pc = {k.split()[1]: v for k, v in fp8.items() if k.startswith("per_channel")}
    if pc:
        rows += [
            "",
            "FP8 GEMM (per-channel scales, 4096 → 12288, e4m3 codes in) against `torch._scaled_mm`, kernel time: "
            + ", ".join(f"{m.replace('M', 'M = ')} {_x(r['stock_ms'] / r['default_ms'])}" for m, r in pc.items())
            + ".",
        ]
    rows += [
        "",
        f"Decode-size variants checked bitwise against the persistent path's rows: {sum(bits)} of {len(bits)} equal.",
    ]
    return rows


def cpu_benchmarks() -> list[str]:
    """docs/benchmarks.md: the CPU benchmarks, zerokld ÷ stock per case, one table per results file."""
    sections: list[tuple[str, str, list[tuple[str, float | None]]]] = []
    for name, what in (
        ("rollout_overhead_h1024_xeon_amx.json", "batch 32"),
        ("rollout_overhead_h1024_ctx1024_xeon_amx.json", "8 sequences at a 1024-token context"),
    ):
        cases = []
        for dt, r in _load(name)["runs"].items():
            cases += [(f"{what}, {dt}: prefill tokens/s", r["ratio_prefill"])]
            cases += [(f"{what}, {dt}: decode tokens/s", r["ratio_decode"])]
        sections.append(("rollout_overhead.py", name, cases))
    for name, model in (
        ("trainer_h1024_xeon_amx_cpu2.json", "Qwen3"),
        (DEEPSEEK_SPEED[0], "DeepSeek-V3"),
    ):
        cases = [
            (f"{model}, {dt}: TorchTitan forward + backward", r["speed_ours_over_stock"])
            for dt, r in _load(name)["runs"].items()
        ]
        sections.append(("trainer.py", name, cases))
    for name, what in (
        ("streaming_h1024_xeon_amx_cpu2.json", "dense"),
        ("streaming_lora_h1024_xeon_amx_cpu2.json", "LoRA rank 32"),
        ("streaming_fp8_h1024_xeon_amx_cpu2.json", "FP8 QAT"),
        ("streaming_moe_h1024_xeon_amx_cpu2.json", "MoE 8 experts top-2"),
    ):
        cases = []
        for dt, r in _load(name)["runs"].items():
            cases.append((f"{what}, {dt}: streamed ÷ batched `train_step`", r["streamed_over_rl_step"]))
            if r.get("rl_step_over_stock_rl_step") is not None:
                cases.append(
                    (f"{what}, {dt}: zerokld's `train_step` ÷ TorchTitan stock's", r["rl_step_over_stock_rl_step"])
                )
        sections.append(("streaming.py", name, cases))
    name = "attention_xeon_amx_cpu2.json"
    cases = [
        (f"{r['shape']} shape, {r['dtype']}, {r['case'].replace('_', ' ')} vs ATen SDPA", r["speed_ours_over_stock"])
        for r in _load(name)["rows"]
        if r.get("speed_ours_over_stock") is not None
    ]
    sections.append(("attention.py", name, cases))
    for name in LINEAR:
        cases = [
            (
                f"{r['dtype']} {r['direction'].replace('_', ' + ')}, M = {r['M']}, {r['K']} → {r['N']}",
                r["speed_ours_over_stock"],
            )
            for r in _load(name)["rows"]
        ]
        sections.append(("linear.py", name, cases))
    rows: list[str] = []
    for i, (bench, name, cases) in enumerate(sections):
        if i == 0 or sections[i - 1][0] != bench:
            rows += [f"### `{bench}`", ""]
        rows += [f"`benchmarks/results/{name}`: {machine(_load(name))}", ""]
        rows += ["| case | zerokld ÷ stock |", "| --- | --- |"]
        rows += [f"| {case} | {_x(ratio)} |" for case, ratio in cases]
        rows.append("")
    return rows[:-1]


def op_dispatch() -> list[str]:
    """docs/benchmarks.md: what calling a CPU kernel costs by each path (``benchmarks/op_dispatch.py``)."""
    rows = []
    for path in sorted(RESULTS.glob("op_dispatch_*.json")):
        d = json.loads(path.read_text())
        rows += [
            f"`benchmarks/results/{path.name}`: {machine(d)}; median microseconds per call of one GEMM:",
            "",
            (
                "| dtype, M x K → N | ctypes (before) | `cpu_ops.gemm_abt` (now) | via the dispatcher | `custom_op` "
                "| `F.linear` |"
            ),
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for r in d["rows"]:
            t = r["median_us"]
            rows.append(
                f"| {r['dtype']}, {r['M']} x {r['K']} → {r['N']} | {t['ctypes']:.1f} | {t['zerokld']:.1f} "
                f"| {t['zerokld_op']:.1f} | {t['custom_op']:.1f} | {t['F.linear']:.1f} |"
            )
        rows.append("")
    return rows[:-1]


def gpu_benchmarks() -> list[str]:
    """docs/benchmarks.md: the GPU kernels, stock ÷ ours (a speed: > 1 is faster)."""
    name = "gpu_kernels_h200.json"
    d = _load(name)
    rows = [
        f"Measured on {machine(d)} (`benchmarks/results/{name}`), Qwen3-8B shapes, bf16, zerokld ÷ stock:",
        "",
        "| case | speed |",
        "| --- | --- |",
    ]
    for op, cases in d["ops"].items():
        for m, r in cases.items():
            if isinstance(r, dict) and r.get("stock_over_ours") is not None:
                rows.append(f"| `{op}`, {m.replace('M', 'M = ')} | {_x(r['stock_over_ours'])} |")
    for key in ("attention", "layer", "layer_cublas"):
        for case, r in (d.get(key) or {}).items():
            if isinstance(r, dict) and r.get("stock_over_ours") is not None:
                rows.append(f"| {key.replace('_', ' ')}: {case.replace('_', ' ')} | {_x(r['stock_over_ours'])} |")
    return rows


def k_block_tree() -> list[str]:
    """docs/benchmarks.md: the TP-aligned K-block tree, block by block vs fused vs stock
    (``benchmarks/k_block_tree.py``)."""
    name = "k_block_tree_amd_epyc_avx2_cpu2.json"
    d = _load(name)
    rows = [
        f"`benchmarks/results/{name}`: {machine(d)}, float32; median seconds, forward / forward + backward:",
        "",
        (
            "| M x K → N, `tp_k_block` | block by block (before) | fused (now) | stock `F.linear` | now ÷ before | "
            "stock ÷ now | same bits |"
        ),
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in d["rows"]:
        rows.append(
            f"| {r['M']} x {r['K']} → {r['N']}, {r['k_block']} "
            f"| {r['blocks_forward_s']:.3f} / {r['blocks_forward_backward_s']:.3f} "
            f"| {r['fused_forward_s']:.3f} / {r['fused_forward_backward_s']:.3f} "
            f"| {r['stock_forward_s']:.3f} / {r['stock_forward_backward_s']:.3f} "
            f"| {_x(r['forward_speedup_vs_blocks'])} / {_x(r['forward_backward_speedup_vs_blocks'])} "
            f"| {_x(r['forward_fused_over_stock_speed'])} / {_x(r['forward_backward_fused_over_stock_speed'])} "
            f"| {'yes' if r['fused_bits_equal_blocks'] else 'NO'} |"
        )
    return rows


def delta_codecs() -> list[str]:
    """docs/hotload.md: the delta codecs at model scale (``benchmarks/delta.py``)."""
    name = "delta.json"
    d = _load(name)
    ms = d["model_scale_codecs"]
    rows = [
        (
            f"{ms['tensors']} tensors, {ms['model_bytes'] / 2**20:.0f} MiB of bf16, {ms['density']:.1%} of the "
            f"elements changed, {ms['threads']} threads; {machine(d)} (`benchmarks/results/{name}`, "
            "`model_scale_codecs`):"
        ),
        "",
        "| codec | bytes per changed element | encode GB/s | in-place stage GB/s | in-place commit GB/s |",
        "| --- | --- | --- | --- | --- |",
    ]
    for codec, r in ms.items():
        if isinstance(r, dict):
            rows.append(
                f"| `{codec}` | {r['bytes_per_changed']:.2f} | {r['encode_gbps']:.2f} | {r['in_place_stage_gbps']:.2f} "
                f"| {r['in_place_commit_gbps']:.2f} |"
            )
    return rows


#: DeepSeek-V3 at issue 55's size: the (trainer, rollout) results, measured on one machine
DEEPSEEK_SPEED = ("trainer_deepseek_v3_h1024_xeon_avx512_cpu2.json", "rollout_deepseek_v3_h1024_xeon_avx512_cpu2.json")
#: ``benchmarks/linear.py`` runs in docs/benchmarks.md: bf16 on AMX, and on AVX-512 without AMX (the float32 kernel's
#: bf16 reads)
LINEAR = ("linear_xeon_amx_cpu2.json", "linear_xeon_avx512_cpu2.json")


def deepseek_speed() -> list[str]:
    """docs/deepseek.md: DeepSeek-V3 at issue 55's size, trainer and rollout."""
    trainer, roll = DEEPSEEK_SPEED
    t, r = _load(trainer), _load(roll)
    rows = [
        f"Measured on {machine(t)} (`benchmarks/results/{trainer}`, `{roll}`):",
        "",
        "| what | dtype | zerokld | stock | zerokld ÷ stock |",
        "| --- | --- | --- | --- | --- |",
    ]
    for dt, run in t["runs"].items():
        rows.append(
            f"| trainer forward + backward (s) | {dt} | {run['zerokld']['median_s']:.1f} "
            f"| {run['stock']['median_s']:.1f} | {_x(run['speed_ours_over_stock'])} |"
        )
    for dt, run in r["runs"].items():
        for phase in ("prefill", "decode"):
            stock = run["stock"]
            cell = "not measured (see below)" if "unavailable" in stock else f"{stock[f'{phase}_median']:.0f}"
            rows.append(
                f"| rollout {phase} tokens/s | {dt} | {run['zerokld'][f'{phase}_median']:.0f} "
                f"| {cell} | {_x(run.get(f'ratio_{phase}'))} |"
            )
    return rows


#: ``benchmarks/dsa.py``'s run in docs/deepseek.md: GLM-5's DeepSeek Sparse Attention ÷ the same weights as dense MLA
DSA_SPEED = "dsa_glm5_h1024_xeon_avx512_cpu2.json"


def dsa_speed() -> list[str]:
    """docs/deepseek.md: GLM-5's DSA served by zerokld ÷ the same checkpoint served as dense MLA (stock vLLM-CPU has
    no DSA)."""
    r = _load(DSA_SPEED)
    a = r["args"]
    what = (
        f"Measured on {machine(r)} (`benchmarks/results/{DSA_SPEED}`; {a['batch']} sequences, prompts of "
        f"{a['prompt_len']} tokens, decode at a {a['decode_context']}-token context, `index_topk` {a['index_topk']}, "
        f"{a['index_heads']} indexer heads of 128):"
    )
    rows = [
        what,
        "",
        "| what | dtype | DSA (zerokld) | dense MLA (zerokld) | DSA ÷ dense | stock vLLM-CPU |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for dt, run in r["runs"].items():
        for phase in ("prefill", "decode"):
            rows.append(
                f"| {phase} tokens/s | {dt} | {run['dsa'][f'{phase}_median']:.1f} "
                f"| {run['dense'][f'{phase}_median']:.1f} | {_x(run[f'ratio_{phase}'])} | no DSA |"
            )
    return rows


#: block name → its renderer (a list of Markdown lines)
#: ``benchmarks/gated_deltanet.py``'s run in docs/benchmarks.md
GATED_DELTANET = "gated_deltanet_amd_epyc_avx512bf16_cpu2.json"


def gated_deltanet() -> list[str]:
    """docs/benchmarks.md: the Gated DeltaNet token mixer, ours ÷ stock vLLM-CPU's kernels (medians)."""
    d = _load(GATED_DELTANET)
    a = d["args"]

    def ms(v: list[float]) -> str:
        return f"{sorted(v)[len(v) // 2] * 1e3:.2f}"

    p, dec, tr = d["prefill_s"], d["decode_step_s"], d["train_s"]
    cases = [
        (f"prefill {a['prompt_len']} tokens, recurrence", p["stock"], p["ours"], d["prefill_ratio"]),
        ("prefill, conv + gates + L2 + recurrence", p["stock_core"], p["ours_core"], d["prefill_core_ratio"]),
        (f"decode step of {a['batch']}, recurrence", dec["stock"], dec["ours"], d["decode_ratio"]),
        ("decode step, conv + gates + L2 + recurrence", dec["stock_core"], dec["ours_core"], d["decode_core_ratio"]),
        (
            f"trainer forward + backward, {a['train_len']} tokens (stock: HF `torch_chunk_gated_delta_rule`)",
            tr["hf_torch_chunk"],
            tr["ours"],
            d["train_ratio"],
        ),
    ]
    head = (
        f"Measured on {machine(d)} (`benchmarks/results/{GATED_DELTANET}`; {a['heads']} + {a['heads']} heads of "
        f"{a['head_dim']}, bf16, medians of {a['repeats']}; stock's conv on its packed weight: {d['stock_cpp_conv']}):"
    )
    return [
        head,
        "",
        "| case | stock (ms) | zerokld (ms) | zerokld ÷ stock |",
        "| --- | --- | --- | --- |",
        *(f"| {case} | {ms(stock)} | {ms(ours)} | {_x(ratio)} |" for case, stock, ours, ratio in cases),
        f"| our gated RMSNorm, prefill (stock's not timed) | — | {ms(p['ours_norm'])} | — |",
    ]


RENDERERS: dict[str, Callable[[], list[str]]] = {
    "headline": headline,
    "headline-site": lambda: headline(""),
    "demo-paths": demo_paths,
    "demo-runs": demo_runs,
    "cpu-benchmarks": cpu_benchmarks,
    "gpu-benchmarks": gpu_benchmarks,
    "gpu-gemm": gpu_gemm,
    "delta-codecs": delta_codecs,
    "k-block-tree": k_block_tree,
    "op-dispatch": op_dispatch,
    "kld-tables": lambda: _embedded("kld_table*.json"),
    "layouts-table": lambda: _embedded("layouts_*.json"),
    "deepseek-speed": deepseek_speed,
    "dsa-speed": dsa_speed,
    "gated-deltanet": gated_deltanet,
}


#: results whose own benchmark writes a Markdown table beside the JSON (``<stem>.md``): JSON glob → module whose
#: ``markdown(result)`` makes it
STANDALONE = {
    "kld_table*.json": "benchmarks.kld_table",
    "layouts_*.json": "benchmarks.layouts",
    "async_rl*.json": "benchmarks.async_rl",
}


def standalone_tables() -> dict[Path, str]:
    """``{<stem>.md path: the Markdown its benchmark's markdown() makes of <stem>.json}`` for :data:`STANDALONE`."""
    import importlib

    out = {}
    for pattern, module in STANDALONE.items():
        markdown = importlib.import_module(module).markdown
        for path in sorted(RESULTS.glob(pattern)):
            out[path.with_suffix(".md")] = markdown(json.loads(path.read_text()))
    return out


def _embedded(pattern: str) -> list[str]:
    """The standalone tables of ``pattern`` for a docs page: each one's title a ``###`` heading, its source named."""
    rows: list[str] = []
    for path, text in standalone_tables().items():
        if not path.with_suffix(".json").match(pattern):
            continue
        lines = text.rstrip("\n").splitlines()
        title, body = lines[0].lstrip("# ").strip(), "\n".join(lines[1:]).strip("\n").splitlines()
        rows += [f"### {title}", "", f"`benchmarks/results/{path.with_suffix('.json').name}`:", "", *body, ""]
    return rows[:-1]


def render_file(text: str) -> tuple[str, list[str]]:
    """``(new text, names of the blocks that changed)``.

    Raises:
        KeyError: a block names no renderer."""
    changed: list[str] = []

    def one(m: re.Match) -> str:
        name = m.group("name")
        body = "\n".join(RENDERERS[name]()) + "\n"
        if body != m.group("body"):
            changed.append(name)
        return m.group(1) + body + m.group(4)

    return BLOCK.sub(one, text), changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a committed block differs")
    args = ap.parse_args(argv)
    stale = []
    for rel in FILES:
        path = ROOT / rel
        new, changed = render_file(path.read_text())
        stale += [f"{rel}: {name}" for name in changed]
        if changed and not args.check:
            path.write_text(new)
    for path, text in standalone_tables().items():
        if not path.exists() or path.read_text() != text:
            stale.append(str(path.relative_to(ROOT)))
            if not args.check:
                path.write_text(text)
    if stale:
        print(("stale: " if args.check else "rewrote: ") + ", ".join(stale))
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
