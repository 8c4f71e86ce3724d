"""Ops a device runs by another kernel than the one the layout assumes, which keeps other tensors
for the backward.

The layout (cost/layout.py) keeps what a GPU's kernels keep. rms_norm on a GPU is torch's fused
kernel, which keeps its input and each row's reciprocal RMS. A CPU has no fused kernel: torch runs
the composite, which computes in fp32 and keeps, beside the reciprocal, the fp32 input and the
normalized rows: one more tensor of the input's size in fp32 training, three more (4x a 16-bit
input's bytes, fp32 copies of input and rows) in 16-bit training. autopar.simulate runs a GPU
plan's norms by the fused kernel for the same reason (autopar/simulate/kernels.py).
"""

from __future__ import annotations

from dataclasses import replace

from autopar.cost.layout import GraphLayout
from autopar.graph import Graph

RMS_NORM = "aten.rms_norm.default"


def with_composite_norms(layout: GraphLayout, graph: Graph) -> GraphLayout:
    """`layout` with every rms_norm keeping what the CPU's composite keeps (module docstring)."""
    by_name = {n.name: n for n in graph.nodes}
    extra = 1.0 if layout.dtype == "float32" else 3.0
    nodes, storage_bytes, seq_degree = [], dict(layout.storage_bytes), dict(layout.seq_degree)
    for node in layout.nodes:
        if by_name[node.name].target == RMS_NORM and node.requires_grad and node.saved:
            source = layout.storage[by_name[node.name].inputs[0]]
            key = f"{node.name}:normalized"
            storage_bytes[key] = extra * layout.storage_bytes.get(source, 0.0)
            seq_degree[key] = layout.seq_degree.get(source, 0)
            node = replace(node, saved=(*node.saved, key))
        nodes.append(node)
    return replace(layout, nodes=nodes, storage_bytes=storage_bytes, seq_degree=seq_degree)
