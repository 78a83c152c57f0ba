"""zerokld's TorchTitan plugin: TorchTitan models on ``shared_numerics`` (via ``@override``), trainer log-probs."""
from .logprobs import sequence_logprobs, trainer_logprobs

__all__ = ["sequence_logprobs", "trainer_logprobs"]
