"""Score sequences with the TorchTitan trainer under tensor parallelism, under ``torchrun`` (one process per rank).

``python -m torch.distributed.run --nproc-per-node 2 -m zerokld_testing.titan_tp IN.json OUT.pt``: ``IN.json`` holds
``checkpoint``, ``dtype``, ``tp`` (TorchTitan's ``tensor_parallel_degree``), ``tp_k_block`` (or null),
``batch_invariant``, ``sequences``, ``prompt_lengths``, ``train_step`` (bool), ``fused`` (bool, default false: the
fused lm_head log-probs and loss), ``ep`` (TorchTitan's ``expert_parallel_degree``, default 1) and ``split`` (bool,
default false: rank ``r`` scores sequences ``r::world`` instead of all of them; rank 0 reassembles them in order) and
``routed_experts`` (per sequence a ``[len - 1, MoE layers, top_k]`` nested list to replay, or null), ``repeat``
(times the forward is run and timed, default 1);
rank 0 writes ``OUT.pt``
(``torch.save`` of a dict): ``logprobs``, the per-sequence float32 log-probs of
:meth:`titan_plugin.RLTrainer.forward_logprobs`; with ``train_step``, also ``loss`` of one on-policy
:meth:`~titan_plugin.RLTrainer.rl_step` (advantages +1 / -1 alternating) and ``after``, the log-probs after it;
``seconds``: rank 0's wall clock of each timed forward (and the step), between barriers.
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
            tensor_parallel_degree=spec["tp"],
            fused=spec.get("fused", False),
            expert_parallel_degree=spec.get("ep", 1),
        )
        config.checkpoint.enable = True
        trainer = RLTrainer(config)
        mine = list(range(len(spec["sequences"])))
        if spec.get("split"):
            mine = mine[dist.get_rank() :: dist.get_world_size()]
        routes = spec.get("routed_experts")
        batch = RolloutBatch(
            [spec["sequences"][i] for i in mine],
            [spec["prompt_lengths"][i] for i in mine],
            routed_experts=None if routes is None else [np.array(routes[i], dtype=np.int16) for i in mine],
        )
        dist.barrier()
        t0 = time.perf_counter()
        result = {"logprobs": [t.detach().float() for t in trainer.forward_logprobs(batch)]}
        dist.barrier()
        seconds = {"forward": [time.perf_counter() - t0]}
        for _ in range(spec.get("repeat", 1) - 1):  # timed again (benchmarks/layouts.py): same batch, same bits
            t0 = time.perf_counter()
            trainer.forward_logprobs(batch)
            dist.barrier()
            seconds["forward"].append(time.perf_counter() - t0)
        ep_sizes = {getattr(m, "expert_parallel_size", None) for m in trainer.model.modules()} - {None}
        if spec.get("train_step"):
            adv = [1.0 if i % 2 == 0 else -1.0 for i in mine]
            t0 = time.perf_counter()
            step = trainer.rl_step(
                RolloutBatch(
                    batch.sequences,
                    batch.prompt_lengths,
                    advantages=adv,
                    sampler_logprobs=result["logprobs"],
                    numerics=trainer.numerics,
                )
            )
            dist.barrier()
            seconds["step"] = [time.perf_counter() - t0]
            result["loss"] = step["loss"]
            result["after"] = [t.detach().float() for t in trainer.forward_logprobs(batch)]
        if spec.get("split"):  # every rank's rows, back in the batch's order
            parts = [None] * dist.get_world_size()
            dist.all_gather_object(parts, (mine, result))
            merged = {}
            for key in result:
                if key == "loss":
                    merged[key] = [r["loss"] for _, r in parts]
                    continue
                rows = {i: t for idx, r in parts for i, t in zip(idx, r[key], strict=True)}
                merged[key] = [rows[i] for i in range(len(spec["sequences"]))]
            result = merged
        result["expert_parallel_sizes"] = sorted(ep_sizes)  # zerokld MoE blocks: the EP size they ran at
        result["seconds"] = seconds  # rank 0's wall clock, between barriers
        if dist.get_rank() == 0:
            torch.save(result, argv[1])
        trainer.close()


if __name__ == "__main__":
    main(sys.argv[1:])
