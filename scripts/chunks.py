"""Move a model file to the device machine in pieces small enough for its 64 MiB transfer limit.

    python scripts/chunks.py split ~/.cache/sparsespec/models/qwen2.5-coder-0.5b.gguf .chunks --size 60
        -> .chunks/part000 ... and .chunks/manifest.json (offsets, sizes, SHA-256 of every part and of the whole)
    (one device call per part, carrying .chunks/manifest.json and .chunks/partNNN:)
    python3 scripts/chunks.py append .chunks ~/models/qwen.gguf
        -> appends, in order, the parts present that continue the file (hash-checked; parts already in it are
           skipped, so a repeated call does nothing and parts left from earlier calls are used)
    python3 scripts/chunks.py verify .chunks ~/models/qwen.gguf
        -> checks the whole file's size and SHA-256

`.chunks/` must be git-ignored (it is): carry it with the device tool's `carry` option.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 24):
            h.update(block)
    return h.hexdigest()


def split(src: Path, out: Path, size_mb: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    parts, offset = [], 0
    with open(src, "rb") as fh:
        while block := fh.read(size_mb << 20):
            name = f"part{len(parts):03d}"
            (out / name).write_bytes(block)
            parts.append({"name": name, "offset": offset, "size": len(block),
                          "sha256": hashlib.sha256(block).hexdigest()})
            offset += len(block)
    manifest = {"source": src.name, "size": offset, "sha256": _sha256(src), "parts": parts}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(f"{len(parts)} parts of <= {size_mb} MiB in {out}")


def append(folder: Path, dest: Path) -> None:
    """Append, in order, every part present in `folder` that continues `dest` (parts already in it are skipped,
    so calls can be repeated; a part that would leave a gap waits for the missing one)."""
    manifest = json.loads((folder / "manifest.json").read_text())
    dest.parent.mkdir(parents=True, exist_ok=True)
    have = dest.stat().st_size if dest.exists() else 0
    for part in manifest["parts"]:
        if part["offset"] + part["size"] <= have or not (folder / part["name"]).is_file():
            continue
        if part["offset"] != have:
            break
        data = (folder / part["name"]).read_bytes()
        if hashlib.sha256(data).hexdigest() != part["sha256"]:
            sys.exit(f"chunks: {part['name']} is corrupt (hash mismatch)")
        with open(dest, "ab") as fh:
            fh.write(data)
        have += len(data)
        print(f"appended {part['name']}")
    print(f"{dest}: {have} of {manifest['size']} bytes")


def verify(folder: Path, dest: Path) -> None:
    manifest = json.loads((folder / "manifest.json").read_text())
    if not dest.is_file() or dest.stat().st_size != manifest["size"]:
        sys.exit(f"chunks: {dest} is incomplete")
    if _sha256(dest) != manifest["sha256"]:
        sys.exit(f"chunks: {dest} does not match the manifest's SHA-256")
    print(f"{dest} verified ({manifest['size']} bytes)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split")
    s.add_argument("src", type=Path)
    s.add_argument("out", type=Path)
    s.add_argument("--size", type=int, default=60, help="MiB per part")
    for name in ("append", "verify"):
        p = sub.add_parser(name)
        p.add_argument("folder", type=Path)
        p.add_argument("dest", type=Path)
    args = ap.parse_args()
    if args.cmd == "split":
        split(args.src, args.out, args.size)
    elif args.cmd == "append":
        append(args.folder, args.dest.expanduser())
    else:
        verify(args.folder, args.dest.expanduser())


if __name__ == "__main__":
    main()
