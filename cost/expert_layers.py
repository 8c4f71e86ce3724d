"""Mixture-of-experts layers found in a captured graph by their structure, not by class names.

An expert layer is a set of grouped matmuls (family "matmul" reading a 3-D parameter [E, K, N]
or a view of one, as HuggingFace transposes its [E, N, K] weights, the experts' weights, and 2-D
rows [M, K] sorted by expert) that share one routing: the third input, the rows' group offsets. Its rows per token are the top-k it routes to (M over the tokens
its dispatch gathered from); its members are the grouped matmuls and the ops between them (the
activation of a SwiGLU expert), which run on the rows, not on the tokens. Its router is the
matmul whose output a top-k choice reads.

A batched expert layer (HuggingFace's Llama 4, GShard's einsum dispatch) runs each expert on rows
of its own: batched matmuls `bmm(rows [E, n, K], weight [E, K, N])`, or einsums that compute the
same per expert (`per_expert_rows`), whose E is the width of the router choice (top-k or max)
before them, the layer's routing. Its rows per token are E (every
expert sees every token) and the rows of the batch E x n.
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
    return graph.derive("expert_layers", lambda: _expert_layers(graph))


def _expert_layers(graph: Graph) -> list[ExpertLayer]:
    by_name = {n.name: n for n in graph.nodes}
    position = {n.name: k for k, n in enumerate(graph.nodes)}
    routed: dict[str, list] = {}
    for node in graph.nodes:
        read = _expert_weight(node, by_name)
        if read is not None:
            weight, parameter = read
            routing = next((i for i in node.inputs[1:] if i != weight), node.inputs[-1])
            routed.setdefault(routing, []).append((node, parameter))
        parameter = _batched_weight(node, by_name)
        router = parameter and _router_of(node.inputs[0], by_name[parameter].shape[0], by_name, position)
        if router:
            routed.setdefault(router, []).append((node, parameter))
    layers = []
    for found in routed.values():
        matmuls = [node.name for node, _ in found]
        weights = tuple(dict.fromkeys(weight for _, weight in found))
        experts = by_name[weights[0]].shape[0]
        first = by_name[matmuls[0]]
        rows = _numel(first.shape[:-1])
        tokens = first.shape[1] if len(first.shape) == 3 else _tokens(by_name, first)
        layers.append(ExpertLayer(matmuls=tuple(matmuls), members=_members(graph, matmuls),
                                  weights=weights, experts=experts, rows=rows,
                                  top_k=rows / max(1, tokens)))
    return layers


_CHOICES = ("aten.topk.", "aten.max.dim", "aten.argmax.")


def _choice_width(node, by_name) -> int:
    """The number of scores a router choice (top-k, max, argmax over the last dim) picks among;
    0 for other nodes."""
    if node.role is not Role.ACTIVATION or not node.target.startswith(_CHOICES) or not node.inputs:
        return 0
    shape = by_name[node.inputs[0]].shape
    return shape[-1] if shape else 0


def _router_of(rows: str, experts: int, by_name: dict, position: dict) -> str | None:
    """The router choice over `experts` scores that `rows` derive from, the last in graph order
    (an earlier layer's reach them too, through the residual stream); None if there is none."""
    found, stack, seen = None, [rows], set()
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        if _choice_width(by_name[name], by_name) == experts \
                and (found is None or position[name] > position[found]):
            found = name
        stack.extend(by_name[name].inputs)
    return found


def _batched_weight(node, by_name) -> str | None:
    """The parameter [E, K, N] of `bmm(rows [E, n, K], weight)`, a batched expert matmul; else
    None."""
    if node.role is not Role.ACTIVATION or len(node.inputs) != 2 or not (
            node.target.startswith("aten.bmm") or node.target.startswith("aten.einsum")
            and per_expert_rows(node.args[0])):
        return None
    rows, weight = (by_name[name] for name in node.inputs)
    parameter = parameter_behind(weight.name, by_name)
    if parameter is None or rows.role is not Role.ACTIVATION or parameter_behind(rows.name, by_name):
        return None
    shape = by_name[parameter].shape
    return parameter if len(shape) == 3 and len(rows.shape) == 3 and rows.shape[0] == shape[0] \
        else None


def per_expert_rows(equation) -> bool:
    """Whether a two-operand einsum computes `rows [e, n, ...]` with `weight [e, ...]` into
    `[e, n, ...]`, each (expert, row) from that row and that expert's weight alone: the batched
    matmul of experts ("ecd,edf->ecf", or with the weight transposed, "ecd,efd->ecf")."""
    if not isinstance(equation, str) or "->" not in equation or "..." in equation:
        return False
    operands, out = equation.replace(" ", "").split("->")
    parts = operands.split(",")
    if len(parts) != 2 or min(len(parts[0]), len(parts[1]), len(out)) < 2:
        return False
    rows, weight = parts
    return rows[0] == weight[0] == out[0] and rows[1] == out[1] and rows[1] not in weight


def _numel(shape) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


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


def expert_parameters(layers: list[ExpertLayer]) -> set[str]:
    return {weight for layer in layers for weight in layer.weights}
