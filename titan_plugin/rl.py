"""GRPO on TorchTitan's own ``Trainer`` (CPU, one process), with the zerokld model overrides.

:class:`RLTrainer` subclasses ``torchtitan.trainer.Trainer``: the model, optimizer, LR schedule, gradient clipping,
checkpointing (HF initial load through the model's state-dict adapter) and ``train_step`` are TorchTitan's. RL adds
only the data path: rollouts are queued into :class:`RolloutQueue` (a TorchTitan ``BaseDataLoader``) and the RL inputs
go to :class:`titan_plugin.losses.RLLoss`. :func:`rl_trainer_config` builds the ``Trainer.Config`` for an HF
checkpoint (source of the config layout: ``torchtitan/models/qwen3/config_registry.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
from torchtitan.components.optimizer.optimizer import default_adamw
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.trainer import Trainer

from shared_numerics.losses import CorrectionConfig, normalize_loss
from shared_numerics.mode import NumericsMode
from shared_numerics.rollout import IGNORE_INDEX as ROLLOUT_IGNORE_INDEX
from shared_numerics.rollout import RolloutBatch
from shared_numerics.settings import ZeroKLDSettings
from zerokld_models import ModelConfig, adapter_for, layer_plan, read_model_config
from zerokld_models.checkpoint import held_dtype
from zerokld_plugins.errors import InvalidRequestError, UnsupportedRequestError, ZeroKLDClientError

from . import cpu_compat
from .context_parallel import gather_sequence, local_positions, shard_sequence, with_context_parallel
from .exact_accumulation import ExactAccumulation, unsupported_reason
from .logprobs import completion_logprobs, logprob_scorer, sequence_logprobs
from .lora import ZeroKLDLoRAConverter, disable_adapter, keep_requires_grad, load_peft_adapter, save_peft_adapter
from .losses import RLLoss
from .models import hf_state_dict, state_dict_adapter_class, titan_model_config
from .pipeline import PipelineRunner, total_grad_norm
from .routing import counted_positions, pack_routes, replay_routes

__all__ = [
    "NonFiniteGradientError",
    "RLTrainer",
    "RolloutQueue",
    "numerics_mode",
    "rl_trainer_config",
]


class NonFiniteGradientError(ZeroKLDClientError, ValueError):
    """:meth:`RLTrainer.optim_step` refused a step whose gradients are not finite (NaN / inf: inputs that overflow
    the model's dtype); the gradients were discarded and the weights are as before."""


assert ROLLOUT_IGNORE_INDEX == IGNORE_INDEX, "RolloutBatch.pack labels must use TorchTitan's IGNORE_INDEX"


class RolloutQueue(BaseDataLoader):
    """A TorchTitan dataloader fed by the RL loop: each ``put`` is one ``(input_dict, labels)`` microbatch."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        pass

    def __init__(self, config: Config, **kwargs) -> None:
        self._items: list = []

    def put(self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor) -> None:
        self._items.append((input_dict, labels))

    def __iter__(self):
        while self._items:
            yield self._items.pop(0)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass


def numerics_mode(config) -> NumericsMode:
    """The trainer's :class:`shared_numerics.NumericsMode` from an ``RLTrainer.Config``: its ``zerokld`` settings
    (:meth:`shared_numerics.settings.ZeroKLDSettings.mode`), the forward dtype (``training.mixed_precision_param``)
    and the backend of TorchTitan's device type (on a CPU-only torch after :mod:`titan_plugin.cpu_compat`'s shims,
    applied here: the device the trainer will run on)."""
    cpu_compat.apply()
    from torchtitan.tools.utils import device_type

    return config.zerokld.mode(config.training.mixed_precision_param, device_type)


def _model_spec(cfg: ModelConfig, settings: ZeroKLDSettings, lora=None) -> ModelSpec:
    from zerokld_plugins import resolve

    batch_invariant = settings.batch_invariant
    model_cfg = titan_model_config(cfg, settings)
    adapter = adapter_for(cfg)
    parallelize = resolve(adapter.titan_parallelize)
    if batch_invariant:  # zerokld runs context parallelism itself (titan_plugin.context_parallel)
        parallelize = with_context_parallel(parallelize)
    if lora is not None:
        model_cfg = _apply_lora(model_cfg, lora, batch_invariant, layer_plan(cfg, adapter))
        parallelize = keep_requires_grad(parallelize)
    post_optimizer = None
    if any(getattr(layer, "moe", None) is not None for layer in model_cfg.layers):
        # TorchTitan's auxiliary-loss-free load balancing updates expert_bias_E; ZeroKLDMoE never routes by it
        from torchtitan.components.optimizer import register_moe_load_balancing_hook as post_optimizer
    return ModelSpec(
        name=cfg.architecture,
        flavor="hf",
        model=model_cfg,
        parallelize_fn=parallelize,
        pipelining_fn=resolve(adapter.titan_pipelining) if adapter.titan_pipelining else None,
        post_optimizer_build_fn=post_optimizer,
        state_dict_adapter=state_dict_adapter_class(cfg),
    )


def _apply_lora(model_cfg, lora, batch_invariant: bool, plan):
    """The model config with LoRA adapters: zerokld's converter (attention projections and dense MLPs; a MoE block's
    experts are not adapted), or (stock numerics, dense models only) TorchTitan's own with the same rank, alpha and
    targets. MoE models: those whose every MLP component is tested with zerokld's LoRA (DeepSeekMoE: the attention
    and the dense first layers adapted), with zerokld numerics."""
    routed = any(getattr(layer, "moe", None) is not None for layer in model_cfg.layers)
    if routed and not (batch_invariant and all(layer.mlp.component.lora for layer in plan)):
        raise UnsupportedRequestError(
            "zerokld LoRA on MoE models adapts DeepSeek's MLA projections and dense layers "
            "(zerokld numerics); MoE experts are not adapted"
        )
    if batch_invariant:
        return lora.build().convert(model_cfg)
    from torchtitan.components.lora import LoRAConverter

    stock = LoRAConverter.Config(rank=lora.rank, alpha=lora.alpha, target_modules=list(lora.target_modules))
    return stock.build().convert(model_cfg)


def rl_trainer_config(
    checkpoint_dir: str,
    dump_folder: str,
    dtype: str = "float32",
    lr: float = 1e-4,
    steps: int = 1000,
    batch_invariant: bool = True,
    loss_fn: str = "ppo",
    loss_fn_config: dict | None = None,
    max_norm: float = 1.0,
    fused: bool = False,
    fp8: str | None = None,
    corrections: dict | None = None,
    lora: ZeroKLDLoRAConverter.Config | None = None,
    tp_k_block: int | None = None,
    parallelism: ParallelismConfig | None = None,
    cpu_offload: bool = False,
    pipeline_parallel_microbatches: int | None = None,
    seq_len: int | None = None,
) -> RLTrainer.Config:
    """A TorchTitan ``Trainer.Config`` for GRPO on an HF checkpoint, on CPU, one process.

    Args:
        checkpoint_dir: absolute path of the HF checkpoint (loaded with ``initial_load_in_hf``).
        dump_folder: TorchTitan's output folder.
        dtype: the compute dtype of the forward, which must be the dtype vLLM serves (``"float32"`` or
            ``"bfloat16"``). Master weights and the optimizer stay float32 (``training.dtype``); FSDP's mixed-precision
            ``param_dtype`` (``training.mixed_precision_param``) casts them to ``dtype`` for the forward — the same
            round-to-nearest cast the exported snapshot gets, so the training forward sees exactly vLLM's weights.
        lr: AdamW learning rate (constant schedule, no warm-up).
        batch_invariant, fp8, tp_k_block: the :class:`shared_numerics.settings.ZeroKLDSettings` fields of the same
            names and defaults (vLLM's ``additional_config["zerokld"]`` spells them the same), stored whole as
            ``config.zerokld``. batch_invariant: swap in the zerokld numerics (otherwise TorchTitan's stock
            components; on CPU that needs the SDPA inner attention, since flex attention has no CPU path).
        loss_fn, loss_fn_config: a loss registered through the ``zerokld`` hooks (``ppo``, ``importance_sampling``,
            ``cross_entropy``, or a plugin's) and its config (Tinker names, e.g. ``clip_low_threshold``).
        fused: compute the completion tokens' log-probs with the fused lm_head (no ``[tokens, vocab]`` logits);
            needs ``batch_invariant=True``.
        fp8: FP8 quantization-aware training of the decoder projections (``"per_channel"`` or ``"block"``, the
            granularity vLLM serves with ``additional_config`` ``fp8``); ``None``: off. Needs ``batch_invariant``.
        corrections: :class:`shared_numerics.losses.CorrectionConfig` fields for the configured loss (``tis_cap``:
            truncated importance sampling, ``mis_low``/``mis_high``: masked importance sampling, ``kl_beta``), e.g.
            for stale rollouts in asynchronous RL; ``None``: off.
        lora: LoRA training (:func:`titan_plugin.lora.lora_converter_config`): frozen base, adapters on the
            targets, optimizer state for the adapters only; ``None``: full-parameter training. With
            ``batch_invariant=False``, TorchTitan's own ``LoRAConverter`` (stock ``F.linear`` adapters).
        tp_k_block: the TP-size-invariant row-parallel sum (vLLM's ``additional_config`` ``tp_k_block``), or ``None``.
        parallelism: TorchTitan's own ``ParallelismConfig`` (``torchtitan.config``), passed through (default: its
            defaults, one rank); run under ``torchrun`` with as many processes. zerokld sets three of its fields:
            ``enable_sequence_parallel`` off with the zerokld numerics (the activations stay replicated, so the
            norms' gain chains see every token in order, :mod:`titan_plugin.exact_accumulation`),
            ``context_parallel_load_balancer`` ``None`` (contiguous slices, :mod:`titan_plugin.context_parallel`) and,
            on more than one rank, ``spmd_backend`` ``"partial_dtensor"`` (DTensor on the model-parallel axes only:
            TorchTitan's default needs every parameter a DTensor on the full mesh before FSDP, which its CPU path
            does not provide). What each degree gives:
            ``tensor_parallel_degree`` (CPU: gloo): above 1 it needs ``tp_k_block`` (zerokld numerics); the log-probs,
            gradients and weights are TP 1's (at the same ``tp_k_block``) bit for bit — every sum TP splits is the
            fixed tree (:func:`titan_plugin.overrides.set_tp_k_block`; a layer whose rows ``tp_k_block`` does not
            divide per rank, e.g. an lm_head over an unpadded vocabulary, sums its input gradient stock, to rounding).
            ``expert_parallel_degree`` (EP borrowing the data-parallel ranks): each rank holds ``E / EP`` experts and
            exchanges token rows with the others (:mod:`titan_plugin.expert_parallel`); the log-probs are the same
            bits at any EP size. ``pipeline_parallel_degree``, ``pipeline_parallel_schedule``,
            ``pipeline_parallel_microbatch_size`` (:mod:`titan_plugin.pipeline`): with the zerokld numerics the
            schedule is one of :data:`titan_plugin.pipeline.EXACT_SCHEDULES` and the log-probs and the weights after
            :meth:`RLTrainer.rl_step` are one rank's bit for bit. ``context_parallel_degree``
            (:mod:`titan_plugin.context_parallel`): each rank scores a contiguous slice of every sequence, the keys
            and values all-gathered over the ``cp`` mesh dimension; the log-probs are CP 1's bit for bit, and in
            training (with or without data parallelism) the gradients and weights are one rank's (every rank runs the
            whole sequences' attention backward; exact accumulation replays the rollouts' passes in one rank's
            order; where exact accumulation is off, FSDP sums the ranks' gradients, one rank's to summation order).
            ``data_parallel_replicate_degree`` (HSDP: FSDP within each replica group, the replicas' gradients
            all-reduced; FSDP over the other ranks as ``data_parallel_shard_degree`` -1 takes them): exact
            accumulation hands the chains over every data-parallel rank, replicas included, so the weights are one
            rank's bit for bit.
        cpu_offload: TorchTitan's ``training.enable_cpu_offload``: FSDP2's ``CPUOffloadPolicy`` keeps the sharded
            float32 parameters, their gradients and the optimizer state in host memory and the optimizer step runs
            there; the forward and backward see the same ``dtype`` weights. On a CPU-only machine host memory is
            the device, so this covers the code path (the weights after N steps are the resident run's bit for
            bit, ``tests/test_titan.py``); on a GPU the same holds only if the host's AdamW step computes the
            device's bits.
        pipeline_parallel_microbatches: micro-batches per schedule step (default: twice the stages); one schedule
            step takes ``microbatches * microbatch_size`` rollouts (TorchTitan's ``training.local_batch_size``).
        seq_len: TorchTitan's ``training.seq_len`` (default: the model's ``max_position_embeddings``); under pipeline
            parallelism every rollout is padded to it (the schedule's shapes are fixed).

    Raises:
        shared_numerics.settings.ZeroKLDSettingsError: ``fp8`` or ``tp_k_block`` without ``batch_invariant``, an
            unknown granularity. ValueError: ``fused`` without ``batch_invariant``; ``lora`` with ``fp8``.
        NotImplementedError: ``lora`` on a MoE model other than DeepSeek's, or with stock numerics.
            ValueError: ``expert_parallel_degree`` on a dense model, or not dividing the expert count; a pipeline
            layout the zerokld trainer cannot keep exact (schedule, tied embeddings, too few layers); context
            parallelism on MLA or with TP, EP or PP; tensor parallelism on DeepSeekMoE without EP over the TP ranks.
    """
    parallelism = parallelism if parallelism is not None else ParallelismConfig()
    tensor_parallel_degree = parallelism.tensor_parallel_degree
    expert_parallel_degree = parallelism.expert_parallel_degree
    pipeline_parallel_degree = parallelism.pipeline_parallel_degree
    context_parallel_degree = parallelism.context_parallel_degree
    if fused and not batch_invariant:
        raise InvalidRequestError("fused log-probs need the zerokld lm_head (batch_invariant=True)")
    if lora is not None and fp8 is not None:
        raise InvalidRequestError("LoRA with FP8 QAT is not supported: the adapters would bypass the FP8 forward")
    if tensor_parallel_degree > 1 and batch_invariant and tp_k_block is None:
        raise InvalidRequestError("tensor_parallel_degree > 1 with the zerokld numerics needs tp_k_block")
    settings = ZeroKLDSettings.parse(
        dict(batch_invariant=batch_invariant, fp8=fp8, tp_k_block=tp_k_block), "rl_trainer_config settings"
    )
    cfg = read_model_config(checkpoint_dir)
    plan = layer_plan(cfg, adapter_for(cfg))
    experts_whole = any(layer.mlp.component.trainer_tp_needs_ep for layer in plan)
    if (
        tensor_parallel_degree > 1
        and batch_invariant
        and experts_whole
        and expert_parallel_degree != tensor_parallel_degree
    ):
        raise InvalidRequestError(
            f"tensor_parallel_degree {tensor_parallel_degree} on DeepSeekMoE: with expert_parallel_degree "
            f"{tensor_parallel_degree} only (TP x EP, each expert whole on its rank; experts split over their "
            f"intermediate size are not implemented), not {expert_parallel_degree}"
        )
    if expert_parallel_degree > 1:
        _check_expert_parallel(cfg, expert_parallel_degree, batch_invariant)
    microbatches = 1
    if pipeline_parallel_degree > 1:
        microbatches = _check_pipeline_parallel(
            cfg,
            pipeline_parallel_degree,
            parallelism.pipeline_parallel_schedule,
            pipeline_parallel_microbatches,
            batch_invariant,
        )
    if context_parallel_degree > 1 and batch_invariant:
        if not all(layer.mixer.component.context_parallel for layer in plan):
            raise InvalidRequestError(f"context_parallel_degree {context_parallel_degree}: not yet on MLA attention")
        if max(tensor_parallel_degree, expert_parallel_degree, pipeline_parallel_degree) > 1:
            raise InvalidRequestError(f"context_parallel_degree {context_parallel_degree} with TP, EP or PP: not yet")
    spec = _model_spec(cfg, settings, lora)
    ckpt = str(Path(checkpoint_dir).resolve())
    ranks = max(
        tensor_parallel_degree,
        expert_parallel_degree,
        pipeline_parallel_degree,
        context_parallel_degree,
        int(os.environ.get("WORLD_SIZE", "1")),  # FSDP alone (torchrun's ranks)
    )
    return RLTrainer.Config(
        model_spec=spec,
        zerokld=settings,
        hf_assets_path=ckpt,
        dump_folder=dump_folder,
        loss=RLLoss.Config(
            loss_fn=loss_fn, loss_fn_config=dict(loss_fn_config or {}), fused=fused, corrections=dict(corrections or {})
        ),
        dataloader=RolloutQueue.Config(),
        optimizer=default_adamw(lr=lr, weight_decay=0.0),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=0, decay_ratio=None),
        metrics=MetricsProcessor.Config(log_freq=1, enable_tensorboard=False),
        training=TrainingConfig(
            local_batch_size=microbatches * parallelism.pipeline_parallel_microbatch_size,
            seq_len=seq_len or cfg.max_position_embeddings,
            steps=steps,
            max_norm=max_norm,
            dtype="float32",
            mixed_precision_param=dtype,
            enable_cpu_offload=cpu_offload,
            # TorchTitan refuses CUDA graphs with its CPU-synchronising EP dispatcher and with pipeline parallelism
            disable_cuda_graphs=expert_parallel_degree > 1 or pipeline_parallel_degree > 1,
        ),
        parallelism=dataclasses.replace(
            parallelism,
            # zerokld TP keeps the activations replicated: the norms' gain chains then see every token in order
            # (titan_plugin.exact_accumulation); sequence parallelism would split them by the call's padded length
            enable_sequence_parallel=parallelism.enable_sequence_parallel and not batch_invariant,
            context_parallel_load_balancer=None,  # contiguous slices (titan_plugin.context_parallel)
            # more than one rank: DTensor on the model-parallel axes only (TorchTitan's default "spmd_types" needs
            # every parameter a DTensor on the full mesh before FSDP, which its CPU path does not provide)
            spmd_backend="partial_dtensor" if ranks > 1 else parallelism.spmd_backend,
        ),
        checkpoint=CheckpointManager.Config(
            enable=True,
            folder="checkpoint",
            initial_load_path=ckpt,
            initial_load_in_hf=True,
            initial_load_model_only=True,
            interval=10**9,
            last_save_model_only=False,
        ),
        activation_checkpoint=None,
        compile=CompileConfig(enable=False),
    )


def _check_expert_parallel(cfg: ModelConfig, degree: int, batch_invariant: bool) -> None:
    """Refuse an expert-parallel degree the model cannot take, before any process group exists: a dense model, an
    expert count that does not split evenly (TorchTitan's sharding would fail deep inside DTensor)."""
    if not cfg.num_experts:
        raise InvalidRequestError(f"expert_parallel_degree {degree}: {cfg.architecture} has no MoE experts")
    if cfg.num_experts % degree:
        raise InvalidRequestError(
            f"expert_parallel_degree {degree}: {cfg.num_experts} experts do not split evenly over {degree} ranks"
        )


def _check_pipeline_parallel(
    cfg: ModelConfig, degree: int, schedule: str, microbatches: int | None, batch_invariant: bool
) -> int:
    """Refuse a pipeline layout the zerokld trainer cannot keep exact, before any process group exists; the number of
    micro-batches per schedule step."""
    from .pipeline import EXACT_SCHEDULES

    if batch_invariant and schedule not in EXACT_SCHEDULES:
        raise InvalidRequestError(
            f"pipeline_parallel_schedule {schedule!r}: the zerokld trainer runs {', '.join(EXACT_SCHEDULES)} (each "
            "stage back-propagates its micro-batches in order; zero-bubble schedules defer weight gradients)"
        )
    if cfg.tie_word_embeddings:
        raise InvalidRequestError(
            f"pipeline_parallel_degree {degree}: tied embeddings put one weight on the first and the last stage"
        )
    stages = degree * (2 if schedule.startswith("Interleaved") else 1)
    if cfg.num_hidden_layers < stages:
        raise InvalidRequestError(
            f"pipeline_parallel_degree {degree}: {cfg.num_hidden_layers} layers for {stages} stages"
        )
    return microbatches or 2 * stages


def _sharded(t) -> bool:
    """A DTensor split over more than one rank (a tensor- or expert-parallel gradient)."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor) and any(p.is_shard() or p.is_partial() for p in t.placements)


def _rollout_tensors(batch: RolloutBatch, layout=None) -> tuple:
    """``batch.pack()`` and ``batch.pack_ref()`` as ``(tokens, labels, advantages, sampler log-probs, reference
    log-probs, weights)``, each ``[B, T]`` (the last three may be ``None``), passed through ``layout(t, pad_value)``
    when given (a chain layout, a pipeline's fixed shape, a context-parallel slice): padding takes token 0, no label,
    and zero for the rest."""
    tokens, labels, adv, q, weights = batch.pack()
    tensors = (tokens, labels, adv, q, batch.pack_ref(), weights)
    if layout is None:
        return tensors
    pad_values = (0, IGNORE_INDEX, 0.0, 0.0, 0.0, 0.0)
    return tuple(None if t is None else layout(t, v) for t, v in zip(tensors, pad_values, strict=True))


def _input_positions(batch: RolloutBatch, layout=None) -> torch.Tensor:
    """``[B, T]`` bool: the positions of ``batch.pack()``'s inputs that hold a rollout's token (``j < len(seq) - 1``;
    not padding), through ``layout(t, False)`` when given as :func:`_rollout_tensors`' tensors — the positions whose
    routes MoE load balancing counts (:func:`titan_plugin.routing.counted_positions`)."""
    t = max(len(s) for s in batch.sequences) - 1
    mask = torch.arange(t).unsqueeze(0) < torch.tensor([len(s) - 1 for s in batch.sequences]).unsqueeze(1)
    return mask if layout is None else layout(mask, False)


class RLTrainer(Trainer):
    """TorchTitan ``Trainer`` with a GRPO step fed from rollouts (``rl_step``) and HF export (``save_hf``).

    Every entry point that consumes rollouts takes a :class:`shared_numerics.RolloutBatch` and first checks its
    numerics against the trainer's (:attr:`numerics`): rollouts sampled by an engine in another mode raise
    :class:`shared_numerics.NumericsMismatchError` before any forward runs."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        zerokld: ZeroKLDSettings = field(default_factory=ZeroKLDSettings)  # the one settings object (both sides)

    def __init__(self, config: RLTrainer.Config) -> None:
        cpu_compat.apply()  # TorchTitan on a CPU-only torch (titan_plugin.cpu_compat): applied here, not on import
        cpu_compat.ensure_single_process_env()
        super().__init__(config)
        if not self.checkpointer.load():  # HF initial load (initial_load_in_hf) through the state-dict adapter
            raise RuntimeError(f"TorchTitan loaded no checkpoint from {config.hf_assets_path}")
        self._hf = read_model_config(config.hf_assets_path)
        self.numerics = numerics_mode(config)
        self._pending = None  # forward_backward since the last optim_step: (token_mean?, kept tokens)
        dtype = getattr(torch, config.training.mixed_precision_param)
        dims = self.parallel_dims
        # the chains are handed from data-parallel rank to rank (a rank's rollouts are whole: not under CP); under
        # context parallelism between all the cp and data-parallel ranks, pass by pass (one rollout's slices each)
        data_parallel = dims.get_optional_mesh("batch") if dims.dp_enabled and not dims.cp_enabled else None
        context_parallel = None
        if dims.cp_enabled:  # every data-parallel (replicas included) and cp rank: TorchTitan's loss mesh
            data_parallel = dims.get_mesh("loss") if dims.dp_enabled else dims.get_mesh("cp")
            context_parallel = (dims.get_mesh("cp"), dims.get_optional_mesh("batch") if dims.dp_enabled else None)
        reason = unsupported_reason(self.model_parts, dtype, data_parallel is not None)
        #: forward_backward's exact accumulation with batched passes (titan_plugin.exact_accumulation), or None:
        #: one rollout at a time (``exact_accumulation_off`` says why)
        self.exact_accumulation = (
            None if reason else ExactAccumulation(self.model_parts, dtype, data_parallel, context_parallel)
        )
        self.exact_accumulation_off = reason
        #: the pipeline schedule's driver (titan_plugin.pipeline) under pipeline parallelism, else None
        self.pipeline: PipelineRunner | None = None
        last = self.model_parts[-1]
        if self.parallel_dims.pp_enabled:
            pp_mesh = self.parallel_dims.get_mesh("pp")
            self.pipeline = PipelineRunner(
                self.pp_schedule,
                self.model_parts,
                pp_mesh.get_group(),
                pp_mesh.size() - 1,
                config.training.local_batch_size,
                config.training.seq_len,
                self.pp_has_first_stage,
                self.pp_has_last_stage,
            )
            if self.exact_accumulation is not None and config.training.seq_len % self.exact_accumulation.token_multiple:
                raise InvalidRequestError(
                    f"seq_len {config.training.seq_len} must be a multiple of "
                    f"{self.exact_accumulation.token_multiple} (exact accumulation's token steps)"
                )
        # its log-softmax (and, fused, the lm_head itself); a pipeline's other stages have none
        self.loss_fn.set_lm_head(getattr(last, "lm_head", None))
        if config.loss.fused and getattr(last, "lm_head", None) is not None:
            last._skip_lm_head = True  # the model returns final hidden states; the loss calls lm_head(h, targets=...)

    @property
    def model(self) -> torch.nn.Module:
        return self.model_parts[0]

    def _results(self) -> dict:
        last = self.loss_fn.last
        flat = last["train_logprobs"]
        per_seq = list(torch.split(flat, last["mask"].sum(dim=1).tolist()))
        return {
            "train_logprobs": per_seq,
            "clipped": int(last["clipped"].sum()),
            "grad_zeroed": int(last["grad_zeroed"].sum()),
            "num_tokens": int(last["weighted"].sum()),
            "loss": float(last["loss"]),
        }

    def _check(self, batch: RolloutBatch) -> None:
        """Sampled rollouts (sampler log-probs given) must come from an engine in the trainer's numerics mode."""
        if not isinstance(batch, RolloutBatch):
            raise TypeError(f"expected a shared_numerics.RolloutBatch, got {type(batch).__name__}")
        if batch.sampler_logprobs is not None:
            batch.check_numerics(self.numerics)

    def rl_step(self, batch: RolloutBatch) -> dict:
        """One optimizer step on a batch of rollouts through TorchTitan's ``train_step`` (the configured loss).

        Args:
            batch: sequences, prompt lengths, advantages (per rollout a scalar or a ``[completion]`` tensor),
                sampler log-probs (``None``: on-policy, e.g. SFT with ``cross_entropy`` and advantages 1) and, for MoE
                models, the routes to replay in the training forward (R3, :mod:`titan_plugin.routing`).

        Returns:
            ``train_logprobs`` (per rollout, the training forward's log-probs of the completion, float32),
            ``clipped`` / ``grad_zeroed`` token counts and ``num_tokens`` (completion tokens with a positive loss
            weight), ``loss`` (the step's loss, float).

        Raises:
            shared_numerics.NumericsMismatchError: the rollouts were sampled in another numerics mode (nothing ran).
        """
        self._check(batch)
        exact = self.exact_accumulation
        streamed = exact is not None and exact.data_parallel is not None  # the chains' data-parallel hand-off
        if self.pipeline is not None or self.parallel_dims.cp_enabled or streamed:  # forward_backward + optim_step
            self.zero_grad()
            result = self.forward_backward(batch)
            self.optim_step()
            return result
        self._pending = None  # train_step zeroes the gradients forward_backward accumulated
        if self.exact_accumulation is not None:
            self.exact_accumulation.reset()
        t_pack = time.perf_counter()
        tokens, labels, adv, q, weights = batch.pack()
        self.loss_fn.clear_rl_inputs()
        self.loss_fn.set_rl_inputs(
            adv, None if batch.sampler_logprobs is None else q, batch.pack_ref(), weights=weights
        )
        self.dataloader.put({"input": tokens}, labels)
        self.step += 1
        # Trainer.train() records data-loading time per step; the metrics logger averages it.
        self.metrics_processor.data_loading_times.append(time.perf_counter() - t_pack)
        self.metrics_processor.ntokens_since_last_log += int((labels != IGNORE_INDEX).sum())
        with replay_routes(self.model, self._routes(batch, tokens.shape[1])), self._counted([_input_positions(batch)]):
            self.train_step(iter(self.dataloader))
        return self._results()

    @staticmethod
    def _routes(batch: RolloutBatch, seq_len: int):
        return None if batch.routed_experts is None else pack_routes(batch.routed_experts, seq_len)

    @contextlib.contextmanager
    def _counted(self, masks: list[torch.Tensor]):
        """MoE load balancing counts the routes of the rollouts' tokens alone (``masks``: one ``[B, T]`` per training
        forward, :func:`titan_plugin.routing.counted_positions`) in every model part of this rank."""
        with contextlib.ExitStack() as stack:
            for part in self.model_parts:
                stack.enter_context(counted_positions(part, masks))
            yield

    @torch.no_grad()
    def forward_logprobs(self, batch: RolloutBatch, base_only: bool = False) -> list[torch.Tensor]:
        """The training forward's completion log-probs (float32, per rollout), without gradients or an update
        (the batch's routes replayed, as in :meth:`rl_step`; its numerics checked likewise).

        ``base_only``: a LoRA trainer's base model alone (:func:`titan_plugin.lora.disable_adapter`): the reference
        log-probs of the k3 KL term (``RolloutBatch.ref_logprobs``, ``corrections={"kl_beta": ...}``), bitwise a
        full-parameter trainer's on the base checkpoint.

        Raises:
            ValueError: ``base_only`` on a trainer without LoRA adapters.
        """
        self._check(batch)
        if self.pipeline is not None:
            return self._pipeline_logprobs(batch)
        if self.parallel_dims.cp_enabled:
            return self._context_parallel_logprobs(batch)
        ctx = disable_adapter(self.model) if base_only else contextlib.nullcontext()
        with ctx:
            return sequence_logprobs(
                self.model,
                batch.sequences,
                batch.prompt_lengths,
                fused=self.config.loss.fused,
                routed_experts=batch.routed_experts,
            )

    def _context_parallel_logprobs(self, batch: RolloutBatch) -> list[torch.Tensor]:
        """:meth:`forward_logprobs` under context parallelism (:mod:`titan_plugin.context_parallel`): this rank's
        contiguous slice of every sequence through the model (global positions for RoPE), each position's next-token
        log-prob scored there, the slices gathered over the ``cp`` mesh dimension."""
        mesh = self.parallel_dims.get_mesh("cp")
        tokens = batch.padded_tokens(0)
        targets = torch.nn.functional.pad(tokens[:, 1:], (0, 1))  # position p scores token p + 1
        local, local_targets = shard_sequence(tokens, mesh), shard_sequence(targets, mesh)
        positions = local_positions(local.shape[1], mesh)
        routes = self._routes(batch, tokens.shape[1])
        with replay_routes(self.model, None if routes is None else shard_sequence(routes, mesh)):
            out = self.model(local, positions=positions)
        lm_head, rows = self.model.lm_head, local_targets.reshape(-1)
        if self.config.loss.fused:
            scores = lm_head(lm_head.fused_input(out).reshape(rows.numel(), -1), targets=rows)
        else:
            logits, score = logprob_scorer(out, lm_head)
            scores = score(logits.reshape(rows.numel(), -1), rows)
        every = gather_sequence(scores.reshape(local_targets.shape), mesh)
        return [
            every[i, p - 1 : len(s) - 1]
            for i, (s, p) in enumerate(zip(batch.sequences, batch.prompt_lengths, strict=True))
        ]

    def _context_parallel_forward_backward(self, batch: RolloutBatch, loss: RLLoss) -> list[dict]:
        """:meth:`forward_backward` under context parallelism: this rank's contiguous slice of every rollout (tokens,
        labels, the loss's RL inputs, routes) forward and backward, every rank running the whole sequences'
        attention and its backward (:func:`titan_plugin.context_parallel.cp_attention`). With exact accumulation
        (:class:`titan_plugin.exact_accumulation.ExactAccumulation` ``context_parallel``): one rollout per pass,
        every pass recorded and replayed in one rank's token order (data-parallel group by group, rollout by rollout,
        cp rank by rank), so the gradients are one rank's bits; else one pass of every rollout, FSDP summing the
        parameter gradients over the ranks (one rank's up to summation order).
        Returns the loss records, their per-position tensors whole again (gathered over ``cp``), their counts summed
        over the ranks."""
        if loss.config.loss_fn == "gspo":
            raise UnsupportedRequestError("GSPO under context parallelism: its sequence-level ratio spans the cp ranks")
        mesh = self.parallel_dims.get_mesh("cp")
        exact = self.exact_accumulation
        if exact is None:
            return [self._context_parallel_pass(batch, loss, mesh)]
        parts = []
        for i in range(len(batch)):  # one rollout per pass (replayed in one rank's order by write_grads)
            exact.attach()
            try:
                parts.append(self._context_parallel_pass(batch.select([i]), loss, mesh, exact.token_multiple))
            finally:
                exact.detach()
        return parts

    def _context_parallel_pass(self, batch: RolloutBatch, loss: RLLoss, mesh, multiple: int = 1) -> dict:
        """One forward and backward of this rank's slices of ``batch`` (each sequence padded to a multiple of
        ``multiple`` positions per rank): its loss record, whole again."""
        import torch.distributed as dist

        def layout(t, v):  # dim 1 padded to a multiple of multiple x cp, then this rank's slice
            pad = [0, 0] * (t.dim() - 2) + [0, -t.shape[1] % (multiple * mesh.size())]
            return shard_sequence(torch.nn.functional.pad(t, pad, value=v), mesh, v)

        tokens, labels, adv, q, ref, weights = _rollout_tensors(batch, layout)
        positions = local_positions(tokens.shape[1], mesh)
        routes = self._routes(batch, batch.padded_tokens(0).shape[1])
        loss.clear_rl_inputs()
        loss.set_rl_inputs(adv, None if batch.sampler_logprobs is None else q, ref, weights=weights)
        counted = [layout(_input_positions(batch), False)]
        with (
            replay_routes(self.model, None if routes is None else layout(routes, 0)),
            self._counted(counted),
        ):
            out, _ = loss(self.model(tokens, positions=positions), labels)  # summed: divided at optim_step
        out.backward()
        last = loss.last
        mask = last["mask"]
        per_position = {}
        for key in ("train_logprobs", "token_losses", "weighted", "clipped", "grad_zeroed"):
            full = torch.zeros(mask.shape, dtype=last[key].dtype)
            full[mask] = last[key]
            per_position[key] = gather_sequence(full, mesh)
        whole = gather_sequence(mask, mesh)
        kept = torch.tensor(last["kept"])
        dist.all_reduce(kept, group=mesh.get_group())
        return {**{k: v[whole] for k, v in per_position.items()}, "mask": whole, "kept": int(kept)}

    def _count_over_ranks(self, kept: int) -> int:
        """``kept`` summed over the data-parallel ranks: each rank's ``token_mean`` divides its gradient shard by
        the whole batch's kept tokens."""
        import torch.distributed as dist

        mesh = self.parallel_dims.get_optional_mesh("batch") if self.parallel_dims.dp_enabled else None
        if mesh is None:
            return kept
        total = torch.tensor(kept)
        dist.all_reduce(total, group=mesh.get_group())
        return int(total)

    def _pipeline_logprobs(self, batch: RolloutBatch) -> list[torch.Tensor]:
        """:meth:`forward_logprobs` through the pipeline schedule (forward only), scored on the last stage and
        shared with every rank."""
        if batch.routed_experts is not None:
            raise UnsupportedRequestError("routing replay (R3) under pipeline parallelism is not supported yet")
        pipe = self.pipeline
        tokens = pipe.pad(batch.padded_tokens(0), 0)
        outputs = [pipe.forward(tokens[chunk]) for chunk in pipe.chunks(tokens.shape[0])]
        result = None
        if pipe.last:
            result = completion_logprobs(
                torch.cat(outputs),
                tokens,
                batch.sequences,
                batch.prompt_lengths,
                self.model_parts[-1].lm_head,
                fused=self.config.loss.fused,
            )
        return pipe.share(result)

    def _pipeline_forward_backward(self, batch: RolloutBatch, loss: RLLoss) -> list[dict]:
        """:meth:`forward_backward` through the pipeline schedule: the batch in ``local_batch_size`` chunks, each
        one schedule step of micro-batches; every stage's chains continue across them in batch order. Returns the
        loss's records of the real rows (every rank: the last stage's)."""
        if batch.routed_experts is not None:
            raise UnsupportedRequestError("routing replay (R3) under pipeline parallelism is not supported yet")
        exact, pipe = self.exact_accumulation, self.pipeline
        if exact is None and self.config.zerokld.batch_invariant:
            raise UnsupportedRequestError(
                "training under pipeline parallelism needs exact accumulation (its micro-batches' gradients would "
                f"otherwise depend on the schedule): {self.exact_accumulation_off}"
            )
        tokens, labels, adv, q, ref, weights = _rollout_tensors(batch, pipe.pad)
        counted = _input_positions(batch, pipe.pad)
        records: list[dict] = []

        def scored(pred, target, **kwargs):
            out, _ = loss(pred, target)  # no global_valid_tokens: summed, divided at optim_step (token_mean)
            records.append(loss.last)
            return out

        mb = self.config.parallelism.pipeline_parallel_microbatch_size
        for chunk in pipe.chunks(tokens.shape[0]):
            loss.clear_rl_inputs()
            for i in range(chunk.start, chunk.stop, mb):
                sl = slice(i, i + mb)
                loss.set_rl_inputs(
                    adv[sl],
                    None if batch.sampler_logprobs is None else q[sl],
                    None if ref is None else ref[sl],
                    weights=None if weights is None else weights[sl],
                )
            try:
                pipe.prepare(tokens[chunk], labels[chunk], RLLoss.metadata_loss)  # its forward counts no routes
                with self._counted([counted[i : i + mb] for i in range(chunk.start, chunk.stop, mb)]):
                    pipe.train(
                        tokens[chunk],
                        labels[chunk],
                        scored,
                        RLLoss.metadata_loss,
                        attach=None if exact is None else exact.attach,
                    )
            finally:
                loss.clear_rl_inputs()
                if exact is not None:
                    exact.detach()
        keys = ("train_logprobs", "mask", "weighted", "kept", "token_losses", "clipped", "grad_zeroed")
        return pipe.share([{k: r[k] for k in keys} for r in records] if pipe.last else None)

    def build_loss(self, loss_fn: str, loss_fn_config: dict | None = None, normalization: str = "token_mean") -> RLLoss:
        """An :class:`RLLoss` for this trainer (fused like the configured loss, the model's lm_head
        attached: it names the log-softmax, and fused it computes the log-probs).
        ``loss_fn_config`` may also hold :class:`shared_numerics.losses.CorrectionConfig` fields (``kl_beta``,
        ``tis_cap``, ``mis_low``, ``mis_high``): they go to the loss's corrections."""
        config = dict(loss_fn_config or {})
        corrections = {k: config.pop(k) for k in CorrectionConfig.model_fields if k in config}
        loss = RLLoss.Config(
            loss_fn=loss_fn,
            loss_fn_config=config,
            fused=self.config.loss.fused,
            normalization=normalization,
            corrections=corrections,
        ).build()
        loss.set_lm_head(self.model.lm_head)
        return loss

    def forward_backward(self, batch: RolloutBatch, loss: RLLoss | None = None) -> dict:
        """Accumulate gradients of ``loss`` (default: the configured one) through TorchTitan's
        ``forward_backward_step``; no optimizer step (see :meth:`optim_step`).

        Streaming, exact: calls on consecutive micro-batches, made as each arrives, leave exactly the ``.grad`` bits
        of one call on their concatenation, whatever the grouping. (TorchTitan's own accumulation back-propagates
        each micro-batch in one batched backward, whose reductions over tokens depend on the grouping.) Two ways:

        * batched (:attr:`exact_accumulation` set; zerokld models — dense, MoE with or without replayed routes,
          LoRA, FP8 QAT — on CPUs whose kernels cover the dtype, :mod:`titan_plugin.exact_accumulation`): one
          forward and backward of the call's rollouts, every gradient element one float32 chain over the tokens in
          batch order that the next call continues (:mod:`shared_numerics.grad_chain`). The batch layout is
          right-padded to a multiple of ``exact_accumulation.token_multiple`` positions. Under data parallelism
          (FSDP) each rank passes its own rollouts; the call's batch is their concatenation in data-parallel rank
          order, and the chains are handed from rank to rank: one rank's gradient bits, and :meth:`optim_step`
          takes one rank's gradient norm of them.
        * under pipeline parallelism (:mod:`titan_plugin.pipeline`): the batched way through the schedule's
          micro-batches, each stage's chains continued in micro-batch order — one rank's bits; refused where exact
          accumulation is off.
        * under context parallelism (:mod:`titan_plugin.context_parallel`): one pass per rollout of this rank's
          slices, every pass replayed in one rank's token order (one rank's bits); where exact accumulation is off,
          one pass of every rollout, FSDP summing the ranks' gradients (summation order).
        * one rollout at a time (elsewhere; :attr:`exact_accumulation_off` says why): each rollout's forward and
          backward run alone (the forward is batch-invariant: the same log-prob bits as in any batch) and autograd
          adds its contribution into ``.grad`` in batch order.

        The two ways give different bits (each is exact across groupings). ``token_mean`` divides by the kept tokens
        of the whole accumulated batch, which a stream knows only at its end: the rollouts back-propagate the summed
        token losses and :meth:`optim_step` divides the accumulated gradients by the kept tokens counted since the
        previous step — over every data-parallel rank, since FSDP sums their gradients. ``sum`` (Tinker's) and
        ``constant`` need no deferral.

        Returns:
            Like :meth:`rl_step`; ``loss`` is this call's (summed token losses, ``token_mean``: divided by this
            call's kept tokens, ``constant``: by the normaliser).

        Raises:
            shared_numerics.NumericsMismatchError: the rollouts were sampled in another numerics mode (nothing ran).
            ValueError: a ``token_mean`` loss and another normalisation accumulated into one optimizer step; under
                pipeline parallelism, a rollout longer than ``seq_len``.
            NotImplementedError: under pipeline parallelism, routes to replay (R3), or the zerokld numerics without
                exact accumulation; under context parallelism, GSPO (its sequence ratio spans ranks); nothing ran.
        """
        self._check(batch)
        loss = loss or self.loss_fn
        token_mean = loss.config.normalization == "token_mean"
        if self._pending is not None and self._pending[0] != token_mean:
            raise InvalidRequestError(
                "one optimizer step accumulates either token_mean losses or sum/constant ones, not both"
            )
        exact = self.exact_accumulation
        configured, parts = self.loss_fn, []
        self.loss_fn = loss
        try:
            if self.pipeline is not None:  # the schedule's micro-batches (titan_plugin.pipeline)
                parts, groups = self._pipeline_forward_backward(batch, loss), []
            elif self.parallel_dims.cp_enabled:  # the sequences split over the cp ranks
                parts, groups = self._context_parallel_forward_backward(batch, loss), []
            else:
                groups = [batch] if exact is not None else [batch.select([i]) for i in range(len(batch))]
            chain_layout = None
            if exact is not None:  # the chains' layout: a multiple of token_multiple positions per rollout

                def chain_layout(t, v, multiple=exact.token_multiple):
                    return torch.nn.functional.pad(t, (0, -t.shape[1] % multiple), value=v)

            for one in groups:
                tokens, labels, adv, q, ref, weights = _rollout_tensors(one, chain_layout)
                if exact is not None:
                    exact.attach()
                loss.clear_rl_inputs()
                loss.set_rl_inputs(adv, None if one.sampler_logprobs is None else q, ref, weights=weights)
                try:
                    counted = [_input_positions(one, chain_layout)]
                    with replay_routes(self.model, self._routes(one, tokens.shape[1])), self._counted(counted):
                        self.forward_backward_step(
                            input_dict={"input": tokens}, labels=labels, global_valid_tokens=None
                        )
                finally:
                    if exact is not None:
                        exact.detach()
                parts.append(loss.last)
            if exact is not None:  # every path's chains (under data or context parallelism after their hand-off)
                exact.write_grads()
        finally:
            self.loss_fn = configured
        kept = sum(p["kept"] for p in parts)
        # the whole batch's, for optim_step (a pipeline's stages share the last stage's counts; cp ranks summed
        # theirs): summed over the data-parallel ranks
        batch_kept = self._count_over_ranks(kept)
        self._pending = (token_mean, batch_kept + (self._pending[1] if self._pending else 0))
        summed = torch.cat([p["token_losses"] for p in parts]).sum()
        return {
            "train_logprobs": [
                lp for p in parts for lp in torch.split(p["train_logprobs"], p["mask"].sum(dim=1).tolist())
            ][: len(batch)],  # a pipeline's padding rows score nothing
            "clipped": sum(int(p["clipped"].sum()) for p in parts),
            "grad_zeroed": sum(int(p["grad_zeroed"].sum()) for p in parts),
            "num_tokens": sum(int(p["weighted"].sum()) for p in parts),
            "loss": float(normalize_loss(summed, loss.config.normalization, kept, loss.config.normalizer)),
        }

    def forward_backward_custom(self, batch: RolloutBatch, loss_fn) -> dict:
        """Two-pass custom loss: pass 1 computes the log-probs, ``loss_fn(logprobs_list) -> (loss, metrics)`` (any
        differentiable Python; one ``[len(seq) - p]`` float32 tensor per rollout, every completion token whatever
        its loss weight — the batch's ``loss_weights`` are the user's to apply) gives ``dL/dl``, pass 2
        back-propagates ``sum(dL/dl * l)`` through the model (exact gradient, ~1.5x the FLOPs of a fused loss).
        Gradients accumulate; no optimizer step.

        Returns:
            ``loss`` (float), ``metrics`` (the user's), ``train_logprobs`` (pass 1, float32 per rollout).
        """
        lps = [lp.clone().requires_grad_(True) for lp in self.forward_logprobs(batch)]
        loss, metrics = loss_fn(lps)
        grads = torch.autograd.grad(loss, lps, allow_unused=True)
        weights = [-(g if g is not None else torch.zeros_like(lp)) for g, lp in zip(grads, lps, strict=True)]
        on_policy = dataclasses.replace(batch, advantages=weights, sampler_logprobs=None, loss_weights=None)
        self.forward_backward(on_policy, loss=self.build_loss("cross_entropy", normalization="sum"))
        return {"loss": float(loss), "metrics": metrics, "train_logprobs": [lp.detach() for lp in lps]}

    def optim_step(
        self,
        learning_rate: float | None = None,
        betas: tuple[float, float] | None = None,
        eps: float | None = None,
        weight_decay: float | None = None,
        max_norm: float | None = None,
    ) -> dict:
        """Clip the accumulated gradients (``max_norm``, default ``training.max_norm``; 0: no clipping), step the
        optimizer and the LR schedule, zero the gradients. A non-finite gradient norm refuses the step: the
        gradients are discarded and :class:`NonFiniteGradientError` raised, the weights untouched. ``learning_rate``,
        ``betas``, ``eps``, ``weight_decay``: set on every parameter group from this step on (``None``: unchanged;
        Tinker's ``AdamParams``). Returns ``grad_norm`` (before clipping)."""
        from torchtitan.distributed import utils as dist_utils

        settings = {"lr": learning_rate, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        for opt in self.optimizers.optimizers:
            for group in opt.param_groups:
                group.update({k: v for k, v in settings.items() if v is not None})
        params = [p for m in self.model_parts for p in m.parameters()]
        divided = None
        if self._pending is not None and self._pending[0]:  # forward_backward's deferred token_mean
            divided = max(1, self._pending[1])
            for p in params:
                if p.grad is not None:
                    p.grad.div_(divided)
        self._pending = None
        norm = self.config.training.max_norm if max_norm is None else max_norm
        norm = norm if norm > 0 else float("inf")
        exact = self.exact_accumulation
        whole = None if exact is None else exact.full_grads(params, divided)  # data parallelism: on every rank
        if whole is None and exact is not None and any(_sharded(p.grad) for p in params):  # TP, TP x EP
            whole = [p.grad for p in params if p.grad is not None]
        if whole is not None or (self.pipeline is not None and exact is not None):  # the one-rank norm
            grads = whole if whole is not None else [p.grad for p in params if p.grad is not None]
            if self.pipeline is not None:  # every stage's (titan_plugin.pipeline)
                grad_norm = total_grad_norm(grads, self.pipeline.group)
            else:  # TorchTitan's, on one rank: model-parallel shards gathered whole (their norms' sums would differ)
                grads = [g.full_tensor() if hasattr(g, "full_tensor") else g for g in grads]
                grad_norm = torch.nn.utils.get_total_norm(grads, 2.0, False, True)
            from torch.distributed.tensor.experimental import implicit_replication

            meshes: dict = {}  # a DTensor foreach op takes one mesh: FSDP shards, EP experts (TorchTitan EP clip)
            for p in params:
                meshes.setdefault(id(getattr(p, "device_mesh", None)), []).append(p)
            with implicit_replication():  # the norm is a plain tensor, the sharded gradients DTensors
                for group in meshes.values():  # elementwise: the grouping does not change a bit
                    torch.nn.utils.clip_grads_with_norm_(group, norm, grad_norm, foreach=True)
        else:  # TorchTitan's (train_step's call)
            pp_mesh = self.parallel_dims.get_mesh("pp") if self.pipeline is not None else None
            grad_norm = dist_utils.clip_grad_norm_(
                params, norm, foreach=True, pp_mesh=pp_mesh, ep_enabled=self.parallel_dims.ep_enabled
            )
        if not math.isfinite(float(grad_norm)):  # a NaN / inf gradient would make every weight it touches NaN
            self.zero_grad()
            raise NonFiniteGradientError(
                f"the accumulated gradients' norm is {float(grad_norm)}: the step was "
                "refused and its gradients discarded; the weights are unchanged"
            )
        self.optimizers.step()
        self.lr_schedulers.step()
        self.zero_grad()
        self.step += 1
        return {"grad_norm": float(grad_norm)}

    def zero_grad(self) -> None:
        """Discard what :meth:`forward_backward` accumulated since the last :meth:`optim_step` (which ends with this):
        the parameters' gradients (TorchTitan's ``optimizers.zero_grad``), the exact-accumulation chains they were
        read from, and the deferred ``token_mean`` count."""
        self.optimizers.zero_grad()
        if self.exact_accumulation is not None:
            self.exact_accumulation.reset()
        self._pending = None

    def close(self) -> None:
        """TorchTitan's cleanup plus the process group, so another trainer can start in this process."""
        super().close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    def hf_weights(self, dtype: str) -> dict[str, torch.Tensor]:
        """The current weights under HF names, cast to ``dtype`` (what a snapshot ships; CPU tensors) — but the
        tensors the models hold in float32 (:func:`zerokld_models.checkpoint.held_dtype`: DeepSeekMoE's selection
        bias), which stay float32 whatever dtype the checkpoint stores them in: the trainer routes with its float32
        buffer (updated by TorchTitan's load balancing) and the server must route with the same bits."""
        torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
        return {
            k: v.to(held_dtype(k, torch_dtype))
            for k, v in hf_state_dict(
                self.model_parts, self.model_config, self._hf, None if self.pipeline is None else self.pipeline.group
            ).items()
        }

    def save_hf(self, out_dir: str | Path, dtype: str) -> Path:
        """Publish the current weights as a full HF snapshot directory (:func:`deltasync.write_full_snapshot`; config
        and tokenizer copied from the initial checkpoint)."""
        from deltasync import write_full_snapshot

        return write_full_snapshot(self.hf_weights(dtype), self.config.hf_assets_path, out_dir)

    def save_lora(self, out_dir: str | Path, dtype: str) -> Path:
        """Publish the LoRA adapters as a PEFT adapter directory (:func:`titan_plugin.lora.save_peft_adapter`; HF
        module names, ``dtype`` casts) that vLLM serves on the base checkpoint.

        Raises:
            ValueError: the trainer has no LoRA adapters."""
        return save_peft_adapter(
            self.model,
            state_dict_adapter_class(self._hf)(self.model_config, None),
            out_dir,
            dtype,
            base_model_name_or_path=str(self.config.hf_assets_path),
        )

    def load_lora(self, adapter_dir: str | Path) -> None:
        """Load a PEFT adapter directory into this LoRA trainer's adapters (:func:`titan_plugin.lora.load_peft_adapter`:
        same rank, alpha and targets); the optimizer state is left as it is.

        Raises:
            ValueError: no LoRA adapters, or an adapter that does not fit them (nothing loaded)."""
        load_peft_adapter(self.model, state_dict_adapter_class(self._hf)(self.model_config, None), adapter_dir)

    def save_fp8(self, out_dir: str | Path, dtype: str, granularity: str = "per_channel") -> Path:
        """Export the current weights as the FP8 serving checkpoint
        (:func:`zerokld_models.fp8_export.export_fp8_checkpoint` of the ``dtype`` snapshot ``save_hf`` writes):
        vLLM serving it computes exactly this trainer's FP8 QAT forward."""
        import tempfile

        from zerokld_models.fp8_export import export_fp8_checkpoint

        with tempfile.TemporaryDirectory(prefix="zerokld-fp8-") as tmp:
            src = self.save_hf(Path(tmp) / "hf", dtype)
            return export_fp8_checkpoint(src, out_dir, granularity)
