"""Random-weight models in real shapes: for speed measurements where the weights do not matter (what a step reads
and computes depends on the shapes alone), e.g. `--model random:llama-3.1-8b`. Their text is meaningless.

    SHAPES["llama-3.1-8b"]  the ModelConfig of a shape (the vocabulary of the real model, no weights)
    random_model(cfg, ...)  a Transformer of that shape, weights ~ N(0, 0.02), norms 1
    ByteTokenizer           UTF-8 bytes as token ids; a token id decodes as its low byte (random weights draw ids
                            anywhere in the real vocabulary)
"""

from __future__ import annotations

import torch

from ..config import ModelConfig, RopeScaling
from ..errors import SparseSpecError
from .rope import inverse_frequencies
from .transformer import Transformer

LLAMA31_8B = ModelConfig(
    arch="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
    num_kv_heads=8, head_dim=128, max_position=131072 + 1024, rms_eps=1e-5, rope_theta=500000.0,
    rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192),
)
_QWEN = dict(arch="qwen2", vocab_size=151936, max_position=32768, rope_theta=1e6, qkv_bias=True, tie_embeddings=True)
SHAPES = {
    "llama-3.1-8b": LLAMA31_8B,
    "qwen2.5-coder-1.5b": ModelConfig(hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12,
                                      num_kv_heads=2, head_dim=128, **_QWEN),
    "qwen2.5-coder-0.5b": ModelConfig(hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
                                      num_kv_heads=2, head_dim=64, **_QWEN),
    "tiny": ModelConfig(arch="llama", vocab_size=512, hidden_size=64, intermediate_size=96, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16, max_position=4096),  # tests, quick checks
}


def shape(name: str) -> ModelConfig:
    if name not in SHAPES:
        raise SparseSpecError(f"unknown model shape {name!r} for random weights (choose from {', '.join(SHAPES)})")
    return SHAPES[name]


def random_model(cfg: ModelConfig, device: torch.device | str = "cuda", dtype: torch.dtype = torch.bfloat16,
                 seed: int = 0) -> Transformer:
    """A Transformer of `cfg`'s shape made directly on `device` (no host copy of the weights): weights ~ N(0, 0.02)
    from `seed`, norm weights 1; the LM head its own matrix even where the real model ties it (the same bytes a
    step reads)."""
    with torch.device("meta"):
        model = Transformer(cfg).to(dtype)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0, 0.02, generator=gen)
    model.inv_freq = inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(device)
    return model.eval().requires_grad_(False)


class ByteTokenizer:
    """UTF-8 bytes as token ids, a chat template that passes the last message through, no end-of-sequence token."""

    eos_token_id = None
    chat_template = "plain"

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": list(text.encode())}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(int(i) % 256 for i in ids).decode(errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tokenize: bool = False) -> str:
        return messages[-1]["content"]
