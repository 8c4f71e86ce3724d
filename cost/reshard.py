"""What a change of placement costs in collectives, and how an op's placements split its work: the
facts the sharding ILP (autopar.solver) and the estimator (a Plan priced from its own placements)
both price, written once. Placements are strings, one per mesh axis: "R", "P", "S(d)".

    forward   R -> S, R -> P    free (a local slice; zeros on all ranks but one)
              S(d) -> R         all-gather          S(d) -> S(e)   all-to-all
              P -> R            all-reduce          P -> S(d)      reduce-scatter
              S -> P            not allowed
    backward  the gradient travels the other way: a consumer's input gradient has its input's
              placement, except that a replicated input of an op whose work is split on that
              axis gets partial sums (Megatron's "f": identity forward, all-reduce backward) and
              a partial-sum input gets a replicated gradient ("g"); the producer needs the gradient
              in its output's placement (replicated for a partial output).

On a multi-axis mesh the axes that change go one at a time from the innermost, each on the bytes
one device holds across the other axes at that point.
"""

from __future__ import annotations

import math

ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL = ("all_reduce", "all_gather", "reduce_scatter",
                                                      "all_to_all")


def reshard_steps(src: tuple[str, ...], dst: tuple[str, ...],
                  sizes: list[int]) -> list[tuple[str, int, int]] | None:
    """The collectives that turn a tensor placed `src` into `dst`, as (kind, axis, divisor): the
    collective runs on mesh axis `axis` over the tensor's bytes / `divisor` (its share held across
    the other axes). [] when nothing moves, None when the change is not possible (S -> P)."""
    steps, current = [], list(src)
    for a in reversed(range(len(src))):
        before, after = current[a], dst[a]
        if before == after:
            continue
        current[a] = after
        if before == "R":
            continue        # a local slice, or zeros on all ranks but one
        others = math.prod(size for b, (p, size) in enumerate(zip(current, sizes))
                           if b != a and p.startswith("S"))
        if before == "P":
            steps.append((ALL_REDUCE if after == "R" else REDUCE_SCATTER, a, others))
        elif after == "R":
            steps.append((ALL_GATHER, a, others))
        elif after == "P":
            return None
        else:
            steps.append((ALL_TO_ALL, a, others))
    return steps


def gradient_need(output: tuple[str, ...], gradient: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """The placement a producer needs its output's gradient in: a parameter's gradient placement
    when it has its own (ZeRO-1/2), else the output's, replicated where the output is partial."""
    if gradient:
        return tuple(gradient)
    return tuple("R" if p == "P" else p for p in output)


def gradient_given(output: tuple[str, ...], inputs: list[tuple[str, ...]], k: int) -> tuple[str, ...]:
    """The placement an op whose placements are `output` and `inputs` gives its input k's gradient in.
    A replicated input's gradient is partial where the op is split, and where it writes partial
    sums: it scales a partial factor there (mul(R, P) -> P), so its gradient is the output's
    gradient times that factor, partial too."""
    given = []
    for a, p in enumerate(inputs[k]):
        split = output[a] != "R" or any(q[a].startswith("S") for q in inputs)
        given.append("R" if p == "P" else ("P" if p == "R" and split else p))
    return tuple(given)


def work_split(output: tuple[str, ...], inputs: list[tuple[str, ...]], sizes: list[int]) -> int:
    """How many ways an op's work is divided: the product of the axes on which its output or any
    input is sharded (a contraction split on its inner dim reads sharded inputs, writes partials)."""
    split = 1
    for a, size in enumerate(sizes):
        if output[a].startswith("S") or any(p[a].startswith("S") for p in inputs):
            split *= size
    return split


def cheapest_inputs(output: str, sources: list[str], options: list[tuple[str, ...]],
                    nbytes: list[float], size: int) -> tuple[str, ...]:
    """Of the input placements `options` of an op's strategies that write `output` on a mesh
    axis of `size`, the one whose reading of producers placed `sources` (of `nbytes` each) moves
    the least, forward and gradients (an all-reduce moves twice what a gather does), then whose
    work is split the most: the ILP's choice with every output fixed. All replicated when no
    strategy writes `output` (an op without a rule, computed whole)."""
    return min(options, key=lambda inputs: _read_traffic(output, sources, inputs, nbytes, size),
               default=("R",) * len(sources))


def _read_traffic(output: str, sources: list[str], inputs: tuple[str, ...], nbytes: list[float],
                  size: int) -> tuple[float, int]:
    moved = 0.0
    for k, source in enumerate(sources):
        given = gradient_given((output,), [(p,) for p in inputs], k)
        for src, dst in (((source,), (inputs[k],)), (given, gradient_need((source,)))):
            steps = reshard_steps(src, dst, [size])
            if steps is None:
                return (float("inf"), 0)
            moved += sum(nbytes[k] / divisor * (2 if kind == ALL_REDUCE else 1)
                         for kind, _, divisor in steps)
    return (moved, -work_split((output,), [(p,) for p in inputs], [size]))


def written_as_computed(planned: str, sources: list[str],
                        strategies: list[tuple[str, tuple[str, ...]]]) -> str:
    """Where an op's value is placed as it runs. The runtime moves no value to a partial sum
    (`passes.tensor_parallel.place_nodes` leaves P to DTensor), so an op the plan places P
    writes what DTensor computes from its inputs as they arrive, when a strategy reads them so
    (a cast of a replicated value stays replicated); else the plan's P, DTensor reading its
    inputs as the plan does, or whole where no strategy writes P."""
    if planned != "P":
        return planned
    if strategies and all(written != "P" for written, _ in strategies):
        return "R"          # no rule writes a partial sum (a copy of one): reduced first
    as_they_arrive = [written for written, inputs in strategies if list(inputs) == list(sources)]
    return planned if not as_they_arrive or planned in as_they_arrive else as_they_arrive[0]
