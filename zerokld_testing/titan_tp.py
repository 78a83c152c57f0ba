"""Score sequences with the TorchTitan trainer under tensor parallelism, under ``torchrun`` (one process per rank).

``python -m torch.distributed.run --nproc-per-node 2 -m zerokld_testing.titan_tp IN.json OUT.pt``. ``IN.json`` holds:

* ``checkpoint``, ``dtype``, ``tp`` (TorchTitan's ``tensor_parallel_degree``), ``tp_k_block`` (or null),
  ``batch_invariant``, ``sequences``, ``prompt_lengths``, ``train_step`` (bool), ``fused`` (bool, default false: the
  fused lm_head log-probs and loss), ``ep`` (``expert_parallel_degree``, default 1);
* ``split`` (bool, default false: data-parallel rank ``r`` of ``n`` scores the ``r``-th of ``n`` contiguous blocks of
  the sequences (their concatenation in rank order is the batch) instead of all of them; rank 0 reassembles them in
  order);
* ``routed_experts`` (per sequence a ``[len - 1, MoE layers, top_k]`` nested list to replay, or null), ``repeat``
  (times the forward is run and timed, default 1);
* pipeline parallelism: ``pp`` (``pipeline_parallel_degree``, default 1), ``pp_schedule``, ``pp_microbatch_size``,
  ``pp_microbatches``, ``seq_len`` (:func:`titan_plugin.rl_trainer_config`'s ``pipeline_parallel_*`` and
  ``seq_len``); ``cp`` (``context_parallel_degree``, default 1); ``dp_replicate``
  (``data_parallel_replicate_degree``, default 1: HSDP); ``loss_fn`` (default ``"ppo"``);
* ``streaming`` (bool: the step is ``forward_backward`` + ``optim_step`` instead of ``rl_step``; ``grad_norm``: each
  step's; ``stream_calls``: that many ``forward_backward`` calls on consecutive slices of the rank's rollouts, default
  1), ``steps`` (RL steps, default 1), ``weights`` (bool: also ``weights``, the float32 HF weights after the
  steps), ``grads`` (bool, with ``streaming``: also ``grads``, every parameter's whole gradient before the first
  step's ``optim_step``, by TorchTitan's parameter name), ``exact`` (false: exact accumulation off, the trainer's
  other way: a negative control);
* ``refusal`` (``"train"``: an ``rl_step``, else ``forward_logprobs``, that must be refused: rank 0 writes only
  ``refused``, ``"<NotImplementedError | ValueError>: <message>"``, or ``None``);
* ``score`` (bool, default true): false runs no ``forward_logprobs`` (no ``logprobs`` and ``after``; the rollouts
  are on-policy, no sampler log-probs) — for a layout whose stock run cannot score the batch's padded length.

Rank 0 writes ``OUT.pt`` (``torch.save`` of a dict): ``logprobs``, the per-sequence float32 log-probs of
:meth:`titan_plugin.RLTrainer.forward_logprobs`; with ``train_step``, also ``loss`` of one on-policy
:meth:`~titan_plugin.RLTrainer.rl_step` (advantages +1 / -1 alternating) and ``after``, the log-probs after it;
``seconds``: rank 0's wall clock of each timed forward (and the step), between barriers; ``parallel_dims``: the
data-parallel and cp degrees TorchTitan built (``dp_replicate``, ``dp_shard``, ``cp``).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str]) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    from torchtitan.config import ParallelismConfig

    from shared_numerics import RolloutBatch
    from titan_plugin import cpu_compat
    from titan_plugin.rl import RLTrainer, rl_trainer_config

    cpu_compat.apply()
    spec = json.loads(Path(argv[0]).read_text())
    with tempfile.TemporaryDirectory(prefix="zerokld-titan-tp-") as dump:
        config = rl_trainer_config(
            spec["checkpoint"],
            dump,
            dtype=spec["dtype"],
            batch_invariant=spec["batch_invariant"],
            tp_k_block=spec["tp_k_block"],
            parallelism=ParallelismConfig(
                tensor_parallel_degree=spec["tp"],
                expert_parallel_degree=spec.get("ep", 1),
                pipeline_parallel_degree=spec.get("pp", 1),
                pipeline_parallel_schedule=spec.get("pp_schedule", "1F1B"),
                pipeline_parallel_microbatch_size=spec.get("pp_microbatch_size", 1),
                context_parallel_degree=spec.get("cp", 1),
                data_parallel_replicate_degree=spec.get("dp_replicate", 1),
            ),
            fused=spec.get("fused", False),
            pipeline_parallel_microbatches=spec.get("pp_microbatches"),
            seq_len=spec.get("seq_len"),
            loss_fn=spec.get("loss_fn", "ppo"),
        )
        config.checkpoint.enable = True
        trainer = RLTrainer(config)
        if spec.get("exact") is False:  # the negative control of exact accumulation: its other way
            trainer.exact_accumulation = None
        mine = list(range(len(spec["sequences"])))
        if spec.get("split"):  # by data-parallel rank (EP borrows those ranks; pipeline stages share their rows)
            dp = trainer.parallel_dims.get_optional_mesh("batch")
            dp_rank, dp_size = (0, 1) if dp is None else (dp.get_local_rank(), dp.size())
            mine = [int(i) for i in np.array_split(mine, dp_size)[dp_rank]]  # contiguous: one rank's batch order
        routes = spec.get("routed_experts")
        batch = RolloutBatch(
            [spec["sequences"][i] for i in mine],
            [spec["prompt_lengths"][i] for i in mine],
            routed_experts=None if routes is None else [np.array(routes[i], dtype=np.int16) for i in mine],
        )
        if spec.get("refusal"):  # the call that must be refused (every rank raises alike): its message
            try:
                if spec["refusal"] == "train":
                    trainer.rl_step(RolloutBatch(batch.sequences, batch.prompt_lengths, advantages=[1.0] * len(mine)))
                else:
                    trainer.forward_logprobs(batch)
                result = {"refused": None}
            except (NotImplementedError, ValueError) as e:  # named by the builtin it is refused as
                kind = NotImplementedError if isinstance(e, NotImplementedError) else ValueError
                result = {"refused": f"{kind.__name__}: {e}"}
            if dist.get_rank() == 0:
                torch.save(result, argv[1])
            trainer.close()
            return
        dist.barrier()
        score = spec.get("score", True)
        result: dict = {}
        seconds: dict = {"forward": []}
        # timed `repeat` times when scoring (benchmarks/layouts.py): same batch, same bits; the first's are kept
        for _ in range(spec.get("repeat", 1) if score else 0):
            t0 = time.perf_counter()
            logprobs = trainer.forward_logprobs(batch)
            dist.barrier()
            seconds["forward"].append(time.perf_counter() - t0)
            if "logprobs" not in result:
                result["logprobs"] = [t.detach().float() for t in logprobs]
        ep_sizes = {getattr(m, "expert_parallel_size", None) for m in trainer.model.modules()} - {None}
        if spec.get("train_step"):
            adv = [1.0 if i % 2 == 0 else -1.0 for i in mine]
            rollouts = RolloutBatch(
                batch.sequences,
                batch.prompt_lengths,
                advantages=adv,
                sampler_logprobs=result["logprobs"] if score else None,
                numerics=trainer.numerics,
            )
            t0 = time.perf_counter()
            for _ in range(spec.get("steps", 1)):
                if spec.get("streaming"):
                    calls = np.array_split(np.arange(len(mine)), spec.get("stream_calls", 1))
                    parts = [trainer.forward_backward(rollouts.select(c.tolist())) for c in calls if len(c)]
                    step = {
                        "loss": parts[-1]["loss"],
                        "train_logprobs": [lp for part in parts for lp in part["train_logprobs"]],
                    }
                    if spec.get("grads") and "grads" not in result:  # the first step's, whole
                        result["grads"] = {
                            n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                            for n, p in trainer.model.named_parameters()
                            if p.grad is not None
                        }
                    result.setdefault("grad_norm", []).append(trainer.optim_step()["grad_norm"])
                else:
                    step = trainer.rl_step(rollouts)
            dist.barrier()
            seconds["step"] = [time.perf_counter() - t0]
            result["loss"] = step["loss"]
            result["step_logprobs"] = [t.detach().float() for t in step["train_logprobs"]]
            if score:
                result["after"] = [t.detach().float() for t in trainer.forward_logprobs(batch)]
            if spec.get("weights"):
                result["weights"] = trainer.hf_weights("float32")
        if spec.get("split"):  # every rank's rows, back in the batch's order
            parts = [None] * dist.get_world_size()
            dist.all_gather_object(parts, (mine, result))
            merged = {}
            for key in result:
                if key == "loss":
                    merged[key] = [r["loss"] for _, r in parts]
                    continue
                if key in ("weights", "grads", "grad_norm"):  # every rank's the same (gathered; the whole model's norm)
                    merged[key] = result[key]
                    continue
                rows = {i: t for idx, r in parts for i, t in zip(idx, r[key], strict=True)}
                merged[key] = [rows[i] for i in range(len(spec["sequences"]))]
            result = merged
        result["expert_parallel_sizes"] = sorted(ep_sizes)  # zerokld MoE blocks: the EP size they ran at
        result["exact_accumulation_off"] = trainer.exact_accumulation_off  # None: batched chains
        dims = trainer.parallel_dims
        result["parallel_dims"] = {"dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "cp": dims.cp}
        result["seconds"] = seconds  # rank 0's wall clock, between barriers
        if dist.get_rank() == 0:
            torch.save(result, argv[1])
        # every rank past its last collective before any tears the process group down: a rank destroying its gloo
        # group while a peer still completes a collective with it can abort the peer ("terminate called without an
        # active exception", seen once at TP 2's exit)
        dist.barrier()
        trainer.close()


if __name__ == "__main__":
    main(sys.argv[1:])
