"""Mixture-of-experts layers found by their structure in a captured graph (their experts are
rewritten to run expert-parallel by passes/expert_parallel.py).

A MoE layer is recognized by what it computes, not by module or class names:
- a router's `topk` whose indices choose experts (softmax or sigmoid scores, group-limited or
  not: only the indices matter here), or its `max` taken in turns (Phi-3.5-MoE's sparsemixer
  picks one expert, masks it, picks the next), the *routing source*;
- expert weights: parameters whose leading dim is the number of experts E (the width of the
  scores the router's topk reads), read by a grouped matmul (`torch._grouped_mm`, transformers'
  `grouped_mm_fallback`: rows sorted by expert, cumulative counts as offsets) or gathered row by
  row by the routed expert ids (`weight[expert_ids]`, transformers' batched implementation), or
  *batched*: read by `bmm(rows [E, n, in], weight)`, each expert on rows of its own (HuggingFace's
  Llama 4, GShard's einsum dispatch; expert_batches.py);
- the experts' *body*: every op that computes on those weights' results, up to the value the
  layer combines (weights by routing scores, returns rows to token order, sums over top-k).

Each node of the graph gets a kind: CONST (made from nothing: buffers, `arange`), PARAM (a
parameter or a view of one), ROUTE (computed from the routing source's indices and constants
alone: sorted ids, permutations, per-expert counts and offsets) or VALUE (anything computed from
the model's inputs). The body grows from the expert ops in graph order: a node joins when it reads
a body value and otherwise only constants, expert weights through the expert ops, or the one
VALUE the first expert op reads (the *rows*: one per routed token-expert pair). A node that reads
any other VALUE (routing scores), or a ROUTE value outside an expert op (an unsort permutation), is
the layer's combine and stays in the graph. The body must end in exactly one value read outside it.

What the rewrite needs of a layer is recorded in its `ExpertLayer`: the rows, the ROUTE values
the body reads (offsets or per-row ids), the constants, the body in graph order and its output.
The router, its load-balancing loss and shared experts are not part of it. A batched layer has no
ROUTE inputs: its rows are the [E, n, in] value its first batched matmul reads, and its body only
the ops that keep each (expert, row) to itself (`keeps_expert_rows`); its output is [E, n, out].
"""

from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass, field

import torch
from torch import fx, nn

from autopar.errors import AutoparError
from autopar.passes.expert_batches import batched_rows, batched_source, batched_use, keeps_expert_rows

CONST, PARAM, ROUTE, VALUE = "const", "param", "route", "value"
# grouped matmuls over rows sorted by expert: (input, weight, offsets) by position
GROUPED_MM = ("aten._grouped_mm.default", "transformers.grouped_mm_fallback.default",
              "autopar.grouped_mm.default")
GATHERS = ("aten.index.Tensor", "aten.index_select.default")
CHECK = "aten._assert_tensor_metadata.default"


class ExpertStructureError(AutoparError):
    """A MoE layer's experts, router or dispatch could not be recognized in the graph."""


@dataclass(kw_only=True, slots=True)
class ExpertLayer:
    """One MoE layer's experts as found in the graph."""
    source: fx.Node                   # the router topk's indices
    num_experts: int
    holders: list[fx.Node]            # the expert parameters' reads
    weights: list[fx.Node] = field(default_factory=list)    # holders and views of them
    body: list[fx.Node] = field(default_factory=list)       # in graph order
    rows: fx.Node | None = None
    out: fx.Node | None = None
    routes: dict[fx.Node, str] = field(default_factory=dict)  # ROUTE input -> "offsets" | "ids"
    constants: list[fx.Node] = field(default_factory=list)
    batched: list[fx.Node] = field(default_factory=list)    # its batched matmuls, if that layout

    @property
    def where(self) -> str:
        return _module_path(self.out or self.source)


def find_expert_layers(gm: fx.GraphModule) -> list[ExpertLayer]:
    """Every MoE layer of `gm`, in graph order. Parameters are read by `call_module` nodes without
    inputs whose module returns an `nn.Parameter` (how autopar's stages hold them). Raises
    ExpertStructureError for a layer whose expert weights are found but whose body is not."""
    kinds = _kinds(gm)
    layers: dict[fx.Node, ExpertLayer] = {}
    for node in gm.graph.nodes:
        use = _expert_use(node, kinds)
        if use is None:
            continue
        weight, route = use
        source = _routing_source(route, kinds) if route is not None else \
            batched_source(node, weight.meta["val"].shape[0], _is_expert_choice, _router_width)
        if source is None:
            continue    # a batched matmul over a parameter that no router chooses among
        layer = layers.get(source)
        if layer is None:
            layer = layers[source] = ExpertLayer(source=source, num_experts=_router_width(source),
                                                 holders=[])
        if route is None:
            layer.batched.append(node)
        for holder in _holders(weight, kinds, gm):
            if holder not in layer.holders:
                layer.holders.append(holder)
    for layer in layers.values():
        _check_weights(layer, gm)
        _grow_body(gm, layer, kinds)
    return list(layers.values())


def token_wise_nodes(gm: fx.GraphModule) -> set[str]:
    """The names of the nodes of `gm`'s MoE layers that work along the rows (one per routed
    token-expert pair) and yet compute each token's output from that token alone: the experts'
    body (row by row, as expert parallelism runs it on any rows), sorts of values computed from
    the routed expert ids alone (the rows' order by expert), numberings of the rows that only
    such values read (`arange` for an inverse permutation), and gathers of whole rows by such a
    value (dispatch into that order and combine back). Under dropless routing a rank holding
    only some tokens computes the same for each of them (context parallelism relies on it). A
    router whose top-k runs over the tokens, or a token's place counted over the others
    (capacity), is not among them."""
    try:
        layers = find_expert_layers(gm)
    except ExpertStructureError:
        return set()    # experts not understood: their ops are judged one by one
    if not layers:
        return set()
    kinds = _kinds(gm)
    # a batched layer's body runs on [E, n] rows, not on a token's: its ops are judged one by one
    found = {node.name for layer in layers if not layer.batched for node in layer.body}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        target = str(node.target)
        if target.startswith(("aten.sort.", "aten.argsort.")) and kinds[node] == ROUTE:
            found.add(node.name)
        elif target.startswith("aten.arange.") and node.users \
                and all(kinds.get(user) == ROUTE for user in node.users):
            found.add(node.name)
        elif target in GATHERS:
            source, index = _gather_arguments(node)
            if source is not None and kinds.get(index) == ROUTE:
                found.add(node.name)
    return found


# --- node kinds -----------------------------------------------------------------------------------

def _kinds(gm: fx.GraphModule) -> dict[fx.Node, str]:
    kinds: dict[fx.Node, str] = {}
    for node in gm.graph.nodes:
        inputs = node.all_input_nodes
        if node.op == "placeholder":
            kinds[node] = VALUE
        elif node.op in ("call_module", "get_attr") and not inputs:
            kinds[node] = PARAM if _parameter(gm, node) is not None else CONST
        elif _is_expert_choice(node):
            kinds[node] = ROUTE
        elif not inputs:
            kinds[node] = CONST
        else:
            found = {kinds.get(i, VALUE) for i in inputs}
            if found <= {CONST}:
                kinds[node] = CONST
            elif found <= {CONST, ROUTE}:
                kinds[node] = ROUTE
            elif found <= {CONST, PARAM}:
                kinds[node] = PARAM
            else:
                kinds[node] = VALUE
    return kinds


def _parameter(gm: fx.GraphModule, node: fx.Node) -> nn.Parameter | None:
    if node.op == "get_attr":
        owner, _, name = node.target.rpartition(".")
        value = getattr(gm.get_submodule(owner), name, None)
    else:
        module = gm.get_submodule(node.target)
        value = module() if not list(module.children()) and _takes_no_input(module) else None
    return value if isinstance(value, nn.Parameter) else None


def _takes_no_input(module: nn.Module) -> bool:
    try:
        return not inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


# ops whose indices choose among a router's scores: top-k, or the largest one (a router that
# picks its k experts one at a time, as Phi-3.5-MoE's sparsemixer does)
CHOICES = ("aten.topk.default", "aten.max.dim")


def _is_expert_choice(node: fx.Node) -> bool:
    """Whether `node` is the indices of a top-k or max over scores (the routing source)."""
    return _choice(node) is not None


def _choice(node: fx.Node) -> fx.Node | None:
    """The top-k, max or argmax node whose indices `node` is, where it is one: `node` itself, or
    the node a no-grad region's output stands for (torch.export wraps `torch.no_grad()` code in
    a `wrap_with_set_grad_enabled` call of a submodule)."""
    if node.op != "call_function":
        return None
    if str(node.target) == "aten.argmax.default":
        return node
    if node.target is not operator.getitem or not isinstance(node.args[0], fx.Node):
        return None
    producer, index = node.args
    if str(producer.target) in CHOICES:
        return node if index == 1 else None
    if "wrap_with_set_grad_enabled" in str(producer.target):
        inner = _region_output(producer, index)
        return _choice(inner) if isinstance(inner, fx.Node) else None
    return None


def _region_output(call: fx.Node, index: int):
    """The node of a `wrap_with_set_grad_enabled` call's submodule that its output `index` is."""
    submodule = call.graph.owning_module.get_submodule(call.args[1].target)
    output = next(n for n in submodule.graph.nodes if n.op == "output").args[0]
    return output[index] if isinstance(output, (tuple, list)) else output


# --- expert ops and their weights -----------------------------------------------------------------

def _expert_use(node: fx.Node, kinds) -> tuple[fx.Node, fx.Node] | None:
    """(weight, route) when `node` reads expert weights by routed experts: a grouped matmul with
    PARAM weights and ROUTE offsets, or a gather of PARAM rows by ROUTE ids."""
    if node.op != "call_function":
        return None
    target = str(node.target)
    if target in GROUPED_MM:
        _, weight, offsets = grouped_arguments(node)
        if isinstance(weight, fx.Node) and kinds[weight] == PARAM and isinstance(offsets, fx.Node) \
                and kinds[offsets] == ROUTE:
            return weight, offsets
    elif target in GATHERS:
        source, index = _gather_arguments(node)
        if isinstance(source, fx.Node) and kinds[source] == PARAM and isinstance(index, fx.Node) \
                and kinds[index] == ROUTE:
            return source, index
    else:
        weight = batched_use(node, kinds, PARAM, VALUE)
        if weight is not None:
            return weight, None
    return None


def grouped_arguments(node: fx.Node) -> tuple:
    """(input, weight, offsets) of a grouped matmul node."""
    args = list(node.args) + [None] * 3
    offsets = node.kwargs.get("offs", args[2])
    extra = {key: value for key, value in node.kwargs.items() if key != "offs" and value is not None}
    if extra or any(a is not None for a in node.args[3:]):
        raise ExpertStructureError(
            f"the grouped matmul {node.name} in {_module_path(node)} takes {sorted(extra) or 'more'} "
            f"arguments beyond (input, weight, offsets), which expert parallelism does not split; "
            f"add the bias after the matmul, or train this model with ep=1")
    return args[0], args[1], offsets


def _gather_arguments(node: fx.Node) -> tuple:
    """(source, index) of a gather of whole rows of dim 0, else (None, None)."""
    if str(node.target) == "aten.index.Tensor":
        source, indices = node.args[0], node.args[1]
        if len(indices) == 1 and isinstance(indices[0], fx.Node):
            return source, indices[0]
    elif node.args[1] == 0:
        return node.args[0], node.args[2]
    return None, None


def _routing_source(route: fx.Node, kinds) -> fx.Node:
    """The router choice a ROUTE value derives from: the last of the top-k or max indices it is
    computed from (a router may pick its experts in turns, each from the scores the turns before
    left), all over the same number of experts; else the experts mix routers."""
    sources, stack, seen = set(), [route], set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if _is_expert_choice(node):
            sources.add(node)
        else:
            stack.extend(i for i in node.all_input_nodes if kinds[i] == ROUTE)
    widths = {_router_width(source) for source in sources}
    if len(widths) != 1:
        raise ExpertStructureError(
            f"the expert routing value {route.name} in {_module_path(route)} derives from "
            f"{len(sources)} router choices over {sorted(widths)} experts; expert parallelism "
            f"needs each expert computation chosen among one router's experts: train this model "
            f"with ep=1")
    if len(sources) == 1:
        return sources.pop()
    order = {node: index for index, node in enumerate(route.graph.nodes)}
    return max(sources, key=order.__getitem__)


def _router_width(source: fx.Node) -> int:
    """The number of experts a routing choice picks among: the width of the scores it reads."""
    choice = _choice(source)
    scores = choice.args[0] if str(choice.target) == "aten.argmax.default" else choice.args[0].args[0]
    return int(scores.meta["val"].shape[-1])


def _holders(weight: fx.Node, kinds, gm: fx.GraphModule) -> list[fx.Node]:
    """The parameter reads a PARAM value is computed from."""
    found, stack = [], [weight]
    while stack:
        node = stack.pop()
        if not node.all_input_nodes:
            if kinds[node] == PARAM and node not in found:
                found.append(node)
        else:
            stack.extend(i for i in node.all_input_nodes if kinds[i] == PARAM)
    return found


def _check_weights(layer: ExpertLayer, gm: fx.GraphModule) -> None:
    for holder in layer.holders:
        if holder.op != "call_module":
            raise ExpertStructureError(
                f"the expert weight {holder.target} in {layer.where} is read as a graph attribute; "
                f"expert parallelism moves expert weights with the modules that hold them, as "
                f"autopar's stage programs do (autopar.passes.program.export_for_pipeline)")
        shape = tuple(_parameter(gm, holder).shape)
        if not shape or shape[0] != layer.num_experts:
            raise ExpertStructureError(
                f"the expert weight read by {holder.name} in {layer.where} has shape {shape}, but "
                f"its router chooses among {layer.num_experts} experts; expert parallelism splits "
                f"expert weights on a leading dim of that size: train this model with ep=1")


# --- the body -------------------------------------------------------------------------------------

def _grow_body(gm: fx.GraphModule, layer: ExpertLayer, kinds) -> None:
    """The experts' body, rows, routing inputs and constants (module doc)."""
    seeds = layer.batched or [node for node in gm.graph.nodes if _is_seed(node, layer, kinds)]
    weights = _weight_nodes(layer, kinds)
    layer.rows, chain = (batched_rows(seeds[0]), []) if layer.batched else _rows(seeds, kinds)
    body: set[fx.Node] = set(seeds) | set(chain)
    for node in gm.graph.nodes:
        if node not in body and str(node.target) != CHECK \
                and any(i in body for i in node.all_input_nodes) and _joins(node, layer, body, kinds) \
                and (not layer.batched or keeps_expert_rows(node, layer.rows.meta["val"])):
            body.add(node)
    layer.body = [n for n in gm.graph.nodes if n in body]
    layer.weights = [n for n in gm.graph.nodes if n in weights]
    outs = [n for n in layer.body if any(u not in body and str(u.target) != CHECK for u in n.users)]
    if len(outs) != 1:
        raise ExpertStructureError(
            f"the experts in {layer.where} (weights {[h.name for h in layer.holders]}) do not end in "
            f"one value that the layer combines (found {[n.name for n in outs]}); expert "
            f"parallelism cannot split this router and experts: train this model with ep=1")
    layer.out = outs[0]
    _check_closed(layer, body, weights)


def _is_seed(node: fx.Node, layer: ExpertLayer, kinds) -> bool:
    """An expert op of this layer; records how it reads the routing (offsets or ids)."""
    use = _expert_use(node, kinds)
    if use is None or use[1] is None or _routing_source(use[1], kinds) is not layer.source:
        return False
    role = "offsets" if str(node.target) in GROUPED_MM else "ids"
    if layer.routes.setdefault(use[1], role) != role:
        raise ExpertStructureError(
            f"{use[1].name} in {layer.where} is used both as grouped-matmul offsets and as expert "
            f"ids; expert parallelism cannot split this router: train this model with ep=1")
    return True


def _rows(seeds: list[fx.Node], kinds) -> tuple[fx.Node, list[fx.Node]]:
    """The rows, and the ops between them and the expert matmuls (views: `unsqueeze`).

    The expert matmuls' token operands are the grouped matmuls' inputs and what an op reads
    beside a gathered weight, among values that no expert op computes. Each is followed back
    through ops that read one value (views, casts) to the last one they have in common."""
    computed = _descendants(seeds)
    operands = []
    for seed in seeds:
        if str(seed.target) in GROUPED_MM:
            readers = [(seed, grouped_arguments(seed)[0])]
        else:
            readers = [(user, value) for user in seed.users for value in user.all_input_nodes]
        operands += [value for _, value in readers if value not in computed and kinds[value] == VALUE
                     and value not in operands]
    if not operands:
        where = _module_path(seeds[0])
        raise ExpertStructureError(
            f"the experts in {where} read no value of the model's tokens beside their weights; "
            f"expert parallelism cannot dispatch them: train this model with ep=1")
    paths = [_single_input_path(value, kinds) for value in operands]
    common = next((node for node in paths[0] if all(node in path for path in paths[1:])), None)
    if common is None:
        raise ExpertStructureError(
            f"the experts in {_module_path(seeds[0])} read token values {[v.name for v in operands]} "
            f"that are not views of one value; expert parallelism dispatches one value per row: "
            f"train this model with ep=1")
    chain = [node for path in paths for node in path[:path.index(common)]]
    return common, list(dict.fromkeys(chain))


def _descendants(nodes: list[fx.Node]) -> set[fx.Node]:
    found, stack = set(nodes), list(nodes)
    while stack:
        for user in stack.pop().users:
            if user not in found:
                found.add(user)
                stack.append(user)
    return found


def _single_input_path(value: fx.Node, kinds) -> list[fx.Node]:
    """`value`, then what it was computed from while each op read one non-constant value."""
    path = [value]
    while True:
        inputs = [i for i in path[-1].all_input_nodes if kinds[i] != CONST]
        if len(inputs) != 1 or kinds[inputs[0]] != VALUE or path[-1].op != "call_function":
            return path
        path.append(inputs[0])


def _weight_nodes(layer: ExpertLayer, kinds) -> set[fx.Node]:
    """The holders and every PARAM value made from them (views, casts, transposes)."""
    found = set(layer.holders)
    stack = list(layer.holders)
    while stack:
        for user in stack.pop().users:
            if kinds.get(user) == PARAM and user not in found:
                found.add(user)
                stack.append(user)
    return found


def _joins(node: fx.Node, layer: ExpertLayer, body: set, kinds) -> bool:
    """Whether a node reading a body value is part of the body (module doc): it reads nothing
    else but constants and the rows."""
    return node.op != "output" and all(
        value in body or value is layer.rows or kinds[value] == CONST for value in node.all_input_nodes)


def _check_closed(layer: ExpertLayer, body: set, weights: set) -> None:
    """Expert weights are read by the experts alone, and the body reads nothing the rewrite does
    not pass it; the rows and the output are one row per routed token-expert pair."""
    inside = body | weights
    for node in layer.weights:
        outside = [u.name for u in node.users if u not in inside and str(u.target) != CHECK]
        if outside:
            raise ExpertStructureError(
                f"the expert weight value {node.name} in {layer.where} is also read outside the "
                f"experts (by {outside}); expert parallelism holds each expert on one rank: train "
                f"this model with ep=1")
    for node in layer.body + layer.weights:
        for value in node.all_input_nodes:
            if value not in inside and value is not layer.rows and value not in layer.routes \
                    and value not in layer.constants:
                layer.constants.append(value)
    rows, out = layer.rows.meta.get("val"), layer.out.meta.get("val")
    leading = 2 if layer.batched else 1      # [E, n] pairs, or routed rows
    if not isinstance(rows, torch.Tensor) or not isinstance(out, torch.Tensor) \
            or rows.dim() < 2 * leading - 1 or out.dim() < 2 * leading - 1 \
            or rows.shape[:leading] != out.shape[:leading]:
        raise ExpertStructureError(
            f"the experts in {layer.where} take {layer.rows.name} and return {layer.out.name}, "
            f"which are not one row per routed token: expert parallelism cannot dispatch them; "
            f"train this model with ep=1")


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    paths = [path for path, _ in stack.values() if path]
    return f"module {paths[-1]}" if paths else "the model's own forward"
