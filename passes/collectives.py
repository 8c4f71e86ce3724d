"""Collectives inserted into a stage's graph where the plan fixes a value's placement.

Inserted ops are small modules (`call_module` nodes) so that a printed graph names what they do
and which placements they produce. Autograd is DTensor's: the backward of a redistribution is
its reverse.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate


class Redistribute(nn.Module):
    """Move a DTensor to the placements the plan gives its node. `weight`: the node is computed
    from parameters alone (a transposed expert weight), which only matmuls read."""

    def __init__(self, mesh: DeviceMesh, placements: tuple, weight: bool = False):
        super().__init__()
        self.mesh, self.placements, self.weight = mesh, tuple(placements), weight

    def forward(self, value):
        if not isinstance(value, DTensor):   # a tensor made in the graph (arange, ...) is replicated
            value = DTensor.from_local(value, self.mesh, [Replicate()] * self.mesh.ndim, run_check=False)
        if tuple(value.placements) == self.placements:
            moved = _Placed.apply(value, self.placements)
        else:
            moved = value.redistribute(self.mesh, self.placements)
        # Handed on with a local that is dense and whose last dim is dense: DTensor decides by the
        # global layout alone, and a local that is not dense where its global is (a chunk of a
        # dim after the first) is misread: the CPU flash kernel misread a local whose last dim is
        # strided (Gemma's multi-query attention under tensor parallelism trained wrong), and a
        # view the global allows fails on a gapped local. Only those are copied: a transposed
        # local (heads before tokens, as attention reads q, k and v) is dense and what every
        # kernel takes as it is, and copying it held a second copy of q, k, v and of attention's
        # output for each layer's backward. A weight's transposed shard goes to matmuls, which
        # take any dense layout: a copy of it was made, and kept for the backward, per layer
        # and micro-batch.
        local = moved.to_local()
        if local.dim() == 0 or (_dense(local) and (local.stride(-1) == 1 or self.weight)):
            return moved
        return DTensor.from_local(local.contiguous(), self.mesh, moved.placements, run_check=False,
                                  shape=moved.shape, stride=moved.stride())

    def extra_repr(self) -> str:
        return f"placements={self.placements}" + (", weight" if self.weight else "")


def _dense(tensor: torch.Tensor) -> bool:
    """Whether `tensor` covers its memory without gaps in some order of its dims (contiguous, or
    a permutation of a contiguous tensor such as a transpose)."""
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(tensor.stride(), tensor.shape) if n > 1):
        if stride != expected:
            return False
        expected *= size
    return True


class _Placed(torch.autograd.Function):
    """The identity on a DTensor that is already where the plan places it; the backward moves the
    gradient there, as DTensor's redistribution does (a partial gradient is reduced here, once for
    all the value's readers). Most placed values need nothing, and DTensor's own redistribution
    costs a CPU host ~0.2 ms per value in each direction even then: on a stage of a few hundred
    ops, more than its compute."""

    @staticmethod
    def forward(ctx, value: DTensor, placements: tuple):
        ctx.mesh, ctx.placements = value.device_mesh, placements
        return DTensor.from_local(value.to_local(), value.device_mesh, value.placements,
                                  run_check=False, shape=value.shape, stride=value.stride())

    @staticmethod
    def backward(ctx, grad):
        if isinstance(grad, DTensor) and tuple(grad.placements) != ctx.placements:
            grad = grad.redistribute(ctx.mesh, ctx.placements)
        return grad, None
