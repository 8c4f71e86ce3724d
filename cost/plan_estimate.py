"""A Plan priced from its own stages and placements: the estimate a Plan records as `predicted`.

`estimate_plan(graph, plan)` turns each of the plan's stages into the estimator's chunk
(`StageSpec`): the node ranges of the modules it lists, its tensor and data parallelism,
recompute, ZeRO and sequence parallelism, and the plan's per-op placements on its tensor-parallel
axis, so that each op is priced at its own shard and each change of placement along the graph's
edges with its collective (cost/layout.py, by the sharding ILP's facts in cost/reshard.py); the
plan's micro-batch size, schedule and virtual chunks complete the call to `estimate_stages`, whose
pipeline, data-parallel, ZeRO and overlap pricing is the one every configuration gets. The planner
records exactly this estimate, so that a saved plan priced again (`autopar estimate --plan
plan.json`) gives the figures it records. (The pipeline search prices its candidates before their
placements are solved, with Megatron's layout for their tensor-parallel degree; a plan without a
tensor-parallel axis is priced the same either way.)
"""

from __future__ import annotations

from autopar.cost.estimator import Estimate, estimate_stages
from autopar.cost.layout import TensorPlacements
from autopar.cost.mesh import Mesh
from autopar.cost.stages import StageSpec
from autopar.errors import PlanMismatchError
from autopar.graph import Graph, Role
from autopar.plans.vocabulary import AxisRole


def estimate_plan(graph: Graph, plan, *, cache: dict | None = None, runtime: str = "autopar",
                  attention: str = "flash", calibration=None, efficiencies=None) -> Estimate:
    """Price `plan` (an autopar.plans.Plan) on `graph`, the graph it was made for; `cache`,
    `runtime`, `attention`, `calibration` and `efficiencies` as for `estimate_stages`."""
    if plan.fingerprint != graph.fingerprint():
        raise PlanMismatchError("the plan was made for another graph (fingerprints differ); "
                                "capture the model the plan was made for, or plan this one")
    ranges = plan_stage_ranges(graph, [stage.layers for stage in plan.stages])
    placements = tensor_placements(graph, plan)
    specs = [StageSpec(layers=ranges[stage.index], tp=stage.tp, dp=stage.dp, recompute=stage.recompute,
                       zero=stage.zero, sequence_parallel=stage.sequence_parallel,
                       placements=placements)
             for stage in plan.stages]
    return estimate_stages(graph, Mesh.from_dict(plan.mesh), specs, global_batch=plan.global_batch,
                           micro_batch=plan.micro_batch_size, schedule=plan.schedule,
                           virtual=plan.virtual, cache=cache, runtime=runtime,
                           attention=attention, calibration=calibration, precision=plan.precision,
                           efficiencies=efficiencies)


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


def plan_stage_ranges(graph: Graph, stage_layers: list[list[str]]) -> list[list[tuple[int, int]]]:
    """Each stage's node ranges. A module listed by several stages (T5's stack dropout, called
    after the embedding and again after the last block) has its ops split among them: each op
    goes to the last of those stages whose own modules start at or before it, as the pipeline
    split assigns them."""
    listed: dict[str, list[int]] = {}
    for index, layers in enumerate(stage_layers):
        for layer in layers:
            listed.setdefault(layer, []).append(index)
    owned = [_module_indices(graph, [l for l in layers if len(listed[l]) == 1])
             for layers in stage_layers]
    starts = [min(indices) if indices else None for indices in owned]
    for layer, stages in listed.items():
        if len(stages) < 2:
            continue
        for i in _module_indices(graph, [layer]):
            before = [s for s in stages if starts[s] is not None and starts[s] <= i]
            owned[before[-1] if before else stages[0]].append(i)
    for index, indices in enumerate(owned):
        if not indices:
            raise PlanMismatchError(f"plan stage {index} lists modules {stage_layers[index][:4]} that "
                                    f"run no op of the graph; plan this model again")
    return [_contiguous(sorted(indices)) for indices in owned]


def _module_indices(graph: Graph, layers: list[str]) -> list[int]:
    prefixes = tuple(layer + "." for layer in layers)
    wanted = set(layers)
    return [i for i, node in enumerate(graph.nodes)
            if node.role is Role.ACTIVATION and node.module_path
            and (node.module_path in wanted or node.module_path.startswith(prefixes))]


def _contiguous(indices: list[int]) -> list[tuple[int, int]]:
    ranges, start = [], indices[0]
    for previous, current in zip(indices, indices[1:] + [None]):
        if current != previous + 1:
            ranges.append((start, previous + 1))
            start = current
    return ranges
