"""zerokld extension points: one pluggy hookspec (project ``zerokld``), one manager, entry-point discovery.

See ``docs/plugins.md``. ``python -m zerokld_plugins`` lists what is registered and by whom.
"""

from .hookspecs import hookimpl, hookspec
from .manager import (
    DuplicateNameError,
    UnknownNameError,
    get_backend,
    get_codec,
    get_loss,
    get_model_adapter,
    get_plugin_manager,
    get_storage,
    list_registrations,
    registered,
    reset_plugin_manager,
)
from .specs import BackendSpec, CodecSpec, LossSpec, ModelAdapterSpec, StorageSpec, resolve

__all__ = [
    "BackendSpec",
    "CodecSpec",
    "DuplicateNameError",
    "LossSpec",
    "ModelAdapterSpec",
    "StorageSpec",
    "UnknownNameError",
    "get_backend",
    "get_codec",
    "get_loss",
    "get_model_adapter",
    "get_plugin_manager",
    "get_storage",
    "hookimpl",
    "hookspec",
    "list_registrations",
    "registered",
    "reset_plugin_manager",
    "resolve",
]
