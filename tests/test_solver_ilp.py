"""The ILP on synthetic problems: brute force agrees, ties share variables, JSON round-trips."""

import itertools
import json
import random

import pytest

from autopar.errors import AutoparError
from autopar.solver.ilp import solve
from autopar.solver.problem import Edge, Problem, ProblemNode, Strategy


def random_problem(seed: int, nodes: int = 5, strategies: int = 3, forbid: float = 0.15,
                   memory_limit: float | None = None) -> Problem:
    rng = random.Random(seed)
    made = []
    for i in range(nodes):
        made.append(ProblemNode(name=f"n{i}", kind="op", strategies=[
            Strategy(output=[f"S({s})"], inputs=[], compute_s=rng.uniform(0, 1e-3),
                     backward_s=rng.uniform(0, 2e-4), comm_s=rng.uniform(0, 1e-4),
                     memory_bytes=rng.uniform(1e8, 1e9))
            for s in range(strategies)]))
    edges = []
    for i in range(1, nodes):
        for src in rng.sample(range(i), k=min(i, 2)):
            src_class = [rng.randrange(2) for _ in range(strategies)]
            dst_class = [rng.randrange(3) for _ in range(strategies)]
            cost = [[None if rng.random() < forbid else rng.uniform(0, 5e-4) for _ in range(3)]
                    for _ in range(2)]
            edges.append(Edge(src=f"n{src}", dst=f"n{i}", arg=0, src_class=src_class,
                              dst_class=dst_class, cost=cost, overlapped=rng.random() < 0.5))
    return Problem(axes=[["gpu", 4]], nodes=made, edges=edges, memory_limit=memory_limit)


def brute_force(problem: Problem) -> tuple[float, dict]:
    rep = problem.representative()
    free = sorted({rep[n.name] for n in problem.nodes})
    sizes = [len(problem.node(name).strategies) for name in free]
    best, best_choice = float("inf"), None
    for combo in itertools.product(*(range(s) for s in sizes)):
        choice = dict(zip(free, combo))
        time, memory = problem.evaluate(choice)
        if problem.memory_limit is not None and memory > problem.memory_limit:
            continue
        if time < best:
            best, best_choice = time, choice
    return best, best_choice


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("backend", ["highs", "cp-sat"])
def test_brute_force_agrees(seed, backend):
    problem = random_problem(seed, memory_limit=[None, 2.2e9][seed % 2])
    expected, _ = brute_force(problem)
    found = solve(problem, backend=backend, time_limit=20, relative_gap=0.0)
    if expected == float("inf"):
        assert found.status == "infeasible"
        return
    assert found.status == "optimal"
    assert found.objective_s == pytest.approx(expected, rel=1e-4, abs=1e-9)
    if problem.memory_limit is not None:
        assert found.memory_bytes <= problem.memory_limit * (1 + 1e-6)


def test_tied_nodes_share_variables_and_costs():
    problem = random_problem(3, nodes=6, forbid=0.0)
    untied = solve(problem)
    # copies n3..n5 of n0..n2 with the same strategies and the same edges among them
    for k in range(3):
        copy = problem.nodes[k + 3]
        copy.strategies = problem.nodes[k].strategies
        copy.tie = f"n{k}"
    problem.edges = [e for e in problem.edges if int(e.dst[1:]) < 3]
    problem.edges += [Edge(**{**vars_of(e), "src": f"n{int(e.src[1:]) + 3}",
                              "dst": f"n{int(e.dst[1:]) + 3}"}) for e in list(problem.edges)]
    tied = solve(problem)
    expected, choice = brute_force(problem)
    assert tied.objective_s == pytest.approx(expected, rel=1e-4)
    assert tied.variables < untied.variables
    assert all(tied.choice[f"n{k + 3}"] == tied.choice[f"n{k}"] for k in range(3))


def vars_of(edge: Edge) -> dict:
    return {name: getattr(edge, name) for name in Edge.__slots__}


def test_json_round_trip_is_exact(tmp_path):
    problem = random_problem(1, memory_limit=1.2345678901234567e9)
    problem.nodes[2].tie = "n0"
    problem.nodes[2].strategies = problem.nodes[0].strategies
    path = tmp_path / "problem.json"
    problem.save(path)
    loaded = Problem.load(path)
    assert loaded == problem
    assert json.dumps(loaded.to_dict()) == json.dumps(problem.to_dict())


def test_bad_inputs_are_named():
    problem = random_problem(0)
    with pytest.raises(AutoparError, match="backend"):
        solve(problem, backend="gurobi")
    with pytest.raises(AutoparError, match="schema"):
        Problem.from_dict({**problem.to_dict(), "schema_version": 99})
    problem.nodes[1].tie = "n0"
    problem.nodes[1].strategies = problem.nodes[1].strategies[:2]
    with pytest.raises(AutoparError, match="tied"):
        solve(problem)


def odd_cycle(same_cost: float | None) -> Problem:
    """Three nodes, two strategies each, every pair charged when equal: the LP relaxation takes
    every strategy by half at no cost; an integral answer must pay on one edge."""
    nodes = [ProblemNode(name=f"n{i}", kind="op",
                         strategies=[Strategy(output=["R"], inputs=[]), Strategy(output=["S(0)"], inputs=[])])
             for i in range(3)]
    edges = [Edge(src=f"n{a}", dst=f"n{b}", arg=0, src_class=[0, 1], dst_class=[0, 1],
                  cost=[[same_cost, 0.0], [0.0, same_cost]]) for a, b in ((0, 1), (1, 2), (0, 2))]
    return Problem(axes=[["gpu", 2]], nodes=nodes, edges=edges)


@pytest.mark.parametrize("backend", ["highs", "cp-sat"])
def test_fractional_relaxation_falls_back_to_integers(backend):
    found = solve(odd_cycle(1e-3), backend=backend, relative_gap=0.0)
    assert found.status == "optimal"
    assert found.objective_s == pytest.approx(1e-3)
    assert solve(odd_cycle(None), backend=backend).status == "infeasible"


def layered(copies: int, memory_limit: float) -> Problem:
    """`copies` tied ops, each reading its own tied parameter that can be kept whole (fast) or
    sharded (slower, less memory): the budget decides how many copies shard."""
    nodes, edges = [], []
    for k in range(copies):
        tie = None if k == 0 else "p0"
        nodes.append(ProblemNode(name=f"p{k}", kind="parameter", tie=tie, strategies=[
            Strategy(output=["R"], inputs=[], memory_bytes=4e9),
            Strategy(output=["S(0)"], inputs=[], comm_s=1e-3 * (1 + 0.1 * 0), memory_bytes=1e9)]))
        nodes.append(ProblemNode(name=f"op{k}", kind="op", tie=None if k == 0 else "op0", strategies=[
            Strategy(output=["R"], inputs=[["R"]], compute_s=2e-3),
            Strategy(output=["S(0)"], inputs=[["S(0)"]], compute_s=1.5e-3, memory_bytes=0.5e9)]))
        edges.append(Edge(src=f"p{k}", dst=f"op{k}", arg=0, src_class=[0, 1], dst_class=[0, 1],
                          cost=[[0.0, 2e-4], [3e-4, 0.0]]))
    return Problem(axes=[["gpu", 4]], nodes=nodes, edges=edges, memory_limit=memory_limit)


@pytest.mark.parametrize("limit", [5e9, 9e9, 12e9, 16e9])
def test_tied_parameters_choose_per_copy(limit):
    problem = layered(4, limit)
    best = float("inf")
    for ops in range(2):
        for params in itertools.product(range(2), repeat=4):
            choice = {f"op{k}": ops for k in range(4)} | {f"p{k}": params[k] for k in range(4)}
            time_s, memory = problem.evaluate(choice)
            if memory <= limit:
                best = min(best, time_s)
    found = solve(problem, relative_gap=0.0)
    assert found.objective_s == pytest.approx(best)
    assert found.memory_bytes <= limit


@pytest.mark.parametrize("seed", range(4))
def test_least_memory_agrees_with_brute_force(seed):
    problem = random_problem(seed)
    rep = problem.representative()
    names = sorted(set(rep.values()))
    least = min(mem for combo in itertools.product(*(range(len(problem.node(n).strategies)) for n in names))
                for time_s, mem in [problem.evaluate(dict(zip(names, combo)))] if time_s < float("inf"))
    found = solve(problem, minimize="memory", relative_gap=0.0)
    assert found.memory_bytes == pytest.approx(least, rel=1e-6)
