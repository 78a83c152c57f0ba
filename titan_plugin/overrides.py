"""TorchTitan ``@override`` factories that make TorchTitan's own model components run ``shared_numerics``.

Activate them like any TorchTitan override — ``--override.imports`` with the names in :data:`OVERRIDE_IMPORTS`, or
programmatically with :func:`apply_zerokld_overrides` (the configs :func:`titan_plugin.rl.rl_trainer_config` builds
already carry them; TorchTitan's own flavours, e.g. ``qwen3_moe_debug``, take them too). Each replacement subclasses
the component it replaces (same parameters, same state-dict keys, same checkpoints); only ``forward`` changes:

=====================  ===========================================================================
TorchTitan component   zerokld replacement
=====================  ===========================================================================
``Linear``             :func:`shared_numerics.linear` (fixed row tiles, fp32 accumulation); the ``lm_head`` also
                       offers :func:`shared_numerics.fused_selected_logprobs` (``lm_head(h, targets=t)``; with
                       ``tp_k_block`` the vocab-parallel one of :mod:`shared_numerics.vocab_parallel`)
``RMSNorm``            :func:`shared_numerics.rms_norm` (fixed-tree fp32 statistics)
``Embedding``          TorchTitan's; under exact accumulation (:mod:`titan_plugin.exact_accumulation`) its
                       gradient, like every zerokld linear's, norm's and the lm_head's, goes into float32 chains in
                       token order (:mod:`shared_numerics.grad_chain`)
``FeedForward``        ``w2(silu_and_mul(w1 x, w3 x))`` with :func:`shared_numerics.silu_and_mul`
``CosSinRoPE``         :func:`shared_numerics.apply_rope` (rotate-half, float64 tables; Llama 3.x scaling from
                       the RoPE config's ``scaling="llama"`` factors); :class:`titan_plugin.rope.PartialCosSinRoPE`
                       too (the first ``dim`` dimensions of each head rotated, the rest passed through)
``ComplexRoPE``        same, after undoing the adapter's interleave permutation of q/k (llama3), so the
                       q·k dot products run over the HF dimension order exactly as vLLM's do
``wo`` / ``w2``         with ``tp_k_block`` (:func:`set_tp_k_block`): :class:`ZeroKLDRowParallelLinear`, the
                       TP-size-invariant row-parallel sum (:mod:`shared_numerics.tensor_parallel`); under
                       TorchTitan's tensor parallelism every zerokld linear, norm and RoPE runs on its local shard
                       (:mod:`titan_plugin.tensor_parallel`)
``Linear`` (FP8 QAT)   :func:`shared_numerics.fp8_linear_qat` (optional fourth pass, ``fp8=...``): every decoder
                       projection, not the lm_head; MLA's ``wkv_b``, used as a tensor, through
                       :func:`shared_numerics.fp8.fp8_weight_qat`; the MoE's routed experts (``ZeroKLDMoE.fp8``)
``FlexAttention`` /    :func:`shared_numerics.dense_causal_attention` (fixed 32-key chunks, same arithmetic as
``ScaledDotProduct``   vLLM's paged path)
``MoE``                :func:`shared_numerics.moe.moe_forward` (softmax router, stable top-k with lowest-id ties,
                       row-invariant experts, slot-order fp32 combine); replays recorded routes when given
                       (:mod:`titan_plugin.routing`). The load-balancing ``expert_bias_E`` is still updated by
                       TorchTitan's optimizer hook but never changes the selection: serving (HF / vLLM Qwen3-MoE)
                       has no such bias, so using it would route the trainer differently from the rollout.
=====================  ===========================================================================

Backward passes are autograd through these plain torch ops: deterministic on CPU (no atomics, fixed shapes).
Source: ``torchtitan/config/override.py`` (the override mechanism), ``torchtitan/models/common/*`` (the components).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torchtitan.config import override
from torchtitan.config.override import OverrideConfig, apply_overrides, derive
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
from torchtitan.models.common.embedding import Embedding
from torchtitan.models.common.feed_forward import FeedForward
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.moe import MoE
from torchtitan.models.common.nn_modules import LayerNorm, RMSNorm
from torchtitan.models.common.rope import ComplexRoPE, CosSinRoPE
from torchtitan.models.deepseek_v3.model import Attention as DeepSeekMLAAttention
from torchtitan.protocols.module import Module

import shared_numerics as sn
import shared_numerics.dsa as sn_dsa
import shared_numerics.fp8 as sn_fp8
import shared_numerics.fused_logprobs as sn_fused
import shared_numerics.grad_chain as sn_chain
import shared_numerics.mla as sn_mla
import shared_numerics.moe as sn_moe
import shared_numerics.norm as sn_norm
import shared_numerics.tensor_parallel as sn_tp
from shared_numerics.linear import linear as torch_backend_linear  # the module; the package's `linear` dispatches
from shared_numerics.rope import RopeScaling

from .context_parallel import ContextParallelAttention, cp_attention
from .rope import PartialCosSinRoPE

__all__ = [
    "OVERRIDE_IMPORTS",
    "DSAIndexer",
    "ZeroKLDDSAAttention",
    "ZeroKLDMLAAttention",
    "ZeroKLDRowParallelLinear",
    "apply_zerokld_overrides",
    "set_mla",
    "set_tp_k_block",
]


def grad_chains(module: torch.nn.Module) -> dict | None:
    """The :class:`shared_numerics.grad_chain.GradChain` s a module's parameters' gradients go into (``{name: chain}``,
    set by :class:`titan_plugin.exact_accumulation.ExactAccumulation` for its backward passes), or ``None``."""
    return module.__dict__.get("_zerokld_grad_chains")


class ZeroKLDLinear(Linear):
    """TorchTitan's linear as :func:`shared_numerics.linear`. ``k_block`` (set on the column-parallel projections
    by :func:`set_tp_k_block`): the input's gradient sums over the output dimension with the TP-aligned tree
    (:func:`shared_numerics.tensor_parallel.column_parallel_input_grad`), so TP 1, 2, 4, ... train with the same
    bits — where ``k_block`` divides each rank's output rows and the rows split evenly (else the ranks' partial
    input gradients are all-reduced, as stock)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Linear.Config):
        k_block: int = 0

    def __init__(self, config: Config):
        super().__init__(config)
        self.k_block = config.k_block

    def _input_tree(self, x: torch.Tensor) -> bool:
        """Whether ``x``'s gradient takes the TP-aligned tree (:attr:`k_block` set and dividing the local rows)."""
        return torch.is_grad_enabled() and x.requires_grad and self._tree_rows()

    def _tree_rows(self) -> bool:
        """Whether the output rows take the TP-aligned tree in the input's gradient: :attr:`k_block` set, dividing
        this rank's rows, the rows split evenly over the ranks."""
        if not self.k_block:
            return False
        rows, local = self.weight.shape[0], self.weight.shape[0]
        if _is_dtensor(self.weight):
            local = self.weight.to_local().shape[0]
            if any(p.is_shard() for p in self.weight.placements) and local * self.weight.device_mesh.size() != rows:
                return False  # uneven shards (e.g. an odd vocabulary): the ranks' subtrees would not align
        return local % self.k_block == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chains = grad_chains(self) or {}
        k_block = self.k_block if self._input_tree(x) else 0
        if _is_dtensor(self.weight):  # TorchTitan tensor parallelism: compute on the local shard
            from .tensor_parallel import column_parallel_dtensor

            return column_parallel_dtensor(
                x, self.weight, self.bias, chains.get("weight"), chains.get("bias"), k_block=k_block
            )
        x_in = x.detach() if k_block else x  # dX: the tree below
        if chains:
            y = torch_backend_linear(
                x_in, self.weight, self.bias, weight_chain=chains["weight"], bias_chain=chains.get("bias")
            )
        else:
            y = sn.linear(x_in, self.weight, self.bias)
        return sn_tp.column_parallel_input_grad(y, x, self.weight, k_block=k_block) if k_block else y


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _expert_parallel(weight) -> bool:
    from .expert_parallel import is_expert_parallel

    return is_expert_parallel(weight)


def _per_row(fn, x, *params):
    """``fn(x, *params)`` for an op on each row of the last dimension alone (norms, RoPE); a DTensor ``x`` (tensor
    parallelism) runs on its local shard (:func:`titan_plugin.tensor_parallel.per_row_dtensor`)."""
    if not _is_dtensor(x):
        return fn(x, *params)
    from .tensor_parallel import per_row_dtensor

    return per_row_dtensor(fn, x, *params)


class _FixedTreeOutput:
    """Mixin for a module whose ranks are summed by the fixed tree when ``k_block`` is set: TorchTitan's
    ``ShardingConfig`` then declares its output ``Replicate``, not ``Partial`` (no all-reduce runs)."""

    def parallelize(self, parallel_dims) -> None:
        if self.k_block:
            from .tensor_parallel import replicate_output_sharding

            self._sharding_config = replicate_output_sharding(self._sharding_config)
        super().parallelize(parallel_dims)


class ZeroKLDFp8Linear(ZeroKLDLinear):
    """FP8 quantization-aware linear: forward is :func:`shared_numerics.fp8_linear_qat` — bit for bit the FP8 GEMM
    vLLM serves (:func:`shared_numerics.fp8_linear` of ``quantize_fp8_weight(weight)``) — backward straight-through
    (under exact accumulation ``dW`` into the weight's chain)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ZeroKLDLinear.Config):
        granularity: str = "per_channel"  # or "block" (1x128 activation groups, 128x128 weight blocks)

    def __init__(self, config: Config):
        super().__init__(config)
        self.granularity = config.granularity

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is not None:
            raise NotImplementedError("zerokld FP8 linears are bias-free")
        chains = grad_chains(self)
        if chains is not None:  # exact accumulation: the CPU op, dW into the chain
            return sn_fp8.fp8_linear_qat(x, self.weight, self.granularity, weight_chain=chains["weight"])
        return sn.fp8_linear_qat(x, self.weight, self.granularity)


class ZeroKLDRowParallelLinear(_FixedTreeOutput, ZeroKLDLinear):
    """A row-parallel projection (attention ``wo``, feed-forward ``w2``) whose sum over ``K`` runs in fixed
    ``k_block`` blocks with the TP-aligned tree (:func:`shared_numerics.tensor_parallel.row_parallel_linear`): the
    same bits at every TP size, and as vLLM's ``o_proj`` / ``down_proj`` with the same ``tp_k_block``.

    Under TorchTitan's tensor parallelism the weight is a DTensor ``Shard(1)`` on the TP mesh: the forward runs on
    the local shards, all-gathers the float32 subtree roots over the mesh's group and returns the reduced output
    as a ``Replicate`` DTensor (no all-reduce)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ZeroKLDLinear.Config):
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chain = (grad_chains(self) or {}).get("weight")  # exact accumulation: dW into the chain
        if _is_dtensor(self.weight):
            from .tensor_parallel import row_parallel_dtensor

            return row_parallel_dtensor(x, self.weight, self.bias, self.k_block, chain)
        if chain is None:
            return sn_tp.row_parallel_linear(x, self.weight, self.bias, k_block=self.k_block)
        if self.bias is not None:
            raise NotImplementedError("zerokld row-parallel linear: exact accumulation with a bias")
        from shared_numerics.grad_chain import chained_weight_grad

        out = sn_tp.row_parallel_linear(x, self.weight.detach(), None, k_block=self.k_block)
        return chained_weight_grad(out, x, chain)


class ZeroKLDLMHead(ZeroKLDLinear):
    """lm_head that can also return the fused selected-token log-probs (``forward(h, targets=t)``), so RL losses run
    through the module (and FSDP's unshard / gradient hooks) without ever materialising ``[tokens, vocab]`` logits.

    With ``vocab_parallel`` (set by :func:`set_tp_k_block`) the fused log-probs are the vocab-parallel definition
    (:func:`shared_numerics.vocab_parallel.fused_selected_logprobs`); under TorchTitan's tensor parallelism the weight
    is ``Shard(0)`` (vocabulary rows) and each rank scores its own rows (:meth:`fused_input` makes the hidden states
    local). The hidden states' gradient sums over the vocabulary in the TP-aligned tree where ``k_block`` divides each
    rank's rows (every rank holds the whole of it: the same bits at every TP size), else it is each rank's partial
    sum, ``Partial``. Under exact accumulation the weight's gradient goes into its chain (this rank's rows)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ZeroKLDLinear.Config):
        fused_chunk: int = 0  # rows per chunk of the fused log-probs; 0: sized from the vocabulary
        vocab_parallel: bool = False  # the tp_k_block log-softmax (shared_numerics.vocab_parallel)

    def __init__(self, config: Config):
        super().__init__(config)
        self.fused_chunk = config.fused_chunk or None
        self.vocab_parallel = config.vocab_parallel

    def fused_input(self, x: torch.Tensor) -> torch.Tensor:
        """The hidden states ``[..., H]`` as this rank's plain tensor for ``forward(x, targets=...)`` (index it
        first; a DTensor cannot take a boolean mask): a DTensor's local tensor, whose gradient is ``Partial`` when
        the weight is vocabulary-sharded (each rank's rows contribute) and the fused backward does not take the
        TP-aligned tree; a plain tensor unchanged."""
        if not _is_dtensor(x):
            return x
        from torch.distributed.tensor import Partial, Replicate

        sharded = _is_dtensor(self.weight) and any(p.is_shard() for p in self.weight.placements)
        partial = sharded and not (self.vocab_parallel and self._tree_rows())
        return x.to_local(grad_placements=[Partial() if partial else Replicate()])

    def forward(self, x: torch.Tensor, *, targets: torch.Tensor | None = None) -> torch.Tensor:
        if targets is None:
            return super().forward(x)
        if self.bias is not None:
            raise NotImplementedError("fused log-probs need a bias-free lm_head")
        x = self.fused_input(x)
        if self.vocab_parallel:
            import shared_numerics.vocab_parallel as sn_vocab

            weight, kwargs = self.weight, {}
            if _is_dtensor(weight):
                from .tensor_parallel import vocab_rows

                weight, kwargs = vocab_rows(weight)
            chains = grad_chains(self)
            if chains is not None:  # exact accumulation: this rank's rows' gradient into the chain
                weight, kwargs["weight_chain"] = weight.detach(), chains["weight"]
            k_block = self.k_block if self._tree_rows() else 0
            return sn_vocab.fused_selected_logprobs(
                x, weight, targets, chunk=self.fused_chunk, k_block=k_block, **kwargs
            )
        if _is_dtensor(self.weight):
            raise NotImplementedError("fused log-probs under tensor parallelism need tp_k_block")
        chains = grad_chains(self)
        if chains is not None:
            return sn_fused.fused_selected_logprobs(
                x, self.weight, targets, self.fused_chunk, weight_chain=chains["weight"]
            )
        return sn.fused_selected_logprobs(x, self.weight, targets, self.fused_chunk)


class ZeroKLDRMSNorm(RMSNorm):
    """TorchTitan's RMSNorm as :func:`shared_numerics.rms_norm`. ``head_tree`` (Qwen3's q/k norms under
    :func:`set_tp_k_block`): ``x`` is ``[B, L, heads, D]`` and the gain's gradient is a sum per head added over the
    heads with the TP-aligned tree (:func:`shared_numerics.norm.head_tree_gain_grad`), so a TP rank's head shard is
    one subtree: TP 1, 2, 4, ... train with the same bits."""

    @dataclass(kw_only=True, slots=True)
    class Config(RMSNorm.Config):
        head_tree: bool = False

    def __init__(self, config: Config):
        super().__init__(config)
        self.head_tree = config.head_tree

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        chains = grad_chains(self)
        if self.head_tree and x.dim() == 4 and torch.is_grad_enabled() and (chains or x.requires_grad):
            return self._head_tree(x, eps, None if chains is None else chains["weight"])
        if chains is not None:  # the gain's gradient into its chain (under TP: x replicated, the whole rows)
            chain = chains["weight"]
            if _is_dtensor(x) and any(q.is_shard() for q in x.placements):  # e.g. q/k norms on a head shard
                chain.partial = True

            def chained(t, w):
                w = w.to_local() if _is_dtensor(w) else w  # the gradient is the chain's
                return sn_norm.rms_norm(t, w, eps, weight_chain=chain)

            return _per_row(chained, x, self.weight)
        return _per_row(lambda t, w: sn.rms_norm(t, w, eps), x, self.weight)

    def _head_tree(self, x: torch.Tensor, eps: float, chain) -> torch.Tensor:
        """The training forward with the per-head gain gradient (a DTensor ``x``: this rank's heads, the gain's
        gradient whole on every rank)."""
        w = self.weight.detach() if chain is not None else self.weight  # with a chain, the gradient is the chain's
        if not _is_dtensor(x):
            w = w.to_local() if _is_dtensor(w) else w
            return sn_norm.rms_norm(x, w, eps, weight_chain=chain, head_tree=True)
        from torch.distributed.tensor import DTensor, Replicate, Shard

        from .tensor_parallel import head_gather

        if any(p.is_shard() and p != Shard(2) for p in x.placements):
            raise NotImplementedError(f"zerokld per-head norm: input placements {x.placements} (heads only)")
        w = w.to_local(grad_placements=[Replicate()]) if _is_dtensor(w) else w
        gather = head_gather(x) if any(p.is_shard() for p in x.placements) else None
        out = sn_norm.rms_norm(x.to_local(), w, eps, weight_chain=chain, head_tree=True, gather=gather)
        return DTensor.from_local(out, x.device_mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride())


class ZeroKLDEmbedding(Embedding):
    """TorchTitan's embedding; under exact accumulation its weight gradient goes into the module's
    :class:`shared_numerics.grad_chain.GradChain` (:func:`shared_numerics.grad_chain.chained_embedding`)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Embedding.Config):
        pass

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        chains = grad_chains(self)
        if chains is None:
            return super().forward(input)
        if self.tp_group is None:
            return sn_chain.chained_embedding(input, self.weight, chains["weight"])
        # TorchTitan's vocab-parallel embedding (this rank's rows; the others' tokens masked to zero, their zero
        # gradients added to a clamped row: exact zeros), the rows' gradients into the chain
        import torch.distributed as dist

        weight = self.weight.to_local() if _is_dtensor(self.weight) else self.weight
        offset = dist.get_rank(self.tp_group) * -(-self.num_embeddings // dist.get_world_size(self.tp_group))
        mask = (input >= offset) & (input < offset + weight.shape[0])
        local = (input - offset).clamp(0, weight.shape[0] - 1)
        out = sn_chain.chained_embedding(local, weight, chains["weight"])
        return out * mask.unsqueeze(-1).to(out.dtype)


class ZeroKLDFeedForward(FeedForward):
    @dataclass(kw_only=True, slots=True)
    class Config(FeedForward.Config):
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(sn.silu_and_mul(self.w1(x), self.w3(x)))


def _rope_forward(cfg, query, key, positions, interleaved: bool):
    b, seqlen, _, d = query.shape
    scaling = None
    if cfg.scaling == "llama":
        scaling = RopeScaling(
            cfg.scaling_factor, cfg.low_freq_factor, cfg.high_freq_factor, cfg.original_max_position_embeddings
        )
    elif cfg.scaling not in (None, "none", "") and not (cfg.scaling == "yarn" and cfg.rope_factor <= 1.0):
        raise NotImplementedError(f"zerokld RoPE supports unscaled and Llama 3.x RoPE, got scaling={cfg.scaling!r}")
    if positions is None:
        pos = torch.arange(seqlen, device=query.device).repeat(b)
    else:
        pos = positions.expand(b, seqlen).reshape(-1) if positions.dim() == 2 else positions.repeat(b)
    cos, sin = sn.rope_cos_sin(pos, cfg.dim, cfg.theta, scaling)  # dim < d: partial RoPE (sn.apply_rope)

    def rot(x: torch.Tensor) -> torch.Tensor:
        if interleaved:  # (x0, x_{D/2}, x1, x_{D/2+1}, ...) -> HF halves order
            x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
        flat = x.reshape(b * seqlen, x.shape[2], d)
        return sn.apply_rope(flat, cos, sin).reshape(x.shape)

    if _is_dtensor(query):  # tensor parallelism: heads sharded, positions whole; the rotation is per head
        from torch.distributed.tensor import Shard

        if any(p.is_shard() and p != Shard(2) for p in (*query.placements, *key.placements)):
            raise NotImplementedError(f"zerokld RoPE: q/k placements {query.placements} (heads Shard(2) only)")
    return _per_row(rot, query), _per_row(rot, key)


class ZeroKLDCosSinRoPE(CosSinRoPE):
    @dataclass(kw_only=True, slots=True)
    class Config(CosSinRoPE.Config):
        pass

    def forward(self, query, key, positions=None):
        return _rope_forward(self.config, query, key, positions, interleaved=False)


class ZeroKLDComplexRoPE(ComplexRoPE):
    """Llama3: TorchTitan's state-dict adapter stores q/k rows interleaved; this returns q/k in HF halves order."""

    @dataclass(kw_only=True, slots=True)
    class Config(ComplexRoPE.Config):
        pass

    def forward(self, query, key, positions=None):
        return _rope_forward(self.config, query, key, positions, interleaved=True)


class ZeroKLDAttention(ContextParallelAttention, Module):
    """Inner attention: ``[B, L, N, H]`` q/k/v → ``[B, L, N, H]``, causal, one sequence per row."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        pass

    def __init__(self, config: Config):
        super().__init__()
        self.cp_mesh = None  # the ``cp`` DeviceMesh under context parallelism (titan_plugin.context_parallel)

    def forward(
        self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, scale=None, enable_gqa=False, is_causal=True, **kwargs
    ):
        if attention_masks is not None:
            raise NotImplementedError(
                "zerokld attention runs one causal sequence per row; document masks "
                "(packed sequences) are not supported"
            )
        d = q_BLNH.shape[-1]
        scale = scale if scale is not None else d**-0.5
        if self.cp_mesh is not None:  # this rank's slice of the sequences, over all their keys
            return cp_attention(q_BLNH, k_BLNH, v_BLNH, scale, self.cp_mesh)
        return sn.dense_causal_attention(q_BLNH, k_BLNH, v_BLNH, scale)


class ZeroKLDMLAAttention(DeepSeekMLAAttention):
    """TorchTitan's DeepSeek-V3 MLA ``Attention`` (same parameters and state-dict keys: ``wq`` or ``wq_a`` / ``q_norm``
    / ``wq_b``, ``wkv_a``, ``kv_norm``, ``wkv_b``, ``wo``) whose forward is :mod:`shared_numerics.mla`'s absorbed
    definition — the one vLLM's zerokld DeepSeek-V3 runs over its latent cache: ``[B, L, D]`` in, ``[B, L, D]``
    out, positions ``0 .. L-1`` (or ``positions``). Made by :func:`set_mla` (it needs the checkpoint's RoPE and
    norm settings, which TorchTitan's config does not carry).

    Under TorchTitan's tensor parallelism (``x`` a ``Replicate`` DTensor; ``wq_b`` / ``wq`` and ``wkv_b`` sharded by
    head, ``wq_a`` / ``wkv_a`` / the norms replicated, ``wo`` row-parallel) it runs on this rank's heads: the local
    query columns and ``wkv_b`` rows, the whole latent. ``head_tree`` (set with ``tp_k_block``,
    :func:`set_tp_k_block`): the latent's gradient adds the heads with the fixed TP-aligned tree
    (:func:`shared_numerics.mla.mla_dense_attention`), the ranks' subtree roots gathered over the TP mesh, so it is
    whole and one rank's bits on every rank."""

    @dataclass(kw_only=True, slots=True)
    class Config(DeepSeekMLAAttention.Config):
        dims: object = None  # shared_numerics.mla.MLADims
        rope_theta: float = 10000.0
        rope_scaling: object = None  # shared_numerics.rope.YarnScaling or None
        scale: float = 1.0
        head_tree: bool = False  # tp_k_block: the latent's gradient over the heads in the TP-aligned tree

    def __init__(self, config: Config):
        super().__init__(config)
        self.zerokld = config

    def forward(self, x: torch.Tensor, attention_masks=None, positions: torch.Tensor | None = None) -> torch.Tensor:
        if attention_masks is not None:
            raise NotImplementedError(
                "zerokld attention runs one causal sequence per row; document masks "
                "(packed sequences) are not supported"
            )
        c = self.zerokld
        b, seq, d = x.shape
        pos = torch.arange(seq, device=x.device).repeat(b) if positions is None else positions.reshape(-1)
        cos, sin = sn.rope_cos_sin(pos, c.dims.qk_rope_head_dim, c.rope_theta, c.rope_scaling)
        x2 = x.reshape(b * seq, d)
        q_resid = None if self.q_lora_rank == 0 else self.q_norm(self.wq_a(x2))
        q = self.wq(x2) if q_resid is None else self.wq_b(q_resid)
        ckv, kv_b, kv_norm = self.wkv_a(x2), self.wkv_b.weight, self.kv_norm.weight
        dims, gather, a = c.dims, None, x2
        if _is_dtensor(x):  # TorchTitan TP: this rank's heads (q's Shard(-1) columns, wkv_b's Shard(0) rows)
            from .tensor_parallel import _gather_over, _local

            mesh = x.device_mesh
            q, ckv, kv_b, kv_norm, a, q_resid = (_local(t) for t in (q, ckv, kv_b, kv_norm, x2, q_resid))
            dims = dataclasses.replace(dims, num_heads=q.shape[-1] // (dims.qk_nope_head_dim + dims.qk_rope_head_dim))
            gather = _gather_over(mesh) if mesh.size() > 1 else None
        if isinstance(self.wkv_b, ZeroKLDFp8Linear):  # FP8 QAT: the dequantized codes the server absorbs
            # (with a chain, the straight-through gradient is the chain's: the linears' dW of the codes' values)
            kv_b = sn_fp8.fp8_weight_qat(kv_b, self.wkv_b.granularity)
        # exact accumulation: the absorbed weights' gradients into their modules' chains (kv_b: one block per head,
        # shared_numerics.mla.kv_b_chain_shape; titan_plugin.exact_accumulation lays the sums out as the weight)
        norm_chain = (grad_chains(self.kv_norm) or {}).get("weight")
        kv_b_chain = (grad_chains(self.wkv_b) or {}).get("weight")
        qc, latent = sn_mla.mla_query_latent(
            q, ckv, kv_norm, kv_b, cos, sin, dims, kv_norm_chain=norm_chain, kv_b_chain=kv_b_chain
        )

        qc, latent = qc.view(b, seq, dims.num_heads, -1), latent.view(b, seq, -1)
        o = self.latent_attention(qc, latent, gather, a, q_resid, cos, sin)
        o = sn_mla.mla_output(o.reshape(b * seq, dims.num_heads, -1), kv_b, dims, kv_b_chain=kv_b_chain)
        return self.wo(o).view(b, seq, d)

    def latent_attention(self, qc, latent, gather, a, q_resid, cos, sin):
        """The attention of the absorbed queries ``qc`` ``[B, T, H, R + P]`` (this rank's heads) over the latents
        ``[B, T, R + P]``: dense MLA (:func:`shared_numerics.mla.mla_dense_attention`, ``head_tree`` with ``gather``
        under TP); DSA's :class:`ZeroKLDDSAAttention` attends its selecting rows to their selections (``a``: the
        layer's input ``[B T, dim]``, ``q_resid``: ``q_norm(wq_a(a))``, both plain tensors)."""
        c = self.zerokld
        return sn_mla.mla_dense_attention(qc, latent, c.scale, head_tree=c.head_tree, gather=gather)


class DSAIndexer(Module):
    """DeepSeek Sparse Attention's lightning indexer as TorchTitan components (``Linear`` / ``LayerNorm``, HF's names
    and shapes): ``wq_b`` ``[Hi Di, q_lora_rank]``, ``wk`` ``[Di, dim]``, ``k_norm`` (LayerNorm, eps 1e-6, weight and
    bias ``[Di]``), ``weights_proj`` ``[Hi, dim]``. Its parameters are not trained (``requires_grad`` off: HF runs the
    indexer under ``no_grad``); the arithmetic is :func:`shared_numerics.dsa.indexer_query_key`'s."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        dims: object = None  # shared_numerics.dsa.IndexerDims
        q_lora_rank: int = 0
        dim: int = 0

    def __init__(self, config: Config):
        super().__init__()
        d, init = config.dims, {"weight": lambda w: torch.nn.init.normal_(w, std=0.02)}
        self.wq_b = Linear.Config(
            in_features=config.q_lora_rank, out_features=d.n_heads * d.head_dim, param_init=init
        ).build()
        self.wk = Linear.Config(in_features=config.dim, out_features=d.head_dim, param_init=init).build()
        self.k_norm = LayerNorm.Config(normalized_shape=d.head_dim, eps=sn_dsa.INDEX_NORM_EPS).build()
        self.weights_proj = Linear.Config(in_features=config.dim, out_features=d.n_heads, param_init=init).build()
        for p in self.parameters():
            p.requires_grad_(False)


class ZeroKLDDSAAttention(ZeroKLDMLAAttention):
    """:class:`ZeroKLDMLAAttention` with DeepSeek Sparse Attention (GLM-5, ``zerokld_models/glm_moe_dsa``; TorchTitan
    has no DSA, so it is added here in TorchTitan's style): a ``"full"`` layer holds the lightning indexer
    (``indexer.wq_b`` ``[Hi Di, q_lora_rank]``, ``indexer.wk`` ``[Di, dim]``, ``indexer.k_norm`` LayerNorm weight and
    bias ``[Di]``, ``indexer.weights_proj`` ``[Hi, dim]``; not trained: ``requires_grad`` off, computed without
    autograd, as HF's ``no_grad`` indexer) and selects each query's ``index_topk`` tokens
    (:func:`shared_numerics.dsa.dense_selection`); a ``"shared"`` layer reuses the selection of the full layer
    ``topk_source`` (its latest forward in this model config's layers: one forward at a time; pipeline schedules
    with several micro-batches in flight are not supported with shared layers). Rows at positions ``< index_topk``
    are dense MLA's; the others :func:`shared_numerics.dsa.dsa_dense_attention` (under tensor parallelism: this
    rank's heads, the selection computed whole on every rank, the latent's gradient in the TP-aligned head tree).
    Packed documents are refused."""

    @dataclass(kw_only=True, slots=True)
    class Config(ZeroKLDMLAAttention.Config):
        indexer: object = None  # shared_numerics.dsa.IndexerDims
        full: bool = True  # this layer runs its indexer ("full"), else reuses topk_source's selection ("shared")
        layer_id: int = 0
        topk_source: int = 0  # a shared layer: the index of the full layer whose selection it reuses
        selections: object = None  # {full layer index: its latest (rows, idx)}, one dict for the model's layers

    def __init__(self, config: Config):
        super().__init__(config)
        if config.full:
            self.indexer = DSAIndexer.Config(
                dims=config.indexer, q_lora_rank=config.q_lora_rank, dim=config.dim
            ).build()

    def latent_attention(self, qc, latent, gather, a, q_resid, cos, sin):
        c = self.zerokld
        if c.full:
            ix = self.indexer
            weights = [
                w.to_local() if _is_dtensor(w) else w
                for w in (ix.wq_b.weight, ix.wk.weight, ix.k_norm.weight, ix.k_norm.bias, ix.weights_proj.weight)
            ]
            iq, ik, iw = sn_dsa.indexer_query_key(a, q_resid, *weights, cos, sin, c.indexer)
            b, t = latent.shape[:2]
            c.selections[c.layer_id] = sn_dsa.dense_selection(iq, iw, ik.view(b, t, -1), c.indexer.topk)
        source = c.layer_id if c.full else c.topk_source
        if source not in c.selections:
            raise NotImplementedError(
                f"DeepSeek Sparse Attention: layer {c.layer_id} reuses layer {source}'s selection, which this process "
                "has not computed (a pipeline stage boundary between them is not supported)"
            )
        rows, idx = c.selections[source]
        return sn_dsa.dsa_dense_attention(qc, latent, rows, idx, c.scale, head_tree=c.head_tree, gather=gather)


def set_mla(model_cfg, cfg) -> None:
    """Make every layer's TorchTitan DeepSeek-V3 ``Attention`` a :class:`ZeroKLDMLAAttention` with the checkpoint's
    (:class:`zerokld_models.ModelConfig` ``cfg``) MLA sizes, RoPE base and scaling, and softmax scale; after
    :func:`apply_zerokld_overrides` (its sub-configs are already zerokld linears and norms)."""
    from zerokld_models import indexer_dims, mla_dims, mla_softmax_scale, topk_sources

    dsa, sources = indexer_dims(cfg), topk_sources(cfg)
    selections: dict = {}  # one dict for the model's layers: each full layer's latest selection
    for i, layer in enumerate(model_cfg.layers):
        common = dict(
            dims=mla_dims(cfg), rope_theta=cfg.rope_theta, rope_scaling=cfg.rope_scaling, scale=mla_softmax_scale(cfg)
        )
        if dsa is None:
            layer.attention = derive(layer.attention, ZeroKLDMLAAttention.Config, **common)
            continue
        layer.attention = derive(
            layer.attention,
            ZeroKLDDSAAttention.Config,
            indexer=dsa,
            full=sources[i] == i,
            layer_id=i,
            topk_source=sources[i],
            selections=selections,
            **common,
        )


class ZeroKLDMoE(_FixedTreeOutput, MoE):
    """TorchTitan ``MoE`` (same parameters, buffers and state-dict keys) whose forward is
    :func:`shared_numerics.moe.moe_forward` — the block vLLM's zerokld Qwen3-MoE runs.

    ``replay_ids`` (``[B, L, top_k]`` int, ``-1`` rows routed afresh) replays recorded routes;
    ``last_ids`` holds the ids of the latest forward. Both are set by :mod:`titan_plugin.routing`. A training
    forward (grad enabled; scoring passes count nothing) adds its routes to ``tokens_per_expert_E``, TorchTitan's
    load-balancing counts — every position, as TorchTitan's ``MoE`` does, or with ``count_masks`` set
    (:func:`titan_plugin.routing.counted_positions`) only the positions the next mask marks (a rollout's tokens, not
    padding: counts that do not depend on how a batch is padded, split or grouped). Under exact
    accumulation (:mod:`titan_plugin.exact_accumulation`) the experts' gradients go into its chains ``w1_EFD``,
    ``w3_EFD``, ``w2_EDF`` and the router's into its gate's."""

    @dataclass(kw_only=True, slots=True)
    class Config(MoE.Config):
        k_block: int = 0  # tp_k_block (set_tp_k_block): the experts' down projections sum in the fixed tree
        fp8: str = ""  # FP8 QAT granularity of the routed experts ("per_channel" / "block"; "": off)

    def __init__(self, config: Config):
        super().__init__(config)
        self.k_block = config.k_block or None
        self.fp8 = config.fp8 or None
        r = config.router
        #: DeepSeekMoE (scores in expert groups, shared experts; DeepSeek-V3's sigmoid scores with the selection bias
        #: or DeepSeek-V2's softmax scores): the deepseek_v3 block (titan_plugin.models.mla_config)
        self.deepseek = r.num_expert_groups is not None or config.shared_experts is not None
        if self.deepseek and (config.shared_experts is None or r.num_expert_groups is None):
            raise NotImplementedError("zerokld DeepSeekMoE needs expert groups and shared experts")
        if not self.deepseek and (r.score_func != "softmax" or r.route_scale != 1.0):
            raise NotImplementedError(
                "zerokld MoE implements Qwen3-MoE routing (softmax scores, no expert groups, "
                "route_scale 1, no shared experts) and DeepSeekMoE"
            )
        self.replay_ids: torch.Tensor | None = None
        self.last_ids: torch.Tensor | None = None
        #: ``[B, L]`` bool masks, one per coming training forward (in order), of the positions its load-balancing
        #: counts take (titan_plugin.routing.counted_positions); ``None``: every position
        self.count_masks: list[torch.Tensor] | None = None
        #: the EP size of the latest forward (1: every expert on this rank; titan_plugin.expert_parallel)
        self.expert_parallel_size = 1

    def _moe_chains(self) -> dict | None:
        """Exact accumulation's chains for :func:`shared_numerics.moe.moe_forward`: the experts' here (under EP this
        rank's experts'), the router's on its gate; ``None`` when none are attached."""
        chains = grad_chains(self)
        if chains is None:
            return None
        return {
            "router": grad_chains(self.router.gate)["weight"],
            "w_gate": chains["w1_EFD"],
            "w_up": chains["w3_EFD"],
            "w_down": chains["w2_EDF"],
        }

    def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:
        b, seq, d = x_BLD.shape
        k = self.router.top_k
        ex = self.routed_experts.inner_experts
        replay = None if self.replay_ids is None else self.replay_ids.reshape(b * seq, k)
        if self.deepseek:
            from torch.distributed.tensor import DTensor, Replicate

            from .tensor_parallel import _local

            r = self.router
            weights, ep = (ex.w1_EFD, ex.w3_EFD, ex.w2_EDF), None
            # TorchTitan TP (TP x EP): the tokens replicated over the TP ranks, the experts whole on the EP (= TP)
            # ranks, the shared experts TP-split (their sums in the fixed tree with tp_k_block)
            tp_mesh = x_BLD.device_mesh if _is_dtensor(x_BLD) else None
            x, experts_input, output = x_BLD, None, None
            if _is_dtensor(ex.w1_EFD) and _expert_parallel(ex.w1_EFD):  # TorchTitan EP: experts sharded along E
                from .expert_parallel import expert_parallel_inputs

                e = expert_parallel_inputs(x_BLD, weights, r.gate.weight.shape[0])
                x, weights, ep, experts_input, output = e.x, e.weights, e.ep, e.experts_input, e.output
                self.expert_parallel_size = ep.size
            elif tp_mesh is not None or _is_dtensor(ex.w1_EFD):
                raise NotImplementedError(
                    "zerokld DeepSeekMoE under tensor parallelism: TP x EP only (expert_parallel_degree = "
                    "tensor_parallel_degree); experts split over their intermediate size are not implemented"
                )
            shared = self.shared_experts
            if tp_mesh is not None:
                module = self.shared_experts

                def shared(xl: torch.Tensor) -> torch.Tensor:  # the TP-split module on the replicated tokens
                    xd = DTensor.from_local(xl.view(b, seq, d), tp_mesh, [Replicate()], run_check=False)
                    return module(xd).to_local().reshape(b * seq, d)

            # the shared experts are the module (its w1/w2/w3: zerokld linears, FP8 QAT ones under FP8)
            out, ids = sn_moe.deepseek_moe_forward(
                x.reshape(b * seq, d),
                _local(r.gate.weight),
                _local(self.expert_bias_E),
                *weights,
                shared,
                k,
                r.num_expert_groups,
                r.num_limited_groups,
                r.route_norm,
                r.route_scale,
                expert_ids=replay,
                scoring=r.score_func,
                fp8=self.fp8,
                expert_parallel=ep,
                chains=self._moe_chains(),
                k_block=self.k_block,  # tp_k_block at TP 1 (TP x EP: whole experts): vLLM TP N's tree
                experts_input=experts_input,
            )
            if output is not None:  # EP: a Replicate DTensor on the TP mesh under TP x EP, else unchanged
                out = output(out)
        elif _is_dtensor(ex.w1_EFD) and _expert_parallel(ex.w1_EFD):  # TorchTitan EP: experts sharded along E
            from .expert_parallel import moe_expert_parallel

            out, ids = moe_expert_parallel(
                x_BLD,
                self.router.gate.weight,
                ex.w1_EFD,
                ex.w3_EFD,
                ex.w2_EDF,
                k,
                self.router.route_norm,
                replay,
                self.fp8,
                chains=self._moe_chains(),
                k_block=self.k_block,
            )
            self.expert_parallel_size = ex.w1_EFD.device_mesh.size()
        elif _is_dtensor(ex.w1_EFD):  # TorchTitan tensor parallelism: experts sharded along I
            from .tensor_parallel import moe_dtensor

            if self.fp8:
                raise NotImplementedError("zerokld FP8 experts under tensor parallelism (FP8 is single-rank)")

            out, ids = moe_dtensor(
                x_BLD,
                self.router.gate.weight,
                ex.w1_EFD,
                ex.w3_EFD,
                ex.w2_EDF,
                k,
                self.router.route_norm,
                replay,
                self.k_block,
                chains=self._moe_chains(),
            )
        else:
            chains = self._moe_chains()
            out, ids = sn_moe.moe_forward(
                x_BLD.reshape(b * seq, d),
                self.router.gate.weight,
                ex.w1_EFD,
                ex.w3_EFD,
                ex.w2_EDF,
                k,
                self.router.route_norm,
                replay,
                k_block=self.k_block,
                chains=chains,
                fp8=self.fp8,
            )
        self.last_ids = ids.detach().view(b, seq, k)
        if self.training and torch.is_grad_enabled():  # feeds TorchTitan's load-balancing hook, as MoE.forward does
            self._count_routes(self.last_ids, ex.num_experts)
        return out.view(b, seq, d)

    @torch.no_grad()
    def _count_routes(self, ids: torch.Tensor, num_experts: int) -> None:
        """Add the routes ``ids [B, L, top_k]`` of this training forward's counted positions to
        ``tokens_per_expert_E`` (integer counts in float32: exact, in any order below 2**24).

        Raises:
            RuntimeError: ``count_masks`` is set but holds no mask for this forward, or one of another shape."""
        if self.count_masks is not None:
            if not self.count_masks:
                raise RuntimeError("zerokld MoE: a training forward beyond the counted micro-batches")
            mask = self.count_masks.pop(0)
            if tuple(mask.shape) != tuple(ids.shape[:2]):
                raise RuntimeError(f"zerokld MoE: a count mask of {tuple(mask.shape)} for {tuple(ids.shape[:2])}")
            ids = ids[mask.bool()]
        counts = self.tokens_per_expert_E
        counts = counts.to_local() if _is_dtensor(counts) else counts
        counts.add_(torch.bincount(ids.reshape(-1), minlength=num_experts).float())


@override(target=Linear.Config, exact=True, description="zerokld batch-invariant linear")
def zerokld_linear(cfg: Linear.Config) -> ZeroKLDLinear.Config:
    return derive(cfg, ZeroKLDLinear.Config)


@override(target=Linear.Config, fqns=["lm_head"], exact=True, description="zerokld lm_head (+ fused log-probs)")
def zerokld_lm_head(cfg: Linear.Config) -> ZeroKLDLMHead.Config:
    return derive(cfg, ZeroKLDLMHead.Config)


@override(target=RMSNorm.Config, exact=True, description="zerokld batch-invariant RMSNorm")
def zerokld_rmsnorm(cfg: RMSNorm.Config) -> ZeroKLDRMSNorm.Config:
    return derive(cfg, ZeroKLDRMSNorm.Config)


@override(target=Embedding.Config, exact=True, description="zerokld embedding (exact gradient accumulation)")
def zerokld_embedding(cfg: Embedding.Config) -> ZeroKLDEmbedding.Config:
    return derive(cfg, ZeroKLDEmbedding.Config)


@override(target=FeedForward.Config, exact=True, description="zerokld SiLU-and-mul feed-forward")
def zerokld_feed_forward(cfg: FeedForward.Config) -> ZeroKLDFeedForward.Config:
    # w1/w2/w3 are converted here: TorchTitan refuses nested claims by two overrides in one pass.
    return derive(cfg, ZeroKLDFeedForward.Config, **{w: zerokld_linear(getattr(cfg, w)) for w in ("w1", "w2", "w3")})


@override(target=MoE.Config, exact=True, description="zerokld deterministic MoE (Qwen3-MoE routing)")
def zerokld_moe(cfg: MoE.Config) -> ZeroKLDMoE.Config:
    return derive(cfg, ZeroKLDMoE.Config)


@override(target=MoE.Config, exact=True, description="zerokld deterministic MoE, FP8 QAT experts (per channel)")
def zerokld_fp8_moe(cfg: MoE.Config) -> ZeroKLDMoE.Config:
    return derive(cfg, ZeroKLDMoE.Config, fp8="per_channel")


@override(target=MoE.Config, exact=True, description="zerokld deterministic MoE, FP8 QAT experts (128x128 blocks)")
def zerokld_fp8_block_moe(cfg: MoE.Config) -> ZeroKLDMoE.Config:
    return derive(cfg, ZeroKLDMoE.Config, fp8="block")


@override(target=CosSinRoPE.Config, exact=True, description="zerokld rotate-half RoPE")
def zerokld_cos_sin_rope(cfg: CosSinRoPE.Config) -> ZeroKLDCosSinRoPE.Config:
    return derive(cfg, ZeroKLDCosSinRoPE.Config)


@override(target=PartialCosSinRoPE.Config, exact=True, description="zerokld partial rotate-half RoPE")
def zerokld_partial_cos_sin_rope(cfg: PartialCosSinRoPE.Config) -> ZeroKLDCosSinRoPE.Config:
    return derive(cfg, ZeroKLDCosSinRoPE.Config)


@override(target=ComplexRoPE.Config, exact=True, description="zerokld RoPE for interleaved (llama3) q/k")
def zerokld_complex_rope(cfg: ComplexRoPE.Config) -> ZeroKLDComplexRoPE.Config:
    return derive(cfg, ZeroKLDComplexRoPE.Config)


@override(target=FlexAttention.Config, exact=True, description="zerokld fixed-chunk causal attention")
def zerokld_flex_attention(cfg: FlexAttention.Config) -> ZeroKLDAttention.Config:
    return ZeroKLDAttention.Config()


@override(target=ScaledDotProductAttention.Config, exact=True, description="zerokld fixed-chunk causal attention")
def zerokld_sdpa_attention(cfg: ScaledDotProductAttention.Config) -> ZeroKLDAttention.Config:
    return ZeroKLDAttention.Config()


@override(target=ZeroKLDLinear.Config, exact=True, description="zerokld FP8 QAT linear (per-token x per-channel)")
def zerokld_fp8_linear(cfg: ZeroKLDLinear.Config) -> ZeroKLDFp8Linear.Config:
    return derive(cfg, ZeroKLDFp8Linear.Config, granularity="per_channel")


@override(target=ZeroKLDLinear.Config, exact=True, description="zerokld FP8 QAT linear (1x128 x 128x128 blocks)")
def zerokld_fp8_block_linear(cfg: ZeroKLDLinear.Config) -> ZeroKLDFp8Linear.Config:
    return derive(cfg, ZeroKLDFp8Linear.Config, granularity="block")


# Three passes: TorchTitan rejects an override claiming a node whose ancestor another override of the same pass
# claims. The MoE goes first (DeepSeekMoE's shared experts are a FeedForward inside it); the feed-forward override owns
# its w1/w2/w3: after it those linears are ZeroKLDLinear, which the exact Linear override of the last pass no longer
# matches.
OVERRIDE_PASSES = [
    [f"{__name__}.zerokld_moe"],
    [f"{__name__}.zerokld_feed_forward", f"{__name__}.zerokld_lm_head"],
    [
        f"{__name__}.{fn.__name__}"
        for fn in (
            zerokld_linear,
            zerokld_rmsnorm,
            zerokld_embedding,
            zerokld_cos_sin_rope,
            zerokld_partial_cos_sin_rope,
            zerokld_complex_rope,
            zerokld_flex_attention,
            zerokld_sdpa_attention,
        )
    ],
]
OVERRIDE_IMPORTS = [name for names in OVERRIDE_PASSES for name in names]
# FP8 QAT: a fourth pass turns every decoder linear (exactly ZeroKLDLinear: not the lm_head) into ZeroKLDFp8Linear
# (MLA's wkv_b too: ZeroKLDMLAAttention uses its fake-quantized weight), and the MoE override of the first pass is
# the one whose routed experts are FP8 (their router stays high precision: it is used as a tensor).
FP8_OVERRIDES = {"per_channel": f"{__name__}.zerokld_fp8_linear", "block": f"{__name__}.zerokld_fp8_block_linear"}
FP8_MOE_OVERRIDES = {"per_channel": f"{__name__}.zerokld_fp8_moe", "block": f"{__name__}.zerokld_fp8_block_moe"}


def set_tp_k_block(model_cfg, k_block: int) -> None:
    """Make every decoder layer's row-parallel projections (``attention.wo`` — MLA's too —, ``feed_forward.w2``,
    DeepSeekMoE's shared experts' ``w2``) :class:`ZeroKLDRowParallelLinear` with ``k_block``
    (:attr:`shared_numerics.NumericsMode.tp_k_block`), and the MoE experts' down projections sum with the same tree
    (:class:`ZeroKLDMoE` ``k_block``); the lm_head's fused
    log-probs become the vocab-parallel ones (:class:`ZeroKLDLMHead` ``vocab_parallel``). The backward's sums over a
    TP-split dimension take the tree too: the column-parallel projections' input gradients (``wq``/``wk``/``wv`` or
    ``wqkv``, ``w1``/``w3``, the lm_head: :class:`ZeroKLDLinear` ``k_block``) and the per-head q/k norms' gains
    (:class:`ZeroKLDRMSNorm` ``head_tree``).

    Raises:
        ValueError: FP8 or LoRA projections (not the zerokld linear)."""
    if type(getattr(model_cfg, "lm_head", None)) is ZeroKLDLMHead.Config:
        model_cfg.lm_head = derive(model_cfg.lm_head, ZeroKLDLMHead.Config, vocab_parallel=True, k_block=int(k_block))
    for i, layer in enumerate(model_cfg.layers):
        shared = None
        if getattr(layer, "moe", None) is not None:
            if type(layer.moe) is not ZeroKLDMoE.Config:
                raise ValueError(f"tp_k_block: layer {i} moe is {type(layer.moe).__qualname__}, not the zerokld MoE")
            layer.moe = derive(layer.moe, ZeroKLDMoE.Config, k_block=int(k_block))
            shared = layer.moe.shared_experts  # DeepSeekMoE's: a SwiGLU split over I like the dense MLP
        qkv = getattr(layer.attention, "qkv_linear", None)
        mlps = (getattr(layer, "feed_forward", None), shared)
        columns = [(qkv, n) for n in ("wq", "wkv", "wqkv")] + [(m, w) for m in mlps for w in ("w1", "w3")]
        if type(layer.attention) in (ZeroKLDMLAAttention.Config, ZeroKLDDSAAttention.Config):  # MLA (and DSA): the
            # latent's gradient over the heads in the tree; the query up-projection's input gradient too, and the
            # replicated low-rank projections' whole
            layer.attention = derive(layer.attention, type(layer.attention), head_tree=True)
            columns += [(layer.attention, n) for n in ("wq", "wq_a", "wq_b", "wkv_a")]
        for owner, name in columns:
            cfg = getattr(owner, name, None)
            if type(cfg) is ZeroKLDLinear.Config:  # column-parallel: dX with the tree
                setattr(owner, name, derive(cfg, ZeroKLDLinear.Config, k_block=int(k_block)))
        qk_norm = getattr(layer.attention, "qk_norm", None)
        if type(qk_norm) is ZeroKLDRMSNorm.Config:
            layer.attention.qk_norm = derive(qk_norm, ZeroKLDRMSNorm.Config, head_tree=True)
        for owner, name in ((layer.attention, "wo"), *((m, "w2") for m in mlps)):
            if owner is None:
                continue
            cfg = getattr(owner, name)
            if type(cfg) is not ZeroKLDLinear.Config:
                raise ValueError(
                    f"tp_k_block: layer {i} {name} is {type(cfg).__qualname__} (FP8 or LoRA), not the zerokld linear"
                )
            setattr(owner, name, derive(cfg, ZeroKLDRowParallelLinear.Config, k_block=int(k_block)))


def apply_zerokld_overrides(config_root, fp8: str | None = None) -> list[str]:
    """Apply every zerokld override to a TorchTitan config tree (``Trainer.Config`` or a model config) in place.

    Args:
        config_root: the config tree.
        fp8: ``None`` (no FP8), ``"per_channel"`` or ``"block"``: FP8 QAT on the decoder projections, with the
            granularity vLLM serves (``additional_config`` ``fp8``), and on the routed experts of MoE blocks.

    Returns:
        TorchTitan's log lines, one per replaced node.

    Raises:
        ValueError: an unknown ``fp8`` granularity.
    """
    passes = [list(names) for names in OVERRIDE_PASSES]
    if fp8 is not None:
        if fp8 not in FP8_OVERRIDES:
            raise ValueError(f"unknown FP8 granularity {fp8!r}; expected one of {sorted(FP8_OVERRIDES)}")
        passes.append([FP8_OVERRIDES[fp8]])
        passes[0] = [FP8_MOE_OVERRIDES[fp8] if n == f"{__name__}.zerokld_moe" else n for n in passes[0]]
    lines: list[str] = []
    for names in passes:
        lines += apply_overrides(OverrideConfig(imports=names), config_root)
    return lines
