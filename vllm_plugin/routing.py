"""Routing capture on vLLM-CPU: the worker half of vLLM's own ``enable_return_routed_experts`` for zerokld MoE models.

vLLM 0.32 already carries routed experts from the scheduler to the user: ``SchedulerOutput.
aux_output_connector_metadata`` tells the worker, per scheduled request, the first token position it still owes;
``ModelRunnerOutput.aux_output_connector_output`` answers ``{req_id: AuxRequestOutput(token_start, rows)}``; the
scheduler keeps the accepted rows (``AuxOutputSchedulerConnector.take_output``), the output processor concatenates
them into ``CompletionOutput.routed_experts`` (``[num_tokens - 1, layers, top_k]``: every token that went through the
forward — prompt and completion, not the last sampled one), and the chat-completions API returns it base64-``.npy``
encoded as ``routed_experts``. Only the worker side is GPU-only (Model Runner V2) and refused on CPU at config time.

This module supplies it for zerokld MoE models (batch_invariant on): the config check accepts the V1 runner, and
after each step the runner reads each scheduled request's rows for positions ``[token_start, computed)`` from the
model's :class:`vllm_plugin.models.moe.RouteCache` through the request's block table (cached-prefix tokens included:
their slots still hold the routes written with their KV). Rows are int16.
Sources: ``vllm/distributed/aux_output_connector/connector.py``, ``vllm/v1/engine/output_processor.py``.
"""

from __future__ import annotations

import torch

from .config import ZeroKLDConfigError, from_vllm_config
from .seams import replace

__all__ = ["install", "request_rows"]


def _patch_config_check() -> None:
    def wrap(original):
        def verify(self) -> None:
            if not self.aux_output_config.enabled or not from_vllm_config(self).batch_invariant:
                return original(self)
            problems = []
            if not self.model_config.is_moe:
                problems.append("routed experts need an MoE model")
            if not self.cache_config.enable_prefix_caching:
                problems.append("routed experts need prefix caching on (vLLM's rule)")
            if self.speculative_config is not None:
                problems.append("speculative decoding")
            from vllm.platforms import current_platform

            if current_platform.is_cuda_alike() and not self.model_config.enforce_eager:
                problems.append("CUDA graphs (routes are recorded in Python after the forward: use enforce_eager)")
            if problems:
                raise ZeroKLDConfigError("enable_return_routed_experts with zerokld: " + "; ".join(problems))

        return verify

    replace("vllm.config.vllm:VllmConfig._verify_aux_output_compatibility", wrap)


def request_rows(model, block_ids: list[int], block_size: int, start: int, end: int):
    """Routes of positions ``[start, end)`` of one request: ``[end - start, layers, top_k]`` int16 numpy.

    Args:
        model: a zerokld MoE model (has ``route_cache``).
        block_ids: the request's KV block table (first KV-cache group).
        block_size: tokens per block.
    """
    pos = torch.arange(start, end, dtype=torch.int64)
    blocks = torch.tensor(block_ids, dtype=torch.int64)[pos // block_size]
    return model.route_cache.read(blocks * block_size + pos % block_size).numpy()


def _block_size(runner) -> int:
    return runner.input_batch.block_table[0].block_size


def _patch_runner() -> None:
    from vllm.distributed.aux_output_connector.connector import AuxRequestOutput
    from vllm.v1.outputs import ModelRunnerOutput

    def wrap(sample_tokens):
        def zerokld_sample_tokens(self, grammar_output):
            state = self.execute_model_state
            output = sample_tokens(self, grammar_output)
            model = self.get_model() if state is not None else None
            meta = getattr(state.scheduler_output, "aux_output_connector_metadata", None) if state is not None else None
            if meta is None or not getattr(model, "capture_routes", False) or not isinstance(output, ModelRunnerOutput):
                return output
            rows = {}
            bs = _block_size(self)
            for req_id, start in meta.requests.items():
                req = self.requests[req_id]
                end = req.num_computed_tokens + state.scheduler_output.num_scheduled_tokens[req_id]
                rows[req_id] = AuxRequestOutput(
                    token_start=start, rows=request_rows(model, req.block_ids[0], bs, start, end)
                )
            output.aux_output_connector_output = rows
            return output

        return zerokld_sample_tokens

    replace("vllm.v1.worker.gpu_model_runner:GPUModelRunner.sample_tokens", wrap)


def install() -> None:
    """Install the config check and the runner hook (idempotent; inert for engines without capture)."""
    _patch_config_check()
    _patch_runner()
