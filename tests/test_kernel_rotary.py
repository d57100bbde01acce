"""The fused rotary + cache write against its torch reference (interpreted on CPU at small sizes, native on CUDA),
and the model's step through it against the step without it."""

import pytest
import torch

pytest.importorskip("triton")

from sparsespec.kernels.rotary import rope_write, rope_write_ref  # noqa: E402
from sparsespec.cache import KVCache  # noqa: E402
from sparsespec.config import RopeScaling  # noqa: E402
from sparsespec.models.loading import load  # noqa: E402
from sparsespec.models.rope import inverse_frequencies, rope_cos_sin  # noqa: E402

from .conftest import DEVICE, cuda_only, tiny_hf_model  # noqa: E402


def case(B, T, Hq, Hkv, D, S, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    qkv = (3 * torch.randn(B, T, (Hq + 2 * Hkv) * D, generator=gen)).to(DEVICE, dtype)
    positions = torch.stack([torch.randperm(S, generator=gen)[:T] for _ in range(B)]).to(DEVICE)  # [B, T]
    cos, sin = rope_cos_sin(positions, inverse_frequencies(D, 10000.0, RopeScaling()).to(DEVICE), dtype)
    cache = [torch.randn(B, Hkv, S, D, generator=gen).to(DEVICE, dtype) for _ in range(2)]
    return qkv, cos, sin, positions, cache


@pytest.mark.parametrize("B,T,Hq,Hkv,D,S,dtype", [
    (1, 1, 4, 2, 16, 9, torch.bfloat16), (3, 5, 7, 1, 32, 20, torch.float16), (2, 3, 6, 3, 64, 11, torch.float32),
    (2, 1, 4, 4, 8, 5, torch.bfloat16), (1, 4, 12, 2, 128, 7, torch.bfloat16), (2, 2, 3, 1, 2, 6, torch.float16)])
def test_rope_write_equals_its_reference(B, T, Hq, Hkv, D, S, dtype):
    qkv, cos, sin, positions, (k, v) = case(B, T, Hq, Hkv, D, S, dtype, seed=B * 100 + T * 10 + D)
    k_ref, v_ref = k.clone(), v.clone()
    q_ref = rope_write_ref(qkv, cos, sin, positions, k_ref, v_ref, Hq)
    q = rope_write(qkv, cos, sin, positions, k, v, Hq)
    assert q.shape == (B, Hq, T, D) and q.is_contiguous()
    assert torch.equal(q, q_ref)  # each op rounded as eager torch rounds it
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)  # the written slots, and every other slot untouched


def test_rope_write_skips_slots_outside_the_cache():
    qkv, cos, sin, positions, (k, v) = case(2, 2, 4, 2, 16, 6, torch.bfloat16, seed=3)
    positions = torch.tensor([[1, 6], [-1, 4]], device=DEVICE)  # 6 and -1 lie outside 6 slots
    k_ref, v_ref = k.clone(), v.clone()
    rope_write_ref(qkv, cos, sin, positions, k_ref, v_ref, 4)
    rope_write(qkv, cos, sin, positions, k, v, 4)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


def test_rope_write_refuses_what_it_cannot_do():
    qkv, cos, sin, positions, (k, v) = case(1, 2, 4, 2, 16, 6, torch.bfloat16, seed=0)
    with pytest.raises(ValueError, match="rope_write needs"):
        rope_write(qkv, cos, sin, positions, k, v, 3)  # the heads do not add up
    with pytest.raises(ValueError, match="rope_write needs"):
        rope_write(qkv, cos.float(), sin.float(), positions, k, v, 4)  # mixed dtypes
    with pytest.raises(ValueError, match="rope_write needs"):
        rope_write(qkv[..., :-16].reshape(1, 2, -1), cos[..., :12], sin[..., :12], positions, k[..., :12].clone(),
                   v[..., :12].clone(), 4)  # D = 12: not a power of two


@cuda_only
@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_step_through_rope_write_equals_the_step_without_it(kind, dtype, tmp_path):
    """The model takes the fused kernel on CUDA for steps of up to BLOCK_QUERIES tokens a row; an observer (which
    needs k) keeps the unfused path. Both must write the same cache and compute the same hidden states, bitwise."""
    tiny_hf_model(kind).save_pretrained(tmp_path)
    model = load(tmp_path, device="cuda", dtype=dtype, with_tokenizer=False).model
    seen = []
    results = []
    for observer in (None, lambda layer, q, k: seen.append(layer)):
        cache = KVCache(model.cfg, 2, 40, dtype, "cuda")
        hidden = [model(torch.tensor([[5, 9, 2], [7, 1, 3]], device="cuda"), torch.tensor([[0, 1, 2], [0, 1, 2]],
                                                                                            device="cuda"), cache,
                        observer=observer)]
        for step in range(3):
            tokens = torch.tensor([[step + 4], [step + 8]], device="cuda")
            hidden.append(model(tokens, torch.tensor([[3 + step], [3 + step]], device="cuda"), cache,
                                observer=observer))
        results.append((hidden, cache))
    assert seen  # the unfused path ran
    (fused, cache_f), (plain, cache_p) = results
    assert all(torch.equal(a, b) for a, b in zip(fused, plain))
    assert all(torch.equal(a, b) for a, b in zip(cache_f.k + cache_f.v, cache_p.k + cache_p.v))
