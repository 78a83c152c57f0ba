"""What zerokld adds to vLLM's outputs, in one replacement per vLLM attribute (:mod:`vllm_plugin.seams`): two
features contribute to the same two targets, so neither wraps the other's patch.

* ``RequestState._new_completion_output`` (``v1/engine/output_processor.py``): each ``CompletionOutput`` gets
  ``zerokld_seed`` / ``zerokld_numerics`` (:func:`vllm_plugin.sampler.tag_output`) and, where the hot-load endpoint
  serves, its weight-version spans so far (:func:`vllm_plugin.hotload.attribution.spans_so_far`).
* ``OpenAIServingCompletion.request_output_to_completion_response`` (``entrypoints/openai/completion/serving.py``):
  each ``/v1/completions`` choice gets the same fields (:func:`vllm_plugin.sampler.tag_choice`,
  :func:`vllm_plugin.hotload.attribution.tag_choice`).
"""

from __future__ import annotations

from .seams import replace

__all__ = ["install"]


def install() -> None:
    """Install both replacements (idempotent; at registration)."""
    from .hotload import attribution
    from .sampler import tag_choice, tag_output

    def completion_output(original):
        def zerokld_new_completion_output(self, *args, **kwargs):
            out = original(self, *args, **kwargs)
            tag_output(self, out)
            attribution.spans_so_far(self, out)
            return out

        return zerokld_new_completion_output

    def completion_response(original):
        def zerokld_completion_response(self, final_res_batch, *args, **kwargs):
            response = original(self, final_res_batch, *args, **kwargs)
            outputs = [o for res in final_res_batch for o in res.outputs]
            for choice, out in zip(response.choices, outputs, strict=True):  # vLLM appends choices in this order
                tag_choice(choice, out)
                attribution.tag_choice(choice, out)
            return response

        return zerokld_completion_response

    replace("vllm.v1.engine.output_processor:RequestState._new_completion_output", completion_output)
    replace(
        "vllm.entrypoints.openai.completion.serving:OpenAIServingCompletion.request_output_to_completion_response",
        completion_response,
    )
