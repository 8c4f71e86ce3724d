"""Weights that several pipeline stages read (tied embeddings), kept identical across stages.

An LM head that reuses the embedding matrix puts one parameter in the first and the last stage.
As in Megatron-LM, each stage that reads it holds its own copy; after the backward the copies'
gradients are summed over the ranks that hold one (Megatron's "embedding group", one per data-
and tensor-parallel coordinate), so every copy receives the gradient of the whole model and,
starting equal and stepped by the same optimizer, stays equal. Copies on one rank (two stages of
an interleaved or V schedule) are summed locally first.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from autopar.passes.program import TensorRef


class TiedWeights:
    """This rank's copies of tied weights and the group over which their gradients are summed.

    Built on every rank in the same order (it creates process groups, a collective of all ranks),
    from this rank's stage programs, whose `tied` map is the whole model's."""

    def __init__(self, programs, stage_rank: list[int], grid: list[list[list[int]]], pp_group=None):
        tied = programs[0].tied if programs else {}
        me = dist.get_rank()
        position = next((p, d, t) for p, plane in enumerate(grid) for d, row in enumerate(plane)
                        for t, rank in enumerate(row) if rank == me)
        holders = {fqn: tuple(sorted({stage_rank[s] for s in stages})) for fqn, stages in tied.items()}
        groups: dict[tuple[int, ...], object] = {}
        for ranks in sorted(set(holders.values())):
            if len(ranks) == 1:
                continue
            if len(ranks) == len(grid) and pp_group is not None:
                groups[ranks] = pp_group      # every pipeline rank: the pipeline group is the group
                continue
            for d, plane_row in enumerate(grid[0]):
                for t in range(len(plane_row)):
                    group = dist.new_group([grid[p][d][t] for p in ranks])
                    if (d, t) == position[1:] and position[0] in ranks:
                        groups[ranks] = group
        self.copies: dict[str, list[nn.Parameter]] = {}
        for program in programs:
            for ref in program.module.modules():
                if isinstance(ref, TensorRef) and ref.fqn in tied and isinstance(ref.value, nn.Parameter):
                    self.copies.setdefault(ref.fqn, []).append(ref.value)
        self.group_of = {fqn: groups.get(holders[fqn]) for fqn in self.copies}

    def reduce_gradients(self) -> None:
        """Every copy's gradient becomes the sum over all copies of its weight."""
        by_group: dict[object, list[str]] = {}
        for fqn in self.copies:
            by_group.setdefault(self.group_of[fqn], []).append(fqn)
        for group, names in by_group.items():
            sums = [sum(_local_grad(p) for p in self.copies[fqn]) for fqn in names]
            if group is not None:
                flat = torch.cat([s.reshape(-1) for s in sums])
                dist.all_reduce(flat, group=group)
                sums = list(torch.split(flat, [s.numel() for s in sums]))
            for fqn, total in zip(names, sums):
                for param in self.copies[fqn]:
                    _local_grad(param).copy_(total.view_as(_local_grad(param)))


def _local_grad(param: nn.Parameter) -> torch.Tensor:
    """This rank's part of `param`'s gradient, laid out as the parameter is. DTensor may leave a
    gradient in another placement than its parameter's (an embedding's backward from whole
    activations writes a whole gradient for a vocabulary-split weight); the copies in other stages
    are summed shard by shard, so each is first brought to its parameter's placement."""
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    grad = param.grad
    if not isinstance(grad, DTensor):
        return grad
    if grad.placements != param.placements:
        grad = param.grad = grad.redistribute(param.device_mesh, param.placements)
    return grad.to_local()
