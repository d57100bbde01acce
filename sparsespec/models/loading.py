"""Loading: HF checkpoint folders (config.json + safetensors) and GGUF files -> Transformer + tokenizer.

Both paths produce an HF-named state dict first (GGUF names are mapped, Llama q/k rows un-permuted), which
`_to_ours` then fuses into our layout. Weights are dequantised/cast to the compute dtype on load.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import ModelConfig
from ..errors import SparseSpecError
from .rope import inverse_frequencies
from .transformer import Transformer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: object | None  # a transformers PreTrainedTokenizerFast
    config: ModelConfig
    source: Path


def cache_dir() -> Path:
    """Where assembled model files and converted tokenizers live (SPARSESPEC_CACHE overrides)."""
    return Path(os.environ.get("SPARSESPEC_CACHE") or Path.home() / ".cache" / "sparsespec")


def load(path: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32,
         progress: bool = False, with_tokenizer: bool = True) -> LoadedModel:
    """Load an HF checkpoint folder or a GGUF file onto `device` in `dtype` (tokenizer None if not wanted)."""
    path = Path(path)
    if path.is_dir():
        cfg, state, freq_factors = _read_hf_folder(path, dtype)
        tokenizer = _hf_tokenizer(path) if with_tokenizer else None
    elif path.is_file():
        cfg, state, freq_factors = _read_gguf(path, dtype, progress, device)
        tokenizer = _gguf_tokenizer(path) if with_tokenizer else None
    else:
        raise SparseSpecError(f"model not found: {path} is neither a registered model name, a file nor a folder")
    model = _build(cfg, state, freq_factors, device)
    return LoadedModel(model, tokenizer, cfg, path)


def _build(cfg: ModelConfig, hf_state: dict[str, torch.Tensor], freq_factors, device) -> Transformer:
    with torch.device("meta"):
        model = Transformer(cfg)
    state = _to_ours(cfg, hf_state)
    expected = set(model.state_dict()) - ({"lm_head.weight"} if cfg.tie_embeddings else set())
    missing = sorted(expected - set(state))
    if missing:
        raise SparseSpecError(f"checkpoint is missing {len(missing)} weights (first: {missing[0]})")
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    model.inv_freq = inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, freq_factors)
    return model.to(device).eval().requires_grad_(False)  # inference only


def _to_ours(cfg: ModelConfig, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF-named tensors -> our names, fusing q/k/v and gate/up."""
    out: dict[str, torch.Tensor] = {}
    strip = {k[len("model."):] if k.startswith("model.") else k: v for k, v in hf.items()}
    for key in ("embed_tokens.weight", "norm.weight", "lm_head.weight"):
        if key in strip:
            out[key] = strip[key]
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        for name in ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.o_proj.weight",
                     "self_attn.o_proj.bias", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                     "mlp.down_proj.weight", "mlp.down_proj.bias"):
            if p + name in strip:
                out[p + name] = strip[p + name]
        for suffix in ("weight", "bias"):
            parts = [strip.get(f"{p}self_attn.{n}_proj.{suffix}") for n in "qkv"]
            if all(t is not None for t in parts):
                out[f"{p}self_attn.qkv_proj.{suffix}"] = torch.cat(parts)
            parts = [strip.get(f"{p}mlp.{n}_proj.{suffix}") for n in ("gate", "up")]
            if all(t is not None for t in parts):
                out[f"{p}mlp.gate_up_proj.{suffix}"] = torch.cat(parts)
    return out


# ---------------------------------------------------------------------------------------------- HF folders

def _read_hf_folder(folder: Path, dtype: torch.dtype):
    from safetensors import SafetensorError, safe_open

    config_file = folder / "config.json"
    if not config_file.is_file():
        raise SparseSpecError(f"{folder} has no config.json: not an HF checkpoint folder")
    try:  # (JSON that parses but is no config: a list, a string where a number belongs)
        cfg = ModelConfig.from_hf(json.loads(config_file.read_text()))
    except (KeyError, ValueError, TypeError, AttributeError) as e:
        raise SparseSpecError(f"invalid config.json in {folder}: {type(e).__name__} {_one_line(e)}") from None
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
        except (KeyError, ValueError, TypeError, AttributeError) as e:
            raise SparseSpecError(f"invalid {index.name} in {folder}: {type(e).__name__} {_one_line(e)}") from None
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise SparseSpecError(f"no safetensors weights in {folder}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        if not f.is_file():
            raise SparseSpecError(f"missing weight file {f}")
        try:
            with safe_open(f, framework="pt") as st:
                for name in st.keys():
                    state[name] = st.get_tensor(name).to(dtype)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise SparseSpecError(f"corrupt or truncated weight file {f}: {_one_line(e)}") from None
    return cfg, state, None


def _hf_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    if not (folder / "tokenizer.json").is_file() and not (folder / "tokenizer_config.json").is_file():
        raise SparseSpecError(f"no tokenizer (tokenizer.json) in {folder}")
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


# ---------------------------------------------------------------------------------------------- GGUF

_GGUF_NAMES = [
    (r"token_embd\.weight", "model.embed_tokens.weight"),
    (r"output_norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"blk\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"blk\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.attn_(q|k|v)\.(weight|bias)", r"model.layers.\1.self_attn.\2_proj.\3"),
    (r"blk\.(\d+)\.attn_output\.(weight|bias)", r"model.layers.\1.self_attn.o_proj.\2"),
    (r"blk\.(\d+)\.attn_(q|k)_norm\.weight", r"model.layers.\1.self_attn.\2_norm.weight"),
    (r"blk\.(\d+)\.ffn_(gate|up|down)\.(weight|bias)", r"model.layers.\1.mlp.\2_proj.\3"),
]


def _gguf():
    """The gguf package (a dependency of ours, but an environment may lack it): one clear error where it is missing."""
    try:
        import gguf
        import gguf.quants
    except ImportError as e:
        raise SparseSpecError(f"reading GGUF files needs the gguf package ({e}); install it: pip install gguf"
                              ) from None
    return gguf


def open_gguf(path: Path):
    """The file's metadata and tensor table (gguf_file.GGUFFile), or one clear error for a damaged file."""
    _gguf()
    from .gguf_file import GGUFFormatError, NotGGUF, read_gguf

    try:
        return read_gguf(path)
    except NotGGUF:
        raise SparseSpecError(f"{path} is not a GGUF file (bad magic) and not a checkpoint folder") from None
    except GGUFFormatError as e:
        raise SparseSpecError(f"corrupt or truncated GGUF file {path}: {e}") from None


def _read_gguf(path: Path, dtype: torch.dtype, progress: bool, device: str | torch.device = "cpu"):
    """A GGUF file's config, HF-named state (dequantised on `device`, torch's threads or the GPU, cast to
    `dtype`) and Llama 3 rope frequency factors."""
    from ..progress import track
    from .dequant import dequantize

    gguf_file = open_gguf(path)
    meta = gguf_file.metadata
    names = {t.name for t in gguf_file.tensors}
    cfg = ModelConfig.from_gguf(meta, has_output_weight="output.weight" in names)
    state: dict[str, torch.Tensor] = {}
    freq_factors = None
    for t in track(gguf_file.tensors, "dequantising weights", enabled=progress):
        array = dequantize(t.data, t.type_name, device)
        if t.name == "rope_freqs.weight":
            freq_factors = array.float().cpu()
            continue
        hf_name = _gguf_to_hf(t.name)
        if hf_name is None:
            raise SparseSpecError(f"unsupported tensor {t.name!r} in GGUF file {path}")
        if cfg.arch == "llama" and re.search(r"\.(q|k)_proj\.", hf_name):
            heads = cfg.num_heads if ".q_proj." in hf_name else cfg.num_kv_heads
            array = _unpermute_rows(array, heads)
        state[hf_name] = array.to(dtype)
    return cfg, state, freq_factors


def _gguf_to_hf(name: str) -> str | None:
    for pattern, repl in _GGUF_NAMES:
        if re.fullmatch(pattern, name):
            return re.sub(pattern, repl, name)
    return None


def _unpermute_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp stores Llama q/k rows of each head interleaved (pairs i, i+D/2 adjacent) for its rotary layout;
    restore the half-split order HF checkpoints (and our RoPE) use."""
    head_dim = w.shape[0] // heads
    return w.reshape(heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _gguf_tokenizer(path: Path):
    """tokenizer.json beside the file if there is one, else converted from the GGUF metadata once and cached."""
    from transformers import AutoTokenizer

    if (path.parent / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(path.parent, local_files_only=True)
    saved = cache_dir() / "tokenizers" / f"{path.stem}-{path.stat().st_size}"
    if not (saved / "tokenizer.json").is_file():
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
        tmp = saved.with_name(saved.name + f".tmp{os.getpid()}")
        tok.save_pretrained(tmp)
        saved.parent.mkdir(parents=True, exist_ok=True)
        try:
            tmp.rename(saved)
        except OSError:  # another process cached it first
            shutil.rmtree(tmp, ignore_errors=True)
    return AutoTokenizer.from_pretrained(saved, local_files_only=True)


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split()) or type(e).__name__
