"""The vLLM OpenAI server as a :class:`deltasync.ReplicaEngine`: the replica state machine
(:class:`deltasync.Replica`) drives vLLM's ``EngineClient`` (``AsyncLLM``) through this adapter.

LoRA adapter versions are served through vLLM's own OpenAI model registry (``OpenAIServingModels``: the
``lora_requests`` map that resolves a request's ``model``, its id counter and per-name lock, as
``/v1/load_lora_adapter`` uses them): each version is its own ``LoRARequest`` (name ``<lora_name>@<identity>``, a new
id, its own directory — so its own prefix-cache entries and its own slot), loaded into the engine with ``add_lora``
before the name points to it. vLLM's ``load_inplace`` instead replaces an adapter under requests that are using it.

Source: vLLM ``v1/engine/async_llm.py`` (``pause_generation(mode="keep"|"wait")``, ``resume_generation``,
``is_paused``, ``update_weight_version``, ``reset_prefix_cache(reset_running_requests=...)``,
``collective_rpc("reload_weights")``: every worker, in place; ``collective_rpc`` of the delta worker extension
(:mod:`vllm_plugin.hotload.worker`); ``add_lora``; ``output_processor.request_states``),
``entrypoints/openai/models/serving.py`` (``load_lora_adapter``).
"""

from __future__ import annotations

from deltasync.protocol import HotLoadError, lora_version

from .worker import METHOD, has_delta_worker, same_digest, stage_in_background

__all__ = ["ServerEngine", "versions_in_use"]


def versions_in_use(lora_names, name: str) -> set[str]:
    """Snapshot identities of adapter ``name`` among the vLLM adapter names ``lora_names`` (``None``: no adapter)."""
    prefix = lora_version(name, "")
    return {n[len(prefix) :] for n in lora_names if n and n.startswith(prefix)}


class ServerEngine:
    """Adapter of a running ``EngineClient``; ``numerics`` is the engine's
    :func:`vllm_plugin.config.numerics_stamp`; ``serving_models`` the server's ``OpenAIServingModels`` (LoRA
    adapters are served through it; ``None``: adapter hot-loads are refused)."""

    def __init__(self, engine_client, serving_models=None) -> None:
        from ..config import numerics_stamp
        from .sessions import CacheEpochs

        self.client, self.models = engine_client, serving_models
        self.numerics = numerics_stamp(engine_client.vllm_config)
        #: the prompt-cache epochs the endpoint salts requests with (:mod:`vllm_plugin.hotload.sessions`)
        self.epochs = CacheEpochs()

    async def load_adapter(self, name: str, identity: str, path: str) -> None:
        """Raises :class:`deltasync.HotLoadError`: 409 LoRA is off (``--enable-lora``) or no model registry, 400
        ``name`` is a served base model's, 422 ``add_lora`` refused the adapter (rank above ``--max-lora-rank``,
        modules it cannot adapt, ...; nothing changed)."""
        from vllm.lora.request import LoRARequest

        if self.client.vllm_config.lora_config is None or self.models is None:
            raise HotLoadError("LoRA is not enabled on this server (start it with --enable-lora)", 409)
        if self.models.is_base_model(name):
            raise HotLoadError(f"lora_name {name!r} is the name of a served base model", 400)
        request = LoRARequest(
            lora_name=lora_version(name, identity), lora_int_id=self.models.lora_id_counter.inc(1), lora_path=path
        )
        async with self.models.lora_resolver_lock[name]:  # the lock vLLM's own load/unload take for this name
            try:  # loads (and checks) it on every worker before anyone can use it
                await self.client.add_lora(request)
            except Exception as e:  # the engine's refusal, whatever its type
                raise HotLoadError(f"the engine refused the adapter: {e}", 422) from e
            self.models.lora_requests[name] = request

    def adapter_versions_in_use(self, name: str) -> set[str]:
        states = self.client.output_processor.request_states.values()
        return versions_in_use((s.lora_name for s in states), name)

    @property
    def inplace_deltas(self) -> bool:
        return has_delta_worker(self.client.vllm_config)

    async def apply_delta(
        self, path: str, compression_format: str | None, commit: bool, allow_non_finite: bool = False
    ) -> dict:
        """The stage pass runs on the workers' threads while the engine keeps serving
        (:func:`vllm_plugin.hotload.worker.stage_in_background`); the commit pass is one ``collective_rpc``.

        Raises :class:`deltasync.HotLoadError` 422: a worker refused the delta (stage pass: nothing written)."""
        try:
            if commit:
                results = await self.client.collective_rpc(
                    METHOD, kwargs={"path": path, "compression_format": compression_format, "commit": True}
                )
            else:  # serving goes on while the workers decode and check
                results = await stage_in_background(
                    self.client.collective_rpc, path, compression_format, allow_non_finite
                )
        except Exception as e:  # the worker's DeltaError arrives re-raised by the engine client
            raise HotLoadError(f"delta refused by the engine's workers: {e}", 422) from e
        return same_digest(results)

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
        done = bool(await self.client.reset_prefix_cache(reset_running_requests=running_requests))
        if done:  # nothing cached is left: every session starts over
            self.epochs.new_epoch(forget_sessions=True)
        return done

    async def isolate_new_sessions(self) -> bool:
        self.epochs.new_epoch()
        return True
