"""The step's one reduction of the gradients a pipeline stage accumulated whole.

A pipeline stage that does not reduce its gradients every micro-batch (ZeRO-0 and 1, and every
zero-bubble stage: autopar.plans.zero.reduces_every_micro_batch) accumulates them whole, in fp32,
and torch's schedule reduces them once after the stage's last backward
(`PipelineStage.perform_reduce_grad`): FSDP2's groups one after another, in the order FSDP2 made
their states (pre-order of the stage's modules: the stage's own group, then its layers', a
layer's split experts after it). Each group's post-backward
  - reshards the group: frees its gathered 16-bit (or fp32) weights;
  - copies its gradients into one fp32 reduce input (chunk-cat, padded as its shards are) and
    lets go of them, but for the last of them, which FSDP2's `foreach_reduce` still names (its
    loop's variable) until it returns, wherever the group is sharded over more than one rank;
  - reduce-scatters the input into a new output of 1/dp its size, which becomes the group's
    gradient shard; plain data parallelism (`replicate`, ZeRO-0) copies the input into an
    output of its whole size and all-reduces that, which becomes the group's gradient.
FSDP2 lets go of a group's input before the next group reduces (one input buffer in flight).
So while the k-th group reduces, a rank holds the groups before it as shards, the groups after
it whole, and the k-th's input, output and last gradient; the fullest of these moments is a
phase of the rank's peak (cost.memory.peak_bytes).
"""

from __future__ import annotations

# bytes per element of a gradient FSDP2 accumulates and reduces (its fp32 reduce dtype)
REDUCED_BYTES = 4


def reduce_phases(order: tuple, padded: tuple[float, float], *, weights: float, element: int, zero: int,
                  splits: tuple[float, float]) -> list[dict]:
    """What a rank holds while each group of `order` (`cost.stages.reduce_order`) reduces (module
    docstring), by part as cost.memory.peak_bytes counts them: `weights` the bytes of its
    gathered weights at the step's end, `element` a weight's bytes, `splits` the ranks a dense
    and an experts' group is sharded over, `padded` how much larger their padded buffers are
    (cost/padding.py)."""
    whole = sum(elements for elements, _, _ in order)
    phases, reduced, shards = [], 0.0, 0.0
    for elements, last, experts in order:
        ranks, pad = splits[experts], padded[experts]
        if zero == 0:       # all-reduced in a whole-sized copy of its input
            moving = elements * pad
        else:
            moving = elements * pad / ranks + (last if ranks > 1 else 0.0)
        phases.append({"gradients": REDUCED_BYTES * (whole - reduced - elements + shards + elements * pad + moving),
                       "activations": 0.0, "buffers": 0.0, "optimizer_step": 0.0,
                       "weights": weights - element * (reduced + elements)})
        reduced += elements
        shards += elements if zero == 0 else elements * pad / ranks
    return phases
