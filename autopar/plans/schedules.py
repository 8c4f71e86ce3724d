"""What torch.distributed.pipelining (torch 2.13) runs: the one place that says which schedule,
pipeline depth, chunks per rank and micro-batch count make a schedule torch can construct and run.

The planner generates only candidates these rules accept, and the runtime builds the torch
schedule these rules name, so a plan never names a schedule that fails when the runtime builds it.
No torch import: plans stay torch-free.

The rules, read from torch/distributed/pipelining/schedules.py and checked by constructing every
class for 1-8 ranks, 1-4 chunks per rank and 1-40 micro-batches (tests/test_pipeline_schedules.py):

    ScheduleGPipe                  one stage per rank; any micro-batch count
    Schedule1F1B                   one stage per rank; micro-batches >= stages ("must be greater
                                   than or equal to the number of stages")
    ScheduleInterleaved1F1B        any stages per rank, placed round-robin (stage s on rank s % pp);
    ScheduleInterleavedZeroBubble  rounds = max(1, m // pp) must divide m (so m % pp == 0, or
                                   m < 2 pp, or m // pp dividing m as 10 on 4 ranks does)
    ScheduleZBVZeroBubble          exactly two stages per rank in a V (rank r holds stages r and
                                   2 pp - 1 - r); any micro-batch count

autopar's names map onto them: "gpipe" and "1f1b" are the single-stage classes, "interleaved-1f1b"
is ScheduleInterleaved1F1B at any chunk count, and "zero-bubble" is ScheduleZBVZeroBubble when the
stages form a V and ScheduleInterleavedZeroBubble otherwise (the planner places chunks round-robin).
"""

from __future__ import annotations

from collections.abc import Sequence

from autopar.plans.vocabulary import SCHEDULES, Recompute, Schedule
from autopar.errors import AutoparError


def torch_schedule(schedule: str, stages_per_rank: int, v_shape: bool = False) -> str:
    """The name of the torch.distributed.pipelining class that runs `schedule` with this many
    stages on each rank (`v_shape`: rank r holds stages r and 2 pp - 1 - r)."""
    if schedule not in SCHEDULES:
        raise AutoparError(f"schedule {schedule!r} is unknown; expected one of {', '.join(SCHEDULES)}")
    if schedule in (Schedule.GPIPE, Schedule.ONE_F_ONE_B):
        if stages_per_rank != 1:
            raise AutoparError(f"schedule {schedule!r} runs one stage per rank, but each rank holds "
                               f"{stages_per_rank}; use 'interleaved-1f1b' or 'zero-bubble'")
        return "ScheduleGPipe" if schedule == Schedule.GPIPE else "Schedule1F1B"
    if schedule == Schedule.INTERLEAVED_1F1B:
        return "ScheduleInterleaved1F1B"
    if v_shape and stages_per_rank == 2:
        return "ScheduleZBVZeroBubble"
    return "ScheduleInterleavedZeroBubble"


def schedule_error(schedule: str, pp: int, micro_batches: int, virtual: int = 1,
                   v_shape: bool = False) -> str | None:
    """Why torch cannot run `schedule` on `pp` pipeline ranks holding `virtual` stages each with
    `micro_batches` micro-batches per step; None when it can."""
    for name, value in (("pipeline ranks", pp), ("micro-batches", micro_batches),
                        ("stages per rank", virtual)):
        if value < 1:
            return f"{value} {name}: at least 1 is needed"
    try:
        torch_class = torch_schedule(schedule, virtual, v_shape)
    except AutoparError as err:
        return str(err)
    if torch_class == "Schedule1F1B" and micro_batches < pp:
        return (f"1F1B needs at least as many micro-batches as stages ({micro_batches} < {pp}); "
                f"use more micro-batches or the gpipe schedule")
    interleaved = torch_class in ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble")
    if interleaved and not _rounds_divide(pp, micro_batches):
        rounds = max(1, micro_batches // pp)
        near = min((m for m in range(1, 2 * micro_batches + pp) if _rounds_divide(pp, m)),
                   key=lambda m: (abs(m - micro_batches), m))
        return (f"{schedule} on {pp} ranks runs {micro_batches} micro-batches in {rounds} rounds "
                f"of {micro_batches // rounds}, which leaves {micro_batches % rounds} over (torch's "
                f"{torch_class} needs the rounds, max(1, m // {pp}), to divide m); {near} "
                f"micro-batches would run")
    return None


def recompute_error(schedule: str, recomputes: Sequence[str]) -> str | None:
    """Why torch's zero-bubble schedule should not train stages that recompute (`recomputes`:
    each stage's level); None when it may. Its split backward runs the input gradients and
    then each parameter group's weight gradients as autograd passes of their own; torch's
    checkpoint reruns a recomputed region in every pass that reads what it saved, and keeps what
    that pass does not read until the micro-batch's last pass. Simulated (llama, 4 layers,
    pp2 x dp2, bf16): the last stage's peak is 9.47 MiB without recompute, 9.25 under selective
    and 12.44 under full recompute, with the layer rerun once per weight it reads."""
    if schedule != Schedule.ZERO_BUBBLE or all(r == Recompute.NONE for r in recomputes):
        return None
    return ("the zero-bubble schedule does not recompute: its split backward makes torch's "
            "checkpoint rerun a recomputed layer once per weight and keep the reruns' activations "
            "until the weight backward, which holds as much as no recompute (more under full "
            "recompute); use schedule '1f1b' or 'interleaved-1f1b' with recompute, or zero-bubble "
            "with recompute 'none'")


def relay_error(schedule: str, relayed: Sequence[str]) -> str | None:
    """Why torch cannot train `schedule` on stages that relay the activations `relayed` (values a
    stage reads more than one stage after the stage computing them, passed along the stages
    between; autopar.plans.stage_flow finds them); None when it can. Seen on T5, whose encoder
    output every decoder stage reads: the split backward of torch's zero-bubble schedules
    (gradients of the inputs first, of the weights later) then gives gradients that differ from
    one process, where 1F1B's and GPipe's whole backward does not."""
    if schedule != Schedule.ZERO_BUBBLE or not relayed:
        return None
    return (f"the zero-bubble schedule cannot train these stages: activations such as "
            f"{relayed[0]} are read more than one stage after the one that computes them, and "
            f"zero-bubble's split backward trains such relayed values wrong; use schedule '1f1b' "
            f"or 'interleaved-1f1b', or cut the model where no activation skips a stage")


def _rounds_divide(pp: int, micro_batches: int) -> bool:
    """The interleaved classes split the micro-batches into max(1, m // pp) equal rounds."""
    return micro_batches % max(1, micro_batches // pp) == 0


def runs(schedule: str, pp: int, micro_batches: int, virtual: int = 1, v_shape: bool = False) -> bool:
    return schedule_error(schedule, pp, micro_batches, virtual, v_shape) is None


def check_schedule(schedule: str, pp: int, micro_batches: int, virtual: int = 1,
                   v_shape: bool = False) -> None:
    """Raise AutoparError naming the problem when torch cannot run the schedule."""
    error = schedule_error(schedule, pp, micro_batches, virtual, v_shape)
    if error is not None:
        raise AutoparError(f"{schedule} with {pp} ranks, {virtual} chunks per rank and "
                           f"{micro_batches} micro-batches is not a valid schedule: {error}")


def valid_micro_batch_counts(schedule: str, pp: int, virtual: int = 1, *, upto: int) -> list[int]:
    """The micro-batch counts 1..upto that torch runs (m % pp == 0 always does)."""
    return [m for m in range(1, max(upto, pp) + 1) if runs(schedule, pp, m, virtual)]
