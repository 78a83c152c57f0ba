"""vLLM's ``Qwen2ForCausalLM``, stock unless the zerokld switch is on (then :mod:`vllm_plugin.models.dense`)."""
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

from vllm_plugin.models.dense import ZeroKLDMixin

from . import ADAPTER


class ZeroKLDQwen2ForCausalLM(ZeroKLDMixin, Qwen2ForCausalLM):
    adapter = ADAPTER
