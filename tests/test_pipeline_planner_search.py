"""What the inter-op search guarantees (no processes): odd global batches plan with a schedule torch
runs, the plan is the fastest fitting candidate the search priced, it is never slower than any
fitting configuration of the full Megatron grid (every ZeRO stage included), and when nothing can
run the error says why."""

import itertools

import pytest

from autopar.cost.config import Config
from autopar.cost.estimator import estimate
from autopar.cost.mesh import Mesh
from autopar.errors import AutoparError, InfeasibleError
from autopar.solver.candidates import layout_error
from autopar.plans.schedules import runs

SMALL_GPT = "gpt:layers=8,hidden=128,heads=2,seq=256,vocab=4096"
BLOCKS = 8


@pytest.fixture(scope="module")
def graphs():
    from autopar.tracer import capture
    from autopar.models import build_model

    return {name: capture(*build_model(name)) for name in (SMALL_GPT, "llama-tiny")}


def _plan(graph, mesh, batch, limit=None):
    from autopar.solver.planner import plan_and_search

    return plan_and_search(graph, Mesh.parse(mesh), global_batch=batch, memory_limit=limit,
                           time_limit=60)


def _check_runnable(plan):
    """The plan's own numbers: the batch divides exactly, and torch runs its schedule."""
    assert plan.dp * plan.micro_batch_size * plan.micro_batches == plan.global_batch
    if plan.pp > 1:
        assert runs(plan.schedule, plan.pp, plan.micro_batches, plan.virtual), plan.summary()


@pytest.mark.parametrize("batch", [5, 50, *(pytest.param(b, marks=pytest.mark.slow)
                                            for b in (6, 10, 14, 25, 125, 250))])
def test_odd_global_batches_plan_with_a_schedule_torch_runs(graphs, batch):
    # 8 devices, 4 per node; the model's 2 heads allow tp <= 2, so dp = 1 (odd batches) needs a
    # pipeline of 4 or 8 stages, where zero-bubble and interleaving need counts torch accepts
    for limit in (None, 2e8):
        plan, search = _plan(graphs[SMALL_GPT], "2x4:a100-80g", batch, limit)
        _check_runnable(plan)
        for priced in search.candidates():
            assert layout_error(priced.candidate.shape, batch) is None


def test_forced_pipelines_under_tight_memory_use_many_schedules(graphs):
    """Across batches and a tight limit the search prices every schedule, each only with micro-
    batch counts torch runs (the failure seen: zero-bubble with 125 micro-batches on 4 ranks)."""
    schedules = set()
    for batch in (125, 250, 1000):
        plan, search = _plan(graphs[SMALL_GPT], "2x4:a100-80g", batch, 4.2e8)
        _check_runnable(plan)
        for priced in search.candidates():
            shape = priced.candidate.shape
            if shape.pp > 1:
                schedules.add(shape.schedule)
                m = batch // (shape.dp * shape.micro_batch)
                assert runs(shape.schedule, shape.pp, m, shape.virtual)
    assert schedules == {"gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"}


def _grid(graph, mesh: Mesh, batch: int, limit: float, pricer):
    """Every Megatron-style configuration, enumerated here and not by the planner: TP inside a
    node, PP dividing the blocks, DP the rest, micro-batch sizes dividing a replica's batch, the
    schedules torch runs, every recompute and ZeRO stage; priced by `estimate` on the per-op
    placements `pricer.placements(tp)` (those a plan of that degree runs), with sequence
    parallelism where those placements split the residual stream (a stage that says it does
    while its norms read the stream whole is no plan's). The fitting ones."""
    fitting = []
    for tp, pp in itertools.product(range(1, mesh.gpus_per_node + 1), range(1, BLOCKS + 1)):
        if mesh.gpus_per_node % tp or BLOCKS % pp or mesh.world_size % (tp * pp):
            continue
        dp = mesh.world_size // (tp * pp)
        if batch % dp:
            continue
        for mbs in [b for b in (1, 2, 4, 8) if (batch // dp) % b == 0]:
            m = batch // (dp * mbs)
            layouts = [("1f1b", 1)] if pp == 1 else \
                [("gpipe", 1), ("1f1b", 1)] + [("interleaved-1f1b", v) for v in (2, 4)
                                               if BLOCKS % (pp * v) == 0]
            for (schedule, v), recompute, zero in itertools.product(
                    layouts, ("none", "selective", "full"), (0, 1, 2, 3) if dp > 1 else (0,)):
                if pp > 1 and not runs(schedule, pp, m, v):
                    continue
                config = Config(tp=tp, pp=pp, dp=dp, virtual=v, global_batch=batch, micro_batch=mbs,
                                recompute=recompute, zero=zero, schedule=schedule,
                                sequence_parallel=tp > 1 and pricer.tensor_axis(tp)[0]["splits_stream"])
                try:
                    priced = estimate(graph, mesh, config, placements=pricer.placements(tp))
                except AutoparError:
                    continue        # a degree the model does not divide
                if priced.memory_per_gpu_bytes <= limit:
                    fitting.append((priced.step_time_s, config))
    return fitting


# (model, mesh, global batch, memory limit as a fraction of the least the unconstrained plan
# needs: None is the device's memory; below 1 the limit binds and ZeRO or pipelines must step in)
CASES = [(SMALL_GPT, "2x2:a100-80g", 16, None), (SMALL_GPT, "2x1:cpu", 2, 0.9),
         (SMALL_GPT, "4:cpu", 8, 0.5), (SMALL_GPT, "2x4:a100-80g", 24, 0.3),
         (SMALL_GPT, "2x4:a100-80g", 250, 0.5), ("llama-tiny", "1x4:a100-40g", 32, None),
         ("llama-tiny", "1x4:a100-40g", 32, 0.3), ("llama-tiny", "4:cpu", 12, 0.5)]


# without a limit and under one in the default tier; the others in the slow one
SEARCH_DEFAULT = {(SMALL_GPT, "2x2:a100-80g", 16, None), (SMALL_GPT, "4:cpu", 8, 0.5)}


@pytest.mark.parametrize("model,mesh,batch,fraction",
                         [case if case in SEARCH_DEFAULT else pytest.param(*case, marks=pytest.mark.slow)
                          for case in CASES])
def test_plan_is_the_fastest_fitting_candidate_and_never_slower_than_the_grid(graphs, model, mesh,
                                                                             batch, fraction):
    graph = graphs[model]
    limit = None
    if fraction is not None:
        free, _ = _plan(graph, mesh, batch)
        limit = fraction * free.predicted["memory_per_gpu_bytes"]
    plan, search = _plan(graph, mesh, batch, limit)
    step = plan.predicted["step_time_s"]
    budget = limit or Mesh.parse(mesh).device.memory_bytes
    assert plan.predicted["memory_per_gpu_bytes"] <= budget
    fitting = [p for p in search.candidates() if p.fits]
    assert len(search.candidates()) > 1 and fitting
    assert step <= min(p.step_time_s for p in fitting)
    # ZeRO-2 and -3 are priced wherever there is data parallelism, not only when nothing fits
    # (ZeRO-2 is not priced for a shape where ZeRO-3, which needs less, fits at no recompute level)
    data_parallel = [p for p in search.candidates() if p.candidate.shape.dp > 1]
    zeros = {z for p in data_parallel for z in p.candidate.zero}
    if data_parallel:
        assert 3 in zeros
    if any(p.fits and 3 in p.candidate.zero for p in data_parallel):
        assert 2 in zeros
    grid = _grid(graph, Mesh.parse(mesh), batch, budget, search.pricer)
    if grid:
        best, config = min(grid, key=lambda pair: pair[0])
        assert step <= best * (1 + 1e-9), f"{plan.summary()} is slower than {config}"


def test_zero3_wins_over_a_pipeline_when_it_fits_and_is_faster(graphs):
    """Two devices, a batch of 2: a limit below what ZeRO-1 data parallelism needs but above
    ZeRO-3's must not push the plan into a pipeline the estimator itself prices slower."""
    graph, mesh = graphs[SMALL_GPT], Mesh.parse("2x1:cpu")
    priced = {zero: estimate(graph, mesh, Config(dp=2, global_batch=2, zero=zero))
              for zero in (1, 3)}
    limit = (priced[1].memory_per_gpu_bytes + priced[3].memory_per_gpu_bytes) / 2
    assert priced[3].memory_per_gpu_bytes < limit < priced[1].memory_per_gpu_bytes
    plan, _ = _plan(graph, "2x1:cpu", 2, limit)
    assert plan.predicted["step_time_s"] <= priced[3].step_time_s


def test_infeasible_errors_name_the_batches_or_memory_that_would_plan(graphs):
    with pytest.raises(InfeasibleError, match=r"multiple of 16, e\.g\. 16"):
        _plan(graphs[SMALL_GPT], "128x8:a100-80g", 3)
    # sizes in the unit that keeps them at least 1 (1e5 bytes is 97.7 KiB, not 0.0 GiB)
    with pytest.raises(InfeasibleError,
                       match=r"no plan fits 97.66 KiB per device; the least memory found is [1-9]"):
        _plan(graphs[SMALL_GPT], "4:cpu", 8, 1e5)


def test_a_forced_configuration_torch_cannot_schedule_is_refused_by_name(graphs):
    from autopar.solver.planner import plan_config

    config = Config(tp=1, pp=4, dp=2, global_batch=250, micro_batch=1, schedule="interleaved-1f1b",
                    virtual=2)
    with pytest.raises(AutoparError, match="125 micro-batches.*rounds"):
        plan_config(graphs[SMALL_GPT], Mesh.parse("1x8:a100-80g"), config)


def test_a_search_the_clock_cuts_short_still_refines_what_it_found(graphs, monkeypatch):
    """The phases stop early enough to leave the local search its share of the time: a plan cut
    short by the clock is refined from the best layouts found (and says it was cut short)."""
    import time

    from autopar.solver import planner

    refined = []
    real_refine = planner.refine

    def slow_uneven_phase(search, shapes, weights_for):
        while not search.out_of_time():      # the phases' deadline passes in here
            time.sleep(0.05)
        return []

    def counted_refine(search, seed, weights_for):
        refined.append(not search.out_of_time())
        return real_refine(search, seed, weights_for)

    monkeypatch.setattr(planner, "uneven_phase", slow_uneven_phase)
    monkeypatch.setattr(planner, "refine", counted_refine)
    plan, search = planner.plan_and_search(graphs[SMALL_GPT], Mesh.parse("2x4:a100-80g"), global_batch=32,
                                           time_limit=8)
    assert plan.solver["status"] == "time_limit" and search.timed_out
    assert refined and all(refined), "the refinement had no time left"
