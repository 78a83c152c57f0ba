"""The tests' server helper: a ``vllm serve`` started on its own tmpfs (a disk that really fills up). The servers
themselves: :mod:`vllm_plugin.serve`."""

from __future__ import annotations

from pathlib import Path

__all__ = ["tmpfs_prefix"]


def tmpfs_prefix(mount_point: Path, size: str) -> list[str]:
    """A :attr:`OpenAIServer.prefix` that starts the server in its own user and mount namespaces (``unshare``, no
    privileges needed) with a fresh tmpfs of ``size`` (``"24m"``) mounted on ``mount_point``: a disk that really
    fills up, seen only by the server; the test reaches it through ``/proc/<server pid>/root<mount_point>``."""
    return [
        "unshare",
        "--user",
        "--map-root-user",
        "--mount",
        "sh",
        "-c",
        f'mount -t tmpfs -o size={size} tmpfs "$0" && exec "$@"',
        str(mount_point),
    ]
