"""The DFlash training loss's cross-entropy kernel against its torch reference: the loss and its gradient, over odd
vocabulary sizes (within one chunk, across chunks), ignored labels, large logits and three dtypes (interpreted on CPU
at small sizes, native on CUDA at the 1.5B drafter's full size)."""

import pytest
import torch

pytest.importorskip("triton")

from sparsespec.kernels.cross_entropy import BLOCK_V, cross_entropy, cross_entropy_ref  # noqa: E402

from .conftest import DEVICE, cuda_only  # noqa: E402


def case(N, V, dtype, seed, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(N, V, generator=gen) * scale + torch.randn(N, 1, generator=gen) * 10).to(DEVICE, dtype)
    labels = torch.randint(0, V, (N,), generator=gen)
    labels[torch.rand(N, generator=gen) < 0.25] = -100  # nothing to predict there
    weights = torch.rand(N, generator=gen).to(DEVICE)
    return logits, labels.to(DEVICE), weights


def loss_and_grad(fn, logits, labels, weights):
    x = logits.detach().clone().requires_grad_(True)
    loss = fn(x, labels)
    (loss * weights).sum().backward()
    return loss, x.grad


TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("N,V,dtype", [(1, 7, torch.float32), (5, 37, torch.bfloat16), (9, 100, torch.float16),
                                       (3, BLOCK_V + 3, torch.bfloat16), (4, 2 * BLOCK_V - 5, torch.float32)])
def test_cross_entropy_and_its_gradient_match_the_reference(N, V, dtype):
    logits, labels, weights = case(N, V, dtype, seed=N * 1000 + V)
    loss, grad = loss_and_grad(cross_entropy, logits, labels, weights)
    ref_loss, ref_grad = loss_and_grad(cross_entropy_ref, logits, labels, weights)
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    # the kernel reads the logits as they are and computes in fp32: the loss to fp32 rounding of the row's sums
    assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-4), (loss - ref_loss).abs().max()
    # the gradient is rounded once, to the logits' dtype (the reference rounds its fp32 gradient once too)
    assert torch.allclose(grad.float(), ref_grad.float(), rtol=TOL[dtype], atol=TOL[dtype] * 1e-2), \
        (grad.float() - ref_grad.float()).abs().max()
    ignored = labels < 0
    assert (loss[ignored] == 0).all() and (grad[ignored] == 0).all()


def test_a_gradient_row_sums_to_zero_and_is_minus_one_less_the_labels_probability_at_the_label():
    logits, labels, weights = case(6, 50, torch.float32, seed=7)
    labels[:] = torch.arange(6, device=DEVICE)
    _, grad = loss_and_grad(cross_entropy, logits, labels, torch.ones(6, device=DEVICE))
    p = logits.float().softmax(-1)
    assert torch.allclose(grad.sum(-1), torch.zeros(6, device=DEVICE), atol=1e-6)
    assert torch.allclose(grad[torch.arange(6), labels], p[torch.arange(6), labels] - 1, atol=1e-6)


def test_cross_entropy_refuses_what_it_cannot_do():
    logits, labels, _ = case(2, 16, torch.bfloat16, seed=0)
    for bad in ((logits[0], labels), (logits, labels.int()), (logits, labels[:1]), (logits.double(), labels)):
        with pytest.raises(ValueError, match="cross_entropy needs"):
            cross_entropy(*bad)
    assert cross_entropy(logits[:0], labels[:0]).shape == (0,)


@cuda_only
def test_cross_entropy_at_the_drafters_full_size():
    """A step of the 1.5B's drafter: 8 x 64 blocks of 15 predicted positions over Qwen2.5's 151,936 tokens, bf16."""
    logits, labels, weights = case(7680, 151936, torch.bfloat16, seed=1)
    loss, grad = loss_and_grad(cross_entropy, logits, labels, weights)
    ref_loss, ref_grad = loss_and_grad(cross_entropy_ref, logits, labels, weights)
    assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-3)
    assert torch.allclose(grad.float(), ref_grad.float(), rtol=1e-2, atol=1e-6)
