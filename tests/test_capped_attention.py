"""autopar::attention (soft-capped scores, sinks) against the math transformers writes out, and
its backward against finite differences, in tiles of query rows as on a long sequence."""

import pytest
import torch

from autopar.models import capped_attention

BATCH, HEADS, SEQ, DIM, SCALE = 1, 2, 5, 3, 0.3


def written_out(q, k, v, sinks, softcap, causal, mask=None):
    """Gemma 2's and GPT-OSS's eager attention: capped scores, masks, the sinks' column in the
    softmax, dropped after it."""
    scores = q @ k.transpose(-1, -2) * SCALE
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if causal:
        scores = scores.masked_fill(~torch.ones(SEQ, SEQ, dtype=torch.bool).tril(), float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, -1) @ v
    column = sinks.view(1, -1, 1, 1).expand(BATCH, -1, SEQ, 1)
    return torch.softmax(torch.cat([scores, column], -1), -1)[..., :-1] @ v


@pytest.mark.parametrize("softcap, sunk, causal", [(2.0, False, True), (0.0, True, True),
                                                   (2.0, True, False)])
def test_attention_is_the_written_out_math_and_its_gradient(monkeypatch, softcap, sunk, causal):
    # tiles of 2 query rows (3 tiles), as a long sequence is cut
    monkeypatch.setattr(capped_attention, "tiles", lambda q, k: [
        range(start, min(start + 2, q.shape[-2])) for start in range(0, q.shape[-2], 2)])
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(BATCH, HEADS, SEQ, DIM, dtype=torch.double, generator=generator,
                           requires_grad=True) for _ in range(3))
    sinks = torch.randn(HEADS, dtype=torch.double, generator=generator, requires_grad=True)
    inputs = (q, k, v, sinks) if sunk else (q, k, v)

    def attend(*given):
        return torch.ops.autopar.attention(*given[:3], None, 0.0, causal, SCALE, softcap,
                                           given[3] if sunk else None)

    expected = written_out(q, k, v, sinks if sunk else None, softcap, causal)
    assert torch.allclose(attend(*inputs), expected, atol=1e-12)
    assert torch.autograd.gradcheck(attend, inputs)


def test_a_query_that_sees_no_key_attends_to_nothing_or_its_sink():
    """A padded query row masked from every key gives 0 (as scaled_dot_product_attention does),
    and with sinks the sink takes all its weight, still 0; the gradients stay finite."""
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(BATCH, HEADS, SEQ, DIM, dtype=torch.double, generator=generator,
                           requires_grad=True) for _ in range(3))
    mask = torch.rand(BATCH, 1, SEQ, SEQ, generator=generator) > 0.3
    mask[:, :, 0] = False
    for sinks in (None, torch.randn(HEADS, dtype=torch.double, generator=generator)):
        out = torch.ops.autopar.attention(q, k, v, mask, 0.0, False, SCALE, 2.0, sinks)
        assert torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0]))
        out.sum().backward()
        assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert torch.autograd.gradcheck(
        lambda *t: torch.ops.autopar.attention(*t[:3], mask, 0.0, False, SCALE, 2.0, t[3]),
        (q, k, v, torch.randn(HEADS, dtype=torch.double, requires_grad=True)))
