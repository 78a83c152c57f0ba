"""The ``zerokld`` hook specifications (pluggy project name ``zerokld``, entry-point group ``zerokld``).

A plugin is any module or object with functions marked ``@hookimpl`` (``from zerokld_plugins import hookimpl``),
exposed through an entry point in the ``zerokld`` group of its distribution::

    [project.entry-points.zerokld]
    my_plugin = "my_pkg.zerokld_hooks"

Each hook returns a list of specs (:mod:`zerokld_plugins.specs`); a plugin implements only the hooks it needs.
Source: pluggy's hookspec/hookimpl model (https://pluggy.readthedocs.io), as used by pytest.
"""

from __future__ import annotations

import pluggy

PROJECT = "zerokld"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def zerokld_losses() -> list:
    """RL losses: ``list[LossSpec]`` (name → per-token formula + config schema)."""


@hookspec
def zerokld_delta_codecs() -> list:
    """Delta codecs: ``list[CodecSpec]`` (name advertised in ``compression_format`` → encoder/decoder)."""


@hookspec
def zerokld_storages() -> list:
    """Snapshot storages: ``list[StorageSpec]`` (URL scheme → fsspec filesystem factory)."""


@hookspec
def zerokld_numerics_backends() -> list:
    """Numerics backends: ``list[BackendSpec]`` (name → op table with the ``shared_numerics`` signatures)."""


@hookspec
def zerokld_model_adapters() -> list:
    """Model adapters: ``list[ModelAdapterSpec]`` (HF architecture → its declaration; the plugins build from it)."""
