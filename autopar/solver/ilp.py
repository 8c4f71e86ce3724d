"""The intra-op sharding ILP, solved with OR-Tools (HiGHS by default, CP-SAT selectable).

Ties. Nodes tied to a representative r (`ProblemNode.tie`: the same position in another instance
of a repeated block) share r's variables: 96 identical layers cost one layer's variables. An op
group takes one strategy for all its K copies. A parameter group may differ per copy (ZeRO for
some layers only): its variables count how many of the K copies take each strategy, which is
exact because a parameter copy feeds only the op copy of its own instance.

Variables
    x[r, s] in {0, 1}        op group r takes strategy s
    x[r, s] in {0, ..., K}   parameter group r: copies taking strategy s
    y[e, p, q] in [0, K]     copies of edge e going from producer class p to consumer class q (a
                             class groups the strategies whose resharding costs on e are equal);
                             continuous, since integral x make y integral (integer under CP-SAT)
    exposed >= 0             parameter/gradient traffic left after overlapping the backward

Objective (seconds, scaled to microseconds for the solver)                    `set_objective`
    min  sum_r sum_s cost[r, s] * x[r, s]     compute + own communication (per copy for counted
                                              groups, summed over copies for the others)
       + sum_{e not overlapped} sum_pq C[e, p, q] * y[e, p, q]     resharding, forward + backward
       + exposed
    An edge whose producer or consumer has one class needs no y: its cost is a linear function of
    the other end's x and goes into its coefficients (`add_edges`).

Constraints
    one strategy per node     sum_s x[r, s] = 1 (K for counted groups)          `add_choices`
    edge marginals            sum_q y[e, p, q] = sum_{s in p} x[src, s]          `add_edges`
                              sum_p y[e, p, q] = K_src / K_dst * sum_{s in q} x[dst, s]
                              (a pair (p, q) that is not allowed has no y, which forbids it)
    memory                    sum_r sum_s mem[r, s] * x[r, s] <= budget          `add_memory_limit`
    overlap                   exposed >= sum_{e overlapped} sum_pq C[e, p, q] y[e, p, q]
                                         - sum_r sum_s backward[r, s] x[r, s]    `set_objective`
                              (gradient reduction and ZeRO gathers run behind the backward, as
                              DDP and FSDP do: only what exceeds the backward's compute counts)

Solving (`solve`). With HiGHS the LP relaxation comes first: when its x are integral (the usual
case without a binding memory limit) that is the optimum. Otherwise `_rounded` rounds it, keeping
the memory limit (each op group takes the least-memory strategy the LP mixes; counted groups round
their counts toward the least-memory strategies); within `relative_gap` of the LP bound, that is
the answer. Else x become integers and the MIP runs for half the time left; if it finds nothing,
`_dive` fixes fractional groups one at a time, solving the LP again after each, and the best
rounding met is returned, "feasible" with its gap to the first LP's bound. Every solve has a time
limit and returns the best assignment found with its status and relative gap to the best bound.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass

from ortools.linear_solver import pywraplp

from autopar.errors import AutoparError
from autopar.solver.problem import Problem

BACKENDS = {"highs": "HIGHS", "cp-sat": "CP_SAT"}
TIME_SCALE = 1e6          # seconds -> microseconds: keeps coefficients well above tolerances
MEMORY_SCALE = 1 / 2**30  # bytes -> GiB
RELATIVE_GAP = 1e-2       # "optimal" means within 1% of the best bound; the gap is reported
DIVES = 30                # LP re-solves spent rounding a fractional relaxation
STATUS = {pywraplp.Solver.OPTIMAL: "optimal", pywraplp.Solver.FEASIBLE: "feasible",
          pywraplp.Solver.INFEASIBLE: "infeasible", pywraplp.Solver.UNBOUNDED: "unbounded",
          pywraplp.Solver.ABNORMAL: "abnormal", pywraplp.Solver.NOT_SOLVED: "not solved",
          pywraplp.Solver.MODEL_INVALID: "model invalid"}


@dataclass(kw_only=True, slots=True)
class Assignment:
    choice: dict[str, int]      # every node -> its strategy index
    objective_s: float          # predicted time of the step's forward and backward, seconds
    memory_bytes: float         # per device, by the problem's memory model
    status: str                 # "optimal" (within relative_gap), "feasible" (time limit), "infeasible", ...
    gap: float                  # relative gap between the solution and the best bound
    seconds: float              # wall time of building and solving the model
    variables: int
    constraints: int


def solve(problem: Problem, *, time_limit: float = 10.0, backend: str = "highs",
          minimize: str = "time", memory_limit: float | None = None,
          relative_gap: float = RELATIVE_GAP) -> Assignment:
    """Solve `problem`; `minimize="memory"` finds the least memory any assignment needs (the time
    objective and memory limit are dropped). `memory_limit` overrides the problem's budget."""
    if backend not in BACKENDS:
        raise AutoparError(f"solver backend {backend!r} is unknown; choose one of {list(BACKENDS)}")
    if time_limit <= 0:
        raise AutoparError(f"time_limit={time_limit} must be positive seconds")
    start = time.perf_counter()
    model = _Model(problem, BACKENDS[backend])
    model.add_choices()
    model.add_edges()
    limit = problem.memory_limit if memory_limit is None else memory_limit
    if minimize == "time" and limit is not None:
        model.add_memory_limit(limit)
    model.set_objective(minimize)
    return model.solve(time_limit, start, relative_gap, limit if minimize == "time" else None)


def model_size(problem: Problem, *, memory_limit: float | None = None) -> tuple[int, int]:
    """(variables, constraints) of the model `solve` would build, without solving it."""
    model = _Model(problem, BACKENDS["highs"])
    model.add_choices()
    model.add_edges()
    limit = problem.memory_limit if memory_limit is None else memory_limit
    if limit is not None:
        model.add_memory_limit(limit)
    model.set_objective("time")
    return model.solver.NumVariables(), model.solver.NumConstraints()


class _Model:
    def __init__(self, problem: Problem, backend: str):
        problem.check()
        self.problem = problem
        self.relax_first = backend == "HIGHS"
        self.solver = pywraplp.Solver.CreateSolver(backend)
        if self.solver is None:
            raise AutoparError(f"OR-Tools was built without the {backend} backend; "
                               f"choose another backend")
        self.rep = problem.representative()
        self.nodes = {n.name: n for n in problem.nodes}
        self.copies: dict[str, list[str]] = defaultdict(list)
        for node in problem.nodes:
            self.copies[self.rep[node.name]].append(node.name)
        # counted groups: K copies of a parameter, each free to choose
        self.count = {rep: len(names) if self.nodes[rep].kind == "parameter" else 1
                      for rep, names in self.copies.items()}
        self.x: dict[str, list] = {}
        self.time_coef: dict[str, list[float]] = {}
        self.backward_coef: dict[str, list[float]] = {}
        self.memory_coef: dict[str, list[float]] = {}
        self.edge_terms: list[tuple] = []       # (variable, seconds) paid in full
        self.overlap_terms: list[tuple] = []    # (variable, seconds) that may hide behind the backward
        self.overlapped = any(edge.overlapped for edge in problem.edges)
        self.minimize = "time"

    def _var(self, name: str, upper: int):
        if self.relax_first:
            return self.solver.NumVar(0.0, upper, name)
        return self.solver.IntVar(0, upper, name)

    def _constraint(self, terms, lower: float, upper: float) -> None:
        constraint = self.solver.Constraint(lower, upper)
        total: dict[int, list] = {}
        for var, coef in terms:     # a variable may appear in several terms
            total.setdefault(var.index(), [var, 0.0])[1] += coef
        for var, coef in total.values():
            if coef:
                constraint.SetCoefficient(var, coef)
        return constraint

    def add_choices(self) -> None:
        for rep, names in self.copies.items():
            strategies = self.nodes[rep].strategies
            count = self.count[rep]
            self.x[rep] = [self._var(f"x[{rep},{s}]", count) for s in range(len(strategies))]
            self._constraint([(v, 1.0) for v in self.x[rep]], count, count)
            # coefficients per unit of x: per copy for counted groups, all copies otherwise
            per_unit = 1.0 / count
            for coef, field in ((self.time_coef, "cost_s"), (self.backward_coef, "backward_s"),
                                (self.memory_coef, "memory_bytes")):
                coef[rep] = [per_unit * sum(getattr(self.nodes[n].strategies[s], field) for n in names)
                             for s in range(len(strategies))]

    def add_edges(self) -> None:
        for (src, dst, src_class, dst_class, overlapped), cost in self._merged_edges().items():
            if len(set(src_class)) == 1 or len(set(dst_class)) == 1:
                self._add_linear_edge(src, dst, src_class, dst_class, cost, overlapped)
            else:
                self._add_paired_edge(src, dst, src_class, dst_class, cost, overlapped)

    def _merged_edges(self) -> dict[tuple, list[list[float | None]]]:
        """Edges between the same representatives with the same classes (the copies of one edge
        in each block instance) become one edge with summed costs."""
        groups: dict[tuple, dict[int, list]] = defaultdict(dict)
        for edge in self.problem.edges:
            key = (self.rep[edge.src], self.rep[edge.dst], tuple(edge.src_class),
                   tuple(edge.dst_class), edge.overlapped)
            # copies usually share one cost matrix object: count it rather than add it 96 times
            groups[key].setdefault(id(edge.cost), [edge.cost, 0])[1] += 1
        merged = {}
        for key, matrices in groups.items():
            total = None
            for cost, count in matrices.values():
                scaled = [[None if v is None else v * count for v in row] for row in cost]
                total = scaled if total is None else [
                    [None if a is None or b is None else a + b for a, b in zip(r, s)]
                    for r, s in zip(total, scaled)]
            merged[key] = total
        return merged

    def _add_linear_edge(self, src, dst, src_class, dst_class, cost, overlapped) -> None:
        """One class at either end: the cost is a function of the other end's strategy alone."""
        if len(set(src_class)) == 1:
            row, end, classes = cost[src_class[0]], dst, dst_class
        else:
            row, end, classes = [r[dst_class[0]] for r in cost], src, src_class
        coef = self.backward_coef if overlapped else self.time_coef
        for s, cls in enumerate(classes):
            if row[cls] is None:
                self.x[end][s].SetUb(0)
            elif overlapped:        # stored negated beside the backward compute that hides it
                coef[end][s] -= row[cls] / self.count[end]
            else:
                coef[end][s] += row[cls] / self.count[end]

    def _add_paired_edge(self, src, dst, src_class, dst_class, cost, overlapped) -> None:
        # y counts edge copies: as many as the producer group has copies
        copies = self.count[src]
        members_src, members_dst = defaultdict(list), defaultdict(list)
        for s, cls in enumerate(src_class):
            members_src[cls].append(self.x[src][s])
        for s, cls in enumerate(dst_class):
            members_dst[cls].append(self.x[dst][s])
        rows, cols = defaultdict(list), defaultdict(list)
        terms = self.overlap_terms if overlapped else self.edge_terms
        for p in members_src:
            for q in members_dst:
                if cost[p][q] is None:
                    continue
                y = self._var(f"y[{src},{dst},{p},{q}]", copies)
                rows[p].append(y)
                cols[q].append(y)
                if cost[p][q]:
                    terms.append((y, cost[p][q] / copies))
        for p, xs in members_src.items():
            self._constraint([(y, 1.0) for y in rows[p]] + [(x, -1.0) for x in xs], 0.0, 0.0)
        scale = copies / self.count[dst]
        for q, xs in members_dst.items():
            self._constraint([(y, 1.0) for y in cols[q]] + [(x, -scale) for x in xs], 0.0, 0.0)

    def _all_x(self, coef: dict[str, list[float]], scale: float) -> list[tuple]:
        return [(xs[s], coef[rep][s] * scale) for rep, xs in self.x.items() for s in range(len(xs))]

    def add_memory_limit(self, limit: float) -> None:
        self._constraint(self._all_x(self.memory_coef, MEMORY_SCALE), -self.solver.infinity(),
                         limit * MEMORY_SCALE)

    def set_objective(self, minimize: str) -> None:
        self.minimize = minimize
        if minimize == "memory":
            terms = self._all_x(self.memory_coef, MEMORY_SCALE)
        elif minimize == "time":
            terms = self._all_x(self.time_coef, TIME_SCALE)
            terms += [(y, c * TIME_SCALE) for y, c in self.edge_terms]
            if self.overlapped:
                exposed_s = self.solver.NumVar(0.0, self.solver.infinity(), "exposed")
                exposed = [(v, c) for v, c in self._all_x(self.backward_coef, TIME_SCALE)]
                exposed += [(y, -c * TIME_SCALE) for y, c in self.overlap_terms]
                self._constraint(exposed + [(exposed_s, 1.0)], 0.0, self.solver.infinity())
                terms.append((exposed_s, 1.0))
        else:
            raise AutoparError(f"minimize={minimize!r}: expected 'time' or 'memory'")
        objective = self.solver.Objective()
        total: dict[int, list] = {}
        for var, coef in terms:
            total.setdefault(var.index(), [var, 0.0])[1] += coef
        for var, coef in total.values():
            if coef:
                objective.SetCoefficient(var, coef)
        objective.SetMinimization()

    def solve(self, time_limit: float, start: float, relative_gap: float,
              memory_limit: float | None) -> Assignment:
        self.solver.SetNumThreads(1)
        self.solver.SuppressOutput()
        if self.relax_first:        # HiGHS prints a banner on every solve unless told not to;
            # OR-Tools does not hand it RELATIVE_MIP_GAP, and its own default (1e-4) would stop
            # the MIP short of an optimum closer than that
            self.solver.SetSolverSpecificParametersAsString(
                f"output_flag=false\nmip_rel_gap={relative_gap!r}")
        deadline = start + time_limit
        params = pywraplp.MPSolverParameters()
        params.SetDoubleParam(pywraplp.MPSolverParameters.RELATIVE_MIP_GAP, relative_gap)
        code = self._solve_until(deadline, params)
        counts = dict(variables=self.solver.NumVariables(), constraints=self.solver.NumConstraints(),
                      seconds=0.0)
        if not self.relax_first or code != pywraplp.Solver.OPTIMAL or self._integral():
            return self._read(code, counts, start)
        bound_s = self.solver.Objective().Value() / TIME_SCALE
        # rounding and diving compare times: when minimizing memory the MIP alone decides
        rounded = self._rounded(bound_s, memory_limit) if self.minimize == "time" else None
        if rounded is not None and rounded["gap"] <= relative_gap:
            return Assignment(**rounded, **{**counts, "seconds": time.perf_counter() - start})
        # the MIP, with half the time left; then, if it found nothing, LP diving with the rest
        xs = [v for group in self.x.values() for v in group]
        for var in xs:
            var.SetInteger(True)
        code = self._solve_until(time.perf_counter() + (deadline - time.perf_counter()) / 2, params)
        if STATUS.get(code) in ("optimal", "feasible"):
            return self._read(code, counts, start)
        for var in xs:
            var.SetInteger(False)
        if self.minimize == "time" and self._solve_until(deadline, params) == pywraplp.Solver.OPTIMAL:
            dived = self._dive(bound_s, memory_limit, relative_gap, params, deadline)
            if dived is not None and (rounded is None or dived["objective_s"] < rounded["objective_s"]):
                rounded = dived
        if rounded is None:
            return self._read(code, counts, start)
        status = "optimal" if rounded["gap"] <= relative_gap else "feasible"
        return Assignment(**{**rounded, "status": status},
                          **{**counts, "seconds": time.perf_counter() - start})

    def _solve_until(self, deadline: float, params) -> int:
        self.solver.SetTimeLimit(max(1, int((deadline - time.perf_counter()) * 1000)))
        return self.solver.Solve(params)

    def _read(self, code: int, counts: dict, start: float) -> Assignment:
        counts = {**counts, "seconds": time.perf_counter() - start}
        status = STATUS.get(code, f"code {code}")
        if status not in ("optimal", "feasible"):
            return Assignment(choice={}, objective_s=float("inf"), memory_bytes=float("inf"),
                              status=status, gap=float("inf"), **counts)
        choice = self._choice({rep: [round(v.solution_value()) for v in xs]
                               for rep, xs in self.x.items()})
        objective_s, memory = self.problem.evaluate(choice)
        value, bound = self.solver.Objective().Value(), self.solver.Objective().BestBound()
        gap = abs(value - bound) / max(abs(value), 1e-12)
        return Assignment(choice=choice, objective_s=objective_s, memory_bytes=memory,
                          status=status, gap=gap, **counts)

    def _integral(self) -> bool:
        return all(abs(v.solution_value() - round(v.solution_value())) < 1e-6
                   for xs in self.x.values() for v in xs)

    def _choice(self, counts: dict[str, list[int]]) -> dict[str, int]:
        """Strategy counts per group -> a strategy per node (copies in order)."""
        choice = {}
        for rep, per_strategy in counts.items():
            picks = [s for s, n in enumerate(per_strategy) for _ in range(n)]
            if self.count[rep] == 1:        # an op group: every copy takes the one choice
                picks = picks * len(self.copies[rep])
            for name, s in zip(self.copies[rep], picks):
                choice[name] = s
        return choice

    def _dive(self, bound_s: float, memory_limit: float | None, relative_gap: float, params,
              deadline: float) -> dict | None:
        """LP diving: fix the first fractional group (in graph order, so inputs first) to the
        least-memory strategy its LP solution uses, solve the LP again, repeat until integral.
        An LP often mixes two whole configurations; fixing one node makes the rest follow.
        Keeps the best rounding met on the way; restores every bound before returning."""
        best = self._rounded(bound_s, memory_limit)
        changed = []
        try:
            for _ in range(DIVES):
                fractional = [rep for rep, xs in self.x.items()
                              if any(abs(v.solution_value() - round(v.solution_value())) > 1e-6 for v in xs)]
                done = best is not None and best["gap"] <= relative_gap
                if done or not fractional or time.perf_counter() > deadline:
                    break
                rep = fractional[0]
                values = [v.solution_value() for v in self.x[rep]]
                s = min((s for s, v in enumerate(values) if v > 1e-6),
                        key=lambda s: self.memory_coef[rep][s])
                var = self.x[rep][s]
                changed.append((var, var.lb(), var.ub()))
                var.SetLb(math.ceil(values[s] - 1e-6))
                if self._solve_until(deadline, params) != pywraplp.Solver.OPTIMAL:
                    break
                found = self._rounded(bound_s, memory_limit)
                if found is not None and (best is None or found["objective_s"] < best["objective_s"]):
                    best = found
        finally:
            for var, lower, upper in reversed(changed):
                var.SetBounds(lower, upper)
        return best

    def _rounded(self, bound_s: float, memory_limit: float | None) -> dict | None:
        """Round a fractional LP optimum without raising memory: fractions go to the strategies
        of least memory the LP mixes. None when the result breaks an edge or the limit."""
        counts = {}
        for rep, xs in self.x.items():
            values = [v.solution_value() for v in xs]
            per_strategy = [math.floor(v + 1e-6) for v in values]
            support = sorted((s for s, v in enumerate(values) if v > 1e-6),
                             key=lambda s: self.memory_coef[rep][s])
            for s in support[:self.count[rep] - sum(per_strategy)]:
                per_strategy[s] += 1
            missing = self.count[rep] - sum(per_strategy)
            per_strategy[support[0]] += missing     # more than one fraction on one strategy
            counts[rep] = per_strategy
        choice = self._choice(counts)
        objective_s, memory = self.problem.evaluate(choice)
        gap = (objective_s - bound_s) / max(objective_s, 1e-12)
        if objective_s == float("inf"):
            return None
        if memory_limit is not None and memory > memory_limit * (1 + 1e-9):
            return None
        return dict(choice=choice, objective_s=objective_s, memory_bytes=memory, status="optimal",
                    gap=max(gap, 0.0))
