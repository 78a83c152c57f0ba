"""Test helper around real vLLM engines on CPU: a delta shipped to an offline engine through the replica. Starting,
stopping, reloading engines and reading logprobs: :mod:`vllm_plugin.engines`.
"""

from __future__ import annotations

__all__ = ["load_delta_offline"]


def load_delta_offline(
    llm,
    base_checkpoint: str,
    new_tensors: dict,
    work_dir,
    identity: str = "step1",
    compression_format: str = "zkd_sparse_v2",
) -> dict:
    """Ship ``new_tensors`` to the offline engine ``llm`` as a hot-load delta: an incremental snapshot against
    ``base_checkpoint`` written under ``work_dir/snapshots/<identity>``, loaded by a
    :class:`vllm_plugin.hotload.offline.OfflineReplica` (state in ``work_dir/state``; ``base_checkpoint`` is its
    initial weights, what ``llm`` must be serving). Returns the replica's ledger row (``applied``,
    ``tensors_changed``, ...)."""
    from pathlib import Path

    from deltasync import HotLoadConfig, Signal, write_incremental_snapshot
    from vllm_plugin.hotload.offline import OfflineReplica

    work = Path(work_dir)
    write_incremental_snapshot(
        base_checkpoint, new_tensors, work / "snapshots" / identity, compression_format=compression_format
    )
    replica = OfflineReplica(
        llm, HotLoadConfig(snapshot_root=str(work / "snapshots"), state_dir=str(work / "state")), base_checkpoint
    )
    try:
        return replica.load(Signal(identity, previous_identity="initial", compression_format=compression_format))
    finally:
        replica.close()
