"""Hot-load deltas applied in place on every worker: vLLM's worker extension for ``collective_rpc``.

A zerokld engine's workers get :class:`DeltaWorkerExtension` (vLLM's ``--worker-extension-cls``, the upstream way to
add ``collective_rpc`` methods to workers: ``v1/worker/worker_base.py``). :func:`configure_worker_extension` sets it
on every engine config built with ``batch_invariant`` on and no extension of the user's own
(``EngineArgs.create_engine_config``, through :mod:`vllm_plugin.start`), so ``vllm serve`` and ``vllm.LLM`` need no
extra flag; an engine started with another extension keeps it and its hot-loads decode deltas on the host instead
(:meth:`deltasync.Replica.signal`).

Each worker decodes the delta against its own parameters' bits
(:meth:`vllm_plugin.models.model.ZeroKLDForCausalLM.checkpoint_views`), one tensor at a time
(:func:`deltasync.apply_delta_in_place`): the stage pass checks every tensor's Adler-32 and writes nothing — on the
server it runs on a worker thread while the engine keeps stepping (:func:`stage_in_background`) —
the commit pass (engine paused) writes the new bits into the parameters; online FP8 re-quantizes only the projections
whose bits changed. Peak extra memory: one tensor and its payload.

Source: vLLM ``v1/worker/worker_base.py`` (``worker_extension_cls``), ``config/parallel.py``
(``ParallelConfig.worker_extension_cls``), ``engine/arg_utils.py`` (``EngineArgs.create_engine_config``).
"""

from __future__ import annotations

__all__ = [
    "EXTENSION",
    "METHOD",
    "DeltaWorkerExtension",
    "configure_worker_extension",
    "has_delta_worker",
    "same_digest",
    "stage_in_background",
]

#: the qualified name set as ``parallel_config.worker_extension_cls``
EXTENSION = "vllm_plugin.hotload.worker.DeltaWorkerExtension"
#: the ``collective_rpc`` method name
METHOD = "zerokld_apply_delta"


class DeltaWorkerExtension:
    """Mixed into vLLM's worker class (``self.model_runner`` is the worker's)."""

    def zerokld_start_stage(self, path: str, compression_format: str | None, allow_non_finite: bool = False) -> None:
        """Start the stage pass of :meth:`zerokld_apply_delta` on a thread of this worker and return at once: the
        engine keeps stepping while the delta is decoded and checked (the pass only reads the parameters; numpy,
        zstd and zlib release the GIL). :meth:`zerokld_stage_result` collects it. A stage already running is
        waited for first (one at a time)."""
        from concurrent.futures import ThreadPoolExecutor

        if getattr(self, "_zerokld_stage", None) is None:
            self._zerokld_stage_pool = ThreadPoolExecutor(1, thread_name_prefix="zerokld-stage")
        else:
            self._zerokld_stage[1].exception()  # wait; its outcome was never collected
        self._zerokld_stage = (
            path,
            self._zerokld_stage_pool.submit(
                self.zerokld_apply_delta, path, compression_format, False, allow_non_finite
            ),
        )

    def zerokld_stage_result(self, path: str) -> dict | None:
        """``None`` while the stage pass of ``path`` runs, then its :meth:`zerokld_apply_delta` result (once).

        Raises:
            deltasync.DeltaError: the stage refused the delta. RuntimeError: no stage of ``path`` was started."""
        stage = getattr(self, "_zerokld_stage", None)
        if stage is None or stage[0] != path:
            raise RuntimeError(f"no stage pass of {path!r} was started on this worker")
        if not stage[1].done():
            return None
        self._zerokld_stage = (None, stage[1])
        return stage[1].result()

    def zerokld_apply_delta(
        self, path: str, compression_format: str | None, commit: bool, allow_non_finite: bool = False
    ) -> dict:
        """Stage (``commit=False``) or commit one incremental snapshot at ``path`` on this worker's model
        (``allow_non_finite``: accept NaN/inf weights, ``HotLoadConfig.allow_non_finite``).

        Returns:
            ``{"weights_digest": hex}`` (the digest of the weights the delta produces:
            :func:`deltasync.checksums_digest` of the per-tensor SHA-256 it verified) and ``"changed"``: the number of
            tensors whose bits changed (commit).

        Raises:
            deltasync.DeltaError: refused (wrong base, corrupt payload, tensor set differs from the model's); in the
                stage pass nothing was written.
            RuntimeError: the model does not hold checkpoint bits (stock numerics).
        """
        from deltasync import DeltaError, apply_delta_in_place, checksums_digest, delta_checksums

        from ..faults import copy_fault

        model = self.model_runner.get_model()
        names = delta_checksums(path)
        try:
            targets = model.checkpoint_views(names)
        except KeyError as e:
            raise DeltaError(f"delta tensors differ from the model's: {e.args[0]}") from e
        out = apply_delta_in_place(
            path,
            targets,
            compression_format,
            commit=commit,
            after_tensor=copy_fault if commit else None,
            allow_non_finite=allow_non_finite,
        )
        if commit:
            model.checkpoint_updated(out["changed"])
        return {"weights_digest": checksums_digest(out["sha256"]), "changed": len(out["changed"])}


async def stage_in_background(
    collective_rpc, path: str, compression_format: str | None, allow_non_finite: bool, poll_s: float = 0.05
) -> list[dict]:
    """The stage pass on every worker while the engine keeps serving: ``zerokld_start_stage``, then
    ``zerokld_stage_result`` every ``poll_s`` seconds until each worker answered (``collective_rpc``: the engine
    client's, awaitable). Returns the per-worker results; raises what a worker raised."""
    import asyncio

    await collective_rpc(
        "zerokld_start_stage",
        kwargs={"path": path, "compression_format": compression_format, "allow_non_finite": allow_non_finite},
    )
    while True:
        results = await collective_rpc("zerokld_stage_result", kwargs={"path": path})
        if all(r is not None for r in results):
            return results
        await asyncio.sleep(poll_s)


def has_delta_worker(vllm_config) -> bool:
    """Whether the engine's workers carry :class:`DeltaWorkerExtension` (its deltas can be applied in place)."""
    return vllm_config.parallel_config.worker_extension_cls == EXTENSION


def same_digest(results: list[dict]) -> dict:
    """One answer from every worker's (``collective_rpc``'s per-worker results): ``{"weights_digest",
    "tensors_changed"}``.

    Raises:
        RuntimeError: the workers disagree on the digest (their weights differ) or none answered."""
    digests = {r["weights_digest"] for r in results}
    if len(digests) != 1:
        raise RuntimeError(f"workers report {len(digests)} different weights digests")
    return {"weights_digest": digests.pop(), "tensors_changed": max(r["changed"] for r in results)}


def configure_worker_extension(vllm_config) -> None:
    """Set :data:`EXTENSION` as ``vllm_config``'s ``worker_extension_cls`` when zerokld is on, the engine runs at
    TP 1 and the user named no extension of their own (called where the config is built: :mod:`vllm_plugin.start`)."""
    from ..config import from_vllm_config

    parallel = vllm_config.parallel_config
    # sharded workers (TP > 1) hold slices, not checkpoint tensors: their deltas go through reload_weights
    if (
        from_vllm_config(vllm_config).batch_invariant
        and not parallel.worker_extension_cls
        and parallel.tensor_parallel_size == 1
    ):
        parallel.worker_extension_cls = EXTENSION
