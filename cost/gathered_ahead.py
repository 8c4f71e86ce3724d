"""The chunks ZeRO-3 holds gathered whole ahead of their turn under the interleaved schedule.

torch's schedule runtime (`_PipelineScheduleRuntime`, which runs interleaved 1F1B) gathers a
chunk whole, every FSDP group in it at once, when the chunk enters the next ACTIVE_CHUNKS
distinct chunks the rank will compute, and frees the chunks that leave that window
(`torch.distributed.pipelining.schedules._add_unshard_reshard`). FSDP2's own hooks free each
group after its forward, and autopar's `ReshardingStage` after its backward, but a chunk gathered
whole stays whole until it runs. Which chunks wait so at the rank's fullest moment depends on
the order of its actions: with more chunks than the window, chunks leave it and are gathered
whole again in the steady state, beside the most activations the rank holds; with fewer, each
is gathered once, at the step's start, and on the later stages may still wait at the fullest
moment. A bound (the largest chunks) over-prices the ranks whose largest chunks never wait
then, so the order is walked.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

from autopar.cost.chunk_price import padded_ratios, poly_at
from autopar.plans.schedules import check_schedule
from autopar.plans.vocabulary import Schedule

ACTIVE_CHUNKS = 3       # _add_unshard_reshard's max_active_stages


@dataclass(frozen=True)
class Moment:
    """A compute action of a rank: forward or backward ("F", "B"), its chunk (0..virtual-1 on
    the rank), whether that chunk starts it gathered whole, the rank's other chunks gathered
    whole, waiting, and the chunks whose backward has run before it (which hold their gradients'
    shards and their last reduce-scatter's input)."""
    kind: str
    running: int
    whole: bool
    waiting: tuple[int, ...]
    backed: tuple[int, ...]

    def extra(self, params: list[float], gathered: list[float]) -> float:
        """Elements gathered beyond the running chunk's usual groups (`gathered`, per chunk):
        the waiting chunks whole (`params`, per chunk), and the running one where it starts so."""
        own = params[self.running] - gathered[self.running] if self.whole else 0.0
        return sum(params[w] for w in self.waiting) + own

    def gradients(self, params: list[float], lasts: list[float]) -> "Backed":
        """What the chunks `backed` hold, from their elements (`params`, `lasts`, per chunk)."""
        return Backed(sum(params[c] for c in self.backed) / sum(params), self.running in self.backed,
                      sum(lasts[c] for c in self.backed))


class Backed(NamedTuple):
    """The gradients a rank holds at a moment, from the backwards run before it: their chunks'
    share of its gradient shards, whether the running chunk is one of them (its backward adds
    into its shards rather than making them), their last reduce-scatter inputs' elements."""
    share: float
    running: bool
    lasts: float


def at_fullest(chunks: list, lasts: list[float], *, zero: int, schedule: str, pp: int, micro_batches: int,
               virtual: int, stage: int, b, seq_ratio) -> tuple[list, list]:
    """For a rank's `chunks` (cost.chunk_price.Chunk) whose last reduce-scatter inputs are `lasts`
    elements: what each chunk's backward meets (`backward_situations`) and peak_bytes's
    `forwards` of its fullest forwards (`forward_ends`); where no order is walked, the largest
    forward's with every chunk's gradients."""
    walk = gathering_moments(zero, schedule, pp=pp, micro_batches=micro_batches, virtual=virtual, stage=stage)
    sizes = dict(params=[c.params for c in chunks], gathered=[c.gathered for c in chunks], lasts=lasts)
    outs = [b * max(poly_at(p, seq_ratio) for p in [{}, *c.peak_polys]) for c in chunks]
    groups = [2 * c.group * padded_ratios(c)[0] for c in chunks]
    ends = forward_ends(walk, groups=groups, outs=outs, **sizes) or [(max(groups), max(outs), None)]
    return backward_situations(walk, **sizes), ends


def gathering_moments(zero: int, schedule: str, *, pp: int, micro_batches: int, virtual: int,
                      stage: int) -> tuple[Moment, ...]:
    """The rank's fullest moments where ZeRO-3 gathers chunks ahead (`fullest_moments`); none
    under other schedules and ZeRO stages."""
    if zero < 3 or schedule != Schedule.INTERLEAVED_1F1B:
        return ()
    return fullest_moments(pp, micro_batches, virtual, stage)


def backward_situations(moments: tuple[Moment, ...], *, params: list[float], gathered: list[float],
                        lasts: list[float]) -> list[list[tuple]]:
    """For each of a rank's chunks, what its backward meets at each of the fullest `moments` it
    runs at: (the other chunks' last reduce-scatter inputs held, elements gathered beyond its
    usual groups, `Backed`). A chunk that runs at none is priced as on a rank whose order is not
    walked: every other chunk's input held, nothing gathered ahead, an earlier backward's
    gradients (`Backed` None)."""
    situations = [[] for _ in params]
    for moment in moments:
        if moment.kind == "B":
            backed = moment.gradients(params, lasts)
            others = backed.lasts - (lasts[moment.running] if backed.running else 0.0)
            situations[moment.running].append((others, moment.extra(params, gathered), backed))
    return [list(dict.fromkeys(found)) or [(sum(lasts) - own, 0.0, None)] for found, own in zip(situations, lasts)]


def forward_ends(moments: tuple[Moment, ...], *, groups: list[float], outs: list[float], params: list[float],
                 gathered: list[float], lasts: list[float]) -> list[tuple]:
    """cost.memory.peak_bytes's `forwards` at each of the fullest `moments` that is a forward:
    the elements gathered (the running chunk's, `groups`: its largest group's weights and
    all-gather output, cost/memory.py; with what is gathered ahead), its transient bytes (`outs`,
    per chunk), and the gradients of the chunks that ran a backward before it (`Backed`: their
    share of the rank's gradient shards, their last reduce-scatter inputs, `lasts` per chunk). A
    forward before any backward holds no gradients."""
    return [(groups[m.running] + m.extra(params, gathered), outs[m.running], m.gradients(params, lasts))
            for m in moments if m.kind == "F"]


@lru_cache(maxsize=512)
def fullest_moments(pp: int, micro_batches: int, virtual: int, stage: int) -> tuple[Moment, ...]:
    """The compute actions of `stage`'s interleaved 1F1B order at which it holds the most forward
    activations (a forward counted from its start), with what is gathered whole at each."""
    walked = list(_walk(_order(pp, micro_batches, virtual, stage)))
    most = max(held for held, _ in walked)
    return tuple(_moment(state) for state in dict.fromkeys(state for held, state in walked if held == most))


def moments(pp: int, micro_batches: int, virtual: int, stage: int) -> list[tuple[int, Moment]]:
    """Each compute action of `stage`'s interleaved 1F1B order (torch's), in turn: the (chunk,
    micro-batch) forward activations the rank holds then, and what is gathered whole."""
    return [(held, _moment(state)) for held, state in _walk(_order(pp, micro_batches, virtual, stage))]


def _walk(order: list[tuple[str, int]]):
    """(forward activations held, (kind, chunk, chunks gathered whole, chunks backed)) at each
    action in turn, sets of chunks as bit masks (a plan has thousands of actions a rank)."""
    held, active, whole, backed = 0, 0, 0, 0
    for (kind, chunk), window in zip(order, _windows(order)):
        # the runtime frees the chunks that left the window and gathers those that entered it
        whole, active = (whole & window) | (window & ~active), window
        held += kind == "F"
        yield held, (kind, chunk, whole, backed)
        whole &= ~(1 << chunk)
        held -= kind == "B"
        backed |= (1 << chunk) if kind == "B" else 0


def _moment(state: tuple) -> Moment:
    kind, chunk, whole, backed = state
    chunks = lambda mask: tuple(c for c in range(mask.bit_length()) if mask >> c & 1)
    return Moment(kind, chunk, bool(whole >> chunk & 1), chunks(whole & ~(1 << chunk)), chunks(backed))


def _order(pp: int, micro_batches: int, virtual: int, stage: int) -> list[tuple[str, int]]:
    """`stage`'s compute actions in torch's interleaved 1F1B order as (kind, its chunk on the
    rank). torch's constructor also lowers every rank's order with its communication, a hundred
    times the work of one rank's compute order, which the estimator asks for per candidate plan:
    this computes that one order alone (tests/test_cost.py checks it equals the constructor's)."""
    from torch.distributed.pipelining import schedules as torch_schedules

    check_schedule(Schedule.INTERLEAVED_1F1B, pp, micro_batches, virtual)
    schedule = object.__new__(torch_schedules.ScheduleInterleaved1F1B)
    rounds = max(1, micro_batches // pp)
    schedule.pp_group_size, schedule.n_local_stages, schedule._n_microbatches = pp, virtual, micro_batches
    schedule.number_of_rounds, schedule.microbatches_per_round = rounds, micro_batches // rounds
    return [(action.computation_type.value, action.stage_index // pp)
            for action in schedule._calculate_single_rank_operations(stage) if action is not None]


def _windows(order: list[tuple[str, int]]) -> list[int]:
    """At each action, the next ACTIVE_CHUNKS distinct chunks the rank computes from it on, as a
    bit mask (built from the end: an action's chunk, then the next action's without it)."""
    windows, ahead = [], []
    for _, chunk in reversed(order):
        ahead = [chunk, *(c for c in ahead if c != chunk)][:ACTIVE_CHUNKS]
        windows.append(sum(1 << c for c in ahead))
    return windows[::-1]
