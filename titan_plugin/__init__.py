"""zerokld's TorchTitan plugin: TorchTitan models on ``shared_numerics`` (via ``@override``), trainer log-probs,
an RL trainer (``RLTrainer``) on TorchTitan's own ``Trainer``."""
from . import cpu_compat

cpu_compat.apply()

from .logprobs import sequence_logprobs, trainer_logprobs  # noqa: E402

__all__ = ["sequence_logprobs", "trainer_logprobs"]
