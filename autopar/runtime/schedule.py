"""The schedule that runs a plan's micro-batches on this rank's stages.

A plan with several stages runs the torch.distributed.pipelining schedule that
`autopar.plans.schedules` names for it (the one statement of what torch runs, which the planner
also searches with). A plan with one stage has nothing to pipeline: its schedule is a loop of
forward and backward per micro-batch, as torch's single-stage schedules do, without their
per-chunk bookkeeping.

Data-parallel gradients are reduced when `autopar.plans.zero.reduces_every_micro_batch` says
(the rule the cost model prices): after every micro-batch under ZeRO-2 and 3, so that a rank
accumulates only its shard, otherwise once, on the last micro-batch.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage, schedules
from torch.distributed.pipelining._backward import (_get_grad_fn_or_grad_acc, stage_backward,
                                                    stage_backward_weight)
from torch.distributed.pipelining._utils import _make_tensor_from_meta

from autopar.plans.zero import reduces_every_micro_batch
from autopar.errors import PlanMismatchError
from autopar.plans import Plan
from autopar.plans.schedules import schedule_error, torch_schedule
from autopar.runtime.fsdp_groups import fsdp_param_groups


class MicroBatchLoop:
    """One stage, `n` micro-batches: forward, loss and backward of each in turn. Its `step` takes
    the arguments of torch's schedules' `step` and gives the same gradients: the mean over
    micro-batches (torch's schedules scale the sum by 1/n after the backward)."""

    def __init__(self, module: nn.Module, n: int, loss_fn, *, reduce_every: bool = False,
                 keep_gathered: bool = False):
        self.module, self.n, self.loss_fn = module, n, loss_fn
        self.reduce_every, self.keep_gathered = reduce_every, keep_gathered

    def step(self, *inputs: torch.Tensor, target: torch.Tensor, losses: list,
             return_outputs: bool = False):
        """`return_outputs` is torch's schedules' argument; outputs are never kept here."""
        chunks = self.micro_batches(*inputs, target=target)
        for index in range(self.n):
            self.run_micro_batch(index, chunks, losses)

    def micro_batches(self, *inputs: torch.Tensor, target: torch.Tensor) -> list:
        """Every input's and the target's `n` micro-batches."""
        return [x.tensor_split(self.n) for x in (*inputs, target)]

    def run_micro_batch(self, index: int, chunks: list, losses: list) -> None:
        """Forward, loss and backward of micro-batch `index`. Only the first (which makes the
        gradients) and the last (which reduces them) differ from the others, which repeat
        (autopar.simulate runs one of them for all)."""
        *micro, micro_target = (chunk[index] for chunk in chunks)
        for group in _outermost_fsdp(self.module):
            # accumulated whole until the last micro-batch, or reduced every one (module doc)
            group.set_requires_gradient_sync(self.reduce_every or index == self.n - 1)
            if self.keep_gathered:    # ZeRO-1/2 gather the weights once a step, as a pipeline
                group.set_reshard_after_backward(index == self.n - 1)   # stage does
        loss = self.loss_fn(self.module(*micro), micro_target)
        (loss / self.n).backward()
        losses.append(loss.detach())


def _outermost_fsdp(module: nn.Module) -> list[FSDPModule]:
    """The FSDP modules that no other of `module`'s contains: the stage itself where FSDP2 holds
    it, else the split experts FSDP2 holds alone (a stage of one replica in fp32), whose
    gradients would otherwise be reduced over their ranks after every micro-batch."""
    if isinstance(module, FSDPModule):
        return [module]
    return [group for child in module.children() for group in _outermost_fsdp(child)]


class ReceivingStage(PipelineStage):
    """A pipeline stage that holds a micro-batch's receive buffers only while the micro-batch
    needs them: allocated when its receive is posted, let go after its backward. torch's
    PipelineStage allocates one for every micro-batch's inputs and every one's output gradients
    at its first step and keeps them all, m of each (about 48 GiB on a Qwen3-235B rank at
    pp32 x virtual 3 with 512 micro-batches); Megatron-Core receives into fresh tensors as this
    does. Buffers are torch's own (`_make_tensor_from_meta` of each receive's metadata)."""

    def _setup_forward_recv_info(self, num_microbatches: int, has_backward: bool) -> None:
        super()._setup_forward_recv_info(num_microbatches, has_backward)
        for index in range(num_microbatches):
            self._let_go(self.args_recv_info[index])

    def _setup_backward_recv_info(self, num_microbatches: int):
        super()._setup_backward_recv_info(num_microbatches)
        for index in range(num_microbatches):
            self._let_go(self.grad_recv_info[index])

    def get_fwd_recv_ops(self, fwd_chunk_id: int):
        self._allocate(self.args_recv_info[fwd_chunk_id])
        return super().get_fwd_recv_ops(fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int):
        if self.has_backward and not self.is_last:
            self._allocate(self.grad_recv_info[bwd_chunk_id])
        return super().get_bwd_recv_ops(bwd_chunk_id)

    def set_local_bwd_input(self, next_stage_bwd_outputs, mb_index: int) -> None:
        self._allocate(self.grad_recv_info[mb_index])    # a None gradient zeroes its buffer
        super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, *args, **kwargs):
        result = super().backward_one_chunk(bwd_chunk_id, loss, *args, **kwargs)
        # the input gradients it made are in bwd_cache until sent; autograd keeps what a
        # zero-bubble weight backward still needs
        self._let_go(self.args_recv_info.get(bwd_chunk_id, ()))
        self._let_go(self.grad_recv_info.get(bwd_chunk_id, ()))
        # the schedule keeps each micro-batch's loss to the step's end, and with it the graph's
        # nodes back to the received input, which an AccumulateGrad node holds: one input a
        # micro-batch. torch detaches the stage's output here, but not where it is a view.
        if loss is not None and not loss._is_view():
            loss.detach_()
        return result

    @staticmethod
    def _let_go(infos) -> None:
        for info in infos:
            if not info.is_root_arg and info.tensor_meta is not None:
                info.buffer = None

    def _allocate(self, infos) -> None:
        for info in infos:
            if not info.is_root_arg and info.tensor_meta is not None and info.buffer is None:
                info.buffer = _make_tensor_from_meta(info.tensor_meta, self.device)


class ReducingStage(ReceivingStage):
    """A pipeline stage under ZeRO-2 that reduce-scatters its gradients after every
    micro-batch's backward (module doc). torch's PipelineStage turns FSDP's gradient sync off
    for every backward and reduces once after the last, holding the stage's whole gradients
    meanwhile. Not for zero-bubble schedules, whose backward is split in two."""

    reshard_after_backward = False      # ZeRO-2 keeps the weights gathered (ReshardingStage)

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        if backward_type != "full" or not isinstance(self.submod, FSDPModule):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        # as torch's stage sets FSDP up for a backward that is not the step's last, with the
        # gradient sync on: each group's post-backward reduce-scatters and accumulates its shard
        self.submod.set_is_last_backward(False)
        self.submod.set_reshard_after_backward(self.reshard_after_backward)
        self.submod.set_requires_gradient_sync(True)
        grads = stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"],
                               bwd_kwargs["input_values"])
        return grads, None


class ReshardingStage(ReducingStage):
    """A pipeline stage under ZeRO-3 that also frees FSDP's gathered weights after every
    micro-batch's backward, as ZeRO-3 means and as the estimator prices it (gathers every
    micro-batch, two groups gathered at a time): each group as its own backward ends, so that
    a stage's backward does not end holding all its groups gathered. torch's PipelineStage
    keeps them gathered from the first backward to the last, which saves those gathers but
    holds the whole stage's weights: ZeRO-2's memory. Not for zero-bubble schedules, whose
    weight backward runs after the input backward on the weights it gathered."""

    reshard_after_backward = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _prefetch_in_reverse(self.submod)

    def backward_maybe_with_nosync(self, *args, **kwargs):
        result = super().backward_maybe_with_nosync(*args, **kwargs)
        for module in self.submod.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        return result


def _prefetch_in_reverse(root: nn.Module) -> None:
    """Have each FSDP module's backward gather the module that ran before it in the forward.
    FSDP2 otherwise picks the one before it in the order forwards ended, which in a pipeline
    also holds the next micro-batch's forward (1F1B runs it before this one's backward): the
    first layer's backward would gather the stage's last group again, for nothing, once its
    groups are freed after their backwards."""
    def ended(module: nn.Module):        # forwards end children first
        for child in module.children():
            yield from ended(child)
        yield module
    order = [m for m in ended(root) if isinstance(m, FSDPModule) and m is not root]
    for before, module in zip([root, *order], order):
        module.set_modules_to_backward_prefetch([before])


class WeightBackwardStage(ReceivingStage):
    """A pipeline stage of a zero-bubble schedule under FSDP mixed precision. FSDP2 folds a
    group's 16-bit gradients into its fp32 accumulated gradients in the group's post-backward
    hook, which fires with the input backward; a zero-bubble schedule computes the weight
    gradients later, so each stayed beside its fp32 accumulation until the next micro-batch's
    input backward: 2 more bytes a parameter on every rank, and the whole chunk's at the end of
    each weight backward. Folding each weight's gradient as soon as its group has made it does
    the same additions in the same order, holding one group's 16-bit gradients at a time (as
    the estimator prices: cost/memory.py)."""

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        if backward_type != "weight" or not bwd_kwargs["param_groups"]:
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        first, *rest = bwd_kwargs["param_groups"]
        # the first group as torch runs it (which also sets FSDP up for a backward), then each
        # other group on its own weights, as torch's stage_backward_weight does in its loop
        result = super().backward_maybe_with_nosync(
            "weight", {**bwd_kwargs, "param_groups": [first]}, last_backward)
        self._fold_gradients()
        weights = {_get_grad_fn_or_grad_acc(w): w for w in self.submod.parameters()}
        for group in rest:
            stage_backward_weight(iter([weights[node] for node in group["params"]]), [group])
            self._fold_gradients()
        return result

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward=False):
        super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
        self._fold_gradients()     # the first stage's weight backward is a whole backward

    def _fold_gradients(self) -> None:
        if not hasattr(self, "_fsdp_params"):      # the stage's FSDP parameters, found once
            self._fsdp_params = [param for module in self.submod.modules()
                                 if isinstance(module, FSDPModule)
                                 for group in fsdp_param_groups(module)
                                 for param in group.fsdp_params]
        for param in self._fsdp_params:
            param.accumulate_unsharded_grad_if_needed()
            param.to_accumulated_grad_if_needed()


def build_schedule(plan: Plan, stage_rank: list[int], pp: int, modules: list[nn.Module],
                   stages: list[PipelineStage] | None, loss_fn):
    """The schedule for this rank's stages (`modules`, and their PipelineStages when pp > 1)."""
    n = plan.micro_batches
    if len(plan.stages) == 1:
        zero = plan.stages[0].zero
        return MicroBatchLoop(modules[0], n, loss_fn,
                              reduce_every=reduces_every_micro_batch(zero, plan.schedule),
                              keep_gathered=0 < zero < 3)
    v_shape = _is_v_shape(stage_rank, pp)
    error = schedule_error(plan.schedule, pp, n, len(stages), v_shape)
    if error:
        raise PlanMismatchError(f"the plan's schedule cannot run: {error}; plan again")
    torch_class = getattr(schedules, torch_schedule(plan.schedule, len(stages), v_shape))
    multi = issubclass(torch_class, schedules.PipelineScheduleMulti)   # these take a list of stages
    schedule = torch_class(stages if multi else stages[0], n, loss_fn=loss_fn)
    _gather_once(schedule, {s.index for s in plan.stages if s.zero < 3})
    return schedule


def _gather_once(schedule, kept: set[int]) -> None:
    """ZeRO-1/2 stages (`kept`) gathered once a step, as a pipeline stage keeps its weights
    (and as the estimator prices). torch's action-list schedules (interleaved 1F1B, interleaved
    zero-bubble) gather a stage's FSDP weights before its compute and free them when more than
    3 of the rank's stages would be gathered: with 4 chunks a rank, every round of micro-batches
    gathered every chunk's weights again (4x a step's all-gather bytes) to save memory that
    ZeRO-1/2 means to keep. Such a stage is gathered at the start of the step instead and freed
    at its end."""
    orders = getattr(schedule, "pipeline_order_with_comms", None)
    if not orders or not kept:
        return
    moves = (schedules._ComputationType.UNSHARD, schedules._ComputationType.RESHARD)
    for rank, actions in orders.items():
        mine = sorted({a.stage_index for a in actions if a is not None} & kept)
        rest = [a for a in actions if a is None or a.computation_type not in moves
                or a.stage_index not in kept]
        orders[rank] = ([schedules._Action(s, moves[0], None) for s in mine] + rest
                        + [schedules._Action(s, moves[1], None) for s in mine])


def _is_v_shape(stage_rank: list[int], pp: int) -> bool:
    """Two stages per rank, rank r holding stages r and 2*pp-1-r (what ZBV expects)."""
    return len(stage_rank) == 2 * pp and all(
        stage_rank[s] == stage_rank[2 * pp - 1 - s] == s for s in range(pp))
