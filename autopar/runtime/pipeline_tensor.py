"""Tensor parallelism inside a pipeline stage, with DTensor.

The stage's parameters become DTensors over the stage's tensor-parallel sub-mesh with the plan's
placement for the "tp" axis ("S(0)" column-parallel, "S(1)" row-parallel, "R" replicated), so every
op of the stage's graph computes on global shapes and DTensor's sharding propagation inserts the
collectives. Between stages activations travel as ordinary tensors: a stage takes its inputs as
replicated and hands its outputs on replicated, which is what the pipeline's send and receive move.

Values the plan places (`Plan.nodes`, e.g. the residual stream at each norm's input: whole, or
split on the sequence for sequence parallelism) are moved there with the intra-op runtime's
`Redistribute`; partial sums are left to DTensor, which reduces them where they are next read.
"""

from __future__ import annotations

import torch
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor
from torch.utils._pytree import tree_map

import autopar.runtime.dtensor_rules  # noqa: F401  (CPU attention has no DTensor rule in torch)
from autopar.errors import PlanMismatchError
from autopar.passes.collectives import Redistribute
from autopar.cost.strategies.placements import parse_placement
from autopar.runtime.pipeline_split import TensorRef


class TensorParallelStage(nn.Module):
    """Runs `inner` on DTensors over `mesh`; inputs and outputs are replicated plain tensors."""

    def __init__(self, inner: nn.Module, mesh: DeviceMesh):
        super().__init__()
        self.inner = inner
        self.mesh = mesh

    def forward(self, *args):
        inputs = tree_map(self._to_dtensor, args)
        return tree_map(self._to_local, self.inner(*inputs))

    def _to_dtensor(self, value):
        if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            return DTensor.from_local(value, self.mesh, [Replicate()], run_check=False)
        return value

    def _to_local(self, value):
        if isinstance(value, DTensor):
            # a copy, not the local view: FSDP's backward hook on a stage output must not be lost
            # to an in-place op on a view
            return value.redistribute(self.mesh, [Replicate()]).to_local().clone()
        return value


class Replicated(nn.Module):
    """Makes a plain tensor a replicated DTensor on `mesh`."""

    def __init__(self, mesh: DeviceMesh):
        super().__init__()
        self.mesh = mesh

    def forward(self, value: torch.Tensor) -> DTensor:
        if isinstance(value, DTensor):  # created from a DTensor's shape or dtype, already placed
            return value
        return DTensor.from_local(value, self.mesh, [Replicate()], run_check=False)


def drop_metadata_checks(module: nn.Module) -> None:
    """Remove the export's `_assert_tensor_metadata` checks: they compare a value's dtype and
    device with what was traced, which a DTensor cannot be asked (DTensor has no rule for them),
    and they compute nothing."""
    for graph_module in [m for m in module.modules() if isinstance(m, fx.GraphModule)]:
        checks = [node for node in graph_module.graph.nodes
                  if node.target is torch.ops.aten._assert_tensor_metadata.default]
        for node in checks:
            graph_module.graph.erase_node(node)
        if checks:
            graph_module.recompile()


def replicate_created_tensors(module: nn.Module, mesh: DeviceMesh) -> None:
    """Ops that create a tensor from nothing (a position `arange`) give plain tensors, which DTensor
    ops refuse next to DTensors; every such value is made a replicated DTensor where it is created,
    in the graph, so that recomputation in backward does the same."""
    for graph_module in [m for m in module.modules() if isinstance(m, fx.GraphModule)]:
        created = [node for node in graph_module.graph.nodes
                   if node.op == "call_function" and not node.all_input_nodes
                   and isinstance(node.meta.get("val"), torch.Tensor)]
        if not created:
            continue
        graph_module.add_submodule("replicated", Replicated(mesh))
        for node in created:
            with graph_module.graph.inserting_after(node):
                wrapped = graph_module.graph.call_module("replicated", (node,))
            node.replace_all_uses_with(wrapped, delete_user_cb=lambda user: user is not wrapped)
        graph_module.recompile()


def place_nodes(module: nn.Module, mesh: DeviceMesh, nodes: dict[str, list[str]], tp_axis: int) -> None:
    """After each node the plan places on `tp_axis`, move its value to that placement."""
    for graph_module in [m for m in module.modules() if isinstance(m, fx.GraphModule)]:
        for node in list(graph_module.graph.nodes):
            texts = nodes.get(node.name)
            if node.op != "call_function" or texts is None \
                    or not isinstance(node.meta.get("val"), torch.Tensor):
                continue
            placement = parse_placement(texts[tp_axis])
            if isinstance(placement, Partial):
                continue
            name = f"place_{node.name}"
            graph_module.add_submodule(name, Redistribute(mesh, (placement,)))
            with graph_module.graph.inserting_after(node):
                placed = graph_module.graph.call_module(name, (node,))
            node.replace_all_uses_with(placed, delete_user_cb=lambda user: user is not placed)
        graph_module.recompile()


def shard_stage(module: nn.Module, mesh: DeviceMesh, parameters: dict[str, list[str]],
                nodes: dict[str, list[str]], tp_axis: int) -> TensorParallelStage:
    """Distribute the stage's tensors by the plan's placements on axis `tp_axis`; unplaced ones
    (buffers, constants, parameters the plan leaves out) are replicated. Then place the nodes."""
    for ref in module.modules():
        if not isinstance(ref, TensorRef):
            continue
        texts = parameters.get(ref.fqn)
        placement = parse_placement(texts[tp_axis]) if texts else Replicate()
        if not isinstance(placement, Replicate):
            dim = placement.dim
            if dim >= ref.value.dim() or ref.value.shape[dim] % mesh.size():
                raise PlanMismatchError(
                    f"parameter {ref.fqn} of shape {tuple(ref.value.shape)} cannot be split in "
                    f"{mesh.size()} equal shards on dim {dim}; plan it replicated or change tp")
        # a meta tensor (a model too big for one process) is only split, no values move: the
        # local shards get storage and values after the sharding (materialize.py)
        tensor = distribute_tensor(ref.value.detach(), mesh, [placement],
                                   src_data_rank=None if ref.value.is_meta else 0)
        if isinstance(ref.value, nn.Parameter):
            ref.value = nn.Parameter(tensor, requires_grad=ref.value.requires_grad)
        else:
            ref.value = tensor
    drop_metadata_checks(module)
    replicate_created_tensors(module, mesh)
    place_nodes(module, mesh, nodes, tp_axis)
    return TensorParallelStage(module, mesh)
