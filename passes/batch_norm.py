"""Batch norms of a stage's graph as data parallelism runs them.

Every `aten.batch_norm` of a stage becomes a `BatchNorm` module call (`batch_norms_over`), which:
- gives the op its weight and bias in the dtype of its running statistics: FSDP2's mixed
  precision hands every parameter over in 16 bits, while the running statistics are buffers it
  leaves in fp32, and torch's kernels take 16-bit inputs with fp32 parameters and statistics but
  not 16-bit parameters with fp32 statistics (one process under autocast keeps all of them fp32);
- with `group` (compile's `sync_batchnorm=True`), in training mode, normalizes over the samples of
  every replica of the group, as torch.nn.SyncBatchNorm does (whose kernels have no CPU version):
  the per-channel sums are all-reduced, then the centred sums of squares, and in the backward
  the sums of the gradient and of the gradient times the normalized input. The running
  statistics are updated as one process updates them on the whole batch (the unbiased variance
  over all the group's samples).
Without `group`, each replica normalizes over its own samples and keeps its own running
statistics, as torch's DDP does. Under tensor parallelism the op runs on whole tensors and
returns a replicated DTensor (as an op without a DTensor rule does): DTensor's own batch norm
would update copies of the replicated running statistics, not the statistics.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed.tensor import DTensor, Replicate

from autopar.passes.program import PassTarget, StageProgram


class BatchNorm(nn.Module):
    """`aten.batch_norm`'s arguments in, its result out; statistics over `group` when training."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        super().__init__()
        self.group = group

    def forward(self, x, weight, bias, running_mean, running_var, training, momentum, eps, cudnn):
        if isinstance(x, DTensor):
            replicated = [Replicate()] * x.device_mesh.ndim

            def whole(value):
                return value.redistribute(x.device_mesh, replicated).to_local() \
                    if isinstance(value, DTensor) else value
            # the running statistics are replicated buffers: their local tensors are them
            out = self.forward(whole(x), whole(weight), whole(bias), _local(running_mean),
                               _local(running_var), training, momentum, eps, cudnn)
            return DTensor.from_local(out, x.device_mesh, replicated, run_check=False)
        if running_mean is not None:
            weight = None if weight is None else weight.to(running_mean.dtype)
            bias = None if bias is None else bias.to(running_mean.dtype)
        if not training or self.group is None:
            return torch.ops.aten.batch_norm(x, weight, bias, running_mean, running_var, training,
                                             momentum, eps, cudnn)
        return _OverGroup.apply(x, weight, bias, running_mean, running_var, momentum, eps, self.group)


class _OverGroup(torch.autograd.Function):
    """Batch norm over the samples of every replica of `group`: torch's kernel formulas, with the
    per-channel sums all-reduced. The backward is torch's closed form (dx from dy, and the sums
    of dy and of dy times the normalized input over all replicas), not autograd through the
    statistics: for a channel of small variance the chain's roundings differ from the kernel's
    by a thousand times its own (seen on MobileNetV2)."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps, group):
        dims, shape = _channel_dims(x)
        # every replica holds a micro-batch of the same size (the plan splits the batch evenly)
        count = x.numel() // x.shape[1] * dist.get_world_size(group)
        # sums in float64, as torch's CPU kernel accumulates float32 statistics
        total = x.sum(dims, dtype=torch.float64)
        dist.all_reduce(total, group=group)
        mean = total / count
        squares = (x.double() - mean.view(shape)).square().sum(dims)
        dist.all_reduce(squares, group=group)
        variance = squares / count
        invstd = torch.rsqrt(variance + eps)
        if running_mean is not None:
            with torch.no_grad():   # torch's update: momentum * batch + (1 - momentum) * running
                unbiased = variance * (count / max(count - 1, 1))
                for running, batch in ((running_mean, mean), (running_var, unbiased)):
                    running.mul_(1 - momentum).add_(batch.to(running.dtype) * momentum)
        mean, invstd = mean.float(), invstd.float()
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.group, ctx.count = group, count
        # the kernel's own normalization with these statistics (its eval mode)
        return torch.ops.aten.batch_norm(x, weight, bias, mean, variance.float(), False, 0.0, eps,
                                         False)

    @staticmethod
    def backward(ctx, grad):
        x, weight, mean, invstd = ctx.saved_tensors
        dims, shape = _channel_dims(x)
        normalized = (x.float() - mean.view(shape)) * invstd.view(shape)
        grad32 = grad.float()
        sums = torch.stack([grad32.sum(dims, dtype=torch.float64),
                            (grad32 * normalized).sum(dims, dtype=torch.float64)])
        grad_weight = sums[1].float() if weight is not None and ctx.needs_input_grad[1] else None
        grad_bias = sums[0].float() if ctx.needs_input_grad[2] else None
        dist.all_reduce(sums, group=ctx.group)
        means = (sums / ctx.count).float()
        scale = invstd if weight is None else invstd * weight.float()
        grad_x = (grad32 - means[0].view(shape) - normalized * means[1].view(shape)) * scale.view(shape)
        return (grad_x.to(x.dtype), None if grad_weight is None else grad_weight.to(weight.dtype),
                grad_bias, None, None, None, None, None)


def _channel_dims(x: torch.Tensor) -> tuple[list[int], list[int]]:
    """The dims a batch norm sums over (all but the channels, dim 1), and a channel vector's
    shape that broadcasts against x."""
    return [d for d in range(x.dim()) if d != 1], [1, -1] + [1] * (x.dim() - 2)


def _local(value):
    return value.to_local() if isinstance(value, DTensor) else value


def batch_norms_over(module: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Make every `aten.batch_norm` of the graphs in `module` a `BatchNorm` call over `group`
    (None: each replica's own samples)."""
    for graph_module in [m for m in module.modules() if isinstance(m, fx.GraphModule)]:
        nodes = [node for node in graph_module.graph.nodes
                 if node.op == "call_function" and node.target is torch.ops.aten.batch_norm.default]
        for node in nodes:
            # the node keeps its name, which the plan's placements use
            name = f"batch_norm_{node.name}"
            graph_module.add_submodule(name, BatchNorm(group))
            node.op, node.target = "call_module", name
        if nodes:
            graph_module.recompile()


def normalize_batch_norms(program: StageProgram, plan, target: PassTarget) -> StageProgram:
    """The stage's batch norms as `BatchNorm` calls, over `target.batch_norm_group` (None: each
    replica's own samples)."""
    batch_norms_over(program.module, target.batch_norm_group)
    return program
