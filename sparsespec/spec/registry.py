"""Trained drafters shipped inside the package: sparsespec/drafters/<target>-dflash.{safetensors,json}.

The json beside each file records how it was made (command, data, steps, device, held-out acceptance)."""

from __future__ import annotations

from pathlib import Path

from ..errors import SparseSpecError
from ..models.registry import REGISTRY, identify

DRAFTER_DIR = Path(__file__).resolve().parent.parent / "drafters"


def shipped() -> list[str]:
    """Target names that have a shipped DFlash drafter."""
    return sorted(p.name.removesuffix("-dflash.safetensors") for p in DRAFTER_DIR.glob("*-dflash.safetensors"))


def drafter_path(target: str, progress: bool = False) -> Path:
    """The shipped DFlash drafter of a registered target, given by name or by its GGUF file (path without suffix)."""
    if target not in REGISTRY and (entry := identify(Path(target), progress)) is not None:
        target = entry.name
    path = DRAFTER_DIR / f"{target}-dflash"
    if not Path(f"{path}.safetensors").is_file():
        have = ", ".join(shipped()) or "none"
        hint = "" if target in REGISTRY else "; name a model given by its file with --target-name"
        raise SparseSpecError(f"no DFlash drafter is shipped for {target!r} (shipped for: {have}); train one with "
                              f"`sparsespec train dflash` and name it as dflash:PATH (--draft, or bench spec's "
                              f"--drafters){hint}")
    return path
