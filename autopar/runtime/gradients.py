"""Gradients that tensor parallelism leaves as partial sums, reduced after the backward.

A replicated parameter read by a split op (a norm's weight under sequence parallelism) gets a
gradient that is a partial sum over the tensor-parallel ranks; DTensor would reduce it where the
optimizer first reads it, one all-reduce per parameter. The runtime reduces them all after the
schedule's backward instead, bucketed as the cost model prices them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate


def reduce_partial_gradients(modules: list[nn.Module]) -> None:
    """Reduce every gradient that is still a partial sum over a mesh dim (a replicated parameter
    read by a split op: a norm's weight under sequence parallelism) in one all-reduce per mesh
    dims and dtype, the bucket the cost model prices, instead of one per parameter where the
    optimizer first reads it. A sum of the same values: the same gradients."""
    buckets: dict[tuple, list[nn.Parameter]] = {}
    for param in (p for module in modules for p in module.parameters()):
        grad = param.grad
        if isinstance(grad, DTensor):
            dims = tuple(d for d, place in enumerate(grad.placements)
                         if type(place) is Partial and place.reduce_op == "sum")
            if dims:
                buckets.setdefault((grad.device_mesh, dims, grad.dtype), []).append(param)
    with torch.no_grad():
        for (mesh, dims, _), params in buckets.items():
            flat = torch.cat([param.grad.to_local().reshape(-1) for param in params])
            for dim in dims:
                dist.all_reduce(flat, group=mesh.get_group(dim))
            offset = 0
            for param in params:
                local, placements = param.grad.to_local(), list(param.grad.placements)
                reduced = flat[offset:offset + local.numel()].view(local.shape)
                offset += local.numel()
                param.grad = DTensor.from_local(
                    reduced, mesh, [Replicate() if d in dims else p for d, p in enumerate(placements)],
                    run_check=False)
