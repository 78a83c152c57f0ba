"""vLLM's ``Qwen3ForCausalLM``, stock unless the zerokld switch is on (then :mod:`vllm_plugin.models.dense`)."""
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

from vllm_plugin.models.dense import ZeroKLDMixin

from . import ADAPTER


class ZeroKLDQwen3ForCausalLM(ZeroKLDMixin, Qwen3ForCausalLM):
    adapter = ADAPTER
