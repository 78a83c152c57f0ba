"""LoRA training on the zerokld TorchTitan models: TorchTitan's own :class:`torchtitan.components.lora.LoRAConverter`
(frozen base, ``lora_a`` / ``lora_b`` adapter ``Linear`` s, same parameter names and initialisation), with the
adapted projections computed by :func:`shared_numerics.lora_linear` — the batch-invariant multi-LoRA op the serving
side shares — instead of stock ``F.linear`` s.

* :class:`ZeroKLDLoRAConverter` / :func:`lora_converter_config`: the converter, targets named by Tinker's switches
  (``train_attn``: q/k/v/o, ``train_mlp``: gate/up/down) or by HF / PEFT module names (``q_proj``...).
* :func:`disable_adapter`: PEFT's ``PeftModel.disable_adapter()`` context: the base model alone (adapter ids ``-1``),
  bitwise the full-parameter model's forward — the reference log-probs of RL's KL term.
* :func:`peft_adapter_state_dict` / :func:`save_peft_adapter`: the adapter as PEFT writes it (``adapter_config.json``
  + ``adapter_model.safetensors`` with ``base_model.model.<hf module>.lora_A.weight`` keys), which vLLM's
  ``LoRAModel.from_local_checkpoint`` and PEFT load.
* :func:`load_peft_adapter`: the inverse, into a LoRA model of the same rank and targets (start RL from an SFT
  adapter; score what an engine served).
* :func:`keep_requires_grad`: TorchTitan 0.3.0's ``spmd_types`` parallelize re-registers every parameter as
  ``nn.Parameter(tensor)`` (``torchtitan/protocols/module.py`` ``_spmd_distribute_state``), which turns the frozen
  base trainable again; the wrapper restores the flags before the optimizer is built, so its state holds the
  adapters only (fixed upstream after 0.3.0: pytorch/torchtitan#4267, "Preserve requires_grad when distributing
  parameters"; the wrapper is then a no-op).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from torchtitan.components.lora import LoRAConverter, _get_lora_cls

import shared_numerics as sn
import shared_numerics.lora as sn_lora
from zerokld_models.checkpoint import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from zerokld_plugins.errors import InvalidRequestError, UnsupportedRequestError

from .overrides import ZeroKLDFp8Linear, ZeroKLDLinear, grad_chains

__all__ = [
    "ATTN_TARGETS",
    "HF_TO_TITAN",
    "MLP_TARGETS",
    "REFUSED_TARGETS",
    "ZeroKLDLoRAConverter",
    "ZeroKLDLoRALinear",
    "disable_adapter",
    "keep_requires_grad",
    "load_peft_adapter",
    "lora_converter_config",
    "lora_modules",
    "peft_adapter_state_dict",
    "save_peft_adapter",
]

# HF / PEFT module names -> TorchTitan config-tree names (wk and wv share one config node, "wkv", when unfused; MLA's
# projections are TorchTitan deepseek_v3's wq_a / wq_b / wkv_a).
HF_TO_TITAN = {
    "q_proj": "wq",
    "k_proj": "wkv",
    "v_proj": "wkv",
    "o_proj": "wo",
    "q_a_proj": "wq_a",
    "q_b_proj": "wq_b",
    "kv_a_proj_with_mqa": "wkv_a",
    "gate_proj": "w1",
    "up_proj": "w3",
    "down_proj": "w2",
}
#: Tinker's ``train_attn``: the attention projections a model has (grouped-query attention's q/k/v/o, or MLA's
#: q_a/q_b (or q)/kv_a/o — never ``kv_b_proj``, whose weight MLA absorbs per head)
ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa")
#: Tinker's ``train_mlp``: the dense MLPs (a MoE block's routed and shared experts are not adapted)
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
#: module names no zerokld adapter may target, with the reason
REFUSED_TARGETS = {
    "kv_b_proj": "MLA absorbs kv_b_proj's weight per head (shared_numerics.mla), so an adapter on it is not implemented"
}


class ZeroKLDLoRALinear(_get_lora_cls(ZeroKLDLinear)):
    """TorchTitan's ``LoRALinear`` over :class:`titan_plugin.overrides.ZeroKLDLinear` (same ``weight``,
    ``lora_a.weight [r, K]``, ``lora_b.weight [N, r]``, scaling ``alpha / r``, frozen base), whose forward is
    :func:`shared_numerics.lora_linear` with one adapter, zero-padded to ``max_rank`` (the engine's
    ``max_lora_rank``: the padded rank is part of the op's definition), and the scaling folded into ``lora_B`` in
    the forward dtype (``round(B * scaling)``, then scaling 1) — what vLLM does when it loads an adapter
    (``vllm/lora/lora_weights.py`` ``LoRALayerWeights.optimize``). For power-of-two scalings (``alpha / r`` = 2,
    PEFT's and Tinker's usual choice) that is exactly PEFT's ``lora_B(lora_A(x)) * scaling``. Under exact
    accumulation (:mod:`titan_plugin.exact_accumulation`) the padded operands' gradients go into the chains
    ``lora_a.weight`` / ``lora_b.weight`` it is given."""

    @dataclass(kw_only=True, slots=True)
    class Config(_get_lora_cls(ZeroKLDLinear).Config):
        max_rank: int = 0  # 0: rank

    def __init__(self, config: Config) -> None:
        if _tp_replicated(config):
            # TorchTitan 0.3.0's LoRALinear derives its adapters' sharding from a column- or row-wise base only
            # (components/lora.py _lora_adapter_sharding asserts); MLA's wq_a / wkv_a are TP-replicated. zerokld MLA
            # runs at TP 1 (its tensor parallelism is refused), where that placement is the identity: none given.
            config = dataclasses.replace(config, sharding_config=None)
        super().__init__(config)
        self.alpha = config.alpha
        self.max_rank = max(config.max_rank, config.rank)
        self.adapter_enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.lora_a.weight, self.lora_b.weight * self._lora_scaling
        pad = self.max_rank - a.shape[0]
        if pad:
            a = torch.nn.functional.pad(a, (0, 0, 0, pad))
            b = torch.nn.functional.pad(b, (0, pad))
        ids = torch.full(x.shape[:-1], 0 if self.adapter_enabled else -1, dtype=torch.int64, device=x.device)
        chains = grad_chains(self)
        if chains is not None:  # exact accumulation (titan_plugin.exact_accumulation): the CPU op, adapters chained
            return sn_lora.lora_linear(
                x,
                self.weight,
                self.bias,
                a.unsqueeze(0),
                b.unsqueeze(0),
                [1.0],
                ids,
                adapter_chains=[(chains["lora_a.weight"], chains["lora_b.weight"])],
            )
        return sn.lora_linear(x, self.weight, self.bias, a.unsqueeze(0), b.unsqueeze(0), [1.0], ids)


class ZeroKLDLoRAConverter(LoRAConverter):
    """:class:`torchtitan.components.lora.LoRAConverter` whose targets become :class:`ZeroKLDLoRALinear`.

    Targets must be zerokld decoder projections (apply after :func:`titan_plugin.overrides.apply_zerokld_overrides`).

    Raises (``convert``):
        NotImplementedError: a target that is not a :class:`~titan_plugin.overrides.ZeroKLDLinear` (stock
            ``Linear``), an FP8 QAT linear, or the lm_head.
        ValueError: a target name that matches nothing.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(LoRAConverter.Config):
        max_rank: int = 0
        """The engine's ``max_lora_rank`` (adapters are zero-padded to it); 0: ``rank``."""
        switches: tuple = ()
        """The targets came from Tinker's switches, ``((switch, TorchTitan names), ...)``: the names the model lacks
        (MLA has no ``wkv``, grouped-query attention no ``wq_a``) are dropped instead of refused, but each switch
        must find one."""

    def __init__(self, config: Config, **kwargs) -> None:
        super().__init__(config, **kwargs)
        if config.max_rank and config.max_rank < config.rank:
            raise InvalidRequestError(f"max_rank {config.max_rank} is below the LoRA rank {config.rank}")
        self.max_rank = config.max_rank
        self.switches = config.switches

    def _make_lora_config(self, cfg):
        owner = cfg._owner
        if owner is not ZeroKLDLinear:
            kind = (
                "FP8 QAT linears"
                if owner is not None and issubclass(owner, ZeroKLDFp8Linear)
                else f"{getattr(owner, '__name__', owner)} (only zerokld decoder projections)"
            )
            raise UnsupportedRequestError(f"zerokld LoRA does not adapt {kind}")
        return ZeroKLDLoRALinear.Config(
            **{f.name: getattr(cfg, f.name) for f in fields(cfg) if f.init},
            rank=self.rank,
            alpha=self.alpha,
            max_rank=self.max_rank,
        )

    def convert(self, model_config):
        """TorchTitan's ``LoRAConverter.convert`` (targets by their last name; every other module frozen), except
        inside a MoE block: its shared experts' ``w1`` / ``w2`` / ``w3`` run inside the zerokld MoE op by weight
        (:func:`shared_numerics.moe.deepseek_moe_forward`) and stay frozen base projections."""
        from torchtitan.components.lora import _make_frozen_config
        from torchtitan.protocols.module import Module

        targets = self.target_modules or set()

        def adaptable(fqn: str) -> bool:  # a decoder projection outside any MoE block
            return ".moe." not in f".{fqn}."

        found = {
            fqn.rsplit(".", 1)[-1]
            for fqn, *_ in model_config.traverse(ZeroKLDLinear.Config, recurse=True)
            if adaptable(fqn)
        }
        if self.target_modules is None or "lm_head" in targets:
            raise UnsupportedRequestError(
                "zerokld LoRA adapts named decoder projections, not the lm_head (give target_modules)"
            )
        if self.switches:
            for switch, names in self.switches:
                if not set(names) & found:
                    raise InvalidRequestError(
                        f"{switch}: this model has none of its projections {sorted(names)} (a MoE "
                        f"block's experts are not adapted); it has {sorted(found)}"
                    )
            targets = targets & found
        elif targets - found:
            raise InvalidRequestError(
                f"LoRA targets {sorted(targets - found)} match no projection; the model has {sorted(found)}"
            )
        root = model_config
        for fqn, cfg, parent, attr in reversed(list(model_config.traverse(Module.Config, recurse=True))):
            target = isinstance(cfg, ZeroKLDLinear.Config) and fqn.rsplit(".", 1)[-1] in targets and adaptable(fqn)
            new = self._make_lora_config(cfg) if target else _make_frozen_config(cfg)
            if parent is None:
                root = new
            elif isinstance(parent, list):
                parent[attr] = new
            else:
                setattr(parent, attr, new)
        return root


def _tp_replicated(cfg) -> bool:
    import spmd_types as spmd
    from torchtitan.models.common.decoder_sharding import dense_param_placement

    sc = cfg.sharding_config
    placement = sc.state_shardings.get("weight") if sc is not None else None
    return placement is not None and placement == dense_param_placement(tp=spmd.R)


def lora_converter_config(
    rank: int = 32,
    alpha: float = 32.0,
    train_attn: bool = True,
    train_mlp: bool = True,
    target_modules: list[str] | None = None,
    max_rank: int = 0,
) -> ZeroKLDLoRAConverter.Config:
    """The converter config for Tinker's LoRA switches (``tinker.types.LoraConfig``: ``rank``, ``train_attn``,
    ``train_mlp``: :data:`ATTN_TARGETS` / :data:`MLP_TARGETS`, those the model has) or explicit HF / PEFT
    ``target_modules`` (``q_proj`` ... ``down_proj``, MLA's ``q_a_proj`` / ``q_b_proj`` / ``kv_a_proj_with_mqa``;
    they win, and each must exist in the model).

    Args:
        rank: LoRA rank ``r``; alpha: ``lora_alpha`` (scaling ``alpha / r``, PEFT's); max_rank: the engine's
            ``max_lora_rank`` (0: ``rank``).

    Raises:
        ValueError: no target, an unknown module name, or one of :data:`REFUSED_TARGETS` (``kv_b_proj``).
    """
    names = (
        list(target_modules)
        if target_modules is not None
        else [*(ATTN_TARGETS if train_attn else ()), *(MLP_TARGETS if train_mlp else ())]
    )
    refused = [f"{n}: {REFUSED_TARGETS[n]}" for n in names if n in REFUSED_TARGETS]
    if refused:
        raise InvalidRequestError("; ".join(refused))
    unknown = [n for n in names if n not in HF_TO_TITAN]
    if unknown or not names:
        raise InvalidRequestError(f"LoRA targets must be a non-empty subset of {sorted(HF_TO_TITAN)}; got {names}")
    if ("k_proj" in names) != ("v_proj" in names):
        raise InvalidRequestError("k_proj and v_proj are one TorchTitan config node (wkv): adapt both or neither")
    titan = sorted({HF_TO_TITAN[n] for n in names})
    switches = (
        ()
        if target_modules is not None
        else tuple(
            (switch, tuple(sorted({HF_TO_TITAN[n] for n in group})))
            for switch, on, group in (("train_attn", train_attn, ATTN_TARGETS), ("train_mlp", train_mlp, MLP_TARGETS))
            if on
        )
    )
    return ZeroKLDLoRAConverter.Config(
        rank=rank, alpha=alpha, target_modules=titan, max_rank=max_rank, switches=switches
    )


def lora_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The model's LoRA projections by TorchTitan FQN: :class:`ZeroKLDLoRALinear`, or TorchTitan's own ``LoRALinear``
    classes (stock numerics); empty for a full-parameter model."""
    return {
        name: m
        for name, m in model.named_modules()
        if hasattr(m, "_lora_scaling")
        and isinstance(getattr(m, "lora_a", None), torch.nn.Module)
        and isinstance(getattr(m, "lora_b", None), torch.nn.Module)
    }


def _alpha(m: torch.nn.Module) -> float:
    return float(getattr(m, "alpha", m._lora_scaling * m.lora_a.weight.shape[0]))


@contextlib.contextmanager
def disable_adapter(model: torch.nn.Module):
    """Run the base model alone inside the block (PEFT's ``PeftModel.disable_adapter()``): every LoRA projection
    computes ``linear(x, W, b)``, bitwise the full-parameter zerokld model's forward.

    Raises:
        ValueError: the model has no LoRA projection; NotImplementedError: stock TorchTitan LoRA projections."""
    mods = list(lora_modules(model).values())
    if not mods:
        raise InvalidRequestError("the model has no LoRA adapter to disable")
    if not all(isinstance(m, ZeroKLDLoRALinear) for m in mods):
        raise UnsupportedRequestError("TorchTitan's stock LoRALinear has no adapter switch (zerokld LoRA only)")
    saved = [m.adapter_enabled for m in mods]
    for m in mods:
        m.adapter_enabled = False
    try:
        yield model
    finally:
        for m, s in zip(mods, saved, strict=True):
            m.adapter_enabled = s


def keep_requires_grad(parallelize_fn):
    """Wrap a TorchTitan ``parallelize_fn`` so every parameter keeps the ``requires_grad`` it had before (see the
    module docstring: TorchTitan 0.3.0's ``spmd_types`` path resets it, unfreezing a LoRA model's base)."""

    @functools.wraps(parallelize_fn)
    def wrapped(model, **kwargs):
        # every name, tied ones included: a tied checkpoint's ``lm_head.weight`` is the embedding's parameter, which
        # ``named_parameters()`` lists once (as ``tok_embeddings.weight``); parallelize re-registers both names as
        # separate parameters and TorchTitan's ``init_states`` then re-ties the embedding to the lm_head's, so the
        # lm_head's flag is the one that survives
        before = {name: p.requires_grad for name, p in model.named_parameters(remove_duplicate=False)}
        out = parallelize_fn(model, **kwargs)
        for name, p in model.named_parameters(remove_duplicate=False):
            if name in before:
                p.requires_grad_(before[name])
        return out

    return wrapped


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def _hf_rows(sd_adapter, base_key: str, shape: torch.Size) -> tuple[str, torch.Tensor]:
    """The HF name of a TorchTitan weight of ``shape`` and the row order ``to_hf`` gives it (llama3 permutes q/k
    rows): ``to_hf`` of a ``[N, K]`` tensor whose rows hold their own index."""
    idx = torch.arange(shape[0], dtype=torch.float64)[:, None].expand(tuple(shape)).contiguous()
    ((hf_key, rows),) = sd_adapter.to_hf({base_key: idx}).items()
    if not torch.equal(rows, rows[:, :1].expand_as(rows)):
        raise UnsupportedRequestError(f"{base_key}: to_hf mixes columns; LoRA export handles row permutations only")
    if not hf_key.endswith(".weight"):
        raise UnsupportedRequestError(f"unexpected HF name {hf_key!r} for {base_key}")
    return hf_key, rows[:, 0].long()


def _peft_modules(model: torch.nn.Module, sd_adapter):
    """``(module, PEFT prefix, lora_B row order)`` per LoRA projection: the one name mapping export and import share."""
    for fqn, m in lora_modules(model).items():
        hf_key, rows = _hf_rows(sd_adapter, f"{fqn}.weight", m.weight.shape)
        yield m, "base_model.model." + hf_key[: -len(".weight")], rows


def peft_adapter_state_dict(model: torch.nn.Module, sd_adapter) -> dict[str, torch.Tensor]:
    """The adapters under PEFT names (``base_model.model.<HF module>.lora_A.weight [r, K]`` / ``lora_B.weight
    [N, r]``), float32 copies; ``lora_B`` rows in HF order (the state-dict adapter's ``to_hf`` row permutation).

    Args:
        model: a TorchTitan model with :class:`ZeroKLDLoRALinear` projections.
        sd_adapter: the architecture's TorchTitan ``StateDictAdapter`` instance.
    """
    out = {}
    for m, prefix, rows in _peft_modules(model, sd_adapter):
        out[f"{prefix}.lora_A.weight"] = _full(m.lora_a.weight).float().clone()
        out[f"{prefix}.lora_B.weight"] = _full(m.lora_b.weight).float()[rows].clone()
    return out


def save_peft_adapter(
    model: torch.nn.Module, sd_adapter, out_dir: str | Path, dtype: str, base_model_name_or_path: str = ""
) -> Path:
    """Write the adapters as a PEFT LoRA directory: ``adapter_model.safetensors`` (``dtype``: ``"float32"`` or
    ``"bfloat16"``, round-to-nearest casts as the serving copy gets) and ``adapter_config.json`` (``peft_type``
    ``LORA``, ``r``, ``lora_alpha``, ``target_modules`` as HF module names). Loadable by vLLM (``--lora-modules``,
    ``/v1/load_lora_adapter``, ``LoRARequest``) and by PEFT's ``PeftModel.from_pretrained``.

    Raises:
        ValueError: no LoRA projection in the model, or an unknown dtype.
    """
    from safetensors.torch import save_file

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(dtype)
    if torch_dtype is None:
        raise InvalidRequestError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    mods = lora_modules(model)
    if not mods:
        raise InvalidRequestError("the model has no LoRA adapter to save")
    first = next(iter(mods.values()))
    tensors = {k: v.to(torch_dtype).contiguous() for k, v in peft_adapter_state_dict(model, sd_adapter).items()}
    targets = sorted({k.split(".")[-3] for k in tensors})
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": first.lora_a.weight.shape[0],
        "lora_alpha": _alpha(first),
        "target_modules": targets,
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "base_model_name_or_path": base_model_name_or_path,
        "inference_mode": True,
    }
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return out


def _assign(param: torch.Tensor, value: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        if isinstance(param, DTensor):
            value = distribute_tensor(value.to(param.dtype), param.device_mesh, param.placements)
        param.copy_(value)


def load_peft_adapter(model: torch.nn.Module, sd_adapter, adapter_dir: str | Path) -> None:
    """Load a PEFT LoRA directory (:func:`save_peft_adapter`'s layout, or PEFT's own) into the model's adapters:
    ``lora_A`` as is, ``lora_B`` rows back into TorchTitan order; the values are cast to the parameters' dtype.

    Raises:
        ValueError: the model has no LoRA projection; the adapter's ``r`` / ``lora_alpha`` differ from the model's;
            a tensor the model has no adapter for, an adapter the file lacks, or a shape mismatch (nothing is
            loaded then).
    """
    from safetensors.torch import load_file

    mods = lora_modules(model)
    if not mods:
        raise InvalidRequestError("the model has no LoRA adapter to load into")
    folder = Path(adapter_dir)
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    first = next(iter(mods.values()))
    rank = first.lora_a.weight.shape[0]
    if config.get("r") != rank or float(config.get("lora_alpha", -1)) != _alpha(first):
        raise InvalidRequestError(
            f"{folder}: adapter r={config.get('r')}, lora_alpha={config.get('lora_alpha')}; the model's "
            f"LoRA has r={rank}, alpha={_alpha(first)}"
        )
    tensors = load_file(str(folder / ADAPTER_WEIGHTS))
    plan = []
    for m, prefix, rows in _peft_modules(model, sd_adapter):
        a, b_hf = tensors.pop(f"{prefix}.lora_A.weight", None), tensors.pop(f"{prefix}.lora_B.weight", None)
        if a is None or b_hf is None:
            raise InvalidRequestError(f"{folder}: no lora_A / lora_B for {prefix}")
        if tuple(a.shape) != tuple(m.lora_a.weight.shape) or tuple(b_hf.shape) != tuple(m.lora_b.weight.shape):
            raise InvalidRequestError(
                f"{folder}: {prefix} has shapes {tuple(a.shape)}, {tuple(b_hf.shape)}; the model expects "
                f"{tuple(m.lora_a.weight.shape)}, {tuple(m.lora_b.weight.shape)}"
            )
        b = torch.empty_like(b_hf)
        b[rows] = b_hf
        plan.append((m, a, b))
    if tensors:
        raise InvalidRequestError(
            f"{folder}: tensors for modules without an adapter in this model: {sorted(tensors)[:4]}"
        )
    for m, a, b in plan:
        _assign(m.lora_a.weight, a)
        _assign(m.lora_b.weight, b)
