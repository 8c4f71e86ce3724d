"""The inter-op planner: cuts, the grid it contains, memory-forced pipelines, schedule simulation."""

import itertools
import random
import time

import pytest

from autopar.cost.mesh import Mesh
from autopar.errors import AutoparError, InfeasibleError
from autopar.solver.candidates import (balanced_cuts, megatron_shapes, pipeline_units, uniform_cuts,
                                       unit_weights)
from autopar.timeline import schedule_actions, simulate

SMALL_GPT = "gpt:layers=8,hidden=128,heads=2,seq=256,vocab=4096"
# Two nodes of one device each: no tensor parallelism across nodes, and a global batch of 2 leaves
# data parallelism (with any ZeRO) as the only way to use both without a pipeline.
TWO_NODES, BATCH = "2x1:a100-80g", 2


@pytest.fixture(scope="module")
def graph():
    from autopar.tracer import capture
    from autopar.models import build_model

    model, inputs = build_model(SMALL_GPT)
    return capture(model, example_inputs=inputs)


# --- schedules: torch's action orders, simulated ---------------------------------------------

@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp,m", [(2, 8), (4, 8), (4, 4), (8, 16)])
def test_bubble_of_gpipe_and_1f1b_is_p_minus_1_over_m(schedule, pp, m):
    timeline = simulate(schedule, forward_s=[1.0] * pp, backward_s=[2.0] * pp, micro_batches=m)
    assert timeline.bubble_fraction == pytest.approx((pp - 1) / m)


@pytest.mark.parametrize("pp,v,m", [(2, 2, 8), (4, 2, 8), (4, 4, 8), (4, 2, 4)])
def test_interleaved_bubble_is_p_minus_1_over_v_m(pp, v, m):
    timeline = simulate("interleaved-1f1b", forward_s=[1.0 / v] * (pp * v),
                        backward_s=[2.0 / v] * (pp * v), micro_batches=m, virtual=v)
    assert timeline.bubble_fraction == pytest.approx((pp - 1) / (v * m))


def test_zero_bubble_fills_the_drain_with_weight_gradients():
    one_f_one_b = simulate("1f1b", forward_s=[1.0] * 4, backward_s=[2.0] * 4, micro_batches=8)
    zero_bubble = simulate("zero-bubble", forward_s=[1.0] * 4, backward_s=[2.0] * 4, micro_batches=8)
    kinds = {e.action.kind for e in zero_bubble.events}
    assert kinds == {"F", "I", "W"}
    # ZB-H1: the bubble shrinks from (p-1)(F+B) to (p-1)(F+B-W) with B split evenly into I and W
    assert zero_bubble.bubble_fraction == pytest.approx(one_f_one_b.bubble_fraction / 3)


def test_every_action_runs_once_and_after_its_inputs():
    timeline = simulate("interleaved-1f1b", forward_s=[0.5] * 8, backward_s=[1.0] * 8,
                        micro_batches=8, virtual=2, send_s=0.1)
    end = {(e.action.kind, e.action.stage, e.action.micro_batch): e.end for e in timeline.events}
    assert len(end) == len(timeline.events) == 2 * 8 * 8
    for event in timeline.events:
        kind, stage, mb = event.action.kind, event.action.stage, event.action.micro_batch
        if kind == "F" and stage > 0:
            assert event.start >= end[("F", stage - 1, mb)] + 0.1 - 1e-12
        if kind == "B" and stage < 7:
            assert event.start >= end[("B", stage + 1, mb)] + 0.1 - 1e-12
        assert event.rank == stage % 4
    # no rank runs two actions at once
    for rank in range(4):
        spans = sorted((e.start, e.end) for e in timeline.events if e.rank == rank)
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(spans, spans[1:]))


def test_uneven_stages_leave_a_larger_bubble():
    even = simulate("1f1b", forward_s=[1.0] * 4, backward_s=[2.0] * 4, micro_batches=8)
    uneven = simulate("1f1b", forward_s=[1.0, 1.0, 1.0, 2.0], backward_s=[2.0, 2.0, 2.0, 4.0],
                      micro_batches=8)
    assert uneven.makespan > even.makespan
    # the slowest stage paces the steady state: 3 forwards to fill, 8 x (F+B) of its own, 3 backwards to drain
    assert uneven.makespan == pytest.approx(3 * 1 + 8 * 6 + 3 * 2)


def test_schedules_refuse_what_torch_cannot_run():
    with pytest.raises(AutoparError, match="at least as many micro-batches"):
        schedule_actions("1f1b", pp=4, micro_batches=2)
    with pytest.raises(AutoparError, match="chunks per rank"):
        schedule_actions("gpipe", pp=2, micro_batches=4, virtual=2)
    with pytest.raises(AutoparError, match="unknown"):
        schedule_actions("pipedream", pp=2, micro_batches=4)


# --- cuts -----------------------------------------------------------------------------------

def test_uniform_weights_give_equal_parts():
    assert balanced_cuts([1.0] * 12, 4) == (0, 3, 6, 9, 12)
    assert balanced_cuts([1.0] * 3, 4) is None


def test_heavy_ends_take_fewer_blocks():
    weights = [2.0] + [1.0] * 8 + [2.0]          # embedding, 8 blocks, head
    cuts = balanced_cuts(weights, 2)
    assert max(sum(weights[a:b]) for a, b in zip(cuts, cuts[1:])) == 6.0
    cuts = balanced_cuts([3.0] + [1.0] * 8 + [1.0], 3)
    assert cuts[1] - cuts[0] < cuts[2] - cuts[1]     # the stage with the embedding holds fewer blocks


def test_balanced_cuts_are_optimal_against_brute_force():
    rng = random.Random(0)
    for _ in range(30):
        weights = [rng.uniform(0.1, 3.0) for _ in range(rng.randint(3, 9))]
        chunks = rng.randint(1, len(weights))
        best = min(max(sum(weights[a:b]) for a, b in zip((0, *inner), (*inner, len(weights))))
                   for inner in itertools.combinations(range(1, len(weights)), chunks - 1))
        cuts = balanced_cuts(weights, chunks)
        assert max(sum(weights[a:b]) for a, b in zip(cuts, cuts[1:])) == pytest.approx(best)


def test_units_of_a_gpt_and_its_uniform_cuts(graph):
    units = pipeline_units(graph)
    assert [u.name for u in units] == ["embedding", *[f"layers.{i}" for i in range(8)], "head"]
    assert "tok_emb" in units[0].layers and "lm_head" in units[-1].layers
    weights = unit_weights(graph, units, Mesh.parse("4:cpu"), tp=1)
    assert len(set(round(w, 12) for w in weights[1:-1])) == 1       # identical blocks cost the same
    assert uniform_cuts(units, 4) == (0, 3, 5, 7, 10)
    assert uniform_cuts(units, 3) is None


def test_grid_has_megatron_layouts():
    shapes = megatron_shapes(blocks=96, world=1024, gpus_per_node=8, global_batch=1536)
    layouts = {(s.tp, s.pp, s.dp) for s in shapes}
    assert (8, 16, 8) in layouts and (8, 8, 16) in layouts
    assert all(s.tp <= 8 and 96 % s.pp == 0 and s.tp * s.pp * s.dp == 1024 for s in shapes)
    assert any(s.virtual == 2 and s.schedule == "interleaved-1f1b" for s in shapes)


# --- the planner with the estimator ---------------------------------------------------------

def _search(graph, mesh, **kwargs):
    from autopar.solver.planner import search_pipeline

    return search_pipeline(graph, Mesh.parse(mesh), deadline=time.monotonic() + 60, **kwargs)


def _least_unpipelined_memory(graph, mesh, global_batch):
    """The least memory of any configuration without a pipeline, by the estimator."""
    from autopar.cost.config import Config
    from autopar.cost.estimator import estimate

    mesh = Mesh.parse(mesh)
    least = float("inf")
    for shape in megatron_shapes(8, mesh.world_size, mesh.gpus_per_node, global_batch):
        for recompute, zero in itertools.product(("none", "selective", "full"), (0, 1, 2, 3)):
            if shape.pp == 1 and (zero == 0 or shape.dp > 1):
                config = Config(tp=shape.tp, dp=shape.dp, global_batch=global_batch,
                                micro_batch=shape.micro_batch, recompute=recompute, zero=zero,
                                sequence_parallel=shape.sequence_parallel)
                least = min(least, estimate(graph, mesh, config).memory_per_gpu_bytes)
    return least


def test_memory_limit_that_forbids_the_unpipelined_plan_forces_stages(graph):
    # On 4 devices and a batch of 8: with fewer devices or samples, ZeRO-3 over all of them with
    # full recompute needs less than any stage of a pipeline, whose stages hold their model states
    # (fp32 gradients among them) unsharded.
    mesh, batch = "4x1:a100-80g", 8
    free = _search(graph, mesh, global_batch=batch, memory_limit=None)
    assert free.best.candidate.shape.pp == 1
    limit = 0.99 * _least_unpipelined_memory(graph, mesh, batch)
    forced = _search(graph, mesh, global_batch=batch, memory_limit=limit)
    best = forced.best
    # stages, or context parallelism: splitting the sequence also frees what the limit forbids
    assert best.candidate.shape.pp > 1 or best.candidate.shape.cp > 1
    assert best.memory_bytes <= limit
    assert best.step_time_s >= free.best.step_time_s       # the limit costs time, never gains it


def test_uniform_blocks_give_balanced_stages():
    """From a lopsided 4-stage cut, the search ends with two blocks per stage (the embedding and
    head of this model are light), and every rank's time within one block of the others."""
    from autopar.tracer import capture
    from autopar.models import build_model
    from autopar.solver.candidates import Candidate, Shape
    from autopar.solver.search import refine
    from autopar.solver.planner import new_search

    model, inputs = build_model("gpt:layers=8,hidden=128,heads=2,seq=64,vocab=64")
    light = capture(model, example_inputs=inputs)
    mesh = Mesh.parse("4x1:a100-80g")
    search = new_search(light, mesh, 8, float("inf"), time.monotonic() + 60)
    start = search.price(Candidate(Shape(1, 4, 1, 1, "1f1b"), (0, 1, 2, 3, 10), ("none",) * 4, (0,) * 4))
    best = refine(search, start, lambda tp: unit_weights(light, search.units, mesh, tp))
    cuts = best.candidate.cuts
    assert cuts == (0, 3, 5, 7, 10)
    times = [d["time_per_micro_batch_s"] for d in best.estimate.devices]
    assert best.step_time_s < start.step_time_s
    assert max(times) - min(times) < min(times) / 2


def test_impossible_memory_limit_is_a_clear_error(graph):
    with pytest.raises(InfeasibleError, match="least memory found"):
        _search(graph, "4:cpu", global_batch=8, memory_limit=1e5)


def test_plan_is_never_worse_than_the_best_grid_configuration(graph):
    from autopar.solver.search import Search
    from autopar.solver.planner import new_search, grid_phase

    mesh = Mesh.parse("2x2:a100-80g")
    search = new_search(graph, mesh, 16, mesh.device.memory_bytes, time.monotonic() + 60)
    blocks = 8
    grid = grid_phase(search, megatron_shapes(blocks, 4, 2, 16))
    grid_best = min(p.step_time_s for p in grid if p.fits)
    planned = _search(graph, "2x2:a100-80g", global_batch=16, memory_limit=None).best
    assert planned.step_time_s <= grid_best


def test_memory_sizes_parse():
    from autopar.api import parse_bytes

    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("40GB") == 40 * 10**9
    assert parse_bytes("512 MiB") == 512 * 2**20
    assert parse_bytes(123456) == parse_bytes("123456") == 123456
    with pytest.raises(AutoparError, match="80GiB"):
        parse_bytes("80 gigs")
    with pytest.raises(AutoparError, match="positive"):
        parse_bytes("0GiB")


def test_a_forced_configuration_is_a_plan_priced_like_estimate(graph):
    from autopar.api import plan_from_config
    from autopar.cost import estimate_plan
    from autopar.cost.config import Config

    mesh = Mesh.parse("2x2:a100-80g")
    config = Config(tp=2, pp=2, dp=1, global_batch=8, micro_batch=1, recompute="selective",
                    sequence_parallel=True)
    plan = plan_from_config(graph, mesh, config)
    assert (plan.tp, plan.pp, plan.dp, plan.micro_batches) == (2, 2, 1, 8)
    assert [s.recompute for s in plan.stages] == ["selective", "selective"]
    assert plan.stages[0].layers[-1] == "layers.3" and plan.stages[1].layers[0] == "layers.4"
    # the plan's price is that of its own placements (the ILP's, for the config's tensor axis)
    assert plan.predicted["step_time_s"] == estimate_plan(graph, plan).step_time_s
    assert plan.solver["status"] == "forced"
    with pytest.raises(AutoparError, match="inside a node"):
        plan_from_config(graph, mesh, Config(tp=4, global_batch=8))


def test_autopar_plan_from_a_module():
    import autopar
    from autopar.models import build_model

    model, inputs = build_model("gpt-tiny")
    plan = autopar.plan(model, "4:cpu", example_inputs=inputs, global_batch=8, memory_limit="1GiB",
                        time_limit=20)
    assert plan.world_size == 4 and plan.global_batch == 8
    assert plan.predicted["memory_per_gpu_bytes"] <= 2**30


def test_stage_pricing_of_uniform_cuts_equals_estimate(graph):
    """The planner's non-uniform pricing (estimate_stages over its units) agrees with `estimate`
    on Megatron's uniform stages, so grid and autopar rows are priced alike."""
    from autopar.solver.candidates import Candidate, Shape
    from autopar.solver.planner import new_search

    mesh = Mesh.parse("2x2:a100-80g")
    search = new_search(graph, mesh, 16, mesh.device.memory_bytes, time.monotonic() + 60)
    for shape, recompute in [(Shape(2, 2, 1, 1, "1f1b", 1, True), "full"),
                             (Shape(1, 2, 2, 2, "interleaved-1f1b", 2), "none")]:
        cuts = uniform_cuts(search.units, shape.pp * shape.virtual)
        chunks = len(cuts) - 1
        candidate = Candidate(shape, cuts, (recompute,) * chunks, (1,) * chunks)
        uniform = search.pricer.price(candidate, search.units, uniform=True)
        staged = search.pricer.stages_estimate(candidate, search.units)
        assert staged.step_time_s == uniform.step_time_s
        assert staged.memory_per_gpu_bytes == uniform.memory_bytes


def test_a_plans_sequence_parallelism_is_what_its_placements_do(graph):
    """A free plan's stages say sequence parallelism where the ILP split every value its norms
    read on the tensor axis, not wherever tp > 1; a forced configuration's say what it asked."""
    from autopar.solver.candidates import Shape
    from autopar.solver.candidate_prices import CandidatePricer, stream_is_split

    reads = graph.norm_inputs()
    assert reads
    assert not stream_is_split(graph, {value: ["R"] for value in reads})
    assert stream_is_split(graph, {value: ["S(1)"] for value in reads})
    assert not stream_is_split(graph, {value: ["S(1)"] for value in reads[1:]})   # one whole
    shape = Shape(2, 1, 1, 1, "1f1b", 1, True)
    for asked in (True, False):
        forced = CandidatePricer(graph=graph, mesh=Mesh.parse("2:cpu"), global_batch=8,
                                 memory_limit=2**40, sequence_parallel=asked)
        assert forced.splits_stream(shape) is asked
    assert forced.splits_stream(Shape(1, 2, 1, 1, "1f1b", 1, False)) is False
