"""autopar.plans.schedules against torch itself: a layout is accepted exactly when torch's
schedule class constructs it (no process group: stand-in stages), and what it accepts runs every
forward and backward once, in an order the simulator completes."""

from collections import Counter

import pytest

from autopar.errors import AutoparError
from autopar.plans.schedules import (SCHEDULES, check_schedule, runs, schedule_error,
                                      torch_schedule, valid_micro_batch_counts)
from autopar.timeline import _StandInStage, simulate


def _construct(schedule: str, pp: int, virtual: int, micro_batches: int, v_shape: bool = False):
    """Build the torch class autopar names for this layout, as rank 0 would."""
    from torch.distributed.pipelining import schedules as torch_schedules

    name = torch_schedule(schedule, virtual, v_shape)
    cls = getattr(torch_schedules, name)
    indices = [0, 2 * pp - 1] if v_shape else [chunk * pp for chunk in range(virtual)]
    stages = [_StandInStage(i, pp * virtual, pp, 0) for i in indices]
    if name in ("ScheduleGPipe", "Schedule1F1B"):
        return cls(stages[0], micro_batches)
    return cls(stages, micro_batches)


def _complete(built, stages: int, micro_batches: int) -> bool:
    """Every stage runs a forward and a backward (whole, or input then weight half) of every
    micro-batch exactly once, and nothing else."""
    count = Counter((a.computation_type.value, a.stage_index, a.microbatch_index)
                    for ops in built.pipeline_order.values() for a in ops
                    if a is not None and a.computation_type.value in "FBIW")
    expected = Counter()
    for stage in range(stages):
        for mb in range(micro_batches):
            expected[("F", stage, mb)] = 1
            if ("B", stage, mb) in count:
                expected[("B", stage, mb)] = 1
            else:
                expected[("I", stage, mb)] = expected[("W", stage, mb)] = 1
    return count == expected


@pytest.mark.parametrize("schedule,virtual", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 1),
                                              ("interleaved-1f1b", 2), ("interleaved-1f1b", 3),
                                              ("zero-bubble", 1), ("zero-bubble", 2)])
def test_accepted_exactly_when_torch_constructs_it(schedule, virtual):
    for pp in range(2, 7):
        for m in range(1, 26):
            try:
                built = _construct(schedule, pp, virtual, m)
            except ValueError:
                built = None
            assert runs(schedule, pp, m, virtual) == (built is not None), (schedule, pp, virtual, m)
            if built is not None and schedule not in ("gpipe", "1f1b"):
                assert _complete(built, pp * virtual, m), (schedule, pp, virtual, m)


def test_zbv_takes_two_stages_per_rank_and_any_count():
    for pp in (2, 3, 4):
        for m in (1, 3, 5, 7, 125):
            assert runs("zero-bubble", pp, m, 2, v_shape=True)
            assert _complete(_construct("zero-bubble", pp, 2, m, v_shape=True), 2 * pp, m)
    assert torch_schedule("zero-bubble", 3, v_shape=True) == "ScheduleInterleavedZeroBubble"


@pytest.mark.parametrize("pp,m", [(4, 125), (2, 5), (3, 7), (4, 9), (8, 250)])
def test_counts_torch_refuses_are_named_with_a_count_that_runs(pp, m):
    error = schedule_error("zero-bubble", pp, m)
    assert error is not None and "rounds" in error
    suggested = int(error.rsplit(";", 1)[1].split()[0])
    assert runs("zero-bubble", pp, suggested)
    with pytest.raises(AutoparError, match="not a valid schedule"):
        check_schedule("interleaved-1f1b", pp, m)


def test_single_stage_schedules_refuse_several_stages_per_rank():
    for schedule in ("gpipe", "1f1b"):
        assert "one stage per rank" in schedule_error(schedule, 2, 8, virtual=2)
    assert "at least as many micro-batches" in schedule_error("1f1b", 4, 3)
    assert "unknown" in schedule_error("pipedream", 2, 4)
    assert set(SCHEDULES) == {"gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"}


def test_what_is_accepted_simulates_to_the_end():
    for schedule, virtual in (("interleaved-1f1b", 2), ("zero-bubble", 1), ("zero-bubble", 2)):
        for pp in (2, 3, 4):
            for m in valid_micro_batch_counts(schedule, pp, virtual, upto=13):
                stages = pp * virtual
                timeline = simulate(schedule, forward_s=[1.0] * stages, backward_s=[2.0] * stages,
                                    micro_batches=m, virtual=virtual)
                assert len(timeline.events) >= 2 * stages * m
