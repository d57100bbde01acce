import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    # the Triton kernels' tests run them in Triton's CPU interpreter; it must be chosen before any kernel module is
    # imported (a kernel is made interpreted or compiled when its module is imported). The engine itself runs the
    # kernels on CUDA only.
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    # `make test` runs the files in parallel processes (pytest-xdist, one a core): each takes its share of torch's
    # intra-op threads, so that together they do not oversubscribe the cores
    torch.set_num_threads(max(1, torch.get_num_threads() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"  # where a kernel test runs its kernel (interpreted on CPU, at small sizes)
cuda_only = pytest.mark.skipif(not CUDA, reason="larger sizes run on CUDA only")  # full sizes: on the GPU

TINY = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2)


def tiny_hf_model(kind: str, seed: int = 0):
    """A randomly initialised HF transformers model of one supported architecture variant."""
    import transformers as tf

    torch.manual_seed(seed)
    if kind == "llama":
        cfg = tf.LlamaConfig(**TINY, tie_word_embeddings=False)
    elif kind == "llama-mha-tied-bias":
        cfg = tf.LlamaConfig(**{**TINY, "num_key_value_heads": 4}, tie_word_embeddings=True, attention_bias=True,
                             mlp_bias=True)
    elif kind == "llama3-rope":
        cfg = tf.LlamaConfig(**TINY, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    elif kind == "llama-linear-rope":
        cfg = tf.LlamaConfig(**TINY, rope_scaling={"rope_type": "linear", "factor": 4.0})
    elif kind == "mistral":
        cfg = tf.MistralConfig(**TINY, sliding_window=7)
    elif kind == "qwen2":
        cfg = tf.Qwen2Config(**{**TINY, "num_key_value_heads": 1}, tie_word_embeddings=True)
    elif kind == "qwen3":
        cfg = tf.Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=False)
    else:
        raise ValueError(kind)
    cfg._attn_implementation = "eager"
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    # HF initialises biases (and norms) to zero / one: randomise them so the parity test sees them.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(1.0 if "norm" in name else 0.0, 0.1)
    return model


def cache_with_keys(keys: torch.Tensor):
    """A one-layer KVCache holding `keys` [B, Hkv, S, D] and random values (Hq = 2 Hkv)."""
    from sparsespec.cache import KVCache
    from sparsespec.config import ModelConfig

    B, Hkv, S, D = keys.shape
    cfg = ModelConfig(arch="llama", vocab_size=10, hidden_size=Hkv * D * 2, intermediate_size=8, num_layers=1,
                      num_heads=Hkv * 2, num_kv_heads=Hkv, head_dim=D, max_position=S)
    cache = KVCache(cfg, B, S, torch.float32, "cpu")
    cache.k[0].copy_(keys)
    cache.v[0].copy_(torch.randn_like(keys))
    return cache


ARCH_KINDS = ["llama", "llama-mha-tied-bias", "llama3-rope", "llama-linear-rope", "mistral", "qwen2", "qwen3"]


@pytest.fixture(scope="session")
def smollm2_path():
    from sparsespec.models.registry import resolve

    return resolve("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_engine(smollm2_path):
    from sparsespec.generate import Engine
    from sparsespec.models.loading import load

    return Engine(load(smollm2_path))


@pytest.fixture(scope="session")
def smollm2_wiki_greedy(smollm2_engine):
    """A 260-word wiki passage (seed 5) as tokens and the real model's first 20 dense greedy tokens after it (EOS
    ignored): the reference of the full-budget tests of test_policies and test_runner, generated once for both."""
    from sparsespec import corpora
    from sparsespec.generate import GenerationConfig

    prompt = smollm2_engine.tokenizer(corpora.text("wiki", 260, seed=5))["input_ids"]
    gen = GenerationConfig(max_new_tokens=20, stop_on_eos=False)
    return prompt, smollm2_engine.generate([prompt], gen).token_ids[0]


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: intra-op threads only add wake-up latency (milliseconds per op on a loaded 2-core box)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def byte_engine(seed: int = 0):
    """A tiny random llama on the ByteTokenizer: `eval` and `bench spec` end to end on real text in milliseconds."""
    from sparsespec.config import ModelConfig
    from sparsespec.generate import Engine
    from sparsespec.models.loading import LoadedModel
    from sparsespec.models.shapes import ByteTokenizer
    from sparsespec.models.transformer import Transformer

    cfg = ModelConfig(arch="llama", vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position=4096)
    torch.manual_seed(seed)
    return Engine(LoadedModel(Transformer(cfg).eval().requires_grad_(False), ByteTokenizer(), cfg, None))
