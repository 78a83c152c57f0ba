"""Small shims that let TorchTitan 0.3.0 train on a CPU-only machine with torch 2.13.

* ``torchtitan.tools.utils`` picks its device at import time and falls back to ``"cuda"`` when no accelerator is
  found; on a CPU-only torch build we point it (and the modules that imported the names) at ``"cpu"``/``torch.cpu``.
* ``torch.distributed.set_timeout`` (called by ``torchtitan.distributed.utils.set_pg_timeouts``) does not exist in
  torch 2.13: a no-op stands in.
* FSDP2 divides gradients with ``ReduceOp.PREMUL_SUM`` when TorchTitan sets a divide factor; gloo has no such op, so
  on CPU FSDP is told to reduce with plain sums and divide after (its own ``force_sum_reduction_for_comms`` path).
* ``training.enable_cpu_offload`` makes TorchTitan add a ``cpu:gloo`` backend beside the device's; on a CPU-only
  machine the device's backend already is ``cpu:gloo`` and the doubled string is refused, so the extra backend is
  not asked for (``init_distributed(enable_cpu_backend=False)``); and FSDP2's ``CPUOffloadPolicy()`` pins host
  memory by default, which needs an accelerator, so TorchTitan's FSDP builder (``torchtitan.distributed.fsdp``)
  gets the policy with ``pin_memory=False`` (pinning is a transfer speed-up; nothing else changes).
* Single-process runs need the ``torchrun`` environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR/PORT``) for the gloo
  process group TorchTitan creates; :func:`ensure_single_process_env` fills it in (loopback, a free port).

Everything is idempotent and does nothing when a CUDA device is present.
"""

from __future__ import annotations

import os
import socket
import sys

import torch

_APPLIED = False


class _CPUDeviceModule:
    """``torch.cpu`` plus the ``torch.cuda``-style calls TorchTitan makes on its ``device_module`` (memory monitor,
    device name/properties, seeding); memory figures are the process's peak RSS and the machine's RAM."""

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    @staticmethod
    def get_device_name(device=None) -> str:
        import platform

        return platform.processor() or "cpu"

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def set_device(device) -> None:
        return None

    @staticmethod
    def get_device_properties(device=None):
        from types import SimpleNamespace

        return SimpleNamespace(total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), name="cpu")

    @staticmethod
    def memory_stats(device=None) -> dict:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak, "num_alloc_retries": 0, "num_ooms": 0}

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def synchronize(device=None) -> None:
        return None

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        torch.manual_seed(seed)


CPU_DEVICE_MODULE = _CPUDeviceModule()
_MODULES_WITH_DEVICE_NAMES = (
    "torchtitan.components.metrics",
    "torchtitan.models.common.token_dispatcher",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.distributed.utils",
    "torchtitan.tools.profiler",
)


def apply() -> None:
    """Install the shims (safe to call many times)."""
    global _APPLIED
    if _APPLIED:
        return
    if not hasattr(torch.distributed, "set_timeout"):
        torch.distributed.set_timeout = lambda timeout, group=None: None  # type: ignore[attr-defined]
    if not torch.cuda.is_available():
        import torchtitan.tools.utils as tu

        _force_sum_reduction_on_cpu()
        _single_cpu_backend()

        tu.device_type = "cpu"
        tu.device_module = CPU_DEVICE_MODULE
        tu.get_local_device = lambda: torch.device("cpu")
        for name in _MODULES_WITH_DEVICE_NAMES:
            mod = sys.modules.get(name)
            if mod is None:
                continue
            for attr, value in (
                ("device_type", "cpu"),
                ("device_module", CPU_DEVICE_MODULE),
                ("get_local_device", tu.get_local_device),
            ):
                if hasattr(mod, attr):
                    setattr(mod, attr, value)
    _APPLIED = True


def _force_sum_reduction_on_cpu() -> None:
    import functools

    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as fc

    original = fc._get_gradient_divide_factors
    if getattr(original, "_zerokld", False):
        return

    @functools.wraps(original)
    def factors(*args, **kwargs):
        out = original(*args, **kwargs)
        device_type = kwargs.get("device_type", args[3] if len(args) > 3 else "")
        if device_type == "cpu" and not isinstance(out[2], torch.distributed.ReduceOp.RedOpType):  # PREMUL_SUM
            kwargs["force_sum_reduction_for_comms"] = True
            out = original(*args[:5], **kwargs)
        return out

    factors._zerokld = True  # type: ignore[attr-defined]
    fc._get_gradient_divide_factors = factors


def _single_cpu_backend() -> None:
    import functools

    import torchtitan.distributed.utils as du

    original = du.init_distributed
    if getattr(original, "_zerokld", False):
        return

    @functools.wraps(original)
    def init_distributed(comm_config, enable_cpu_backend: bool = False, *args, **kwargs):
        return original(comm_config, False, *args, **kwargs)  # the device backend is cpu:gloo already

    init_distributed._zerokld = True  # type: ignore[attr-defined]
    du.init_distributed = init_distributed

    import torchtitan.distributed.fsdp as tf
    from torch.distributed.fsdp import CPUOffloadPolicy

    tf.CPUOffloadPolicy = functools.partial(CPUOffloadPolicy, pin_memory=False)


def ensure_single_process_env() -> None:
    """Set ``RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT`` for a one-process run if unset."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
