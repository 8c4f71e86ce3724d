"""What a chunk's backward holds op by op where FSDP2 reduces each group's gradients as the
group's backward ends (ZeRO-2 and 3: `autopar.plans.zero.reduces_every_micro_batch`).

Beside the gradients flowing through the ops (cost/gradient_flow.py), each op's backward makes
the gradients of the weights it reads. They stay, whole, until their FSDP group's backward is
done (its first op in forward order has run), when FSDP2 copies them into one fp32 reduce-scatter
input, keeps that until the next group's reduce-scatter, and keeps the new shard. Under ZeRO-3
the group that runs is gathered, and so is the next, which FSDP2 prefetches. So the fullest
moment is not where the flowing gradients weigh most: it is found by weighing every op's moment
with the plan's sizes (cost.memory.peak_bytes), which `Moment` keeps apart.

The moments are kept few: of the ops between two reductions only those that are the fullest at
some micro-batch size, and of identical moments in identical blocks (what differs is only what the
blocks before freed and reduced, both growing block by block), the first and the last.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Moment:
    """One op's backward, in parts the plan weighs differently."""
    flowing: tuple          # ((power of seq, bytes per sample), ...) alive beyond the kept
                            # activations: gradients, temporaries, what a rerun keeps
    freed: tuple            # ((power of seq, bytes per sample), ...) of the kept activations
                            # that the backward has freed by then
    grads: float            # elements of weight gradients not yet reduced (the op's included)
    gathered: float         # elements ZeRO-3 holds gathered: the running group and the next
    scattering: float | None    # elements of the group reduced last (its reduce-scatter input);
                                # None before the first reduction of this backward
    reduced: tuple          # elements of the groups reduced so far: (dense, experts)
    copying: float = 0.0    # experts' elements a group's copy-out moment copies (`enter`)
    releasing: tuple = (0.0, 0.0)   # (dense, experts) elements of the group being reduced (`after`)


def whole_held(fact) -> float:
    """Elements an op's backward holds of the weights it reads whole: gathered again, beside
    their whole gradients once made, and before that the gather's own copies (`gathering`)."""
    return max(2 * fact.whole, fact.gathering)


class GroupReductions:
    """FSDP2's groups as a chunk's backward meets them: the weight gradients alive, the last
    reduce-scatter's input and what has been reduced."""

    def __init__(self, nodes: list, facts: dict, param_local: dict[str, float],
                 summed_apart: bool = False):
        # autograd sums a second reader's gradient into the first's in place, but out of place
        # for DTensors (`summed_apart`): the two and their sum are alive at once
        self.second_reader = 2.0 if summed_apart else 1.0
        self.totals: dict[str, list[float]] = {}       # group -> [dense, experts] elements
        self.release: dict[int, list[str]] = {}        # position -> groups reduced after it
        first: dict[str, int] = {}
        order: list[str] = []                          # groups in the order the backward meets them
        counted: set[str] = set()
        for position in range(len(nodes) - 1, -1, -1):
            fact = facts[nodes[position].name]
            for name, group in fact.weights:
                if name not in counted:
                    counted.add(name)
                    self.totals.setdefault(group, [0.0, 0.0])[fact.expert] += param_local.get(name, 0.0)
        # a group none of whose weights the chunk holds (the next chunk's, whose first op a
        # chunk's last may be) is no FSDP group of the chunk: it neither gathers nor reduces here
        for position in range(len(nodes) - 1, -1, -1):
            group = self.group_of(facts[nodes[position].name])
            if group is not None:
                first[group] = position
                if group not in order:
                    order.append(group)
        for group, position in first.items():
            self.release.setdefault(position, []).append(group)
        self.next = dict(zip(order, order[1:]))
        # the group the forward gathers last: FSDP2 keeps that all-gather's output to the forward's end
        self.first_met = sum(self.totals.get(order[0], ())) if order else 0.0
        self.first = first                             # group -> position of its first op
        self.param_local = param_local
        self.alive: dict[str, float] = {}
        self.made: set[str] = set()
        self.active: str | None = None
        self.entered: list[str] = []                   # groups the backward has reached
        self.done: set[str] = set()
        self.scattering: float | None = None
        self.reduced = [0.0, 0.0]
        self.moments: list[tuple] = []
        self._run: tuple = ()       # the current run's parts and its fullest moments

    def group_of(self, fact) -> str | None:
        """The FSDP group of the chunk an op's backward runs in, if any."""
        return fact.group if fact.group in self.totals else None

    def record(self, fact, flowing: dict, freed: dict) -> None:
        """Add the op's `moment`. Of a run of ops that make no weight gradient (their parts
        but the flowing bytes alike), only the fullest at each compared length can be fullest."""
        moment = self.moment(fact, flowing, freed)
        nets = tuple(_net(moment, ratio) for ratio in _COMPARED_AT)
        if self._run and self._run[0] == moment[2:]:
            self._run = (moment[2:], [best if best[0] >= net else (net, moment)
                                      for best, net in zip(self._run[1], nets)])
            return
        self._end_run()
        self._run = (moment[2:], [(net, moment) for net in nets])

    def enter(self, fact, flowing: dict, rerun_before: dict[int, dict], freed: dict) -> None:
        """Before the op's backward: where it is the first of a group the backward meets, FSDP2
        copies the group's gathered buffer out into its parameters, both alive a moment (under
        ZeRO-3), with the gradients that reached the group and the group before still waiting
        for its reduce-scatter. A group inside another (an expert-parallel layer's experts) is
        copied out as the recomputed forward reaches it, with what the rerun keeps before it
        (`rerun_before`: position -> {power of seq: bytes}). Its experts' elements are recorded
        apart: FSDP2 copies those it shards on a later dim out through a temporary as large
        (cost.estimator's `_weighed`)."""
        group = self.group_of(fact)
        if group is None or group in self.entered or group in self.done:
            return
        self._end_run()
        open_groups = self._open()
        if open_groups:
            rerun = rerun_before.get(self.first[group], {})
            flowing = {degree: flowing.get(degree, 0.0) + rerun.get(degree, 0.0)
                       for degree in {*flowing, *rerun}}
        gathered = open_groups + 2 * sum(self.totals[group])
        self.active = group
        self.entered.append(group)
        self.moments.append((dict(flowing), dict(freed), sum(self.alive.values()), gathered,
                             self.scattering, tuple(self.reduced), self.totals[group][1],
                             (0.0, 0.0)))

    def _end_run(self) -> None:
        if self._run:
            self.moments.extend({id(m): m for _, m in self._run[1]}.values())
        self._run = ()

    def kept(self) -> tuple[Moment, ...]:
        """The moments recorded, pruned."""
        self._end_run()
        return prune(self.moments)

    def moment(self, fact, flowing: dict, freed: dict) -> tuple:
        """The op's backward, a `Moment`'s fields (its polynomials as dicts, made into a Moment
        only if `prune` keeps it): it makes its weights' gradients (and holds a weight it reads
        whole with its whole gradient, `fact.whole`)."""
        own = again = 0.0
        for name, group in fact.weights:
            size = self.param_local.get(name, 0.0)
            if name not in self.made:
                self.made.add(name)
                self.alive[group] = self.alive.get(group, 0.0) + size
                own = max(own, size)
            elif group not in self.done:    # a second reader's gradient, beside the first's
                again = max(again, self.second_reader * size)   # until autograd adds it in
        self.active = self.group_of(fact) or self.active
        return (flowing, dict(freed), sum(self.alive.values()) + max(0.0, whole_held(fact) - own) + again,
                self._gathered(), self.scattering, tuple(self.reduced), 0.0, (0.0, 0.0))

    def after(self, position: int, flowing: dict, freed: dict) -> None:
        """Groups whose backward ended with the op at `position`: reduced. FSDP2 frees the
        group's gathered weights, copies its gradients into its reduce-scatter input (having let
        go of the one before) and makes its shard while the gradients are still alive: a moment
        of its own."""
        for group in self.release.get(position, ()):
            self._end_run()
            size = sum(self.totals.get(group, ()))
            dense, experts = self.totals.get(group, (0.0, 0.0))
            # resharded first: under ZeRO-3 only the prefetched group is gathered then
            self.moments.append((dict(flowing), dict(freed), sum(self.alive.values()), self._gathered() - size,
                                 size, (self.reduced[0] + dense, self.reduced[1] + experts), 0.0,
                                 (dense, experts)))
            self.alive.pop(group, None)
            self.done.add(group)
            dense, experts = self.totals.get(group, (0.0, 0.0))
            self.scattering = dense + experts
            self.reduced = [self.reduced[0] + dense, self.reduced[1] + experts]

    def _open(self) -> float:
        """Elements of the groups reached and not yet reduced: the running one, and where groups
        nest (an expert-parallel layer's experts in their block), the one around it."""
        return sum(sum(self.totals.get(group, ())) for group in self.entered if group not in self.done)

    def _gathered(self) -> float:
        if self.active is None:
            return 0.0
        following = self.next.get(self.active)
        return self._open() + (sum(self.totals.get(following, ())) if following not in self.entered else 0.0)


def last_scattered(moments: tuple[Moment, ...]) -> float | None:
    """Elements of the group a backward reduce-scatters last, of its (pruned) `moments`: FSDP2
    keeps that reduce-scatter's input until the next backward's first; None where none reduces."""
    reducing = [moment for moment in moments if moment.scattering is not None]
    return max(reducing, key=lambda moment: sum(moment.reduced)).scattering if reducing else None


def _items(poly: dict) -> tuple:
    return tuple(sorted((degree, value) for degree, value in poly.items() if value))


# Sequence lengths (over the captured one) at which the moments are compared: a moment whose
# attention gradients grow as its square can outweigh the others only at long sequences.
_COMPARED_AT = (1, 8)


def prune(moments: list[tuple]) -> tuple[Moment, ...]:
    """The moments some plan may find fullest (module docstring), of `GroupReductions.moment`s."""
    epochs: dict = {}
    for moment in moments:
        epochs.setdefault(moment[3:], []).append(moment)
    chosen = {id(moment): moment for same in epochs.values() for ratio in _COMPARED_AT
              for moment in _envelope(same, ratio)}
    kept = [Moment(flowing=_items(flowing), freed=_items(freed), grads=grads, gathered=gathered,
                   scattering=scattering, reduced=reduced, copying=copying, releasing=releasing)
            for flowing, freed, grads, gathered, scattering, reduced, copying, releasing in chosen.values()]
    shapes: dict = {}
    for moment in kept:
        shape = (_rounded(moment.flowing), round(moment.grads, 3), round(moment.gathered, 3),
                 None if moment.scattering is None else round(moment.scattering, 3), moment.copying)
        shapes.setdefault(shape, []).append(moment)
    out = []
    for same in shapes.values():
        same.sort(key=lambda moment: sum(moment.reduced))
        out += same[:1] + same[-1:] if len(same) > 1 else same
    return tuple(out)


def _envelope(moments: list[tuple], ratio: float) -> list[tuple]:
    """The moments fullest at some micro-batch (and element size): a plan weighs a moment as
    b x its net bytes per sample + element x its gradients' elements, so only the upper hull of
    the points (net, gradients) counts, from the most gradients to the most bytes."""
    if len(moments) < 2:
        return moments
    hull: list[tuple[float, float, tuple]] = []
    for point in sorted(((_net(m, ratio), m[2], m) for m in moments), key=lambda p: p[:2]):
        while len(hull) >= 2 and _cross(hull[-2], hull[-1], point) >= 0:
            hull.pop()
        hull.append(point)
    top = max(range(len(hull)), key=lambda k: hull[k][1::-1])
    return [moment for _, _, moment in hull[top:]]


def _net(moment: tuple, ratio: float) -> float:
    flowing, freed = moment[:2]
    if ratio == 1:
        return sum(flowing.values()) - sum(freed.values())
    return (sum(value * ratio ** degree for degree, value in flowing.items())
            - sum(value * ratio ** degree for degree, value in freed.items()))


def _cross(o: tuple, a: tuple, b: tuple) -> float:
    return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])


def _rounded(poly: tuple) -> tuple:
    return tuple((degree, round(value, 3)) for degree, value in poly)
