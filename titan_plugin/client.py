"""``TrainingClient``: a Tinker-compatible training API over a real TorchTitan trainer with zerokld numerics.

Names and shapes follow Tinker's ``TrainingClient`` (``forward``, ``forward_backward``, ``forward_backward_custom``,
``optim_step``, ``save_state``, ``load_state``, ``save_weights_for_sampler``), synchronous here. A datum is::

    {"model_input": list[int],                         # n input tokens
     "loss_fn_inputs": {"target_tokens": [n],          # next-token aligned: target[i] = model_input[i + 1]
                        "weights": [n],                # 0 on prompt positions, >0 on the completion (a suffix)
                        "advantages": [n], "logprobs": [n],    # sampler logprobs (RL losses)
                        "routed_experts": [n, layers, top_k]}} # MoE: vLLM's routed_experts, replayed (optional)

(lists or tensors), optionally with ``"zerokld_numerics"`` (the engine's stamp from the sampling response). Every
method also takes a :class:`shared_numerics.RolloutBatch` instead of datums. Stamped data (a batch from
``RolloutBatch.from_vllm`` / ``from_openai``, or datums with ``zerokld_numerics``) is checked against the trainer's
numerics mode (:class:`shared_numerics.NumericsMismatchError`, nothing computed); Tinker's datum format has no stamp,
so unstamped datums are taken as sampled in the trainer's mode. Results carry ``loss``, ``metrics`` and ``loss_fn_outputs[i]["logprobs"]`` — the trainer's
log-probs of the datum's weighted positions (``forward``: of every position), bitwise what vLLM reports for them.
Losses are the ones registered through the ``zerokld`` hooks; for ``cross_entropy`` the weights are the per-token
weights.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from shared_numerics.rollout import RolloutBatch, common_numerics

from .losses import RLLoss
from .rl import RLTrainer, rl_trainer_config

__all__ = ["TrainingClient", "datums_to_rollouts"]


def _t(x) -> torch.Tensor:
    return x.detach().float().reshape(-1) if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=torch.float32)


def datums_to_rollouts(data: list[dict], numerics=None, loss_fn: str = "cross_entropy") -> RolloutBatch:
    """Turn Tinker datums into a :class:`shared_numerics.RolloutBatch`.

    Args:
        data: datums (see the module docstring).
        numerics: the mode of unstamped datums (the trainer's); a datum's own ``zerokld_numerics`` wins.
        loss_fn: ``cross_entropy`` takes the weights as advantages and no sampler log-probs; any other loss needs
            ``advantages`` and ``logprobs``.

    Raises:
        ValueError: targets not next-token aligned, no weighted position, weighted positions that are not one
            suffix (general masks are not supported by the trainer's packing), missing RL inputs, or datums stamped
            with different modes.
    """
    seqs, plens, inputs = [], [], []
    for i, d in enumerate(data):
        x = [int(v) for v in (d["model_input"].tolist() if isinstance(d["model_input"], torch.Tensor)
                              else d["model_input"])]
        li = d.get("loss_fn_inputs", {})
        tgt = [int(v) for v in _t(li["target_tokens"]).tolist()]
        n = len(x)
        if len(tgt) != n or tgt[:-1] != x[1:]:
            raise ValueError(f"datum {i}: target_tokens must be model_input shifted by one (length {n})")
        w = _t(li.get("weights", [1.0] * n))
        nz = torch.nonzero(w).squeeze(1)
        if nz.numel() == 0:
            raise ValueError(f"datum {i}: no position has a nonzero weight")
        first = int(nz[0])
        if int(nz.numel()) != n - first:
            raise ValueError(f"datum {i}: weighted positions must be one suffix (the completion)")
        seqs.append(x + [tgt[-1]])
        plens.append(first + 1)
        sl = slice(first, n)
        inputs.append({"weights": w[sl], "advantages": _t(li["advantages"])[sl] if "advantages" in li else None,
                       "logprobs": _t(li["logprobs"])[sl] if "logprobs" in li else None,
                       "routed_experts": li.get("routed_experts")})
    if loss_fn == "cross_entropy":
        adv, q = [i["weights"] for i in inputs], None
    else:
        if any(i["advantages"] is None or i["logprobs"] is None for i in inputs):
            raise ValueError(f"loss {loss_fn!r} needs loss_fn_inputs 'advantages' and 'logprobs'")
        adv, q = [i["advantages"] for i in inputs], [i["logprobs"] for i in inputs]
    stamped = [d["zerokld_numerics"] for d in data if "zerokld_numerics" in d]
    return RolloutBatch(seqs, plens, adv, q, _routes(inputs),
                        numerics=common_numerics(stamped) if stamped else numerics)


def _routes(inputs: list[dict]):
    """The datums' ``routed_experts`` for replay (:mod:`titan_plugin.routing`), ``None`` when no datum has any; a
    datum without routes is routed afresh."""
    given = [i["routed_experts"] for i in inputs]
    ref = next((r for r in given if r is not None), None)
    if ref is None:
        return None
    shape = tuple(torch.as_tensor(ref).shape[1:])
    return [r if r is not None else torch.empty((0, *shape), dtype=torch.int64) for r in given]


class TrainingClient:
    """Synchronous Tinker-style client; owns one :class:`titan_plugin.rl.RLTrainer`."""

    def __init__(self, trainer: RLTrainer, dtype: str) -> None:
        self.trainer = trainer
        self.dtype = dtype
        self._losses: dict = {}

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str, dtype: str = "bfloat16", learning_rate: float = 1e-4,
                        fused: bool = True, dump_folder: str | None = None, max_norm: float = 1.0) -> "TrainingClient":
        """Start a TorchTitan trainer on an HF checkpoint (``dtype``: the serving dtype of the forward)."""
        dump = dump_folder or str(Path(checkpoint_dir).resolve().parent / (Path(checkpoint_dir).name + "_train"))
        cfg = rl_trainer_config(checkpoint_dir, dump, dtype=dtype, lr=learning_rate, fused=fused, max_norm=max_norm)
        return cls(RLTrainer(cfg), dtype)

    def _loss(self, loss_fn: str, loss_fn_config: dict | None) -> RLLoss:
        key = (loss_fn, tuple(sorted((loss_fn_config or {}).items())))
        if key not in self._losses:
            self._losses[key] = self.trainer.build_loss(loss_fn, loss_fn_config, normalization="sum")
        return self._losses[key]

    def _batch(self, data, loss_fn: str = "cross_entropy") -> RolloutBatch:
        if isinstance(data, RolloutBatch):
            return data
        return datums_to_rollouts(data, self.trainer.numerics, loss_fn)

    def forward(self, data: list[dict] | RolloutBatch) -> dict:
        """Log-probs of every target token (no gradients)."""
        batch = self._batch(data)
        if not isinstance(data, RolloutBatch):  # Tinker's forward scores every position
            batch = dataclasses.replace(batch, prompt_lengths=[1] * len(batch), advantages=None,
                                        sampler_logprobs=None)
        return {"loss_fn_outputs": [{"logprobs": lp} for lp in self.trainer.forward_logprobs(batch)]}

    def forward_backward(self, data: list[dict] | RolloutBatch, loss_fn: str, loss_fn_config: dict | None = None
                         ) -> dict:
        """Accumulate the gradient of ``loss_fn`` summed over the weighted tokens (Tinker: sum, no normaliser)."""
        res = self.trainer.forward_backward(self._batch(data, loss_fn), loss=self._loss(loss_fn, loss_fn_config))
        return {"loss": res["loss"], "metrics": {"clipped": res["clipped"], "grad_zeroed": res["grad_zeroed"],
                                                 "num_tokens": res["num_tokens"]},
                "loss_fn_outputs": [{"logprobs": lp} for lp in res["train_logprobs"]]}

    def forward_backward_custom(self, data: list[dict] | RolloutBatch, loss_fn) -> dict:
        """Two-pass custom loss: ``loss_fn(data, logprobs_list) -> (loss, metrics)`` on the weighted positions."""
        res = self.trainer.forward_backward_custom(self._batch(data), lambda lps: loss_fn(data, lps))
        return {"loss": res["loss"], "metrics": res["metrics"],
                "loss_fn_outputs": [{"logprobs": lp} for lp in res["train_logprobs"]]}

    def optim_step(self, adam_params: dict | None = None) -> dict:
        """Apply the accumulated gradients (AdamW; ``adam_params={"learning_rate": ...}`` sets the rate)."""
        lr = (adam_params or {}).get("learning_rate")
        return self.trainer.optim_step(learning_rate=lr)

    def save_state(self, name: str) -> str:
        """Full training state (model + optimizer + schedule) through TorchTitan's checkpointer; returns its path."""
        self.trainer.checkpointer.save(curr_step=self.trainer.step, last_step=True)
        return str(Path(self.trainer.checkpointer.folder) / f"step-{self.trainer.step}")

    def load_state(self, path: str) -> None:
        """Restore a state written by :meth:`save_state`."""
        step = int(Path(path).name.split("-")[-1])
        if not self.trainer.checkpointer.load(step=step):
            raise FileNotFoundError(f"no TorchTitan checkpoint at {path}")
        self.trainer.step = step

    def save_weights_for_sampler(self, name: str) -> str:
        """A full HF snapshot the vLLM side loads (``reload_weights`` / a new engine); returns its directory."""
        out = Path(self.trainer.config.dump_folder) / "sampler_weights" / name
        return str(self.trainer.save_hf(out, self.dtype))

    def close(self) -> None:
        self.trainer.close()
