"""What one pipeline stage's plan means for this process: mesh, axes, groups and placements.

An axis of the stage's mesh is a *data* axis when the plan shards the model's inputs on their
batch dim (dim 0) there; every other axis is a *tensor* axis. The two kinds run differently:
- on data axes each rank computes its own slice of the batch with ordinary local tensors;
  gradients are averaged by the runtime (bucketed, overlapped with backward) or, for ZeRO,
  reduced into shards. A parameter sharded on a data axis is ZeRO-3/FSDP: stored sharded and
  all-gathered before use.
- on tensor axes values are DTensors over the sub-mesh of those axes, so every op computes on
  global shapes and torch's sharding propagation inserts the collectives between the placements
  the plan fixes.
A plan without node placements (a forced configuration) marks its data axis by name ("dp").
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from autopar.errors import MeshError, PlanMismatchError
from autopar.plan import Plan

DATA_AXIS_NAMES = ("dp", "data")


def parse_placement(text: str) -> Placement:
    """"S(1)" -> Shard(1), "R" -> Replicate(), "P" -> Partial(), as DTensor prints them."""
    if text == "R":
        return Replicate()
    if text == "P":
        return Partial()
    match = re.fullmatch(r"S\((\d+)\)", text)
    if not match:
        raise PlanMismatchError(f"placement {text!r} is not one of 'S(dim)', 'R', 'P'; the plan file "
                                f"is malformed: plan the model again")
    return Shard(int(match.group(1)))


@dataclass(kw_only=True, slots=True)
class ParameterLayout:
    shape: tuple[int, ...]          # unsharded
    tensor: tuple[Placement, ...]   # over the tensor axes, in mesh order
    data_dim: int | None            # dim sharded over the data axes (ZeRO-3), None when replicated


@dataclass(kw_only=True, slots=True)
class StageLayout:
    """The plan of one stage resolved against the running process group."""
    mesh: DeviceMesh                      # the stage's whole mesh, axes named as in Plan.axes
    data_axes: tuple[str, ...]
    tensor_axes: tuple[str, ...]          # only axes of size > 1
    parameters: dict[str, ParameterLayout]
    nodes: dict[str, tuple[Placement, ...]]   # node name -> placements over the tensor axes
    zero: int
    recompute: str
    blocks: tuple[str, ...]               # module paths of repeated blocks: the recompute regions
    micro_batches: int
    micro_batch_size: int

    tensor_mesh: DeviceMesh | None       # sub-mesh of the tensor axes; None without tensor parallelism
    dp_group: dist.ProcessGroup | None    # the data axes flattened into one group
    dp_size: int
    dp_rank: int


def check_world(plan: Plan) -> None:
    """Raise on every rank, before any collective, when the plan's mesh is not the process group."""
    if len(plan.stages) != 1:
        raise PlanMismatchError(f"this plan has {len(plan.stages)} pipeline stages; the single-stage "
                                f"runtime runs one (compile() hands pipelines to the pipeline runtime)")
    size = 1
    for _, axis_size in plan.axes:
        size *= axis_size
    world = dist.get_world_size()
    if size != world:
        raise MeshError(f"the plan's mesh {plan.axes} has {size} devices but the process group has "
                        f"{world} ranks; start {size} processes or plan for a mesh of {world}")


def data_axis_names(plan: Plan, input_names: list[str]) -> tuple[str, ...]:
    """Axes on which the plan shards the model's inputs on the batch dim."""
    names = [name for name, _ in plan.axes]
    placed = [plan.nodes[n] for n in input_names if n in plan.nodes]
    if not placed:
        return tuple(n for n in names if n in DATA_AXIS_NAMES)
    return tuple(name for i, name in enumerate(names) if any(p[i] == "S(0)" for p in placed))


def build_layout(plan: Plan, *, input_names: list[str], param_shapes: dict[str, torch.Size],
                 param_placements: dict[str, list[str] | None], blocks: tuple[str, ...], device_type: str) -> StageLayout:
    """Resolve `plan` for this rank; validates before the device mesh makes its first collective."""
    check_world(plan)
    names = tuple(name for name, _ in plan.axes)
    data = data_axis_names(plan, input_names)
    tensor = tuple(name for name, size in plan.axes if name not in data and size > 1)
    sizes = dict((name, size) for name, size in plan.axes)
    # Tied weights: every name of one parameter is a key (graph nodes may use any of them).
    parameters = {fqn: _parameter_layout(fqn, texts, param_shapes[fqn], names, data, tensor, sizes)
                  for fqn, texts in param_placements.items()}
    index = [names.index(a) for a in tensor]
    nodes = {name: tuple(parse_placement(p[i]) for i in index)
             for name, p in plan.nodes.items() if tensor}
    stage = plan.stages[0]
    mesh = init_device_mesh(device_type, tuple(sizes[n] for n in names), mesh_dim_names=names)
    data_mesh = None
    if data:
        data_mesh = mesh[data] if len(data) == 1 else mesh[data]._flatten()
    return StageLayout(mesh=mesh, data_axes=data, tensor_axes=tensor, parameters=parameters,
                       nodes=nodes, zero=stage.zero, recompute=stage.recompute, blocks=blocks,
                       micro_batches=plan.micro_batches, micro_batch_size=plan.micro_batch_size,
                       tensor_mesh=mesh[tensor] if tensor else None,
                       dp_group=data_mesh.get_group() if data_mesh else None,
                       dp_size=_product(sizes, data), dp_rank=data_mesh.get_local_rank() if data_mesh else 0)


def _parameter_layout(fqn, texts, shape, names, data, tensor, sizes) -> ParameterLayout:
    if texts is None:
        texts = ["R"] * len(names)
    if len(texts) != len(names):
        raise PlanMismatchError(f"parameter {fqn} has {len(texts)} placements for the {len(names)} "
                                f"axes {list(names)}; the plan file is malformed: plan the model again")
    by_axis = dict(zip(names, texts))
    data_dims = {parse_placement(by_axis[a]).dim for a in data if by_axis[a].startswith("S")}
    if len(data_dims) > 1:
        raise PlanMismatchError(f"parameter {fqn} is sharded on different dims over the data axes "
                                f"{list(data)}; the runtime shards it on one dim over all of them")
    placements = tuple(parse_placement(by_axis[a]) for a in tensor)
    if any(isinstance(p, Partial) for p in placements):
        raise PlanMismatchError(f"parameter {fqn} is placed as partial sums; a parameter is "
                                f"sharded or replicated")
    _check_divisible(fqn, shape, [(p.dim, sizes[a]) for a, p in zip(tensor, placements)
                                  if isinstance(p, Shard)] + [(d, _product(sizes, data)) for d in data_dims])
    return ParameterLayout(shape=tuple(shape), tensor=placements, data_dim=next(iter(data_dims), None))


def _check_divisible(fqn, shape, shards) -> None:
    size = list(shape)
    for dim, parts in shards:
        if dim >= len(size) or size[dim] % parts:
            raise PlanMismatchError(f"parameter {fqn} of shape {tuple(shape)} cannot be split in {parts} "
                                    f"equal shards on dim {dim}; plan it replicated on that axis or "
                                    f"choose a mesh that divides it")
        size[dim] //= parts


def _product(sizes: dict, axes) -> int:
    result = 1
    for axis in axes:
        result *= sizes[axis]
    return result
