"""Mixture-of-experts layers found in a captured graph by their structure, not by class names.

An expert layer is a set of grouped matmuls (family "matmul" reading a 3-D parameter [E, K, N]
or a view of one, as HuggingFace transposes its [E, N, K] weights, the experts' weights, and 2-D
rows [M, K] sorted by expert) that share one routing: the third input, the rows' group offsets. Its rows per token are the top-k it routes to (M over the tokens
its dispatch gathered from); its members are the grouped matmuls and the ops between them (the
activation of a SwiGLU expert), which run on the rows, not on the tokens. Its router is the
matmul whose output a top-k choice reads.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cost.compute import op_family
from autopar.graph import Graph, Role


@dataclass(frozen=True, slots=True)
class ExpertLayer:
    matmuls: tuple[str, ...]        # grouped matmuls in graph order
    members: frozenset[str]         # the matmuls and the ops between them (on the rows)
    weights: tuple[str, ...]        # parameter nodes [E, K, N]
    experts: int
    rows: int                       # rows of the captured batch (tokens x top_k)
    top_k: float


def expert_layers(graph: Graph) -> list[ExpertLayer]:
    """Every mixture-of-experts layer of `graph`, in order (none for a dense model)."""
    by_name = {n.name: n for n in graph.nodes}
    routed: dict[str, list] = {}
    for node in graph.nodes:
        read = _expert_weight(node, by_name)
        if read is not None:
            weight, parameter = read
            routing = next((i for i in node.inputs[1:] if i != weight), node.inputs[-1])
            routed.setdefault(routing, []).append((node, parameter))
    layers = []
    for found in routed.values():
        matmuls = [node.name for node, _ in found]
        weights = tuple(dict.fromkeys(weight for _, weight in found))
        experts = by_name[weights[0]].shape[0]
        rows = by_name[matmuls[0]].shape[0]
        layers.append(ExpertLayer(matmuls=tuple(matmuls), members=_members(graph, matmuls),
                                  weights=weights, experts=experts, rows=rows,
                                  top_k=rows / max(1, _tokens(by_name, by_name[matmuls[0]]))))
    return layers


# Ops between a router's logits and its top-k choice: scores (softmax, sigmoid), casts, views.
_SCORING = ("softmax", "view", "elementwise")


def routers(graph: Graph) -> set[str]:
    """Matmuls whose output a top-k choice reads (through scoring ops): mixture-of-experts
    routers, which Megatron keeps whole on every tensor-parallel rank (a choice over the
    experts needs all their scores)."""
    by_name = {n.name: n for n in graph.nodes}
    found = set()
    for node in graph.nodes:
        if node.role is not Role.ACTIVATION or not node.target.startswith("aten.topk"):
            continue
        name = node.inputs[0] if node.inputs else None
        while name is not None and by_name[name].role is Role.ACTIVATION:
            family = op_family(by_name[name].target)
            if family == "matmul":
                found.add(name)
                break
            activations = [i for i in by_name[name].inputs if by_name[i].role is Role.ACTIVATION]
            name = activations[0] if family in _SCORING and len(activations) == 1 else None
    return found


def _expert_weight(node, by_name) -> tuple[str, str] | None:
    """The experts' weight a grouped matmul reads ([E, K, N] parameter or a view of one, [M, K]
    rows): (the input it reads, the parameter's node); or None."""
    if node.role is not Role.ACTIVATION or op_family(node.target) != "matmul" or len(node.shape) != 2:
        return None
    for name in node.inputs:
        if len(by_name[name].shape) == 3:
            parameter = parameter_behind(name, by_name)
            if parameter is not None:
                return name, parameter
    return None


def parameter_behind(name: str, by_name: dict) -> str | None:
    """The parameter node that `name` is, or is a view or cast of (a transpose, a dtype), else None."""
    node = by_name[name]
    while node.role is Role.ACTIVATION and len(node.inputs) == 1 \
            and (op_family(node.target) == "view" or node.target.startswith(("aten.to.", "aten._to_copy"))):
        node = by_name[node.inputs[0]]
    return node.name if node.role is Role.PARAMETER else None


def _members(graph: Graph, matmuls: list[str]) -> frozenset[str]:
    """The matmuls and the ops on the rows between them: descendants of an earlier grouped
    matmul that the last one reads."""
    first, last = set(matmuls[:-1]), matmuls[-1]
    after: set[str] = set()
    for node in graph.nodes:
        if node.name in first or any(name in after for name in node.inputs):
            after.add(node.name)
    by_name = {n.name: n for n in graph.nodes}
    before, stack = set(), [last]
    while stack:
        name = stack.pop()
        if name in before or name not in after:
            continue
        before.add(name)
        stack.extend(by_name[name].inputs)
    return frozenset(before | set(matmuls))


def _tokens(by_name: dict, matmul) -> int:
    """Tokens the rows were gathered from: the rows of the tensor the dispatch indexes (the
    first matmul's rows input, an index op over [tokens, hidden], behind any casts); the rows
    themselves when the dispatch is not such a gather (top-1 then)."""
    rows = by_name[matmul.inputs[0]]
    while rows.target.startswith(("aten.to.", "aten._to_copy")) and rows.inputs:
        rows = by_name[rows.inputs[0]]
    source = by_name[rows.inputs[0]] if rows.inputs else rows
    return source.shape[0] if len(source.shape) == 2 else rows.shape[0]


def experts_on_every_token(graph: Graph) -> list[str]:
    """Parameters stacked over a router's experts ([E, in, out], E the width of a top-k in the
    graph) that a batched matmul runs on every token: experts computed densely, each on all the
    tokens weighted by the router's scores (HuggingFace's Llama 4 layout), which expert
    parallelism cannot dispatch."""
    by_name = {n.name: n for n in graph.nodes}
    widths = {by_name[n.inputs[0]].shape[-1] for n in graph.nodes
              if n.target.startswith("aten.topk") and n.inputs and by_name[n.inputs[0]].shape}
    found = []
    for node in graph.nodes:
        if node.role is not Role.ACTIVATION or not node.target.startswith(("aten.bmm", "aten.matmul")):
            continue
        for name in node.inputs:
            parameter = parameter_behind(name, by_name)
            shape = by_name[parameter].shape if parameter is not None else ()
            if len(shape) == 3 and shape[0] in widths and parameter not in found:
                found.append(parameter)
    return found


def expert_parameters(layers: list[ExpertLayer]) -> set[str]:
    return {weight for layer in layers for weight in layer.weights}
