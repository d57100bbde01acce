"""sparsespec.hf: the sparse policies as transformers attention implementations and the speculative loop as
generate's custom_generate, on real weights (smollm2-135m) and tiny random models."""

import os
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import sparsespec.hf as hf
from sparsespec import GenerationConfig, SparseSpecError, corpora
from sparsespec.attention import POLICIES, make_policy
from sparsespec.attention.binarypc import BinaryPCOptions
from sparsespec.attention.doublesparse import save_labels
from sparsespec.attention.policy import BudgetOptions, PolicyOptions
from sparsespec.generate import Engine
from sparsespec.models.loading import load
from sparsespec.runner import Runner
from sparsespec.spec.drafters import ModelDrafter, NgramDrafter

from .conftest import tiny_hf_model

pytestmark = pytest.mark.usefixtures("one_thread")


def hf_twin(engine: Engine) -> torch.nn.Module:
    """The engine's model as a transformers model (config from its GGUF file, q/k/v and gate/up split apart):
    the same weights and rotary frequencies. transformers computes its inverse frequencies a last bit apart from
    ours, and BinaryPC's greedy basis fit amplifies such differences in its later bits; with them shared, the two
    engines' keys are the same and a sparse selection can be compared token for token."""
    src = engine.loaded.source
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(src.parent), gguf_file=src.name),
                                             dtype=engine.dtype)
    ours = engine.model
    split = ours.layers[0].self_attn.split
    state = {}
    for name, t in ours.state_dict().items():
        if ".qkv_proj." in name:
            state.update({"model." + name.replace("qkv", n): w for n, w in zip("qkv", t.split(split))})
        elif ".gate_up_proj." in name:
            state.update({"model." + name.replace("gate_up", n): w for n, w in zip(("gate", "up"), t.chunk(2))})
        elif name != "inv_freq":
            state[name if name == "lm_head.weight" else "model." + name] = t
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    rotary = model.model.rotary_emb
    rotary.inv_freq.copy_(ours.inv_freq)
    rotary.original_inv_freq.copy_(ours.inv_freq)
    return model.eval()


@pytest.fixture(scope="module")
def twin(smollm2_engine):
    return hf_twin(smollm2_engine)


@pytest.fixture(scope="module")
def wiki(smollm2_engine):
    return smollm2_engine.tokenizer(corpora.text("wiki", 800, seed=1))["input_ids"]


def generate(model, prompt: list[int], attn: str = "sdpa", cache=None, **kwargs) -> list[int]:
    """Greedy new tokens of `model.generate` with attention implementation `attn`."""
    model.set_attn_implementation(attn)
    out = model.generate(torch.tensor([prompt]), do_sample=False, cache=cache, **kwargs)
    return out[0, len(prompt):].tolist()


def sparse_cache(model, policy: str, capacity: int, options=None, **kwargs) -> hf.SparseCache:
    """`model` switched to attn_implementation sparsespec_<policy>, and a SparseCache for it."""
    model.set_attn_implementation(f"sparsespec_{policy}")
    return hf.SparseCache(model.config, capacity, options, **kwargs)


def assert_same_or_near_tie(model, prompt: list[int], ref: list[int], got: list[int], gap: float = 1e-3) -> None:
    """Equal tokens, or the first step where they differ is a near-tie of the reference's top-2 logits."""
    if got == ref:
        return
    i = next(i for i, (a, b) in enumerate(zip(ref, got)) if a != b)
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        top = model(torch.tensor([prompt + ref[:i]])).logits[0, -1].topk(2).values
    assert float(top[0] - top[1]) < gap, f"token {i}: {got[i]} instead of {ref[i]} without a near-tie"


FULL = {  # each policy's options that attend to every key
    "dense": {}, "topk": {"budget": 1.0}, "streaming": {"budget": 1.0}, "quest": {"budget": 1.0},
    "doublesparse": {"budget": 1.0}, "magicpig": {"budget": 1.0, "min_collisions": 0},
    "binarypc": {"budget": 1.0}, "topp": {"p": 1.0}, "twilight": {"p": 1.0, "candidates": 1.0},
    "doublep": {"p1": 1.0, "p2": 1.0},
}


def test_every_policy_is_registered_with_a_full_budget_case():
    assert set(FULL) == set(POLICIES)
    assert hf.ATTENTION_IMPLEMENTATIONS == [f"sparsespec_{name}" for name in POLICIES]


SHORT = 100, 10  # prompt tokens, new tokens


@pytest.fixture(scope="module")
def sdpa_short(twin, wiki):
    return generate(twin, wiki[:SHORT[0]], max_new_tokens=SHORT[1])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FULL))
def test_full_budget_equals_sdpa_on_smollm2(name, twin, wiki, sdpa_short, tmp_path):
    prompt, new = wiki[:SHORT[0]], SHORT[1]
    options = dict(FULL[name])
    if name == "doublesparse":  # at full budget any label channels select every key
        save_labels(tmp_path / "labels.safetensors", {f"layer{i}": torch.arange(16).expand(3, 16)
                                                      for i in range(twin.config.num_hidden_layers)})
        options["labels"] = str(tmp_path / "labels.safetensors")
    cache = sparse_cache(twin, name, len(prompt) + new, POLICIES[name].Options(**options))
    got = generate(twin, prompt, f"sparsespec_{name}", cache, max_new_tokens=new)
    assert_same_or_near_tie(twin, prompt, sdpa_short, got)
    if name != "dense":
        assert cache.mean_attended == pytest.approx(len(prompt) + (new - 2) / 2, rel=0.01)


@pytest.mark.slow
def test_binarypc_at_2_percent_gives_the_engines_tokens(smollm2_engine, twin, wiki):
    """400 prompt tokens at 2%: 8 keys per step and KV head (min_tokens=0: the default floor of 1024 keys would
    attend everything at this length; no sinks or window)."""
    prompt, new = wiki[:400], 12
    options = BinaryPCOptions(budget=0.02, min_tokens=0, sinks=0, window=0)
    ours = smollm2_engine.generate([prompt], GenerationConfig(max_new_tokens=new),
                                   policy=make_policy("binarypc", {"budget": 0.02, "min_tokens": 0, "sinks": 0,
                                                                   "window": 0})).token_ids[0]
    for fixed in (False, True):  # eager steps, and fixed-width ones through the kernels' torch references
        cache = sparse_cache(twin, "binarypc", len(prompt) + new, options, fixed=fixed)
        assert generate(twin, prompt, "sparsespec_binarypc", cache, max_new_tokens=new) == ours
        assert cache.mean_attended < 0.03 * (len(prompt) + new)  # 2%, the safeguard and the decoded tokens


@pytest.mark.slow
def test_speculative_greedy_equals_plain_greedy(smollm2_engine, twin, wiki):
    prompt = wiki[:150] + wiki[:40]  # a repeat: the n-gram drafter finds matches
    draft = tiny_hf_model("llama")  # a random draft model of the same vocabulary: mostly rejected proposals
    draft.resize_token_embeddings(twin.config.vocab_size)
    drafters = {"ngram": NgramDrafter(), "hf-model": hf.HFModelDrafter(draft, twin.config.vocab_size),
                "engine": ModelDrafter(smollm2_engine, target_vocab=twin.config.vocab_size)}
    runs = [(name, {"max_new_tokens": 24}) for name in drafters]
    runs.append(("ngram", {"max_new_tokens": 16, "repetition_penalty": 1.3}))  # processors see every row's prefix
    refs = {}
    for name, kwargs in runs:
        key = tuple(kwargs.items())
        if key not in refs:
            refs[key] = generate(twin, prompt, **kwargs)
        got = generate(twin, prompt, custom_generate=hf.speculative_generate, drafter=drafters[name], block_size=6,
                       **kwargs)
        assert got == refs[key], (name, kwargs)


@pytest.mark.slow
def test_tapped_features_are_the_engines(smollm2_engine, twin, wiki):
    from sparsespec.cache import KVCache

    tokens = torch.tensor([wiki[:64]])
    taps = (1, 14, 27)
    with torch.no_grad():
        states = twin(tokens, output_hidden_states=True).hidden_states
        cache = KVCache(smollm2_engine.config, 1, 64, torch.float32, "cpu")
        _, ours = smollm2_engine.model.forward_tapped(tokens, torch.arange(64)[None], cache, 64, taps)
    got = hf.tapped_features(states, taps)
    assert ((got - ours).abs().max() / ours.abs().max()).item() < 1e-5


# ---------------------------------------------------------------------------------------------- tiny models


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_tiny_batch_of_equal_prompts_matches_the_engine(kind, tmp_path):
    """Two rows of one length decode sparsely as the engine does (a model converted by our loader from the HF
    folder); oracle top-k at 8 keys of ~40."""
    model = tiny_hf_model(kind)
    model.save_pretrained(tmp_path)
    ours = load(tmp_path, with_tokenizer=False).model
    model.model.rotary_emb.inv_freq.copy_(ours.inv_freq)
    model.generation_config.eos_token_id = None
    prompts = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(4))
    new = 8
    cache = sparse_cache(model, "topk", 32 + new, BudgetOptions(budget=8, min_tokens=0, dense_layers=1, sinks=0,
                                                                window=0))
    got = model.generate(prompts, do_sample=False, max_new_tokens=new, cache=cache)[:, 32:]
    runner = Runner(ours, 2, 32 + new, make_policy("topk", {"budget": 8, "min_tokens": 0, "dense_layers": 1,
                                                            "sinks": 0, "window": 0}))
    tokens = [ours.logits(runner.prefill(prompts.tolist())).argmax(-1)]
    while len(tokens) < new:
        tokens.append(runner.decode(tokens[-1]).argmax(-1))
    assert torch.equal(got, torch.stack(tokens, 1))
    assert cache.mean_attended == 8


def test_dflash_drafter_on_a_transformers_target_keeps_greedy_output(tmp_path):
    """A (random) DFlash drafter built for a tiny transformers target, saved and loaded through `dflash_drafter`,
    drafts blocks from the target's tapped features: the speculative output is plain greedy decoding's."""
    from sparsespec.config import ModelConfig
    from sparsespec.spec.dflash import DFlash, DFlashConfig

    model = tiny_hf_model("llama")
    model.generation_config.eos_token_id = None
    torch.manual_seed(1)
    target = ModelConfig.from_hf(model.config.to_dict())
    DFlash(DFlashConfig(target=target, layers=1, block_size=4, taps=(0, 1))).save(tmp_path / "d", torch.float32)
    drafter = hf.dflash_drafter(model, tmp_path / "d.safetensors")
    prompt = torch.randint(0, model.config.vocab_size, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    want = generate(model, prompt, max_new_tokens=12)
    assert generate(model, prompt, custom_generate=hf.speculative_generate, drafter=drafter,
                    max_new_tokens=12) == want


def test_doublep_fixed_width_steps_through_transformers_equal_eager_ones():
    """Double-P in a SparseCache: fixed-width steps (what CUDA runs; here the torch path) give the eager steps'
    tokens, the token leaving the window clustered inside each step."""
    from sparsespec.attention.doublep import DoublePOptions

    model = tiny_hf_model("llama")
    model.generation_config.eos_token_id = None
    prompt = torch.randint(0, model.config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(7))
    options = DoublePOptions(window=4, sinks=2, cluster_size=4, p1=0.9, p2=0.6, dense_layers=1)
    runs = []
    for fixed in (False, True):
        cache = sparse_cache(model, "doublep", 48 + 12, options, fixed=fixed)
        runs.append(model.generate(prompt, do_sample=False, max_new_tokens=12, cache=cache)[0, 48:].tolist())
    assert runs[0] == runs[1]


def test_crop_rolls_the_index_back():
    """After a crop, decoding the cropped tokens again gives the same logits (the index follows the rollback)."""
    model = tiny_hf_model("llama")
    cache = sparse_cache(model, "binarypc", 40, BinaryPCOptions(budget=6, min_tokens=0, dense_layers=1, bits=16,
                                                                encode_decoded=True))
    prompt = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        model(prompt, cache=cache)
        tokens = [3, 14, 15, 92, 65]
        first = [model(torch.tensor([[t]]), cache=cache).logits[0, -1] for t in tokens]
        cache.crop(-3)
        again = [model(torch.tensor([[t]]), cache=cache).logits[0, -1] for t in tokens[2:]]
    assert cache.get_seq_length() == 29
    for a, b in zip(first[2:], again):
        torch.testing.assert_close(a, b)


def test_clear_errors():
    model = tiny_hf_model("llama")
    with pytest.raises(SparseSpecError, match="attn_implementation set to one of sparsespec_dense"):
        hf.SparseCache(model.config, 16)  # an eager model
    model.set_attn_implementation("sparsespec_binarypc")
    with pytest.raises(SparseSpecError, match="takes BinaryPCOptions, got PolicyOptions"):
        hf.SparseCache(model.config, 16, PolicyOptions())
    with pytest.raises(SparseSpecError, match="select_every is a setting of sparsespec's own runner"):
        hf.SparseCache(model.config, 16, BinaryPCOptions(select_every=4))
    with pytest.raises(SparseSpecError, match=r"max_cache_len must be in \[1, 256\]"):
        hf.SparseCache(model.config, 1000)
    ids = torch.randint(0, 200, (2, 6), generator=torch.Generator().manual_seed(6))
    with pytest.raises(SparseSpecError, match="decodes through a sparsespec.hf.SparseCache"):
        model.generate(ids, do_sample=False, max_new_tokens=3)
    with pytest.raises(SparseSpecError, match="holds 8 positions; writing 1 more after 8"):
        model.generate(ids, do_sample=False, max_new_tokens=4, cache=hf.SparseCache(model.config, 8))
    padded = torch.tensor([[1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]]).flip(-1)
    with pytest.raises(SparseSpecError, match="rows without padding"):
        model.generate(ids, attention_mask=padded, do_sample=False, max_new_tokens=3, pad_token_id=0,
                       cache=hf.SparseCache(model.config, 16, BinaryPCOptions(min_tokens=0, budget=2)))
    with pytest.raises(SparseSpecError, match="does not support beam search|expanding the batch"):
        model.generate(ids, do_sample=False, num_beams=2, max_new_tokens=3, cache=hf.SparseCache(model.config, 16))
    model.set_attn_implementation("sdpa")
    spec = dict(custom_generate=hf.speculative_generate, max_new_tokens=3)
    with pytest.raises(SparseSpecError, match="needs drafter="):
        model.generate(ids[:1], **spec)
    with pytest.raises(SparseSpecError, match="one row at a time, got a batch of 2"):
        model.generate(ids, drafter=NgramDrafter(), **spec)
    with pytest.raises(SparseSpecError, match="is greedy"):
        model.generate(ids[:1], drafter=NgramDrafter(), do_sample=True, **spec)
    with pytest.raises(SparseSpecError, match="block size must be >= 2"):
        model.generate(ids[:1], drafter=NgramDrafter(), block_size=1, **spec)
    with pytest.raises(SparseSpecError, match="must share the target's tokenizer"):
        hf.HFModelDrafter(model, target_vocab=500)
    other = tiny_hf_model("llama")  # a draft model of another vocabulary, given without target_vocab=
    other.resize_token_embeddings(model.config.vocab_size + 7)
    with pytest.raises(SparseSpecError, match=rf"\({model.config.vocab_size + 7}\) differs from the target's"):
        model.generate(ids[:1], drafter=hf.HFModelDrafter(other), **spec)


def test_mistral_sliding_window_is_refused():
    model = tiny_hf_model("mistral")
    model.set_attn_implementation("sparsespec_topk")
    with pytest.raises(SparseSpecError, match="sliding-window"):
        hf.SparseCache(model.config, 16)


def test_transformers_range_is_stated_and_checked():
    text = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    low, high = hf.TRANSFORMERS_RANGE
    assert re.search(rf'hf = \["transformers>={low},<{high}"\]', text)
    hf.check_version()  # the installed one
    for outside in (str(low).rsplit(".", 1)[0] + f".{int(str(low).rsplit('.', 1)[1]) - 1}.0", str(high)):
        with pytest.raises(SparseSpecError, match=f"needs transformers >={low},<{high}; {outside} is installed"):
            hf.check_version(outside)


# ---------------------------------------------------------------------------------------------- qwen2.5-coder-0.5b


@pytest.fixture(scope="module")
def qwen():
    from sparsespec.models.registry import REGISTRY, is_installed, resolve

    if not is_installed(REGISTRY["qwen2.5-coder-0.5b"]):
        pytest.skip("qwen2.5-coder-0.5b is not installed (`sparsespec models install qwen2.5-coder-0.5b`)")
    if os.environ.get("SPARSESPEC_TEST_QWEN") != "1":
        pytest.skip("qwen2.5-coder-0.5b takes ~40 s to load through transformers' GGUF reader on CPU, past this "
                    "file's time budget: set SPARSESPEC_TEST_QWEN=1 to run it")
    path = resolve("qwen2.5-coder-0.5b")
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.slow
def test_qwen_full_budget_and_dflash(qwen):
    from sparsespec.spec.registry import drafter_path

    model, tokenizer = qwen
    prompt = tokenizer(corpora.text("stdlib", 300, seed=2))["input_ids"][:256]
    ref = generate(model, prompt, max_new_tokens=24)
    cache = sparse_cache(model, "binarypc", len(prompt) + 24, BinaryPCOptions(budget=1.0))
    assert_same_or_near_tie(model, prompt, ref, generate(model, prompt, "sparsespec_binarypc", cache,
                                                         max_new_tokens=24))
    drafter = hf.dflash_drafter(model, drafter_path("qwen2.5-coder-0.5b"))
    got = generate(model, prompt, custom_generate=hf.speculative_generate, drafter=drafter, max_new_tokens=24)
    assert got == ref
