"""The Fireworks SDK's training data, as the tests build it (``fireworks-ai``'s ``Datum`` / ``TensorData``)."""

from __future__ import annotations

import torch

__all__ = ["completion_logprobs_from_forward", "sdk_datum"]


def sdk_datum(tokens: list[int], prompt_len: int, old_logprobs, advantage: float):
    """One ``fireworks.training.sdk.Datum`` of a sampled sequence ``tokens`` (prompt of ``prompt_len`` tokens):
    ``target_tokens`` and ``weights`` (0 on the prompt's targets, 1 on the completion's); with ``old_logprobs`` (the
    completion's sampling log-probs) an RL datum that also carries ``logprobs`` and ``advantages``, else one for
    ``cross_entropy`` / custom losses."""
    from fireworks.training.sdk import Datum, ModelInput, TensorData

    n = len(tokens) - 1
    weights = [0.0] * (prompt_len - 1) + [1.0] * (n - prompt_len + 1)
    inputs = {
        "target_tokens": TensorData(data=tokens[1:], dtype="int64", shape=[n]),
        "weights": TensorData(data=weights, dtype="float32", shape=[n]),
    }
    if old_logprobs is not None:
        inputs["logprobs"] = TensorData(data=[0.0] * (prompt_len - 1) + list(old_logprobs), dtype="float32", shape=[n])
        inputs["advantages"] = TensorData(data=[advantage] * n, dtype="float32", shape=[n])
    return Datum(model_input=ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def completion_logprobs_from_forward(training_client, data, samples) -> list[torch.Tensor]:
    """The training server's ``forward`` log-probs of each sample's completion tokens (float32), for comparison
    with the sampler's ``sampling_logprobs``."""
    fwd = training_client.forward(data, "cross_entropy").result()
    return [
        torch.tensor(o["logprobs"].data, dtype=torch.float32)[c.prompt_len - 1 :]
        for o, c in zip(fwd.loss_fn_outputs, samples, strict=True)
    ]
