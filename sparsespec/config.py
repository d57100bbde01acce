"""Model configuration: one dataclass for every supported decoder, built from an HF config or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import SparseSpecError

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")

# HF `architectures` / `model_type` and GGUF `general.architecture` names that map onto ours.
_HF_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}


@dataclass(frozen=True)
class RopeScaling:
    """Rotary scaling: `default`, `linear` (positions / factor) or `llama3` (frequency-band interpolation)."""

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self):
        if self.kind not in ("default", "linear", "llama3"):
            raise SparseSpecError(f"unsupported rope scaling type {self.kind!r} (supported: default, linear, llama3)")
        if self.factor <= 0:
            raise SparseSpecError(f"rope scaling factor must be positive, got {self.factor}")


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    qkv_bias: bool = False  # Qwen2: bias on q/k/v only
    o_bias: bool = False  # Llama `attention_bias`: bias on o_proj too
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k before RoPE
    tie_embeddings: bool = False
    sliding_window: int | None = None  # Mistral v0.1 style window over keys (None = full attention)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.arch not in ARCHITECTURES:
            raise SparseSpecError(f"unsupported architecture {self.arch!r} (supported: {', '.join(ARCHITECTURES)})")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position"):
            if getattr(self, name) <= 0:
                raise SparseSpecError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise SparseSpecError(f"model config: {self.num_heads} query heads do not divide into "
                                  f"{self.num_kv_heads} kv heads")
        if self.head_dim % 2:
            raise SparseSpecError(f"model config: head_dim must be even for rotary embeddings, got {self.head_dim}")

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """From the dict of an HF `config.json`."""
        model_type = cfg.get("model_type", "")
        arch = _HF_MODEL_TYPES.get(model_type)
        if arch is None:
            raise SparseSpecError(f"unsupported architecture {model_type or cfg.get('architectures')!r} "
                                  f"(supported: {', '.join(ARCHITECTURES)})")
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        attention_bias = bool(cfg.get("attention_bias", False))
        sliding = cfg.get("sliding_window") if arch == "mistral" else None
        if arch in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
            raise SparseSpecError(f"{arch} with use_sliding_window=true is not supported")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            arch=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            max_position=cfg.get("max_position_embeddings", 4096),
            rms_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=_hf_rope_theta(cfg),
            rope_scaling=_hf_rope_scaling(cfg),
            qkv_bias=arch == "qwen2" or attention_bias,
            o_bias=arch != "qwen2" and attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch == "qwen3",
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            sliding_window=sliding,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], has_output_weight: bool) -> "ModelConfig":
        """From GGUF key/value metadata (`general.architecture` prefixes the model keys)."""
        arch = meta.get("general.architecture")
        if arch not in ("llama", "qwen2", "qwen3"):
            raise SparseSpecError(f"unsupported architecture {arch!r} in GGUF file (supported: llama, qwen2, qwen3)")

        def get(key, default=None):
            return meta.get(f"{arch}.{key}", default)

        heads = int(get("attention.head_count"))
        hidden = int(get("embedding_length"))
        head_dim = int(get("attention.key_length", 0) or get("rope.dimension_count", 0) or hidden // heads)
        scaling_type = get("rope.scaling.type", "none")
        if scaling_type in ("none", None):
            scaling = RopeScaling()
        elif scaling_type == "linear":
            scaling = RopeScaling(kind="linear", factor=float(get("rope.scaling.factor", 1.0)))
        else:
            raise SparseSpecError(f"unsupported rope scaling type {scaling_type!r} in GGUF file")
        eos = meta.get("tokenizer.ggml.eos_token_id")
        vocab = get("vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
        return cls(
            arch=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=heads,
            num_kv_heads=int(get("attention.head_count_kv", heads)),
            head_dim=head_dim,
            max_position=int(get("context_length", 4096)),
            rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            qkv_bias=arch == "qwen2",
            qk_norm=arch == "qwen3",
            tie_embeddings=not has_output_weight,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=(int(eos),) if eos is not None else (),
        )


def _hf_rope_theta(cfg: dict[str, Any]) -> float:
    params = cfg.get("rope_parameters") or {}
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def _hf_rope_scaling(cfg: dict[str, Any]) -> RopeScaling:
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    kind = rs.get("rope_type", rs.get("type", "default")) or "default"
    if kind == "default":
        return RopeScaling()
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(rs["factor"]))
    if kind == "llama3":
        return RopeScaling(
            kind="llama3",
            factor=float(rs["factor"]),
            low_freq_factor=float(rs["low_freq_factor"]),
            high_freq_factor=float(rs["high_freq_factor"]),
            original_max_position=int(rs["original_max_position_embeddings"]),
        )
    return RopeScaling(kind=kind)
