"""zerokld snapshot protocol (imports neither vLLM nor TorchTitan).

Full HF-safetensors snapshots (models, and PEFT LoRA adapters) and incremental deltas (codec by name, ``arc_v2``
built in), verified before they are published; codecs and storages are registered through the ``zerokld`` plugin hooks.
The hot-load ledger and identity rules (:mod:`deltasync.ledger`), the hot-load protocol (:mod:`deltasync.protocol`) and
the replica state machine (:mod:`deltasync.replica`) are here too; the vLLM side is two adapters
(:mod:`vllm_plugin.hotload`).
"""

from .client import HotLoadClient, HotLoadRefused, PushResult
from .ledger import IdentityError, Ledger, validate_identity
from .protocol import HotLoadConfig, HotLoadError, Signal, lora_version
from .replica import Replica, ReplicaEngine, StateDirInUseError, Track
from .snapshot import (
    DeltaError,
    SnapshotError,
    apply_delta_in_place,
    apply_incremental_snapshot,
    checksums_digest,
    copy_snapshot,
    delta_checksums,
    delta_digests,
    delta_weights_digest,
    element_density,
    materialize_snapshot,
    read_snapshot_tensors,
    snapshot_numerics,
    tensor_spec,
    verify_adapter_config,
    verify_full_snapshot,
    weight_bytes,
    weights_digest,
    write_full_snapshot,
    write_incremental_snapshot,
)
from .storage import fetch_dir, publish_dir
from .writer import SnapshotInfo, SnapshotWriter

__all__ = [
    "DeltaError",
    "HotLoadClient",
    "HotLoadConfig",
    "HotLoadError",
    "HotLoadRefused",
    "IdentityError",
    "Ledger",
    "PushResult",
    "Replica",
    "ReplicaEngine",
    "Signal",
    "SnapshotError",
    "SnapshotInfo",
    "SnapshotWriter",
    "StateDirInUseError",
    "Track",
    "apply_delta_in_place",
    "apply_incremental_snapshot",
    "checksums_digest",
    "copy_snapshot",
    "delta_checksums",
    "delta_digests",
    "delta_weights_digest",
    "element_density",
    "fetch_dir",
    "lora_version",
    "materialize_snapshot",
    "publish_dir",
    "read_snapshot_tensors",
    "snapshot_numerics",
    "tensor_spec",
    "validate_identity",
    "verify_adapter_config",
    "verify_full_snapshot",
    "weight_bytes",
    "weights_digest",
    "write_full_snapshot",
    "write_incremental_snapshot",
]
