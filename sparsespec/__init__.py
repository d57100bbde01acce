"""sparsespec: long-context decoding with sparse attention and lossless speculative decoding."""

import importlib

from .errors import SparseSpecError

__all__ = ["Engine", "Generation", "GenerationConfig", "SamplingConfig", "SparseSpecError"]
__version__ = "0.1.0"

# where each public name lives: imported on first use, so that the CLI starts (and --help, --version, a Ctrl-C
# during start-up answer) without importing torch first
_LAZY = {"Engine": ".generate", "Generation": ".generate", "GenerationConfig": ".generate",
         "SamplingConfig": ".sampling"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
