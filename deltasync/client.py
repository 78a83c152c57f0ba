"""Trainer-side client of the hot-load HTTP API (:mod:`vllm_plugin.hotload.endpoint`): write the next snapshot with
a :class:`~deltasync.writer.SnapshotWriter`, signal every replica, wait for readiness, fall back to a full snapshot
when an incremental one is refused.

Wire format: :mod:`deltasync.protocol` (Fireworks' bring-your-own-trainer signal, ``../shared/DESIGN.md`` §5).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .protocol import DEFAULT_DRAIN_TIMEOUT_S, PREFIX, Signal
from .writer import SnapshotInfo, SnapshotWriter

__all__ = ["HotLoadClient", "HotLoadRefused", "PushResult"]


class HotLoadRefused(RuntimeError):
    """A replica refused a snapshot (``status``: its HTTP status, ``error``: its message)."""

    def __init__(self, status: int, error: str) -> None:
        super().__init__(f"hot-load refused ({status}): {error}")
        self.status, self.error = status, error


@dataclass
class PushResult:
    """What one :meth:`HotLoadClient.push` shipped: the snapshot that serves now, seconds from signal to ready,
    and the refused attempts before it (an incremental one, when it fell back to full)."""

    snapshot: SnapshotInfo
    swap_seconds: float
    refused: list[str] = field(default_factory=list)


class HotLoadClient:
    """Args:
        base_urls: one or more replica base URLs (``http://host:port``).
        api_key: the servers' ``--api-key`` (sent as a Bearer token), or ``None``.
        transition: ``"async"`` or ``"sync"``; ``drain_timeout``: seconds (sync).
        reset_prompt_cache: ``"all"`` | ``"new_session"`` | ``"none"``.
    """

    def __init__(self, base_urls: str | list[str], api_key: str | None = None, transition: str = "async",
                 drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S, reset_prompt_cache: str = "all",
                 timeout: float = 600.0) -> None:
        self.urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
        self.transition, self.drain_timeout = transition, drain_timeout
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.reset_prompt_cache, self.timeout = reset_prompt_cache, timeout

    def signal_for(self, info: SnapshotInfo) -> Signal:
        """The :class:`deltasync.Signal` announcing ``info`` with this client's settings."""
        return Signal.for_snapshot(info, self.reset_prompt_cache, self.transition, self.drain_timeout)

    def signal(self, info: SnapshotInfo) -> None:
        """Load ``info`` on every replica (sequentially); returns when all serve it.

        Raises:
            HotLoadRefused: the first replica that refused (the ones before it serve ``info``).
        """
        import requests

        sig = self.signal_for(info)
        body, headers = sig.body(), {**self.headers, **sig.headers()}
        for url in self.urls:
            r = requests.post(url + PREFIX, json=body, headers=headers, timeout=self.timeout)
            if r.status_code != 200:
                try:
                    err = r.json().get("error", r.text)
                except ValueError:
                    err = r.text
                raise HotLoadRefused(r.status_code, err)

    def status(self) -> list[dict]:
        import requests

        return [requests.get(u + PREFIX + "/status", headers=self.headers, timeout=30).json() for u in self.urls]

    def push(self, writer: SnapshotWriter, identity: str, tensors: dict[str, torch.Tensor]) -> PushResult:
        """Write the next snapshot (full or incremental, as the writer's cadence says), signal, and on a refused
        incremental snapshot write ``<identity>-full`` as a full snapshot and signal that.

        Raises:
            HotLoadRefused: a full snapshot was refused too.
        """
        info = writer.write(identity, tensors)
        refused = []
        t0 = time.perf_counter()
        try:
            self.signal(info)
        except HotLoadRefused as e:
            writer.failed(info)
            if info.kind == "full":
                raise
            refused.append(f"{info.identity}: {e.error}")
            info = writer.write(f"{identity}-full", tensors, kind="full")
            t0 = time.perf_counter()
            self.signal(info)
        writer.confirm(info)
        return PushResult(info, time.perf_counter() - t0, refused)
