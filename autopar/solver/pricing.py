"""What a sharding choice costs on a mesh: op time, resharding time, memory kept per device.

Prices come from `autopar.cost` (roofline compute per op family, alpha-beta collectives); this
module only decides WHICH collective a change of placement needs and on how many bytes:

    forward   R -> S, R -> P    free (a local slice; zeros on all ranks but one)
              S(d) -> R         all-gather          S(d) -> S(e)   all-to-all
              P -> R            all-reduce          P -> S(d)      reduce-scatter
              S -> P            not allowed
    backward  the gradient travels the other way: a consumer's input gradient has its input's
              placement, except that a replicated input of an op whose work is split on that
              axis gets partial sums (Megatron's "f": identity forward, all-reduce backward) and
              a partial-sum input gets a replicated gradient ("g"); the producer needs the gradient
              in its output's placement (replicated for a partial output).

On a multi-axis mesh the axes that change are priced one at a time from the innermost, each on
the bytes one device holds across the other axes at that point: exact for one-axis changes and
for gathers, an over-estimate for all-reduces over several axes (NCCL reduces hierarchically).
"""

from __future__ import annotations

import math

from autopar.cost.collectives import (all_gather_time, all_reduce_time, all_to_all_time,
                                      reduce_scatter_time)
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


class Pricer:
    """Prices on one mesh; caches resharding costs, which repeat across the layers of a model."""

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
        """Axis by axis from the innermost, as NCCL's hierarchical collectives go; each step moves
        the bytes one device holds across the other axes at that point."""
        total, current = 0.0, list(src)
        for a in reversed(range(len(src))):
            before, after = current[a], dst[a]
            if before == after:
                continue
            current[a] = after
            if before == "R":
                continue        # a local slice, or zeros on all ranks but one
            others = math.prod(size for b, (p, size) in enumerate(zip(current, self.sizes))
                               if b != a and p.startswith("S"))
            size, axes = nbytes / others, [self.names[a]]
            if before == "P":
                total += (all_reduce_time(size, self.mesh, axes) if after == "R"
                          else reduce_scatter_time(size, self.mesh, axes))
            elif after == "R":
                total += all_gather_time(size, self.mesh, axes)
            elif after == "P":
                return None
            else:
                total += all_to_all_time(size, self.mesh, axes)
        return total

    def all_gather(self, nbytes: float, axis: int) -> float:
        return all_gather_time(nbytes, self.mesh, [self.names[axis]])
