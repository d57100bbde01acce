"""sparsespec's methods inside Hugging Face transformers, through its supported extension points.

    import sparsespec.hf                                   # registers attn_implementation="sparsespec_<policy>"
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="sparsespec_binarypc")
    cache = SparseCache(model.config, max_cache_len=4096, options=BinaryPCOptions(budget=0.02))
    model.generate(ids, cache=cache, max_new_tokens=64)    # sparse decode steps, dense prefill

    model.generate(ids, custom_generate=speculative_generate, drafter=NgramDrafter(), max_new_tokens=64)
"""

from __future__ import annotations

import transformers
from packaging.version import Version

from ..errors import SparseSpecError

# the transformers releases this package is tested with (pyproject's `hf` extra states the same range)
TRANSFORMERS_RANGE = (Version("5.24"), Version("6"))


def check_version(version: str = transformers.__version__) -> None:
    low, high = TRANSFORMERS_RANGE
    if not low <= Version(version) < high:
        raise SparseSpecError(f"sparsespec.hf needs transformers >={low},<{high}; {version} is installed")


check_version()

from .attention import register, sparse_attention_forward  # noqa: E402
from .cache import SparseCache  # noqa: E402
from .generate import HFModelDrafter, dflash_drafter, speculative_generate, tapped_features  # noqa: E402

ATTENTION_IMPLEMENTATIONS = register()

__all__ = ["ATTENTION_IMPLEMENTATIONS", "HFModelDrafter", "SparseCache", "check_version", "dflash_drafter", "register",
           "sparse_attention_forward", "speculative_generate", "tapped_features"]
