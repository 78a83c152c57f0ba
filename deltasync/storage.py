"""Snapshot storages (fsspec filesystems, registered through the ``zerokld`` hooks by URL scheme) and the transfer of
a snapshot directory to and from one.

A replica never reads a half-uploaded snapshot: :func:`publish_dir` uploads every file, then writes the marker
``_ZEROKLD_COMPLETE`` (a JSON list of file names and sizes) last; :func:`fetch_dir` refuses a snapshot without the
marker, checks every size, and renames its download into place only when complete. Object stores have no atomic
directory rename; the marker is the commit point (as Hadoop's ``_SUCCESS``).

``s3://`` goes through ``s3fs``; the endpoint comes from the standard AWS settings (``AWS_ENDPOINT_URL``,
credentials, region), so any S3-compatible server works.
"""
from __future__ import annotations

import json
from pathlib import Path

import fsspec

from zerokld_models.checkpoint import staged_dir

__all__ = ["COMPLETE_MARKER", "fetch_dir", "filesystem_for", "local_filesystem", "memory_filesystem", "publish_dir",
           "s3_filesystem"]

COMPLETE_MARKER = "_ZEROKLD_COMPLETE"


def local_filesystem(url: str) -> fsspec.AbstractFileSystem:
    """Plain paths and ``file://`` URLs."""
    return fsspec.filesystem("file")


def memory_filesystem(url: str) -> fsspec.AbstractFileSystem:
    """``memory://`` (process-local; tests)."""
    return fsspec.filesystem("memory")


def s3_filesystem(url: str) -> fsspec.AbstractFileSystem:
    """``s3://bucket/prefix`` via ``s3fs`` (endpoint and credentials from the AWS environment)."""
    return fsspec.filesystem("s3", skip_instance_cache=True)


def filesystem_for(url: str) -> fsspec.AbstractFileSystem:
    """The filesystem of the storage registered for ``url``'s scheme.

    Raises:
        zerokld_plugins.UnknownNameError: no storage registered for the scheme.
    """
    from zerokld_plugins import get_storage, resolve

    return resolve(get_storage(url).filesystem)(url)


def publish_dir(local_dir: str | Path, url: str) -> str:
    """Upload the files of ``local_dir`` to ``url`` (a directory URL), the completion marker last. Returns ``url``."""
    fs, remote = filesystem_for(url), url.rstrip("/")
    files = sorted(p for p in Path(local_dir).iterdir() if p.is_file())
    fs.makedirs(remote, exist_ok=True)  # local/memory need the directory; object stores ignore it
    for f in files:
        fs.put_file(str(f), f"{remote}/{f.name}")
    fs.pipe_file(f"{remote}/{COMPLETE_MARKER}",
                 json.dumps({f.name: f.stat().st_size for f in files}).encode())
    return url


def fetch_dir(url: str, local_dir: str | Path) -> Path:
    """Download a published snapshot directory into ``local_dir`` (replaced), all or nothing.

    Raises:
        SnapshotError: no completion marker (not published, or still uploading), or a file of the wrong size.
    """
    from .snapshot import SnapshotError

    fs, remote, out = filesystem_for(url), url.rstrip("/"), Path(local_dir)
    try:
        listing = json.loads(fs.cat_file(f"{remote}/{COMPLETE_MARKER}"))
    except FileNotFoundError as e:
        raise SnapshotError(f"{url}: not a completely published snapshot (no {COMPLETE_MARKER})") from e
    with staged_dir(out) as tmp:
        for name, size in listing.items():
            fs.get_file(f"{remote}/{name}", str(tmp / name))
            if (tmp / name).stat().st_size != size:
                raise SnapshotError(f"{url}/{name}: {(tmp / name).stat().st_size} bytes, published {size}")
    return out
