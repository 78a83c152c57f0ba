"""``TrainingClient``: a Tinker-compatible training API over a real TorchTitan trainer with zerokld numerics.

Names and shapes follow Tinker's ``TrainingClient`` (``forward``, ``forward_backward``, ``forward_backward_custom``,
``optim_step``, ``save_state``, ``load_state``, ``save_weights_for_sampler``), synchronous here. A datum is::

    {"model_input": list[int],                         # n input tokens
     "loss_fn_inputs": {"target_tokens": [n],          # next-token aligned: target[i] = model_input[i + 1]
                        "weights": [n],                # per-token loss weights (default: all 1): a mask >= 0
                                                       # for RL losses; any finite value for cross_entropy
                        "advantages": [n], "logprobs": [n],    # RL losses: per target token, sampler logprobs
                        "routed_experts": [n, layers, top_k],  # MoE: vLLM's routed_experts, replayed (optional)
                        "ref_logprobs": [n]}}          # reference log-probs for loss_fn_config kl_beta (optional;
                                                       # zerokld's, not Tinker's: forward(data, base_only=True))

(lists, numpy arrays or tensors), optionally with ``"zerokld_numerics"`` (the engine's stamp from the sampling
response). As in Tinker, every datum is scored at all ``n`` target positions: ``loss_fn_outputs[i]["logprobs"]`` of
``forward``, ``forward_backward`` and the ``logprobs`` a ``forward_backward_custom`` loss receives hold one float32
log-prob per target token — the trainer's, bitwise what vLLM reports for it. Each token's loss is multiplied by its
weight (Tinker's ``cross_entropy``: ``-sum(weights * logprobs)``; RL losses: Tinker's formulas, and a weight, when
given, masks them too: prompt, tool outputs, earlier turns), summed (Tinker: no normaliser); weight-0 tokens count in
no metric, and GSPO's sequence ratio averages over the weighted tokens. ``loss_fn_config`` may add the
loss-independent corrections of :class:`shared_numerics.losses.CorrectionConfig` (``kl_beta``: the k3 KL term against
``ref_logprobs``; ``tis_cap``; ``mis_low`` / ``mis_high``).

LoRA (:meth:`TrainingClient.create_lora`, Tinker's ``create_lora_training_client``): the base stays frozen,
``save_weights_for_sampler`` writes a PEFT adapter, and ``forward(data, base_only=True)`` gives the base model's
log-probs — bitwise a full-parameter client's on the base checkpoint — for the reference-KL term.

Every method also takes a :class:`shared_numerics.RolloutBatch` instead of datums (its completion tokens scored,
its ``loss_weights`` applied). Stamped data (a batch from ``RolloutBatch.from_vllm`` / ``from_openai``, or datums
with ``zerokld_numerics``) is checked against the trainer's numerics mode
(:class:`shared_numerics.NumericsMismatchError`, nothing computed); Tinker's datum format has no stamp, so unstamped
datums are taken as sampled in the trainer's mode. Losses are the ones registered through the ``zerokld`` hooks.
"""

from __future__ import annotations

from pathlib import Path

import torch

from shared_numerics.rollout import RolloutBatch, common_numerics
from zerokld_plugins.errors import InvalidRequestError, UnsupportedRequestError

from .losses import RLLoss
from .rl import RLTrainer, rl_trainer_config

__all__ = ["TrainingClient", "datums_to_rollouts"]


def _t(x) -> torch.Tensor:
    return x.detach().float().reshape(-1) if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=torch.float32)


def _ids(x) -> list[int]:
    return [int(v) for v in torch.as_tensor(x).reshape(-1).tolist()]


def datums_to_rollouts(data: list[dict], numerics=None, loss_fn: str = "cross_entropy") -> RolloutBatch:
    """Turn Tinker datums into a :class:`shared_numerics.RolloutBatch` that scores every target token: prompt
    length 1 (the first input token), the ``n`` targets its completion, ``weights`` its ``loss_weights``.

    Args:
        data: datums (see the module docstring).
        numerics: the mode of unstamped datums (the trainer's); a datum's own ``zerokld_numerics`` wins.
        loss_fn: ``cross_entropy`` needs only ``target_tokens`` (and ``weights``); any other loss needs
            ``advantages`` and ``logprobs``.

    Raises:
        ValueError: targets not next-token aligned, a per-token input of another length than ``model_input``,
            negative or non-finite weights (:class:`shared_numerics.RolloutBatch` refuses them, naming the rollout
            index = the datum index), missing RL inputs, ``ref_logprobs`` on some datums but not all, or datums
            stamped with different modes.
    """
    seqs, inputs = [], []
    for i, d in enumerate(data):
        x = _ids(d["model_input"])
        li = d.get("loss_fn_inputs", {})
        tgt = _ids(li["target_tokens"])
        n = len(x)
        if len(tgt) != n or tgt[:-1] != x[1:]:
            raise InvalidRequestError(f"datum {i}: target_tokens must be model_input shifted by one (length {n})")
        row = {key: _t(li[key]) if key in li else None for key in ("weights", "advantages", "logprobs", "ref_logprobs")}
        for key, value in row.items():
            if value is not None and value.numel() != n:
                raise InvalidRequestError(
                    f"datum {i}: loss_fn_inputs[{key!r}] has {value.numel()} values for {n} targets"
                )
        if row["weights"] is None:
            row["weights"] = torch.ones(n)
        row["routed_experts"] = li.get("routed_experts")
        seqs.append(x + [tgt[-1]])
        inputs.append(row)
    masks = None
    if loss_fn == "cross_entropy":
        # Tinker's -sum(weights * logprobs) with any finite weights, negative too (forward_backward_custom sends
        # -dLoss/dlogprobs): the weight is the formula's advantage, its non-zero pattern the loss mask
        for i, row in enumerate(inputs):
            if not bool(torch.isfinite(row["weights"]).all()):
                raise InvalidRequestError(f"datum {i}: weights must be finite")
        adv, q = [i["weights"] for i in inputs], None
        masks = [(i["weights"] != 0).float() for i in inputs]
    else:
        if any(i["advantages"] is None or i["logprobs"] is None for i in inputs):
            raise InvalidRequestError(f"loss {loss_fn!r} needs loss_fn_inputs 'advantages' and 'logprobs'")
        adv, q = [i["advantages"] for i in inputs], [i["logprobs"] for i in inputs]
    refs = [i["ref_logprobs"] for i in inputs]
    if any(r is None for r in refs) and any(r is not None for r in refs):
        raise InvalidRequestError("loss_fn_inputs 'ref_logprobs' must be given for every datum or for none")
    stamped = [d["zerokld_numerics"] for d in data if "zerokld_numerics" in d]
    return RolloutBatch(
        seqs,
        [1] * len(seqs),
        adv,
        q,
        _routes(inputs),
        numerics=common_numerics(stamped) if stamped else numerics,
        loss_weights=masks if masks is not None else [i["weights"] for i in inputs],
        ref_logprobs=None if refs[0] is None else refs,
    )


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
    def from_checkpoint(
        cls,
        checkpoint_dir: str,
        dtype: str = "bfloat16",
        learning_rate: float = 1e-4,
        fused: bool = True,
        dump_folder: str | None = None,
        max_norm: float = 1.0,
        batch_invariant: bool = True,
    ) -> TrainingClient:
        """Start a TorchTitan trainer on an HF checkpoint (``dtype``: the serving dtype of the forward;
        ``batch_invariant=False``: TorchTitan's stock numerics, for contrast)."""
        dump = dump_folder or str(Path(checkpoint_dir).resolve().parent / (Path(checkpoint_dir).name + "_train"))
        cfg = rl_trainer_config(
            checkpoint_dir,
            dump,
            dtype=dtype,
            lr=learning_rate,
            fused=fused and batch_invariant,
            max_norm=max_norm,
            batch_invariant=batch_invariant,
        )
        return cls(RLTrainer(cfg), dtype)

    @classmethod
    def create_lora(
        cls,
        checkpoint_dir: str,
        rank: int = 32,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = False,
        *,
        alpha: float = 32.0,
        max_rank: int = 0,
        dtype: str = "bfloat16",
        learning_rate: float = 1e-4,
        fused: bool = True,
        dump_folder: str | None = None,
        max_norm: float = 1.0,
    ) -> TrainingClient:
        """A LoRA training client on a frozen base checkpoint (Tinker's
        ``ServiceClient.create_lora_training_client(base_model, rank, seed, train_mlp, train_attn, train_unembed)``,
        ``tinker.types.LoraConfig``): adapters on the attention projections (q/k/v/o; MLA: q_a/q_b or q, kv_a, o —
        not kv_b) and/or the dense MLPs (gate/up/down; a MoE block's experts are not adapted),
        scaling ``alpha / rank``, zero-padded to ``max_rank`` (the engine's ``max_lora_rank``; 0: ``rank``);
        optimizer state for the adapters only. :meth:`save_weights_for_sampler` writes a PEFT adapter;
        ``forward(data, base_only=True)`` scores with the base model (reference log-probs).

        Args:
            seed: seeds TorchTitan's initialisation of ``lora_A`` (``debug.seed``); ``None``: TorchTitan's default.
            train_unembed: Tinker's lm_head adapter; not supported (the fused lm_head has no LoRA path).

        Raises:
            NotImplementedError: ``train_unembed=True``; a MoE checkpoint other than DeepSeek's.
            ValueError: neither ``train_mlp`` nor ``train_attn``; a switch with nothing to adapt (``train_mlp`` on a
                DeepSeek checkpoint without dense layers, ``first_k_dense_replace`` 0: set it False).
        """
        from .lora import lora_converter_config

        if train_unembed:
            raise UnsupportedRequestError("zerokld LoRA does not adapt the lm_head (train_unembed=False)")
        lora = lora_converter_config(
            rank=rank, alpha=alpha, train_attn=train_attn, train_mlp=train_mlp, max_rank=max_rank
        )
        dump = dump_folder or str(Path(checkpoint_dir).resolve().parent / (Path(checkpoint_dir).name + "_lora"))
        cfg = rl_trainer_config(
            checkpoint_dir, dump, dtype=dtype, lr=learning_rate, fused=fused, max_norm=max_norm, lora=lora
        )
        if seed is not None:
            cfg.debug.seed = seed
        return cls(RLTrainer(cfg), dtype)

    @property
    def is_lora(self) -> bool:
        """Whether this client trains LoRA adapters on a frozen base (:meth:`create_lora`)."""
        from .lora import lora_modules

        return bool(lora_modules(self.trainer.model))

    def _loss(self, loss_fn: str, loss_fn_config: dict | None) -> RLLoss:
        key = (loss_fn, tuple(sorted((loss_fn_config or {}).items())))
        if key not in self._losses:
            self._losses[key] = self.trainer.build_loss(loss_fn, loss_fn_config, normalization="sum")
        return self._losses[key]

    def _batch(self, data, loss_fn: str = "cross_entropy") -> RolloutBatch:
        if isinstance(data, RolloutBatch):
            return data
        return datums_to_rollouts(data, self.trainer.numerics, loss_fn)

    def forward(self, data: list[dict] | RolloutBatch, base_only: bool = False) -> dict:
        """Log-probs of every target token (no gradients): ``loss_fn_outputs[i]["logprobs"]`` float32 ``[n]``.
        ``base_only`` (a LoRA client): the frozen base model's — the reference log-probs to pass back as
        ``loss_fn_inputs["ref_logprobs"]`` with ``loss_fn_config={"kl_beta": ...}`` (k3 KL term)."""
        lps = self.trainer.forward_logprobs(self._batch(data), base_only=base_only)
        return {"loss_fn_outputs": [{"logprobs": lp} for lp in lps]}

    def forward_backward(
        self, data: list[dict] | RolloutBatch, loss_fn: str, loss_fn_config: dict | None = None
    ) -> dict:
        """Accumulate the gradient of ``loss_fn`` summed over the weighted tokens (Tinker: sum, no normaliser).
        Call it on micro-batches as they arrive: the accumulated gradients are bitwise those of one call on the
        concatenated data (:meth:`titan_plugin.rl.RLTrainer.forward_backward`)."""
        res = self.trainer.forward_backward(self._batch(data, loss_fn), loss=self._loss(loss_fn, loss_fn_config))
        return {
            "loss": res["loss"],
            "metrics": {"clipped": res["clipped"], "grad_zeroed": res["grad_zeroed"], "num_tokens": res["num_tokens"]},
            "loss_fn_outputs": [{"logprobs": lp} for lp in res["train_logprobs"]],
        }

    def forward_backward_custom(self, data: list[dict] | RolloutBatch, loss_fn) -> dict:
        """Two-pass custom loss (Tinker's): ``loss_fn(data, logprobs_list) -> (loss, metrics)``, ``logprobs_list[i]``
        float32 ``[n]`` with a gradient, one per target token of datum ``i``; the weights are the loss's to apply."""
        res = self.trainer.forward_backward_custom(self._batch(data), lambda lps: loss_fn(data, lps))
        return {
            "loss": res["loss"],
            "metrics": res["metrics"],
            "loss_fn_outputs": [{"logprobs": lp} for lp in res["train_logprobs"]],
        }

    def optim_step(self, adam_params: dict | None = None) -> dict:
        """Apply the accumulated gradients (AdamW). ``adam_params``: Tinker's ``AdamParams`` fields, each optional —
        ``learning_rate``, ``beta1`` / ``beta2``, ``eps``, ``weight_decay``, ``grad_clip_norm`` (0: no clipping);
        an absent field keeps the trainer's setting. Returns ``grad_norm``."""
        p = adam_params or {}
        betas = None
        if "beta1" in p or "beta2" in p:
            group = self.trainer.optimizers.optimizers[0].param_groups[0]
            betas = (float(p.get("beta1", group["betas"][0])), float(p.get("beta2", group["betas"][1])))
        return self.trainer.optim_step(
            learning_rate=p.get("learning_rate"),
            betas=betas,
            eps=p.get("eps"),
            weight_decay=p.get("weight_decay"),
            max_norm=p.get("grad_clip_norm"),
        )

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
        """What the vLLM side loads, returns its directory: a full HF snapshot (``reload_weights`` / a new engine),
        or for a LoRA client (:meth:`create_lora`) the PEFT adapter (``adapter_config.json`` +
        ``adapter_model.safetensors``) to serve on the base checkpoint (vLLM ``--enable-lora``)."""
        out = Path(self.trainer.config.dump_folder) / "sampler_weights" / name
        if self.is_lora:
            return str(self.trainer.save_lora(out, self.dtype))
        return str(self.trainer.save_hf(out, self.dtype))

    def close(self) -> None:
        self.trainer.close()
