"""Expert parallelism as a search dimension: the free plan splits experts where the cost model
finds it faster, or where nothing else fits; it proposes only degrees the runtime runs (dividing
the experts and the stage's dp x cp x tp ranks), and none for a model without MoE layers."""

import functools

import pytest

from autopar.cost.config import Config
from autopar.cost.mesh import Mesh
from autopar.errors import AutoparError
from autopar.models import build_model
from autopar.solver.candidates import expert_degrees, with_expert_degrees, Shape
from autopar.solver.planner import plan_and_search, plan_config
from autopar.tracer import capture

# two MoE layers whose experts (64 of 3 x 4096 x 8192 each) dwarf the rest, on 8 single-GPU nodes:
# no tensor parallelism, so without EP every rank gathers or holds every expert
BIG_EXPERTS = "moe:layers=2,hidden=4096,heads=32,seq=512,vocab=1000,experts=64,top_k=2,expert_ffn=8192"
MESH = "8x1:a100-80g"


@functools.cache
def graph(spec: str = BIG_EXPERTS):
    model, inputs = build_model(spec)
    return capture(model, example_inputs=inputs)


def best_by_ep(search) -> dict:
    best = {}
    for priced in search.candidates():
        ep = priced.candidate.shape.ep
        if priced.fits and (ep not in best or priced.step_time_s < best[ep].step_time_s):
            best[ep] = priced
    return best


def test_free_plan_splits_experts_where_it_is_faster():
    plan, search = plan_and_search(graph(), Mesh.parse(MESH), global_batch=16, time_limit=120)
    best = best_by_ep(search)
    assert plan.ep > 1 and all(stage.ep == plan.ep for stage in plan.stages)
    assert 1 in best and best[plan.ep].step_time_s < best[1].step_time_s
    assert plan.predicted["step_time_s"] == pytest.approx(best[plan.ep].step_time_s)
    # what the runtime runs: ep divides the experts and the stage's ranks
    assert 64 % plan.ep == 0 and (plan.dp * plan.tp) % plan.ep == 0


def test_free_plan_splits_experts_where_nothing_else_fits():
    limit = 32 * 2**30
    plan, search = plan_and_search(graph(), Mesh.parse(MESH), global_batch=16, memory_limit=limit,
                                   time_limit=120)
    assert plan.ep > 1 and plan.predicted["memory_per_gpu_bytes"] <= limit
    replicated = [p for p in search.candidates() if p.candidate.shape.ep == 1]
    assert replicated and not any(p.fits for p in replicated)


def test_forced_expert_parallelism_is_planned_and_refused_where_the_runtime_cannot_run_it():
    plan = plan_config(graph(), Mesh.parse(MESH), Config(dp=8, ep=8, global_batch=16, micro_batch=2))
    assert [stage.ep for stage in plan.stages] == [8]
    with pytest.raises(AutoparError, match="ep=3 does not divide"):
        Config(dp=8, ep=3, global_batch=16, micro_batch=2)
    dense = graph("gpt:layers=2,hidden=64,heads=4,seq=32,vocab=256")
    with pytest.raises(AutoparError, match="no mixture-of-experts layer"):
        plan_config(dense, Mesh.parse("2:cpu"), Config(dp=2, ep=2, global_batch=4, micro_batch=2))


def test_expert_degrees_are_those_the_runtime_runs():
    # 48 experts on a stage of 2 x 8 ranks: the divisors of both
    assert expert_degrees(16, 48, 8, every=True) == [1, 2, 4, 8, 16]
    assert expert_degrees(16, 48, 8) == [1, 8]          # the grid: none, the largest in a node
    assert expert_degrees(16, 0, 8, every=True) == [1]   # no MoE layer: no expert parallelism
    shapes = with_expert_degrees([Shape(tp=2, pp=1, dp=8, micro_batch=1, schedule="1f1b")], 6, 8)
    assert [shape.ep for shape in shapes] == [1, 2]
    # context-parallel ranks count too (Megatron-Core folds the experts into dp x cp x tp)
    shapes = with_expert_degrees([Shape(tp=1, pp=1, dp=1, micro_batch=1, schedule="1f1b", cp=8)], 8, 8)
    assert [shape.ep for shape in shapes] == [1, 8]


def test_a_single_moe_layer_runs_expert_parallel_as_planned():
    """A model without repeated blocks is cut between modules (autopar.cost.units); a unit
    boundary between a layer's router and its experts left the runtime, which splits experts
    within one unit, running them replicated under a plan that said ep=2. The layer is now one
    unit, and the rank sends on the ep and edp groups exactly what the plan priced."""
    from autopar.api import plan_from_config
    from autopar.models.gpt import lm_loss
    from autopar.simulate import priced_as_simulated, rank_report, simulate_ranks
    spec = "moe:layers=1,hidden=64,heads=4,kv_heads=2,vocab=256,experts=2,top_k=2,expert_ffn=48,seq=32"
    model, inputs = build_model(spec)
    graph = capture(model, example_inputs=inputs)
    plan = plan_from_config(graph, "2x4:a100-80g", Config(dp=8, ep=2, zero=1, global_batch=8,
                                                         micro_batch=1))
    assert "layers.0.ffn" in plan.stages[0].layers
    [run] = simulate_ranks(model, plan, [0], example_inputs=inputs, targets=inputs[0],
                           loss_fn=lm_loss, graph=graph)
    report = rank_report(plan, run, priced_as_simulated(graph, plan))
    sent = {(entry["kind"], entry["axis"]): entry for entry in report.collectives}
    assert sent[("all_to_all", "ep")]["sent_bytes"] > 0
    for entry in report.collectives:
        assert entry["sent_bytes"] == entry["predicted_sent_bytes"], entry
