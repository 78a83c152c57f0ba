"""``python -m zerokld_plugins``: list every registered loss, codec, storage, backend and model adapter, then every
``ZEROKLD_*`` environment variable (:mod:`zerokld_plugins.envs`) with its current value."""

from __future__ import annotations

from . import envs
from .manager import list_registrations


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(x[i]) for x in rows + [header]) for i in range(len(header))]
    for row in [header] + rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def main() -> None:
    _table(("kind", "name", "provider"), [(r.kind, r.name, r.provider) for r in list_registrations()])
    print()
    _table(
        ("environment variable", "value", "meaning"),
        [(r["name"], f"{r['value']}" + ("" if r["set"] else " (default)"), r["doc"]) for r in envs.describe()],
    )


if __name__ == "__main__":
    main()
