"""DTensor sharding rules for ATen ops that torch's DTensor does not cover yet.

CPU attention (`_scaled_dot_product_flash_attention_for_cpu` and its backward) has no rule in
torch, while the CUDA kernels do; without one every attention would fail under tensor
parallelism on gloo. The rule mirrors torch's CUDA one: replicated, sharded on heads (dim 1), or
sharded on batch (dim 0). A mask is sharded along with the inputs unless it broadcasts on that dim.
Registered once, on import.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

aten = torch.ops.aten


def _mask_placement(attn_mask, dim: int):
    """A mask of size 1 on the sharded dim broadcasts, so every rank keeps all of it."""
    return Shard(dim) if attn_mask.shape[dim] > 1 else Replicate()


def _strategies(n_outputs: int, tensors_before: int, attn_mask, dims=(None, 1, 0)):
    """(outputs, inputs) placement lists: all replicated, then sharded on each of `dims`."""
    result = []
    for dim in dims:
        place = Replicate() if dim is None else Shard(dim)
        inputs = [place] * tensors_before + [None, None]       # dropout_p, is_causal
        if attn_mask is not None:
            inputs.append(Replicate() if dim is None else _mask_placement(attn_mask, dim))
        result.append(([place] * n_outputs, inputs))
    return result


@register_sharding(aten._scaled_dot_product_flash_attention_for_cpu.default)
def _sdpa_cpu_forward(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    """Outputs (attention, logsumexp) follow query, key and value."""
    return _strategies(2, 3, attn_mask)


@register_sharding(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
def _sdpa_cpu_backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *,
                       attn_mask=None, scale=None):
    """Gradients of query, key and value follow every tensor input."""
    return _strategies(3, 6, attn_mask)
