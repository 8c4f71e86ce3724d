"""Pipeline schedules as data, a process-free simulator of them, and the timeline picture.

The order of actions on each pipeline rank comes from torch.distributed.pipelining itself: its
schedule classes compute `pipeline_order` ({rank: [action such as 2F0, 2B0, 2I0, 2W0]}) in their
constructors from nothing but the stage indices, the group size and the micro-batch count, so they
are built here with stand-in stage objects and no process group. What torch runs is what autopar
simulates.

The simulator replays each rank's actions in torch's order; an action starts when its rank is free
and its inputs exist: a forward needs the previous stage's forward of the same micro-batch, a
backward (or its input-gradient half, I) needs the next stage's backward and its own forward, a
weight-gradient half (W) needs its I. Sends between ranks cost `send_s`.

bubble_fraction = makespan / (busiest rank's compute) - 1, Megatron's definition: (p-1)/m for
GPipe and 1F1B with equal stages, (p-1)/(v m) for interleaved 1F1B with v chunks per rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from autopar.errors import AutoparError
from autopar.plans.schedules import check_schedule
from autopar.plans.vocabulary import Schedule

COMPUTE_KINDS = ("F", "B", "I", "W")
COLORS = {"F": "#4C72B0", "B": "#DD8452", "I": "#DD8452", "W": "#55A868"}


@dataclass(frozen=True, slots=True)
class Action:
    kind: str           # F forward, B full backward, I input-gradient backward, W weight-gradient backward
    stage: int          # model chunk index, 0 .. pp * virtual - 1
    micro_batch: int


@dataclass(frozen=True, slots=True)
class Event:
    rank: int
    action: Action
    start: float
    end: float


@dataclass(kw_only=True, slots=True)
class Timeline:
    schedule: str
    pp: int
    virtual: int
    micro_batches: int
    events: list[Event] = field(default_factory=list)

    @property
    def makespan(self) -> float:
        return max(e.end for e in self.events) - min(e.start for e in self.events)

    def busy(self, rank: int) -> float:
        return sum(e.end - e.start for e in self.events if e.rank == rank)

    @property
    def bubble_fraction(self) -> float:
        return self.makespan / max(self.busy(r) for r in range(self.pp)) - 1.0


class _StandInStage:
    """What torch's schedule constructors read from a PipelineStage to compute the action order."""

    def __init__(self, index: int, num_stages: int, group_size: int, group_rank: int):
        import torch

        self.stage_index = index
        self.num_stages = num_stages
        self.group_size = group_size
        self.group_rank = group_rank
        self.is_first = index == 0
        self.is_last = index == num_stages - 1
        self.stage_index_to_group_rank = {}
        self.submod = torch.nn.Module()


def schedule_actions(schedule: str, pp: int, micro_batches: int, virtual: int = 1) -> dict[int, list[Action]]:
    """Compute actions per pipeline rank in torch's order for one of autopar's schedule names."""
    from torch.distributed.pipelining import schedules as torch_schedules

    # the rules of what torch runs live in one place, shared with the planner and the runtime
    check_schedule(schedule, pp, micro_batches, virtual)
    classes = {Schedule.GPIPE: torch_schedules.ScheduleGPipe,
               Schedule.INTERLEAVED_1F1B: torch_schedules.ScheduleInterleaved1F1B,
               Schedule.ZERO_BUBBLE: torch_schedules.ScheduleInterleavedZeroBubble}
    num_stages = pp * virtual
    if schedule == Schedule.ONE_F_ONE_B:
        return {rank: _one_f_one_b(rank, pp, micro_batches) for rank in range(pp)}
    if schedule == Schedule.GPIPE:
        built = classes[schedule](_StandInStage(0, num_stages, pp, 0), micro_batches)
    else:
        stages = [_StandInStage(chunk * pp, num_stages, pp, 0) for chunk in range(virtual)]
        try:
            built = classes[schedule](stages, micro_batches)
        except ValueError as err:
            raise AutoparError(f"{schedule} with {pp} ranks, {virtual} chunks and {micro_batches} "
                               f"micro-batches is not a valid schedule: {err}") from None
    return {rank: [Action(a.computation_type.value, a.stage_index, a.microbatch_index)
                   for a in ops if a is not None and a.computation_type.value in COMPUTE_KINDS]
            for rank, ops in built.pipeline_order.items()}


def _one_f_one_b(rank: int, pp: int, micro_batches: int) -> list[Action]:
    """The order Schedule1F1B._step_microbatches runs (its `pipeline_order`, used only for display,
    numbers the last rank's forwards from 1): p - rank forwards, then backward/forward pairs."""
    warmup = min(micro_batches, pp - rank)
    order = [Action("F", rank, mb) for mb in range(warmup)]
    for backward in range(micro_batches):
        order.append(Action("B", rank, backward))
        if warmup + backward < micro_batches:
            order.append(Action("F", rank, warmup + backward))
    return order


def simulate(schedule: str, *, forward_s, backward_s, micro_batches: int, virtual: int = 1,
             send_s: float = 0.0, input_grad_share: float = 0.5) -> Timeline:
    """Replay torch's action order with per-stage forward and backward times (lists over the
    pp * virtual model chunks, or one number for all). In zero-bubble schedules a backward splits
    into I (`input_grad_share` of it) and W (the rest)."""
    num_stages = len(forward_s) if isinstance(forward_s, (list, tuple)) else None
    if num_stages is None:
        raise AutoparError("simulate needs forward_s as a list with one time per model chunk")
    if num_stages % virtual:
        raise AutoparError(f"{num_stages} model chunks do not divide into {virtual} chunks per rank")
    pp = num_stages // virtual
    duration = {"F": list(forward_s), "B": list(backward_s),
                "I": [b * input_grad_share for b in backward_s],
                "W": [b * (1.0 - input_grad_share) for b in backward_s]}
    actions = schedule_actions(schedule, pp, micro_batches, virtual)
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * pp
    position = [0] * pp
    timeline = Timeline(schedule=schedule, pp=pp, virtual=virtual, micro_batches=micro_batches)
    remaining = sum(len(a) for a in actions.values())
    while remaining:
        progressed = False
        for rank in range(pp):
            while position[rank] < len(actions[rank]):
                action = actions[rank][position[rank]]
                ready = _ready_time(action, done, num_stages, send_s if pp > 1 else 0.0)
                if ready is None:
                    break
                start = max(free[rank], ready)
                end = start + duration[action.kind][action.stage]
                done[(action.kind, action.stage, action.micro_batch)] = end
                timeline.events.append(Event(rank, action, start, end))
                free[rank] = end
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: actions[r][position[r]] for r in range(pp) if position[r] < len(actions[r])}
            raise AutoparError(f"schedule {schedule} deadlocks in simulation at {stuck}")
    return timeline


def _ready_time(action: Action, done: dict, num_stages: int, send_s: float) -> float | None:
    """When the inputs of `action` exist, or None while one of them has not run yet."""
    s, mb = action.stage, action.micro_batch
    if action.kind == "F":
        needs = [] if s == 0 else [(("F", s - 1, mb), send_s)]
    elif action.kind == "W":
        needs = [(("I", s, mb), 0.0)]
    else:
        needs = [(("F", s, mb), 0.0)]
        if s < num_stages - 1:
            upstream = ("I", s + 1, mb) if ("I", s + 1, mb) in done else ("B", s + 1, mb)
            needs.append((upstream, send_s))
    times = []
    for key, delay in needs:
        if key not in done:
            return None
        times.append(done[key] + delay)
    return max(times, default=0.0)


def save_png(timeline: Timeline, path: str | Path, title: str = "") -> None:
    """Forward and backward boxes per pipeline rank and micro-batch, time on the x axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, ax = plt.subplots(figsize=(12, 0.6 * timeline.pp + 1.6))
    scale, unit = _time_unit(timeline.makespan)
    # One collection of boxes per (rank, kind, chunk), not one artist per box: a plan with
    # thousands of micro-batches draws in a second instead of minutes.
    boxes: dict[tuple[int, str, int], list[tuple[float, float]]] = {}
    labelled = timeline.makespan * scale / 60     # boxes wide enough to carry their micro-batch
    for event in timeline.events:
        width = (event.end - event.start) * scale
        key = (event.rank, event.action.kind, event.action.stage // timeline.pp)
        boxes.setdefault(key, []).append((event.start * scale, width))
        if width > labelled:
            ax.text(event.start * scale + width / 2, event.rank, str(event.action.micro_batch),
                    ha="center", va="center", fontsize=7, color="white")
    for (rank, kind, chunk), spans in boxes.items():
        fade = 0.35 * chunk / (timeline.virtual - 1) if timeline.virtual > 1 else 0.0
        ax.broken_barh(spans, (rank - 0.4, 0.8), facecolors=COLORS[kind], edgecolor="white",
                       linewidth=0.5 if len(spans) < 500 else 0, alpha=1.0 - fade)
    ax.set_yticks(range(timeline.pp), [f"rank {r}" for r in range(timeline.pp)])
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({unit})")
    kinds = sorted({e.action.kind for e in timeline.events}, key=COMPUTE_KINDS.index)
    names = {"F": "forward", "B": "backward", "I": "backward (input grad)", "W": "backward (weight grad)"}
    ax.legend(handles=[Patch(color=COLORS[k], label=names[k]) for k in kinds], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.set_title(title or f"{timeline.schedule}: {timeline.pp} ranks, {timeline.micro_batches} micro-batches"
                 f", bubble {timeline.bubble_fraction:.1%}", loc="left",
                 parse_math=False)   # a title from a plan file is text, never TeX
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _time_unit(seconds: float) -> tuple[float, str]:
    if seconds >= 1.0:
        return 1.0, "s"
    return (1e3, "ms") if seconds >= 1e-3 else (1e6, "us")


def plan_timeline(plan) -> Timeline:
    """Simulate a Plan's schedule with each stage's predicted time per micro-batch
    (`chunk_time_per_micro_batch_s`; for plans without it, its pipeline rank's time shared among
    the rank's chunks by layer count), backward twice the forward."""
    stages, pp = plan.stages, plan.pp
    layers = [max(1, len(s.layers)) for s in stages]
    fallback = ((plan.predicted.get("breakdown") or {}).get("compute")
                or plan.predicted.get("step_time_s", 1.0)) / plan.micro_batches
    totals = []
    for i, stage in enumerate(stages):
        if "chunk_time_per_micro_batch_s" in stage.predicted:
            totals.append(stage.predicted["chunk_time_per_micro_batch_s"])
        else:
            rank_time = stage.predicted.get("time_per_micro_batch_s", fallback)
            totals.append(rank_time * layers[i] / sum(layers[i % pp::pp]))
    return simulate(plan.schedule, forward_s=[t / 3 for t in totals],
                    backward_s=[2 * t / 3 for t in totals], micro_batches=plan.micro_batches,
                    virtual=plan.virtual)
