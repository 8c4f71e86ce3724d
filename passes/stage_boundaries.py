"""Values that cross pipeline stages travel as 1/tp chunks (Megatron-LM's scatter/gather).

Without it every tensor-parallel rank of a stage sends the whole of each value to its peer of
the next stage: tp times the bytes over the links between stages (InfiniBand, where stages
cross nodes), and, where sequence parallelism splits the value, a gather before the send. With
it each rank sends its chunk and the receiving stage rebuilds the placement the plan gives the
value: nothing to gather where that is the chunk (a sequence-split residual stream), one
all-gather over the tensor-parallel ranks where it is whole. Gradients travel back the same way.

The chunk's dim is a function of the value's shape alone (`boundary_dim`), so sender and
receiver agree without telling each other: the sequence (dim 1 of [batch, tokens, ...]) where
the tensor-parallel ranks divide it, else the first dim they divide. Only floating values are
split; ids and masks are small and cross whole. The model's own inputs (stage 0's) and outputs
(the last stage's) are whole. The meta tensors the pipeline allocates its receive buffers by
(`StageProgram.example_inputs` / `example_outputs`) become the chunks' shapes.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate

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
    inputs = tuple(None if first else boundary_dim(x, tp) for x in program.example_inputs)
    outputs = tuple(None if last else boundary_dim(x, tp) for x in program.example_outputs)
    stage = program.module
    if not isinstance(stage, TensorParallelStage):   # a stage the plan does not shard
        stage = program.module = TensorParallelStage(stage, target.tp_mesh, dtensors=False)
    stage.inputs, stage.outputs = inputs, outputs
    stage.input_placements = _placements(program.input_values, plan.nodes, target.tp_axis)
    program.example_inputs = tuple(_chunk(x, dim, tp) for x, dim in zip(program.example_inputs, inputs))
    program.example_outputs = tuple(_chunk(x, dim, tp)
                                    for x, dim in zip(program.example_outputs, outputs))
    return program


def boundary_dim(value: torch.Tensor, tp: int) -> int | None:
    """The dim a crossing value is split on over `tp` ranks; None: it crosses whole."""
    if not value.is_floating_point() or value.dim() < 2:
        return None
    for dim in (1, *range(2, value.dim()), 0):
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
