"""zerokld's TorchTitan plugin: TorchTitan models on ``shared_numerics`` (via ``@override``), trainer log-probs,
an RL trainer (``RLTrainer``) on TorchTitan's own ``Trainer``."""
from . import cpu_compat

cpu_compat.apply()

from zerokld_models.fp8_export import export_fp8_checkpoint  # noqa: E402

from .logprobs import sequence_logprobs, trainer_logprobs  # noqa: E402


def __getattr__(name: str):  # TrainingClient imports TorchTitan's trainer stack: load it on first use
    if name == "TrainingClient":
        from .client import TrainingClient

        return TrainingClient
    raise AttributeError(name)


__all__ = ["TrainingClient", "export_fp8_checkpoint", "sequence_logprobs", "trainer_logprobs"]
