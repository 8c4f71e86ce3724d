"""Pipeline units: the pieces of a model that stage cuts may not split, and their weights.

A transformer is cut between its blocks: the embedding (every node before the first repeated
block), each block instance, and the head (every node after the last block). A model without
repeated blocks (an MLP, a CNN) is cut between modules: the units start as the model's outermost
modules, in the order they run, and the heaviest unit (by forward FLOPs) is replaced by its child
modules while it weighs more than `MAX_UNIT_SHARE` of the model and its children can stand as
units. Children can when each runs as one contiguous range of the graph's ops (a module called at
two places, such as one ReLU used after every convolution of a ResNet block, cannot): the
pipeline runs units in order. The ops of the parent itself (a residual add between two children)
run with the child before them.

The runtime splits a stage into these units and wraps each as an FSDP group
(autopar.runtime.data_parallel), so the cost model reads its FSDP groups from them too
(cost.stages.parameter_groups).
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cost.compute import compute_time, op_family
from autopar.cost.expert_layers import expert_layers
from autopar.cost.layout import op_name
from autopar.graph import Graph, Role

# A unit weighs at most this share of the model where its modules allow: pipelines of up to
# eight stages can then be balanced by the cut search (autopar.solver.candidates.balanced_cuts).
MAX_UNIT_SHARE = 1 / 8


@dataclass(frozen=True, slots=True)
class Unit:
    name: str                   # "embedding", "layers.3", "head"
    layers: tuple[str, ...]     # module paths of the unit, in order
    start: int                  # node index range in Graph.nodes
    stop: int
    block: bool = False         # a repeated block instance


def pipeline_units(graph: Graph) -> list[Unit]:
    """Embedding, block instances in order, head: the pieces stage cuts may not split; for a
    model without repeated blocks, its modules (`module_units`)."""
    instances = sorted((inst for kind in graph.blocks for inst in kind.instances), key=lambda i: i.start)
    blocks = {inst.module_path for inst in instances}
    if not instances:
        return [Unit(name=layers[0] if len(layers) == 1 else "model", layers=layers, start=start,
                     stop=stop) for layers, start, stop in module_units(graph)]
    units = []
    first, last = instances[0], instances[-1]
    # an embedding or head with no ops of its own (only parameter placeholders) is no unit
    embedding = graph.top_modules(0, first.start, blocks)
    if embedding:
        units.append(Unit(name="embedding", layers=embedding, start=0, stop=first.start))
    for inst, following in zip(instances, instances[1:] + [None]):
        # nodes between two blocks run with the block before: a residual add at the top level, or
        # whole modules that are no repeated block (an encoder's final norm, a decoder's first
        # block that differs from the others, the decoder's embedding): the unit names them all,
        # so that every module's nodes belong to some unit
        stop = following.start if following is not None else inst.stop
        between = graph.top_modules(inst.stop, stop, blocks)
        units.append(Unit(name=inst.module_path, layers=(inst.module_path, *between), start=inst.start,
                          stop=stop, block=True))
    head = graph.top_modules(last.stop, len(graph.nodes), blocks)
    if head:
        units.append(Unit(name="head", layers=head, start=last.stop, stop=len(graph.nodes)))
    return units


def unit_weights(graph: Graph, units: list[Unit], mesh, tp: int) -> list[float]:
    """Seconds of forward and backward of each unit on one device of a tp group, by the cost
    model's roofline: the proposal weights of the cut dynamic program (the estimator decides)."""
    weights = []
    for unit in units:
        seconds = 0.0
        for node in graph.nodes[unit.start:unit.stop]:
            if node.role is Role.ACTIVATION:
                family = op_family(node.target)
                seconds += 3 * compute_time(node.flops / tp, 3 * node.bytes / tp, mesh.device, family)
        weights.append(seconds)
    return weights


def module_units(graph: Graph) -> list[tuple[tuple[str, ...], int, int]]:
    """(module paths, first node, one past the last node) of each unit, in model order, covering
    every node of the graph. The model is one unit of all its outermost modules when they
    cannot stand as units."""
    return graph.derive("module_units", lambda: _module_units(graph))


def _module_units(graph: Graph) -> list[tuple[tuple[str, ...], int, int]]:
    ops = [i for i, node in enumerate(graph.nodes) if node.role is Role.ACTIVATION and node.module_path]
    ranges = _ranges(graph, ops)
    flops = [node.flops for node in graph.nodes]
    total = sum(flops) or 1
    ranges[""] = (0, len(graph.nodes) - 1)
    units, layers = [""], _expert_spans(graph)
    while True:
        weights = {path: sum(flops[ranges[path][0]:ranges[path][1] + 1]) for path in units}
        splittable = [path for path in units if weights[path] > MAX_UNIT_SHARE * total
                      and _standalone(graph, ranges, _children(ranges, path), layers)]
        if not splittable:
            break
        heaviest = max(splittable, key=weights.__getitem__)
        at = units.index(heaviest)
        units[at:at + 1] = _children(ranges, heaviest)
    if units == [""]:
        return [(tuple(_children(ranges, "")), 0, len(graph.nodes))]
    starts = [0 if k == 0 else ranges[path][0] for k, path in enumerate(units)]
    return [((path,), start, stop) for path, start, stop in zip(units, starts, [*starts[1:], len(graph.nodes)])]


def _ranges(graph: Graph, ops: list[int]) -> dict[str, tuple[int, int]]:
    """Every module path (and each of its parents) -> (first, last) index of its ops."""
    ranges: dict[str, tuple[int, int]] = {}
    for i in ops:
        parts = graph.nodes[i].module_path.split(".")
        for depth in range(1, len(parts) + 1):
            path = ".".join(parts[:depth])
            first, _ = ranges.get(path, (i, i))
            ranges[path] = (first, i)
    return ranges


def _children(ranges: dict[str, tuple[int, int]], parent: str) -> list[str]:
    """The modules directly under `parent` ("" for the model), in the order they start; through
    a module with one child (an encoder holding a ModuleList of stages), that child's."""
    prefix = parent + "." if parent else ""
    found = [path for path in ranges if path and path.startswith(prefix) and "." not in path[len(prefix):]]
    if len(found) == 1:
        return _children(ranges, found[0])
    return sorted(found, key=lambda path: ranges[path][0])


def _expert_spans(graph: Graph) -> list[tuple[int, int]]:
    """Node ranges from each mixture-of-experts layer's router (the top-k before its experts)
    to its last expert op: the runtime rewrites a layer for expert parallelism within one unit
    (autopar.passes.expert_parallel), so no unit boundary may fall inside one."""
    position = {node.name: k for k, node in enumerate(graph.nodes)}
    topks = [k for k, node in enumerate(graph.nodes) if op_name(node.target) == "topk"]
    spans = []
    for layer in expert_layers(graph):
        members = [position[name] for name in layer.members if name in position]
        first = min(members)
        spans.append((max((k for k in topks if k < first), default=first), max(members)))
    return spans


def _standalone(graph: Graph, ranges: dict[str, tuple[int, int]], children: list[str],
                expert_spans: list[tuple[int, int]] = ()) -> bool:
    """Whether each of `children` (two or more) runs as one range holding only its own ops, and
    no mixture-of-experts layer (`expert_spans`) has its router and its experts in two of them."""
    if len(children) < 2:
        return False
    owner = lambda k: next((path for path in children if ranges[path][0] <= k <= ranges[path][1]), None)
    if any(owner(a) != owner(b) for a, b in expert_spans if owner(a) or owner(b)):
        return False
    for path in children:
        first, last = ranges[path]
        if any(node.role is Role.ACTIVATION and not _under(node.module_path, path)
               for node in graph.nodes[first:last + 1]):
            return False
    return True


def _under(module_path: str, path: str) -> bool:
    return module_path == path or module_path.startswith(path + ".")
