"""Built-in snapshot storages (fsspec filesystems), registered through the ``zerokld`` hooks by URL scheme."""
from __future__ import annotations

import fsspec

__all__ = ["filesystem_for", "local_filesystem", "memory_filesystem"]


def local_filesystem(url: str) -> fsspec.AbstractFileSystem:
    """Plain paths and ``file://`` URLs."""
    return fsspec.filesystem("file")


def memory_filesystem(url: str) -> fsspec.AbstractFileSystem:
    """``memory://`` (process-local; tests)."""
    return fsspec.filesystem("memory")


def filesystem_for(url: str) -> fsspec.AbstractFileSystem:
    """The filesystem of the storage registered for ``url``'s scheme.

    Raises:
        zerokld_plugins.UnknownNameError: no storage registered for the scheme.
    """
    from zerokld_plugins import get_storage, resolve

    return resolve(get_storage(url).filesystem)(url)
