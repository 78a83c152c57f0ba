"""vLLM's ``LlamaForCausalLM``, stock unless the zerokld switch is on (then :mod:`vllm_plugin.models.dense`)."""
from vllm.model_executor.models.llama import LlamaForCausalLM

from vllm_plugin.models.dense import ZeroKLDMixin

from . import ADAPTER


class ZeroKLDLlamaForCausalLM(ZeroKLDMixin, LlamaForCausalLM):
    adapter = ADAPTER
