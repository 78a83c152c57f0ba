"""Trainer-side client of the hot-load HTTP API (:mod:`vllm_plugin.hotload.endpoint`): write the next snapshot with
a :class:`~deltasync.writer.SnapshotWriter`, signal every replica of the fleet at once, wait for readiness, and when
some replicas refuse an incremental snapshot, send those replicas — and only those — a full snapshot of the same
weights, so the fleet serves the same bits again (:attr:`PushResult.fallback` says which; the next snapshot is full
for all, so the chains meet again). :meth:`HotLoadClient.fleet_status` tells whether the fleet is consistent.

Wire format: :mod:`deltasync.protocol` (Fireworks' bring-your-own-trainer signal, ``docs/design.md`` §5).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from zerokld_plugins.errors import ZeroKLDClientError

from .protocol import DEFAULT_DRAIN_TIMEOUT_S, PREFIX, Signal
from .writer import SnapshotInfo, SnapshotWriter

__all__ = ["HotLoadClient", "HotLoadRefused", "PushResult"]


class HotLoadRefused(ZeroKLDClientError, RuntimeError):
    """Replicas refused a snapshot: ``status`` (= ``status_code``) and ``error`` are the first refusal's HTTP status
    and message, ``failures`` every refusing replica's (URL → (status, error); status 0: unreachable), ``served`` the
    URLs that loaded it."""

    @property
    def status_code(self) -> int:  # type: ignore[override]
        return self.status

    def __init__(
        self,
        status: int,
        error: str,
        failures: dict[str, tuple[int, str]] | None = None,
        served: list[str] | None = None,
    ) -> None:
        n = len(failures or {})
        super().__init__(f"hot-load refused ({status}): {error}" + (f" (and {n - 1} more replicas)" if n > 1 else ""))
        self.status, self.error = status, error
        self.failures, self.served = failures or {}, served or []


@dataclass
class PushResult:
    """What one :meth:`HotLoadClient.push` shipped: the snapshot that serves now, seconds from signal to ready, the
    refusals before it, and ``fallback``: the replicas that refused the incremental snapshot and got ``snapshot``,
    the full ``<identity>-full`` of the same weights (the other replicas serve the incremental ``<identity>``)."""

    snapshot: SnapshotInfo
    swap_seconds: float
    refused: list[str] = field(default_factory=list)
    fallback: list[str] = field(default_factory=list)  # URLs that got the full snapshot after refusing the delta


class HotLoadClient:
    """Args:
    base_urls: one or more replica base URLs (``http://host:port``).
    api_key: the servers' ``--api-key`` (sent as a Bearer token), or ``None``.
    transition: ``"async"`` or ``"sync"``; ``drain_timeout``: seconds (sync).
    reset_prompt_cache: ``"all"`` | ``"new_session"`` | ``"none"``.
    """

    def __init__(
        self,
        base_urls: str | list[str],
        api_key: str | None = None,
        transition: str = "async",
        drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S,
        reset_prompt_cache: str = "all",
        timeout: float = 600.0,
    ) -> None:
        self.urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
        self.transition, self.drain_timeout = transition, drain_timeout
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.reset_prompt_cache, self.timeout = reset_prompt_cache, timeout

    def signal_for(self, info: SnapshotInfo, lora_name: str | None = None) -> Signal:
        """The :class:`deltasync.Signal` announcing ``info`` (``lora_name``: a version of that LoRA adapter) with this
        client's settings."""
        return Signal.for_snapshot(info, self.reset_prompt_cache, self.transition, self.drain_timeout, lora_name)

    def _post(self, url: str, body: dict, headers: dict) -> tuple[int, str]:
        import requests

        try:
            r = requests.post(url + PREFIX, json=body, headers=headers, timeout=self.timeout)
        except requests.RequestException as e:
            return 0, f"unreachable: {type(e).__name__}"
        if r.status_code == 200:
            return 200, ""
        try:
            return r.status_code, str(r.json().get("error", r.text))
        except ValueError:
            return r.status_code, r.text

    def signal(self, info: SnapshotInfo, lora_name: str | None = None, urls: list[str] | None = None) -> None:
        """Load ``info`` on every replica (``urls``: only these) at once; returns when all serve it.

        Raises:
            HotLoadRefused: some replicas refused (or were unreachable); ``failures`` names each, ``served`` the
                replicas that loaded it.
        """
        from concurrent.futures import ThreadPoolExecutor

        sig = self.signal_for(info, lora_name)
        body, headers, urls = sig.body(), {**self.headers, **sig.headers()}, list(urls or self.urls)
        if len(urls) == 1:  # one replica: no thread
            answers = {urls[0]: self._post(urls[0], body, headers)}
        else:
            with ThreadPoolExecutor(max_workers=len(urls)) as pool:
                answers = dict(zip(urls, pool.map(lambda u: self._post(u, body, headers), urls), strict=True))
        failures = {u: a for u, a in answers.items() if a[0] != 200}
        if failures:
            status, error = next(iter(failures.values()))
            raise HotLoadRefused(status, error, failures, [u for u in urls if u not in failures])

    def status(self) -> list[dict]:
        import requests

        return [requests.get(u + PREFIX + "/status", headers=self.headers, timeout=30).json() for u in self.urls]

    def fleet_status(self) -> dict:
        """Every replica's status (:meth:`deltasync.Replica.status` rows with their ``url``; an unreachable one:
        ``{"url", "error"}``) and ``consistent``: every replica reachable, idle, and serving the same weights (the
        same ``weights_digest``, whatever the identity is called on each)."""
        import requests

        rows = []
        for u in self.urls:
            try:
                rows += [
                    {"url": u, **r}
                    for r in requests.get(u + PREFIX + "/status", headers=self.headers, timeout=30).json()["replicas"]
                ]
            except (requests.RequestException, ValueError, KeyError) as e:
                rows.append({"url": u, "error": f"{type(e).__name__}: {e}"[:200]})
        ok = all("error" not in r and r["readiness"] for r in rows)
        digests = {r.get("weights_digest") or r.get("current_snapshot_identity") for r in rows}
        return {"replicas": rows, "consistent": ok and len(digests) == 1}

    def push(
        self, writer: SnapshotWriter, identity: str, tensors: dict[str, torch.Tensor], lora_name: str | None = None
    ) -> PushResult:
        """Write the next snapshot (full or incremental, as the writer's cadence says) and signal the fleet. When
        replicas refuse an incremental snapshot, write ``<identity>-full`` as a full snapshot of the same weights and
        signal those replicas only; the next snapshot is then full for all (their identities differ now).

        Args:
            writer: the snapshot chain (one writer per model, and per LoRA adapter: its ``assets_dir`` is then a
                PEFT adapter directory).
            tensors: HF names → tensors (an adapter: PEFT names, :func:`titan_plugin.lora.peft_adapter_state_dict`).
            lora_name: push a version of this LoRA adapter instead of the base weights.

        Raises:
            HotLoadRefused: a full snapshot was refused (by the replicas in its ``failures``; ``served`` loaded it).
        """
        info = writer.write(identity, tensors)
        t0 = time.perf_counter()
        try:
            self.signal(info, lora_name)
        except HotLoadRefused as e:
            writer.failed(info)
            if info.kind == "full":
                raise
            refused = [f"{u}: {info.identity}: {err}" for u, (_, err) in e.failures.items()]
            fallback = list(e.failures)
            info = writer.write(f"{identity}-full", tensors, kind="full")
            t0 = time.perf_counter()
            self.signal(info, lora_name, urls=fallback)
            writer.confirm(info)
            if e.served:  # replicas now serve <identity> and <identity>-full: same bits, different chains
                writer.require_full()
            return PushResult(info, time.perf_counter() - t0, refused, fallback)
        writer.confirm(info)
        return PushResult(info, time.perf_counter() - t0)
