"""sparsespec: long-context decoding with sparse attention and lossless speculative decoding."""

from .errors import SparseSpecError
from .generate import Engine, Generation, GenerationConfig
from .sampling import SamplingConfig

__all__ = ["Engine", "Generation", "GenerationConfig", "SamplingConfig", "SparseSpecError"]
__version__ = "0.1.0"
