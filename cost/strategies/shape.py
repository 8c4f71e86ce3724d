"""Ops that move data without arithmetic: views and reshapes, transposes, split and cat, indexing."""

from __future__ import annotations

import math

from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.cost.strategies.registry import OpStrategy, OpView, rule

VIEWS = ("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default",
         "aten.flatten.using_ints", "aten.unflatten.int", "aten.unsqueeze.default",
         "aten.squeeze.dim", "aten.squeeze.dims", "aten.squeeze.default")


@rule(*VIEWS)
def view_like(view: OpView) -> list[OpStrategy]:
    """A sharded input dim stays sharded through a reshape when some output dim starts at the same
    place in the flat layout (equal product of the dims before it): then every rank's block of
    elements is the same before and after. Merging [b, s] keeps b; splitting h into [heads,
    head_dim] keeps heads. Sums pass through unchanged."""
    in_shape, out_shape = view.input_shapes[0], view.output_shape
    out_starts = {}
    for e, size in enumerate(out_shape):
        if size > 1:
            out_starts.setdefault(math.prod(out_shape[:e]), e)
    found = []
    for d, size in enumerate(in_shape):
        e = out_starts.get(math.prod(in_shape[:d]))
        if size > 1 and e is not None:
            found.append(OpStrategy(Shard(e), (Shard(d),)))
    found.append(OpStrategy(Partial(), (Partial(),)))
    return found


@rule("aten.expand.default")
def expand(view: OpView) -> list[OpStrategy]:
    in_shape, out_shape = view.input_shapes[0], view.output_shape
    offset = len(out_shape) - len(in_shape)
    found = [OpStrategy(Shard(d + offset), (Shard(d),))
             for d, size in enumerate(in_shape) if size > 1 and size == out_shape[d + offset]]
    found.append(OpStrategy(Partial(), (Partial(),)))
    return found


def permuted(order: list[int]) -> list[OpStrategy]:
    """Output dim i is input dim order[i]."""
    found = [OpStrategy(Shard(i), (Shard(d),)) for i, d in enumerate(order)]
    found.append(OpStrategy(Partial(), (Partial(),)))
    return found


def _swapped(rank: int, a: int, b: int) -> list[int]:
    order = list(range(rank))
    order[a % rank], order[b % rank] = order[b % rank], order[a % rank]
    return order


@rule("aten.transpose.int", "aten.swapaxes.default", "aten.swapdims.default")
def transpose(view: OpView) -> list[OpStrategy]:
    return permuted(_swapped(len(view.input_shapes[0]), view.arg(1), view.arg(2)))


@rule("aten.t.default", "aten.numpy_T.default")
def t(view: OpView) -> list[OpStrategy]:
    """All dims reversed (`x.T`; `t` has at most two)."""
    return permuted(list(range(len(view.input_shapes[0])))[::-1])


@rule("aten.mT.default", "aten.mH.default", "aten.adjoint.default")
def matrix_transpose(view: OpView) -> list[OpStrategy]:
    """The last two dims swapped (`x.mT`; the conjugate of real tensors is themselves)."""
    return permuted(_swapped(len(view.input_shapes[0]), -2, -1))


@rule("aten.movedim.int")
def movedim(view: OpView) -> list[OpStrategy]:
    rank = len(view.input_shapes[0])
    source, destination = view.arg(1) % rank, view.arg(2) % rank
    order = [d for d in range(rank) if d != source]
    order.insert(destination, source)
    return permuted(order)


@rule("aten.permute.default")
def permute(view: OpView) -> list[OpStrategy]:
    rank = len(view.input_shapes[0])
    return permuted([d % rank for d in view.arg(1)])


def _dim_arg(view: OpView, index: int, default: int = 0) -> int:
    return view.arg(index, default) % len(view.input_shapes[0])


@rule("aten.split.Tensor", "aten.split_with_sizes.default", "aten.chunk.default",
      "aten.slice.Tensor", "aten.narrow.default")
def split(view: OpView) -> list[OpStrategy]:
    """Pieces along `dim`: any other dim sharded, each piece sharded the same way."""
    cut = _dim_arg(view, 2) if view.target != "aten.narrow.default" else _dim_arg(view, 1)
    if view.target == "aten.slice.Tensor":
        cut = _dim_arg(view, 1)
    found = [OpStrategy(Shard(d), (Shard(d),)) for d in range(len(view.input_shapes[0])) if d != cut]
    found.append(OpStrategy(Partial(), (Partial(),)))
    return found


@rule("aten.select.int", "aten.unbind.int")
def select(view: OpView) -> list[OpStrategy]:
    """Drops `dim`: the dims after it move down by one."""
    cut = _dim_arg(view, 1)
    found = [OpStrategy(Shard(d if d < cut else d - 1), (Shard(d),))
             for d in range(len(view.input_shapes[0])) if d != cut]
    found.append(OpStrategy(Partial(), (Partial(),)))
    return found


@rule("aten.cat.default")
def cat(view: OpView) -> list[OpStrategy]:
    rank = max(len(s) for s in view.input_shapes)
    joined = view.arg(1, 0) % rank
    count = len(view.input_shapes)
    found = [OpStrategy(Shard(d), (Shard(d),) * count) for d in range(rank) if d != joined]
    found.append(OpStrategy(Partial(), (Partial(),) * count))
    return found


@rule("aten.stack.default")
def stack(view: OpView) -> list[OpStrategy]:
    rank = len(view.input_shapes[0])
    new = view.arg(1, 0) % (rank + 1)
    count = len(view.input_shapes)
    found = [OpStrategy(Shard(d if d < new else d + 1), (Shard(d),) * count) for d in range(rank)]
    found.append(OpStrategy(Partial(), (Partial(),) * count))
    return found


@rule("getitem", "operator.getitem", "_operator.getitem")
def getitem(view: OpView) -> list[OpStrategy]:
    """One output of a multi-output op takes the op's placement (it has one for all outputs)."""
    found = [OpStrategy(Shard(d), (Shard(d),)) for d, size in enumerate(view.output_shape) if size > 1]
    found.append(OpStrategy(Partial(), (Partial(),)))
    return found


@rule("aten.index.Tensor")
def index(view: OpView) -> list[OpStrategy]:
    """x[i0, i1, ...] with index tensors on x's leading dims (no gaps): a dim of x after them
    stays sharded; or the indices are sharded, x replicated, and the output follows them."""
    x_shape, index_shapes = view.input_shapes[0], view.input_shapes[1:]
    if not index_shapes or len(view.arg(1) or []) != len(index_shapes):
        return []
    taken = len(index_shapes)
    index_rank = len(view.output_shape) - (len(x_shape) - taken)
    found = [OpStrategy(Shard(d - taken + index_rank), (Shard(d),) + (Replicate(),) * taken)
             for d in range(taken, len(x_shape))]
    for d in range(index_rank):
        if all(len(s) == index_rank and s[d] == view.output_shape[d] for s in index_shapes):
            found.append(OpStrategy(Shard(d), (Replicate(),) + (Shard(d),) * taken))
    return found
