"""What a block's backward holds beyond the kept activations, weighed for a plan: the fullest
moment of its flowing gradients, and of those with the weight gradients alive beside them, as
FSDP2 makes, reduces and reshards them (cost/backward_moments.py records the moments)."""

from __future__ import annotations

from typing import NamedTuple

import sympy

from autopar.cost.chunk_price import poly_at
from autopar.cost.memory import GRADIENT_BYTES


class BlockTransients(NamedTuple):
    """`block_transients`'s bytes, named as cost.memory.peak_bytes takes them."""
    flowing: object
    paired: object
    accumulating: object = None


def block_transients(chunks: list, seq_ratio, b, element: int, *, split: bool, fsdp: bool,
                     resharding: bool = False, last_reduction: tuple | None = None,
                     between: bool = True, alone: bool = False) -> BlockTransients:
    """A block backward's bytes beside the kept activations, for `b` samples a micro-batch: the
    fullest moment's flowing gradients (an input backward's, where the schedule splits it, and
    then, where it reads a weight whole, its fullest with that weight: `split_whole_reads`), and
    unsplit, the fullest moment with the weight gradients alive in it (`element` bytes each; None
    if none is known), which makes the heaviest late: its op's own (`paired_polys`: autograd
    adds each into the accumulated one), or where FSDP2 holds the weights (`fsdp`), those its
    group made so far (`moments`: FSDP2 adds them in as the group's backward ends), less, where
    FSDP2 reshards each group as its backward ends (`resharding`), the gathered weights of the
    groups done by then. Where the step's last backward reduces the accumulated gradients group
    by group (`last_reduction`, the share of a reduced group's gradients each rank keeps, of its
    dense and its experts' elements), its moments are weighed as `_reducing_moment`; those of the
    backwards before it, which reduce nothing, count where there are any `between` the first
    and the last; where that backward is the step's only one (`alone`), with no gradients
    accumulated before it. Returned: the flowing bytes, the paired (None if none is known) and,
    where FSDP2 accumulates a step's gradients over its backwards, the fullest moment of the
    step's first (`_accumulating_moment`; None otherwise)."""
    if split:
        flowing = _largest([poly_at(c.split_flowing_poly, seq_ratio) for c in chunks]) * b
        whole = [poly_at(dict(poly), seq_ratio) * b + elements * element
                 for c in chunks for poly, elements in c.split_whole_polys]
        return BlockTransients(flowing, _largest([flowing, *whole]) if whole else None)
    accumulating = None
    if fsdp:
        moments = [m for c in chunks for m in c.moments]
        paired = [_moment_bytes(m, seq_ratio, b, element, resharding)
                  for m in moments if last_reduction is None or between]
        if last_reduction is not None:
            paired += [_reducing_moment(m, seq_ratio, b, element, last_reduction, accumulated=not alone)
                       for m in moments]
        if moments and not alone:
            accumulating = _largest([_accumulating_moment(m, seq_ratio, b, element, resharding) for m in moments])
    else:
        paired = [poly_at(dict(poly), seq_ratio) * b + elements * element
                  for c in chunks for poly, elements in c.paired_polys]
    return BlockTransients(_largest([poly_at(c.flowing_poly, seq_ratio) for c in chunks]) * b,
                           _largest(paired) if paired else None, accumulating)


def _moment_bytes(m, seq_ratio, b, element: int, resharding: bool):
    """A backward moment's flowing bytes (less the activations freed) and weight gradients, less
    the gathered weights of the groups done where they are `resharding`."""
    return ((poly_at(dict(m.flowing), seq_ratio) - poly_at(dict(m.freed), seq_ratio)) * b
            + (m.grads - (sum(m.reduced) if resharding else 0.0)) * element)


def _accumulating_moment(m, seq_ratio, b, element: int, resharding: bool):
    """A moment of the step's first backward where FSDP2 accumulates the gradients over the
    step's backwards: the gradients of each group done stay, in fp32 (FSDP2's reduce dtype), and
    as a 16-bit group's end (`releasing`) copies its gradients into fp32 both are alive
    (FSDP2's `to_accumulated_grad_if_needed`); in fp32 the group keeps its own."""
    done, ending = sum(m.reduced) - sum(m.releasing), sum(m.releasing)
    copied = GRADIENT_BYTES if element < GRADIENT_BYTES else 0.0
    return _moment_bytes(m, seq_ratio, b, element, resharding) + GRADIENT_BYTES * done + copied * ending


def _reducing_moment(m, seq_ratio, b, element: int, kept: tuple, *, accumulated: bool):
    """A moment of the step's last backward where FSDP2 reduces the gradients group by group
    (autopar.plans.zero.reduces_group_by_group_at_the_last_backward), beside those `accumulated`
    whole by earlier backwards: each group done is resharded, its gradients freed but for the
    `kept` share of their reduction's output, and the fp32 input of the group reduced last is
    alive until the next reduction. The group being reduced (`releasing`) is resharded, and its
    gradients are freed only as its output is made: they and its input are the moment's."""
    dense, experts = (done - now for done, now in zip(m.reduced, m.releasing))
    outputs = dense * kept[0] + experts * kept[1]
    return (_moment_bytes(m, seq_ratio, b, element, resharding=True) + GRADIENT_BYTES
            * ((m.scattering or 0.0) + outputs - (dense + experts if accumulated else 0.0)))


def _largest(values: list):
    numbers = all(isinstance(v, (int, float)) for v in values)
    return max(values) if numbers else sympy.Max(*values)
