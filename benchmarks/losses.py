"""RL loss heads: fused vs two-pass vs naive (full logits), time per step and peak memory, JSON out.

The head is what differs between the paths: final hidden states ``[N, H]`` → lm_head ``[V, H]`` → selected-token
log-probs → per-token loss (registered through the ``zerokld`` hooks) → backward to the hidden states and the lm_head
weight. ``naive`` materialises ``[N, V]`` logits; ``fused`` is :func:`shared_numerics.fused_selected_logprobs`;
``two_pass`` runs the fused forward without gradients, takes ``dL/dl`` from the loss, then back-propagates
``sum(dL/dl * l)`` through a second fused forward (the custom-loss path). Each (loss, path, vocab, tokens) runs in
its own subprocess so that its peak RSS (``ru_maxrss``) is its own; time is the median of ``--repeats`` steps after
one warm-up. Usage: ``python -m benchmarks.losses --out runs/bench/losses.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from shared_numerics.machine import machine_facts


def _one(loss_name: str, path: str, vocab: int, tokens: int, hidden: int, repeats: int) -> dict:
    import resource

    import torch

    import shared_numerics as sn
    from benchmarks.timing import wall_times
    from shared_numerics.losses import LossBatch
    from zerokld_plugins import get_loss, resolve

    spec = get_loss(loss_name)
    fn, cfg = resolve(spec.token_loss), resolve(spec.config_schema)()
    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=g).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.05).requires_grad_()
    t = torch.randint(0, vocab, (tokens,), generator=g)
    q = torch.full((tokens,), -float(torch.log(torch.tensor(float(vocab)))))
    adv = torch.randn(tokens, generator=g)
    batch = LossBatch.single(tokens)
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def step():
        h.grad = w.grad = None
        if path == "naive":
            lp = sn.selected_logprobs(sn.linear(h, w), t)
            fn(lp, q, adv, cfg, batch)[0].sum().backward()
        elif path == "fused":
            lp = sn.fused_selected_logprobs(h, w, t)
            fn(lp, q, adv, cfg, batch)[0].sum().backward()
        else:
            with torch.no_grad():
                lp0 = sn.fused_selected_logprobs(h, w, t)
            leaf = lp0.clone().requires_grad_()
            (dl,) = torch.autograd.grad(fn(leaf, q, adv, cfg, batch)[0].sum(), leaf)
            (sn.fused_selected_logprobs(h, w, t) * dl).sum().backward()

    times = wall_times(step, repeats)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "loss": loss_name,
        "path": path,
        "vocab": vocab,
        "tokens": tokens,
        "seconds_median": statistics.median(times),
        "seconds": times,
        "peak_rss_mib": peak / 1024,
        "peak_rss_over_inputs_mib": (peak - base_rss) / 1024,
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/bench/losses.json")
    ap.add_argument("--losses", default="ppo,cross_entropy,dro,gspo")
    ap.add_argument("--vocab", default="32768,131072")
    ap.add_argument("--tokens", default="1024,4096")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--max-naive-gib",
        type=float,
        default=12.0,
        help="skip the naive path where its [tokens, vocab] buffers (~24 bytes per logit: float32 logits, "
        "float64 softmax, gradients) would exceed this",
    )
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:  # child process: one configuration, JSON on stdout
        loss_name, path, vocab, tokens = args.one.split(":")
        print(json.dumps(_one(loss_name, path, int(vocab), int(tokens), args.hidden, args.repeats)))
        return {}
    rows = []
    for loss_name in args.losses.split(","):
        for vocab in map(int, args.vocab.split(",")):
            for tokens in map(int, args.tokens.split(",")):
                for path in ("naive", "fused", "two_pass"):
                    need_gib = tokens * vocab * 24 / 2**30
                    if path == "naive" and need_gib > args.max_naive_gib:
                        rows.append(
                            {
                                "loss": loss_name,
                                "path": path,
                                "vocab": vocab,
                                "tokens": tokens,
                                "skipped": f"needs ~{need_gib:.0f} GiB of logits buffers",
                            }
                        )
                        print(f"{loss_name:14s} V={vocab:6d} N={tokens:5d} naive    skipped (~{need_gib:.0f} GiB)")
                        continue
                    cmd = [
                        sys.executable,
                        "-m",
                        "benchmarks.losses",
                        "--one",
                        f"{loss_name}:{path}:{vocab}:{tokens}",
                        "--hidden",
                        str(args.hidden),
                        "--repeats",
                        str(args.repeats),
                    ]
                    res = subprocess.run(cmd, capture_output=True, text=True)
                    if res.returncode != 0:
                        rows.append(
                            {
                                "loss": loss_name,
                                "path": path,
                                "vocab": vocab,
                                "tokens": tokens,
                                "failed": f"exit {res.returncode}: {res.stderr.strip()[-300:]}",
                            }
                        )
                        print(f"{loss_name:14s} V={vocab:6d} N={tokens:5d} {path:8s} failed (exit {res.returncode})")
                        continue
                    row = json.loads(res.stdout.strip().splitlines()[-1])
                    rows.append(row)
                    print(
                        f"{loss_name:14s} V={vocab:6d} N={tokens:5d} {path:8s} "
                        f"{row['seconds_median'] * 1e3:9.1f} ms  peak {row['peak_rss_mib']:8.0f} MiB",
                        flush=True,
                    )
    summary = []
    for r in rows:
        if r["path"] != "fused" or "seconds_median" not in r:
            continue
        same = {
            x["path"]: x for x in rows if (x["loss"], x["vocab"], x["tokens"]) == (r["loss"], r["vocab"], r["tokens"])
        }
        entry = {"loss": r["loss"], "vocab": r["vocab"], "tokens": r["tokens"]}
        if "seconds_median" in same.get("two_pass", {}):
            entry["fused_over_two_pass_time"] = r["seconds_median"] / same["two_pass"]["seconds_median"]
        if "peak_rss_mib" in same.get("naive", {}):
            entry["fused_over_naive_peak_rss"] = r["peak_rss_mib"] / same["naive"]["peak_rss_mib"]
        summary.append(entry)
    out = {"machine": machine_facts(), "args": vars(args), "rows": rows, "summary": summary}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")
    return out


if __name__ == "__main__":
    main()
