"""``python -m zerokld_plugins``: list every registered loss, codec, storage, backend and model adapter."""
from __future__ import annotations

from .manager import list_registrations


def main() -> None:
    rows = [(r.kind, r.name, r.provider) for r in list_registrations()]
    widths = [max(len(x[i]) for x in rows + [("kind", "name", "provider")]) for i in range(3)]
    for row in [("kind", "name", "provider")] + rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))


if __name__ == "__main__":
    main()
