"""Snapshots: full HF checkpoint directories and incremental deltas against a base, both published atomically.

* Full: config, tokenizer files, ``model.safetensors`` — HF ``transformers`` layout, so vLLM loads a snapshot like any
  model directory; or, for a LoRA adapter, ``adapter_config.json`` + ``adapter_model.safetensors`` (PEFT's layout,
  what vLLM's LoRA loader reads). The assets decide which (:func:`zerokld_models.checkpoint.weights_file`).
* Incremental: for every tensor of every base shard, the codec's payload (``compression_format``, default ``arc_v2``:
  XOR of raw bytes + zstd) stored as a 1-D ``uint8`` tensor under the tensor's name, in a safetensors file with the
  base shard's filename; that file's ``__metadata__`` maps each tensor name to the decimal Adler-32 of the **new**
  tensor's bytes (so applying onto a wrong base is detected). ``delta.json`` records
  ``compression_format``/``checksum_format``. Source: Fireworks' incremental-snapshot format (``arc_v2``, checksum
  ``alder32`` sic); codecs are looked up through the ``zerokld`` plugin hooks.

Integrity: besides the transport checksum the Fireworks wire names (Adler-32), every full snapshot's spec and every
delta's ``delta.json`` carry the **SHA-256 of each tensor's bytes** (``"sha256": {name: hex}``); a replica verifies
them before it loads and again at a restart, and a weights digest is the SHA-256 of that map, so bytes edited to keep
their Adler-32 are refused. A full snapshot's ``model.safetensors.index.json``, when present, must name every tensor
exactly once, in the shard that holds it, and use every shard (vLLM loads only the shards the index names).

A directory is assembled in the staging namespace beside the target (``.staging/``,
:func:`zerokld_models.checkpoint.staged_dir`) and renamed into place, so a reader never sees a
half-written snapshot; an incremental snapshot is verified completely (key set, lengths, checksums) before the
result is published.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import stat
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from zerokld_models.checkpoint import (
    ADAPTER_CONFIG,
    INDEX_FILE,
    held_dtype,
    read_tensors,
    staged_dir,
    weights_file,
    write_checkpoint,
)
from zerokld_plugins import envs
from zerokld_plugins.errors import ZeroKLDClientError

from .protocol import DEFAULT_CHECKSUM_FORMAT, DEFAULT_COMPRESSION_FORMAT

__all__ = [
    "DeltaError",
    "SnapshotError",
    "apply_delta_in_place",
    "apply_incremental_snapshot",
    "check_regular_files",
    "checksums_digest",
    "copy_snapshot",
    "delta_checksums",
    "delta_digests",
    "delta_weights_digest",
    "element_density",
    "tensor_sha256",
    "materialize_snapshot",
    "read_snapshot_tensors",
    "tensor_spec",
    "verify_adapter_config",
    "verify_full_snapshot",
    "weight_bytes",
    "weights_digest",
    "write_full_snapshot",
    "write_incremental_snapshot",
]


class SnapshotError(ZeroKLDClientError, ValueError):
    """A snapshot that is refused: unreadable, or not the same tensor set / shapes / dtypes as the model (HTTP 422)."""

    status_code = 422


class DeltaError(SnapshotError):
    """An incremental snapshot that cannot be applied to the given base (nothing was written)."""


def tensor_spec(snapshot_dir: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{name: (dtype, shape)}`` of a full snapshot, read from the safetensors headers (no tensor data is read).

    Raises:
        SnapshotError: no shard, or a shard whose header cannot be read (truncated, not safetensors).
    """
    files = sorted(Path(snapshot_dir).glob("*.safetensors"))
    if not files:
        raise SnapshotError(f"snapshot {Path(snapshot_dir).name!r}: no *.safetensors shard")
    spec = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                for name in fh.keys():
                    if name in spec:
                        raise SnapshotError(f"tensor {name} appears in more than one shard")
                    sl = fh.get_slice(name)
                    spec[name] = (sl.get_dtype(), tuple(sl.get_shape()))
        except SnapshotError:
            raise
        except Exception as e:  # any unreadable header is a refusal
            raise SnapshotError(f"{f.name}: cannot read: {e}") from e
    return spec


def check_regular_files(snapshot_dir: str | Path, root: str | Path | None = None) -> None:
    """Refuse a snapshot directory that is a symlink, lies outside ``root``, or holds anything but regular files
    (symlinks, FIFOs, devices, sockets, sub-directories): nothing in it is opened before this passes, so a FIFO cannot
    block a reader and a symlink cannot reach files outside the snapshot root.

    Raises:
        SnapshotError: naming the offending entry (by its name inside the snapshot, never its absolute path).
    """
    d = Path(snapshot_dir)
    if d.is_symlink() or not d.is_dir():
        raise SnapshotError(f"snapshot {d.name!r} is not a plain directory")
    if root is not None and not d.resolve().is_relative_to(Path(root).resolve()):
        raise SnapshotError(f"snapshot {d.name!r} resolves outside the snapshot root")
    for entry in d.iterdir():
        mode = entry.lstat().st_mode
        if not stat.S_ISREG(mode):
            kind = (
                "symlink"
                if stat.S_ISLNK(mode)
                else "FIFO"
                if stat.S_ISFIFO(mode)
                else "directory"
                if stat.S_ISDIR(mode)
                else "special file"
            )
            raise SnapshotError(f"snapshot {d.name!r}: {entry.name!r} is a {kind}, not a regular file")


def verify_full_snapshot(
    snapshot_dir: str | Path,
    reference: dict[str, tuple[str, tuple[int, ...]]],
    check_data: bool = False,
    allow_non_finite: bool = False,
) -> None:
    """Refuse a full snapshot that is not loadable into a model with tensor spec ``reference``: every shard's header
    readable and covering the file exactly (safetensors refuses a truncated or padded file when it opens it), each
    tensor in one shard only, the same tensor names, dtypes and shapes — a tensor the models hold wider than
    ``reference`` stores it (:func:`zerokld_models.checkpoint.held_dtype`: DeepSeekMoE's float32 selection bias
    in a bf16 checkpoint) may also come in that dtype, which loads into the held parameter without a cast.

    With ``check_data`` (what a replica does before a swap) every tensor is also read, one at a time: its Adler-32
    must equal the ``checksums`` of ``model.weight.spec.json`` (written by :func:`write_full_snapshot`; a snapshot
    without them is refused) and floating-point weights must be finite unless ``allow_non_finite``.

    Raises:
        SnapshotError: naming the first difference.
    """
    spec = tensor_spec(snapshot_dir)
    missing, extra = sorted(set(reference) - set(spec)), sorted(set(spec) - set(reference))
    if missing or extra:
        raise SnapshotError(f"tensor set differs from the served model: missing {missing[:3]}, extra {extra[:3]}")
    for name, (dt, shape) in reference.items():
        if spec[name] != (dt, shape) and spec[name] != (held_dtype(name, dt), shape):
            raise SnapshotError(f"{name}: {spec[name][0]}{list(spec[name][1])}, the model has {dt}{list(shape)}")
    _check_index(Path(snapshot_dir))
    if check_data:
        _verify_data(Path(snapshot_dir), allow_non_finite)


MAX_JSON_BYTES = 64 << 20  # a snapshot's JSON metadata (spec, delta.json) larger than this is refused unread


def _check_index(d: Path) -> None:
    """A ``model.safetensors.index.json`` must map every tensor to the shard that holds it, exactly once, and name
    every shard: vLLM loads only the shards its ``weight_map`` names (``filter_duplicate_safetensors_files``), so an
    index naming a subset would leave the other tensors at their previous values."""
    index = d / INDEX_FILE
    if not index.exists():
        return
    try:
        weight_map = _read_json(index).get("weight_map")
    except (OSError, ValueError) as e:
        raise SnapshotError(f"snapshot {d.name!r}: {INDEX_FILE} unreadable ({type(e).__name__})") from e
    if not isinstance(weight_map, dict):
        raise SnapshotError(f"snapshot {d.name!r}: {INDEX_FILE} has no weight_map")
    held: dict[str, str] = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            held.update({name: f.name for name in fh.keys()})
    if weight_map != held:
        wrong = sorted(n for n in set(held) | set(weight_map) if weight_map.get(n) != held.get(n))
        raise SnapshotError(
            f"snapshot {d.name!r}: {INDEX_FILE} does not list every tensor exactly once in the shard "
            f"that holds it ({len(wrong)} differ, e.g. {wrong[:2]}); unused shards: "
            f"{sorted(set(held.values()) - set(weight_map.values()))[:3]}"
        )


def tensor_sha256(raw) -> str:
    """SHA-256 (hex) of a tensor's bytes (``_raw``): the integrity digest snapshots carry per tensor."""
    return hashlib.sha256(raw).hexdigest()


def copy_snapshot(src: str | Path, dst: str | Path) -> Path:
    """Copy the files of snapshot directory ``src`` into ``dst`` (a staged directory renamed into place: an
    interrupted copy leaves no ``dst``), each opened without following a symlink and without blocking, and refused
    unless what was opened is a regular file (a FIFO, device or symlink swapped in after a check is refused here, not
    read). What a replica verifies and loads is this private copy, so the publisher cannot change the bytes between
    the check and the load.

    Raises:
        SnapshotError: ``src`` is not a plain directory, or an entry is not a regular file (named by its file name).
        OSError: reading or writing failed (``ENOSPC``: no space; nothing is left under ``dst``).
    """
    src, dst = Path(src), Path(dst)
    check_regular_files(src)
    with staged_dir(dst) as tmp:
        for entry in sorted(src.iterdir()):
            try:
                fd = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENXIO):  # a symlink, or a FIFO without a writer
                    raise SnapshotError(f"snapshot {src.name!r}: {entry.name!r} is not a regular file") from None
                raise
            with os.fdopen(fd, "rb") as fin:
                if not stat.S_ISREG(os.fstat(fin.fileno()).st_mode):
                    raise SnapshotError(f"snapshot {src.name!r}: {entry.name!r} is not a regular file")
                with open(tmp / entry.name, "xb") as fout:
                    shutil.copyfileobj(fin, fout, 8 << 20)
    return dst


def _read_json(path: Path) -> dict:
    """A snapshot's JSON metadata file, read only when it is at most :data:`MAX_JSON_BYTES`.

    Raises:
        ValueError: too large, or not a JSON object. OSError: unreadable."""
    if path.stat().st_size > MAX_JSON_BYTES:
        raise ValueError(f"{path.name} is larger than {MAX_JSON_BYTES} bytes")
    data = json.loads(path.read_bytes())
    if not isinstance(data, dict):
        raise ValueError(f"{path.name} is not a JSON object")
    return data


def _spec_map(d: Path, key: str, what: str) -> dict:
    """A per-tensor map of the spec: ``"checksums"`` (Adler-32) or ``"sha256"`` (integrity digests).

    Raises:
        SnapshotError: no readable spec, or one without that map (``sha256``: a snapshot written before integrity
            digests; the trainer must write it again)."""
    try:
        found = _read_json(d / WEIGHT_SPEC).get(key)
    except (OSError, ValueError) as e:
        raise SnapshotError(f"snapshot {d.name!r}: no readable {WEIGHT_SPEC} ({type(e).__name__})") from e
    if not isinstance(found, dict):
        raise SnapshotError(f"snapshot {d.name!r}: {WEIGHT_SPEC} has no per-tensor {what}")
    return found


def _spec_checksums(d: Path) -> dict:
    return _spec_map(d, "checksums", "checksums")


def _spec_digests(d: Path) -> dict:
    return _spec_map(d, "sha256", "sha256 (integrity digests)")


def _verify_data(d: Path, allow_non_finite: bool) -> None:
    checksums, digests = _spec_checksums(d), _spec_digests(d)
    seen = set()
    for f in sorted(d.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as fh:
                for name in fh.keys():
                    t = fh.get_tensor(name)
                    raw = _raw(t)
                    if checksums.get(name) != str(zlib.adler32(raw)):
                        raise SnapshotError(f"{name}: checksum mismatch (corrupt snapshot)")
                    if digests.get(name) != tensor_sha256(raw):
                        raise SnapshotError(f"{name}: sha256 mismatch (the bytes are not the ones published)")
                    if not allow_non_finite and t.is_floating_point() and not bool(torch.isfinite(t.float()).all()):
                        raise SnapshotError(f"{name}: non-finite weights (NaN or inf)")
                    seen.add(name)
        except SnapshotError:
            raise
        except Exception as e:  # unreadable data is a refusal
            raise SnapshotError(f"{f.name}: cannot read: {e}") from e
    if set(checksums) != seen or set(digests) != seen:
        raise SnapshotError(f"snapshot {d.name!r}: checksums do not cover exactly its tensors")


def verify_adapter_config(snapshot_dir: str | Path) -> dict:
    """The ``adapter_config.json`` of a full LoRA adapter snapshot (PEFT's ``LoraConfig`` as saved): a JSON object of
    at most :data:`MAX_JSON_BYTES` with ``peft_type`` ``"LORA"``, a positive integer ``r`` and a ``lora_alpha``
    number. What the engine checks beyond that (rank against ``max_lora_rank``, target modules) it checks at load.

    Raises:
        SnapshotError: missing, unreadable or not a LoRA config."""
    d = Path(snapshot_dir)
    try:
        cfg = _read_json(d / ADAPTER_CONFIG)
    except (OSError, ValueError) as e:
        raise SnapshotError(
            f"snapshot {d.name!r}: no readable {ADAPTER_CONFIG} (a LoRA adapter snapshot is a PEFT "
            f"adapter directory; {type(e).__name__})"
        ) from e
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if (
        cfg.get("peft_type") != "LORA"
        or not isinstance(r, int)
        or isinstance(r, bool)
        or r < 1
        or not isinstance(alpha, (int, float))
        or isinstance(alpha, bool)
    ):
        raise SnapshotError(
            f"snapshot {d.name!r}: {ADAPTER_CONFIG} is not a LoRA config (peft_type LORA, r >= 1, lora_alpha)"
        )
    return cfg


def weights_digest(snapshot_dir: str | Path) -> str:
    """SHA-256 (hex) of a full snapshot's per-tensor SHA-256 map (``model.weight.spec.json``'s ``sha256``,
    canonical JSON): what the ledger records for a loaded snapshot, so a restart can tell the same bits from
    replaced ones.

    Raises:
        SnapshotError: no readable spec with per-tensor sha256.
    """
    return checksums_digest(_spec_digests(Path(snapshot_dir)))


def checksums_digest(checksums: dict[str, str]) -> str:
    """SHA-256 (hex) of a per-tensor digest map ``{name: sha256 hex}`` as canonical JSON: the weights digest of a
    full snapshot (:func:`weights_digest`) and of the weights an incremental one produces
    (:func:`delta_weights_digest`) are the same for the same bits."""
    return hashlib.sha256(json.dumps(checksums, sort_keys=True).encode()).hexdigest()


def weight_bytes(snapshot_dir: str | Path) -> int:
    """Total size of a snapshot's ``*.safetensors`` files (what ships)."""
    return sum(f.stat().st_size for f in Path(snapshot_dir).glob("*.safetensors"))


def element_density(base: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> tuple[int, int]:
    """``(changed, total)``: elements of ``base`` whose bits differ in ``new`` (same names, shapes, dtypes)."""
    changed = total = 0
    for k, b in base.items():
        width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[b.element_size()]
        changed += int((b.view(width) != new[k].contiguous().view(width)).sum())
        total += b.numel()
    return changed, total


def materialize_snapshot(
    src: str | Path,
    out: str | Path,
    reference: dict[str, tuple[str, tuple[int, ...]]],
    base: str | Path | None = None,
    compression_format: str | None = None,
    check_data: bool = False,
    allow_non_finite: bool = False,
) -> Path:
    """The verified full snapshot a replica loads for ``src``: ``src`` itself when it is full (``base is None``),
    else ``src`` decoded onto ``base`` into ``out`` (replaced). Verified against ``reference``
    (:func:`verify_full_snapshot`) before it is returned; nothing is loaded here.

    Raises:
        SnapshotError / DeltaError: the snapshot is refused.
    """
    if base is None:
        verify_full_snapshot(src, reference, check_data, allow_non_finite)
        return Path(src)
    shutil.rmtree(out, ignore_errors=True)
    path = apply_incremental_snapshot(base, src, out, compression_format)
    verify_full_snapshot(path, reference, check_data, allow_non_finite)
    return path


def snapshot_numerics(snapshot_dir: str | Path) -> dict | None:
    """The numerics stamp of a published snapshot (full: ``model.weight.spec.json``; incremental: ``delta.json``),
    or ``None`` when it carries none.

    Raises:
        SnapshotError: the spec file exists but is not JSON.
    """
    for name in (WEIGHT_SPEC, "delta.json"):
        f = Path(snapshot_dir) / name
        if f.is_file():
            try:
                return _read_json(f).get("numerics")
            except ValueError as e:
                raise SnapshotError(f"{f.name}: unreadable ({e})") from e
    return None


def _held(name: str, base: torch.Tensor) -> torch.Tensor:
    """A base tensor as the models hold it (:func:`zerokld_models.checkpoint.held_dtype`): a delta is the XOR of the
    held bits, whichever dtype the base snapshot stores (the bits a worker decodes against in place are its
    parameters')."""
    return base.to(held_dtype(name, base.dtype))


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of ``t`` (bytes-like, no copy for a contiguous CPU tensor)."""
    return memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)


def read_snapshot_tensors(snapshot_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a full snapshot's ``*.safetensors`` files (:func:`zerokld_models.checkpoint.read_tensors`)."""
    return read_tensors(snapshot_dir)


#: threads :func:`write_incremental_snapshot` encodes tensors with (``ZEROKLD_ENCODE_THREADS``; default: the CPUs)
ENCODE_THREADS = max(1, envs.ZEROKLD_ENCODE_THREADS or os.cpu_count() or 1)

WEIGHT_SPEC = "model.weight.spec.json"  # {"tensor_map": {name: {"shape": [...], "dtype": "BF16"}}} (Fireworks)
_SKIP = {"model.safetensors.index.json", WEIGHT_SPEC}


def write_full_snapshot(
    hf_state_dict: dict[str, torch.Tensor],
    assets_dir: str | Path,
    out_dir: str | Path,
    dtype: torch.dtype | None = None,
    numerics: dict | None = None,
) -> Path:
    """Write ``hf_state_dict`` as ``out_dir/model.safetensors`` (a PEFT adapter: ``adapter_model.safetensors``) plus
    every non-weight file of ``assets_dir``, and ``model.weight.spec.json`` (``{"tensor_map": {name: {"shape",
    "dtype"}}, "checksum_format": "alder32", "checksums": {name: Adler-32 of the tensor's bytes}, "numerics"?}``,
    ``"sha256": {name: SHA-256 of the tensor's bytes}``, safetensors dtype names; a replica verifies both before it
    swaps, and the SHA-256 again at a restart).

    Args:
        hf_state_dict: HF parameter names → tensors (any device; copied to CPU, made contiguous); for an adapter,
            PEFT names (``base_model.model.<module>.lora_A.weight``).
        assets_dir: a checkpoint directory whose ``config.json``, tokenizer and generation files are copied, or a
            PEFT adapter directory whose ``adapter_config.json`` is.
        out_dir: the snapshot directory to publish; replaced if it exists.
        dtype: cast every tensor to this dtype (``None``: keep).
        numerics: the producer's :class:`shared_numerics.NumericsMode` as a dict, stamped into the spec as
            ``"numerics"`` (checked by the replica: :func:`snapshot_numerics`), or ``None``.

    Returns:
        ``Path(out_dir)``.

    Raises:
        FileNotFoundError: ``assets_dir`` has neither ``config.json`` nor ``adapter_config.json``.
    """
    src = Path(assets_dir)
    fname = weights_file(src)
    tensors = {k: (v.to(dtype) if dtype is not None else v) for k, v in hf_state_dict.items()}

    def write_spec(tmp: Path) -> None:
        spec = {name: {"shape": list(shape), "dtype": dt} for name, (dt, shape) in sorted(tensor_spec(tmp).items())}
        stamp = {"numerics": numerics} if numerics is not None else {}
        raws = {name: _raw(t) for name, t in sorted(tensors.items())}
        checksums = {name: str(zlib.adler32(r)) for name, r in raws.items()}
        digests = {name: tensor_sha256(r) for name, r in raws.items()}
        (tmp / WEIGHT_SPEC).write_text(
            json.dumps(
                {
                    "tensor_map": spec,
                    "checksum_format": DEFAULT_CHECKSUM_FORMAT,
                    "checksums": checksums,
                    "sha256": digests,
                    **stamp,
                },
                indent=1,
            )
        )

    return write_checkpoint(out_dir, {fname: tensors}, assets_dir=src, skip_assets=_SKIP, finalize=write_spec)


def write_incremental_snapshot(
    base_dir: str | Path,
    new_tensors: dict[str, torch.Tensor],
    out_dir: str | Path,
    compression_format: str = DEFAULT_COMPRESSION_FORMAT,
    numerics: dict | None = None,
) -> Path:
    """Encode ``new_tensors`` against the full snapshot in ``base_dir``.

    Args:
        base_dir: a full snapshot (the one the receiver holds).
        new_tensors: HF name → tensor; same key set, shapes and dtypes as the base (as the models hold it:
            a selection bias stored bf16 in the base is encoded against its float32 widening,
            :func:`zerokld_models.checkpoint.held_dtype`).
        out_dir: the delta directory to publish.
        compression_format: a codec name registered through the ``zerokld`` hooks.
        numerics: stamped into ``delta.json`` as ``"numerics"`` (see :func:`write_full_snapshot`).

    ``delta.json`` also carries ``"sha256"``: each new tensor's SHA-256 (the receiver's integrity check).

    Raises:
        DeltaError: key set, shape or dtype differs from the base.
        zerokld_plugins.UnknownNameError: unknown codec.
    """
    from zerokld_plugins import get_codec, resolve

    encode = resolve(get_codec(compression_format).encode)
    base_files = sorted(Path(base_dir).glob("*.safetensors"))
    base_keys: set[str] = set()

    digests: dict[str, str] = {}

    def encode_one(name: str, b: torch.Tensor, n: torch.Tensor) -> tuple[torch.Tensor, str]:
        nb = _raw(n)
        digests[name] = tensor_sha256(nb)
        return torch.frombuffer(bytearray(encode(_raw(b), nb)), dtype=torch.uint8), str(zlib.adler32(nb))

    # tensors are encoded ENCODE_THREADS at a time (numpy, zstd and zlib release the GIL); at most twice that many
    # are in flight, so memory stays a few tensors whatever the model size
    with staged_dir(out_dir) as tmp, ThreadPoolExecutor(ENCODE_THREADS) as pool:
        for f in base_files:
            payloads, meta, jobs = {}, {}, {}
            with safe_open(str(f), framework="pt") as base:
                for name in base.keys():
                    base_keys.add(name)
                    if name not in new_tensors:
                        raise DeltaError(f"tensor {name} of the base is missing from the new weights")
                    b, n = _held(name, base.get_tensor(name)), new_tensors[name]
                    if b.shape != n.shape or b.dtype != n.dtype:
                        raise DeltaError(f"{name}: base {b.dtype}{list(b.shape)} vs new {n.dtype}{list(n.shape)}")
                    jobs[name] = pool.submit(encode_one, name, b, n)
                    if len(jobs) >= 2 * ENCODE_THREADS:
                        first = next(iter(jobs))
                        payloads[first], meta[first] = jobs.pop(first).result()
                for name, job in jobs.items():
                    payloads[name], meta[name] = job.result()
            save_file(payloads, str(tmp / f.name), metadata=meta)
        extra = set(new_tensors) - base_keys
        if extra:
            raise DeltaError(f"new weights have tensors the base lacks: {sorted(extra)[:5]}")
        stamp = {"numerics": numerics} if numerics is not None else {}
        (tmp / "delta.json").write_text(
            json.dumps(
                {
                    "compression_format": compression_format,
                    "checksum_format": DEFAULT_CHECKSUM_FORMAT,
                    "sha256": dict(sorted(digests.items())),
                    **stamp,
                }
            )
        )
    return Path(out_dir)


def apply_incremental_snapshot(
    base_dir: str | Path,
    delta_dir: str | Path,
    out_dir: str | Path,
    compression_format: str | None = None,
    require_digests: bool = True,
) -> Path:
    """Decode a delta onto its base and publish the result as a full snapshot (assets copied from the base).

    ``compression_format`` comes from the caller (a hot-load signal carries it) or, when ``None``, from the delta's
    ``delta.json``. ``require_digests=False`` decodes a delta that carries only the Fireworks wire's Adler-32 (one
    written by Fireworks' own encoder, no ``delta.json``): a transport check only, for reading foreign deltas, never
    what a replica loads.

    Everything is decoded and verified (same shard files and key sets, payload lengths, Adler-32 and SHA-256 of every
    new tensor) before anything is written; on any failure nothing is published.

    Raises:
        DeltaError: mismatching files/keys, a payload that does not decode, or a checksum mismatch.
        zerokld_plugins.UnknownNameError: the delta's ``compression_format`` is not registered.
    """
    from zerokld_plugins import get_codec, resolve

    base_dir, delta_dir = Path(base_dir), Path(delta_dir)
    decode = resolve(get_codec(_delta_format(delta_dir, compression_format)).decode)
    digests = delta_digests(delta_dir) if require_digests else None
    base_files = sorted(p.name for p in base_dir.glob("*.safetensors"))
    delta_files = sorted(p.name for p in delta_dir.glob("*.safetensors"))
    if base_files != delta_files:
        raise DeltaError(f"shard files differ: base {base_files} vs delta {delta_files}")
    new: dict[str, torch.Tensor] = {}
    for fname in delta_files:
        try:
            with (
                safe_open(str(delta_dir / fname), framework="pt") as d,
                safe_open(str(base_dir / fname), framework="pt") as b,
            ):
                meta = d.metadata() or {}
                if set(d.keys()) != set(b.keys()):
                    raise DeltaError(f"{fname}: tensor names differ from the base")
                for name in b.keys():
                    bt = _held(name, b.get_tensor(name))
                    try:
                        nb = decode(_raw(bt), _raw(d.get_tensor(name)))
                    except Exception as e:  # any codec failure is a refusal of this delta
                        raise DeltaError(f"{fname}:{name}: payload does not decode: {e}") from e
                    if str(zlib.adler32(nb)) != meta.get(name):
                        raise DeltaError(f"{fname}:{name}: checksum mismatch (wrong base or corrupt delta)")
                    if digests is not None and tensor_sha256(nb) != digests.get(name):
                        raise DeltaError(f"{fname}:{name}: sha256 mismatch (wrong base or altered delta)")
                    new[name] = torch.frombuffer(bytearray(nb), dtype=torch.uint8).view(bt.dtype).reshape(bt.shape)
        except DeltaError:
            raise
        except Exception as e:  # unreadable safetensors (truncated, garbage header)
            raise DeltaError(f"{fname}: cannot read: {e}") from e
    return write_full_snapshot(new, base_dir, out_dir)


def _delta_format(delta_dir: Path, compression_format: str | None) -> str:
    if compression_format is not None:
        return compression_format
    try:
        return _read_json(delta_dir / "delta.json")["compression_format"]
    except (OSError, ValueError, KeyError) as e:
        raise DeltaError(
            f"snapshot {delta_dir.name!r}: no compression_format given and no readable delta.json ({type(e).__name__})"
        ) from e


def delta_digests(delta_dir: str | Path) -> dict[str, str]:
    """``{name: SHA-256 hex of the new tensor}`` of an incremental snapshot (``delta.json``'s ``sha256``).

    Raises:
        DeltaError: no readable ``delta.json`` with a ``sha256`` map (a delta written before integrity digests)."""
    d = Path(delta_dir)
    try:
        digests = _read_json(d / "delta.json").get("sha256")
    except (OSError, ValueError) as e:
        raise DeltaError(f"snapshot {d.name!r}: no readable delta.json ({type(e).__name__})") from e
    if not isinstance(digests, dict):
        raise DeltaError(f"snapshot {d.name!r}: delta.json has no per-tensor sha256 (integrity digests)")
    return digests


def delta_weights_digest(delta_dir: str | Path) -> str:
    """The weights digest (:func:`checksums_digest`) of the weights an incremental snapshot produces.

    Raises:
        DeltaError: see :func:`delta_digests`."""
    return checksums_digest(delta_digests(delta_dir))


def delta_checksums(delta_dir: str | Path) -> dict[str, str]:
    """``{name: decimal Adler-32 of the new tensor}`` of an incremental snapshot (its shards' ``__metadata__``): the
    checksums of the weights it produces (:func:`checksums_digest` gives their digest).

    Raises:
        DeltaError: a shard cannot be read, a tensor without a checksum, or a tensor in two shards."""
    out: dict[str, str] = {}
    for f in sorted(Path(delta_dir).glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as d:
                meta, names = d.metadata() or {}, list(d.keys())
        except Exception as e:  # unreadable header
            raise DeltaError(f"{f.name}: cannot read: {e}") from e
        for name in names:
            if name in out or name not in meta:
                raise DeltaError(f"{f.name}:{name}: " + ("in two shards" if name in out else "no checksum"))
            out[name] = meta[name]
    return out


#: dtype → (unsigned view, exponent mask): a value is NaN or inf when all its exponent bits are set (IEEE 754; FP8
#: e4m3fn has no inf, its NaN is the all-ones magnitude)
_NON_FINITE = {
    torch.bfloat16: (np.uint16, 0x7F80),
    torch.float16: (np.uint16, 0x7C00),
    torch.float32: (np.uint32, 0x7F800000),
    torch.float64: (np.uint64, 0x7FF0000000000000),
    torch.float8_e4m3fn: (np.uint8, 0x7F),
}


def has_non_finite(raw, dtype: torch.dtype) -> bool:
    """Whether the bytes ``raw`` of a ``dtype`` tensor hold a NaN or inf (bit test, no conversion; non-float and
    unknown dtypes: ``False``)."""
    if dtype not in _NON_FINITE:
        return False
    view, mask = _NON_FINITE[dtype]
    words = np.frombuffer(raw, dtype=view)
    return bool(((words & view(mask)) == view(mask)).any())


def apply_delta_in_place(
    delta_dir: str | Path,
    targets: dict[str, torch.Tensor],
    compression_format: str | None = None,
    commit: bool = False,
    after_tensor=None,
    allow_non_finite: bool = False,
) -> dict:
    """Decode an incremental snapshot against the bits of live tensors and, with ``commit``, write the new bits into
    them, tensor by tensor: the extra memory is at most ``2 * ENCODE_THREADS`` decoded tensors (and their payloads),
    never the model.

    Every tensor is checked before it is written: its payload must decode against the target's current bits and the
    result's Adler-32 and SHA-256 must equal the delta's (a wrong base or a corrupt payload is refused there). Run it
    first without ``commit`` (verifies everything, writes nothing: the stage pass), then with ``commit`` (the commit
    pass, which checks each tensor again before writing it). A refusal in the stage pass leaves every target bit for
    bit as it was.

    Args:
        delta_dir: an incremental snapshot directory (:func:`write_incremental_snapshot`).
        targets: checkpoint name → the live tensor holding that checkpoint tensor's bits (same dtype and shape as in
            the checkpoint; any device: a non-CPU tensor is decoded through a CPU copy of itself). Its key set must be
            the delta's.
        compression_format: the codec (``None``: ``delta.json``'s).
        commit: write the new bits.
        allow_non_finite: accept NaN or inf in the new floating-point weights (default: refused in the stage pass, as
            :func:`verify_full_snapshot` refuses them in a full snapshot).
        after_tensor: called with the number of tensors written so far after each write (commit pass; fault
            injection in tests), or ``None``.

    Returns:
        ``{"checksums": {name: Adler-32}, "sha256": {name: SHA-256 hex}, "changed": [names whose bits changed]}``
        (``changed`` only with ``commit``).

    Raises:
        DeltaError: the key sets differ, a target has the wrong size, a payload does not decode, or a checksum
            differs; with ``commit`` the tensors before the failing one are already written (the caller reloads).
        zerokld_plugins.UnknownNameError: unknown codec.
    """
    from zerokld_plugins import get_codec, resolve

    delta_dir = Path(delta_dir)
    decode = resolve(get_codec(_delta_format(delta_dir, compression_format)).decode)
    checksums, digests = delta_checksums(delta_dir), delta_digests(delta_dir)
    if set(digests) != set(checksums):
        raise DeltaError(f"snapshot {delta_dir.name!r}: delta.json's sha256 do not cover exactly its tensors")
    missing, extra = sorted(set(targets) - set(checksums)), sorted(set(checksums) - set(targets))
    if missing or extra:
        raise DeltaError(f"delta tensors differ from the model's: missing {missing[:3]}, extra {extra[:3]}")
    changed, written = [], 0

    def decoded(fname: str, name: str, payload: torch.Tensor):
        t = targets[name]
        if not t.is_contiguous():  # its flat view would be a copy: writes would not reach the tensor
            raise DeltaError(f"{name}: the live tensor is not contiguous")
        host = t if t.device.type == "cpu" else t.detach().cpu()
        old = host.detach().reshape(-1).view(torch.uint8).numpy()
        try:
            new = decode(memoryview(old.data), _raw(payload))
        except Exception as e:  # any codec failure is a refusal of this delta
            raise DeltaError(f"{fname}:{name}: payload does not decode: {e}") from e
        if len(new) != old.size or str(zlib.adler32(new)) != checksums[name]:
            raise DeltaError(f"{fname}:{name}: checksum mismatch (wrong base or corrupt delta)")
        if tensor_sha256(new) != digests[name]:
            raise DeltaError(f"{fname}:{name}: sha256 mismatch (wrong base or altered delta)")
        if not commit and not allow_non_finite and has_non_finite(new, t.dtype):
            raise DeltaError(f"{fname}:{name}: non-finite weights (NaN or inf)")
        return t, host, old, new

    def write(t, host, old, new) -> bool:
        new = np.frombuffer(new, dtype=np.uint8)
        wide = np.uint64 if old.size % 8 == 0 else np.uint8  # compare 8 bytes at a time where the size allows
        if np.array_equal(old.view(wide), new.view(wide)):
            return False
        old[:] = new
        if host is not t:
            t.copy_(host)
        return True

    # tensors are decoded and checked ENCODE_THREADS at a time (numpy, zstd and zlib release the GIL), at most
    # twice that many in flight; writes happen here, in order, one at a time
    with ThreadPoolExecutor(ENCODE_THREADS) as pool:
        for f in sorted(delta_dir.glob("*.safetensors")):
            try:
                with safe_open(str(f), framework="pt") as d:
                    jobs: dict = {}
                    names = list(d.keys())
                    for i, name in enumerate(names):
                        jobs[name] = pool.submit(decoded, f.name, name, d.get_tensor(name))
                        while jobs and (len(jobs) >= 2 * ENCODE_THREADS or i == len(names) - 1):
                            first = next(iter(jobs))
                            result = jobs.pop(first).result()
                            if commit:
                                if write(*result):
                                    changed.append(first)
                                written += 1
                                if after_tensor is not None:
                                    after_tensor(written)
            except DeltaError:
                raise
            except Exception as e:  # unreadable safetensors (truncated, garbage header)
                raise DeltaError(f"{f.name}: cannot read: {e}") from e
    return {"checksums": checksums, "sha256": digests, "changed": changed}
