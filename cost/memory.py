"""Memory per device: model states under ZeRO, and the activations a pipeline schedule keeps.

Model states, Adam with mixed precision (Rajbhandari et al., ZeRO, 2020), per parameter:
    weights    2 bytes  bf16 copy used by forward and backward
    gradients  2 bytes  bf16, reduced over the data-parallel group in that dtype
    optimizer 12 bytes  fp32 master weights (4) and Adam's two moments (4 + 4)
16 bytes in all. ZeRO-1 splits the optimizer states over the data-parallel group, ZeRO-2 the
gradients as well, ZeRO-3 (FSDP) also the weights. Megatron-LM keeps fp32 gradient accumulation
buffers instead (18 bytes); autopar's runtime reduces in bf16.

Activations are counted from the graph (what autograd saves per op; see cost/layout.py) for one
micro-batch of one model chunk, then multiplied by how many chunk-micro-batches the schedule holds
at once on a device (`in_flight`).
"""

from __future__ import annotations

from autopar.errors import AutoparError

BYTES_PER_PARAM = {"weights": 2, "gradients": 2, "optimizer": 12}
# An Adam step reads master weights, both moments and the gradient, and writes the three states
# and the bf16 weights: 4+4+4+2 read, 4+4+4+2 written, plus the gradient-norm pass (2).
OPTIMIZER_STEP_BYTES_PER_PARAM = 30


def model_state_bytes(params: float, *, zero: int, dp: int) -> dict[str, float]:
    """Weights, gradients and optimizer state on one device holding `params` parameters
    (its pipeline stage's share after tensor parallelism), before ZeRO's split over `dp`."""
    if zero not in (0, 1, 2, 3):
        raise AutoparError(f"zero={zero}: ZeRO stages are 0, 1, 2 and 3")
    split = {"optimizer": zero >= 1, "gradients": zero >= 2, "weights": zero >= 3}
    return {part: params * size / (dp if split[part] else 1)
            for part, size in BYTES_PER_PARAM.items()}


def in_flight(schedule: str, *, pp: int, micro_batches: int, virtual: int = 1, stage: int = 0) -> int:
    """How many (chunk, micro-batch) forward activations `stage` holds at its peak.

    GPipe runs every forward before any backward: all m micro-batches of all its chunks. 1F1B
    (Narayanan et al. 2021) warms up with p - stage forwards, then alternates: stage 0 holds p.
    Interleaved 1F1B warms up with 2(p - stage - 1) + (v - 1)p chunk forwards and holds one more,
    (1 + (p-1)/(pv)) times the layers of a non-interleaved first stage (Korthikanti et al. 2022,
    section 4.2.3). Zero-bubble schedules keep 1F1B's activation memory.
    """
    if not 0 <= stage < pp:
        raise AutoparError(f"stage {stage} is outside a pipeline of {pp} stages")
    total = micro_batches * virtual
    if schedule == "gpipe":
        return total
    if schedule in ("1f1b", "zero-bubble") or (schedule == "interleaved-1f1b" and virtual == 1):
        return min(total, (pp - stage) * virtual)
    if schedule == "interleaved-1f1b":
        return min(total, 2 * (pp - stage - 1) + (virtual - 1) * pp + 1)
    raise AutoparError(f"schedule {schedule!r} is unknown; expected gpipe, 1f1b, "
                       f"interleaved-1f1b or zero-bubble")


def megatron_activation_bytes(*, seq: int, batch: int, hidden: int, heads: int, tp: int = 1,
                              sequence_parallel: bool = False, recompute: str = "none") -> float:
    """Activation bytes of one transformer layer by Korthikanti et al. 2022 (table 2), for
    checking the graph-derived count: sbh(34 + 5as/h) without parallelism, with dropout."""
    sbh = seq * batch * hidden
    scores = 5 * heads * seq / hidden
    if recompute == "full":
        return 2 * sbh / (tp if sequence_parallel else 1)
    if recompute == "selective":
        scores = 0.0
    if sequence_parallel:
        return sbh * (34 + scores) / tp
    return sbh * (10 + (24 + scores) / tp)
