"""deltasync's registrations (entry point ``deltasync`` in the ``zerokld`` group): delta codecs and snapshot
storages."""

from __future__ import annotations

from zerokld_plugins import CodecSpec, StorageSpec, hookimpl


@hookimpl
def zerokld_delta_codecs():
    return [
        CodecSpec(
            "arc_v2",
            "deltasync.codecs:arc_v2_encode",
            "deltasync.codecs:arc_v2_decode",
            "XOR of raw bytes, zstd-compressed (Fireworks arc_v2)",
        ),
        CodecSpec(
            "zkd_sparse_v1",
            "deltasync.codecs:sparse_encode",
            "deltasync.codecs:sparse_decode",
            "changed 16-bit words: byte-shuffled gaps + XOR values, safetensors container, zstd (zerokld)",
        ),
        CodecSpec(
            "zkd_sparse_v2",
            "deltasync.codecs:sparse_v2_encode",
            "deltasync.codecs:sparse_v2_decode",
            "changed 16-bit words: byte-shuffled gaps + zigzag integer differences, one zstd frame each "
            "(zerokld; the densest)",
        ),
    ]


@hookimpl
def zerokld_storages():
    return [
        StorageSpec("file", "deltasync.storage:local_filesystem"),
        StorageSpec("memory", "deltasync.storage:memory_filesystem"),
        StorageSpec("s3", "deltasync.storage:s3_filesystem"),
    ]
