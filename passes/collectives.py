"""Collectives inserted into a stage's graph where the plan fixes a value's placement.

Inserted ops are small modules (`call_module` nodes) so that a printed graph names what they do
and which placements they produce. Autograd is DTensor's: the backward of a redistribution is
its reverse.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate


class Redistribute(nn.Module):
    """Move a DTensor to the placements the plan gives its node."""

    def __init__(self, mesh: DeviceMesh, placements: tuple):
        super().__init__()
        self.mesh, self.placements = mesh, tuple(placements)

    def forward(self, value):
        if not isinstance(value, DTensor):   # a tensor made in the graph (arange, ...) is replicated
            value = DTensor.from_local(value, self.mesh, [Replicate()] * self.mesh.ndim, run_check=False)
        return value.redistribute(self.mesh, self.placements)

    def extra_repr(self) -> str:
        return f"placements={self.placements}"
