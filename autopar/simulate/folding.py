"""Loops of a step whose iterations repeat: one of them run for all, its collectives counted for each.

A cluster plan's step repeats itself. A one-stage plan runs its micro-batches in a loop where only
the first (which makes the gradients) and the last (which reduces them) differ from the others;
ring attention passes keys and values over cp hops a layer, and the hops of one kind (the blocks
of ranks before this one, or after it) run the same ops on the same shapes. Run in full, a
llama-70b rank at cp=32 with 32 micro-batches would take the simulator hours: 80 layers x 32
micro-batches x 32 hops, each a few dozen ops on fake tensors.

Under fake tensors an iteration's effect depends on shapes alone, and every iteration of a run
of one kind starts from the same shapes (the one before it left them so): each holds the same
bytes at its peak and leaves the rank as it found it, and sends what the others send. So the
simulated rank runs one iteration of each run, with the same code, and records its collectives
once for every iteration it stands for. A loop keeps each micro-batch's loss (a scalar) until
the step ends: the micro-batch that stands for a run finds kept the losses the run's last one
would, so that its peak is the run's highest.

`tests/test_simulate.py` checks that a folded rank reports what the unfolded one does.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator

import torch

from autopar.runtime.schedule import MicroBatchLoop
from autopar.simulate.collectives import CollectiveRecorder
from autopar.passes import context_attention


def runs(kinds: list) -> list[tuple[int, int]]:
    """(first index, length) of each run of equal consecutive `kinds`."""
    out, index = [], 0
    for _, group in itertools.groupby(kinds):
        length = len(list(group))
        out.append((index, length))
        index += length
    return out


def folded(indices: list[int], kind: Callable[[int], object],
           recorder: CollectiveRecorder) -> Iterator[int]:
    """The first of each run of `indices` of one `kind`; the loop body that follows each runs
    while the recorder counts its collectives once for each index of the run."""
    for first, length in runs([kind(index) for index in indices]):
        with recorder.repeated(length):
            yield indices[first]


@contextlib.contextmanager
def folding_repeats(schedule, recorder: CollectiveRecorder):
    """While active, `schedule` (a one-stage loop) and every ring attention run one iteration of
    each run of repeating ones (module docstring)."""
    saved_steps = context_attention._Ring.steps

    def ring_steps(ring):
        return folded(list(range(ring.size)), ring.step_kind, recorder)

    context_attention._Ring.steps = ring_steps
    if isinstance(schedule, MicroBatchLoop):
        schedule.step = _folded_loop(schedule, recorder)
    try:
        yield
    finally:
        context_attention._Ring.steps = saved_steps
        if isinstance(schedule, MicroBatchLoop):
            del schedule.step


def _folded_loop(loop: MicroBatchLoop, recorder: CollectiveRecorder):
    def step(*inputs, target, losses, return_outputs=False):
        chunks = loop.micro_batches(*inputs, target=target)
        last = loop.n - 1
        for first, length in runs([(i == 0, i == last) for i in range(loop.n)]):
            # the losses the run's last micro-batch finds kept, each a scalar like the first's
            losses.extend(torch.empty_like(losses[0]) for _ in range(length - 1))
            with recorder.repeated(length):
                loop.run_micro_batch(first, chunks, losses)
    return step
