"""Insert the collectives that move values between the plan's placements.

Inserted ops are small modules (`call_module` nodes) so that a printed graph names what they do
and which placements they produce. Autograd is torch's: the backward of an all-gather is a
reduce-scatter, of a redistribution its reverse.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate

from autopar.plan import Plan
from autopar.runtime.layout import StageLayout


class GatherShards(nn.Module):
    """All-gather a tensor sharded on `dim` over `group` (ZeRO-3); backward reduce-scatters (sums)."""

    def __init__(self, dim: int, group: dist.ProcessGroup):
        super().__init__()
        self.dim, self.group = dim, group

    def forward(self, shard: torch.Tensor) -> torch.Tensor:
        # all_gather_single concatenates on dim 0 only, so the sharded dim travels first.
        front = shard.movedim(self.dim, 0).contiguous()
        full = funcol.all_gather_single_autograd(front, 0, self.group)
        return funcol.wait_tensor(full).movedim(0, self.dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, ranks={dist.get_process_group_ranks(self.group)}"


class ToDTensor(nn.Module):
    """A local tensor -> a DTensor over the tensor axes with the given placements (no communication)."""

    def __init__(self, mesh: DeviceMesh, placements: tuple):
        super().__init__()
        self.mesh, self.placements = mesh, tuple(placements)

    def forward(self, local: torch.Tensor) -> DTensor:
        return DTensor.from_local(local, self.mesh, self.placements, run_check=False)

    def extra_repr(self) -> str:
        return f"placements={self.placements}"


class Redistribute(nn.Module):
    """Move a DTensor to the placements the plan gives its node."""

    def __init__(self, mesh: DeviceMesh, placements: tuple):
        super().__init__()
        self.mesh, self.placements = mesh, tuple(placements)

    def forward(self, value):
        if not isinstance(value, DTensor):   # a tensor made in the graph (arange, ...) is replicated
            value = DTensor.from_local(value, self.mesh, [Replicate()] * self.mesh.ndim, run_check=False)
        return value.redistribute(self.mesh, self.placements)

    def extra_repr(self) -> str:
        return f"placements={self.placements}"


class ToFull(nn.Module):
    """A model output as a full local tensor: the loss function is plain torch."""

    def forward(self, value):
        return value.full_tensor() if isinstance(value, DTensor) else value


def gather_zero3_parameters(gm: fx.GraphModule, plan: Plan, layout: StageLayout) -> fx.GraphModule:
    """All-gather each parameter sharded on the data axes right before its first use."""
    position = {node: index for index, node in enumerate(gm.graph.nodes)}
    for node in _parameter_nodes(gm, layout):
        dim = layout.parameters[node.target].data_dim
        if dim is not None and node.users:
            gather = _insert_after(gm, node, f"gather_{node.name}", GatherShards(dim, layout.dp_group))
            # Parameters are read at the top of an exported graph; the gather moves down to the
            # first use, so a whole model is never gathered at once and a recomputed block
            # gathers its own parameters again in backward, as FSDP does.
            min(gather.users, key=position.__getitem__).prepend(gather)
    gm.recompile()
    return gm


def distribute_tensors(gm: fx.GraphModule, plan: Plan, layout: StageLayout) -> fx.GraphModule:
    """Make parameters and inputs DTensors over the tensor axes, and the outputs full tensors."""
    mesh = layout.tensor_mesh
    if mesh is None:
        return gm
    for node in list(gm.graph.nodes):
        # Export's dtype/device asserts have no DTensor rule; shapes are checked by verify_local_shapes.
        if node.op == "call_function" and node.target == torch.ops.aten._assert_tensor_metadata.default:
            gm.graph.erase_node(node)
    for node in _parameter_nodes(gm, layout):
        value = _last_inserted(node)
        _insert_after(gm, value, f"dtensor_{node.name}", ToDTensor(mesh, layout.parameters[node.target].tensor))
    for node in list(gm.graph.nodes):
        if node.op == "placeholder" and isinstance(node.meta.get("val"), torch.Tensor):
            _insert_after(gm, node, f"dtensor_{node.name}", ToDTensor(mesh, [Replicate()] * mesh.ndim))
    output = next(n for n in gm.graph.nodes if n.op == "output")
    for index, value in enumerate(output.all_input_nodes):
        with gm.graph.inserting_before(output):
            name = f"to_full_{index}"
            gm.add_submodule(name, ToFull())
            full = gm.graph.call_module(name, (value,))
        output.replace_input_with(value, full)
    gm.recompile()
    return gm


def insert_redistributions(gm: fx.GraphModule, plan: Plan, layout: StageLayout) -> fx.GraphModule:
    """Move each node the plan places to that placement on the tensor axes."""
    mesh = layout.tensor_mesh
    if mesh is None:
        return gm
    for node in list(gm.graph.nodes):
        placements = layout.nodes.get(node.name)
        if (node.op not in ("call_function", "placeholder") or placements is None
                or not isinstance(node.meta.get("val"), torch.Tensor)
                # Partial sums are pending reductions: DTensor keeps them without being told.
                or any(isinstance(p, Partial) for p in placements)):
            continue
        # An input is already wrapped as a DTensor: the placement applies to the wrapped value.
        _insert_after(gm, _last_inserted(node), f"place_{node.name}", Redistribute(mesh, placements))
    gm.recompile()
    return gm


def _parameter_nodes(gm: fx.GraphModule, layout: StageLayout) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "get_attr" and n.target in layout.parameters]


def _last_inserted(node: fx.Node) -> fx.Node:
    """The end of the chain of modules already inserted after `node` (a ZeRO-3 gather)."""
    while len(node.users) == 1 and next(iter(node.users)).meta.get("autopar_inserted"):
        node = next(iter(node.users))
    return node


def _insert_after(gm: fx.GraphModule, node: fx.Node, name: str, module: nn.Module) -> fx.Node:
    """Route every use of `node` through `module`."""
    name = name.replace(".", "_")
    gm.add_submodule(name, module)
    with gm.graph.inserting_after(node):
        new = gm.graph.call_module(name, (node,))
    new.meta["autopar_inserted"] = True
    new.meta["val"] = node.meta.get("val")
    new.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
    node.replace_all_uses_with(new, delete_user_cb=lambda user: user is not new)
    return new
