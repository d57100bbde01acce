"""scripts/chunks.py: a model file split into parts, moved one part per call, rebuilt and verified."""

import importlib.util
import os
import shutil
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("chunks", Path(__file__).parents[1] / "scripts" / "chunks.py")
chunks = importlib.util.module_from_spec(spec)
spec.loader.exec_module(chunks)


def test_split_append_verify(tmp_path):
    src = tmp_path / "model.gguf"
    src.write_bytes(os.urandom(3 * (1 << 20) + 12345))
    store = tmp_path / "store"
    chunks.split(src, store, size_mb=1)
    names = sorted(p.name for p in store.glob("part*"))
    assert names == ["part000", "part001", "part002", "part003"]
    dest = tmp_path / "device" / "model.gguf"
    for name in names:  # each device call carries the manifest and one part
        carried = tmp_path / f"call-{name}"
        carried.mkdir()
        shutil.copy(store / "manifest.json", carried)
        shutil.copy(store / name, carried)
        chunks.append(carried, dest)
        if name == "part001":
            size = dest.stat().st_size
            chunks.append(carried, dest)  # a repeated call does nothing
            assert dest.stat().st_size == size
    chunks.verify(store, dest)
    assert dest.read_bytes() == src.read_bytes()


def test_parts_left_from_earlier_calls_are_appended_in_order(tmp_path):
    src = tmp_path / "model.gguf"
    src.write_bytes(os.urandom(3 * (1 << 20)))
    store = tmp_path / "store"
    chunks.split(src, store, size_mb=1)
    (store / "part000").rename(tmp_path / "held-back")
    dest = tmp_path / "dest"
    chunks.append(store, dest)  # part001 and part002 cannot start the file
    assert not dest.exists() or dest.stat().st_size == 0
    (tmp_path / "held-back").rename(store / "part000")
    chunks.append(store, dest)
    chunks.verify(store, dest)


def test_corrupt_part_is_refused(tmp_path):
    src = tmp_path / "model.gguf"
    src.write_bytes(os.urandom(1 << 20))
    store = tmp_path / "store"
    chunks.split(src, store, size_mb=1)
    (store / "part000").write_bytes(b"x" * (1 << 20))
    with pytest.raises(SystemExit, match="corrupt"):
        chunks.append(store, tmp_path / "dest")
