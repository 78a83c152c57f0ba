"""An offline ``vllm.LLM`` as a :class:`deltasync.ReplicaEngine`, so in-process rollouts (the countdown example, a
single-process RL loop) hot-load through the same replica state machine as the server — ledger, replay and chain
checks, numerics check, verify-before-swap included.

``LLM.generate`` is synchronous: nothing is in flight between calls, so pausing is a no-op and the swap happens
between two ``generate`` calls. Use :meth:`OfflineReplica.load` from synchronous code.
"""
from __future__ import annotations

import asyncio
from pathlib import Path

from deltasync import HotLoadConfig, Replica, Signal

__all__ = ["OfflineEngine", "OfflineReplica"]


class OfflineEngine:
    """Adapter of an offline ``vllm.LLM`` (``collective_rpc("reload_weights")``, ``reset_prefix_cache``)."""

    def __init__(self, llm) -> None:
        from ..config import numerics_stamp

        self.llm = llm
        self.numerics = numerics_stamp(llm.llm_engine.vllm_config)

    async def reload_weights(self, path: str) -> None:
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": path})

    async def set_weight_version(self, identity: str) -> None:
        self.llm.llm_engine.set_weight_version(identity)

    async def pause(self, keep_requests: bool) -> None:
        pass

    async def resume(self) -> None:
        pass

    async def is_paused(self) -> bool:
        return False

    def num_unfinished_requests(self) -> int:
        return 0

    async def reset_prefix_cache(self, running_requests: bool) -> bool:
        return bool(self.llm.reset_prefix_cache())


class OfflineReplica(Replica):
    """A :class:`deltasync.Replica` over an offline ``vllm.LLM``.

    Args:
        llm: the engine (started from ``initial_dir``).
        config: snapshot root, state dir, initial identity, retention (:class:`deltasync.HotLoadConfig`).
        initial_dir: the ``model`` directory the engine started from.
    """

    def __init__(self, llm, config: HotLoadConfig, initial_dir: str | Path) -> None:
        super().__init__(OfflineEngine(llm), config, initial_dir)

    def load(self, sig: Signal) -> dict:
        """Synchronous :meth:`deltasync.Replica.signal`: the ledger row, or :class:`deltasync.HotLoadError`."""
        return asyncio.run(self.signal(sig))
