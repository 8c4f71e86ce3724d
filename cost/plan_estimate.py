"""A Plan priced from its own stages and placements: the estimate a Plan records as `predicted`.

`estimate_plan(graph, plan)` turns each of the plan's stages into the estimator's chunk
(`StageSpec`): the modules it lists (which take their nodes as the runtime's split gives them,
cost/stages.py), its tensor, data, expert and context parallelism, recompute, ZeRO, offload and
sequence parallelism, and the plan's per-op placements on its tensor-parallel
axis, so that each op is priced at its own shard and each change of placement along the graph's
edges with its collective (cost/layout.py, by the sharding ILP's facts in cost/reshard.py); the
plan's micro-batch size, schedule and virtual chunks complete the call to `estimate_stages`, whose
pipeline, data-parallel, ZeRO and overlap pricing is the one every configuration gets. The planner
records exactly this estimate, so that a saved plan priced again (`autopar estimate --plan
plan.json`) gives the figures it records.
"""

from __future__ import annotations

from autopar.cost.estimator import Estimate, estimate_stages
from autopar.cost.layout import TensorPlacements
from autopar.cost.mesh import Mesh
from autopar.cost.stages import StageSpec
from autopar.errors import PlanMismatchError
from autopar.graph import Graph
from autopar.plans.vocabulary import AxisRole


def estimate_plan(graph: Graph, plan, *, cache: dict | None = None, runtime: str = "autopar",
                  attention: str = "flash", calibration=None, efficiencies=None) -> Estimate:
    """Price `plan` (an autopar.plans.Plan) on `graph`, the graph it was made for; `cache`,
    `runtime`, `attention`, `calibration` and `efficiencies` as for `estimate_stages`."""
    mesh, specs = plan_stages(graph, plan)
    return estimate_stages(graph, mesh, specs, global_batch=plan.global_batch,
                           micro_batch=plan.micro_batch_size, schedule=plan.schedule,
                           virtual=plan.virtual, cache=cache, runtime=runtime,
                           attention=attention, calibration=calibration, precision=plan.precision,
                           efficiencies=efficiencies)


def plan_stages(graph: Graph, plan) -> tuple[Mesh, list[StageSpec]]:
    """The plan's mesh and its stages as the estimator's chunks (module docstring)."""
    if plan.fingerprint != graph.fingerprint():
        raise PlanMismatchError("the plan was made for another graph (fingerprints differ); "
                                "capture the model the plan was made for, or plan this one")
    placements = tensor_placements(graph, plan)
    specs = [StageSpec(layers=list(stage.layers), tp=stage.tp, dp=stage.dp, recompute=stage.recompute,
                       zero=stage.zero, sequence_parallel=stage.sequence_parallel,
                       placements=placements, ep=stage.ep, cp=stage.cp, cp_kind=stage.cp_kind,
                       offload=stage.offload, pipelined=len(plan.stages) > 1)
             for stage in plan.stages]
    return Mesh.from_dict(plan.mesh), specs


def tensor_placements(graph: Graph, plan) -> TensorPlacements | None:
    """The plan's placements on its tensor-parallel axis; None when it has none."""
    axis = plan.axis_index(AxisRole.TENSOR)
    if axis is None or plan.tp == 1:
        return None
    fqns = {node.param_fqn: node.name for node in graph.parameters}
    return TensorPlacements(
        nodes={name: placement[axis] for name, placement in plan.nodes.items()},
        parameters={fqns[fqn]: placement[axis] for fqn, placement in plan.parameters.items()
                    if fqn in fqns})
