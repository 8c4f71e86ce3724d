"""A chunk's shape: what its price takes from its nodes, layout and recompute alone, whatever its
micro-batch (cost/chunk_price.py adds the times at a micro-batch size). What it keeps for the
backward, what the backward reruns, and what the backward holds beyond it (cost/gradient_flow.py).
The planner prices each shape at many micro-batch sizes and ZeRO levels, and sweeps it once."""

from __future__ import annotations

from typing import NamedTuple

from autopar.cost.chunk_price import Chunk, poly_at
from autopar.cost.gradient_flow import (backward_moments, backward_peak, first_keepers, last_gathered,
                                         paired_backward_peaks, region_inputs, split_backward_peak,
                                         split_whole_reads)
from autopar.cost.layout import GraphLayout, NodeLayout
from autopar.plans.vocabulary import DTYPE_BYTES
from autopar.graph import Graph


class ChunkShape(NamedTuple):
    """What a chunk's price takes from its nodes, layout and recompute alone, whatever its
    micro-batch: its memory (`chunk`, without times) and, per node, whether the backward reruns
    it, the forward collectives the rerun issues again (`_moved_again`) and whether it is in a
    recomputed region. The planner prices each shape at many micro-batch sizes."""
    chunk: Chunk
    reruns: tuple


def chunk_shape(graph: Graph, layout: GraphLayout, regions: list, nodes: list[NodeLayout]) -> ChunkShape:
    """The flops rerun and kept activations of a chunk whose nodes are `nodes`, from the layout
    and `recomputed_regions`; its parameters and loss buffers are `chunk_states`'."""
    out = Chunk()
    saved: set[str] = set()
    region_saved: dict[str, set[str]] = {}     # recomputed region -> what its nodes keep
    region_nodes: dict[str, set[int]] = {}
    reruns = []
    rerun_until = _last_saving_nodes(layout, regions, nodes)
    placed_at = {node.name: position for position, node in enumerate(nodes)}
    for position, node in enumerate(nodes):
        i = layout.index[node.name]
        region = regions[i]
        recomputed = bool(region) and position <= rerun_until.get(region, -1)
        reruns.append((recomputed, _moved_again(node, position, placed_at, regions, rerun_until, layout),
                       bool(region)))
        if region:
            out.recomputed_flops += graph.nodes[i].flops / layout.batch
            region_saved.setdefault(region, set()).update(node.saved)
            region_nodes.setdefault(region, set()).add(i)
            out.recomputed_ops += int(node.requires_grad)
        else:
            saved.update(node.saved)
        if node.requires_grad and (node.param_bytes or node.family == "embedding"):
            degree = layout.seq_degree.get(layout.storage[node.name], 0)
            out.deferred_poly[degree] = out.deferred_poly.get(degree, 0.0) + node.out_bytes
    out.recomputed_regions = len(region_saved)
    for region, keys in region_saved.items():
        inputs = region_inputs(graph, layout, region_nodes[region])
        saved.update(inputs)
        out.peak_polys.append(_poly(keys, layout))
    out.peak_per_sample = max((poly_at(p, 1) for p in out.peak_polys), default=0.0)
    out.saved_poly = _poly(saved, layout)
    for degree, value in _poly(_saved_after_the_weights(nodes, regions, layout), layout).items():
        out.deferred_poly[degree] = out.deferred_poly.get(degree, 0.0) - value
    _backward_memory(out, graph, layout, regions, nodes)
    return ChunkShape(out, tuple(reruns))


def _backward_memory(out: Chunk, graph: Graph, layout: GraphLayout, regions: list,
                     nodes: list[NodeLayout]) -> None:
    """What the chunk's backward holds beyond the kept activations. What it frees before its
    fullest moment is freed there, once: the heaviest weight's gradient is added whole
    (`heaviest_gradient`); op by op with FSDP2's reductions in `moments`."""
    first_kept = first_keepers(graph, layout, regions, nodes)
    chunk_regions = [regions[layout.index[node.name]] for node in nodes]
    out.flowing_poly = backward_peak(graph, layout, nodes, first_kept, regions=chunk_regions)
    out.split_flowing_poly = split_backward_peak(graph, layout, nodes, first_kept, regions=chunk_regions)
    out.split_whole_polys = split_whole_reads(graph, layout, nodes, first_kept, regions=chunk_regions)
    out.paired_polys = paired_backward_peaks(graph, layout, nodes, first_kept, regions=chunk_regions)
    out.moments = backward_moments(graph, layout, nodes, first_kept, regions=chunk_regions)
    out.last_gathered = last_gathered(graph, layout, nodes, first_kept, regions=chunk_regions)
    out.weight_read = _heaviest_weight(graph, layout, nodes)


def _saved_after_the_weights(nodes: list[NodeLayout], regions: list, layout: GraphLayout) -> set[str]:
    """What only the ops after a chunk's last weight-reading op keep for the backward (outside
    recomputed regions): nothing a weight's gradient reaches."""
    reads = [position for position, node in enumerate(nodes) if node.requires_grad and node.param_bytes]
    if not reads:
        return set()
    def kept(chosen):
        return {key for node in chosen if not regions[layout.index[node.name]] for key in node.saved}
    return kept(nodes[reads[-1] + 1:]) - kept(nodes[:reads[-1] + 1])


def _last_saving_nodes(layout: GraphLayout, regions: list, nodes: list[NodeLayout]) -> dict:
    """Recomputed region -> the position (in `nodes`) of its last op that keeps something for
    the backward. torch's non-reentrant checkpoint stops rerunning a region once the tensors its
    backward needs are recomputed (early stop), so the ops after that one, a layer's closing
    all-reduce and residual add, run once: one tensor-parallel collective a layer fewer than a
    whole second forward."""
    last: dict[str, int] = {}
    for position, node in enumerate(nodes):
        region = regions[layout.index[node.name]]
        if region and node.requires_grad and (node.saved or node.param_bytes):
            last[region] = position
    return last


def _heaviest_weight(graph: Graph, layout: GraphLayout, nodes: list[NodeLayout]) -> float:
    """The elements of the largest weight an op of the chunk reads (`_weight_reads`)."""
    return max((read for read, _, _, _ in _weight_reads(graph, layout, nodes)), default=0.0)


def _weight_reads(graph: Graph, layout: GraphLayout, nodes: list[NodeLayout]) -> list:
    """(elements a backward holds for the weight an op reads, its gradient's elements, position,
    graph index) of each op that reads a weight and is differentiated."""
    reads = []
    for position, node in enumerate(nodes):
        i = layout.index[node.name]
        local = max((layout.param_local.get(name, 0.0) for name in graph.nodes[i].inputs), default=0.0)
        local = max(local, node.param_bytes / DTYPE_BYTES[layout.dtype])
        # a weight read whole: its gathered copy and its whole gradient, both live in the backward
        read = max(local, 2 * node.weight_gathered)
        if read and node.requires_grad:
            reads.append((read, local, position, i))
    return reads


def _moved_again(node: NodeLayout, position: int, placed_at: dict, regions: list, rerun_until: dict,
                 layout: GraphLayout) -> tuple:
    """The forward collectives of `node` that a recomputed region's rerun issues again, up to the
    region's last op that keeps something (`_last_saving_nodes`): a value made in the region is
    moved right after the op that makes it, which the rerun passes only if that op is not its
    last (it stops within it); any other, where the region's graph receives it, or at `node`."""
    region = regions[layout.index[node.name]]
    if not region:
        return ()
    again = []
    for collective, source in zip(node.comm_forward, node.forward_from or [""] * len(node.comm_forward)):
        made_here = source in placed_at and regions[layout.index[source]] == region
        at = placed_at[source] + 0.5 if made_here else position
        if at <= rerun_until.get(region, -1):
            again.append(collective)
    return tuple(again)


def _poly(keys, layout: GraphLayout) -> dict[int, float]:
    """Bytes per sample of storage `keys` by their power of the sequence length."""
    poly: dict[int, float] = {}
    for key in keys:
        degree = layout.seq_degree.get(key, 0)
        poly[degree] = poly.get(degree, 0.0) + layout.storage_bytes.get(key, 0.0)
    return poly
