"""Every pipeline schedule x ZeRO layout x tied/untied embedding that the planner can emit trains
on real gloo ranks exactly like one process.

The planner chooses a schedule for one or two chunks per pipeline rank (GPipe, 1F1B or zero-bubble
for one; interleaved 1F1B or zero-bubble for two; autopar.solver.candidates) and a ZeRO level per
chunk (`_zero_moves`: 0-3, the same for all or different per chunk). A tied embedding puts one
weight in the first and the last stage, whose copies' gradients are summed across pipeline ranks
(autopar.runtime.tied): a plan whose stages hold those copies at different ZeRO levels (one
sharded over the data-parallel ranks, one whole) once made the two ranks all-reduce gradients of
different sizes, and gloo aborted both processes. The default tier runs a slice: the tied model
under the layouts that once aborted, in train mode and in eval mode; the slow tier runs the whole
product, for a tied (OPT) and an untied (Llama) model.
"""

from dataclasses import replace
from itertools import product

import pytest
import torch
# Imported before the ranks fork, so that they inherit it (each would import it on its own).
import torch._dynamo  # noqa: F401
import torch.distributed as dist

import autopar
from autopar.cost.config import Config
from autopar.testing.equivalence import mismatches, train_single_process

pytest.importorskip("transformers")
from autopar.models.hf_zoo import ARCHITECTURES, loss_fn, resolve  # noqa: E402

pytestmark = pytest.mark.multiprocess

CLASSES = resolve(["opt", "llama"])
GLOBAL_BATCH, MICRO_BATCH, STEPS = 8, 2, 3
# (schedule, chunks per pipeline rank): what the search pairs (autopar.solver.candidates)
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("zero-bubble", 1), ("interleaved-1f1b", 2), ("zero-bubble", 2)]
# ZeRO level of each chunk, first to last: uniform, and the tied copies' stages (the first and the
# last) at levels that shard them differently
ZERO_LAYOUTS = ["0", "1", "2", "3", "1,0", "0,3", "2,0", "0,1"]


def zero_levels(layout: str, chunks: int) -> tuple[int, ...]:
    """`layout` for `chunks` stages: one level for all, or the first and last stage's levels (the
    stages between take the first's)."""
    levels = [int(level) for level in layout.split(",")]
    if len(levels) == 1:
        return tuple(levels * chunks)
    return tuple([levels[0]] * (chunks - 1) + [levels[1]])


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-3)


def build(name: str, train: bool):
    model = ARCHITECTURES[name].build(CLASSES[name])
    return model.train() if train else model


def pipeline_plan(graph, schedule: str, chunks: int, zero: tuple[int, ...]):
    """The planner's plan of pp2 x dp2 with this schedule and per-stage ZeRO levels. A forced Config
    names one ZeRO level and pairs two chunks with interleaved 1F1B only: the rest is set on the
    plan, as the search's moves set it."""
    config = Config(pp=2, dp=2, virtual=chunks, micro_batch=MICRO_BATCH, global_batch=GLOBAL_BATCH,
                    schedule="interleaved-1f1b" if chunks > 1 else schedule)
    plan = autopar.plan_from_config(graph, "4:cpu", config, time_limit=20)
    stages = [replace(stage, zero=level) for stage, level in zip(plan.stages, zero)]
    return replace(plan, schedule=schedule, stages=stages)


def train_combinations(name: str, combinations: list[tuple[str, int, str]], train: bool) -> list[dict]:
    """On every rank: each (schedule, chunks, ZeRO layout) compiled and trained; rank 0 compares
    with one process (in eval mode: dropout would differ)."""
    generator = torch.Generator().manual_seed(1)
    data = [ARCHITECTURES[name].batch(GLOBAL_BATCH, generator) for _ in range(STEPS)]
    example = tuple(x[:MICRO_BATCH] for x in data[0][:-1])
    graph = autopar.capture(build(name, train), example)
    reference = None if train or dist.get_rank() else train_single_process(
        build(name, train), data, loss_fn, adamw)
    reports = []
    for schedule, chunks, layout in combinations:
        plan = pipeline_plan(graph, schedule, chunks, zero_levels(layout, 2 * chunks))
        cm = autopar.compile(build(name, train), "4:cpu", example_inputs=example, loss_fn=loss_fn,
                             optimizer=adamw, plan=plan, graph=graph)
        losses = [cm.step(*batch) for batch in data]
        state = cm.full_state_dict()
        found = mismatches(reference, losses, state) if reference is not None else []
        reports.append({"case": f"{name} {schedule} x{chunks} zero {layout}", "losses": losses,
                        "zero": [stage.zero for stage in cm.plan.stages], "mismatches": found})
    return reports


def check(results: list[list[dict]], combinations: list) -> None:
    for (schedule, chunks, layout), report in zip(combinations, results[0]):
        assert report["zero"] == list(zero_levels(layout, 2 * chunks)), report["case"]
        assert report["mismatches"] == [], f"{report['case']}: {report['mismatches']}"
        assert all(abs(loss) < 1e3 for loss in report["losses"]), report["case"]
    for rank in results[1:]:
        assert [r["losses"] for r in rank] == [r["losses"] for r in results[0]]


# the plan (zero-bubble, the embedding's stage sharded, the head's whole), and interleaved
# zero-bubble with the head's stage at ZeRO-3 where the embedding's is whole
SLICE = [("zero-bubble", 1, "1,0"), ("zero-bubble", 2, "0,3")]


@pytest.mark.parametrize("train", [pytest.param(False, marks=pytest.mark.slow), True], ids=["eval", "train"])
def test_tied_copies_at_different_zero_levels_train_like_one_process(train):
    """In eval mode against one process; in train mode (dropout on) the same layouts run."""
    results = autopar.launch(train_combinations, 4, "opt", SLICE, train, timeout=400)
    check(results, SLICE)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["opt", "llama"])
def test_every_schedule_and_zero_layout_trains_like_one_process(name):
    combinations = [(schedule, chunks, layout) for (schedule, chunks), layout
                    in product(SCHEDULES, ZERO_LAYOUTS)]
    results = autopar.launch(train_combinations, 4, name, combinations, False, timeout=1800)
    check(results, combinations)


def _copies_checked_against_a_wrong_layout() -> str:
    """On every rank: the runtime's tied copies, described to the check with ZeRO levels that the
    stages do not have (both whole): the check must name the weight, not reach the all-reduce."""
    from autopar.errors import PlanMismatchError
    from autopar.runtime.tied import TiedWeights

    generator = torch.Generator().manual_seed(1)
    *inputs, _ = ARCHITECTURES["opt"].batch(GLOBAL_BATCH, generator)
    example = tuple(x[:MICRO_BATCH] for x in inputs)
    graph = autopar.capture(build("opt", False), example)
    cm = autopar.compile(build("opt", False), "4:cpu", example_inputs=example, loss_fn=loss_fn,
                         optimizer=adamw, plan=pipeline_plan(graph, "1f1b", 1, (1, 0)), graph=graph)
    try:
        TiedWeights(cm.programs, cm.layout.stage_rank, cm.layout.grid, cm.mesh.get_group("pp"),
                    zero=[0, 0], dp=2)
    except PlanMismatchError as err:
        return str(err)
    return "no error"


def test_a_tied_reduction_of_different_layouts_is_named_before_any_step():
    for message in autopar.launch(_copies_checked_against_a_wrong_layout, 4, timeout=300):
        assert "tied weight lm_head.weight on ranks" in message
        assert "shape [64, 64]" in message and "shape [128, 64]" in message
