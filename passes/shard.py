"""Materialize this rank's parameter shards."""

from __future__ import annotations

import torch
from torch import fx, nn
from torch.distributed.tensor import Shard

from autopar.plan import Plan
from autopar.runtime.layout import StageLayout


def shard_parameters(gm: fx.GraphModule, plan: Plan, layout: StageLayout) -> fx.GraphModule:
    """Replace each full parameter by a copy of this rank's shard of it, as the plan places it."""
    coordinate = layout.tensor_mesh.get_coordinate() if layout.tensor_mesh is not None else []
    names_of = {}
    for name, param in gm.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    for fqn, param in list(gm.named_parameters()):
        spec = layout.parameters[fqn]
        local = param.detach()
        for axis, placement in enumerate(spec.tensor):
            if isinstance(placement, Shard):
                local = local.chunk(layout.tensor_mesh.size(axis), dim=placement.dim)[coordinate[axis]]
        if spec.data_dim is not None:
            local = local.chunk(layout.dp_size, dim=spec.data_dim)[layout.dp_rank]
        # A copy: the shards are this program's own, the user's model stays as it was.
        shard = nn.Parameter(local.clone(), requires_grad=param.requires_grad)
        for name in names_of[id(param)]:   # tied weights: every name points to the one shard
            owner, _, attr = name.rpartition(".")
            setattr(gm.get_submodule(owner), attr, shard)
    return gm


def local_shape(shape: torch.Size | tuple, placements, mesh_sizes, data_dim=None, dp_size=1) -> tuple:
    """The shape of one shard: each sharded dim divided by the size of the axes sharding it."""
    result = list(shape)
    for placement, size in zip(placements, mesh_sizes):
        if isinstance(placement, Shard):
            result[placement.dim] //= size
    if data_dim is not None:
        result[data_dim] //= dp_size
    return tuple(result)
