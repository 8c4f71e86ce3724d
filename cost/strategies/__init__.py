"""Sharding strategies: for each ATen op, how its inputs and output may be placed on one mesh axis.

    from autopar.cost.strategies import OpView, axis_strategies, combine
    axis_strategies(OpView(target="aten.mm.default", args=(None, None),
                           input_shapes=((64, 32), (32, 16)), output_shape=(64, 16)))
    # [R,R->R, S(0),R->S(0), R,S(1)->S(1), S(1),S(0)->P]

Rules live by op family in `matmul` (einsum family, attention, embedding), `pointwise`
(element-wise, norms, softmax, reductions, losses, dropout) and `shape` (views, transposes,
split/cat, getitem); importing this package registers all of them in `RULES`.
"""

from autopar.cost.strategies import matmul, pointwise, shape  # noqa: F401  (registers the rules)
from autopar.cost.strategies.placements import (P, R, S, is_shard, parse_placement,
                                                placement_str)
from autopar.cost.strategies.registry import (RULES, OpStrategy, OpView, axis_strategies, combine,
                                              out_of_place, rule)

__all__ = ["P", "R", "S", "RULES", "OpStrategy", "OpView", "axis_strategies", "combine",
           "is_shard", "out_of_place", "parse_placement", "placement_str", "rule"]
