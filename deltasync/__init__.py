"""zerokld snapshot protocol (imports neither vLLM nor TorchTitan).

Full HF-safetensors snapshots and incremental deltas (codec by name, ``arc_v2`` built in), verified before they are
published; codecs and storages are registered through the ``zerokld`` plugin hooks. The ledger, hot-load signal and
cadence policy of the delta hot-load work build on this package.
"""
from .snapshot import (
    DeltaError, apply_incremental_snapshot, read_snapshot_tensors, write_full_snapshot, write_incremental_snapshot,
)

__all__ = ["DeltaError", "apply_incremental_snapshot", "read_snapshot_tensors", "write_full_snapshot",
           "write_incremental_snapshot"]
