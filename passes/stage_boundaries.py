"""Values that cross pipeline stages travel as 1/tp chunks (Megatron-LM's scatter/gather).

Without it every tensor-parallel rank of a stage sends the whole of each value to its peer of
the next stage: tp times the bytes over the links between stages (InfiniBand, where stages
cross nodes), and, where sequence parallelism splits the value, a gather before the send. With
it each rank sends its chunk and the receiving stage rebuilds the placement the plan gives the
value: nothing to gather where that is the chunk (a sequence-split residual stream), one
all-gather over the tensor-parallel ranks where it is whole. Gradients travel back the same way.

The chunk's dim is a function of the value's shape and of the placement the plan gives it
(`boundary_dim`), so sender and receiver agree without telling each other: the dim the plan
splits it on, so that neither moves anything (a hidden-split residual stream sent as sequence
chunks took an all-to-all on each side, each way); for a whole value the sequence (dim 1 of
[batch, tokens, ...]) where the tensor-parallel ranks divide it, else the first dim they
divide. A stage's outputs are the next stage's inputs, in order. Only floating values are
split; ids and masks are small and cross whole. The model's own inputs (stage 0's) and outputs
(the last stage's) are whole. The meta tensors the pipeline allocates its receive buffers by
(`StageProgram.example_inputs` / `example_outputs`) become the chunks' shapes.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.cost.strategies import parse_placement
from autopar.passes.program import PassTarget, StageProgram
from autopar.passes.tensor_parallel import TensorParallelStage


def split_stage_boundaries(program: StageProgram, plan, target: PassTarget) -> StageProgram:
    """The stage's sends and receives as 1/tp chunks, where it has tensor-parallel ranks and
    neighbours in the pipeline."""
    stages = len(plan.stages)
    if target.tp_mesh is None or stages == 1:
        return program
    tp = target.tp_mesh.size()
    first, last = program.index == 0, program.index == stages - 1
    placed = _placements(program.input_values, plan.nodes, target.tp_axis)
    inputs = (None,) * len(program.example_inputs) if first else tuple(
        boundary_dim(x, tp, placement) for x, placement in zip(program.example_inputs, placed, strict=True))
    outputs = (None,) * len(program.example_outputs) if last else tuple(
        boundary_dim(x, tp, placement) for x, placement in zip(
            program.example_outputs, _placements(program.output_values, plan.nodes, target.tp_axis),
            strict=True))
    stage = program.module
    if not isinstance(stage, TensorParallelStage):   # a stage the plan does not shard
        stage = program.module = TensorParallelStage(stage, target.tp_mesh, dtensors=False)
    stage.inputs, stage.outputs, stage.input_placements = inputs, outputs, placed
    program.example_inputs = tuple(_chunk(x, dim, tp) for x, dim in zip(program.example_inputs, inputs))
    program.example_outputs = tuple(_chunk(x, dim, tp)
                                    for x, dim in zip(program.example_outputs, outputs))
    return program


def boundary_dim(value: torch.Tensor, tp: int, placement=Replicate()) -> int | None:
    """The dim a crossing value is split on over `tp` ranks, the plan placing it `placement`;
    None: it crosses whole."""
    if not value.is_floating_point() or value.dim() < 2:
        return None
    planned = (placement.dim,) if isinstance(placement, Shard) and placement.dim < value.dim() else ()
    for dim in (*planned, 1, *range(2, value.dim()), 0):
        if value.shape[dim] % tp == 0:
            return dim
    return None


def _placements(values: tuple[str, ...], nodes: dict[str, list[str]], tp_axis: int) -> tuple:
    """The placement the plan gives each of the stage's inputs on the tensor-parallel axis
    (replicated where it gives none, or a partial sum, which a received value cannot be)."""
    placements = []
    for name in values:
        texts = nodes.get(name)
        placement = parse_placement(texts[tp_axis]) if texts else Replicate()
        placements.append(Replicate() if isinstance(placement, Partial) else placement)
    return tuple(placements)


def _chunk(value: torch.Tensor, dim: int | None, tp: int) -> torch.Tensor:
    if dim is None:
        return value
    shape = list(value.shape)
    shape[dim] //= tp
    return torch.empty(shape, dtype=value.dtype, device=value.device).requires_grad_(value.requires_grad)
