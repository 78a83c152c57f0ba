"""The countdown example's rollout pipeline stage (``examples/countdown/pipeline.py``) on its own: the staleness bound,
the order in which versions are loaded, errors and stopping. The engine is replaced by callables that record what
the worker asked for (the real-engine run is ``tests/test_example.py``)."""

from __future__ import annotations

import time

import pytest

from examples.countdown.pipeline import RolloutWorker

pytestmark = pytest.mark.timeout(120)


class Engine:
    """Records the version each batch was generated with and the order of loads."""

    def __init__(self, gen_seconds: float = 0.0) -> None:
        self.version, self.loads, self.generated = 0, [], {}
        self.gen_seconds = gen_seconds

    def generate(self, step: int):
        time.sleep(self.gen_seconds)
        self.generated[step] = self.version
        return f"batch {step}", [[(f"id{self.version}", 0, 4)]]

    def load(self, version: int, weights) -> dict:
        assert weights == f"w{version}"
        self.version = version
        self.loads.append(version)
        return {"sync_kind": "full"}


def _train(worker: RolloutWorker, steps: int, train_seconds: float) -> list:
    got = []
    for step in range(1, steps + 1):
        b = worker.next_batch()
        got.append((b.step, b.version))
        assert b.batch == f"batch {step}" and b.spans == [[(f"id{b.version}", 0, 4)]]
        time.sleep(train_seconds)
        worker.publish(step, f"w{step}")
    worker.join(timeout=60)
    return got


@pytest.mark.parametrize("k", [0, 1, 2])
def test_staleness_is_bounded_and_every_version_loaded_in_order(k):
    engine, evaluated = Engine(gen_seconds=0.01), []
    worker = RolloutWorker(8, k, engine.generate, engine.load, evaluated.append)
    worker.start()
    got = _train(worker, 8, train_seconds=0.2)  # training slower than generation: the worker runs ahead
    assert not worker.is_alive() and worker.error is None
    assert [s for s, _ in got] == list(range(1, 9))
    staleness = [s - 1 - v for s, v in got]
    assert all(0 <= x <= k for x in staleness) and max(staleness) == k
    assert engine.loads == list(range(1, 9)) == evaluated and sorted(worker.loaded) == list(range(1, 9))
    assert all(engine.generated[s] == v for s, v in got)


def test_generation_error_reaches_the_trainer_and_stop_ends_a_waiting_worker():
    def broken(step):
        raise OSError("engine died")

    worker = RolloutWorker(3, 1, broken, Engine().load)
    worker.start()
    with pytest.raises(RuntimeError, match="stopped") as e:
        worker.next_batch()
    assert isinstance(e.value.__cause__, OSError)

    engine = Engine()
    waiting = RolloutWorker(4, 1, engine.generate, engine.load)
    waiting.start()
    assert [waiting.next_batch().step for _ in range(2)] == [1, 2]  # batch 3 waits for version 1: never comes
    waiting.stop()
    waiting.join(timeout=10)
    assert not waiting.is_alive() and waiting.error is None
    with pytest.raises(ValueError, match="staleness"):
        RolloutWorker(3, -1, engine.generate, engine.load)
