"""vLLM's ``Qwen3MoeForCausalLM``, stock (FusedMoE) unless the zerokld switch is on (then the dense decoder with
:class:`vllm_plugin.models.moe.MoEBlock` and routed-expert capture)."""
from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM

from vllm_plugin.models.moe import ZeroKLDMoEMixin

from . import ADAPTER


class ZeroKLDQwen3MoeForCausalLM(ZeroKLDMoEMixin, Qwen3MoeForCausalLM):
    adapter = ADAPTER
