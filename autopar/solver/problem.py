"""The intra-op sharding problem as plain data: no torch, an exact JSON round trip.

A `Problem` is what `autopar.solver.build` makes of a captured graph on a mesh and what
`autopar.solver.ilp` solves: nodes, each with its strategies (placements per mesh axis and what the
strategy costs by itself: compute, its own communication, the memory it keeps), edges with
resharding costs between the producer's and the consumer's strategies, the memory budget, and
ties (a node of a repeated block shares the variables of the same node in the block's first
instance). Stored problems let `autopar bench` and the tests solve without torch.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from autopar.errors import AutoparError

SCHEMA_VERSION = 1


@dataclass(kw_only=True, slots=True)
class Strategy:
    output: list[str]               # the output's placement per mesh axis: ["S(0)", "R"]
    inputs: list[list[str]]         # each tensor input's placement per axis, in Node.inputs order
    compute_s: float = 0.0          # forward + backward time of the op under this strategy
    backward_s: float = 0.0         # the backward's part of compute_s: hides gradient communication
    comm_s: float = 0.0             # communication the choice implies by itself (ZeRO's gathers)
    memory_bytes: float = 0.0       # per device, alive at the peak (parameter states, saved activations)
    gradient: list[str] = field(default_factory=list)   # parameters: gradient and optimizer
                                    # state placement per axis ("S(0)" under "R" weights: ZeRO-1/2)

    @property
    def cost_s(self) -> float:
        return self.compute_s + self.comm_s


@dataclass(kw_only=True, slots=True)
class ProblemNode:
    name: str
    kind: str                       # "op", "parameter", "input", "replicated" (an op with no rule)
    strategies: list[Strategy]
    tie: str | None = None          # uses the variables of this node (same block position, instance 0);
                                    # tied parameters may differ per copy (ZeRO for some layers)
    label: str = ""                 # what a person recognizes: a parameter's name, an op's module


@dataclass(kw_only=True, slots=True)
class Edge:
    """Producer `src` feeds input number `arg` of consumer `dst`. Strategies with equal rows (or
    columns) of the cost matrix share a class, so the matrix is stored once per class pair."""
    src: str
    dst: str
    arg: int
    src_class: list[int]            # class of each of src's strategies
    dst_class: list[int]            # class of each of dst's strategies
    cost: list[list[float | None]]  # [src class][dst class] seconds; None where not allowed
    overlapped: bool = False        # parameter/gradient traffic, which runs behind the backward


@dataclass(kw_only=True, slots=True)
class Problem:
    axes: list[list]                # [[name, size], ...] outer to inner
    nodes: list[ProblemNode]
    edges: list[Edge]
    memory_limit: float | None = None   # bytes per device; None: unconstrained
    meta: dict = field(default_factory=dict)    # mesh, model and what the costs assume
    schema_version: int = SCHEMA_VERSION

    def node(self, name: str) -> ProblemNode:
        for node in self.nodes:
            if node.name == name:
                return node
        raise AutoparError(f"the problem has no node {name!r}")

    def representative(self) -> dict[str, str]:
        """Each node's name -> the node whose variables it uses (itself when untied)."""
        ties = {n.name: n.tie for n in self.nodes}
        found = {}
        for name in ties:
            rep = name
            while ties[rep] is not None:
                rep = ties[rep]
            found[name] = rep
        return found

    def check(self) -> None:
        """Raise AutoparError when ties join nodes of different strategy counts or an edge's
        classes do not match its endpoints: a hand-edited or truncated problem file."""
        by_name = {n.name: n for n in self.nodes}
        for node in self.nodes:
            if node.tie is not None and len(by_name[node.tie].strategies) != len(node.strategies):
                raise AutoparError(f"node {node.name} is tied to {node.tie} but has "
                                   f"{len(node.strategies)} strategies to its {len(by_name[node.tie].strategies)}")
            if not node.strategies:
                raise AutoparError(f"node {node.name} has no strategy")
        for edge in self.edges:
            src, dst = by_name[edge.src], by_name[edge.dst]
            if len(edge.src_class) != len(src.strategies) or len(edge.dst_class) != len(dst.strategies):
                raise AutoparError(f"edge {edge.src}->{edge.dst} classes do not match the strategies")

    def evaluate(self, choice: dict[str, int]) -> tuple[float, float]:
        """(time in seconds, memory in bytes per device) of one strategy index per node (a node
        missing from `choice` takes its representative's). Infinite time where an edge is not
        allowed.

        time = compute + own communication + resharding
               + max(0, parameter/gradient traffic - backward compute)   (what overlap leaves)"""
        rep = self.representative()
        pick = {name: choice[name] if name in choice else choice[rep[name]] for name in rep}
        time = memory = backward = overlapped = 0.0
        for node in self.nodes:
            strategy = node.strategies[pick[node.name]]
            time += strategy.cost_s
            backward += strategy.backward_s
            memory += strategy.memory_bytes
        for edge in self.edges:
            cost = edge.cost[edge.src_class[pick[edge.src]]][edge.dst_class[pick[edge.dst]]]
            if cost is None:
                return float("inf"), memory
            if edge.overlapped:
                overlapped += cost
            else:
                time += cost
        return time + max(0.0, overlapped - backward), memory

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Problem:
        if data.get("schema_version") != SCHEMA_VERSION:
            raise AutoparError(f"problem schema version {data.get('schema_version')} is not "
                               f"{SCHEMA_VERSION}; build the problem again with this autopar")
        nodes = [ProblemNode(**{**n, "strategies": [Strategy(**s) for s in n["strategies"]]})
                 for n in data["nodes"]]
        edges = [Edge(**e) for e in data["edges"]]
        return cls(**{**data, "nodes": nodes, "edges": edges})

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict()) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Problem:
        return cls.from_dict(json.loads(Path(path).read_text()))
