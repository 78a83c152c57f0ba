"""Snapshot storages (fsspec filesystems, registered through the ``zerokld`` hooks by URL scheme) and the transfer of
a snapshot directory to and from one.

A replica never reads a half-uploaded snapshot: :func:`publish_dir` uploads every file, then writes the marker
``_ZEROKLD_COMPLETE`` (JSON: file name → ``{"size", "sha256"}``) last; :func:`fetch_dir` refuses a snapshot without
the marker, downloads at most ``max_concurrency`` files at a time, checks every file's size and SHA-256, and renames
its download into place only when complete. Object stores have no atomic directory rename; the marker is the commit
point (as Hadoop's ``_SUCCESS``). An interrupted download is resumed: the partial files stay in the staging namespace
(``.staging/<name>.part/``) and the next fetch reads each from where it stopped (a ranged read), so a replica that
dies mid-pull of a large snapshot does not start over. Markers of earlier versions (name → size) are still read
(size checks only).

``s3://`` goes through ``s3fs``; the endpoint comes from the standard AWS settings (``AWS_ENDPOINT_URL``,
credentials, region), so any S3-compatible server works.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import fsspec

from zerokld_models.checkpoint import publish_atomically, staging_path

__all__ = [
    "COMPLETE_MARKER",
    "fetch_dir",
    "filesystem_for",
    "local_filesystem",
    "memory_filesystem",
    "publish_dir",
    "s3_filesystem",
]

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


CHUNK_BYTES = 8 << 20  # one ranged read of a download (and of a checksum pass)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def publish_dir(local_dir: str | Path, url: str) -> str:
    """Upload the files of ``local_dir`` to ``url`` (a directory URL), the completion marker (each file's size and
    SHA-256) last. Returns ``url``."""
    fs, remote = filesystem_for(url), url.rstrip("/")
    files = sorted(p for p in Path(local_dir).iterdir() if p.is_file())
    fs.makedirs(remote, exist_ok=True)  # local/memory need the directory; object stores ignore it
    for f in files:
        fs.put_file(str(f), f"{remote}/{f.name}")
    fs.pipe_file(
        f"{remote}/{COMPLETE_MARKER}",
        json.dumps({f.name: {"size": f.stat().st_size, "sha256": _sha256(f)} for f in files}).encode(),
    )
    return url


def _listing(fs, remote: str, url: str) -> dict[str, dict]:
    """The marker as ``{name: {"size", "sha256"?}}`` (a name → size marker of an earlier version: no checksums)."""
    from .snapshot import SnapshotError

    try:
        raw = fs.cat_file(f"{remote}/{COMPLETE_MARKER}")
    except FileNotFoundError as e:
        raise SnapshotError(f"{url}: not a completely published snapshot (no {COMPLETE_MARKER})") from e
    try:
        listing = json.loads(raw)
        out = {
            name: ({"size": int(v)} if isinstance(v, int) else {"size": int(v["size"]), "sha256": v.get("sha256")})
            for name, v in listing.items()
        }
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise SnapshotError(f"{url}: unreadable {COMPLETE_MARKER}") from e
    for name in out:
        if "/" in name or name.startswith(".") or not name:
            raise SnapshotError(f"{url}: {COMPLETE_MARKER} names {name[:64]!r}, not a file of the snapshot")
    return out


def _fetch_file(fs, src: str, dst: Path, size: int, sha256: str | None, progress) -> None:
    """Complete ``dst`` (a partial download, or nothing) from ``src`` with ranged reads, then check size and SHA-256;
    a file that does not check out is deleted (the next fetch downloads it anew)."""
    from .snapshot import SnapshotError

    have = dst.stat().st_size if dst.exists() else 0
    if have > size:
        dst.unlink()
        have = 0
    if have < size:
        with fs.open(src, "rb") as r, open(dst, "ab") as w:
            r.seek(have)
            while have < size and (chunk := r.read(min(CHUNK_BYTES, size - have))):
                w.write(chunk)
                have += len(chunk)
                if progress is not None:
                    progress(len(chunk))
    got = dst.stat().st_size
    if got != size or (sha256 is not None and _sha256(dst) != sha256):
        dst.unlink()
        what = f"{got} bytes, published {size}" if got != size else "SHA-256 differs from the published one"
        raise SnapshotError(f"{src}: {what}")


def fetch_dir(
    url: str, local_dir: str | Path, max_concurrency: int = 4, progress: Callable[[int], None] | None = None
) -> Path:
    """Download a published snapshot directory into ``local_dir`` (replaced), all or nothing, resuming an earlier
    interrupted download of the same directory.

    Args:
        url: the snapshot's directory URL (published with :func:`publish_dir`).
        local_dir: where the complete download is renamed to.
        max_concurrency: files downloaded at a time (at least 1).
        progress: called with the byte count of every chunk as it arrives (e.g. a ``tqdm`` bar's ``update``).

    Raises:
        SnapshotError: no completion marker (not published, or still uploading), or a file whose size or SHA-256
            differs from the marker's (that file is discarded; the other partial files stay for the next try).
    """
    fs, remote, out = filesystem_for(url), url.rstrip("/"), Path(local_dir)
    listing = _listing(fs, remote, url)
    part = staging_path(out, "part")
    part.mkdir(exist_ok=True)
    for stale in part.iterdir():  # left by a download of other contents
        if stale.name not in listing:
            stale.unlink() if stale.is_file() else shutil.rmtree(stale)

    def one(item) -> None:
        name, meta = item
        _fetch_file(fs, f"{remote}/{name}", part / name, meta["size"], meta.get("sha256"), progress)

    with ThreadPoolExecutor(max_workers=max(1, int(max_concurrency))) as pool:
        futures = [pool.submit(one, item) for item in sorted(listing.items())]
        try:
            for f in futures:
                f.result()
        except BaseException:
            for f in futures:  # the queued files wait for the next try; running ones finish their chunk loop
                f.cancel()
            raise
    return publish_atomically(part, out)
