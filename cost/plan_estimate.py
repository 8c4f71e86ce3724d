"""A Plan priced from its own stages: the estimate a Plan records as `predicted`.

`estimate_plan(graph, plan)` turns each of the plan's stages into the estimator's chunk
(`StageSpec`): the node ranges of the modules it lists, its tensor and data parallelism,
recompute, ZeRO and sequence parallelism; the plan's micro-batch size, schedule and virtual
chunks complete the call to `estimate_stages`, the same call the pipeline planner prices its
candidates with. The planner records exactly this estimate, so that a saved plan priced again
(`autopar estimate --plan plan.json`) gives the figures it was chosen by.
"""

from __future__ import annotations

from autopar.cost.estimator import Estimate, estimate_stages
from autopar.cost.mesh import Mesh
from autopar.cost.stages import StageSpec
from autopar.errors import PlanMismatchError
from autopar.graph import Graph, Role


def estimate_plan(graph: Graph, plan, *, cache: dict | None = None, runtime: str = "autopar",
                  attention: str = "flash", calibration=None) -> Estimate:
    """Price `plan` (an autopar.plans.Plan) on `graph`, the graph it was made for; `cache`,
    `runtime`, `attention` and `calibration` as for `estimate_stages`."""
    if plan.fingerprint != graph.fingerprint():
        raise PlanMismatchError("the plan was made for another graph (fingerprints differ); "
                                "capture the model the plan was made for, or plan this one")
    specs = [StageSpec(layers=stage_ranges(graph, stage.layers, stage.index), tp=stage.tp,
                       dp=stage.dp, recompute=stage.recompute, zero=stage.zero,
                       sequence_parallel=stage.sequence_parallel)
             for stage in plan.stages]
    return estimate_stages(graph, Mesh.from_dict(plan.mesh), specs, global_batch=plan.global_batch,
                           micro_batch=plan.micro_batch_size, schedule=plan.schedule,
                           virtual=plan.virtual, cache=cache, runtime=runtime,
                           attention=attention, calibration=calibration, precision=plan.precision)


def stage_ranges(graph: Graph, layers: list[str], index: int) -> list[tuple[int, int]]:
    """The contiguous node ranges of the ops of modules `layers` (a path and everything under
    it). Ops at the top level of the model (residual adds between blocks, the loss) belong to
    no listed module: the estimator gives them to the chunk of the ops before them, as the
    pipeline split does."""
    prefixes = tuple(layer + "." for layer in layers)
    wanted = set(layers)
    indices = [i for i, node in enumerate(graph.nodes)
               if node.role is Role.ACTIVATION and node.module_path
               and (node.module_path in wanted or node.module_path.startswith(prefixes))]
    if not indices:
        raise PlanMismatchError(f"plan stage {index} lists modules {layers[:4]} that run no op of "
                                f"the graph; plan this model again")
    ranges, start = [], indices[0]
    for previous, current in zip(indices, indices[1:] + [None]):
        if current != previous + 1:
            ranges.append((start, previous + 1))
            start = current
    return ranges
