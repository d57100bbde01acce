"""Results folders of `eval` and `bench spec`: rows appended to JSONL files as they are measured (a rerun skips
the rows already there), and beside them the settings those rows were made with (results.jsonl ->
results.settings.json), so that commands can share a folder.

Settings that only select rows (which policies, tasks, lengths, drafters, temperatures) are left out of the
settings or keyed by what they select ("policy topk": its options), so a folder takes a new policy but refuses
rows made with another model, seed or options of a policy it already holds."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .errors import SparseSpecError


def read_rows(path: Path) -> list[dict]:
    """The rows of a JSONL file ([] when there is none). A last line that does not end the file with a newline
    and does not parse is a row cut short (a run stopped while writing it): it is left out, and the run that
    resumes measures that row again (`append_rows` cuts it off first). Any other line that is not a JSON object is
    refused in one line."""
    if not path.is_file():
        return []
    lines = path.read_text().split("\n")  # (after the last newline: "" or the torn row)
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if number == len(lines):
                continue
            row, why = None, f"a JSON row ({e.msg})"
        else:
            why = "a JSON object"
        if not isinstance(row, dict):
            raise SparseSpecError(f"{path}, line {number}, is not {why}: the file is damaged; move it away or "
                                  "choose another --out")
        rows.append(row)
    return rows


def append_rows(path: Path):
    """`path` opened to append rows, so that the next row starts on a line of its own: a last row without its
    newline is cut off when it was cut short (see `read_rows`: the run measures it again), ended when it is whole
    (`read_rows` counted it as done)."""
    if path.is_file():
        data = path.read_bytes()
        end = data.rfind(b"\n") + 1
        if data[end:].strip():
            try:
                whole = isinstance(json.loads(data[end:]), dict)
            except ValueError:
                whole = False
            with open(path, "r+b") as fh:
                if whole:
                    fh.seek(0, os.SEEK_END)
                    fh.write(b"\n")
                else:
                    fh.truncate(end)
    return open(path, "a")


def check_folder(folder: str | Path, settings: dict, files: tuple[str, ...], defaults: dict | None = None) -> None:
    """Before any work, creating nothing: refuse a folder that cannot be made or written, or one whose rows
    (`files`, JSONL) were made with another value of a setting recorded there. `defaults`: settings added since
    some folders were recorded, with the value their rows were made with (a record without the key has it)."""
    folder = Path(folder)
    nearest = next(p for p in (folder, *folder.parents) if p.exists())
    if not (nearest.is_dir() and os.access(nearest, os.W_OK | os.X_OK)):
        raise SparseSpecError(f"cannot write to {folder}: {nearest} is not a writable folder")
    before = _recorded(folder, files)
    before = (defaults or {}) | before if before else before
    changed = [k for k, v in _as_read(settings).items() if k in before and _differs(before[k], v)]
    if changed:
        raise SparseSpecError(f"{folder} holds results made with other settings ({', '.join(changed)}): rerun "
                              f"with the same ones or choose another --out")


def _differs(recorded, current) -> bool:
    """A recorded setting against the current one. Of a recorded group of settings (a policy's options), keys the
    current group no longer has are left out: an option since removed from a policy, which took no part in it (the
    budget of the top-p policies); a key the record lacks still differs."""
    if isinstance(recorded, dict) and isinstance(current, dict):
        recorded = {k: v for k, v in recorded.items() if k in current}
    return recorded != current


def record_settings(folder: Path, settings: dict, files: tuple[str, ...]) -> None:
    """Add `settings` (checked by check_folder) to the record of the rows in `files`."""
    _settings_path(folder, files).write_text(json.dumps(_recorded(folder, files) | _as_read(settings), indent=1)
                                             + "\n")


def recorded_rows(folder: str | Path, settings: dict, files: tuple[str, ...], asked
                  ) -> tuple[list[list[dict]], dict]:
    """A report of rows made earlier (`--report`): the rows of each of `files` in `folder` that `asked` keeps, and
    the settings recorded with them; refuses a folder whose record disagrees with `settings` or that holds none of
    the rows asked for."""
    check_folder(folder, settings, files)
    rows = [[r for r in read_rows(Path(folder) / f) if asked(r)] for f in files]
    if not rows[0]:
        raise SparseSpecError(f"{folder} holds no {files[0]} rows of these settings: nothing to report")
    return rows, _recorded(Path(folder), files)


def _settings_path(folder: Path, files: tuple[str, ...]) -> Path:
    return folder / f"{Path(files[0]).stem}.settings.json"


def _recorded(folder: Path, files: tuple[str, ...]) -> dict:
    """The settings of the rows in `files` ({} without rows: a run that made none left nothing to match)."""
    if not any((folder / f).is_file() and (folder / f).stat().st_size for f in files):
        return {}
    path = _settings_path(folder, files)
    if not path.is_file():
        raise SparseSpecError(f"{folder} holds results without a record of their settings: choose another --out")
    try:
        recorded = json.loads(path.read_text())
    except json.JSONDecodeError:
        recorded = None
    if not isinstance(recorded, dict):
        raise SparseSpecError(f"{path} is not a record of settings (a JSON object): the folder is damaged; choose "
                              "another --out")
    return recorded


def _as_read(settings: dict) -> dict:
    return json.loads(json.dumps(settings, default=str))  # tuples become lists, as when read back
