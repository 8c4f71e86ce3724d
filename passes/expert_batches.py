"""Experts batched over their leading dim: the layout in which each expert runs on rows of its own
in one batched matmul, `bmm(rows [E, n, in], weight [E, in, out])`.

HuggingFace's Llama 4 computes its experts so: every token goes to every expert, scaled by a
router score that is zero outside its top-k, and the rows [E x tokens, in] are viewed as
[E, tokens, in]. GShard's and Switch's einsum dispatch does the same on [E, capacity, in] rows
gathered by a one-hot mask. Either way expert e computes on `rows[e]` alone, so expert parallelism
sends `rows[e]` to the rank holding expert e and its output back (an all-to-all on dim 0), as
GShard does; what the model computes does not change, only where.

This module recognizes such a layer's pieces for passes/experts.py:
- `batched_use`: a `bmm` (or an einsum computing the same per expert, `per_expert_rows`) whose
  second operand is an expert weight (a parameter [E, in, out]) and whose first is a value of
  the model [E, n, in];
- `batched_source`: its router, the last top-k (or max) over E scores that the rows derive from;
- `keeps_expert_rows`: whether an op of the body computes each (expert, row) of its inputs from
  that (expert, row) alone (pointwise ops, casts, and splits, slices or softmaxes along a later
  dim), so that it computes the same on the rows a rank receives from other ranks.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from autopar.cost.expert_layers import per_expert_rows

BATCHED_MM = ("aten.bmm.default", "aten.einsum.default")
# ops along one dim (their schema's `dim` argument): per (expert, row) when that dim is >= 2
_ALONG_A_DIM = ("chunk", "split", "split_with_sizes", "slice", "narrow", "cat", "softmax",
                "_softmax", "log_softmax", "_log_softmax")
_COPIES = ("to", "_to_copy", "clone", "contiguous", "alias", "detach")


def batched_use(node: fx.Node, kinds: dict, param: str, value: str) -> fx.Node | None:
    """The expert weight `node` reads when it is `bmm(rows, weight)` with a PARAM weight [E, ...]
    and VALUE rows [E, n, in]; else None."""
    if node.op != "call_function" or str(node.target) not in BATCHED_MM:
        return None
    if str(node.target) == "aten.einsum.default" and (
            not per_expert_rows(node.args[0]) or len(node.args[1]) != 2):
        return None
    rows, weight = _operands(node)
    if kinds.get(weight) != param or kinds.get(rows) != value:
        return None
    rows_value, weight_value = rows.meta.get("val"), weight.meta.get("val")
    if not isinstance(rows_value, torch.Tensor) or not isinstance(weight_value, torch.Tensor):
        return None
    return weight if rows_value.shape[0] == weight_value.shape[0] else None


def batched_rows(node: fx.Node) -> fx.Node:
    """The rows [E, n, in] a batched matmul reads."""
    return _operands(node)[0]


def _operands(node: fx.Node) -> tuple:
    return tuple(node.args[1]) if str(node.target) == "aten.einsum.default" else tuple(node.args[:2])


def batched_source(node: fx.Node, experts: int, is_choice, width) -> fx.Node | None:
    """The router choice (per `is_choice`, among `experts` scores per `width`) that the rows of
    the batched matmul `node` derive from, the last in graph order; None if there is none."""
    order = {n: k for k, n in enumerate(node.graph.nodes)}
    found, stack, seen = None, [batched_rows(node)], set()
    while stack:
        value = stack.pop()
        if value in seen:
            continue
        seen.add(value)
        if is_choice(value) and width(value) == experts:
            if found is None or order[value] > order[found]:
                found = value
        stack.extend(value.all_input_nodes)
    return found


def keeps_expert_rows(node: fx.Node, rows: torch.Tensor) -> bool:
    """Whether `node` computes each (expert, row) of [E, n, ...] values alone (module doc), and
    its result is one such value (or a tuple of them)."""
    target = node.target
    if target is operator.getitem:
        return _leading(node.meta.get("val"), tuple(rows.shape[:2]))
    if not isinstance(target, torch._ops.OpOverload):
        return False
    name = target.overloadpacket.__name__.rstrip("_")
    if torch.Tag.pointwise in target.tags or name in _COPIES:
        fits = True
    elif name in _ALONG_A_DIM:
        fits = _dim(node, target) >= 2
    else:
        fits = False
    return fits and _leading(node.meta.get("val"), tuple(rows.shape[:2]))


def _dim(node: fx.Node, target) -> int:
    """The op's `dim` argument, counted from the front of its input."""
    names = [argument.name for argument in target._schema.arguments]
    if "dim" not in names:
        return -1
    index = names.index("dim")
    dim = node.kwargs.get("dim", node.args[index] if index < len(node.args)
                          else target._schema.arguments[index].default_value)
    first = node.args[0][0] if isinstance(node.args[0], (list, tuple)) else node.args[0]
    ndim = first.meta["val"].dim() if isinstance(first, fx.Node) else 0
    return dim % ndim if ndim else -1


def _leading(value, leading: tuple) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_leading(item, leading) for item in value)
    return isinstance(value, torch.Tensor) and tuple(value.shape[:2]) == leading
