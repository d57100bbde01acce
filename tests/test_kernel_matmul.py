"""The row-invariant matrix product against its torch reference, and its defining property: a row's result does not
depend on the other rows (interpreted on CPU at small sizes, native on CUDA)."""

import pytest
import torch

pytest.importorskip("triton")

from sparsespec.kernels.matmul import (TILES, Tiles, fp8_weights, plan, row_matmul, row_matmul_ref,  # noqa: E402
                                       tiles_for)

from .conftest import CUDA, DEVICE, cuda_only  # noqa: E402


def case(M, N, K, dtype, seed, bias=True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(N, K, generator=gen) / K**0.5).to(DEVICE, dtype)
    b = torch.randn(N, generator=gen).to(DEVICE, dtype) if bias else None
    return x, w, b


def close(y, ref):
    # fp32 sums in another order, one rounding each: at most a step or two of the output dtype apart
    err = (y.float() - ref.float()).abs()
    assert (err <= 2 * torch.finfo(y.dtype).eps * ref.float().abs() + 1e-3).all(), err.max().item()


#  M,  N,   K,   dtype,          bias,  programs (K splits planned for it)
CASES = [
    (1, 8, 16, torch.bfloat16, True, 8),
    (3, 33, 70, torch.float16, False, 8),
    (16, 64, 64, torch.bfloat16, True, 1),
    (17, 100, 200, torch.bfloat16, True, 8),  # a second row tile; several splits
    (40, 65, 333, torch.float16, True, 64),  # more splits than fit: the last one short
    (5, 130, 1000, torch.bfloat16, False, 16),
    (2, 7, 5, torch.float16, True, 4),  # K shorter than a tile
]


@pytest.mark.parametrize("M,N,K,dtype,bias,programs", CASES)
def test_row_matmul_matches_its_reference(M, N, K, dtype, bias, programs):
    x, w, b = case(M, N, K, dtype, M * 1000 + N + K)
    y = row_matmul(x, w, b, programs)
    assert y.shape == (M, N) and y.dtype == dtype
    close(y, row_matmul_ref(x, w, b))


@pytest.mark.parametrize("M,N,K,dtype,bias,programs", CASES)
def test_a_row_is_the_same_whatever_the_other_rows_are(M, N, K, dtype, bias, programs):
    x, w, b = case(M, N, K, dtype, M + N * 7 + K)
    y = row_matmul(x, w, b, programs)
    for r in {0, M // 2, M - 1}:
        assert torch.equal(row_matmul(x[r:r + 1], w, b, programs), y[r:r + 1])  # alone
    other = torch.cat([x.flip(0), torch.randn(5, K).to(DEVICE, dtype)])  # reordered, more rows
    assert torch.equal(row_matmul(other, w, b, programs)[:M].flip(0), y)


def test_the_split_plan_depends_on_the_shape_alone_and_covers_k():
    for tiles in (TILES, Tiles(block_n=128, block_k=128, waves=4), Tiles(block_n=32, block_k=256, waves=1)):
        for n, k, programs in [(8, 16, 8), (2048, 1536, 132), (1536, 8960, 132), (151936, 1536, 132),
                               (64, 999, 200)]:
            splits, chunk = plan(n, k, programs, tiles)
            assert splits >= 1 and chunk % tiles.block_k == 0
            assert (splits - 1) * chunk < k <= splits * chunk  # every split has work, together all of K
        assert plan(151936, 1536, 132, tiles)[0] == 1  # a wide product needs no split
    for n, k in [(8, 16), (2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960), (151936, 1536), (64, 999)]:
        tiles = tiles_for(n, k)  # the default: chosen by the shape, valid and covering K
        splits, chunk = plan(n, k, 132, tiles)
        assert chunk % tiles.block_k == 0 and (splits - 1) * chunk < k <= splits * chunk
    assert tiles_for(1536, 8960) != tiles_for(2048, 1536) != tiles_for(151936, 1536)
    with pytest.raises(ValueError, match="power of two"):
        Tiles(block_k=48)


@pytest.mark.parametrize("tiles", [Tiles(block_n=32, block_k=32, warps=2, stages=2, waves=4),
                                   Tiles(block_n=128, block_k=128, warps=8, stages=4, waves=1)])
def test_other_tilings_match_the_reference_and_keep_rows_invariant(tiles):
    x, w, b = case(21, 100, 300, torch.bfloat16, seed=7)
    y = row_matmul(x, w, b, 8, tiles)
    close(y, row_matmul_ref(x, w, b))
    assert torch.equal(row_matmul(x[3:4], w, b, 8, tiles), y[3:4])
    assert torch.equal(row_matmul(torch.cat([x, x[:5]]), w, b, 8, tiles)[:21], y)


def test_row_matmul_refuses_mixed_or_fp32_inputs():
    x, w, _ = case(2, 8, 16, torch.bfloat16, 0)
    with pytest.raises(ValueError, match="one dtype"):
        row_matmul(x, w.half())
    with pytest.raises(ValueError, match="bf16/fp16"):
        row_matmul(x.float(), w.float())


@cuda_only
@pytest.mark.parametrize("M", [1, 6, 16, 96, 200])
@pytest.mark.parametrize("N,K", [(2048, 1536), (1536, 8960), (17920, 1536), (151936, 1536)])
def test_row_matmul_at_model_sizes(M, N, K):
    x, w, b = case(M, N, K, torch.bfloat16, M + N)
    y = row_matmul(x, w, b)
    close(y, row_matmul_ref(x, w, b))
    assert torch.equal(row_matmul(x[-1:], w, b), y[-1:])


def test_the_models_linear_takes_the_kernel_up_to_its_row_limit(monkeypatch):
    from sparsespec.models import transformer

    if not CUDA:
        monkeypatch.setattr(transformer, "triton_ready", lambda device: True)  # the kernel, interpreted
    torch.manual_seed(0)
    lin = transformer.Linear(40, 24, bias=True).to(DEVICE, torch.bfloat16)
    x = torch.randn(3, 4, 40).to(DEVICE, torch.bfloat16)  # 12 rows
    calls = []
    monkeypatch.setattr(transformer, "row_linear", lambda *a: calls.append(1) or row_matmul(*a))
    plain = lin(x)
    assert not calls  # rows = 0: off
    lin.rows = 12
    y = lin(x)
    assert calls and y.shape == (3, 4, 24)
    close(y, row_matmul_ref(x.reshape(12, 40), lin.weight, lin.bias).view(3, 4, 24))
    assert torch.equal(lin(x[1:2, 2:3]), y[1:2, 2:3])  # a row alone: bitwise the same
    close(plain, y)
    lin.rows = 11
    calls.clear()
    lin(x)
    assert not calls  # past the limit: F.linear (cuBLAS on CUDA)
    # the custom op the model calls (what torch.compile keeps whole in its graph), with and without a bias
    rows = x.reshape(12, 40)
    assert torch.equal(torch.ops.sparsespec.row_linear(rows, lin.weight, lin.bias), y.reshape(12, 24))
    assert torch.equal(torch.ops.sparsespec.row_linear(rows, lin.weight, None), row_matmul(rows, lin.weight))


def test_a_row_invariant_model_compiles_with_inductors_invariant_options():
    """Row-invariant products alone are not enough under torch.compile: Inductor picks a norm's reduction blocks by
    the row count and by timing candidates, and fuses element-wise ops without eager's bf16 rounding between them
    (differently in a one-token graph and a block's), so a compiled step of such a model asks for its deterministic
    mode, eager's rounding and, where torch has it, the batch-invariant mode; a plain model compiles as before."""
    from sparsespec.graphs import invariant_options
    from sparsespec.config import ModelConfig
    from sparsespec.models.transformer import Transformer

    cfg = ModelConfig(arch="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=16, max_position=64)
    model = Transformer(cfg)
    assert invariant_options(model) is None
    model.row_invariant(64)
    options = invariant_options(model)
    config = torch._inductor.config
    assert options and options["deterministic"] and options["emulate_precision_casts"]
    assert all(hasattr(config, key) for key in options)  # torch.compile refuses an unknown option
    model.row_invariant(0)
    assert invariant_options(model) is None


def test_fp8_weights_keep_each_element_within_the_formats_precision():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(37, 50, generator=gen) * torch.logspace(-3, 2, 37)[:, None]  # rows of very different scales
    w8, scale = fp8_weights(w.to(torch.bfloat16))
    assert w8.dtype == torch.float8_e4m3fn and scale.shape == (37,) and scale.dtype == torch.float32
    back = w8.float() * scale[:, None]
    ref = w.to(torch.bfloat16).float()
    assert ((back - ref).abs() <= 2**-4 * ref.abs() + 2**-9 * ref.abs().amax(1, keepdim=True)).all()
    assert (w8.float().abs().amax(1) == 448).all()  # each row's largest element uses the whole range
    zero, s0 = fp8_weights(torch.zeros(2, 8, dtype=torch.bfloat16))
    assert torch.equal(zero.float(), torch.zeros(2, 8)) and (s0 > 0).all()


@pytest.mark.parametrize("M,N,K,bias,programs", [(1, 40, 64, True, 8), (19, 100, 300, False, 8),
                                                 (5, 33, 70, True, 1)])
def test_row_matmul_with_fp8_weights_matches_its_reference(M, N, K, bias, programs):
    x, w, b = case(M, N, K, torch.bfloat16, seed=M + N, bias=bias)
    w8, scale = fp8_weights(w)
    y = row_matmul(x, w8, b, programs, scale=scale)
    close(y, row_matmul_ref(x, w8, b, scale))
    assert torch.equal(row_matmul(x[-1:], w8, b, programs, scale=scale), y[-1:])
    with pytest.raises(ValueError, match="scale"):
        row_matmul(x, w8, b, programs)
    with pytest.raises(ValueError, match="scale"):
        row_matmul(x, w, b, programs, scale=scale)


@cuda_only
@pytest.mark.parametrize("N,K", [(2048, 1536), (17920, 1536), (1536, 8960), (151936, 1536)])
def test_row_matmul_with_fp8_weights_at_model_sizes(N, K):
    for M in (1, 16, 128):
        x, w, b = case(M, N, K, torch.bfloat16, seed=M, bias=False)
        w8, scale = fp8_weights(w)
        close(row_matmul(x, w8, None, scale=scale), row_matmul_ref(x, w8, None, scale))
