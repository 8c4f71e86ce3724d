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
    found = solve(problem, backend=backend, time_limit=20)
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
