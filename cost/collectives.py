"""Time of collectives on a mesh, by the alpha-beta model.

Every function takes `nbytes`, the size of the FULL (unsharded) tensor, and returns seconds. A
group is a set of levels, inner (fast, inside a node) to outer (across nodes), each with a size
and the link between its members. A group on one level runs a ring (or a tree for all-reduce).
On several levels, a ring runs as NCCL runs it, one ring through every device
(`Group._ring_over_every_device`; an all-reduce is its reduce-scatter then its all-gather); a
tree all-reduce runs hierarchically: reduce-scatter inside the node, a tree across nodes of one
shard per device (every device drives its own NIC, so the cross-node trees run side by side),
all-gather inside the node.

Ring on n devices with link bandwidth bw (effective, NCCL bus bandwidth) and latency alpha:
    all-reduce      2(n-1) alpha + 2(n-1)/n * nbytes / bw
    all-gather      (n-1) alpha  +  (n-1)/n * nbytes / bw      (reduce-scatter the same)
    all-to-all      (n-1) alpha  +  (n-1)/n * (nbytes/n) / bw  (each device holds nbytes/n)
    tree all-reduce 2 ceil(log2 n) alpha + 2 * nbytes / bw      (double binary tree: latency-bound sizes)

A link calibrated on the machine (`autopar calibrate --mesh`) carries alpha and bw per collective
kind and group size (`Link.measured`): gloo's all-gather, say, is not its all-reduce's half, and
on ranks that share a host's cores a pair's step costs more than the whole mesh's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from autopar.errors import MeshError
from autopar.cost.mesh import Link, Mesh

ALGORITHMS = ("ring", "tree", "auto")


@dataclass(frozen=True, slots=True)
class Level:
    size: int
    link: Link


@dataclass(frozen=True, slots=True)
class Group:
    """The devices of one collective, as levels from inner to outer; levels of size 1 dropped."""
    levels: tuple[Level, ...]

    @classmethod
    def of_axes(cls, mesh: Mesh, axes: Sequence[str]) -> Group:
        """All devices along the named mesh axes (the whole axis each)."""
        names = [axes] if isinstance(axes, str) else list(axes)
        for name in names:
            mesh.axis(name)   # raises a MeshError naming the known axes
        inner_first = [axis for axis in reversed(mesh.axes) if axis.name in names]
        return cls(tuple(Level(a.size, a.link) for a in inner_first if a.size > 1))

    @classmethod
    def strided(cls, mesh: Mesh, size: int, stride: int) -> Group:
        """`size` devices `stride` ranks apart, ranks numbered with the GPUs of a node consecutive.

        This is how Megatron lays out its groups: tensor-parallel ranks are consecutive (stride 1),
        data-parallel ranks follow (stride tp), pipeline ranks are outermost (stride tp*dp)."""
        if size < 1 or stride < 1 or size * stride > mesh.world_size:
            raise MeshError(f"a group of {size} devices {stride} apart does not fit mesh {mesh} "
                            f"of {mesh.world_size} devices")
        per_node = mesh.gpus_per_node
        if stride < per_node:
            if per_node % stride:
                raise MeshError(f"group stride {stride} does not divide the {per_node} devices of a "
                                f"node of mesh {mesh}; choose degrees that divide {per_node}")
            inner = min(size, per_node // stride)
        else:
            inner = 1
        if size % inner:
            raise MeshError(f"a group of {size} devices cannot be split evenly over nodes of "
                            f"{per_node} devices; choose a size that is a multiple of {inner}")
        outer = size // inner
        levels = [Level(inner, mesh.device.intra_node), Level(outer, mesh.device.inter_node)]
        return cls(tuple(level for level in levels if level.size > 1))

    @property
    def size(self) -> int:
        return math.prod(level.size for level in self.levels)

    def all_reduce(self, nbytes: float, algorithm: str = "ring") -> float:
        if algorithm not in ALGORITHMS:
            raise MeshError(f"all-reduce algorithm {algorithm!r}: expected one of {ALGORITHMS}")
        if not self.levels:
            return 0.0
        first, rest = self.levels[0], Group(self.levels[1:])
        if not rest.levels:
            return _flat_all_reduce(nbytes, first, algorithm)
        # A ring is one ring through every device, as its two halves run; a tree runs across
        # the nodes only: reduce-scatter inside, all-reduce of one shard across, all-gather inside.
        ring = self.reduce_scatter(nbytes) + self.all_gather(nbytes)
        if algorithm == "ring":
            return ring
        inner = Group((first,))
        tree = (inner.reduce_scatter(nbytes) + rest.all_reduce(nbytes / first.size, "tree")
                + inner.all_gather(nbytes))
        return tree if algorithm == "tree" else min(ring, tree)

    def all_gather(self, nbytes: float) -> float:
        return self._ring_over_every_device(nbytes, "all_gather")

    def reduce_scatter(self, nbytes: float) -> float:
        return self._ring_over_every_device(nbytes, "reduce_scatter")

    def _ring_over_every_device(self, nbytes: float, kind: str) -> float:
        """NCCL runs all-gather and reduce-scatter as one ring through every device of the group,
        however many nodes it spans (it has no tree or hierarchy for them). Each piece travels
        all n-1 hops, so the latency is every hop's: (size-1) x (devices beyond it) hops cross
        each level. The hops run side by side, so the bandwidth is the slowest level's, a level
        crossed by as many rings at once as there are devices inside it (each drives its own
        link: a node's NICs carry a ring each). A ZeRO-3 gather of a small tensor over 1536 GPUs
        thus waits on 1535 hops, not on the 191 between nodes."""
        devices = self.size
        if devices == 1:
            return 0.0
        latency, seconds_per_byte, inside = 0.0, 0.0, 1
        for level in self.levels:
            step, bandwidth = level.link.alpha_beta(kind, level.size)
            latency += (level.size - 1) * (devices // (inside * level.size)) * step
            seconds_per_byte = max(seconds_per_byte, 1.0 / (bandwidth * inside))
            inside *= level.size
        return latency + (devices - 1) / devices * nbytes * seconds_per_byte

    def all_to_all(self, nbytes: float) -> float:
        """Each device holds nbytes/N and keeps 1/N of it; the rest leaves over the level that first
        separates it from its destination, one message per peer: each peer's exchange pays a
        latency (as NCCL's grouped point-to-point calls and gloo's peer-by-peer sends do; a
        cheaper all-to-all would make the sharding ILP trade Megatron's layouts for chains of
        all-to-all redistributions that no runtime measurement has supported)."""
        devices = self.size
        if devices == 1:
            return 0.0
        local = nbytes / devices
        total, reached = 0.0, 1
        for level in self.levels:
            before, reached = reached, reached * level.size
            leaving = local * (reached - before) / devices
            latency, bandwidth = level.link.alpha_beta("all_to_all", level.size)
            total += (level.size - 1) * latency + leaving / bandwidth
        return total


def _flat_all_reduce(nbytes: float, level: Level, algorithm: str) -> float:
    n = level.size
    latency, bandwidth = level.link.alpha_beta("all_reduce", n)
    ring = 2 * (n - 1) * latency + 2 * (n - 1) / n * nbytes / bandwidth
    tree = 2 * math.ceil(math.log2(n)) * latency + 2 * nbytes / bandwidth
    return {"ring": ring, "tree": tree, "auto": min(ring, tree)}[algorithm]


def all_reduce_time(nbytes: float, mesh: Mesh, axes: Sequence[str], algorithm: str = "ring") -> float:
    return Group.of_axes(mesh, axes).all_reduce(nbytes, algorithm)


def all_gather_time(nbytes: float, mesh: Mesh, axes: Sequence[str]) -> float:
    return Group.of_axes(mesh, axes).all_gather(nbytes)


def reduce_scatter_time(nbytes: float, mesh: Mesh, axes: Sequence[str]) -> float:
    return Group.of_axes(mesh, axes).reduce_scatter(nbytes)


def all_to_all_time(nbytes: float, mesh: Mesh, axes: Sequence[str]) -> float:
    return Group.of_axes(mesh, axes).all_to_all(nbytes)


def send_recv_time(nbytes: float, link: Link) -> float:
    """One point-to-point message (a pipeline stage's activations or gradients)."""
    latency, bandwidth = link.alpha_beta("send_recv", 2)
    return latency + nbytes / bandwidth
