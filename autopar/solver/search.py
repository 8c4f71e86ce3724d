"""The inter-op search: pipeline stage cuts, sub-meshes, micro-batches, schedule, recompute and ZeRO.

A plan cuts the model's units into pp * v contiguous chunks (candidates.py); every chunk runs on a
dp x tp sub-mesh, tensor parallelism inside a node, data parallelism next, pipeline ranks outermost
(Megatron's rank order, which the collective costs assume).

The search, in three phases, prices every candidate with the one estimator of autopar.cost:
1. The Megatron grid: TP in the divisors of the node size up to 8, PP dividing the blocks, DP the
   rest, micro-batch sizes, recompute, interleaving, ZeRO; uniform stages with the embedding on
   the first and the head on the last. autopar's answer is never worse than this grid's best.
2. Shapes the grid cannot express: PP that does not divide the blocks, with stages balanced by a
   dynamic program over contiguous cuts (`balanced_cuts`).
3. Refinement of the best shapes, one estimator call per move, kept when it is faster and fits:
   other schedules (zero-bubble, GPipe), any micro-batch size that divides the batch, every
   expert-parallel degree the runtime runs (the grid tries three: candidates.expert_degrees), a unit moved
   off the slowest pipeline rank (the embedding and head are not free, so the outer stages take
   fewer blocks), recompute and ZeRO changed rank by rank (the first rank keeps p micro-batches in
   flight, the last one).
ZeRO 1-3 are candidates in phases 1 and 2 wherever there is data (or context) parallelism (ZeRO-0
in phase 3). Context parallelism is a phase of its own, on the grid's layouts, where activations
bind (nothing fits, or the best plan recomputes): it trades them for the ring's or all-to-all's
traffic, as recompute trades them for compute. ZeRO-3 with offload is tried only where nothing
else fits (`context_phase`, `offload_phase`).
What the runtime cannot run is never generated (`layout_error`): the global batch divides into
dp x micro-batch x count, and torch.distributed.pipelining runs the schedule with that count on
pp ranks of v chunks (the rules are in autopar.plans.schedules); and zero-bubble is no candidate
for cuts that make an activation skip a stage (`Search.relay_error`, autopar.plans.stage_flow)
nor for stages that recompute (autopar.plans.schedules.recompute_error).
A model whose numbers change with micro-batching (BatchNorm in training mode, buffers written in
forward: `Graph.batch_coupling`) gets one micro-batch per replica (`whole_batch`), which the
runtime requires of it.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, replace

from autopar.solver.candidates import (MAX_MICRO_BATCH, RECOMPUTE_ORDER, Candidate, Priced, Shape, Unit,
                                       balanced_cuts, expert_degrees, layout_error, uniform_cuts)
from autopar.plans.schedules import recompute_error, relay_error, runs
from autopar.plans.stage_flow import skips_a_stage
from autopar.plans.vocabulary import Recompute, Schedule


@dataclass(kw_only=True, slots=True)
class Search:
    """The planner's state: the pricer, the units, the best priced candidate so far."""
    pricer: object              # autopar.solver.candidate_prices.CandidatePricer
    units: list[Unit]
    deadline: float
    # (unit computing, furthest unit reading) -> an activation: stage_flow.skipping_pairs
    skipping: dict[tuple[int, int], str]
    coupling: str | None = None     # why micro-batches would change the model's numbers
    experts: int = 0                # the gcd of the MoE layers' expert counts; 0: none
    best: Priced | None = None
    least_memory: Priced | None = None
    # of the offloaded candidates that fit the devices, the one whose states need the least host
    # memory (what the refusal names when none fits its host)
    least_host: Priced | None = None
    timed_out: bool = False

    def price(self, candidate: Candidate, uniform: bool = False) -> Priced | None:
        """Price with the estimator; None when the candidate is not a valid plan for it. The
        generators propose only layouts the runtime runs; this guard keeps any other out of
        `best` and counts it among the refusals."""
        error = layout_error(candidate.shape, self.pricer.global_batch, self.coupling) \
            or self.relay_error(candidate)
        if error is not None:
            reason = f"not runnable: {error}"
            self.pricer.refusals[reason] = self.pricer.refusals.get(reason, 0) + 1
            return None
        result = self.pricer.price(candidate, self.units, uniform=uniform)
        if result is None:
            return None
        if result.fits and (self.best is None or _preference(result) < _preference(self.best)):
            self.best = result
        if self.least_memory is None or result.memory_bytes < self.least_memory.memory_bytes:
            self.least_memory = result
        host = result.estimate.host_memory_bytes
        if host and result.memory_bytes <= self.pricer.memory_limit and (
                self.least_host is None or host < self.least_host.estimate.host_memory_bytes):
            self.least_host = result
        return result

    def relay_error(self, candidate: Candidate) -> str | None:
        """Why the candidate's schedule cannot train the activations its cuts relay, or its
        stages' recomputation (`autopar.plans.schedules.recompute_error`)."""
        if candidate.shape.schedule != Schedule.ZERO_BUBBLE:
            return None
        refusal = recompute_error(candidate.shape.schedule, candidate.recompute)
        if refusal is not None:
            return refusal
        unit_stage = [c for c in range(candidate.chunks)
                      for _ in range(candidate.cuts[c], candidate.cuts[c + 1])]
        return relay_error(Schedule.ZERO_BUBBLE, [value for (made, read), value in self.skipping.items()
                                           if skips_a_stage(made, read, unit_stage)])

    def candidates(self) -> list[Priced]:
        """Every distinct candidate the estimator priced (and did not refuse), in pricing order:
        what the plan is checked against (it is the fastest of these that fits)."""
        return [p for p in self.pricer.cache.values() if p is not None]

    @property
    def priced(self) -> int:
        """Distinct candidates the estimator priced (repeats come from the pricer's memo)."""
        return len(self.pricer.cache)

    def out_of_time(self) -> bool:
        """Past the deadline (the phases' or the refinement's); `timed_out` keeps that it was."""
        late = time.monotonic() > self.deadline
        self.timed_out = self.timed_out or late
        return late


def _preference(priced: Priced) -> tuple:
    """Faster first; between candidates the estimator prices alike, the one that recomputes and
    shards less, pipelines less, splits sequences over fewer ranks and keeps its states on the
    device (simpler to run, and what a user expects of a tie)."""
    candidate = priced.candidate
    return (priced.step_time_s, sum(RECOMPUTE_ORDER.index(r) for r in candidate.recompute),
            sum(candidate.zero), candidate.shape.pp, candidate.shape.virtual, candidate.shape.cp,
            candidate.shape.offload)


def _zero_levels(shape: Shape, levels: tuple[int, ...]) -> tuple[int, ...]:
    """The ZeRO levels a layout can take: those asked where dp x cp ranks share the weights, none
    on a single replica; ZeRO-3 alone with offload (the form the runtime offloads)."""
    if shape.offload:
        return (3,)
    return levels if shape.replicas > 1 else (0,)


def grid_phase(search: Search, shapes: list[Shape], zero_levels=(0, 1)) -> list[Priced]:
    """Price the uniform Megatron configurations, keeping for each shape and ZeRO level the fastest
    recompute that fits. Memory only grows with less recompute and a larger micro-batch, and time
    only grows with more recompute, so: when the same layout fitted without recompute at its
    previous micro-batch or ZeRO level, "none" is priced first and ends the ladder if it fits;
    otherwise "full" first, and when it does not fit nothing less saving is priced; a layout
    whose every ZeRO level fails skips its larger micro-batches. Every ZeRO level is tried: a
    lower one can need less (ZeRO-2 reduce-scatters each micro-batch, holding a group's fp32
    input and new shard beside the gathered weights, where ZeRO-1 accumulates)."""
    results = []
    too_big: set[tuple] = set()      # layouts whose smaller micro-batch already failed to fit
    needed: dict[tuple, bool] = {}   # layout -> whether its last micro-batch needed recompute
    for shape in shapes:
        # past the deadline, stop once something fits (the plan then says "time_limit")
        if search.best is not None and search.out_of_time():
            break
        layout = (shape.tp, shape.pp, shape.dp, shape.virtual, shape.schedule, shape.ep, shape.cp,
                  shape.offload)
        cuts = uniform_cuts(search.units, shape.pp * shape.virtual)
        if cuts is None or layout in too_big:
            continue
        fitted = refused = False
        for zero in sorted(_zero_levels(shape, zero_levels), reverse=True):
            ladder = _recompute_ladder(search, shape, cuts, zero,
                                       try_none_first=not needed.get(layout, True))
            if ladder is None:
                refused = True
                break
            priced, fastest = ladder
            results.extend(priced)
            if fastest is None:
                continue
            fitted = True
            needed[layout] = fastest.candidate.recompute[0] != Recompute.NONE
        if not fitted and not refused:
            too_big.add(layout)
    return results


def _recompute_ladder(search: Search, shape: Shape, cuts: tuple, zero: int, try_none_first: bool,
                      uniform: bool = True) -> tuple[list[Priced], Priced | None] | None:
    """The candidates priced to find the fastest fitting recompute of one uniform configuration,
    and that one (None when none fits); None when the estimator refuses the configuration."""
    chunks = len(cuts) - 1
    priced: list[Priced] = []
    levels = ((Recompute.NONE, Recompute.FULL, Recompute.SELECTIVE) if try_none_first
              else (Recompute.FULL, Recompute.NONE, Recompute.SELECTIVE))
    for recompute in [r for r in levels if recompute_error(shape.schedule, (r,)) is None]:
        candidate = search.price(Candidate(shape, cuts, (recompute,) * chunks, (zero,) * chunks),
                                 uniform=uniform)
        if candidate is None:
            if not priced:
                return None
            break
        priced.append(candidate)
        if (recompute == Recompute.NONE and candidate.fits) or (recompute == Recompute.FULL and not candidate.fits):
            break       # the fastest fits, or the most saving does not
    fitting = [p for p in priced if p.fits]
    return priced, min(fitting, key=lambda p: p.step_time_s) if fitting else None


def uneven_phase(search: Search, shapes: list[Shape], weights_for) -> list[Priced]:
    """Shapes outside the grid: balanced cuts, every ZeRO level where there is data parallelism
    (the most sharding first; a lower one can need less: `grid_phase`), and for each the fastest
    recompute that fits."""
    results = []
    for shape in shapes:
        if search.out_of_time():
            break
        cuts = balanced_cuts(weights_for(shape.tp), shape.pp * shape.virtual)
        if cuts is None:
            continue
        needs_recompute = True
        for zero in _zero_levels(shape, (3, 2, 1)):
            ladder = _recompute_ladder(search, shape, cuts, zero, try_none_first=not needs_recompute,
                                       uniform=False)
            if ladder is None:
                break
            priced, fastest = ladder
            results.extend(priced)
            if fastest is None:
                continue
            needs_recompute = fastest.candidate.recompute[0] != Recompute.NONE
    return results


def refine(search: Search, start: Priced, weights_for) -> Priced:
    """Local search from one priced candidate: each move one estimator call; the first better one
    is taken and the moves are generated again from it (hill climbing; repeated candidates come
    from the pricer's memo). Better means faster and fitting; while the current one does not fit,
    anything that fits or needs less memory. Schedules are tried again after the micro-batch
    size changed: which schedules torch runs, and which is fastest, depends on the count."""
    current = start
    experts = functools.partial(_expert_moves, experts=search.experts)
    for move in (_schedule_moves, _micro_batch_moves, _schedule_moves, experts, _balanced_move,
                 _boundary_moves, _recompute_moves, _zero_moves, experts, _context_kind_moves,
                 _boundary_moves):
        if move is _micro_batch_moves and search.coupling is not None:
            continue        # one micro-batch per replica (layout_error)
        improved = True
        while improved and not search.out_of_time():
            improved = False
            for candidate in move(current, search.pricer.global_batch, weights_for):
                if search.relay_error(candidate) is not None:
                    continue        # zero-bubble on these cuts is no candidate (other schedules are)
                priced = search.price(candidate)
                if priced is not None and _better(priced, current):
                    current, improved = priced, True
                    break
    return current


def _better(new: Priced, current: Priced) -> bool:
    if current.fits:
        return new.fits and new.step_time_s < current.step_time_s
    return new.fits or new.memory_bytes < current.memory_bytes


def _schedule_moves(current: Priced, global_batch: int, weights_for):
    """Other schedules for the same stages. With v chunks per rank, interleaved 1F1B or torch's
    interleaved zero-bubble; with one, 1F1B, GPipe or zero-bubble. 1F1B needs m >= p to run, and
    zero-bubble leaves a third of the bubble only when m >= p (the schedule simulator gives 2/3
    at m = 1), which is what the estimator assumes; so it is proposed only there."""
    candidate, shape = current.candidate, current.candidate.shape
    if shape.pp == 1:
        return
    m = global_batch // (shape.dp * shape.micro_batch)
    if shape.virtual > 1:
        options = (Schedule.ZERO_BUBBLE, Schedule.INTERLEAVED_1F1B) if m >= shape.pp else ()
    else:
        options = ((Schedule.ZERO_BUBBLE, Schedule.GPIPE, Schedule.ONE_F_ONE_B) if m >= shape.pp
                   else (Schedule.GPIPE,))
    for schedule in options:
        if schedule != shape.schedule and runs(schedule, shape.pp, m, shape.virtual):
            yield replace(candidate, shape=replace(shape, schedule=schedule))


def _micro_batch_moves(current: Priced, global_batch: int, weights_for):
    """Every other micro-batch size that divides a replica's batch (the grid tries powers of
    two), where torch still runs the schedule with the micro-batches left and, but for GPipe,
    they fill the pipeline (m >= p, which the estimator's bubble assumes)."""
    candidate, shape = current.candidate, current.candidate.shape
    per_replica = global_batch // shape.dp
    for size in range(1, min(per_replica, MAX_MICRO_BATCH) + 1):
        m = per_replica // size
        if per_replica % size or size == shape.micro_batch:
            continue
        if shape.pp > 1 and (not runs(shape.schedule, shape.pp, m, shape.virtual) or
                             (shape.schedule != Schedule.GPIPE and m < shape.pp)):
            continue
        yield replace(candidate, shape=replace(shape, micro_batch=size))


def _expert_moves(current: Priced, global_batch: int, weights_for, *, experts: int):
    """Every other expert-parallel degree the runtime runs for the same stages (the grid tries
    two of them), carved out of their dp x cp x tp ranks."""
    candidate, shape = current.candidate, current.candidate.shape
    for ep in expert_degrees(shape.tp * shape.dp * shape.cp, experts, 0, every=True):
        if ep != shape.ep:
            yield replace(candidate, shape=replace(shape, ep=ep))


def _balanced_move(current: Priced, global_batch: int, weights_for):
    candidate = current.candidate
    cuts = balanced_cuts(weights_for(candidate.shape.tp), candidate.chunks)
    if cuts is not None and cuts != candidate.cuts:
        yield replace(candidate, cuts=cuts)


def _boundary_moves(current: Priced, global_batch: int, weights_for):
    """Give one unit of a chunk on the binding pipeline rank (the slowest, or while nothing fits
    the fullest) to its neighbour chunk: only that rank's load bounds the step (or the memory)."""
    candidate, pp = current.candidate, current.candidate.shape.pp
    devices = current.estimate.devices
    key = "time_per_micro_batch_s" if current.fits else "memory_bytes"
    binding = max(range(pp), key=lambda d: devices[d][key])
    for chunk in range(binding, candidate.chunks, pp):
        for boundary, step in ((chunk, 1), (chunk + 1, -1)):
            cuts = list(candidate.cuts)
            if 0 < boundary < candidate.chunks:
                cuts[boundary] += step
                if cuts[boundary - 1] < cuts[boundary] < cuts[boundary + 1]:
                    yield replace(candidate, cuts=tuple(cuts))


def _rank_chunks(candidate: Candidate) -> list[list[int]]:
    pp = candidate.shape.pp
    return [list(range(rank, candidate.chunks, pp)) for rank in range(pp)]


def _recompute_moves(current: Priced, global_batch: int, weights_for):
    """Another recompute level for the chunks of one pipeline rank, last ranks first (they hold
    the fewest micro-batches in flight), the cheaper levels first."""
    candidate = current.candidate
    for chunks in reversed(_rank_chunks(candidate)):
        for level in RECOMPUTE_ORDER:
            recompute = list(candidate.recompute)
            for chunk in chunks:
                recompute[chunk] = level
            if tuple(recompute) != candidate.recompute:
                yield replace(candidate, recompute=tuple(recompute))


def _context_kind_moves(current: Priced, global_batch: int, weights_for):
    """The other context-parallel attention: all-to-all for a ring, a ring for an all-to-all
    (the estimator refuses an all-to-all whose heads do not divide)."""
    candidate, shape = current.candidate, current.candidate.shape
    if shape.cp > 1:
        kind = "all-to-all" if shape.cp_kind == "ring" else "ring"
        yield replace(candidate, shape=replace(shape, cp_kind=kind))


def _zero_moves(current: Priced, global_batch: int, weights_for):
    """ZeRO levels for all chunks at once, then for the chunks of one pipeline rank."""
    candidate = current.candidate
    if candidate.shape.replicas == 1 or candidate.shape.offload:
        return      # nothing to shard, or offload's ZeRO-3 (what the runtime offloads)
    for zero in (0, 1, 2, 3):
        if (zero,) * candidate.chunks != candidate.zero:
            yield replace(candidate, zero=(zero,) * candidate.chunks)
    for chunks in _rank_chunks(candidate):
        for zero in (0, 1, 2, 3):
            levels = list(candidate.zero)
            for chunk in chunks:
                levels[chunk] = zero
            if tuple(levels) != candidate.zero:
                yield replace(candidate, zero=tuple(levels))


def context_phase(search: Search, shapes: list[Shape]) -> list[Priced]:
    """Context parallelism on the grid's layouts (`candidates.context_shapes`), where activations
    bind: when nothing fits yet, or the best plan found recomputes. Then each shape's ring form
    is priced (the all-to-all is a refinement move, `_context_kind_moves`)."""
    best = search.best
    if best is not None and all(r == Recompute.NONE for r in best.candidate.recompute):
        return []
    return grid_phase(search, shapes, zero_levels=(1, 2, 3))


def offload_phase(search: Search, shapes: list[Shape]) -> list[Priced]:
    """ZeRO-3 with its states on the host, on the given layouts, only when nothing fits: it
    moves every gathered shard over the host link, which a layout that fits never needs."""
    if search.best is not None:
        return []
    # split experts go to the host with the rest (their own FSDP2 groups offload too)
    return grid_phase(search, [replace(shape, offload=True) for shape in shapes],
                      zero_levels=(3,))
