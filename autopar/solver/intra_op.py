"""`solve_intra_op`: the per-op sharding of one graph on one (sub-)mesh, from the ILP.

    solution = solve_intra_op(graph, Mesh.parse("2x4:a100-80g"), roles={"node": "dp"})
    solution.parameter_placements["layers.0.mlp.fc1.weight"]   # ["R", "S(0)"]

Build the `Problem` (autopar.solver.build), solve it (autopar.solver.ilp), read the placements
back. When no assignment fits the memory budget, a second solve finds the least memory any
assignment needs, and `InfeasibleError` reports it with the largest contributors.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

from autopar.cost.mesh import Mesh
from autopar.errors import AutoparError, InfeasibleError, format_bytes
from autopar.graph import Graph
from autopar.solver.build import build_problem
from autopar.solver.ilp import Assignment, solve
from autopar.solver.op_prices import OpPricer
from autopar.solver.problem import Problem


@dataclass(kw_only=True, slots=True)
class IntraOpSolution:
    axes: list[list]                                  # [[name, size], ...] outer to inner
    node_placements: dict[str, list[str]]             # node -> output placement per axis
    node_input_placements: dict[str, list[list[str]]]  # node -> each tensor input's placement per axis
    parameter_placements: dict[str, list[str]]        # fqn -> storage placement per axis
    gradient_placements: dict[str, list[str]]         # fqn -> gradient/optimizer state placement
    parameter_use_placements: dict[str, list[str]]    # fqn -> placement its (first) consumer reads
    objective_s: float                                # predicted forward + backward + communication
    peak_memory_bytes: float
    status: str
    gap: float
    seconds: float
    variables: int
    constraints: int
    replicated_ops: list[str] = field(default_factory=list)   # targets with no sharding rule
    problem: Problem | None = field(default=None, repr=False)

    def zero_stage(self, axis: str) -> int:
        """The ZeRO stage the parameters show on `axis`: 3 when one is stored sharded there but
        used gathered, 2 when only its gradient and optimizer state are sharded, else 0."""
        index = [name for name, _ in self.axes].index(axis)
        stage = 0
        for fqn, storage in self.parameter_placements.items():
            used = self.parameter_use_placements.get(fqn, storage)[index]
            if storage[index].startswith("S") and used == "R":
                stage = 3
            elif self.gradient_placements[fqn][index] != storage[index]:
                stage = max(stage, 2)
        return stage


def solve_intra_op(graph: Graph, mesh: Mesh, *, memory_limit: float | None = None,
                   roles: Mapping[str, str] | None = None, time_limit: float = 10.0,
                   backend: str = "highs", tie_blocks: bool = True,
                   efficiencies=None, sequence_parallel: bool | None = None) -> IntraOpSolution:
    """Choose every op's placement on every axis of `mesh`, fastest within `memory_limit` bytes
    per device (None: the device's memory). `roles` pins what an axis may do (`AxisRole` values:
    {"node": "dp", "gpu": "tp"}). `efficiencies` (a calibration's) price the ops' compute; the
    mesh's links price their communication. `sequence_parallel` forces the residual stream entering each norm
    split on the sequence (True) or whole (False) on a tensor axis (`build_problem`). Raises
    InfeasibleError when nothing fits."""
    limit = mesh.device.memory_bytes if memory_limit is None else memory_limit
    problem = build_problem(graph, mesh, memory_limit=limit, roles=roles, tie_blocks=tie_blocks,
                            pricer=OpPricer(mesh, efficiencies), sequence_parallel=sequence_parallel)
    found = solve(problem, time_limit=time_limit, backend=backend)
    if found.status == "infeasible":
        raise _infeasible(problem, mesh, limit, time_limit, backend)
    if found.status not in ("optimal", "feasible"):
        raise AutoparError(f"the sharding solver stopped with status {found.status!r} after "
                           f"{found.seconds:.1f} s without a solution; raise time_limit "
                           f"(now {time_limit} s) or try backend='cp-sat'")
    return read_solution(graph, problem, found)


def read_solution(graph: Graph, problem: Problem, found: Assignment) -> IntraOpSolution:
    params = {n.name: n.param_fqn for n in graph.nodes if n.param_fqn}
    nodes, inputs, storage, grads = {}, {}, {}, {}
    for node in problem.nodes:
        strategy = node.strategies[found.choice[node.name]]
        if node.kind == "parameter":
            storage[params[node.name]] = list(strategy.output)
            grads[params[node.name]] = list(strategy.gradient or strategy.output)
        else:
            nodes[node.name] = list(strategy.output)
            inputs[node.name] = [list(p) for p in strategy.inputs]
    used = {}
    for node in graph.nodes:
        for k, name in enumerate(node.inputs):
            if name in params and node.name in inputs:
                used.setdefault(params[name], inputs[node.name][k])
    replicated = sorted({graph.node(n.name).target for n in problem.nodes if n.kind == "replicated"})
    return IntraOpSolution(axes=problem.axes, node_placements=nodes, node_input_placements=inputs,
                           parameter_placements=storage, gradient_placements=grads,
                           parameter_use_placements=used,
                           objective_s=found.objective_s, peak_memory_bytes=found.memory_bytes,
                           status=found.status, gap=found.gap, seconds=found.seconds,
                           variables=found.variables, constraints=found.constraints,
                           replicated_ops=replicated, problem=problem)


def _infeasible(problem: Problem, mesh: Mesh, limit: float, time_limit: float,
                backend: str) -> InfeasibleError:
    least = solve(problem, time_limit=time_limit, backend=backend, minimize="memory")
    if least.status not in ("optimal", "feasible"):
        return InfeasibleError(f"no sharding of this graph on mesh {mesh} is consistent (solver "
                               f"status {least.status!r}): an op's rule admits no placement")
    rep = problem.representative()
    by_group: dict[str, list] = defaultdict(lambda: [0.0, 0, ""])
    for node in problem.nodes:
        group = by_group[rep[node.name]]
        group[0] += node.strategies[least.choice[node.name]].memory_bytes
        group[1] += 1
        group[2] = group[2] or node.label
    largest = sorted(by_group.values(), key=lambda g: -g[0])[:5]
    listed = "; ".join(f"{label}{f' (x{count})' if count > 1 else ''}: {_size(nbytes)}"
                       for nbytes, count, label in largest)
    return InfeasibleError(
        f"no sharding fits {_size(limit)} per device on mesh {mesh}: the least any assignment "
        f"needs is {_size(least.memory_bytes)}. Largest contributors: {listed}. Use more devices "
        f"or pipeline stages, a smaller micro-batch, or recompute activations")


def _size(nbytes: float) -> str:
    return format_bytes(nbytes)
