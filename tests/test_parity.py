"""Our decoder against HF transformers' own implementation: tiny random configs and the real default model."""

import pytest
import torch

from sparsespec import corpora
from sparsespec.cache import KVCache
from sparsespec.models.loading import load

from .conftest import ARCH_KINDS, tiny_hf_model


def max_rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def full_logits(model, tokens: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """tokens [B, T] -> logits [B, T, V], prefilling `chunk` positions at a time."""
    B, T = tokens.shape
    cache = KVCache(model.cfg, B, T, model.embed_tokens.weight.dtype, "cpu")
    chunk = chunk or T
    outs = []
    with torch.inference_mode():
        for c0 in range(0, T, chunk):
            c1 = min(c0 + chunk, T)
            pos = torch.arange(c0, c1).expand(B, -1)
            outs.append(model.logits(model(tokens[:, c0:c1], pos, cache, kv_len=c1)))
    return torch.cat(outs, dim=1)


@pytest.fixture(scope="module", params=ARCH_KINDS)
def tiny_pair(request, tmp_path_factory):
    hf = tiny_hf_model(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    return request.param, hf, load(folder, with_tokenizer=False).model


def test_tiny_logits_match_hf(tiny_pair):
    kind, hf, ours = tiny_pair
    tokens = torch.randint(0, hf.config.vocab_size, (2, 41), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(tokens).logits
    assert max_rel_err(full_logits(ours, tokens), ref) <= 1e-4, kind


def test_tiny_chunked_prefill_matches_one_shot(tiny_pair):
    _, hf, ours = tiny_pair
    tokens = torch.randint(0, hf.config.vocab_size, (3, 50), generator=torch.Generator().manual_seed(2))
    one_shot = full_logits(ours, tokens)
    for chunk in (1, 7, 16):
        assert max_rel_err(full_logits(ours, tokens, chunk), one_shot) <= 1e-5


def test_tiny_bf16_close_to_fp32(tiny_pair, tmp_path):
    kind, hf, ours = tiny_pair
    hf.save_pretrained(tmp_path)
    ours_bf16 = load(tmp_path, dtype=torch.bfloat16, with_tokenizer=False).model
    tokens = torch.randint(0, hf.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(3))
    ref = full_logits(ours, tokens)
    got = full_logits(ours_bf16, tokens)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert max_rel_err(got, ref) < 0.1, kind


@pytest.mark.slow
def test_smollm2_logits_match_hf_on_512_real_tokens(smollm2_engine, smollm2_hf):
    ids = smollm2_engine.tokenizer(corpora.text("wiki", 600, seed=1))["input_ids"][:512]
    assert len(ids) == 512
    tokens = torch.tensor([ids])
    with torch.no_grad():
        ref = smollm2_hf(tokens).logits
    ours = full_logits(smollm2_engine.model, tokens, chunk=200)
    assert max_rel_err(ours, ref) <= 1e-4
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.999
