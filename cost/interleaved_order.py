"""What an interleaved 1F1B rank holds at each of its actions, from torch's order of them.

Two mechanisms of torch's schedule runtime (`_PipelineScheduleRuntime`, which runs interleaved
1F1B) make it depend on the order:
- Under ZeRO-3 it gathers a chunk whole, every FSDP group in it at once, when the chunk enters
  the next ACTIVE_CHUNKS distinct chunks the rank will compute, and frees the chunks that leave
  that window (`torch.distributed.pipelining.schedules._add_unshard_reshard`). FSDP2's own hooks
  free each group after its forward, and autopar's `ReshardingStage` after its backward, but a
  chunk gathered whole stays whole until it runs. With more chunks than the window, chunks leave
  it and are gathered whole again in the steady state, beside the most activations the rank
  holds; with fewer, each is gathered once, at the step's start, and on the later stages may
  still wait at the fullest moment.
- Right after a chunk's last micro-batch's backward it reduces that chunk's gradients and
  reshards it (its REDUCE_GRAD action, `_add_reduce_grad`): under every ZeRO stage the chunk
  lets go of its gathered weights and its last reduce-scatter's input and keeps only its reduced
  gradients. With as many micro-batches as pipeline ranks there is no steady state: every
  forward runs before the first backward, so the gradients grow as the activations drain and the
  chunks finish one after another, and the rank is fullest where the two cross, not where it
  holds the most activations.
So the order is walked, and each backward priced with what it meets.
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
    whole, waiting, the chunks whose backward has run before it (which hold their gradients'
    shards and, until they finish, their last reduce-scatter's input), those of them that have
    finished (every micro-batch's backward run, then reduced and resharded), and the (chunk,
    micro-batch) forward activations the rank holds per chunk, the running action's included
    (`pairs`)."""
    kind: str
    running: int
    whole: bool
    waiting: tuple[int, ...]
    backed: tuple[int, ...]
    finished: tuple[int, ...] = ()
    pairs: tuple[int, ...] = ()

    def extra(self, params: list[float], gathered: list[float]) -> float:
        """Elements gathered beyond the running chunk's usual groups (`gathered`, per chunk):
        the waiting chunks whole (`params`, per chunk), and the running one where it starts so."""
        own = params[self.running] - gathered[self.running] if self.whole else 0.0
        return sum(params[w] for w in self.waiting) + own

    def holds(self, params: list[float], lasts: list[float], kept: list, loss_chunk: int | None = None) -> "Backed":
        """What the rank holds by this moment, from its chunks' elements (`params`, `lasts`) and
        the bytes a micro-batch keeps for the backward in each (`kept`); `loss_chunk`: the rank's
        chunk that computes the loss, if any."""
        total = sum(params)
        return Backed(sum(params[c] for c in self.backed) / total, self.running in self.backed,
                      sum(lasts[c] for c in self.backed if c not in self.finished),
                      sum(params[c] for c in self.finished) / total,
                      sum(count * bytes_ for count, bytes_ in zip(self.pairs, kept)), self.running == loss_chunk)


class Backed(NamedTuple):
    """What a rank holds at a backward of its walked order: the share of its gradients whose
    chunks have run a backward (their shards, or unsharded gradients below ZeRO-2), whether the
    running chunk is one of them (its backward adds into them rather than making them), the last
    reduce-scatter inputs' elements of those not finished, the share of its weights in finished
    chunks (reduced and resharded), the bytes of the (chunk, micro-batch) activations held, and
    whether the running chunk computes the loss."""
    share: float
    running: bool
    lasts: float
    finished: float = 0.0
    activations: float = 0.0
    loss: bool = False


def at_fullest(chunks: list, lasts: list[float], kept: list, *, zero: int, schedule: str, pp: int,
               micro_batches: int, virtual: int, stage: int, b, seq_ratio) -> tuple[list, list]:
    """For a rank's `chunks` (cost.chunk_price.Chunk) whose last reduce-scatter inputs are `lasts`
    elements and whose micro-batches each keep `kept` bytes: what each chunk's backward meets
    (`backward_situations`) and peak_bytes's `forwards` of its fullest forwards (`forward_ends`);
    where no order is walked, the largest forward's with every chunk's gradients."""
    walk = walked_moments(zero, schedule, pp=pp, micro_batches=micro_batches, virtual=virtual, stage=stage)
    sizes = dict(params=[c.params for c in chunks], gathered=[c.gathered for c in chunks], lasts=lasts, kept=kept)
    outs = [b * max(poly_at(p, seq_ratio) for p in [{}, *c.peak_polys]) for c in chunks]
    groups = [2 * c.group * padded_ratios(c)[0] for c in chunks]
    ends = forward_ends(walk, groups=groups, outs=outs, **sizes) or [(max(groups), max(outs), None)]
    loss_chunk = virtual - 1 if stage == pp - 1 else None
    return backward_situations(walk, **sizes, loss_chunk=loss_chunk), ends


def walked_moments(zero: int, schedule: str, *, pp: int, micro_batches: int, virtual: int,
                   stage: int) -> tuple[Moment, ...]:
    """The moments of an interleaved pipeline rank's order to price (`priced_moments`; chunks
    gathered ahead only under ZeRO-3); none under other schedules."""
    if schedule != Schedule.INTERLEAVED_1F1B or pp == 1:
        return ()
    return priced_moments(pp, micro_batches, virtual, stage, zero == 3)


def backward_situations(moments: tuple[Moment, ...], *, params: list[float], gathered: list[float],
                        lasts: list[float], kept: list, loss_chunk: int | None = None) -> list[list[tuple]]:
    """For each of a rank's chunks, what its backward meets at each of the `moments` it runs at:
    (the other chunks' last reduce-scatter inputs held, elements gathered beyond its usual
    groups, `Backed`). A chunk that runs at none is priced as on a rank whose order is not
    walked: every other chunk's input held, nothing gathered ahead, an earlier backward's
    gradients (`Backed` None)."""
    situations = [[] for _ in params]
    for moment in moments:
        if moment.kind == "B":
            backed = moment.holds(params, lasts, kept, loss_chunk)
            others = backed.lasts - (lasts[moment.running] if backed.running else 0.0)
            situations[moment.running].append((others, moment.extra(params, gathered), backed))
    return [list(dict.fromkeys(found)) or [(sum(lasts) - own, 0.0, None)] for found, own in zip(situations, lasts)]


def forward_ends(moments: tuple[Moment, ...], *, groups: list[float], outs: list[float], params: list[float],
                 gathered: list[float], lasts: list[float], kept: list) -> list[tuple]:
    """cost.memory.peak_bytes's `forwards` at each of the fullest `moments` that is a forward:
    the elements gathered (the running chunk's, `groups`: its largest group's weights and
    all-gather output, cost/memory.py; with what is gathered ahead), its transient bytes (`outs`,
    per chunk), and the gradients of the chunks that ran a backward before it (`Backed`: their
    share of the rank's gradient shards, their last reduce-scatter inputs, `lasts` per chunk). A
    forward before any backward holds no gradients. `kept`: a micro-batch's activations per chunk."""
    return [(groups[m.running] + m.extra(params, gathered), outs[m.running], m.holds(params, lasts, kept))
            for m in moments if m.kind == "F"]


@lru_cache(maxsize=4096)
def priced_moments(pp: int, micro_batches: int, virtual: int, stage: int, ahead: bool) -> tuple[Moment, ...]:
    """The moments of `stage`'s interleaved 1F1B order that may be its fullest: every backward
    that no other backward of the same chunk holds at least as much as (`_within`), and under
    ZeRO-3 (`ahead`: chunks gathered whole ahead told apart) the forwards so among those at which
    it holds the most activations (a forward counted from its start)."""
    walked = [(held, state if ahead else (*state[:2], 0, *state[3:])) for held, state in
              _walk(_order(pp, micro_batches, virtual, stage), micro_batches)]
    most = max(held for held, _ in walked)
    # forward ends are priced under ZeRO-3 alone (cost.memory.peak_bytes)
    forwards = [(held, state) for held, state in walked if state[0] == "F" and held == most and ahead]
    backwards = [(held, state) for held, state in walked if state[0] == "B"]
    return tuple(_moment(state, ahead) for _, state in _fullest(forwards) + _fullest(backwards))


def _fullest(walked: list[tuple]) -> list[tuple]:
    """The walked (held, state)s that no other holds at least as much as (`_within`)."""
    # a state holding at least another's comes first, so each is checked against those kept
    ordered = sorted(dict.fromkeys(walked), key=lambda walked: (
        -walked[0], -walked[1][3].bit_count(), walked[1][4].bit_count(), -walked[1][2].bit_count()))
    kept: list[tuple] = []
    for held, state in ordered:
        if not any(_within(state, other) for _, other in kept):
            kept.append((held, state))
    return kept


def _within(state: tuple, other: tuple) -> bool:
    """Whether the walked `other` runs the same chunk and holds at least all `state` does: as
    many activations of every chunk, every chunk gathered whole and backed, none finished that
    `state` has not (bit masks, `_walk`)."""
    _, chunk, whole, backed, finished, pairs = state
    return (chunk == other[1] and not whole & ~other[2] and not backed & ~other[3]
            and not other[4] & ~finished and all(mine <= theirs for mine, theirs in zip(pairs, other[5])))


def moments(pp: int, micro_batches: int, virtual: int, stage: int) -> list[tuple[int, Moment]]:
    """Each compute action of `stage`'s interleaved 1F1B order (torch's), in turn: the (chunk,
    micro-batch) forward activations the rank holds then, and what is gathered whole."""
    return [(held, _moment(state, True))
            for held, state in _walk(_order(pp, micro_batches, virtual, stage), micro_batches)]


def _walk(order: list[tuple[str, int]], micro_batches: int):
    """(forward activations held, (kind, chunk, chunks gathered whole, backed, finished, activations
    held per chunk)) at each action in turn, sets of chunks as bit masks (a plan has thousands of
    actions a rank)."""
    active, whole, backed, finished = 0, 0, 0, 0
    chunks = 1 + max((chunk for _, chunk in order), default=0)
    pairs, backwards = [0] * chunks, [0] * chunks
    for (kind, chunk), window in zip(order, _windows(order)):
        # the runtime frees the chunks that left the window and gathers those that entered it
        whole, active = (whole & window) | (window & ~active), window
        pairs[chunk] += kind == "F"
        yield sum(pairs), (kind, chunk, whole, backed, finished, tuple(pairs))
        whole &= ~(1 << chunk)
        if kind == "B":
            pairs[chunk], backed, backwards[chunk] = pairs[chunk] - 1, backed | 1 << chunk, backwards[chunk] + 1
            # its REDUCE_GRAD follows the chunk's last backward
            finished |= (1 << chunk) if backwards[chunk] == micro_batches else 0


def _moment(state: tuple, ahead: bool) -> Moment:
    kind, chunk, whole, backed, finished, pairs = state
    whole = whole if ahead else 0
    chunks = lambda mask: tuple(c for c in range(mask.bit_length()) if mask >> c & 1)
    return Moment(kind, chunk, bool(whole >> chunk & 1), chunks(whole & ~(1 << chunk)), chunks(backed),
                  chunks(finished), pairs)


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
