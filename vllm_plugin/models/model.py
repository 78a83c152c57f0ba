"""The one vLLM model class of every declared architecture with the zerokld switch on: :class:`ZeroKLDForCausalLM`,
built from the checkpoint's layer plan (:func:`zerokld_models.layer_plan`).

vLLM keeps its own class for each architecture in its registry (the stock model); the ``initialize_model`` seam
(:mod:`vllm_plugin.register`) builds this class instead when the engine's ``additional_config={"zerokld":
{"batch_invariant": true}}`` is on and a ``zerokld`` model adapter declares the architecture, so the choice between
stock and zerokld numerics is made once, where vLLM builds the model.

Per layer, the token mixer's vLLM face (:data:`MIXER_LAYERS`: grouped-query attention over vLLM's paged K/V cache,
:class:`vllm_plugin.models.dense.GQALayer`; MLA and DSA over a latent cache, :class:`vllm_plugin.models.mla.MLALayer`)
with the MLP's (:func:`vllm_plugin.models.moe.mlp_module`: dense SwiGLU, :class:`~vllm_plugin.models.moe.MoEBlock`,
:class:`~vllm_plugin.models.moe.DeepSeekMoEBlock`), on one residual stream: ``h = E[ids]``; per layer ``h, f =
add_rms_norm(h, mixer(rms_norm(h)))``, ``h = h + mlp(f)`` (each add fused with the next norm); ``rms_norm`` and
``linear(h, W_lm)``. The sampler's ``compute_logprobs`` becomes :func:`shared_numerics.log_softmax` (with
``tp_k_block``: the vocab-parallel definition, :func:`shared_numerics.vocab_parallel.log_softmax`).

Routed-expert capture (vLLM's ``enable_return_routed_experts``): each computed token's expert ids (``[routed layers,
top_k]``, int16) go into :class:`vllm_plugin.models.moe.RouteCache` at the token's KV-cache slot, read per request by
:mod:`vllm_plugin.routing`.

Weights keep HF names (``model.layers.N.self_attn.q_proj.weight``, ``mlp.experts.{e}.gate_proj.weight`` stacked per
layer ...), so vLLM's loader feeds a HF checkpoint straight in; ``load_weights`` goes through each parameter's
``weight_loader`` so ``reload_weights`` works in place. Source: vLLM ``model_executor/models/qwen3.py`` /
``deepseek_v2.py`` (the classes it replaces), ``model_loader/utils.py`` (``initialize_model``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.model_executor.models.interfaces import SupportsLoRA

import shared_numerics as sn
import shared_numerics.fp8 as sn_fp8
from shared_numerics.fp8_checkpoint import QUANT_METHOD
from zerokld_models import layer_plan
from zerokld_models.mixers import GQA, MLA, GatedDeltaNet
from zerokld_plugins import get_model_adapter

from ..config import ZeroKLDConfigError, from_vllm_config
from ..faults import copy_fault, step_delay
from ..sampler import set_logprobs_definition
from ..start import check_model_settings
from ..support import is_zerokld_fp8
from .dense import Fp8Mode, GQALayer, TensorParallel, _norm, _param, _Proj, norm_gain
from .gated_deltanet import GatedDeltaNetLayer
from .mla import MLALayer
from .moe import RouteCache, expert_tensor, mlp_module

__all__ = ["MIXER_LAYERS", "Decoder", "ZeroKLDForCausalLM"]

#: each token mixer component's vLLM layer: ``(ModelConfig, plan TokenMixer, vllm_config, prefix, Fp8Mode, MLP module,
#: lora, TensorParallel) ->`` a :class:`vllm_plugin.models.dense.ResidualLayer` (its ``rotary_dim``: the RoPE width
#: it rotates, ``None`` for a recurrent mixer)
MIXER_LAYERS = {GQA: GQALayer, MLA: MLALayer, GatedDeltaNet: GatedDeltaNetLayer}


class Decoder(nn.Module):
    """The decoder body under ``model.``: ``embed_tokens``, ``layers`` (one :data:`MIXER_LAYERS` layer per plan entry,
    with its MLP) and ``norm``, HF names. ``forward(input_ids [N], positions [N]) -> [N, hidden]`` in the model dtype;
    the RoPE tables are computed once per distinct ``rotary_dim`` of the layers (none for a recurrent layer)."""

    def __init__(self, vllm_config, cfg, plan, prefix: str, fp8: Fp8Mode) -> None:
        super().__init__()
        lora = vllm_config.lora_config is not None
        self.tp = tp = TensorParallel(vllm_config)
        self.cfg = cfg
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = _param(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            [
                MIXER_LAYERS[type(layer.mixer.component)](
                    cfg,
                    layer.mixer,
                    vllm_config,
                    f"{prefix}layers.{layer.index}",
                    fp8,
                    mlp_module(layer.mlp, cfg, fp8, lora=lora, tp=tp),
                    lora=lora,
                    tp=tp,
                )
                for layer in plan
            ]
        )
        self.norm = _norm(cfg.hidden_size)
        selections: dict = {}  # DeepSeek Sparse Attention: one dict for the layers (shared layers read full ones')
        for mod in self.layers:
            if hasattr(mod, "selections"):
                mod.selections = selections

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens.weight[input_ids]
        cfg = self.cfg
        tables = {
            d: sn.rope_cos_sin(positions, d, cfg.rope_theta, cfg.rope_scaling)
            for d in {layer.rotary_dim for layer in self.layers}
            if d is not None
        }
        tables[None] = (None, None)
        delta = None
        for layer in self.layers:
            h, delta = layer(h, delta, *tables[layer.rotary_dim])
        gain = norm_gain(self.norm, cfg.zero_centred_norm)
        if delta is None:
            return sn.rms_norm(h, gain, cfg.rms_norm_eps)
        return sn.add_rms_norm(h, delta, gain, cfg.rms_norm_eps)[1]


def _fp8_mode(vllm_config, cfg) -> Fp8Mode:
    """The projections' FP8 mode: a ``zerokld_fp8`` checkpoint's, else the engine's ``fp8`` setting (``cfg``: its
    :class:`vllm_plugin.config.ZeroKLDConfig`)."""
    if is_zerokld_fp8(vllm_config):
        stored = vllm_config.quant_config.granularity
        if cfg.fp8 not in (None, stored):
            raise ZeroKLDConfigError(f"fp8 {cfg.fp8!r} conflicts with the checkpoint's granularity {stored!r}")
        return Fp8Mode("serialized", stored)
    if cfg.fp8:
        return Fp8Mode("online", cfg.fp8)
    return Fp8Mode()


class ZeroKLDForCausalLM(nn.Module, SupportsLoRA):
    """A declared architecture's model on ``shared_numerics``, built from its layer plan (what vLLM's
    ``initialize_model`` builds with the zerokld switch on, :mod:`vllm_plugin.register`).

    ``adapter``: the architecture's :class:`zerokld_plugins.ModelAdapterSpec` (``vllm_config.model_config.
    architecture``); ``plan``: its :func:`zerokld_models.layer_plan`. LoRA (vLLM's ``enable_lora``): the projections
    :func:`vllm_plugin.models.dense._proj` makes targets, each its own module (no packed q/k/v or gate/up).

    Raises (at construction):
        vllm_plugin.config.ZeroKLDConfigError: a setting or model feature zerokld does not support
            (:func:`vllm_plugin.start.check_model_settings`).
        zerokld_plugins.UnknownNameError: no model adapter declares the architecture.
    """

    packed_modules_mapping: dict[str, list[str]] = {}
    embedding_modules: dict[str, str] = {}

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__()
        self.adapter = get_model_adapter(vllm_config.model_config.architecture)
        self.model_cfg = cfg = check_model_settings(vllm_config, self.adapter)  # as vllm_plugin.start ran them first
        self.config = vllm_config.model_config.hf_config
        self.vllm_config = vllm_config
        self.fp8 = _fp8_mode(vllm_config, from_vllm_config(vllm_config))
        self.plan = layer_plan(cfg, self.adapter)
        self.model = Decoder(vllm_config, cfg, self.plan, f"{prefix}model." if prefix else "model.", self.fp8)
        if cfg.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:  # vocab-parallel under TP: this rank's vocab/TP rows (a tied lm_head slices the replicated embedding)
            self.lm_head = nn.Module()
            v, tp = cfg.vocab_size, self.model.tp
            self.lm_head.weight = tp.param((v, cfg.hidden_size), 0, rows=tp.vocab_rows(v)[:2])
        routed = self._routed_blocks()
        self.num_experts = cfg.num_experts if routed else 0
        # one row per routed layer, in layer order (DeepSeek-V3's dense first layers route nothing)
        self.route_cache = RouteCache(len(routed), cfg.num_experts_per_tok) if routed else None
        self.capture_routes = bool(routed) and bool(
            getattr(vllm_config.aux_output_config, "enable_return_routed_experts", False)
        )
        set_logprobs_definition(from_vllm_config(vllm_config).tp_k_block is not None)  # vllm_plugin.sampler

    def _routed_blocks(self) -> list:
        """The decoder's routed MLPs (those recording ``last_ids``), in layer order."""
        return [layer.mlp for layer in self.model.layers if hasattr(layer.mlp, "last_ids")]

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens.weight[input_ids]

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        step_delay()  # inert unless a test armed it (vllm_plugin.faults)
        if inputs_embeds is not None or intermediate_tensors is not None:
            raise NotImplementedError("zerokld: inputs_embeds / pipeline intermediate tensors are not supported")
        hidden = self.model(input_ids, positions)
        if self.capture_routes:
            self._record_routes(input_ids.shape[0])
        return hidden

    def _record_routes(self, n: int) -> None:
        from vllm.forward_context import get_forward_context

        meta = get_forward_context().attn_metadata
        if not meta:  # profiling / dummy runs
            return
        # an attention layer's metadata (a hybrid's recurrent layers have no per-token slots)
        first = next((m for m in meta.values() if hasattr(m, "slot_mapping")), None) if isinstance(meta, dict) else meta
        if first is None:
            return
        slots = first.slot_mapping[:n].cpu()
        ids = torch.stack([mlp.last_ids[: slots.shape[0]] for mlp in self._routed_blocks()], dim=1)
        self.route_cache.write(slots, ids)

    def compute_logits(self, hidden_states: torch.Tensor):
        tp = self.model.tp
        if tp.size == 1:
            return sn.linear(hidden_states, self.lm_head.weight)
        from vllm.distributed import tensor_model_parallel_all_gather

        vocab = self.model_cfg.vocab_size
        start, rows, per = tp.vocab_rows(vocab)
        w = self.lm_head.weight
        if self.model_cfg.tie_word_embeddings:  # the replicated embedding: this rank's rows of it
            w = w.narrow(0, start, rows)
        logits = sn.linear(hidden_states, w)
        if rows < per:  # the last rank's short share: pad to the common width for the gather, cut after it
            logits = torch.nn.functional.pad(logits, (0, per - rows))
        # each logit is a full-K dot product: the gathered vocab shards are the unsharded logits, bit for bit
        return tensor_model_parallel_all_gather(logits, dim=-1)[..., :vocab]

    # ---- weights ---------------------------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF checkpoint tensors into the parameters; per-expert tensors into their stacked parameters.

        Raises:
            KeyError: a tensor with no parameter.
            ValueError: a tensor of the wrong shape or dtype; a routed layer whose checkpoint lacks experts.
        """
        params = self._checkpoint_params()
        loaded: set[str] = set()
        experts: dict[str, set[int]] = {}
        tied = self.model_cfg.tie_word_embeddings
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and tied):
                continue
            expert = expert_tensor(name)
            if expert is None:
                self._load_tensor(params, name, tensor)
            else:
                self._load_expert(params, name, expert, tensor)
                experts.setdefault(expert.stacked, set()).add(expert.expert)
            loaded.add(name)
            copy_fault(len(loaded))  # inert unless a test armed it (vllm_plugin.faults)
        for stacked, seen in experts.items():
            if len(seen) != self.num_experts:
                missing = sorted(set(range(self.num_experts)) - seen)
                raise ValueError(f"zerokld: {stacked}: checkpoint lacks experts {missing}")
            loaded.add(stacked)
        self.checkpoint_updated(loaded)  # codes follow the weights, also on reload_weights (hot-load)
        if tied:
            loaded.add("lm_head.weight")
        return loaded

    def _load_tensor(self, params: dict, name: str, tensor: torch.Tensor) -> None:
        if name not in params:
            raise KeyError(f"zerokld: checkpoint tensor {name!r} has no parameter in the model")
        p = params[name]
        if p.dtype in (sn_fp8.FP8_DTYPE, torch.float32) and self.fp8.kind == "serialized" and tensor.dtype != p.dtype:
            raise ValueError(
                f"zerokld: {name} is {tensor.dtype}; this FP8 engine needs {p.dtype} ({QUANT_METHOD} snapshots only)"
            )
        expected = tuple(getattr(p, "checkpoint_shape", p.shape))  # a TP shard's loader slices the full tensor
        if expected != tuple(tensor.shape):
            raise ValueError(f"zerokld: {name} has shape {tuple(tensor.shape)}, model expects {expected}")
        p.weight_loader(p, tensor)

    def _load_expert(self, params: dict, name: str, expert, tensor: torch.Tensor) -> None:
        stacked = self._stacked(params, name, expert)
        if self.fp8.kind == "serialized" and tensor.dtype != stacked.dtype:
            raise ValueError(
                f"zerokld: {name} is {tensor.dtype}; this FP8 engine needs {stacked.dtype} ({QUANT_METHOD} snapshots "
                "only)"
            )
        expected = tuple(getattr(stacked, "checkpoint_shape", stacked.shape)[1:])  # TP: the loader slices
        if expected != tuple(tensor.shape):
            raise ValueError(f"zerokld: {name} has shape {tuple(tensor.shape)}, model expects {expected}")
        stacked.weight_loader(stacked, tensor, expert.expert)

    @staticmethod
    def _stacked(params: dict, name: str, expert) -> torch.Tensor:
        stacked = params.get(expert.stacked)
        if stacked is None or expert.expert >= stacked.shape[0]:
            raise KeyError(f"zerokld: checkpoint tensor {name!r} has no parameter in the model")
        return stacked

    def _checkpoint_params(self) -> dict[str, torch.Tensor]:
        params = dict(self.named_parameters(remove_duplicate=False))
        # vLLM's LoRA manager wraps each projection (vllm_plugin.lora): its weight lives at ``...base_layer.weight``
        params.update({k.replace(".base_layer.", "."): v for k, v in list(params.items()) if ".base_layer." in k})
        return params

    def checkpoint_views(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The live tensors holding checkpoint tensors ``names`` bit for bit (what a hot-load delta is decoded
        against and written into, :func:`deltasync.apply_delta_in_place`): each parameter (a projection wrapped by
        vLLM's LoRA manager: its base layer's), an expert's row of a stacked MoE parameter, and for a tied
        ``lm_head.weight`` a copy of the embedding (the model ignores it, as when loading; a checkpoint whose lm_head
        differs from the embedding is refused by its checksums). Shapes and dtypes are the checkpoint's (FP8
        checkpoints: codes and scales as serialized).

        Raises:
            KeyError: a name the model holds no bits of.
            RuntimeError: a tensor-parallel worker (it holds slices: deltas go through ``reload_weights``).
        """
        if self.model.tp.size > 1:
            raise RuntimeError("tensor-parallel workers hold slices of checkpoint tensors (deltas: reload_weights)")
        names = list(names)
        params = self._checkpoint_params()
        if self.model_cfg.tie_word_embeddings and "lm_head.weight" in names:  # a copy: written, then dropped
            params["lm_head.weight"] = self.model.embed_tokens.weight.detach().clone()
        views = {}
        for name in names:
            expert = expert_tensor(name)
            if expert is not None:
                views[name] = self._stacked(params, name, expert)[expert.expert].data
            elif name in params:
                views[name] = params[name].data
            else:
                raise KeyError(f"zerokld: checkpoint tensor {name!r} has no parameter in the model")
        return views

    def get_mamba_state_copy_funcs(self, mamba_types):
        """vLLM's hybrid-model hook (``IsHybrid.get_mamba_state_copy_funcs``, asked of the built model where
        prefix caching keeps a recurrent state per block): the stock class's copy functions, whose state shapes the
        recurrent layers declare (:class:`vllm_plugin.models.gated_deltanet.GatedDeltaNetMixer`)."""
        from zerokld_plugins.specs import resolve

        return resolve(self.adapter.vllm_base).get_mamba_state_copy_funcs(mamba_types)

    def checkpoint_updated(self, names: Iterable[str]) -> None:
        """After checkpoint tensors ``names`` were written into the parameters (a load, or a delta applied in place):
        online FP8 re-quantizes the projections they belong to and each routed expert whose weights they hold, and
        only those."""
        if self.fp8.kind != "online":
            return
        modules = dict(self.named_modules())
        for name in names:
            expert = expert_tensor(name)
            if expert is not None:
                if expert.weight is not None:
                    modules[expert.module].quantize(expert.weight, expert.expert)
                continue
            owner = modules.get(name.rsplit(".", 1)[0])
            if isinstance(owner, _Proj):
                owner.quantize()
