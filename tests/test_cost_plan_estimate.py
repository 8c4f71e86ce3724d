"""`autopar.cost.estimate_plan` prices a Plan from its own stages, and a Plan's `predicted` is
exactly that price: for plans the search chose and plans forced from a Config, on several models
and meshes, with uneven pipelines, ZeRO and recompute; after a JSON round trip too."""

import pytest

from autopar.cost.mesh import Mesh
from autopar.errors import AutoparError

SMALL_GPT = "gpt:layers=8,hidden=128,heads=2,seq=256,vocab=4096"
ODD_GPT = "gpt:layers=7,hidden=128,heads=4,seq=128,vocab=2048"
LLAMA = "llama:layers=6,hidden=128,heads=4,seq=128,vocab=2048"


@pytest.fixture(scope="module")
def graphs():
    from autopar.tracer import capture
    from autopar.models import build_model

    captured = {}
    for spec in (SMALL_GPT, ODD_GPT, LLAMA):
        model, inputs = build_model(spec, device="meta")
        captured[spec] = capture(model, example_inputs=inputs)
    return captured


def _check_reproduces(graph, plan):
    import json

    from autopar.cost import estimate_plan
    from autopar.plans import Plan

    for copy in (plan, Plan.from_dict(json.loads(plan.to_json()))):
        priced = estimate_plan(graph, copy).to_dict()
        devices = priced.pop("devices")
        recorded = {k: v for k, v in copy.predicted.items() if k != "simulated_bubble_fraction"}
        assert priced == recorded
        pp = copy.pp
        for stage in copy.stages:
            mine = {k: v for k, v in stage.predicted.items() if k != "chunk_time_per_micro_batch_s"}
            assert mine == devices[stage.index % pp]


PLANNED = [
    (SMALL_GPT, "2x1:a100-80g", 2, None),
    (SMALL_GPT, "2x4:a100-80g", 64, None),
    (ODD_GPT, "4:a100-80g", 16, None),
    (LLAMA, "2x2:h100-80g", 32, None),
    # tight memory limits: ZeRO, recompute, uneven pipelines (7 blocks on 3 stages, 8 blocks on
    # 2 ranks x 2 virtual chunks)
    (SMALL_GPT, "4:a100-80g", 32, 24 * 2**20),
    (ODD_GPT, "3:a100-80g", 6, 18 * 2**20),
    (ODD_GPT, "4:a100-80g", 8, 14 * 2**20),
    (SMALL_GPT, "4:a100-80g", 8, 28 * 2**20),
]


@pytest.mark.parametrize("spec,mesh,batch,limit", PLANNED)
def test_planned_plans_record_their_own_price(graphs, spec, mesh, batch, limit):
    from autopar.solver.planner import plan_and_search

    graph = graphs[spec]
    plan, search = plan_and_search(graph, Mesh.parse(mesh), global_batch=batch, memory_limit=limit,
                                   time_limit=120)
    _check_reproduces(graph, plan)
    # the price the search chose the plan by is the price the plan records: the search priced
    # the candidate on the placements the plan records
    assert search.best.estimate.step_time_s == plan.predicted["step_time_s"]
    assert search.best.estimate.memory_per_gpu_bytes == plan.predicted["memory_per_gpu_bytes"]


FORCED = [
    (SMALL_GPT, "2x2:a100-80g", dict(tp=2, pp=2, dp=1, global_batch=8, micro_batch=1,
                                     recompute="selective", sequence_parallel=True)),
    (SMALL_GPT, "8:a100-80g", dict(tp=1, pp=1, dp=8, global_batch=16, micro_batch=2, zero=3,
                                   recompute="full")),
    # 7 blocks on 3 stages: Megatron's uneven split (2/3/2)
    (ODD_GPT, "6:a100-80g", dict(tp=1, pp=3, dp=2, global_batch=12, micro_batch=1, zero=1)),
    (ODD_GPT, "4:a100-80g", dict(tp=1, pp=2, dp=2, global_batch=16, micro_batch=2, zero=2,
                                 schedule="gpipe")),
    (LLAMA, "2x2:a100-80g", dict(tp=2, pp=2, dp=1, virtual=3, global_batch=8, micro_batch=1,
                                 schedule="interleaved-1f1b", recompute="full")),
]


@pytest.mark.parametrize("spec,mesh,fields", FORCED)
def test_forced_plans_record_their_own_price(graphs, spec, mesh, fields):
    from autopar.api import plan_from_config
    from autopar.cost.config import Config
    from autopar.cost.estimator import estimate
    from autopar.cost.plan_estimate import tensor_placements

    graph, config = graphs[spec], Config(**fields)
    plan = plan_from_config(graph, Mesh.parse(mesh), config)
    _check_reproduces(graph, plan)
    # and a forced Config's plan is priced as `estimate` prices the Config on the plan's placements
    # (Megatron's layout without them)
    placements = tensor_placements(graph, plan)
    assert placements is None or config.tp > 1
    assert plan.predicted["step_time_s"] == estimate(graph, Mesh.parse(mesh), config,
                                                     placements=placements).step_time_s


def test_uneven_forced_stages_are_the_ones_priced(graphs):
    from autopar.api import plan_from_config
    from autopar.cost.config import Config

    plan = plan_from_config(graphs[ODD_GPT], Mesh.parse("6:a100-80g"),
                            Config(tp=1, pp=3, dp=2, global_batch=12, micro_batch=1))
    blocks = [sum(1 for layer in s.layers if layer.rsplit(".", 1)[-1].isdigit()) for s in plan.stages]
    assert blocks == [2, 3, 2]


def test_a_plan_of_another_graph_is_refused(graphs):
    from autopar.api import plan_from_config
    from autopar.cost import estimate_plan
    from autopar.cost.config import Config

    plan = plan_from_config(graphs[SMALL_GPT], Mesh.parse("2:a100-80g"),
                            Config(tp=1, pp=1, dp=2, global_batch=4))
    with pytest.raises(AutoparError, match="another graph"):
        estimate_plan(graphs[LLAMA], plan)


def test_autopar_estimate_prices_a_saved_plan(tmp_path, capsys):
    import json

    from autopar.cli import main

    spec, out = "gpt:layers=2,hidden=32,heads=2,seq=8,vocab=64", tmp_path / "plan.json"
    assert main(["plan", spec, "--mesh", "2:cpu", "--global-batch", "4", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["estimate", spec, "--plan", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    recorded = json.loads(out.read_text())["predicted"]
    assert report["step_time_s"] == recorded["step_time_s"]
    assert report["memory_per_gpu_bytes"] == recorded["memory_per_gpu_bytes"]
    # another model's capture is refused by its fingerprint
    assert main(["estimate", "gpt:layers=3,hidden=32,heads=2,seq=8,vocab=64", "--plan", str(out)]) == 1
    assert "another graph" in capsys.readouterr().err


def test_autopar_estimate_of_a_config_prices_what_compile_runs(capsys):
    """`autopar estimate --tp 2` and `compile(plan=Config(tp=2))` (which plans the Config with
    `plan_from_config`) price the same placements, the sharding ILP's, and agree; Megatron-LM's
    layout is another producer of placements, asked for by name; a tensor-parallel Config without
    placements is refused, naming both producers."""
    import json

    from autopar.api import plan_from_config
    from autopar.cli import main
    from autopar.commands.estimate import capture_model
    from autopar.cost.config import Config
    from autopar.cost.estimator import estimate
    from autopar.cost.megatron import megatron_placements
    from autopar.cost.plan_estimate import tensor_placements

    spec, mesh = "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=128", "2x2:a100-80g"
    assert main(["estimate", spec, "--mesh", mesh, "--tp", "2", "--pp", "2", "--global-batch", "8",
                 "--micro-batch", "2", "--sequence-parallel", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    graph = capture_model(spec)
    config = Config(tp=2, pp=2, dp=1, global_batch=8, micro_batch=2, sequence_parallel=True)
    plan = plan_from_config(graph, Mesh.parse(mesh), config)
    for key in ("step_time_s", "memory_per_gpu_bytes", "breakdown", "memory_breakdown"):
        assert report[key] == plan.predicted[key], key
    ilp = estimate(graph, Mesh.parse(mesh), config, placements=tensor_placements(graph, plan))
    assert ilp.step_time_s == report["step_time_s"]
    megatron = estimate(graph, Mesh.parse(mesh), config,
                        placements=megatron_placements(graph, 2, sequence_parallel=True))
    assert megatron.comm_breakdown["tensor"] > 0
    with pytest.raises(AutoparError, match="priced on placements.*plan_from_config.*megatron_placements"):
        estimate(graph, Mesh.parse(mesh), config)


WIDE_GPT = "gpt:layers=2,hidden=1024,heads=16,seq=512,vocab=4096"


def _replaced(plan, nodes: dict, parameters: dict):
    """A copy of `plan` with some tensor-axis placements changed (the data axis kept)."""
    from autopar.plans import Plan

    copy = Plan.from_dict(plan.to_dict())
    for table, changes in ((copy.nodes, nodes), (copy.parameters, parameters)):
        for name, placement in changes.items():
            table[name] = [table[name][0], placement]
    return copy


def _wide_plan(mesh: str):
    from autopar.api import plan_from_config
    from autopar.cost.config import Config
    from autopar.models import build_model
    from autopar.tracer import capture

    model, inputs = build_model(WIDE_GPT, device="meta")
    graph = capture(model, example_inputs=inputs)
    plan = plan_from_config(graph, Mesh.parse(mesh), Config(tp=4, dp=1, global_batch=8, micro_batch=2))
    assert plan.parameters["layers.0.mlp.fc1.weight"][1] == "S(0)"       # column, then row
    assert plan.parameters["layers.0.mlp.fc2.weight"][1] == "S(1)"
    return graph, plan


def test_a_replicated_mlp_is_priced_as_computed_whole():
    """Same tp, other placements, another price, the way the mechanism goes: an MLP computed
    whole on every device needs fewer collectives, more compute (which dominates at this size on
    A100s) and holds its weights whole."""
    from autopar.cost import estimate_plan

    graph, plan = _wide_plan("1x4:a100-80g")
    base = estimate_plan(graph, plan)
    mlp = lambda path: ".mlp." in f"{path}."
    whole = _replaced(plan, {n.name: "R" for n in graph.nodes if n.name in plan.nodes and mlp(n.module_path)},
                      {n.param_fqn: "R" for n in graph.parameters if ".mlp." in n.param_fqn})
    replicated = estimate_plan(graph, whole)
    assert replicated.breakdown["compute"] > base.breakdown["compute"]
    assert replicated.comm_breakdown["tensor"] < base.comm_breakdown["tensor"]
    assert replicated.step_time_s > base.step_time_s
    assert replicated.memory_breakdown["weights"] > base.memory_breakdown["weights"]


def test_row_parallel_projections_add_the_reduction_of_their_outputs():
    """Row-parallel q/k/v projections compute the same shares as column-parallel ones (on a CPU,
    where a GEMM's efficiency does not depend on its output's shape) but write partial sums, each
    reduce-scattered onto the heads: only traffic is added."""
    from autopar.cost import estimate_plan

    graph, plan = _wide_plan("4:cpu")
    base = estimate_plan(graph, plan)
    projections = ("wq", "wk", "wv")
    qkv = [n for n in graph.nodes if n.module_path.rsplit(".", 1)[-1] in projections
           and n.target == "aten.linear.default"]
    row = _replaced(plan, {n.name: "P" for n in qkv},
                    {n.param_fqn: "S(1)" for n in graph.parameters
                     if n.param_fqn.split(".")[-2] in projections and n.param_fqn.endswith("weight")})
    row_parallel = estimate_plan(graph, row)
    assert row_parallel.comm_breakdown["tensor"] > base.comm_breakdown["tensor"]
    assert row_parallel.step_time_s > base.step_time_s
    assert row_parallel.breakdown["compute"] == pytest.approx(base.breakdown["compute"], rel=0.05)
