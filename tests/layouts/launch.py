"""The layout tests' shared runs: TorchTitan's trainer at a layout under ``torchrun`` (gloo on loopback,
:mod:`zerokld_testing.titan_tp`), and the comparisons of one run with another (log-probs, gradients, weights; bit for
bit or to rounding)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import torch

from zerokld_testing.controls import stock_differs

K_BLOCK = 16


def trainer_tp(
    tmp_path,
    ckpt,
    dtype,
    tp,
    seqs,
    lens,
    batch_invariant=True,
    tp_k_block=K_BLOCK,
    train_step=False,
    nproc=None,
    fused=False,
    ep=1,
    split=False,
    routes=None,
    **layout,
):
    """TorchTitan's trainer at ``tensor_parallel_degree`` ``tp`` on ``nproc`` ranks (default ``tp``; more: FSDP over
    the rest) under ``torchrun`` (gloo on loopback): ``{"logprobs"}`` of ``seqs`` (``RLTrainer.forward_logprobs``),
    and with ``train_step`` the ``loss`` of one ``rl_step`` and the log-probs ``after`` it
    (:mod:`zerokld_testing.titan_tp`); ``fused``: the fused lm_head log-probs and loss; ``ep``: TorchTitan's
    ``expert_parallel_degree``; ``split``: each data-parallel rank scores its own share of ``seqs``; ``routes``:
    replayed (R3); ``layout``: more keys of the spec (pipeline parallelism, ``streaming``, ``steps``, ``weights``:
    :mod:`zerokld_testing.titan_tp`)."""
    nproc = nproc or max(tp, ep, layout.get("pp", 1), layout.get("cp", 1))
    extra = "_".join(f"{k}{v}" for k, v in sorted(layout.items()))
    name = f"tp{tp}_ep{ep}_n{nproc}_{batch_invariant}_{fused}_{split}_{routes is not None}_{extra}"
    spec, out = tmp_path / f"{name}.json", tmp_path / f"{name}.pt"
    spec.write_text(
        json.dumps(
            {
                "checkpoint": ckpt,
                "dtype": dtype,
                "tp": tp,
                "batch_invariant": batch_invariant,
                "tp_k_block": tp_k_block if batch_invariant else None,
                "sequences": seqs,
                "prompt_lengths": lens,
                "train_step": train_step,
                "fused": fused,
                "ep": ep,
                "split": split,
                "routed_experts": routes,
                **layout,
            }
        )
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        "--module",
        "zerokld_testing.titan_tp",
        str(spec),
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    if layout.get("fails"):  # the run must fail: its stderr
        assert proc.returncode != 0
        return proc.stderr
    assert proc.returncode == 0, failure_excerpt(proc.stderr)
    return torch.load(out)


def failure_excerpt(stderr: str) -> str:
    """The part of a failed ``torchrun``'s stderr that names the cause: from the first fatal error, C++ ``terminate``
    or Python traceback of a rank (a rank that aborts prints its loaded extension modules after its stack, which
    would otherwise fill the tail), plus the launcher's summary at the end."""
    markers = ("Fatal Python error", "terminate called", "Traceback (most recent call last)")
    starts = [i for i in (stderr.find(m) for m in markers) if i >= 0]
    head = stderr[min(starts) : min(starts) + 4000] if starts else ""
    return head + "\n...\n" + stderr[-1500:]


def check_trains_like(tmp_path, ckpt, seqs, ref: dict, *layouts: dict, exact: bool = False) -> list[dict]:
    """Two streamed float32 steps at each of ``layouts`` update every weight as at ``ref`` (``trainer_tp`` keys
    ``tp``, ``ep``, ...): the log-probs before them equal; ``exact``: every gradient, the gradient norms and every
    weight bit for bit, else to rounding (each parameter's update within 1e-3, relative; the gradient norms within
    1e-5). Returns every run's results, ``ref``'s first."""
    import glob

    from safetensors.torch import load_file

    lens = [len(s) // 2 for s in seqs]
    spec = dict(train_step=True, weights=True, steps=2, streaming=True, grads=exact)
    runs = [
        trainer_tp(tmp_path, ckpt, "float32", run.pop("tp"), seqs, lens, **spec, **run)
        for run in (dict(ref), *(dict(layout) for layout in layouts))
    ]
    start = {}
    for f in glob.glob(f"{ckpt}/*.safetensors"):
        start.update(load_file(f))
    one = runs[0]
    assert len(one["weights"]) > 20
    for name, w1 in one["weights"].items():
        assert (w1 - start[name].float()).norm() > 0, name  # every weight moved
    for two in runs[1:]:
        assert torch.equal(torch.cat(one["logprobs"]), torch.cat(two["logprobs"]))
        assert len(one["grad_norm"]) == len(two["grad_norm"]) == 2
        assert one["weights"].keys() == two["weights"].keys()
        if exact:  # the gradients themselves (AdamW's first steps move a weight by about lr * sign(g))
            assert one["grads"].keys() == two["grads"].keys() and len(one["grads"]) > 10
            differ = [k for k, g in one["grads"].items() if not torch.equal(g, two["grads"][k])]
            assert not differ, f"gradients differ: {' '.join(differ)}"
            assert one["grad_norm"] == two["grad_norm"]
            differ = [k for k, w in one["weights"].items() if not torch.equal(w, two["weights"][k])]
            assert not differ, f"weights differ: {' '.join(differ)}"
            continue
        for a, b in zip(one["grad_norm"], two["grad_norm"], strict=True):
            assert abs(a - b) <= 1e-5 * a, (one["grad_norm"], two["grad_norm"])
        off = {}
        for name, w1 in one["weights"].items():
            update = (w1 - start[name].float()).norm()
            off[name] = float((two["weights"][name] - w1).norm() / update)
        assert max(off.values()) < 1e-3, sorted(off.items(), key=lambda kv: -kv[1])[:3]
    return runs


def same_run(a: dict, b: dict, keys=("logprobs", "step_logprobs", "after"), weights: bool = True) -> dict:
    """Which of two runs' stacked log-probs (and HF weights, when both have them and ``weights``) are the same
    bits."""
    out = {}
    for k in keys:
        assert len(a[k]) == len(b[k]) > 0
        out[k] = torch.equal(torch.cat(a[k]), torch.cat(b[k]))
    if weights and "weights" in a and "weights" in b:
        assert a["weights"].keys() == b["weights"].keys()
        out["weights"] = all(torch.equal(a["weights"][n], b["weights"][n]) for n in a["weights"])
    return out


def pipeline_checkpoint(tmp_path, family="qwen3"):
    from zerokld_testing import TinyModelSpec, make_tiny_checkpoint

    layers = 4 if family == "qwen3" else 2  # Interleaved1F1B at PP 2: four stages of one layer
    spec = TinyModelSpec(family=family, num_hidden_layers=layers)
    return str(make_tiny_checkpoint(tmp_path / f"{family}_pp", spec, seed=1, dtype="float32"))


def check_trains_like_one_rank(tmp_path, family: str, name: str, ckpt: str | None = None, **layout) -> None:
    """Two ranks (each half the batch) at ``layout`` against one rank: two streamed steps, then ``rl_step``; stock
    at the same layout against stock on one rank (the control). ``ckpt``: this checkpoint instead of ``family``'s."""
    from zerokld_testing import random_prompts

    ckpt = ckpt or pipeline_checkpoint(tmp_path, family)
    seqs = random_prompts(6, seed=47, lo=12, hi=60)
    lens = [len(s) // 2 for s in seqs]
    common = dict(train_step=True, weights=True, steps=2)

    def run(nproc=None, batch_invariant=True, **spec):
        return trainer_tp(
            tmp_path, ckpt, "float32", 1, seqs, lens, batch_invariant, None, nproc=nproc, **common, **spec
        )

    one = run(streaming=True)
    assert not torch.equal(torch.cat(one["after"]), torch.cat(one["logprobs"]))  # the steps moved the weights
    two = run(nproc=2, split=True, streaming=True, **layout)
    if "ep" in layout:
        assert two["expert_parallel_sizes"] == [layout["ep"]]  # every zerokld MoE block ran expert-parallel
    same = same_run(one, two)
    assert all(same.values()), same
    assert len(one["grad_norm"]) == len(two["grad_norm"]) == 2 and one["grad_norm"] == two["grad_norm"]
    assert all(same_run(one, run(nproc=2, split=True, **layout)).values())  # rl_step: forward_backward + optim_step
    stock_one = run(batch_invariant=False)
    stock_two = run(batch_invariant=False, nproc=2, split=True, **layout)
    stock_differs(
        not same_run(stock_one, stock_two)["weights"], f"TorchTitan's trainer at {name} vs one rank", "the prompts"
    )
