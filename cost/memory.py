"""Memory per device: model states under ZeRO, and the activations a pipeline schedule keeps.

Model states, Adam with mixed precision, per parameter (bf16 and fp16 alike; fp16's loss scale is
one number), as autopar's runtime holds them:
    weights    2 bytes  16-bit copy used by forward and backward (FSDP2's gathered parameters,
                        or autocast's cached casts)
    gradients  4 bytes  fp32: autocast's parameters are fp32, and FSDP2 accumulates and reduces
                        them in its fp32 reduce dtype (runtime/precision.py)
    optimizer 12 bytes  fp32 master weights (4) and Adam's two moments (4 + 4)
18 bytes in all, as Megatron-LM's fp32 gradient buffers also make it (ZeRO's paper counts 16,
with 16-bit gradients). ZeRO-1 splits the optimizer states over the data-parallel group, ZeRO-2
the gradients as well, ZeRO-3 (FSDP) also the weights.

Activations are counted from the graph (what autograd saves per op; see cost/layout.py) for one
micro-batch of one model chunk, then multiplied by how many chunk-micro-batches the schedule holds
at once on a device (`in_flight`).

A device's peak (`peak_bytes`), as autopar's runtime trains (FSDP2 `replicate` for dp > 1 or
16-bit compute, `fully_shard` for ZeRO: autopar.plans.zero). Alive throughout the forwards and backwards:
  optimizer   Adam's moments and the fp32 master weights the optimizer steps: FSDP's sharded
              parameters when data parallel (its own tensor), the weights themselves when not
              and in fp32; split over dp from ZeRO-1 on
  weights     what the forward and backward read, in the compute dtype: the stage's gathered
              weights (FSDP keeps them from forward to backward below ZeRO-3), `gathered` under
              ZeRO-3
  receive_buffers  in a pipeline, for every micro-batch of a step, as many bytes as a stage's
              inputs and its outputs' gradients: torch's PipelineStage keeps a receive buffer
              for each, and torch's schedule runtime (interleaved, zero-bubble) keeps what each
              sent (cost.overlap.holds_every_transfer)
and in the phase at the peak, the larger of:
  first backward  the `held` micro-batches' activations, with the gradients of earlier
              micro-batches only when the schedule ran a backward before holding that many (a
              single stage's loop, 1F1B's steady state); where none ran and FSDP2 accumulates
              the step's gradients, those of the groups this backward has done, in fp32 (a
              16-bit group's own beside their copy as it ends: cost/backward_transients.py)
  later backward  the activations of one micro-batch fewer (or of one), with the first
              micro-batch's gradients (FSDP accumulates them unsharded until the last
              micro-batch reduces them)
  step's reduction  where a pipeline stage reduces its accumulated gradients once, after its
              last backward: group by group, with each group's copies (cost/step_reduce.py)
  optimizer step  the gathered weights freed; the reduced gradients (split over dp from ZeRO-1
              on: FSDP shards them) and Adam's temporaries (`optimizer_step`)
Where the backward is split (zero-bubble, `split_backward`), an input backward makes no weight
gradient but keeps its graph (torch's stage_backward_input retains it for the weight backward),
the loss's kept copy with it; a weight backward, between input backwards, makes the gradients of
one weight at a time (stage_backward_weight, a parameter group per call) beside those accumulated.
When the runtime reduces the gradients after every micro-batch (`reduce_every`, as ZeRO-2/3 do)
each backward is the loss's phase and one phase at each op's backward that may be the fullest
(cost/backward_moments.py: the weight gradients of the group that runs, the last reduce-scatter's
input, the shards reduced so far, under ZeRO-3 the groups gathered then). After an earlier
micro-batch the rank holds the shards of its gradients, and in a pipeline, until the first
reduce-scatter, the input of the earlier one's last, the `group` it reduced last in fp32, which
FSDP2 keeps until the next reduce-scatter starts (a single stage's loop ends each backward as a
step's last, where FSDP2 lets go of it); each of an interleaved rank's chunks is a root of its
own and keeps its own last (`group` is their sum), until its own last backward, after which
torch's schedule runtime reduces and reshards it (an interleaved rank's order is walked:
cost/interleaved_order.py). The loss's
backward runs before any group's: under ZeRO-3, whose groups are resharded after their forwards
(the runtime sets reshard_after_forward, so FSDP2 does not keep even the root's gathered), none
is gathered again by then. A later micro-batch's forward holds what the loss's backward does
but the loss, and under ZeRO-3 (`forwards`) a group's gathered weights with its all-gather's
output (FSDP2 keeps that output to overlap the next copy-out, until the root's post-forward);
at the forward's end the last group's output while the outputs leave the stage: a
tensor-parallel stage's 1/tp of them, gathered whole and copied dense
(autopar.passes.tensor_parallel), a single rank's as they are.
"""

from __future__ import annotations

from types import MappingProxyType

import sympy

from autopar.errors import AutoparError
from autopar.plans.vocabulary import Precision, Recompute, Schedule
from autopar.plans.zero import holds_weights_in_fsdp
from autopar.cost.step_reduce import reduce_phases

ADAM_STATE_BYTES = 8       # two fp32 moments per element
MASTER_COPY_BYTES = 4      # the fp32 master copy of a 16-bit weight
GRADIENT_BYTES = 4         # fp32 gradients in every precision (module docstring)
BYTES_PER_PARAM = {"weights": 2, "gradients": GRADIENT_BYTES,
                   "optimizer": ADAM_STATE_BYTES + MASTER_COPY_BYTES}
# Training in fp32 (a plan's precision "fp32"): fp32 weights and gradients, Adam's two moments.
BYTES_PER_PARAM_FP32 = {"weights": 4, "gradients": 4, "optimizer": ADAM_STATE_BYTES}
# An Adam step reads master weights, both moments and the gradient, and writes the three states
# and the bf16 weights: 4+4+4+2 read, 4+4+4+2 written, plus the gradient-norm pass (2).
OPTIMIZER_STEP_BYTES_PER_PARAM = 30
# torch's AdamW as it runs by default (foreach, not fused) on fp32 parameters: one pass a
# _foreach op, each reading and writing whole fp32 lists: weight decay (4 read, 4 written), the
# first moment's lerp (8, 4), the second's scale (4, 4) and addcmul (12, 4), its square root,
# bias correction and eps (3 x (4, 4)), the update's addcdiv (12, 4): 84 bytes a parameter.
# Measured on an H200: 6.65 ms for 311M parameters, 3.9 TB/s (benchmarks/gpu_profile.py).
FOREACH_ADAMW_BYTES_PER_PARAM = 84


def model_state_bytes(params: float, *, zero: int, dp: int,
                      precision: str = Precision.BF16) -> dict[str, float]:
    """Weights, gradients and optimizer state on one device holding `params` parameters
    (its pipeline stage's share after tensor parallelism), before ZeRO's split over `dp`."""
    if zero not in (0, 1, 2, 3):
        raise AutoparError(f"zero={zero}: ZeRO stages are 0, 1, 2 and 3")
    split = {"optimizer": zero >= 1, "gradients": zero >= 2, "weights": zero >= 3}
    return {part: params * size / (dp if split[part] else 1)
            for part, size in (BYTES_PER_PARAM_FP32 if precision == Precision.FP32 else BYTES_PER_PARAM).items()}


# torch's AdamW (foreach) takes the square root of the second moment into a new fp32 tensor per
# parameter before dividing: one fp32 element per parameter element alive during the step.
# Without foreach kernels (a CPU) it steps one tensor at a time, and its square root and the
# quotient are both alive: two fp32 temporaries of the largest tensor.
OPTIMIZER_STEP_TEMPORARY_BYTES = 4
ONE_TENSOR_STEP_TEMPORARIES = 2
# Cross-entropy on fp32 logits keeps its log-softmax output for the backward (a copy of the
# logits per micro-batch whose backward has not run), and its backward adds the gradient it
# receives and the one it gives.
LOSS_KEPT_COPIES = 1
LOSS_BACKWARD_COPIES = 2
# ZeRO-3 (FSDP2) holds the gathered weights of the group that runs and of the one it prefetches.
GATHERED_GROUPS = 2


_BLANK = MappingProxyType(dict.fromkeys(("gradients", "activations", "buffers", "optimizer_step"), 0.0))  # a phase's own


def peak_bytes(*, params: float, gathered: float, weight: float, zero: int, dp: int, group: float = 0.0,
               precision: str, micro_batches: int, held: int, pipelined: bool, activations, logits, flowing,
               reduce_every: bool = False, expert_params: float = 0.0, expert_dp: int = 1, received=0.0,
               loss_held: int | None = None, offload: bool = False, one_tensor: float = 0.0,
               deferred=(0.0, 0.0), split_backward=False, paired=None, padding=(0.0, 0.0), moments=(), forwards=(),
               walked=(), alone: bool = False, reduced_at_end=((), (1.0, 1.0)), accumulating=None) -> dict:
    """Memory of one device at its peak, by part (`_at_peak`), phases as in the module docstring.
    `params` elements of its stage(s) (`expert_params` of them experts', whose optimizer state and
    gradient shards ZeRO splits over their `expert_dp` ranks), `gathered` those ZeRO-3 holds
    gathered at once, `activations` the bytes kept for the backward: `held` micro-batches of
    `micro_batches`; on the last stage each of the `loss_held` that ran the last chunk also keeps
    the loss's fp32 copy of its `logits` elements and, in a pipeline, the logits (cached by
    PipelineStage). A backward's transients (`buffers`): the loss's copy and gradients, or a block
    backward's fullest moment (`flowing`, rerun activations included) with the gradient of the
    weight it reads (`weight`; `paired`, `accumulating`: `_transients`); under `reduce_every`,
    the `moments` (`_moment_phase`), under ZeRO-3 the `forwards`'. `received`, `deferred`,
    `split_backward`, `padding`, `offload`, `one_tensor`, `reduced_at_end`: receive buffers,
    zero-bubble's kept gradients and split backward (module docstring), ZeRO's padding, states
    on the host, `_step_temporaries`, a stage's one reduction (cost/step_reduce.py). `walked`: an
    interleaved rank's backwards in its order, with what each holds, in place of the first and
    later (cost/interleaved_order.py); `alone`: the step's only backward, weighed by `paired`."""
    wrapped = holds_weights_in_fsdp(replicas=dp, offload=offload, precision=precision)
    split, expert_split = (dp if wrapped else 1, max(expert_dp, 1)) if zero >= 1 else (1, 1)
    element = 4 if precision == Precision.FP32 else 2     # fp8 recipes keep 16-bit states
    master, expert_master = (MASTER_COPY_BYTES if held else 0 for held in _fsdp_held(precision, wrapped, expert_dp))
    weights = element * (gathered if wrapped and zero == 3 else params + sum(padding))  # padded buffers
    gradients, losses = params * (element if offload else GRADIENT_BYTES), held if loss_held is None else loss_held
    cached, kept, loss, block, between, block_later = _transients(flowing, weight * element, element * logits
        if pipelined else 0.0, 4 * logits, split_backward, paired, alone, None if walked else accumulating)
    sharded, optimizer, shards = _sharded_states(params, expert_params, padding, (split, expert_split),
                                                 (master, expert_master), offload)
    persistent = {"weights": weights, "optimizer": optimizer, **({"receive_buffers": received} if received else {})}
    at = lambda state: {"activations": state.activations + (losses - 1) * kept}   # a walked backward's
    kept_weights = lambda state: weights * (1 - state.finished) if state and wrapped and zero < 3 else weights
    blocks_of = lambda earlier: block_later if earlier else block

    def backward(activations_held, earlier: bool) -> list[dict]:   # after an earlier one's or not
        held_now = {**_BLANK, "activations": activations_held}
        if reduce_every and wrapped:
            return _reduced_phases(held_now, earlier, walked=walked, at=at, kept_weights=kept_weights, shards=shards,
                                   group=group if pipelined else 0.0, zero=zero, loss=loss, block=block,
                                   forwards=forwards, element=element, moments=moments, split=(split, expert_split),
                                   cached=cached, offload=offload, micro_batches=micro_batches, pipelined=pipelined)
        return [{**_BLANK, **at(s), "weights": kept_weights(s), "buffers": _max(loss, blocks_of(s.running)) if s.loss
                 else blocks_of(s.running), "gradients": gradients * (s.share - s.finished) + shards * s.finished}
                for s in walked] or [{**held_now, "gradients": gradients if earlier else 0.0,
                                      "buffers": _max(loss, blocks_of(earlier))}]
    later, first = max(held - 1, 1), activations + deferred[0] + (losses - 1) * kept
    ending = reduce_phases(*reduced_at_end, weights=weights, element=element, zero=zero, splits=(
        split, expert_split)) if wrapped and pipelined and not (reduce_every or offload) else []
    step = {**_BLANK, "weights": 0.0 if master else weights, "gradients": shards,
            "optimizer_step": 0.0 if offload else _step_temporaries(sharded, one_tensor / split)}
    phases = [*backward(first, True), step] if walked else [*ending,   # the first backward (and, making new
        *backward(first, micro_batches > held),     # shards, the step's first micro-batch's), the time
        *(backward(first, False) if reduce_every and micro_batches > held else ()),   # between
        {**backward(activations + deferred[1] + (losses - 1) * kept, micro_batches > held)[0],
         "buffers": between},     # backwards (zero-bubble), the second
        *backward(activations * later / held + (max(losses - 1, 1) - 1) * kept, micro_batches > 1), step]
    return _at_peak(persistent, phases)


def _sharded_states(params, expert_params, padding: tuple, splits: tuple, masters: tuple, offload: bool) -> tuple:
    """What ZeRO splits over `splits` (the dense parameters' ranks, the experts'), padded as FSDP2
    pads them: a function of the bytes per element (and the experts' extra) to a rank's bytes, and
    a rank's optimizer state and gradient shards (none on the device when offloaded)."""
    dense, experts = params - expert_params + padding[0], expert_params + padding[1]
    sharded = lambda per, extra=0.0: dense * per / splits[0] + experts * (per + extra) / splits[1]
    if offload:
        return sharded, 0.0, 0.0
    return sharded, sharded(ADAM_STATE_BYTES + masters[0], masters[1] - masters[0]), sharded(GRADIENT_BYTES)


def _reduced_phases(held_now: dict, earlier: bool, *, walked, at, kept_weights, shards, group, zero: int, loss,
                    block, forwards, element: int, moments, pipelined: bool, micro_batches: int,
                    **moment_args) -> list[dict]:
    """peak_bytes's phases of a backward where the runtime reduce-scatters after every micro-batch:
    the loss's backward (no group gathered under ZeRO-3), under ZeRO-3 the forwards' ends (module
    docstring), and the block's `moments` (`_moment_phase`); on a walked rank (`walked`, `at`,
    `kept_weights`: peak_bytes) the loss's at each backward of the chunk that computes it, and
    each moment with what the rank holds at its own."""
    loss_phase = {**held_now, **({"weights": 0.0} if zero == 3 else {}), "buffers": loss,
                  "gradients": shards + group * GRADIENT_BYTES if earlier else 0.0}
    ends = [_forward_end({**loss_phase, **at(backed)} if walked and backed else loss_phase, element * held, out,
                         backed, shards) for held, out, backed in forwards]
    losses_walked = [{**loss_phase, **at(s), "weights": 0.0 if zero == 3 else kept_weights(s),
                      "gradients": shards * s.share + GRADIENT_BYTES * s.lasts} for s in walked if s.loss]
    blocks = [_moment_phase(moment, {**held_now, **at(moment[-1])} if walked and moment[-1] else held_now,
                            earlier=earlier, weights=kept_weights(moment[-1] if walked else None),
                            shards=shards, zero=zero, element=element, held_before=group if earlier else 0.0,
                            frees_gathered=_frees_gathered(pipelined, micro_batches, earlier), **moment_args)
              for moment in moments]
    return [*(losses_walked if walked else [loss_phase]), *(ends if zero == 3 else []),
            *(blocks or [{**held_now, "gradients": shards if earlier else 0.0, "buffers": block}])]


def _transients(flowing, weight_gradient, cached, loss_copy, split_backward: bool, paired, alone: bool,
                accumulating=None) -> tuple:
    """A backward's transient bytes: (the logits a pipeline stage caches, the loss's kept copy
    with them, the loss's backward, a block's backward, a weight backward's, a block's backward
    after an earlier one). Split, the input backward makes no weight gradient but keeps the
    loss's copy (module docstring). After an earlier backward the weight gradient an op makes
    is a transient beside the accumulated ones: with `paired`, the fullest moment with its own.
    Where FSDP2 accumulates the step's gradients, the first backward's moments hold those of
    the groups done (`accumulating`: cost/backward_transients.py)."""
    kept = LOSS_KEPT_COPIES * loss_copy + cached
    loss = kept + LOSS_BACKWARD_COPIES * loss_copy
    if split_backward:      # `paired`: where an input backward reads a weight whole
        block = (flowing if paired is None else paired) + kept
        return cached, kept, loss, block, weight_gradient, block
    block = paired + cached if alone else flowing + weight_gradient + cached
    first = block if accumulating is None else accumulating + cached
    return cached, kept, loss, first, 0.0, block if paired is None else paired + cached


def _fsdp_held(precision: str, wrapped: bool, expert_dp: int) -> tuple[bool, bool]:
    """Whether FSDP2 holds the stage's weights and its experts' as 16-bit or gathered copies of
    fp32 shards (each then with a master copy): split experts are FSDP2's over their own ranks
    even where the stage, one replica in fp32, is not (autopar.runtime.data_parallel)."""
    mixed = precision != Precision.FP32
    return mixed or wrapped, mixed or wrapped or expert_dp > 1


def _step_temporaries(sharded, one_tensor: float) -> float:
    """Bytes Adam's step makes: for every parameter at once (foreach; `sharded` gives the rank's
    bytes at so many per element), or where it steps one tensor at a time, for the rank's shard of
    the largest (`one_tensor` elements)."""
    if one_tensor:
        return ONE_TENSOR_STEP_TEMPORARIES * OPTIMIZER_STEP_TEMPORARY_BYTES * one_tensor
    return sharded(OPTIMIZER_STEP_TEMPORARY_BYTES)


def _moment_phase(moment: tuple, held_now: dict, *, earlier: bool, shards, weights, zero: int,
                  element: int, split: tuple, cached, held_before, offload: bool,
                  frees_gathered: bool) -> dict:
    """A block phase at one op's backward (cost/backward_moments.py), `moment` weighed:
    (bytes of its flowing gradients less the activations freed, weight gradients' elements,
    gathered elements, the last reduce-scatter's group or None, reduced dense and experts'
    elements, those of the group it reduces, if any, and the walked order's `Backed` or None:
    cost/interleaved_order.py, whose chunks backed so far set the shards and inputs held and whether
    this backward makes its chunk's shards or adds into them). Before this backward's first
    reduce-scatter a pipeline stage holds the earlier micro-batch's last one (`held_before`); the
    reduced groups' new shards are fp32, 1/dp (or 1/expert dp) each, on the host when offloaded,
    and only in the step's first backward: a later one adds the group's reduce-scatter output
    into its shard, the two alive a moment. ZeRO-3 holds what the moment gathers; ZeRO-2 frees a
    reduced group's gathered weights only where its runtime does (`_frees_gathered`)."""
    net, grads, gathered, scattering, dense, experts, releasing, backed = moment
    if backed is not None:      # a moment of the rank's walked order (cost/interleaved_order.py)
        shards, earlier, held_before = shards * backed.share, backed.running, backed.lasts
    reduce_input = held_before if scattering is None else scattering
    shard = lambda elements: GRADIENT_BYTES * (elements[0] / split[0] + elements[1] / split[1])
    new = 0.0 if offload else shard(releasing) if earlier else shard((dense, experts))
    if zero == 3:
        weights = element * gathered
    elif frees_gathered:
        weights = weights - element * (dense + experts)
    return {**held_now, "weights": weights,
            "gradients": (shards if earlier or backed is not None else 0.0) + GRADIENT_BYTES * reduce_input + new,
            "buffers": net + element * grads + cached}


def _forward_end(loss_phase: dict, weights, out, backed, shards) -> dict:
    """A forward's end under ZeRO-3 (module docstring): the `weights` it gathered, its transient
    `out`; at a moment of a rank's walked order (`backed`, cost/interleaved_order.py) the gradients
    of the backwards run before it, their chunks' share of the `shards` and their reduce-scatter
    inputs, rather than the loss phase's."""
    gradients = {} if backed is None else {"gradients": shards * backed.share + backed.lasts * GRADIENT_BYTES}
    return {**loss_phase, "weights": weights, "buffers": out, **gradients}


def _frees_gathered(pipelined: bool, micro_batches: int, earlier: bool) -> bool:
    """Whether ZeRO-2 frees each group's gathered weights after its backward in this one. Outside
    a pipeline the runtime does so in the step's last micro-batch only (GradientAccumulation):
    the one backward of a one-micro-batch step, or the later of two; from three micro-batches on
    a middle one holds the earlier shards with the weights still gathered, which is fuller than
    the last. A pipeline stage keeps them gathered through every backward (ReducingStage)."""
    return not pipelined and (micro_batches == 1 or (earlier and micro_batches == 2))


def _at_peak(persistent: dict, phases: list[dict]) -> dict:
    """The parts at the fullest phase; with symbolic sizes, the first phase's and what the others
    need beyond it (`later_phase`)."""
    placed = [{**persistent, **phase} for phase in phases]
    totals = [sum(parts.values()) for parts in placed]
    if all(isinstance(t, (int, float)) for t in totals):
        peak = max(range(len(phases)), key=lambda k: totals[k])
        return {**placed[peak], "later_phase": 0.0}
    return {**placed[0], "later_phase": sympy.Max(0, *(t - totals[0] for t in totals[1:]))}


def _max(a, b):
    return max(a, b) if isinstance(a - b, (int, float)) else sympy.Max(a, b)


def in_flight(schedule: str, *, pp: int, micro_batches: int, virtual: int = 1, stage: int = 0) -> int:
    """How many (chunk, micro-batch) forward activations `stage` holds at its peak.

    GPipe runs every forward before any backward: all m micro-batches of all its chunks. 1F1B
    (Narayanan et al. 2021) warms up with p - stage forwards, then alternates: stage 0 holds p.
    Interleaved 1F1B (torch's, at any v, 1 included) warms up with 2(p - stage - 1) + (v - 1)p
    chunk forwards and holds one more,
    (1 + (p-1)/(pv)) times the layers of a non-interleaved first stage (Korthikanti et al. 2022,
    section 4.2.3). Zero-bubble (torch's ScheduleInterleavedZeroBubble, which autopar runs for
    any number of chunks a rank) frees a micro-batch's activations only at its weight backward,
    which it defers: every rank holds min(m, p) micro-batches of each of its chunks, the last
    stage as many as the first, not 1F1B's p - stage (tests/test_cost.py checks both formulas
    against torch's own orders of actions).
    """
    if not 0 <= stage < pp:
        raise AutoparError(f"stage {stage} is outside a pipeline of {pp} stages")
    total = micro_batches * virtual
    if schedule == Schedule.GPIPE:
        return total
    if schedule == Schedule.ZERO_BUBBLE:
        return min(micro_batches, pp) * virtual
    if schedule == Schedule.ONE_F_ONE_B:
        return min(total, (pp - stage) * virtual)
    if schedule == Schedule.INTERLEAVED_1F1B:
        return min(total, 2 * (pp - stage - 1) + (virtual - 1) * pp + 1)
    raise AutoparError(f"schedule {schedule!r} is unknown; expected gpipe, 1f1b, "
                       f"interleaved-1f1b or zero-bubble")


def pending_weight_backwards(schedule: str, *, pp: int, micro_batches: int, virtual: int = 1,
                             stage: int = 0) -> int:
    """How many (chunk, micro-batch) pairs of `stage` have run their input backward but not yet
    their weight backward when it holds the most activations: 0 where the backward is not split;
    under torch's interleaved zero-bubble schedule stage + 1 (the last stage defers the most, to
    fill the drain), at most the `in_flight` pairs (tests/test_cost.py checks it against
    torch's orders of actions). During an input backward one fewer are done: the one running
    holds its gradients as the backward's transients. The model's first chunk computes no input
    gradients (its inputs are the model's): torch's input backward of it does nothing and its
    weight backward is the whole backward, so none of its pairs keeps gradients in between; on
    the first rank of a pipeline of one chunk a rank, none does."""
    if schedule != Schedule.ZERO_BUBBLE or (stage == 0 and virtual == 1):
        return 0
    held = in_flight(schedule, pp=pp, micro_batches=micro_batches, virtual=virtual, stage=stage)
    return min(stage + 1, held)


def megatron_activation_bytes(*, seq: int, batch: int, hidden: int, heads: int, tp: int = 1,
                              sequence_parallel: bool = False, recompute: str = Recompute.NONE) -> float:
    """Activation bytes of one transformer layer by Korthikanti et al. 2022 (table 2), for
    checking the graph-derived count: sbh(34 + 5as/h) without parallelism, with dropout."""
    sbh = seq * batch * hidden
    scores = 5 * heads * seq / hidden
    if recompute == Recompute.FULL:
        return 2 * sbh / (tp if sequence_parallel else 1)
    if recompute == Recompute.SELECTIVE:
        scores = 0.0
    if sequence_parallel:
        return sbh * (34 + scores) / tp
    return sbh * (10 + (24 + scores) / tp)
