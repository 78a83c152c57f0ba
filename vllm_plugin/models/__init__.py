"""Model classes the plugin registers with vLLM's ``ModelRegistry`` (lazy ``module:Class`` paths)."""

SUPPORTED_ARCHITECTURES = {
    "Qwen3ForCausalLM": "vllm_plugin.models.dense:ZeroKLDQwen3ForCausalLM",
    "LlamaForCausalLM": "vllm_plugin.models.dense:ZeroKLDLlamaForCausalLM",
}
