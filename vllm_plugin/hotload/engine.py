"""The vLLM OpenAI server as a :class:`deltasync.ReplicaEngine`: the replica state machine
(:class:`deltasync.Replica`) drives vLLM's ``EngineClient`` (``AsyncLLM``) through this adapter.

Source: vLLM ``v1/engine/async_llm.py`` (``pause_generation(mode="keep"|"wait")``, ``resume_generation``,
``is_paused``, ``update_weight_version``, ``reset_prefix_cache(reset_running_requests=...)``,
``collective_rpc("reload_weights")``: every worker, in place).
"""
from __future__ import annotations

__all__ = ["ServerEngine"]


class ServerEngine:
    """Adapter of a running ``EngineClient``; ``numerics`` is the engine's
    :func:`vllm_plugin.config.numerics_stamp`."""

    def __init__(self, engine_client) -> None:
        from ..config import numerics_stamp

        self.client = engine_client
        self.numerics = numerics_stamp(engine_client.vllm_config)

    async def reload_weights(self, path: str) -> None:
        await self.client.collective_rpc("reload_weights", kwargs={"weights_path": path})

    async def set_weight_version(self, identity: str) -> None:
        await self.client.update_weight_version(identity)

    async def pause(self, keep_requests: bool) -> None:
        await self.client.pause_generation(mode="keep" if keep_requests else "wait", clear_cache=False)

    async def resume(self) -> None:
        await self.client.resume_generation()

    async def is_paused(self) -> bool:
        return bool(await self.client.is_paused())

    def num_unfinished_requests(self) -> int:
        return self.client.get_num_unfinished_requests()

    async def reset_prefix_cache(self, running_requests: bool) -> bool:
        return bool(await self.client.reset_prefix_cache(reset_running_requests=running_requests))
