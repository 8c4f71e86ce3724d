"""Rewrite passes: pure functions (GraphModule, Plan, StageLayout) -> GraphModule.

`PASSES` is the one order in which they run on a stage's exported graph:
1. shard_parameters first: every later pass sees this rank's local shards;
2. gather_zero3_parameters before distribute_tensors: the data-axis all-gather rebuilds the
   tensor-axis shard, which is what distribute_tensors then wraps as a DTensor;
3. distribute_tensors before insert_redistributions: only DTensors can be redistributed;
4. verify_local_shapes after every inserted op, so that it checks what will actually run;
5. wrap_recompute last: it splits the flat graph into checkpointed submodules, and every pass
   above expects the flat graph.
"""

from autopar.passes.collectives import distribute_tensors, gather_zero3_parameters, insert_redistributions
from autopar.passes.recompute import wrap_recompute
from autopar.passes.shard import shard_parameters
from autopar.passes.verify import verify_local_shapes

PASSES = (
    shard_parameters,
    gather_zero3_parameters,
    distribute_tensors,
    insert_redistributions,
    verify_local_shapes,
    wrap_recompute,
)


def apply_passes(gm, plan, layout):
    """Run `PASSES` in order."""
    for rewrite in PASSES:
        gm = rewrite(gm, plan, layout)
    return gm


__all__ = ["PASSES", "apply_passes", *(p.__name__ for p in PASSES)]
