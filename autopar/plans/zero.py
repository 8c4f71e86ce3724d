"""How a plan's data parallelism runs under each ZeRO stage and schedule: the rules the runtime
follows when it wraps a stage in FSDP2 and the cost model prices, written once.

ZeRO-2 and 3 reduce-scatter the gradients after every micro-batch, so that a rank accumulates
only its shard (DeepSpeed's stage 2 and torchtitan's FSDP do the same); plain data parallelism and
ZeRO-1 (whose point is to split only the optimizer state) accumulate them whole and reduce once,
on the last micro-batch. ZeRO-3 frees its gathered weights after each forward and gathers them
again for the backward. Zero-bubble schedules split the backward into an input half and a weight
half that runs later: FSDP's per-layer reduction would fire between them, and freeing weights
between forward and backward gives wrong weight gradients in torch 2.13, so under them gradients
accumulate whole and ZeRO-3 keeps its weights gathered.

FSDP2 holds a stage's weights wherever more than one replica shares them, where they are
offloaded, and under mixed precision even for one replica: FSDP2's policy hands the forward
16-bit weights. Autocast alone keeps fp32 weights where it casts nothing (an embedding's
lookup, a learned position added, a norm's scale), so a stage of one replica computed its
residual stream in fp32 from the first layer on while the same stage of two computed it in 16
bits: twice its activations' bytes and tensor-parallel traffic, on plans the estimator priced
alike.
"""

from __future__ import annotations

from autopar.plans.vocabulary import Precision, Schedule


def reduces_every_micro_batch(zero: int, schedule: str) -> bool:
    """Whether gradients are reduce-scattered after every micro-batch's backward, rather than
    accumulated whole and reduced on the last micro-batch."""
    return zero >= 2 and schedule != Schedule.ZERO_BUBBLE


def keeps_weights_gathered(zero: int, schedule: str) -> bool:
    """Whether a stage keeps its weights gathered from a micro-batch's forward to its backward
    (FSDP2's `reshard_after_forward=False`): below ZeRO-3 always, under ZeRO-3 only with a
    zero-bubble schedule."""
    return zero < 3 or schedule == Schedule.ZERO_BUBBLE


def frees_each_group_after_its_backward(zero: int, *, pipelined: bool) -> bool:
    """Whether plain data parallelism in FSDP2 (`replicate`, ZeRO-0) frees each group's gathered
    weights as the group's backward ends, every micro-batch: on a single stage, whose loop leaves
    FSDP2's default (autopar.runtime.schedule.MicroBatchLoop); torch's pipeline stages keep them
    gathered until the step's last backward, as ZeRO-1/2 do (`keeps_weights_gathered`)."""
    return zero == 0 and not pipelined


def reduces_group_by_group_at_the_last_backward(zero: int, schedule: str, *, pipelined: bool) -> bool:
    """Whether a stage that accumulates its gradients whole (`reduces_every_micro_batch` false)
    reduces them as the step's last backward ends each FSDP group, resharding the group's
    gathered weights with them: a single stage's loop turns FSDP2's gradient sync on for the
    last micro-batch, and under ZeRO-1/2, which keep the weights gathered until then, its
    resharding after backward (autopar.runtime.schedule.MicroBatchLoop; ZeRO-0 reshards after
    every backward, `frees_each_group_after_its_backward`). torch's pipeline stages reduce after
    their last backward instead (`perform_reduce_grad`)."""
    return not pipelined and zero < 3 and not reduces_every_micro_batch(zero, schedule)


def holds_weights_in_fsdp(*, replicas: int, offload: bool, precision: str) -> bool:
    """Whether FSDP2 wraps a stage of `replicas` (its dp x cp ranks of the same weights): over
    several replicas, offloaded, or in 16 bits (module docstring)."""
    return replicas > 1 or offload or precision != Precision.FP32


def partial_gradient_reductions(*, zero: int, schedule: str, replicas: int, offload: bool,
                                precision: str, micro_batches: int) -> tuple[int, float]:
    """How often a stage all-reduces over its tensor-parallel ranks the weight gradients that
    tensor parallelism leaves as partial sums (a norm's weight under sequence parallelism), and
    the share of their fp32 bytes each moves. Where FSDP2 reduces the gradients after every
    micro-batch, it reduces these with them, unsharded and in the compute dtype; where it
    accumulates them for the last micro-batch, it holds them in fp32 and reduces them once, as the
    runtime does where FSDP2 does not hold the weights (autopar/runtime/gradients.py)."""
    wrapped = holds_weights_in_fsdp(replicas=replicas, offload=offload, precision=precision)
    if not (wrapped and reduces_every_micro_batch(zero, schedule)):
        return 1, 1.0
    return micro_batches, 1.0 if precision == Precision.FP32 else 0.5
