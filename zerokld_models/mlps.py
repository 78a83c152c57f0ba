"""MLPs, each a component with its host-free spec: the layer it makes of an HF config (:class:`MLP`), the config
fields it reads, why it refuses a config (:meth:`SwiGLU.problems`), its row-parallel linears under tensor parallelism
(:meth:`SwiGLU.row_parallel`) and what the hosts' LoRA and tensor parallelism do with it. The hosts ask these of
the component of each layer (:attr:`MLP.component`), never of an architecture or MLP name.

* :class:`SwiGLU` — ``down(silu(gate x) * up x)``. HF ``LlamaMLP``; vLLM ``LlamaMLP``.
* :class:`MoE` — softmax top-k routed experts (Qwen3-MoE: :func:`shared_numerics.moe.moe_forward`), with Qwen3-Next's
  sigmoid-gated shared expert where the architecture has one. HF ``Qwen3MoeSparseMoeBlock``,
  ``Qwen3NextSparseMoeBlock``; vLLM ``models/qwen3_moe.py``, ``models/qwen3_next.py``.
* :class:`DeepSeekMoE` — group-limited top-k routing (sigmoid scores with a selection bias, or softmax:
  :func:`shared_numerics.moe.route_grouped_topk`), weights times ``routed_scaling_factor``, always-on shared experts.
  HF ``DeepseekV3MoE``, ``Glm4MoeLiteMoE``; vLLM ``models/deepseek_v2.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import ModelConfig

__all__ = ["MLP", "MLPS", "MLP_KINDS", "DeepSeekMoE", "MoE", "SwiGLU"]

#: MLPs: the dense SwiGLU MLP, a softmax top-k routed MoE (Qwen3-MoE), DeepSeekMoE (group-limited routing, shared
#: experts)
MLP_KINDS = ("swiglu", "moe", "deepseek_moe")


@dataclass(frozen=True)
class MLP:
    """A layer's MLP.

    Attributes:
        kind: one of :data:`MLP_KINDS`.
        intermediate_size: the dense MLP's, or each routed expert's.
        num_experts, top_k: the routed experts and how many each token takes (0 for ``swiglu``).
        routing: the MoE's router (``zerokld_plugins.specs.MOE_ROUTINGS``), ``None`` for ``swiglu``.
        shared_experts: DeepSeekMoE's always-on experts.
        shared_expert_gate: the softmax MoE has Qwen3-Next's sigmoid-gated shared expert (HF builds it whatever its
            width: a 0-wide one adds nothing).
        shared_expert_size: its intermediate size (``shared_expert_intermediate_size``).
    """

    kind: str
    intermediate_size: int
    num_experts: int = 0
    top_k: int = 0
    routing: str | None = None
    shared_experts: int = 0
    shared_expert_gate: bool = False
    shared_expert_size: int = 0

    def __post_init__(self):
        if self.kind not in MLP_KINDS:
            raise ValueError(f"MLP {self.kind!r}: not one of {MLP_KINDS}")

    @property
    def routed(self) -> bool:
        return self.component.routed

    @property
    def component(self) -> SwiGLU | MoE | DeepSeekMoE:
        """The component that answers for this layer (:data:`MLPS`)."""
        return MLPS[self.kind]


class SwiGLU:
    """The dense MLP. Config fields: ``intermediate_size``, ``hidden_act`` (silu), ``mlp_bias`` (none)."""

    kind = "swiglu"
    routed = False
    #: routes in expert groups beside shared experts (DeepSeekMoE), not one softmax top-k over every expert
    grouped = False
    #: zerokld's LoRA adapts its projections (vLLM and the trainer)
    lora = True
    #: the trainer's TP splits it over its intermediate size like vLLM's
    trainer_tp_needs_ep = False

    def layer(self, cfg: ModelConfig, adapter) -> MLP:
        return MLP(self.kind, cfg.intermediate_size)

    def problems(self, cfg: ModelConfig, adapter) -> list[str]:
        """What of ``cfg`` zerokld's SwiGLU MLP does not implement (empty: none)."""
        problems = []
        if cfg.mlp_bias:
            problems.append("MLP bias")
        if cfg.hidden_act != "silu":
            problems.append(f"activation {cfg.hidden_act}")
        return problems

    def row_parallel(self, mlp: MLP) -> tuple[tuple[str, int], ...]:
        """``(projection, K)`` of its row-parallel linears: ``down_proj`` over the intermediate size."""
        return (("down_proj", mlp.intermediate_size),)


class MoE(SwiGLU):
    """Softmax top-k routed SwiGLU experts in every layer (Qwen3-MoE), and beside them the sigmoid-gated shared expert
    ``sigmoid(shared_expert_gate(x)) * shared_expert(x)`` where the architecture has one (Qwen3-Next: the folder's
    ``shared_expert_gate``). Config fields: ``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``,
    ``norm_topk_prob``, ``mlp_only_layers``, ``decoder_sparse_step``, ``shared_expert_intermediate_size``."""

    kind = "moe"
    routed = True
    #: tested with zerokld's LoRA on attention only: the experts would not be adapted
    lora = False

    def layer(self, cfg: ModelConfig, adapter) -> MLP:
        gated = cfg.shared_expert_gate and not self.grouped
        return MLP(
            self.kind,
            int(cfg.moe_intermediate_size or cfg.intermediate_size),
            int(cfg.num_experts or 0),
            int(cfg.num_experts_per_tok or 0),
            adapter.moe_routing,
            self.shared_experts(cfg),
            gated,
            cfg.shared_expert_intermediate_size if gated else 0,
        )

    def shared_experts(self, cfg: ModelConfig) -> int:
        """Always-on experts beside the routed ones: none."""
        return 0

    def routed_at(self, cfg: ModelConfig, i: int) -> bool:
        """Whether HF's decoder layer ``i`` builds this MoE (``Qwen3MoeDecoderLayer``: not in ``mlp_only_layers``,
        every ``decoder_sparse_step``-th layer)."""
        return i not in cfg.mlp_only_layers and (i + 1) % cfg.decoder_sparse_step == 0

    def problems(self, cfg: ModelConfig, adapter) -> list[str]:
        problems = super().problems(cfg, adapter)
        if cfg.mlp_only_layers:
            problems.append(f"mlp_only_layers {list(cfg.mlp_only_layers)} (every layer must be MoE)")
        if cfg.decoder_sparse_step != 1:
            problems.append(f"decoder_sparse_step {cfg.decoder_sparse_step}")
        if cfg.shared_expert_intermediate_size and not cfg.shared_expert_gate:
            problems.append("shared experts")
        return problems

    def row_parallel(self, mlp: MLP) -> tuple[tuple[str, int], ...]:
        """The experts' ``down_proj`` over each expert's intermediate size (and the gated shared expert's over its
        own)."""
        shared = (("shared expert's down_proj", mlp.shared_expert_size),) if mlp.shared_expert_size else ()
        return (("experts' down_proj", mlp.intermediate_size),) + shared


#: the (``scoring_func``, ``topk_method``) pairs each DeepSeekMoE routing implements
#: (:func:`shared_numerics.moe.route_grouped_topk`): DeepSeek-V3's and DeepSeek-V2's
DEEPSEEK_ROUTINGS = {
    "grouped_sigmoid": (("sigmoid", "noaux_tc"),),
    "grouped_softmax": (("softmax", "greedy"), ("softmax", "group_limited_greedy")),
}


class DeepSeekMoE(MoE):
    """DeepSeekMoE: routed experts in ``n_group`` groups (top ``topk_group`` groups, then top-k), weights times
    ``routed_scaling_factor``, ``n_shared_experts`` shared experts; the dense layers before them (the plan's
    ``swiglu`` layers). Config fields: ``n_routed_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``,
    ``n_group``, ``topk_group``, ``scoring_func``, ``topk_method``, ``routed_scaling_factor``, ``norm_topk_prob``,
    ``n_shared_experts``, ``first_k_dense_replace`` / ``mlp_layer_types``, ``moe_layer_freq``."""

    kind = "deepseek_moe"
    grouped = True
    #: zerokld's LoRA adapts the model's attention and dense layers; tested with the experts left unadapted
    lora = True
    #: the trainer keeps each expert whole on its rank: TP only with expert parallelism over the TP ranks
    trainer_tp_needs_ep = True

    def shared_experts(self, cfg: ModelConfig) -> int:
        """``n_shared_experts``, each ``moe_intermediate_size`` wide."""
        return cfg.n_shared_experts

    def routed_at(self, cfg: ModelConfig, i: int) -> bool:
        """Whether HF's decoder layer ``i`` builds DeepSeekMoE: ``mlp_layer_types[i] == "sparse"``
        (``Glm4MoeLiteDecoderLayer``, ``GlmMoeDsaDecoderLayer``, ``DeepseekV32DecoderLayer``), else ``i >=
        first_k_dense_replace`` (``DeepseekV2/V3DecoderLayer``; vLLM also reads ``moe_layer_freq``: the support
        check refuses other values)."""
        if cfg.mlp_layer_types:
            return i < len(cfg.mlp_layer_types) and cfg.mlp_layer_types[i] == "sparse"
        return i >= cfg.first_k_dense_replace

    def problems(self, cfg: ModelConfig, adapter) -> list[str]:
        problems = SwiGLU.problems(self, cfg, adapter)
        pairs = DEEPSEEK_ROUTINGS.get(adapter.moe_routing, ())
        if (cfg.scoring_func, cfg.topk_method) not in pairs:
            problems.append(
                f"DeepSeekMoE routing scoring_func={cfg.scoring_func!r} topk_method={cfg.topk_method!r} "
                f"(supported for {adapter.architecture}: " + ", ".join(f"{a} with {b}" for a, b in pairs) + ")"
            )
        if cfg.moe_layer_freq != 1:
            problems.append(f"moe_layer_freq {cfg.moe_layer_freq}")
        k, n = cfg.first_k_dense_replace, cfg.num_hidden_layers
        if cfg.mlp_layer_types and cfg.mlp_layer_types != ("dense",) * k + ("sparse",) * (n - k):
            problems.append(
                f"mlp_layer_types {list(cfg.mlp_layer_types)} (supported: {n} layers, the dense ones first, then"
                " sparse)"
            )
        stated = cfg.raw.get("first_k_dense_replace")
        if cfg.mlp_layer_types and stated is not None and stated != k:
            problems.append(f"first_k_dense_replace {stated} where mlp_layer_types has {k} dense layers first")
        if not cfg.num_experts or cfg.num_experts % cfg.n_group or not 1 <= cfg.topk_group <= cfg.n_group:
            problems.append(
                f"n_routed_experts {cfg.num_experts} in n_group {cfg.n_group} groups, topk_group {cfg.topk_group}"
            )
        return problems

    def row_parallel(self, mlp: MLP) -> tuple[tuple[str, int], ...]:
        """The experts' ``down_proj``, and the shared experts' over ``intermediate_size x shared_experts``."""
        shared = (("shared experts' down_proj", mlp.intermediate_size * mlp.shared_experts),)
        return super().row_parallel(mlp) + (shared if mlp.shared_experts else ())


_MOE, _DEEPSEEK_MOE = MoE(), DeepSeekMoE()
MLPS: dict[str, SwiGLU | MoE | DeepSeekMoE] = {"swiglu": SwiGLU(), "moe": _MOE, "deepseek_moe": _DEEPSEEK_MOE}
#: the routed component of each ``ModelAdapterSpec.moe_routing``
_ROUTED: dict[str, MoE | DeepSeekMoE] = {
    "softmax": _MOE,
    "grouped_sigmoid": _DEEPSEEK_MOE,
    "grouped_softmax": _DEEPSEEK_MOE,
}


def routed_component(adapter) -> MoE | DeepSeekMoE:
    """The routed MLP component an architecture declares (``ModelAdapterSpec.moe_routing``)."""
    return _ROUTED[adapter.moe_routing]
