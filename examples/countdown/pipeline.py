"""The countdown example's rollout side as a pipeline stage: a :class:`RolloutWorker` thread owns the vLLM engine
(generation, weight swaps, held-out evaluation) while the trainer trains in the main thread.

Policy versions: version ``v`` is the trainer's weights after ``v`` optimizer steps (0 = the initial checkpoint).
Batch ``s`` (trained at step ``s``, by the trainer at version ``s - 1``) is generated once the engine serves a
version ``>= s - 1 - K``: ``K = 0`` is synchronous RL (generate, train, sync, repeat), ``K >= 1`` overlaps the
generation of the next ``K`` batches with training, each rollout at most ``K`` versions stale. With the offline
engine every published version is loaded by this thread, in order, through the example's
:class:`examples.countdown.sync.DeltaSync` (the hot-load protocol), between two ``generate`` calls; with ``--server``
the trainer pushes each version over HTTP itself, also while this thread's requests are in flight, and ``load`` only
records it. Either way a batch carries, per rollout, the spans of tokens each snapshot sampled.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["GeneratedBatch", "RolloutWorker"]


@dataclass
class GeneratedBatch:
    """What the worker hands the trainer for step ``step``: the rollouts (a :class:`shared_numerics.RolloutBatch`
    without advantages), per rollout the ``[(snapshot identity, start, end)]`` spans of completion tokens each
    snapshot sampled, the engine's policy version when the batch was sent, and the generation's seconds."""

    step: int
    batch: Any
    spans: list
    version: int
    rollout_seconds: float


class RolloutWorker(threading.Thread):
    """Generates batch ``1..steps`` with at most ``staleness`` versions of lag (see the module docstring).

    Args:
        generate: ``generate(step) -> (RolloutBatch, spans)`` for batch ``step`` (runs in this thread).
        load: ``load(version, weights) -> sync stats`` swaps the engine to a published version.
        on_loaded: ``on_loaded(version)`` after each load (held-out evaluation); runs in this thread.

    The trainer calls :meth:`publish` after every step and :meth:`next_batch` before it; :meth:`stop` ends the thread
    (also on the trainer's errors). An error in this thread is re-raised by :meth:`next_batch`. :attr:`loaded` maps
    each loaded version to its ``load`` stats.
    """

    def __init__(
        self,
        steps: int,
        staleness: int,
        generate: Callable[[int], tuple],
        load: Callable[[int, Any], dict],
        on_loaded: Callable[[int], None] = lambda v: None,
    ) -> None:
        super().__init__(name="rollout-worker", daemon=True)
        if staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {staleness}")
        self.steps, self.staleness = steps, staleness
        self._generate, self._load, self._on_loaded = generate, load, on_loaded
        self._weights: queue.Queue = queue.Queue()
        self._batches: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.loaded: dict[int, dict] = {}
        self._inline = None

    def start(self) -> None:
        """Start the thread; with ``staleness`` 0 (synchronous RL) there is none: :meth:`next_batch` generates in the
        caller's thread (one OpenMP pool: a second thread's pool would spin on the trainer's cores)."""
        if self.staleness == 0:
            self._inline = self._produce()
        else:
            super().start()

    def join(self, timeout: float | None = None) -> None:
        if self._inline is not None:
            for _ in self._inline:  # the final load (and evaluation) after the last batch
                pass
            return
        if self.ident is not None:  # started (Thread.join refuses a thread never started)
            super().join(timeout)

    def publish(self, version: int, weights) -> None:
        """The trainer's weights after ``version`` steps (HF names, the serving dtype)."""
        self._weights.put((version, weights))

    def stop(self) -> None:
        if self._inline is not None:
            self._inline.close()
        self._weights.put(None)

    def next_batch(self) -> GeneratedBatch:
        if self._inline is not None:
            return next(self._inline)
        item = self._batches.get()
        if item is None:
            raise RuntimeError("the rollout worker stopped") from self.error
        return item

    def _catch_up(self, version: int, need: int) -> int:
        """Load every published version, in order; block while the engine's version is below ``need``."""
        while True:
            try:
                item = self._weights.get(block=version < need)
            except queue.Empty:
                return version
            if item is None:
                raise _Stopped
            version, weights = item
            self.loaded[version] = self._load(version, weights)
            self._on_loaded(version)

    def _produce(self):
        version = 0
        for step in range(1, self.steps + 1):
            version = self._catch_up(version, step - 1 - self.staleness)
            t0 = time.perf_counter()
            batch, spans = self._generate(step)
            yield GeneratedBatch(step, batch, spans, version, time.perf_counter() - t0)
        self._catch_up(version, self.steps)  # the final weights, for the last evaluation

    def run(self) -> None:
        try:
            for item in self._produce():
                self._batches.put(item)
        except _Stopped:
            pass
        except BaseException as e:  # noqa: BLE001 - handed to the trainer thread
            self.error = e
        finally:
            self._batches.put(None)


class _Stopped(Exception):
    pass
