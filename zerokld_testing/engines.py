"""Test helpers around real vLLM engines on CPU: mixed sampling settings, full and delta weight reloads, logprobs
read out of outputs. Starting and stopping engines: :mod:`vllm_plugin.engines`.
"""
from __future__ import annotations

import torch

__all__ = ["completion_logprobs", "load_delta_offline", "mixed_sampling_params", "prompt_logprobs", "reload_weights"]


def mixed_sampling_params(i: int, seed: int | None = None, max_tokens: int = 24, **kw):
    """Request ``i``'s ``vllm.SamplingParams`` in a batch whose settings vary (cycling temperature 1.0; 0.7 with
    top-k 20; 1.3 with top-p 0.9; 0.9 with top-k 40 and top-p 0.8), one logprob per token, ``ignore_eos``; ``kw``
    overrides any of them."""
    from vllm import SamplingParams

    settings = [dict(temperature=1.0), dict(temperature=0.7, top_k=20), dict(temperature=1.3, top_p=0.9),
                dict(temperature=0.9, top_k=40, top_p=0.8)][i % 4]
    return SamplingParams(max_tokens=max_tokens, logprobs=0, ignore_eos=True, seed=seed, **{**settings, **kw})


def reload_weights(llm, checkpoint_dir: str) -> None:
    """Load a full HF snapshot into the running engine in place, then drop every cached prefix.

    Uses vLLM's ``reload_weights`` worker method (``v1/worker/gpu_model_runner.py``) and ``reset_prefix_cache``:
    cached KV computed with the old weights would otherwise be reused.
    """
    llm.collective_rpc("reload_weights", kwargs={"weights_path": checkpoint_dir})
    if not llm.reset_prefix_cache():
        raise RuntimeError("reset_prefix_cache refused (requests still running)")


def load_delta_offline(llm, base_checkpoint: str, new_tensors: dict, work_dir, identity: str = "step1",
                       compression_format: str = "zkd_sparse_v2") -> dict:
    """Ship ``new_tensors`` to the offline engine ``llm`` as a hot-load delta: an incremental snapshot against
    ``base_checkpoint`` written under ``work_dir/snapshots/<identity>``, loaded by a
    :class:`vllm_plugin.hotload.offline.OfflineReplica` (state in ``work_dir/state``; ``base_checkpoint`` is its
    initial weights, what ``llm`` must be serving). Returns the replica's ledger row (``applied``,
    ``tensors_changed``, ...)."""
    from pathlib import Path

    from deltasync import HotLoadConfig, Signal, write_incremental_snapshot
    from vllm_plugin.hotload.offline import OfflineReplica

    work = Path(work_dir)
    write_incremental_snapshot(base_checkpoint, new_tensors, work / "snapshots" / identity,
                               compression_format=compression_format)
    replica = OfflineReplica(llm, HotLoadConfig(snapshot_root=str(work / "snapshots"), state_dir=str(work / "state")),
                             base_checkpoint)
    try:
        return replica.load(Signal(identity, previous_identity="initial", compression_format=compression_format))
    finally:
        replica.close()


def completion_logprobs(output) -> torch.Tensor:
    """``[num_generated]`` float32 logprobs of the sampled tokens of ``RequestOutput.outputs[0]``."""
    comp = output.outputs[0]
    return torch.tensor([lp[t].logprob for lp, t in zip(comp.logprobs, comp.token_ids)], dtype=torch.float32)


def prompt_logprobs(output, start: int) -> torch.Tensor:
    """float32 logprobs of prompt tokens ``start..end`` from ``RequestOutput.prompt_logprobs`` (``start >= 1``)."""
    ids = output.prompt_token_ids
    return torch.tensor([output.prompt_logprobs[i][ids[i]].logprob for i in range(start, len(ids))],
                        dtype=torch.float32)
