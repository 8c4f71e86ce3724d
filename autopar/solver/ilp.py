"""The intra-op sharding ILP, solved with OR-Tools (HiGHS by default, CP-SAT selectable).

Formulation. Nodes tied to a representative (`ProblemNode.tie`: the same position in another
instance of a repeated block) use the representative's variables, so their costs add up on one
set of variables: 96 identical layers cost one layer's variables.

Variables
    x[r, s] in {0, 1}        representative node r takes strategy s
    y[e, p, q] in [0, 1]     edge e goes from producer class p to consumer class q (a class groups
                             the strategies whose resharding costs on e are equal); continuous,
                             since integral x forces y integral (binary under CP-SAT, which needs
                             integers)

    exposed >= 0             parameter/gradient traffic left exposed after overlapping the backward

Objective (seconds, scaled to microseconds for the solver)           `set_objective`
    min  sum_n sum_s cost[n, s] * x[rep(n), s]        compute + own communication
       + sum_{e not overlapped} sum_pq C[e, p, q] * y[e, p, q]      resharding, forward and backward
       + exposed
    Edges whose producer (or consumer) has one class need no y: their cost is a linear function of
    the other end's x and is added to its coefficients (`add_edges`).

Constraints
    one strategy per node     sum_s x[r, s] = 1                              `add_choices`
    edge marginals            sum_q y[e, p, q] = sum_{s in p} x[src, s]       `add_edges`
                              sum_p y[e, p, q] = sum_{s in q} x[dst, s]
                              (a pair (p, q) that is not allowed has no y, which forbids it)
    memory                    sum_n sum_s mem[n, s] * x[rep(n), s] <= budget  `add_memory_limit`
    overlap                   exposed >= sum_{e overlapped} sum_pq C[e, p, q] * y[e, p, q]
                                        - sum_n sum_s backward[n, s] * x[rep(n), s]   `set_objective`
                              (gradient reduction and ZeRO gathers run behind the backward, as
                              DDP and FSDP do; only what exceeds the backward's compute counts)

Every solve has a time limit and returns the best feasible assignment found with its status and
relative gap to the best bound.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

from ortools.linear_solver import pywraplp

from autopar.errors import AutoparError
from autopar.solver.problem import Problem

BACKENDS = {"highs": "HIGHS", "cp-sat": "CP_SAT"}
TIME_SCALE = 1e6          # seconds -> microseconds: keeps coefficients well above tolerances
MEMORY_SCALE = 1 / 2**30  # bytes -> GiB
STATUS = {pywraplp.Solver.OPTIMAL: "optimal", pywraplp.Solver.FEASIBLE: "feasible",
          pywraplp.Solver.INFEASIBLE: "infeasible", pywraplp.Solver.UNBOUNDED: "unbounded",
          pywraplp.Solver.ABNORMAL: "abnormal", pywraplp.Solver.NOT_SOLVED: "not solved"}


@dataclass(kw_only=True, slots=True)
class Assignment:
    choice: dict[str, int]      # every node -> its strategy index (tied nodes share)
    objective_s: float          # predicted time of the step's forward and backward, seconds
    memory_bytes: float         # per device, by the problem's memory model
    status: str                 # "optimal", "feasible" (time limit hit), "infeasible", ...
    gap: float                  # relative gap between the solution and the best bound
    seconds: float              # wall time of building and solving the model
    variables: int
    constraints: int


def solve(problem: Problem, *, time_limit: float = 10.0, backend: str = "highs",
          minimize: str = "time", memory_limit: float | None = None) -> Assignment:
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
    return model.solve(time_limit, start)


class _Model:
    def __init__(self, problem: Problem, backend: str):
        problem.check()
        self.problem = problem
        self.integral_edges = backend == "CP_SAT"
        self.solver = pywraplp.Solver.CreateSolver(backend)
        if self.solver is None:
            raise AutoparError(f"OR-Tools was built without the {backend} backend; "
                               f"choose another backend")
        self.rep = problem.representative()
        self.nodes = {n.name: n for n in problem.nodes}
        self.x: dict[str, list] = {}
        self.time_coef: dict[str, list[float]] = {}
        self.overlap_coef: dict[str, list[float]] = {}   # overlapped traffic minus backward compute
        self.edge_terms: list[tuple] = []       # (variable, seconds) paid in full
        self.overlap_terms: list[tuple] = []    # (variable, seconds) that may hide behind the backward

    def add_choices(self) -> None:
        for node in self.problem.nodes:
            rep = self.rep[node.name]
            if rep not in self.x:
                count = len(self.nodes[rep].strategies)
                self.x[rep] = [self.solver.BoolVar(f"x[{rep},{s}]") for s in range(count)]
                self.time_coef[rep] = [0.0] * count
                self.overlap_coef[rep] = [0.0] * count
                self.solver.Add(sum(self.x[rep]) == 1, f"one[{rep}]")
            for s, strategy in enumerate(node.strategies):
                self.time_coef[rep][s] += strategy.cost_s
                self.overlap_coef[rep][s] -= strategy.backward_s

    def add_edges(self) -> None:
        for (src, dst, src_class, dst_class, overlapped), cost in self._merged_edges().items():
            if len(set(src_class)) == 1 or len(set(dst_class)) == 1:
                self._add_linear_edge(src, dst, src_class, dst_class, cost, overlapped)
            else:
                self._add_paired_edge(src, dst, src_class, dst_class, cost, overlapped)

    def _merged_edges(self) -> dict[tuple, list[list[float | None]]]:
        """Edges between the same representatives with the same classes (the copies of one edge
        in each block instance) become one edge with summed costs."""
        merged: dict[tuple, list[list[float | None]]] = {}
        for edge in self.problem.edges:
            key = (self.rep[edge.src], self.rep[edge.dst], tuple(edge.src_class),
                   tuple(edge.dst_class), edge.overlapped)
            if key not in merged:
                merged[key] = [list(row) for row in edge.cost]
                continue
            total = merged[key]
            for p, row in enumerate(edge.cost):
                for q, value in enumerate(row):
                    total[p][q] = None if value is None or total[p][q] is None else total[p][q] + value
        return merged

    def _add_linear_edge(self, src, dst, src_class, dst_class, cost, overlapped) -> None:
        """One class at either end: the cost is a function of the other end's strategy alone."""
        if len(set(src_class)) == 1:
            row, end, classes = cost[src_class[0]], dst, dst_class
        else:
            row, end, classes = [r[dst_class[0]] for r in cost], src, src_class
        for s, cls in enumerate(classes):
            if row[cls] is None:
                self.x[end][s].SetUb(0)
            else:
                (self.overlap_coef if overlapped else self.time_coef)[end][s] += row[cls]

    def _add_paired_edge(self, src, dst, src_class, dst_class, cost, overlapped) -> None:
        members_src, members_dst = defaultdict(list), defaultdict(list)
        for s, cls in enumerate(src_class):
            members_src[cls].append(self.x[src][s])
        for s, cls in enumerate(dst_class):
            members_dst[cls].append(self.x[dst][s])
        rows, cols = defaultdict(list), defaultdict(list)
        for p in members_src:
            for q in members_dst:
                if cost[p][q] is None:
                    continue
                if self.integral_edges:
                    y = self.solver.BoolVar(f"y[{src},{dst},{p},{q}]")
                else:
                    y = self.solver.NumVar(0.0, 1.0, f"y[{src},{dst},{p},{q}]")
                rows[p].append(y)
                cols[q].append(y)
                if cost[p][q]:
                    (self.overlap_terms if overlapped else self.edge_terms).append((y, cost[p][q]))
        for p, xs in members_src.items():
            self.solver.Add(sum(rows[p]) == sum(xs))
        for q, xs in members_dst.items():
            self.solver.Add(sum(cols[q]) == sum(xs))

    def add_memory_limit(self, limit: float) -> None:
        terms = []
        for node in self.problem.nodes:
            xs = self.x[self.rep[node.name]]
            terms += [(xs[s], st.memory_bytes * MEMORY_SCALE)
                      for s, st in enumerate(node.strategies) if st.memory_bytes]
        self.solver.Add(self.solver.Sum(c * v for v, c in terms) <= limit * MEMORY_SCALE, "memory")

    def set_objective(self, minimize: str) -> None:
        if minimize == "memory":
            terms = [(self.x[self.rep[n.name]][s], st.memory_bytes * MEMORY_SCALE)
                     for n in self.problem.nodes for s, st in enumerate(n.strategies)]
        elif minimize == "time":
            terms = [(xs[s], self.time_coef[rep][s] * TIME_SCALE)
                     for rep, xs in self.x.items() for s in range(len(xs))]
            terms += [(y, c * TIME_SCALE) for y, c in self.edge_terms]
            if self.overlap_terms or any(any(c > 0 for c in cs) for cs in self.overlap_coef.values()):
                exposed_s = self.solver.NumVar(0.0, self.solver.infinity(), "exposed")
                exposed = [(xs[s], self.overlap_coef[rep][s] * TIME_SCALE)
                           for rep, xs in self.x.items() for s in range(len(xs))]
                exposed += [(y, c * TIME_SCALE) for y, c in self.overlap_terms]
                self.solver.Add(exposed_s >= self.solver.Sum(c * v for v, c in exposed if c), "overlap")
                terms.append((exposed_s, 1.0))
        else:
            raise AutoparError(f"minimize={minimize!r}: expected 'time' or 'memory'")
        self.solver.Minimize(self.solver.Sum(c * v for v, c in terms if c))

    def solve(self, time_limit: float, start: float) -> Assignment:
        self.solver.SetTimeLimit(int(time_limit * 1000))
        self.solver.SetNumThreads(1)
        self.solver.SuppressOutput()
        status = STATUS.get(self.solver.Solve(), "unknown")
        counts = dict(variables=self.solver.NumVariables(), constraints=self.solver.NumConstraints())
        if status not in ("optimal", "feasible"):
            return Assignment(choice={}, objective_s=float("inf"), memory_bytes=float("inf"),
                              status=status, gap=float("inf"),
                              seconds=time.perf_counter() - start, **counts)
        choice_of_rep = {rep: max(range(len(xs)), key=lambda s: xs[s].solution_value())
                         for rep, xs in self.x.items()}
        choice = {name: choice_of_rep[rep] for name, rep in self.rep.items()}
        objective_s, memory = self.problem.evaluate(choice)
        value = self.solver.Objective().Value()
        bound = self.solver.Objective().BestBound()
        gap = 0.0 if status == "optimal" else abs(value - bound) / max(abs(value), 1e-12)
        return Assignment(choice=choice, objective_s=objective_s, memory_bytes=memory,
                          status=status, gap=gap, seconds=time.perf_counter() - start, **counts)
