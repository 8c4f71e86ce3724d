"""What the runtime's machinery costs the host, measured on every rank of a gloo mesh at once
(`autopar calibrate --mesh`): an op of a tensor-parallel stage, an action of torch's pipeline
schedule, FSDP2's hooks per group and per parameter tensor and its gradient reduction,
zero-bubble's split of the backward, a checkpointed region. Each is the difference between a
chain of tiny ops with the machinery and without it, so that the ops' own compute cancels
(`Efficiencies`, cost/host.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from autopar.cost.overlap import reduction_buffers
from autopar.calibrate.timing import everywhere_seconds, exchange, median_seconds

_CHAIN = 16
_CHAIN_OPS = 3      # per link of the chain: a matmul, a layer norm, a GELU


def tiny_op_latency(device: str, dtype: torch.dtype, budget_s: float) -> float:
    """Seconds of one tiny op, forward or backward, in `tiny_chain`: what launching an op costs."""
    return median_seconds(lambda: tiny_chain(device, dtype), device, budget_s) / (2 * _CHAIN * _CHAIN_OPS)


def tiny_chain(device: str, dtype: torch.dtype) -> None:
    """`_CHAIN` links of tiny matmul, layer norm and GELU (8 x 8) and their backward: each op
    costs what launching it in a training step costs (dispatch, autograd's bookkeeping), and
    almost nothing else."""
    weight = torch.ones(8, 8, device=device, dtype=dtype, requires_grad=True)
    y = torch.ones(8, 8, device=device, dtype=dtype)
    for _ in range(_CHAIN):
        y = _link(y, weight)
    y.sum().backward()


def _link(y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One link of the calibration's chains: a tiny matmul, layer norm and GELU."""
    return F.gelu(F.layer_norm(y @ weight, (8,)))


def distributed_op_latency(budget_s: float) -> float:
    """Seconds an op of a tensor-parallel stage adds over the same op on a plain tensor, forward
    and backward, on the default process group's ranks: its dispatch on a sharded DTensor (the
    sharding propagation of its kind of op) and the runtime's placing of its output where the
    plan puts it (`passes.collectives.Redistribute`, after every op the plan places), where no
    communication is needed. The ops are those of an attention on values split by head, so
    that the mix is a layer's: matmuls, a softmax, transposes whose strided outputs the runtime
    makes dense, views, elementwise ops; a chain of one elementwise op measured half of this."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    # the runtime's own pass, measured as the runtime runs it
    from autopar.passes.collectives import Redistribute

    ranks = torch.distributed.get_world_size()
    mesh = init_device_mesh("cpu", (ranks,))
    placed = (Redistribute(mesh, (Shard(1),)), Redistribute(mesh, (Shard(2),)))
    unplaced = (_unchanged, _unchanged)

    def chain(h, places) -> None:
        for _ in range(_CHAIN):
            h = _head_link(h, *places)
        (h * h).sum().backward()    # a dense gradient, as a loss's: sum()'s is one expanded value

    plain = torch.ones(2, 2 * ranks, 4, 4, requires_grad=True)
    sharded = distribute_tensor(torch.ones(2, 2 * ranks, 4, 4), mesh, [Shard(1)])
    sharded.requires_grad_(True)
    extra = median_seconds(lambda: chain(sharded, placed), "cpu", budget_s) - median_seconds(
        lambda: chain(plain, unplaced), "cpu", budget_s)
    return max(extra, 0.0) / (2 * _CHAIN * _HEAD_LINK_OPS)


_HEAD_LINK_OPS = 10


def _head_link(h: torch.Tensor, on_heads, on_hidden) -> torch.Tensor:
    """An attention's ops on `h` [batch, heads, seq, head dim], split by head, each output placed
    by `on_heads` (split on dim 1) or `on_hidden` (dim 2): none of them communicates."""
    batch, heads, seq, dim = h.shape
    scores = on_heads(torch.softmax(on_heads(h @ on_heads(h.transpose(-2, -1))), -1))
    y = on_heads(scores @ h)
    y = on_hidden(on_hidden(y.transpose(1, 2)).reshape(batch, seq, heads * dim))
    y = on_hidden(on_hidden(F.gelu(y)) * 1.0001)
    # dense again, as an attention's projection makes the next layer's input: DTensor's
    # transpose hands its backward a gradient whose local is strided where the global it records
    # is not, which the next link's view then fails on (on 4 ranks)
    return on_heads(on_hidden(y.view(batch, seq, heads, dim)).transpose(1, 2).contiguous())


def _unchanged(value: torch.Tensor) -> torch.Tensor:
    return value


def pipeline_action_latency(budget_s: float) -> float:
    """Host seconds of one action of torch's pipeline schedule, beyond its compute and transfer:
    every rank runs one stage of a tiny module under Schedule1F1B, at two micro-batch counts. In
    the steady state each micro-batch adds a forward and a backward of the slowest stage, each
    with one transfer; less the tiny module's own forward and backward and two transfers (timed
    as `exchange` times them), half of that growth is one action's cost."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    rank, ranks = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 8), nn.GELU())

    def pipeline_step(micro_batches: int):
        stage = PipelineStage(module, rank, ranks, torch.device("cpu"))
        schedule = Schedule1F1B(stage, micro_batches, loss_fn=lambda out, target: out.pow(2).mean())
        batch = torch.randn(micro_batches, 8)
        if rank == 0:
            return lambda: schedule.step(batch)
        if rank == ranks - 1:
            return lambda: schedule.step(target=batch, losses=[])
        return schedule.step

    counts = (ranks, 4 * ranks)         # 1F1B needs as many micro-batches as stages
    few, many = (everywhere_seconds(pipeline_step(n), budget_s) for n in counts)
    per_micro_batch = (many - few) / (counts[1] - counts[0])
    one = torch.randn(1, 8, requires_grad=True)
    compute = median_seconds(lambda: module(one).sum().backward(), "cpu", budget_s)
    transfer = everywhere_seconds(lambda: exchange(torch.zeros(1, 8), rank), budget_s)
    return max(per_micro_batch - compute - 2 * transfer, 0.0) / 2


def split_backward_latency(budget_s: float) -> float:
    """Host seconds per op that splitting a backward into input and weight halves adds, as
    torch's zero-bubble schedules split it (`stage_backward_input`, then `stage_backward_weight`,
    which walk the autograd graph to group the weights' gradients): `tiny_chain`'s ops with the
    split backward against the plain one."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    weights = [torch.ones(8, 8, requires_grad=True) for _ in range(_CHAIN)]
    first = torch.ones(8, 8, requires_grad=True)

    def forward() -> torch.Tensor:
        y = first
        for weight in weights:
            y = _link(y, weight)
        return y.sum()

    def split() -> None:
        _, groups = stage_backward_input([forward()], None, [first], iter(weights))
        stage_backward_weight(iter(weights), groups)
    extra = median_seconds(split, "cpu", budget_s) - median_seconds(lambda: forward().backward(), "cpu", budget_s)
    return max(extra, 0.0) / (_CHAIN * _CHAIN_OPS)


def checkpoint_latency(budget_s: float) -> tuple[float, float]:
    """Host seconds a recomputed region adds beyond the forward it reruns: (per region, per op
    in it). Chains of `_CHAIN` regions, each under a non-reentrant checkpoint as the runtime
    wraps a recomputed layer (passes/recompute.py), of one and of four links of `tiny_chain`'s
    ops, against the plain chain's forward and backward and one more forward: a GPT layer of
    some thirty ops costs several times a one-op region."""
    from torch.utils.checkpoint import checkpoint

    def extra(links: int) -> float:
        weights = [[torch.ones(8, 8, requires_grad=True) for _ in range(links)] for _ in range(_CHAIN)]
        first = torch.ones(4, 8, requires_grad=True)

        def region(y, region_weights):
            for weight in region_weights:
                y = _link(y, weight)
            return y

        def run(wrap: bool, backward: bool = True) -> None:
            y = first
            for region_weights in weights:
                y = checkpoint(region, y, region_weights, use_reentrant=False) if wrap \
                    else region(y, region_weights)
            if backward:
                y.sum().backward()
        wrapped, plain = median_seconds(lambda: run(True), "cpu", budget_s), median_seconds(lambda: run(False), "cpu", budget_s)
        with torch.no_grad():
            rerun = median_seconds(lambda: run(False, backward=False), "cpu", budget_s)
        return max(wrapped - plain - rerun, 0.0) / _CHAIN
    one, four = extra(1), extra(4)
    per_op = max(four - one, 0.0) / (3 * _CHAIN_OPS)
    return max(one - _CHAIN_OPS * per_op, 0.0), per_op


_GROUPS = 8


def data_parallel_group_latency(budget_s: float) -> tuple[float, float]:
    """Host seconds FSDP2's hooks add per micro-batch: (per group, per parameter tensor in it).
    Chains of groups, each its own `replicate` group as the runtime wraps a stage, of one tiny
    layer (2 tensors) and of six (12), forward and backward without gradient sync (no
    collective), against the same chains unwrapped: FSDP2 visits every parameter of a group in
    its hooks, so a block of a dozen tensors costs more than a layer of two."""
    import copy

    import torch.distributed as dist
    from torch import nn
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    one = torch.randn(1, 8)
    run = lambda model: model(one).sum().backward()

    def per_group(layers: int) -> float:
        plain = nn.Sequential(*(nn.Sequential(*(nn.Linear(8, 8) for _ in range(layers)))
                                for _ in range(_GROUPS)))
        wrapped = copy.deepcopy(plain)
        for group in wrapped:
            replicate(group, mesh=mesh)
        replicate(wrapped, mesh=mesh)
        wrapped.set_requires_gradient_sync(False)
        extra = median_seconds(lambda: run(wrapped), "cpu", budget_s) - median_seconds(lambda: run(plain), "cpu",
                                                                         budget_s)
        return max(extra, 0.0) / (_GROUPS + 1)
    small, large = per_group(1), per_group(6)
    per_tensor = max(large - small, 0.0) / (2 * 6 - 2)
    return max(small - 2 * per_tensor, 0.0), per_tensor


def data_parallel_reduce_latency(budget_s: float) -> tuple[float, float, float]:
    """Host seconds FSDP2's gradient reduction adds beyond its collective: (per group under
    `replicate`, per byte of each of the two buffers it fills with a group's gradients, per group
    under `fully_shard` with the runtime's in-place reduce-scatter on CPUs, as ZeRO reduces).
    `_reduce_extra` of 8 x 8 and 2048 x 2048 layers (16 MiB of gradients) under replicate, of
    8 x 8 ones under fully_shard."""
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.fsdp import fully_shard

    from autopar.runtime.gloo_reduce import reduce_in_place_on_cpu

    def replicate_over(module, mesh) -> None:
        replicate(module, mesh=mesh)

    def shard(module, mesh) -> None:
        fully_shard(module, mesh=mesh, reshard_after_forward=False)
        reduce_in_place_on_cpu(module)

    (small, small_bytes), (large, large_bytes) = (_reduce_extra(replicate_over, width, budget_s)
                                                  for width in (8, 2048))
    buffers = reduction_buffers(0, 1)       # as the estimator counts them
    per_byte = max(large - small, 0.0) / (large_bytes - small_bytes) / buffers
    sharded, sharded_bytes = _reduce_extra(shard, 8, budget_s)
    sharded_buffers = reduction_buffers(1, torch.distributed.get_world_size())
    return (max(small - buffers * per_byte * small_bytes, 0.0), per_byte,
            max(sharded - sharded_buffers * per_byte * sharded_bytes, 0.0))


def _reduce_extra(wrap, width: int, budget_s: float, rounds: int = 3) -> tuple[float, int]:
    """(seconds, bytes of gradients) per group: what gradient sync adds to the forward and
    backward of a chain of `_GROUPS` layers each wrapped by `wrap(layer, mesh)`, less what the same
    all-reduces add to the unwrapped chain, each issued by hand into a buffer that exists already
    as its layer's gradients are ready (so that both wait alike for the ranks the scheduler ran
    less). The median over `rounds`."""
    import copy

    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    plain = nn.Sequential(*(nn.Linear(width, width) for _ in range(_GROUPS)))
    wrapped = copy.deepcopy(plain)
    for layer in wrapped:
        wrap(layer, mesh)
    wrap(wrapped, mesh)
    one, grads = torch.randn(1, width), torch.zeros(width * width + width)
    by_hand = [False]
    for layer in plain:
        layer.weight.register_post_accumulate_grad_hook(
            lambda _: dist.all_reduce(grads) if by_hand[0] else None)

    def step(model, sync: bool) -> float:
        if model is wrapped:
            model.set_requires_gradient_sync(sync)
        by_hand[0] = sync
        return everywhere_seconds(lambda: model(one).sum().backward(), budget_s)
    extras = sorted((step(wrapped, True) - step(wrapped, False)
                     - step(plain, True) + step(plain, False)) / _GROUPS for _ in range(rounds))
    return max(extras[rounds // 2], 0.0), grads.numel() * grads.element_size()
