"""The row-invariant RMSNorm against its torch reference, and its defining property: a row's result does not depend on
the other rows (interpreted on CPU at small sizes, native on CUDA); the model's RMSNorm takes it when asked."""

import pytest
import torch

pytest.importorskip("triton")

from sparsespec.kernels.norm import MAX_N, rms_norm, rms_norm_ref  # noqa: E402

from .conftest import CUDA, DEVICE, cuda_only  # noqa: E402


def case(M, N, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, N, generator=gen) * (1 + 3 * torch.rand(M, 1, generator=gen))).to(DEVICE, dtype)
    w = (1 + 0.2 * torch.randn(N, generator=gen)).to(DEVICE, dtype)
    return x, w


def close(y, ref):
    # the normalised row is rounded to the dtype before the weight's product: either side of a rounding boundary
    # the two may land one step apart, then the product rounds once more
    err = (y.float() - ref.float()).abs()
    assert (err <= 3 * torch.finfo(y.dtype).eps * ref.float().abs() + 1e-3).all(), err.max().item()


@pytest.mark.parametrize("M,N,dtype", [(1, 8, torch.bfloat16), (3, 33, torch.float16), (7, 100, torch.bfloat16),
                                       (2, 1, torch.float16), (5, 257, torch.bfloat16)])
def test_rms_norm_matches_its_reference(M, N, dtype):
    x, w = case(M, N, dtype, seed=M * 1000 + N)
    close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))


@pytest.mark.parametrize("M,N,dtype", [(6, 64, torch.bfloat16), (9, 70, torch.float16)])
def test_a_row_is_normalised_the_same_whatever_the_other_rows_are(M, N, dtype):
    x, w = case(M, N, dtype, seed=N)
    y = rms_norm(x, w, 1e-5)
    for r in (0, M // 2, M - 1):
        assert torch.equal(rms_norm(x[r:r + 1], w, 1e-5), y[r:r + 1])  # alone
    order = torch.randperm(M, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    assert torch.equal(rms_norm(x[order], w, 1e-5), y[order])  # reordered
    more = torch.cat([x, case(M + 5, N, dtype, seed=N + 1)[0]])
    assert torch.equal(rms_norm(more, w, 1e-5)[:M], y)  # among more rows
    strided = torch.cat([x, x], 1)[:, :N]  # rows further apart in memory
    assert torch.equal(rms_norm(strided, w, 1e-5), y)


def test_rms_norm_refuses_what_it_cannot_do():
    x, w = case(2, 16, torch.bfloat16, seed=0)
    for bad in ((x.float(), w.float()), (x, w.half()), (x, w[:8])):
        with pytest.raises(ValueError, match="rms_norm needs"):
            rms_norm(*bad, 1e-6)
    with pytest.raises(ValueError, match="rms_norm needs"):
        rms_norm(torch.zeros(1, MAX_N + 1, dtype=torch.bfloat16, device=DEVICE),
                 torch.ones(MAX_N + 1, dtype=torch.bfloat16, device=DEVICE), 1e-6)
    assert rms_norm(x[:0], w, 1e-6).shape == (0, 16)


@cuda_only
@pytest.mark.parametrize("N", [64, 896, 1536, 4096])
def test_rms_norm_at_model_sizes(N):
    for M in (1, 6, 16, 96, 300):
        x, w = case(M, N, torch.bfloat16, seed=M + N)
        y = rms_norm(x, w, 1e-6)
        close(y, rms_norm_ref(x, w, 1e-6))
        assert torch.equal(rms_norm(x[-1:], w, 1e-6), y[-1:])


def test_the_models_norm_takes_the_kernel_when_invariant(monkeypatch):
    from sparsespec.models import transformer

    if not CUDA:
        monkeypatch.setattr(transformer, "triton_ready", lambda device: True)  # the kernel, interpreted
    norm = transformer.RMSNorm(48, 1e-6).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        norm.weight.normal_(1, 0.1)
    x = torch.randn(2, 5, 3, 48).to(DEVICE, torch.bfloat16).transpose(1, 2)  # [B, H, T, D], as a q-norm sees it
    calls = []
    monkeypatch.setattr(transformer, "row_rms_norm", lambda *a: calls.append(1) or rms_norm(*a))
    plain = norm(x)
    assert not calls  # off by default
    norm.invariant = True
    y = norm(x)
    assert calls and y.shape == x.shape
    close(y, plain)
    assert torch.equal(norm(x[1:, 2:3, 4:]), y[1:, 2:3, 4:])  # a row alone: bitwise the same
    calls.clear()
    norm(x.float())  # fp32 stays on torch
    assert not calls
    rows = x.reshape(-1, 48)
    assert torch.equal(torch.ops.sparsespec.row_rms_norm(rows, norm.weight, 1e-6), y.reshape(-1, 48))
