"""FSDP2's padding of sharded parameters: a parameter is split on one dim over the ranks that
shard it, and a dim that does not divide by them is padded up to a multiple of them (`FSDPParam`'s
`padded_sharded_param_size`); the padding is gathered, reduced and kept as the parameter is. The
runtime splits a plain grouped weight ([experts, in, out]) on its first dim that divides
(autopar.runtime.data_parallel); matrices and vectors, tensor-parallel DTensors and experts over
their own group are split on their first dim, padded where it does not divide, and priced so:
DeepSeek-V3's router ([256, 7168]) over 1024 data-parallel ranks is gathered as [1024, 7168],
and its MLA down-projections ([1536, 7168], [576, 7168]) as [2048, ...] and [1024, ...] (4.4% of
its rank's ZeRO-3 bytes).
"""

from __future__ import annotations

import math

from autopar.cost.layout import GraphLayout
from autopar.graph import Graph


def padding_elements(graph: Graph, layout: GraphLayout, names, shards: int,
                     tensor_split: dict[str, str] | None = None, dim: int = 0) -> float:
    """Elements FSDP2 adds to the parameters `names` (as one rank holds them in `layout`) by
    padding their dim `dim` to a multiple of `shards`. `tensor_split`: the parameters' tensor-
    parallel placements ("S(1)" leaves the first dim whole); without them (no tensor
    parallelism) a grouped weight is split on the first dim that divides, as the runtime places
    it (autopar.runtime.data_parallel), and padded only where none does. Experts split over ep ranks are
    sharded on each expert's rows (dim 1) where their count does not divide by the ranks
    (autopar.runtime.data_parallel), and nothing else splits that dim."""
    if shards <= 1:
        return 0.0
    by_name = {n.name: n for n in graph.nodes}
    extra = 0.0
    for name in names:
        local = layout.param_local.get(name, 0.0)
        shape = by_name[name].shape
        if not local or not shape:
            continue
        whole = math.prod(shape)
        split_elsewhere = (tensor_split or {}).get(name, "R") not in ("R", "S(0)")
        if dim:
            rows = shape[dim]
        elif tensor_split is None and len(shape) >= 3:   # a grouped weight: on a dim that divides
            if any(size % shards == 0 for size in shape):
                continue
            rows = shape[0] * local / whole
        else:
            rows = shape[0] if split_elsewhere else shape[0] * local / whole
        extra += (math.ceil(rows / shards) * shards - rows) * local / rows
    return extra
