"""Check that what runs is what the plan describes."""

from __future__ import annotations

import torch
from torch import fx, nn
from torch.distributed.tensor import DTensor

from autopar.errors import PlanMismatchError
from autopar.plan import Plan
from autopar.runtime.layout import StageLayout

from autopar.passes.collectives import Redistribute, _last_inserted
from autopar.passes.shard import local_shape


class CheckShape(nn.Module):
    """Raise when a value's global or local shape is not the one its plan placement implies."""

    def __init__(self, node: str, global_shape: tuple, local: tuple):
        super().__init__()
        self.node, self.global_shape, self.local = node, tuple(global_shape), tuple(local)

    def forward(self, value):
        local = value._local_tensor if isinstance(value, DTensor) else value
        if tuple(value.shape) != self.global_shape or tuple(local.shape) != self.local:
            raise PlanMismatchError(
                f"node {self.node} has shape {tuple(value.shape)} and local shard {tuple(local.shape)}; "
                f"the plan implies {self.global_shape} and {self.local}: the plan does not match "
                f"this model, plan it again")
        return value

    def extra_repr(self) -> str:
        return f"{self.node}: {self.global_shape} -> {self.local}"


def verify_local_shapes(gm: fx.GraphModule, plan: Plan, layout: StageLayout) -> fx.GraphModule:
    """Check parameter shards now, and each placed node's local shape whenever the program runs."""
    sizes = [layout.tensor_mesh.size(i) for i in range(len(layout.tensor_axes))]
    for fqn, param in gm.named_parameters():
        spec = layout.parameters[fqn]
        expected = local_shape(spec.shape, spec.tensor, sizes, spec.data_dim, layout.dp_size)
        if tuple(param.shape) != expected:
            raise PlanMismatchError(f"parameter {fqn} has a local shard of shape {tuple(param.shape)}, "
                                    f"the plan implies {expected} of {spec.shape}")
    for node in list(gm.graph.nodes):
        placements = layout.nodes.get(node.name)
        if placements is None or not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        placed = _last_inserted(node)
        if placed.op != "call_module" or not isinstance(gm.get_submodule(placed.target), Redistribute):
            continue
        shape = tuple(node.meta["val"].shape)
        name = f"check_{node.name}"
        gm.add_submodule(name, CheckShape(node.name, shape, local_shape(shape, placements, sizes)))
        with gm.graph.inserting_after(placed):
            check = gm.graph.call_module(name, (placed,))
        check.meta.update(placed.meta)
        placed.replace_all_uses_with(check, delete_user_cb=lambda user: user is not check)
    gm.recompile()
    return gm

