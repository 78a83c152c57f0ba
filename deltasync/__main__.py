"""``python -m deltasync``: make, apply, verify and inspect snapshots from the shell.

    python -m deltasync diff --base DIR --new DIR --out DIR [--format arc_v2|<registered codec>]
    python -m deltasync apply --base DIR --delta DIR --out DIR [--format NAME]
    python -m deltasync verify DIR
    python -m deltasync inspect DIR

Exit status 0 on success; on any refusal one line ``deltasync: <reason>`` on stderr and exit status 1 (nothing is
published by a refused ``diff``/``apply``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .snapshot import DeltaError, apply_incremental_snapshot, read_snapshot_tensors, write_incremental_snapshot


def _kind(d: Path) -> str:
    if (d / "delta.json").is_file():
        return "incremental"
    if (d / "config.json").is_file():
        return "full"
    raise DeltaError(f"{d} is neither a full snapshot (config.json) nor an incremental one (delta.json)")


def _shards(d: Path) -> list[Path]:
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise DeltaError(f"{d} has no .safetensors files")
    return files


def verify(d: Path) -> dict:
    """Read every tensor; for a delta, require a checksum for every tensor. Returns a summary."""
    from safetensors import safe_open

    kind = _kind(d)
    n = nbytes = 0
    for f in _shards(d):
        try:
            with safe_open(str(f), framework="pt") as st:
                meta = st.metadata() or {}
                for name in st.keys():
                    t = st.get_tensor(name)
                    n += 1
                    nbytes += t.numel() * t.element_size()
                    if kind == "incremental" and not meta.get(name, "").isdigit():
                        raise DeltaError(f"{f.name}:{name} has no Adler-32 checksum in the metadata")
        except DeltaError:
            raise
        except Exception as e:
            raise DeltaError(f"{f.name}: cannot read: {e}") from e
    out = {"kind": kind, "tensors": n, "bytes": nbytes, "files": len(_shards(d))}
    if kind == "incremental":
        out.update(json.loads((d / "delta.json").read_text()))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m deltasync", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("diff", help="write an incremental snapshot of NEW against BASE")
    p.add_argument("--base", required=True, type=Path)
    p.add_argument("--new", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--format", default="arc_v2", help="a codec registered through the zerokld hooks")
    p = sub.add_parser("apply", help="apply an incremental snapshot to BASE, publishing a full snapshot")
    p.add_argument("--base", required=True, type=Path)
    p.add_argument("--delta", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--format", default=None, help="compression_format (default: the delta's delta.json)")
    for name in ("verify", "inspect"):
        sub.add_parser(name, help=f"{name} a full or incremental snapshot").add_argument("dir", type=Path)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "diff":
            out = write_incremental_snapshot(args.base, read_snapshot_tensors(args.new), args.out, args.format)
            full = sum(f.stat().st_size for f in _shards(args.new))
            delta = sum(f.stat().st_size for f in _shards(out))
            print(f"wrote {out}: {delta} bytes ({100 * delta / max(full, 1):.2f}% of the full snapshot)")
        elif args.cmd == "apply":
            print(f"wrote {apply_incremental_snapshot(args.base, args.delta, args.out, args.format)}")
        elif args.cmd == "verify":
            s = verify(args.dir)
            print(f"ok: {s['kind']} snapshot, {s['tensors']} tensors in {s['files']} file(s)")
        else:
            print(json.dumps(verify(args.dir), indent=2))
    except (DeltaError, OSError, KeyError, ValueError) as e:
        print(f"deltasync: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
