"""Attention that scaled_dot_product_attention cannot compute, as one op autopar can split.

Two published forms change the softmax of attention, and no fused kernel of torch computes them:
- soft-capped scores (Gemma 2): `cap * tanh(scores / cap)` before the mask and the softmax;
- attention sinks (GPT-OSS): one learned logit per head joins each row's softmax, taking a
  share of the weight without a value, so a query may attend to nothing much.

transformers writes them as matmuls, a softmax and a concatenation, which a split over the
sequence cannot tell from any other softmax along it. `autopar::attention` is the same math as one
op of the traced graph (the model's own result to float rounding): context parallelism runs it
over the ring or the all-to-all (passes/context_attention.py), and the cost model prices it as
attention. Its backward is flash attention's, recomputing the probabilities from the inputs:
    dS = P * (dP - rowsum(dO * O)),  through the cap: dS * (1 - tanh^2),
    d sink = -sum over queries of P_sink * rowsum(dO * O).
`attn_mask` is a bool mask (True: the query sees the key), as autopar's own masks make it.
"""

from __future__ import annotations

from typing import Optional

import torch

NEG_INF = float("-inf")


def capped_scores(query: torch.Tensor, key: torch.Tensor, scale: float, softcap: float) -> torch.Tensor:
    """The scores before any mask: q k^T * scale, soft-capped where `softcap` > 0."""
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    return torch.tanh(scores / softcap) * softcap if softcap > 0 else scores


def cap_gradient(scores: torch.Tensor, softcap: float) -> torch.Tensor | float:
    """d(capped)/d(raw) from the capped scores (unmasked): 1 - tanh^2, or 1 without a cap."""
    return 1.0 - (scores / softcap) ** 2 if softcap > 0 else 1.0


def visibility(rows: range, queries: int, keys: int, attn_mask: torch.Tensor | None,
               is_causal: bool, device) -> torch.Tensor | None:
    """Which keys the queries `rows` (of `queries`, the last of `keys` positions) see
    ([.., len(rows), keys] bool), or None for all of them."""
    if attn_mask is not None:
        return attn_mask if attn_mask.shape[-2] == 1 else attn_mask[..., rows.start:rows.stop, :]
    if is_causal:
        return torch.ones(len(rows), keys, dtype=torch.bool, device=device).tril(
            keys - queries + rows.start)
    return None


def tiles(query: torch.Tensor, key: torch.Tensor) -> list[range]:
    """Query rows computed together: as many as keep a tile's scores near 2^26 values (256 MiB
    in fp32), so that no queries x keys matrix of a long sequence is ever made whole."""
    rows = query.shape[-2]
    per_row = max(1, query[..., 0, 0].numel() * key.shape[-2])
    step = max(1, min(rows, 2**26 // per_row))
    return [range(start, min(start + step, rows)) for start in range(0, rows, step)]


def with_sinks(lse: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Each row's log-sum-exp with its head's sink logit joined ([b, h, q]; sinks [h])."""
    return lse if sinks is None else torch.logaddexp(lse, upcast(sinks).view(-1, 1))


def upcast(tensor: torch.Tensor) -> torch.Tensor:
    """16-bit values computed on in fp32, as flash attention does; fp32 and fp64 as they are."""
    return tensor.float() if tensor.dtype in (torch.float16, torch.bfloat16) else tensor


def sink_gradient(sinks: torch.Tensor, delta: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """d sinks ([h]) of the rows whose rowsum(dO * O) is `delta` and log-sum-exp (sinks joined)
    `lse` ([b, h, q]): -sum of each row's sink weight x delta."""
    return -(torch.exp(upcast(sinks).view(-1, 1) - finite(lse)) * delta).sum((0, 2))


def finite(lse: torch.Tensor) -> torch.Tensor:
    """A row that sees no key has a log-sum-exp of -inf: its weights are 0, its output 0."""
    return lse.masked_fill(lse == NEG_INF, 0.0)


def _forward(query, key, value, seen, scale, softcap, sinks):
    """(output, log-sum-exp with the sinks, the capped scores, the weights) of queries that see
    the keys `seen` marks (None: all), 16-bit inputs in fp32."""
    scores = capped_scores(upcast(query), upcast(key), scale, softcap)
    masked = scores if seen is None else scores.masked_fill(~seen, NEG_INF)
    lse = with_sinks(torch.logsumexp(masked, dim=-1), sinks)
    probs = torch.exp(masked - finite(lse).unsqueeze(-1))
    return torch.matmul(probs, upcast(value)), lse, scores, probs


@torch.library.custom_op("autopar::attention", mutates_args=())
def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attn_mask: Optional[torch.Tensor], dropout_p: float, is_causal: bool, scale: float,
              softcap: float, sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """[b, h, q, d] attention of `query` over `key` and `value` (as many heads: repeat a grouped
    query's keys first), soft-capped at `softcap` (0: not), with per-head `sinks` ([h]) or None.
    `dropout_p` must be 0."""
    if dropout_p:
        raise ValueError(f"autopar::attention has no dropout (dropout_p={dropout_p}); set the "
                         f"model's attention dropout to 0")
    queries, keys = query.shape[-2], key.shape[-2]
    return torch.cat([_forward(query[..., rows.start:rows.stop, :], key, value,
                               visibility(rows, queries, keys, attn_mask, is_causal, query.device),
                               scale, softcap, sinks)[0]
                      for rows in tiles(query, key)], dim=-2).to(query.dtype)


@attention.register_fake
def _attention_shape(query, key, value, attn_mask, dropout_p, is_causal, scale, softcap, sinks):
    return query.new_empty(*query.shape[:-1], value.shape[-1])


@torch.library.custom_op("autopar::attention_backward", mutates_args=())
def attention_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor, out: torch.Tensor, attn_mask: Optional[torch.Tensor],
                       is_causal: bool, scale: float, softcap: float,
                       sinks: Optional[torch.Tensor]
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d query, d key, d value, d sinks) of `attention` (d sinks: zeros [h] without sinks),
    tile by tile of query rows as the forward."""
    k, v = upcast(key), upcast(value)
    grad_query, grad_key, grad_value = (torch.zeros_like(upcast(t)) for t in (query, key, value))
    grad_sinks = torch.zeros(query.shape[-3], dtype=grad_key.dtype, device=query.device)
    for rows in tiles(query, key):
        q = upcast(query[..., rows.start:rows.stop, :])
        seen = visibility(rows, query.shape[-2], key.shape[-2], attn_mask, is_causal, query.device)
        _, lse, scores, probs = _forward(q, k, v, seen, scale, softcap, sinks)
        grad = upcast(grad_out[..., rows.start:rows.stop, :])
        delta = (grad * upcast(out[..., rows.start:rows.stop, :])).sum(-1)
        grad_scores = probs * (torch.matmul(grad, v.transpose(-1, -2)) - delta.unsqueeze(-1))
        grad_scores = grad_scores * cap_gradient(scores, softcap)
        grad_query[..., rows.start:rows.stop, :] = torch.matmul(grad_scores, k) * scale
        grad_key += torch.matmul(grad_scores.transpose(-1, -2), q) * scale
        grad_value += torch.matmul(probs.transpose(-1, -2), grad)
        if sinks is not None:
            grad_sinks += sink_gradient(sinks, delta, lse)
    return (*(g.to(t.dtype) for g, t in zip((grad_query, grad_key, grad_value), (query, key, value))),
            grad_sinks.to(query.dtype if sinks is None else sinks.dtype))


@attention_backward.register_fake
def _attention_backward_shape(grad_out, query, key, value, out, attn_mask, is_causal, scale,
                              softcap, sinks):
    sink = sinks.new_empty(sinks.shape) if sinks is not None else query.new_empty(query.shape[-3])
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value), sink


def _setup_context(ctx, inputs, output):
    query, key, value, attn_mask, _, is_causal, scale, softcap, sinks = inputs
    ctx.save_for_backward(query, key, value, output, attn_mask, sinks)
    ctx.settings = (is_causal, scale, softcap)


def _backward(ctx, grad_out):
    query, key, value, out, attn_mask, sinks = ctx.saved_tensors
    grads = torch.ops.autopar.attention_backward(grad_out, query, key, value, out, attn_mask,
                                                 *ctx.settings, sinks)
    return (*grads[:3], None, None, None, None, None, grads[3] if sinks is not None else None)


attention.register_autograd(_backward, setup_context=_setup_context)
