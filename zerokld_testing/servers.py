"""The hot-load tests' ``vllm serve`` (:class:`HotLoadServer`, on :class:`vllm_plugin.serve.OpenAIServer`) and
server flags the tests share."""
from __future__ import annotations

import json
import os
from pathlib import Path

from vllm_plugin.engines import kv_cache_bytes
from vllm_plugin.serve import OpenAIServer

__all__ = ["HotLoadServer", "kv_cache_args", "tmpfs_prefix"]


class HotLoadServer(OpenAIServer):
    """A bf16 ``vllm serve`` with the zerokld numerics and the hot-load endpoint (``zerokld_hotload``) on, as the
    hot-load tests use it: chunked prefill (64-token steps), an API key, prompt-token details (cached-token counts),
    a pass-through chat template, and the copy-fault hook's arm path (:mod:`vllm_plugin.faults`) in its environment.

    Args:
        ckpt: the ``--model`` checkpoint; root, state: the ``hot_load`` section's snapshot root and state dir.
        log: the server log; api_key: the key it is started with (``--api-key``; see :meth:`start`).
        extra_args: more server flags (e.g. ``--enable-lora``).
        max_model_len: ``--max-model-len`` (at most the checkpoint's ``max_position_embeddings``).
    """

    def __init__(self, ckpt: str, root: Path, state: Path, log: Path, api_key: str,
                 extra_args: tuple[str, ...] = (), max_model_len: int = 512) -> None:
        self.ckpt, self.root, self.state, self.api_key, self.extra_args = ckpt, root, state, api_key, extra_args
        self.max_model_len = max_model_len
        # vllm_plugin.faults: while this file exists, a reload pauses inside the weight copy (inert otherwise)
        self.copy_fault_arm = state.parent / "copy-fault.arm"
        super().__init__([], log, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu",
                                       "VLLM_PLUGINS": "zerokld,zerokld_hotload",
                                       "ZEROKLD_FAULT_COPY_ARM": str(self.copy_fault_arm)})

    def start(self, extra_env: dict | None = None, api_key_flag: bool = True) -> None:
        """Start (``api_key_flag=False``: no ``--api-key`` flag; the key may come from ``VLLM_API_KEY``)."""
        cfg = {"zerokld": {"batch_invariant": True,
                           "hot_load": {"snapshot_root": str(self.root), "state_dir": str(self.state)}}}
        self.args = ["--model", self.ckpt, "--dtype", "bfloat16", "--gpu-memory-utilization", "0.3",
                     "--max-model-len", str(self.max_model_len), "--enforce-eager", "--max-num-batched-tokens", "64",
                     "--chat-template", "{% for m in messages %}{{ m['content'] }}{% endfor %}",
                     "--enable-prompt-tokens-details",  # usage.prompt_tokens_details.cached_tokens: prefix hits
                     *(["--api-key", self.api_key] if api_key_flag else []), *kv_cache_args(), *self.extra_args,
                     "--additional-config", json.dumps(cfg)]
        super().start(extra_env)


def kv_cache_args() -> list[str]:
    """``["--kv-cache-memory-bytes", N]`` when :data:`vllm_plugin.engines.KV_CACHE_ENV` is set, else ``[]``."""
    n = kv_cache_bytes()
    return ["--kv-cache-memory-bytes", str(n)] if n else []


def tmpfs_prefix(mount_point: Path, size: str) -> list[str]:
    """A :attr:`OpenAIServer.prefix` that starts the server in its own user and mount namespaces (``unshare``, no
    privileges needed) with a fresh tmpfs of ``size`` (``"24m"``) mounted on ``mount_point``: a disk that really
    fills up, seen only by the server; the test reaches it through ``/proc/<server pid>/root<mount_point>``."""
    return ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
            f'mount -t tmpfs -o size={size} tmpfs "$0" && exec "$@"', str(mount_point)]
