"""The memory passes that 16-bit compute on fp32 master weights adds to every micro-batch, as
autopar's runtime trains (FSDP2's mixed precision: under 16 bits FSDP2 holds every stage's
weights, one replica's too, autopar.plans.zero).

Per parameter element a device holds, per micro-batch:

- its weight cast to 16 bits (4 bytes read, 2 written): FSDP2 casts the whole weights of a stage
  of one replica as it unshards them for each micro-batch's forward. Over several replicas it
  casts its 1/dp shard before gathering instead, too small to count here;
- its 16-bit gradient cast to fp32 (2 read, 4 written): by FSDP2 into its reduce-scatter buffer
  or, at a step's first micro-batch, its accumulation buffer;
- that gradient added to the fp32 one of the step's earlier micro-batches. FSDP2 accumulating
  whole gradients (ZeRO-0/1, zero-bubble) adds the 16-bit one in place, casting as it goes (4
  and 2 read, 4 written: `FSDPParam.accumulate_unsharded_grad_if_needed`). Where each
  micro-batch reduce-scatters (ZeRO-2/3), the 1/dp shard is added (4 and 4 read, 4 written). The
  first micro-batch adds nothing.

Measured on an H200, a 311M-parameter llama of two micro-batches on one GPU: 5.95 ms of copy
kernels and 3.82 ms of other elementwise ones a step, beside 57 ms of priced compute
(docs/gpu_runs.md; these passes are 11.2 GB of them). An offloaded stage's gradients go to the
host, whose copies are priced on their own (cost/offload.py).
"""

from __future__ import annotations

from autopar.cost.compute import compute_time
from autopar.plans.vocabulary import Precision
from autopar.plans.zero import reduces_every_micro_batch

WEIGHT_CAST_BYTES = 6
GRADIENT_CAST_BYTES = 6
ACCUMULATE_BYTES = 12
IN_PLACE_ACCUMULATE_BYTES = 10      # fp32 += a 16-bit gradient


def cast_seconds(params: float, spec, schedule: str, micro_batches: int, *, device, eff,
                 precision: str, runtime) -> tuple[float, float]:
    """(weights', gradients') seconds of a micro-batch's casts, the gradients' with their
    accumulation, on a device holding `params` elements of a stage's (`spec`, a StageSpec) fp32
    master weights, where `runtime` is autopar's and trains in 16 bits (module docstring). The
    gradients' run in the weight backward (zero-bubble's W)."""
    if not runtime.fsdp2 or precision == Precision.FP32 or spec.offload:
        return 0.0, 0.0
    replicas = spec.dp * spec.cp
    later = (micro_batches - 1) / micro_batches      # the share of micro-batches that add
    if reduces_every_micro_batch(spec.zero, schedule):
        gradients = params * GRADIENT_CAST_BYTES + params / replicas * ACCUMULATE_BYTES * later
    else:
        gradients = params * (GRADIENT_CAST_BYTES * (1 - later) + IN_PLACE_ACCUMULATE_BYTES * later)
    seconds = lambda moved: compute_time(0, moved, device, "elementwise", efficiencies=eff) if moved else 0.0
    return seconds(params * WEIGHT_CAST_BYTES if replicas == 1 else 0.0), seconds(gradients)
