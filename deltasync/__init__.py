"""zerokld snapshot protocol (imports neither vLLM nor TorchTitan).

Today: full HF-safetensors snapshots written atomically (:func:`write_full_snapshot`). The incremental ``arc_v2``
deltas, ledger and fsspec storage of the delta hot-load work build on this module.
"""
from .snapshot import write_full_snapshot

__all__ = ["write_full_snapshot"]
