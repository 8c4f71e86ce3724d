"""The solver rediscovers what experts do by hand (no processes): data parallelism with loose
memory, ZeRO-3 when replicas do not fit, Megatron's column/row layout with sequence parallelism on
the fast axis of a 2-D mesh, and a tiny real graph where brute force agrees with the ILP."""

import itertools

import pytest
import torch

import autopar
from autopar.cost.mesh import Mesh
from autopar.errors import InfeasibleError
from autopar.models import build_model
from autopar.solver import solve_intra_op
from autopar.solver.build import build_problem
from autopar.solver.ilp import solve

MiB = 2**20
LINEAR_WEIGHTS = ("attn.wq.weight", "attn.wk.weight", "attn.wv.weight", "attn.wo.weight",
                  "mlp.fc1.weight", "mlp.fc2.weight")


@pytest.fixture(scope="module")
def small_gpt():
    model, inputs = build_model("gpt:layers=4,hidden=512,heads=8,seq=128,vocab=1024", batch=8)
    return autopar.capture(model, inputs)


def linear_outputs(solution):
    graph_nodes = solution.problem.nodes
    return [solution.node_placements[n.name] for n in graph_nodes if n.label.endswith("aten.linear.default")]


def test_loose_memory_gives_data_parallelism(small_gpt):
    solution = solve_intra_op(small_gpt, Mesh.parse("8:a100-80g"))
    assert all(p == ["S(0)"] for p in linear_outputs(solution))           # batch sharded
    assert all(p == ["R"] for p in solution.parameter_placements.values())  # replicas
    assert all(p == ["R"] for p in solution.gradient_placements.values())   # all-reduced gradients
    assert solution.zero_stage("gpu") == 0


def test_tight_memory_gives_zero3(small_gpt):
    mesh = Mesh.parse("8:a100-80g")
    loose = solve_intra_op(small_gpt, mesh)
    least = solve(build_problem(small_gpt, mesh), minimize="memory").memory_bytes
    # between what full sharding needs and what replicated weights with sharded states need
    solution = solve_intra_op(small_gpt, mesh, memory_limit=60 * MiB)
    assert least < 60 * MiB < loose.peak_memory_bytes
    assert solution.peak_memory_bytes <= 60 * MiB
    assert all(p == ["S(0)"] for p in linear_outputs(solution))
    weights = [fqn for fqn in solution.parameter_placements if fqn.endswith(LINEAR_WEIGHTS)]
    gathered = [fqn for fqn in weights if solution.parameter_placements[fqn] == ["S(0)"]
                and solution.parameter_use_placements[fqn] == ["R"]]
    assert len(gathered) >= len(weights) - 1      # one layer's copy may stay whole if it fits
    assert solution.zero_stage("gpu") == 3


def test_infeasible_memory_names_the_least_and_the_largest(small_gpt):
    with pytest.raises(InfeasibleError, match=r"least any assignment needs is \d+\.\d+ [MG]iB") as err:
        solve_intra_op(small_gpt, Mesh.parse("8:a100-80g"), memory_limit=10 * MiB)
    assert "Largest contributors" in str(err.value)


@pytest.fixture(scope="module")
def gpt_6_7b():
    """GPT-3 6.7B's layer shape (hidden 4096, 32 heads, seq 2048); two layers, as blocks are tied."""
    model, inputs = build_model("gpt:layers=2,hidden=4096,heads=32,seq=2048,vocab=51200", batch=2,
                                dtype=torch.bfloat16)
    return autopar.capture(model, inputs)


def by_label(solution, suffix):
    return [solution.node_placements[n.name] for n in solution.problem.nodes
            if n.kind != "parameter" and n.label.split(":")[0].endswith(suffix)]


def assert_megatron_on_gpu_axis(solution):
    gpu = [name for name, _ in solution.axes].index("gpu")
    for fqn, used in solution.parameter_use_placements.items():
        if fqn.endswith(("attn.wq.weight", "attn.wk.weight", "attn.wv.weight", "mlp.fc1.weight")):
            assert used[gpu] == "S(0)", (fqn, used)          # column-parallel
        if fqn.endswith(("attn.wo.weight", "mlp.fc2.weight")):
            assert used[gpu] == "S(1)", (fqn, used)          # row-parallel
    # sequence parallelism between the tensor-parallel regions
    for suffix in ("ln1", "ln2", "attn.resid_dropout", "mlp.dropout"):
        placements = by_label(solution, suffix)
        assert placements and all(p[gpu] == "S(1)" for p in placements), (suffix, placements)


def test_megatron_on_the_nvlink_axis_batch_on_the_node_axis(gpt_6_7b):
    solution = solve_intra_op(gpt_6_7b, Mesh.parse("2x4:a100-80g"), roles={"node": "dp"})
    assert_megatron_on_gpu_axis(solution)
    assert all(p[0] == "S(0)" for p in by_label(solution, ("wq", "wo", "fc1", "fc2")))
    assert solution.zero_stage("node") == 0


def test_megatron_on_the_nvlink_axis_without_roles(gpt_6_7b):
    solution = solve_intra_op(gpt_6_7b, Mesh.parse("2x4:a100-80g"))
    assert_megatron_on_gpu_axis(solution)


def test_brute_force_agrees_on_a_real_graph():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    graph = autopar.capture(model.to("meta"), (torch.empty(4, 16, device="meta"),))
    mesh = Mesh.parse("2:a100-80g")
    loose = build_problem(graph, mesh)
    least = solve(loose, minimize="memory").memory_bytes
    for limit in (None, least * 1.05, least * 1.5):
        problem = build_problem(graph, mesh, memory_limit=limit)
        names = [n.name for n in problem.nodes]
        best = float("inf")
        for combo in itertools.product(*(range(len(n.strategies)) for n in problem.nodes)):
            time_s, memory = problem.evaluate(dict(zip(names, combo)))
            if limit is None or memory <= limit:
                best = min(best, time_s)
        found = solve(problem, relative_gap=0.0)
        assert found.objective_s == pytest.approx(best, rel=1e-9)


def test_a_built_problem_round_trips_through_json_exactly(small_gpt, tmp_path):
    from autopar.solver.problem import Problem
    problem = build_problem(small_gpt, Mesh.parse("2x4:a100-80g"), memory_limit=3e9)
    path = tmp_path / "problem.json"
    problem.save(path)
    loaded = Problem.load(path)
    assert loaded == problem
    assert solve(loaded).objective_s == solve(problem).objective_s


def test_cp_sat_agrees_with_highs_on_a_real_graph():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    graph = autopar.capture(model.to("meta"), (torch.empty(4, 16, device="meta"),))
    highs = solve_intra_op(graph, Mesh.parse("2x2:a100-80g"))
    cp_sat = solve_intra_op(graph, Mesh.parse("2x2:a100-80g"), backend="cp-sat")
    assert cp_sat.objective_s == pytest.approx(highs.objective_s, rel=1e-2)


def test_roles_are_checked(small_gpt):
    from autopar.errors import AutoparError
    with pytest.raises(AutoparError, match="does not have"):
        solve_intra_op(small_gpt, Mesh.parse("8:a100-80g"), roles={"node": "dp"})
    with pytest.raises(AutoparError, match="unknown"):
        solve_intra_op(small_gpt, Mesh.parse("8:a100-80g"), roles={"gpu": "pipeline"})


def test_tying_shares_variables_across_layers(small_gpt):
    mesh = Mesh.parse("8:a100-80g")
    tied = solve_intra_op(small_gpt, mesh)
    untied = solve_intra_op(small_gpt, mesh, tie_blocks=False)
    assert tied.variables < untied.variables
    assert tied.objective_s == pytest.approx(untied.objective_s, rel=1e-2)
    block = [n for n in tied.problem.nodes if n.tie is not None]
    assert len(block) >= 3 * len({n.tie for n in block})      # layers 1-3 tied to layer 0


@pytest.mark.parametrize("spec", ["llama:layers=2,hidden=192,heads=6,kv_heads=2,seq=48,vocab=768",
                                  "llama:layers=2,hidden=256,heads=8,kv_heads=8,seq=64,vocab=512"])
def test_rotary_models_get_megatron_on_the_tensor_axis(spec):
    """A rotary table is a buffer: its gradient is never computed, so reading it from heads split
    over ranks costs no all-reduce in the backward. Priced as if it did, the ILP kept queries and
    keys whole through the rotation (an all-gather or a reduce-scatter per layer)."""
    model, inputs = build_model(spec, batch=2)
    graph = autopar.capture(model, inputs)
    solution = solve_intra_op(graph, Mesh.parse("2:cpu"), roles={"gpu": "tp"})
    for fqn, used in solution.parameter_use_placements.items():
        if fqn.endswith(("wq.weight", "wk.weight", "wv.weight", "w1.weight", "w3.weight")):
            assert used == ["S(0)"], (fqn, used)          # column-parallel
        if fqn.endswith(("wo.weight", "w2.weight")):
            assert used == ["S(1)"], (fqn, used)          # row-parallel
    problem = build_problem(graph, Mesh.parse("2:cpu"), roles={"gpu": "tp"})
    grad, nodes = graph.requiring_grad(), {node.name: node for node in problem.nodes}
    read_whole = 0
    for edge in problem.edges:
        if edge.src in grad:
            continue
        src, dst = nodes[edge.src], nodes[edge.dst]
        for i, made in enumerate(src.strategies):
            for j, used in enumerate(dst.strategies):
                if made.output == ["R"] and used.inputs[edge.arg] == ["R"]:
                    read_whole += 1
                    assert edge.cost[edge.src_class[i]][edge.dst_class[j]] == 0.0, (edge.src, edge.dst)
    assert read_whole    # the rotary tables' reads were checked


@pytest.mark.parametrize("spec", ["gpt:layers=2,hidden=64,heads=4,seq=16,vocab=128",
                                  "llama:layers=2,hidden=64,heads=4,kv_heads=2,seq=16,vocab=128"])
def test_a_forced_configuration_gets_the_sequence_parallelism_it_asks_for(spec):
    """Config(sequence_parallel=...) decides how every norm reads the residual stream on the
    tensor axis: split on the sequence with it, whole without; the ILP places the rest."""
    from autopar.api import plan_from_config
    from autopar.cost.config import Config

    model, inputs = build_model(spec, batch=2)
    graph = autopar.capture(model, inputs)
    norms = [norm for norm, _, _ in graph.norm_reads()]
    assert len(norms) == 2 * 2 + 1          # two norms per block, the final norm
    for sequence_parallel, wanted in ((True, "S(1)"), (False, "R")):
        config = Config(dp=2, tp=2, global_batch=4, micro_batch=2, sequence_parallel=sequence_parallel)
        plan = plan_from_config(graph, "4:cpu", config)
        # a norm reads its input as it writes its output (it normalizes the hidden dim)
        assert {plan.nodes[norm][1] for norm in norms} == {wanted}, sequence_parallel


def test_sequence_parallelism_that_cannot_split_the_sequence_is_refused_at_plan_time():
    from autopar.api import plan_from_config
    from autopar.cost.config import Config
    from autopar.errors import AutoparError

    model, inputs = build_model("gpt:layers=2,hidden=64,heads=4,seq=15,vocab=128", batch=2)
    graph = autopar.capture(model, inputs)
    config = Config(dp=2, tp=2, global_batch=4, micro_batch=2, sequence_parallel=True)
    with pytest.raises(AutoparError, match=r"sequence parallelism: .*shape \[2, 15, 64\].*sequence of 15, which 2 .* divide: use a sequence length .*, or leave sequence_parallel off"):
        plan_from_config(graph, "4:cpu", config)
