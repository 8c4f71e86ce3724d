"""A lookup in an embedding table split on the vocabulary over tensor-parallel ranks, as
Megatron's vocabulary-parallel embedding does it.

Each rank looks up the ids its rows hold, zeroes the others, and the partial sums are reduced to
whole after it (`dtensor_adapters.SettledLookup`). In the backward each rank makes the gradient
of its own rows only. DTensor's forward is the same masked partial sum, but DTensor has no
vocabulary-split rule for the lookup's backward (`embedding_dense_backward`): every rank made
the whole table's gradient, replicated, and kept it as the parameter's gradient through the
optimizer step, tp times what the rank updates (a second whole while the next micro-batch's was
made, beside a tied head's under ZeRO: 4 GiB of fp32 each on a 128k x 8192 table).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

LOOKUP = torch.ops.aten.embedding.default


class VocabularySplitLookup(nn.Module):
    """`aten.embedding` that, for a table split on its rows over a one-dimensional mesh, looks up
    each rank's own rows (`_OwnRows`); any other table goes to DTensor as it was traced. The
    frequency-scaled and sparse gradients need every rank's ids: those go to DTensor too."""

    def forward(self, table, ids, padding_idx: int = -1, scale_grad_by_freq: bool = False,
                sparse: bool = False):
        own_rows = (isinstance(table, DTensor) and table.device_mesh.ndim == 1
                    and tuple(table.placements) == (Shard(0),) and not scale_grad_by_freq and not sparse
                    and (not isinstance(ids, DTensor) or tuple(ids.placements) == (Replicate(),)))
        if not own_rows:
            return LOOKUP(table, ids, padding_idx, scale_grad_by_freq, sparse)
        return _OwnRows.apply(table, ids, padding_idx)


class _OwnRows(torch.autograd.Function):
    """Forward: the rows of this rank's ids, zero for ids another rank holds, as a partial sum.
    Backward: the gradient of this rank's rows, from the whole gradient of the lookup's output
    (a partial sum's gradient is the same on every rank)."""

    @staticmethod
    def forward(ctx, table: DTensor, ids, padding_idx: int):
        mesh, local = table.device_mesh, table.to_local()
        rows = local.shape[0]
        first = mesh.get_local_rank() * rows      # shard_stage splits a table in equal shards
        ids = ids.to_local() if isinstance(ids, DTensor) else ids
        elsewhere = (ids < first) | (ids >= first + rows)
        shifted = (ids - first).masked_fill(elsewhere, 0)
        looked_up = F.embedding(shifted, local).masked_fill(elsewhere.unsqueeze(-1), 0)
        ctx.save_for_backward(shifted, elsewhere)
        ctx.mesh, ctx.rows, ctx.shape, ctx.stride = mesh, rows, table.shape, table.stride()
        ctx.padding = padding_idx - first if first <= padding_idx < first + rows else -1
        return DTensor.from_local(looked_up, mesh, [Partial()], run_check=False)

    @staticmethod
    def backward(ctx, grad):
        shifted, elsewhere = ctx.saved_tensors
        if isinstance(grad, DTensor):
            grad = grad.redistribute(ctx.mesh, [Replicate()]).to_local()
        grad = grad.masked_fill(elsewhere.unsqueeze(-1), 0)
        own = torch.ops.aten.embedding_dense_backward(grad, shifted, ctx.rows, ctx.padding, False)
        return (DTensor.from_local(own, ctx.mesh, [Shard(0)], run_check=False, shape=ctx.shape,
                                   stride=ctx.stride), None, None)


def split_lookups(graph_module: fx.GraphModule, lookups: list[fx.Node]) -> None:
    """Each of the `lookups` (`aten.embedding` nodes of `graph_module`) runs as a
    VocabularySplitLookup."""
    graph_module.add_submodule("vocabulary_split_lookup", VocabularySplitLookup())
    for node in lookups:
        node.op, node.target = "call_module", "vocabulary_split_lookup"
    graph_module.recompile()
