"""zerokld's TorchTitan plugin: TorchTitan models on ``shared_numerics`` (via ``@override``), trainer log-probs,
an RL trainer (``RLTrainer``) on TorchTitan's own ``Trainer``.

Importing it changes nothing in torch or TorchTitan: the CPU shims (:mod:`.cpu_compat`) are applied by the entry
points that run TorchTitan (``RLTrainer``, :func:`titan_plugin.models.build_titan_model`)."""

from zerokld_models.fp8_export import export_fp8_checkpoint

from .logprobs import sequence_logprobs, trainer_logprobs


def __getattr__(name: str):  # TrainingClient imports TorchTitan's trainer stack: load it on first use
    if name == "TrainingClient":
        from .client import TrainingClient

        return TrainingClient
    raise AttributeError(name)


__all__ = ["TrainingClient", "export_fp8_checkpoint", "sequence_logprobs", "trainer_logprobs"]
