"""What a sharding choice costs on a mesh: op time, resharding time, memory kept per device.

Prices come from `autopar.cost` (roofline compute per op family, alpha-beta collectives); which
collective a change of placement needs, and on how many bytes, is `autopar.cost.reshard`'s, the
facts the estimator prices a Plan's placements with too. On a multi-axis mesh the axes that change
are priced one at a time from the innermost: exact for one-axis changes and for gathers, an
over-estimate for all-reduces over several axes (NCCL reduces hierarchically).
"""

from __future__ import annotations

import math

from autopar.cost.collectives import (all_gather_time, all_reduce_time, all_to_all_time,
                                      reduce_scatter_time)
from autopar.cost.reshard import (ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, REDUCE_SCATTER,
                                  reshard_steps)
from autopar.cost.compute import BACKWARD, Efficiencies, compute_time, op_family
from autopar.cost.layout import saves_for_backward
from autopar.cost.memory import ADAM_STATE_BYTES, MASTER_COPY_BYTES
from autopar.cost.mesh import Mesh

HALF_DTYPES = ("bfloat16", "float16")
NOT_DIFFERENTIABLE = ("int64", "int32", "int16", "int8", "uint8", "bool", "")
ZERO2 = "Z"       # a parameter axis choice: weights replicated, gradients and optimizer state sharded


def saved_for_backward(target: str) -> tuple[bool, bool]:
    """(keeps its tensor inputs, keeps its output) for the backward: the estimator's rule
    (autopar.cost.layout.saves_for_backward). A parameter input is left out by the caller (its
    memory is the parameter's)."""
    return saves_for_backward(target)


def shard_factor(placements: list[str], axis_sizes: list[int]) -> int:
    return math.prod(size for p, size in zip(placements, axis_sizes) if p.startswith("S"))


def local_bytes(nbytes: float, placements: list[str], axis_sizes: list[int]) -> float:
    """Bytes one device holds; a partial-sum tensor is full size on every device."""
    return nbytes / shard_factor(placements, axis_sizes)


def optimizer_bytes(nbytes: float, dtype: str) -> float:
    element = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}.get(dtype, 4)
    elements = nbytes / element
    return elements * (ADAM_STATE_BYTES + (MASTER_COPY_BYTES if dtype in HALF_DTYPES else 0))


class OpPricer:
    """The sharding ILP's prices of one op's strategies on one mesh (compute, resharding, memory); caches resharding costs, which repeat across the layers of a model."""

    def __init__(self, mesh: Mesh, efficiencies: Efficiencies | None = None):
        self.mesh = mesh
        self.names = [axis.name for axis in mesh.axes]
        self.sizes = [axis.size for axis in mesh.axes]
        self.efficiencies = efficiencies or Efficiencies.for_device(mesh.device.name)
        self._reshard: dict[tuple, float | None] = {}

    def op_time(self, target: str, flops: float, bytes_moved: float, split: int,
                dtype: str) -> tuple[float, float]:
        """(forward, backward) time of one op whose work is split `split` ways."""
        family = op_family(target)
        flops_factor, bytes_factor = BACKWARD.get(family, (1.0, 1.0))
        dtype = dtype if dtype in self.mesh.device.peak_flops else "float32"
        forward = compute_time(flops / split, bytes_moved, self.mesh.device, family, dtype,
                               self.efficiencies)
        backward = compute_time(flops * flops_factor / split, bytes_moved * bytes_factor,
                                self.mesh.device, family, dtype, self.efficiencies)
        return forward, backward

    def reshard(self, src: tuple[str, ...], dst: tuple[str, ...], nbytes: float,
                bucketed: bool = False) -> float | None:
        """Seconds to turn a tensor placed `src` (per axis) into `dst`; None when not possible.
        `bucketed`: the collective joins others in one bucket (DDP's gradient buckets, FSDP's
        per-block gathers), so it pays bandwidth only, no per-message latency."""
        key = (src, dst, nbytes, bucketed)
        if key not in self._reshard:
            cost = self._reshard_uncached(src, dst, nbytes)
            if bucketed and cost is not None:
                cost -= self._reshard_uncached(src, dst, 0.0)
            self._reshard[key] = cost
        return self._reshard[key]

    def _reshard_uncached(self, src, dst, nbytes) -> float | None:
        steps = reshard_steps(src, dst, self.sizes)
        if steps is None:
            return None
        return sum(_TIMES[kind](nbytes / divisor, self.mesh, [self.names[axis]])
                   for kind, axis, divisor in steps)

    def all_gather(self, nbytes: float, axis: int) -> float:
        return all_gather_time(nbytes, self.mesh, [self.names[axis]])


_TIMES = {ALL_REDUCE: all_reduce_time, ALL_GATHER: all_gather_time,
          REDUCE_SCATTER: reduce_scatter_time, ALL_TO_ALL: all_to_all_time}
