"""An offline ``vllm.LLM`` as a :class:`deltasync.ReplicaEngine`, so in-process rollouts (the countdown example, a
single-process RL loop) hot-load through the same replica state machine as the server — ledger, replay and chain
checks, numerics check, verify-before-swap included.

``LLM.generate`` is synchronous: nothing is in flight between calls, so pausing is a no-op and the swap happens
between two ``generate`` calls. Use :meth:`OfflineReplica.load` from synchronous code. LoRA adapter versions
(signals with ``lora_name``) are loaded with ``add_lora``; ``generate`` takes :meth:`OfflineReplica.lora_request`.
"""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

from deltasync import HotLoadConfig, HotLoadError, Replica, Signal
from deltasync.protocol import lora_version

from .worker import METHOD, has_delta_worker, same_digest

__all__ = ["LORA_ID_BASE", "OfflineEngine", "OfflineReplica"]

#: ``lora_int_id`` of the first adapter version this adapter loads (the ids an application picks itself for its own
#: ``LoRARequest``s in the same engine stay below it)
LORA_ID_BASE = 1 << 30


class OfflineEngine:
    """Adapter of an offline ``vllm.LLM`` (``collective_rpc("reload_weights")`` and the delta worker extension's,
    ``reset_prefix_cache``, ``add_lora``); :attr:`lora_requests` maps each hot-loaded adapter name to its serving
    version's ``LoRARequest``."""

    def __init__(self, llm) -> None:
        from ..config import numerics_stamp

        self.llm = llm
        self.numerics = numerics_stamp(llm.llm_engine.vllm_config)
        self.lora_requests: dict = {}
        self._lora_ids = itertools.count(LORA_ID_BASE)

    async def load_adapter(self, name: str, identity: str, path: str) -> None:
        from vllm.lora.request import LoRARequest

        if self.llm.llm_engine.vllm_config.lora_config is None:
            raise HotLoadError("LoRA is not enabled on this engine (enable_lora=True)", 409)
        request = LoRARequest(lora_version(name, identity), next(self._lora_ids), path)
        try:  # loads and checks it before generate can use it
            self.llm.llm_engine.add_lora(request)
        except Exception as e:  # the engine's refusal, whatever its type
            raise HotLoadError(f"the engine refused the adapter: {e}", 422) from e
        self.lora_requests[name] = request

    def adapter_versions_in_use(self, name: str) -> set[str]:
        return set()  # nothing runs between two generate calls

    @property
    def inplace_deltas(self) -> bool:
        return has_delta_worker(self.llm.llm_engine.vllm_config)

    async def apply_delta(
        self, path: str, compression_format: str | None, commit: bool, allow_non_finite: bool = False
    ) -> dict:
        try:
            results = self.llm.collective_rpc(
                METHOD,
                kwargs={
                    "path": path,
                    "compression_format": compression_format,
                    "commit": commit,
                    "allow_non_finite": allow_non_finite,
                },
            )
        except Exception as e:  # a worker's refusal
            raise HotLoadError(f"delta refused by the engine's workers: {e}", 422) from e
        return same_digest(results)

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

    async def isolate_new_sessions(self) -> bool:
        return False  # no sessions offline: the replica resets the (idle) prefix cache instead


class OfflineReplica(Replica):
    """A :class:`deltasync.Replica` over an offline ``vllm.LLM``.

    Args:
        llm: the engine (started from ``initial_dir``).
        config: snapshot root, state dir, initial identity, retention (:class:`deltasync.HotLoadConfig`).
        initial_dir: the ``model`` directory the engine started from.
    """

    def __init__(self, llm, config: HotLoadConfig, initial_dir: str | Path) -> None:
        super().__init__(OfflineEngine(llm), config, initial_dir)

    def lora_request(self, name: str):
        """The ``vllm.lora.request.LoRARequest`` of adapter ``name``'s serving version (pass it to ``generate``).

        Raises:
            KeyError: no version of ``name`` was hot-loaded."""
        return self.engine.lora_requests[name]

    def load(self, sig: Signal) -> dict:
        """Synchronous :meth:`deltasync.Replica.signal`: the ledger row, or :class:`deltasync.HotLoadError`."""
        return asyncio.run(self.signal(sig))
