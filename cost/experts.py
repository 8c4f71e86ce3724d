"""Mixture-of-experts layers priced under expert parallelism.

The layers themselves are found by cost/expert_layers.py.

Expert parallelism of degree ep (`StageSpec.ep`), as Megatron-Core carves it out of a stage's
tensor x context x data-parallel ranks with expert tensor parallelism 1 (ep consecutive ranks,
tensor-parallel ranks innermost):
  weights      each rank holds E/ep experts, whole (not split over tp): 1/ep of the parameters,
               their gradients and optimizer state; ZeRO shards them over the remaining
               tp x cp x dp / ep ranks (the expert-data-parallel group), which also reduces
               their gradients
  compute      the routed rows are split over the stage's tensor-parallel ranks, so each rank
               computes 1/tp of them: the members' work divided by tp. The runtime takes its
               share of the rows, which every tensor-parallel rank holds whole, and gathers the
               experts' output rows back (passes/expert_dispatch.py): an all-gather of the
               output in the forward and one of the rows' gradient in the backward
  dispatch     an all-to-all over the ep ranks before the first grouped matmul (each rank's
               rows to the ranks holding their experts) and one after the last (the combine),
               each moving the rows' bytes (of which 1/ep stay on the rank); the backward
               sends the gradients back the same way: two more
  balance      routing is assumed balanced: every expert gets tokens x k / E rows, so every
               rank computes the same. A routing imbalance factor f (the slowest rank's rows
               over the mean, 1.0 balanced) scales the members' compute and the all-to-alls
               (`scale_for_imbalance`): the slowest rank bounds the step
With ep = 1 the experts are placed as the rest of the graph (tensor-parallel when tp > 1).
Either way a grouped matmul runs E / ep GEMMs of rows / E rows each (balanced), whose tiles
fill the GPU together (`NodeLayout.gemm`'s third entry: cost.compute.gemm_utilization).
"""

from __future__ import annotations

import math
from dataclasses import replace

from autopar.cost.expert_layers import ExpertLayer, parameter_behind
from autopar.cost.layout import GraphLayout, whole_bytes
from autopar.plans.vocabulary import DTYPE_BYTES
from autopar.errors import AutoparError
from autopar.graph import Graph, Role


def with_expert_parallelism(layout: GraphLayout, layers: list[ExpertLayer], graph: Graph, *,
                            ep: int, tp: int) -> GraphLayout:
    """`layout` with its expert layers as they run at expert-parallel degree `ep` on a stage of
    `tp` tensor-parallel ranks (module docstring): the members' work, the experts' weights on a
    rank, the all-to-alls of dispatch and combine, the grouped GEMMs' shapes."""
    if not layers:
        if ep > 1:
            raise AutoparError(_no_expert_layer(graph, ep))
        return layout
    for layer in layers:
        if layer.experts % ep:
            raise AutoparError(f"ep={ep} does not divide the {layer.experts} experts of the "
                               f"layer of {layer.matmuls[0]}; choose an ep that divides {layer.experts}")
    nodes = list(layout.nodes)
    position = {node.name: k for k, node in enumerate(nodes)}
    param_local, storage_bytes = dict(layout.param_local), dict(layout.storage_bytes)
    element = DTYPE_BYTES[layout.dtype]
    by_name = {n.name: n for n in graph.nodes}
    for layer in layers:
        local_experts = layer.experts // ep
        for name in layer.members:
            node = nodes[position[name]]
            if ep > 1:      # whole experts on 1/tp of the rows: no tensor-parallel split
                whole = _sample_bytes(by_name[name], layout)
                inputs = sum(_sample_bytes(by_name[i], layout) for i in by_name[name].inputs
                             if by_name[i].role is Role.ACTIVATION)
                node = replace(node, flops=by_name[name].flops / layout.batch / tp, sharded=False,
                               out_bytes=whole / tp, act_bytes=(whole + inputs) / tp if node.act_bytes else 0.0,
                               comm_forward=(), forward_from=(), comm_backward=(), comm_step=(), weight_gathered=0.0,
                               weight_gathering=0.0)
                if layout.storage.get(name) == name:
                    storage_bytes[name] = whole / tp
            nodes[position[name]] = replace(node, expert=True)
        for name in layer.matmuls:
            node, weight = nodes[position[name]], _weight_of(by_name[name], by_name)
            rows = _numel(by_name[name].shape[:-1]) / layout.batch / (tp if ep > 1 else 1)
            columns = node.gemm[1] if node.gemm else by_name[name].shape[-1]
            if ep > 1:
                param_local[weight] = _numel(by_name[weight].shape) / ep
                node = replace(node, param_bytes=param_local[weight] * element)
            # balanced: each of the rank's experts gets rows x ep / E of the rank's rows
            nodes[position[name]] = replace(node, gemm=(rows * ep / layer.experts, columns, local_experts))
        if ep > 1:
            _exchange(nodes, position, layer, by_name, layout, tp, element)
    return replace(layout, nodes=nodes, param_local=param_local, storage_bytes=storage_bytes)


def _exchange(nodes: list, position: dict, layer: ExpertLayer, by_name: dict,
              layout: GraphLayout, tp: int, element: int) -> None:
    """Dispatch at the first grouped matmul (its rows), combine at the last (its output): bytes
    per sample that one rank sends into each all-to-all, forward and again backward."""
    first, last = by_name[layer.matmuls[0]], by_name[layer.matmuls[-1]]
    dispatched = _numel(by_name[first.inputs[0]].shape) / layout.batch / tp * element
    combined = _numel(last.shape) / layout.batch / tp * element
    for name, nbytes in ((first.name, dispatched), (last.name, combined)):
        node = nodes[position[name]]
        nodes[position[name]] = replace(node, exchange_bytes=node.exchange_bytes + nbytes)
    node = nodes[position[first.name]]
    nodes[position[first.name]] = replace(node, routing_counts=layer.experts)
    if tp > 1:      # the tensor-parallel shares joined, and the rows' gradients
        # batched rows that tensor parallelism split over the experts are gathered whole first,
        # and so are the gradients of an output that it splits so after the layer
        rows_split = len(first.shape) == 3 and nodes[position[first.inputs[0]]].sharded
        # rows split on another dim than theirs are moved to a split of the rows (all-to-all)
        moved = len(first.shape) == 2 and nodes[position[first.inputs[0]]].placement not in ("R", "S(0)")
        out_split = len(last.shape) == 3 and any(
            nodes[position[user.name]].sharded for user in by_name.values() if last.name in user.inputs)
        node = nodes[position[last.name]]
        nodes[position[last.name]] = replace(
            node, comm_forward=(("all_gather", combined * tp, True),), forward_from=(),   # in the dispatch
            comm_backward=(("all_gather", combined * tp, True),) if out_split else ())
        node = nodes[position[first.name]]
        # moved rows' gradients go back to their own split the same way: an all-to-all
        back = "all_to_all" if moved else "all_gather"
        nodes[position[first.name]] = replace(
            node, comm_backward=((back, dispatched * tp, True),), forward_from=(),
            comm_forward=(("all_gather", dispatched * tp, True),) if rows_split
            else (("all_to_all", dispatched * tp, True),) if moved else ())


def _sample_bytes(node, layout: GraphLayout) -> float:
    """A node's whole output for one sample, as the stage holds it (cost.layout.element_bytes)."""
    return whole_bytes(node, layout.batch, layout.dtype, layout.wide)


def _weight_of(node, by_name: dict) -> str:
    """The parameter node of the experts' weight a grouped matmul reads (directly or in a view)."""
    return next(parameter_behind(name, by_name) for name in node.inputs
                if len(by_name[name].shape) == 3 and parameter_behind(name, by_name) is not None)


def exchange_time(group, nbytes: float, *, top_k: float, experts: int,
                  deduplicated: bool = False) -> float:
    """One dispatch (or combine) over the expert-parallel `group` (a cost.collectives.Group):
    each rank sends `nbytes` of rows (top_k per token) to the ranks holding their experts.

    As an all-to-all (Megatron-Core's alltoall dispatcher, autopar's all_to_all_single) every
    row travels: of a rank's rows, those for experts outside its node cross the network. A
    deduplicating dispatcher (DeepEP, HybridEP) sends a token once to each node holding any of
    its experts and forwards it over NVLink inside: at each level of the group a token crosses
    once per distinct unit it reaches (ranks inside a node, nodes across), which with balanced
    routing is units x (1 - C(E - e, k) / C(E, k)) for units of e experts each."""
    if group.size == 1:
        return 0.0
    if not deduplicated:
        return group.all_to_all(nbytes * group.size)
    k = max(1, round(top_k))
    token = nbytes / top_k
    total, reached = 0.0, 1
    for level in group.levels:
        before, reached = reached, reached * level.size
        unit_experts = experts * before // group.size
        hit = 1.0 - math.comb(experts - unit_experts, k) / math.comb(experts, k)
        crossing = token * (level.size - 1) * hit
        latency, bandwidth = level.link.alpha_beta("all_to_all", level.size)
        total += latency + crossing / bandwidth
    return total


def _numel(shape) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _no_expert_layer(graph: Graph, ep: int) -> str:
    return (f"ep={ep}: the model has no mixture-of-experts layer (expert weights [experts, in, "
            f"out] read by a grouped or batched matmul, chosen among by a router's top-k) to "
            f"split; use ep=1")
