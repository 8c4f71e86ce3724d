"""Data-parallel traffic (gradient reduction, ZeRO's gathers) and how much of it the computation
hides. Both depend on the runtime that trains, so the runtime is named (`RUNTIMES`):

  autopar          autopar's own runtime (the default): torch's FSDP2 with one group per layer
                   (`replicate` for plain data parallelism, `fully_shard` for ZeRO), each of
                   whose collectives is one call per group; gradients reduced on the last
                   micro-batch only (`set_requires_gradient_sync`) for plain data parallelism
                   and ZeRO-1, after every micro-batch for ZeRO-2/3 except under zero-bubble
                   schedules (`autopar.plans.zero.reduces_every_micro_batch`). ZeRO-1/2
                   (`reshard_after_forward=False`) gather the weights before each micro-batch's
                   forward on one stage (FSDP2 frees them after every backward), once per step
                   under a pipeline schedule (torch's stages keep them until the last backward);
                   ZeRO-3 gathers them again for every backward, except under zero-bubble
                   schedules, where they are kept from forward to backward. Weights are
                   gathered in the plan's precision, gradients reduced in fp32 (FSDP2's reduce
                   dtype). Overlapped as "torch" below is. Each reduction also copies a
                   group's gradients through a buffer allocated for it, which costs a CPU
                   host per group and per byte (calibrated; 0 on GPUs).
  torch            plain PyTorch: DDP (or FSDP2's ZeRO-1/2) reduces
                   gradients in 25 MiB buckets while the backward of the LAST micro-batch runs (the
                   others accumulate locally, `no_sync`), and while the later pipeline stages drain;
                   FSDP (ZeRO-3) gathers each block's weights before its forward and its backward,
                   prefetching the next block's during this one's compute, and reduce-scatters each
                   block's gradients as its backward ends, every micro-batch. A recomputed block
                   runs under the gather its backward already made (checkpointing inside the unit).
                   Weights and gradients travel in the plan's precision (by default the
                   device's training dtype: bf16 on GPUs, fp32 on CPUs).
  megatron-core    Megatron-Core's distributed data parallelism of 2024-25 as its performance
                   recipes run it (`--overlap-grad-reduce --overlap-param-gather`, the
                   distributed optimizer): gradients reduce-scattered in buckets during the last
                   micro-batch's backward, as "torch" does, and the updated weights all-gathered
                   behind the next step's first forward rather than after the optimizer step.
  megatron-local   Megatron-LM's own DDP of 2021-22 (`--DDP-impl local`): one all-reduce of the
                   contiguous gradient buffer after the pipeline flush, nothing overlapped.
  deepspeed-2021   DeepSpeed's ZeRO-3 engine of 2021: every sub-module's parameters gathered in its
                   forward and backward hooks, and again for the recomputed forward, one collective
                   per parameter tensor, waited for before the sub-module runs; gradients
                   reduce-scattered per micro-batch. None of it overlapped.

On a device whose collectives run on the cores that compute (a CPU mesh of gloo ranks), nothing
overlaps, whatever the runtime.

What ZeRO adds: ZeRO-1/2 all-gather the updated weights after the optimizer step, on the critical
path; ZeRO-3 moves the weights (bf16) once per gather and the gradients once per micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from autopar.cost.collectives import Group
from autopar.cost.memory import FOREACH_ADAMW_BYTES_PER_PARAM, GRADIENT_BYTES, OPTIMIZER_STEP_BYTES_PER_PARAM
from autopar.errors import AutoparError
from autopar.plans.vocabulary import Schedule

# PyTorch DDP's default gradient bucket (bucket_cap_mb=25); FSDP's per-block units are similar.
BUCKET_BYTES = 25 * 2**20


@dataclass(frozen=True, slots=True)
class Runtime:
    name: str
    overlap: bool               # collectives run beside compute (buckets, prefetch) or wait
    gather_unit: str            # ZeRO-3's collective per "block" or per parameter "tensor"
    regather_on_recompute: bool  # ZeRO-3 gathers again for a recomputed forward
    fsdp2: bool = False         # autopar's FSDP2: per-group calls, counts by micro-batch (above)
    # ZeRO-1/2's all-gather of the updated weights runs behind the next forward (Megatron-Core's
    # --overlap-param-gather) rather than after the optimizer step
    overlap_param_gather: bool = False
    # torch's PipelineStage allocates a receive buffer per micro-batch for a stage's inputs and
    # for its outputs' gradients, and keeps them from the first step on (cost/estimator.py);
    # autopar's stages let each go after its micro-batch's backward
    receive_buffers: bool = False
    # bytes its optimizer step moves per parameter: a fused Adam (Megatron's, DeepSpeed's), or
    # torch's AdamW as a user's training script builds it, foreach (cost/memory.py)
    optimizer_step_bytes: int = OPTIMIZER_STEP_BYTES_PER_PARAM
    # the attention kernel it runs on a GPU (cost/compute.py): torch's SDPA picks
    # FlashAttention-2, Transformer Engine picks cuDNN's fused attention on Hopper and later
    attention_kernel: str = "flash"
    # runs the model as captured under autocast, so values stay fp32 where autocast or the model's
    # own casts keep them (autopar.mixed_dtypes); the others hold the whole model in 16 bits
    autocast: bool = False


RUNTIMES = {
    "autopar": Runtime("autopar", overlap=True, gather_unit="block", regather_on_recompute=False,
                       fsdp2=True, autocast=True,
                       optimizer_step_bytes=FOREACH_ADAMW_BYTES_PER_PARAM),
    "torch": Runtime("torch", overlap=True, gather_unit="block", regather_on_recompute=False,
                     receive_buffers=True, optimizer_step_bytes=FOREACH_ADAMW_BYTES_PER_PARAM),
    "megatron-core": Runtime("megatron-core", overlap=True, gather_unit="block",
                             regather_on_recompute=False, overlap_param_gather=True,
                             attention_kernel="cudnn"),
    "megatron-local": Runtime("megatron-local", overlap=False, gather_unit="block",
                              regather_on_recompute=True),
    "deepspeed-2021": Runtime("deepspeed-2021", overlap=False, gather_unit="tensor",
                              regather_on_recompute=True),
}


# torch's schedule runtime, which runs these schedules, waits each micro-batch's sends only at
# the step's end, and a process group's send holds its tensor until waited: every micro-batch's
# sent activations and input gradients stay until then (as many bytes as a receive buffer each)
_SENDS_WAITED_AT_THE_END = (Schedule.INTERLEAVED_1F1B, Schedule.ZERO_BUBBLE)


def keeps_every_send(schedule: str) -> bool:
    """Whether every micro-batch's sends stay until the step's end (above): a chunk's sent
    output, which its stage also keeps for the backward, is then among them."""
    return schedule in _SENDS_WAITED_AT_THE_END


def holds_every_transfer(runtime: Runtime, schedule: str) -> bool:
    """Whether a pipeline rank holds what it receives or sends for every micro-batch of a step:
    torch's PipelineStage keeps a receive buffer per micro-batch (autopar's lets each go after
    the micro-batch's backward: autopar.runtime.schedule.ReceivingStage); some schedules keep
    every send until the step's end (above)."""
    return runtime.receive_buffers or schedule in _SENDS_WAITED_AT_THE_END


def runtime_named(name: str | Runtime) -> Runtime:
    if isinstance(name, Runtime):
        return name
    try:
        return RUNTIMES[name]
    except KeyError:
        raise AutoparError(f"runtime {name!r} is unknown; runtimes: {', '.join(RUNTIMES)}") from None


@dataclass(kw_only=True, slots=True)
class DeviceWork:
    """One pipeline rank's share of a step, as the data-parallel traffic sees it."""
    params: float               # parameter elements on the device (after tensor parallelism)
    tensors: int                # parameter tensors on it
    blocks: int                 # FSDP groups on it: its modules with parameters, one per chunk for the rest
    forward_s: float            # per micro-batch, all its chunks
    backward_s: float           # per micro-batch, recomputed forwards included
    drain_s: float              # backward of the last micro-batch and of the stages after it
    recompute: bool             # full recompute of the blocks
    pipelined: bool = False     # under a pipeline schedule (more than one pipeline rank)
    kept_gathered: bool = False  # a schedule under which ZeRO-3 keeps weights forward to backward
    reduce_every: bool = False  # gradients reduced after every micro-batch (autopar's ZeRO-2/3)
    # what one blocking collective waits for the last rank after one group's forward (a ZeRO
    # gather) or backward (a reduction) on a host whose cores the ranks share (Efficiencies.wait_after)
    forward_wait_s: float = 0.0
    backward_wait_s: float = 0.0
    # what FSDP2's reduction costs the host beyond its collective, per group and per byte of each
    # buffer it fills (Efficiencies.data_parallel_reduce_group_s or sharded_reduce_group_s, _byte_s)
    reduce_group_s: float = 0.0
    reduce_byte_s: float = 0.0
    expert_params: float = 0.0  # of `params`, experts' under expert parallelism (own group)
    padding: tuple = (0.0, 0.0)  # elements FSDP2 pads ZeRO's shards with, gathered and reduced
                                 # with them: dense, experts (cost/padding.py)


def exposed_data_parallel(work: DeviceWork, *, dp: int, tp: int, zero: int, micro_batches: int,
                          mesh, runtime: Runtime, element_bytes: int | None = None) -> float:
    """Seconds of data-parallel communication on the critical path of one step; weights and
    gradients move `element_bytes` per element (the plan's precision; by default the device's
    training dtype)."""
    if dp == 1:
        return 0.0
    group = Group.strided(mesh, dp, tp)
    element = element_bytes or (4 if mesh.device.training_dtype == "float32" else 2)
    if not mesh.device.overlaps_communication:
        runtime = replace(runtime, overlap=False)
    if runtime.fsdp2:
        return _fsdp2(work, group, dp, zero, micro_batches, element, runtime.overlap)
    if zero == 3:
        return micro_batches * _zero3_per_micro_batch(work, group, runtime, element)
    grads = work.params * element
    # ZeRO-1/2 reduce-scatter where DDP all-reduces (half the ring's traffic) and all-gather the
    # updated weights after the step; the all-gather's ring cost is the other half.
    reduce = group.reduce_scatter(grads) if zero else group.all_reduce(grads)
    if runtime.overlap:
        bucket = min(grads, BUCKET_BYTES)
        last = group.reduce_scatter(bucket) if zero else group.all_reduce(bucket)
        reduce = max(reduce - work.drain_s, last)
    after_step = group.all_gather(work.params * element) if zero else 0.0
    if runtime.overlap and runtime.overlap_param_gather:
        # each bucket's gather ahead of the forward that reads it: the first bucket waits
        bucket = min(work.params * element, BUCKET_BYTES)
        after_step = max(after_step - work.forward_s, group.all_gather(bucket) if zero else 0.0)
    return reduce + after_step


def reduction_buffers(zero: int, dp: int) -> float:
    """Buffers, in units of a group's gradients, that one FSDP2 reduction fills: it copies the
    gradients into one allocated for the call and reduces into another, of the same size for
    replicate (an all-reduce), of a 1/dp share under ZeRO (a reduce-scatter)."""
    return 2.0 if zero == 0 else 1.0 + 1.0 / dp


def _fsdp2(work: DeviceWork, group: Group, dp: int, zero: int, micro_batches: int, element: int,
           overlap: bool) -> float:
    """autopar's FSDP2, one call per group and collective: the gradients reduced once per step
    (all-reduced, or reduce-scattered under ZeRO) or after every micro-batch, the weights
    gathered as often as the runtime frees them (module docstring)."""
    units = max(1, work.blocks)
    share = work.params * element / units
    # gradients travel in FSDP2's fp32 reduce dtype whatever the compute precision
    grads = work.params * GRADIENT_BYTES / units
    if zero == 0:
        reduce, forward_gathers, backward_gathers = units * group.all_reduce(grads), 0, 0
    else:
        reduce = units * group.reduce_scatter(grads)
        kept = work.pipelined and (zero < 3 or work.kept_gathered)
        forward_gathers = 1 if kept else micro_batches
        backward_gathers = micro_batches if zero == 3 and not work.kept_gathered else 0
    gather = units * group.all_gather(share)
    reductions = micro_batches if zero and work.reduce_every else 1
    reduce += (units * work.reduce_group_s
               + reduction_buffers(zero, dp) * work.params * GRADIENT_BYTES * work.reduce_byte_s)
    if not overlap:
        waits = units * ((reductions + backward_gathers) * work.backward_wait_s
                         + forward_gathers * work.forward_wait_s)
        return reductions * reduce + (forward_gathers + backward_gathers) * gather + waits
    # Prefetching hides each group's gather behind the previous group's compute; the first of
    # each pass waits. A reduction runs beside the rest of its backward and the next
    # micro-batch; the last one beside the last backward and the stages' drain.
    forward = forward_gathers * (max(0.0, gather - work.forward_s) + gather / units)
    backward = backward_gathers * (max(0.0, gather - work.backward_s) + gather / units)
    earlier = (reductions - 1) * max(0.0, reduce - work.backward_s)
    return forward + backward + earlier + max(reduce - work.drain_s, reduce / units)


def _zero3_per_micro_batch(work: DeviceWork, group: Group, runtime: Runtime,
                           element: int) -> float:
    units = max(1, work.tensors if runtime.gather_unit == "tensor" else work.blocks)
    gather = units * group.all_gather(work.params * element / units)
    scatter = units * group.reduce_scatter(work.params * element / units)
    backward_gathers = 2 if work.recompute and runtime.regather_on_recompute else 1
    if not runtime.overlap or runtime.gather_unit == "tensor":   # gathered where used: waited on
        return gather * (1 + backward_gathers) + scatter
    # Prefetching hides each unit's gather behind the previous unit's compute: what exceeds the
    # pass's compute shows, and the first gather of each pass and the last reduce-scatter wait.
    forward = max(0.0, gather - work.forward_s)
    backward = max(0.0, backward_gathers * gather + scatter - work.backward_s)
    return forward + backward + 2 * gather / units + scatter / units
