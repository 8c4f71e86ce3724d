"""The table `ATen op -> sharding rule`, and the expansion of one-axis rules to N-D meshes.

A rule sees one op (`OpView`: target, non-tensor args, the shapes of its tensor inputs and of its
output) and lists what is valid on ONE mesh axis: `OpStrategy(output, inputs)`, a placement for the
output and one per tensor input, in `Node.inputs` order. A multi-output op (split,
native_layer_norm) has one placement for all of its outputs. Rules are registered per op family
with `@rule("aten.mm.default", ...)`. On an N-D mesh each axis picks one of the op's one-axis
strategies independently (as DTensor does); `combine` keeps the combinations whose sharded dims
divide evenly.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from torch.distributed.tensor import Placement, Replicate, Shard

Shape = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class OpView:
    target: str                         # "aten.mm.default"
    args: tuple[Any, ...]               # non-tensor arguments; tensors appear as None
    input_shapes: tuple[Shape, ...]     # of the tensor inputs, in Node.inputs order
    output_shape: Shape                 # () for a scalar or a multi-output op

    def arg(self, index: int, default: Any = None) -> Any:
        return self.args[index] if index < len(self.args) else default


class OpStrategy(NamedTuple):
    output: Placement
    inputs: tuple[Placement, ...]


Rule = Callable[[OpView], list[OpStrategy]]
RULES: dict[str, Rule] = {}


def rule(*targets: str) -> Callable[[Rule], Rule]:
    """Register `fn` as the rule of every op in `targets` (ATen overload names)."""
    def register(fn: Rule) -> Rule:
        for target in targets:
            RULES[target] = fn
        return fn
    return register


def replicated(view: OpView) -> OpStrategy:
    return OpStrategy(Replicate(), tuple(Replicate() for _ in view.input_shapes))


def axis_strategies(view: OpView) -> list[OpStrategy] | None:
    """The op's valid strategies on one mesh axis, replicate-everything first; None when no rule
    knows the op (the caller runs it replicated and reports it)."""
    in_place = out_of_place(view.target) != view.target
    fn = RULES.get(view.target) or RULES.get(out_of_place(view.target))
    if fn is None:
        return None
    found = [replicated(view)]
    for strategy in fn(view):
        if len(strategy.inputs) != len(view.input_shapes):
            return None     # a call form the rule does not know (extra tensor arguments)
        # an op that writes its first input keeps it where it is: DTensor cannot move it first
        if strategy not in found and not (in_place and strategy.output != strategy.inputs[0]):
            found.append(strategy)
    return found


def out_of_place(target: str) -> str:
    """The out-of-place form of an in-place ATen op ("aten.add_.Tensor" -> "aten.add.Tensor");
    the target itself for any other op."""
    parts = target.split(".")
    if len(parts) == 3 and parts[0] == "aten" and parts[1].endswith("_") \
            and not parts[1].endswith("__") and not parts[1].startswith("_"):
        return ".".join((parts[0], parts[1][:-1], parts[2]))
    return target


def combine(per_axis: Sequence[Sequence[OpStrategy]], axis_sizes: Sequence[int],
            output_shape: Shape, input_shapes: Sequence[Shape]) -> list[tuple[OpStrategy, ...]]:
    """Every choice of one strategy per axis whose sharded dims divide evenly on every tensor."""
    chosen = []
    for combo in itertools.product(*per_axis):
        if not _divides(output_shape, [s.output for s in combo], axis_sizes):
            continue
        if all(_divides(shape, [s.inputs[k] for s in combo], axis_sizes)
               for k, shape in enumerate(input_shapes)):
            chosen.append(combo)
    return chosen


def _divides(shape: Shape, placements: Sequence[Placement], axis_sizes: Sequence[int]) -> bool:
    if not shape:
        return True
    split = [1] * len(shape)
    for placement, size in zip(placements, axis_sizes):
        if isinstance(placement, Shard):
            if placement.dim >= len(shape):
                return False
            split[placement.dim] *= size
    return all(dim % parts == 0 for dim, parts in zip(shape, split))
