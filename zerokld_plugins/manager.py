"""The one ``zerokld`` plugin manager: every provider is an entry point of the ``zerokld`` group — zerokld's own
packages first (``shared_numerics``, ``deltasync``, ``zerokld_models``: each registers its own built-ins), then
installed third-party plugins, by name.

Every loss, delta codec, storage, numerics backend and model adapter — ours included — is looked up here; there is no
other registry. Names must be unique across providers: a second provider of a name is an error naming both.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pluggy

from . import hookspecs
from .errors import ZeroKLDClientError
from .specs import BackendSpec, CodecSpec, LossSpec, ModelAdapterSpec, StorageSpec

__all__ = [
    "DuplicateNameError",
    "Registration",
    "UnknownNameError",
    "get_backend",
    "get_codec",
    "get_loss",
    "get_model_adapter",
    "get_plugin_manager",
    "get_storage",
    "list_registrations",
    "registered",
    "reset_plugin_manager",
]


class DuplicateNameError(ZeroKLDClientError, ValueError):
    """Two providers registered the same name for the same kind."""


class UnknownNameError(ZeroKLDClientError, KeyError):
    """No provider registered that name (the message lists the known ones)."""

    def __str__(self) -> str:
        return str(self.args[0])


# kind -> (hook name, spec class, key attribute)
KINDS = {
    "loss": ("zerokld_losses", LossSpec, "name"),
    "codec": ("zerokld_delta_codecs", CodecSpec, "name"),
    "storage": ("zerokld_storages", StorageSpec, "scheme"),
    "backend": ("zerokld_numerics_backends", BackendSpec, "name"),
    "model": ("zerokld_model_adapters", ModelAdapterSpec, "architecture"),
}


@dataclass(frozen=True)
class Registration:
    kind: str
    name: str
    provider: str
    spec: object


_lock = threading.Lock()
_state: dict = {}


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide manager (created on first use)."""
    with _lock:
        if "pm" not in _state:
            pm = pluggy.PluginManager(hookspecs.PROJECT)
            pm.add_hookspecs(hookspecs)
            for ep in _entry_points():
                if not pm.has_plugin(ep.name):
                    pm.register(ep.load(), name=ep.name)
            _state["pm"] = pm
            _state["table"] = _collect(pm)
        return _state["pm"]


OWN_DISTRIBUTION = "zerokld"


def _entry_points() -> list:
    """The ``zerokld`` entry points: this distribution's first, then the others; each group by name."""
    from importlib.metadata import entry_points

    def key(ep):
        dist = getattr(ep, "dist", None)
        return (getattr(dist, "name", None) != OWN_DISTRIBUTION, ep.name)

    return sorted(entry_points(group=hookspecs.PROJECT), key=key)


def reset_plugin_manager() -> None:
    """Forget the manager so the next lookup rediscovers plugins (tests, after installing/removing one)."""
    with _lock:
        _state.clear()


def _collect(pm: pluggy.PluginManager) -> dict[str, dict[str, Registration]]:
    table: dict[str, dict[str, Registration]] = {k: {} for k in KINDS}
    for kind, (hook_name, spec_cls, key) in KINDS.items():
        hook = getattr(pm.hook, hook_name)
        for impl in hook.get_hookimpls():  # registration order: built-ins first
            for spec in impl.function() or []:
                if not isinstance(spec, spec_cls):
                    raise TypeError(
                        f"plugin {impl.plugin_name!r} returned {type(spec).__name__} from {hook_name}, "
                        f"expected {spec_cls.__name__}"
                    )
                name = getattr(spec, key)
                if name in table[kind]:
                    raise DuplicateNameError(
                        f"{kind} {name!r} is registered twice: by {table[kind][name].provider!r} and by "
                        f"{impl.plugin_name!r}"
                    )
                table[kind][name] = Registration(kind, name, impl.plugin_name, spec)
    return table


def _table() -> dict[str, dict[str, Registration]]:
    get_plugin_manager()
    return _state["table"]


def registered(kind: str) -> dict[str, Registration]:
    """All registrations of one kind (``loss``, ``codec``, ``storage``, ``backend``, ``model``), by name."""
    return dict(_table()[kind])


def _get(kind: str, name: str):
    regs = _table()[kind]
    if name not in regs:
        raise UnknownNameError(
            f"unknown {kind} {name!r}; registered: {sorted(regs)} "
            "(plugins are discovered through the 'zerokld' entry-point group)"
        )
    return regs[name].spec


def get_loss(name: str) -> LossSpec:
    return _get("loss", name)


def get_codec(name: str) -> CodecSpec:
    return _get("codec", name)


def get_storage(url_or_scheme: str) -> StorageSpec:
    """Storage for a URL (``s3://…``) or a plain path (scheme ``file``)."""
    scheme = url_or_scheme.split("://", 1)[0] if "://" in url_or_scheme else url_or_scheme or "file"
    if "://" not in url_or_scheme and url_or_scheme not in _table()["storage"]:
        scheme = "file"
    return _get("storage", scheme)


def get_backend(name: str) -> BackendSpec:
    return _get("backend", name)


def get_model_adapter(architecture: str) -> ModelAdapterSpec:
    return _get("model", architecture)


def list_registrations() -> list[Registration]:
    """Every registration, sorted by kind then name."""
    return [r for kind in KINDS for _, r in sorted(_table()[kind].items())]
