"""Context parallelism: every sequence split over cp ranks for the whole model.

A rank holds 1/cp of each sequence's tokens: every op but attention does 1/cp of its work, keeps
1/cp of its activations and sends 1/cp of a stage's boundary (the estimator prices a micro-batch
of b sequences as b / cp of them). Attention needs every earlier key, in one of two ways
(`StageSpec.cp_kind`):

  ring        (ring attention; Megatron-Core's and torchtitan's default) the rank keeps its
              queries and passes its K/V block around the ring of cp ranks: cp - 1 steps, each
              computing attention against the block in hand while the next one arrives
              (point-to-point to the ring neighbour). Overlap goes as far as it really does:
              a step takes max(its compute, its transfer), and the first block, the rank's own,
              is computed with nothing to hide behind:
                  forward  = c + (cp - 1) * max(c, t)            c = attention forward / cp
                  backward = c' + (cp - 1) * max(c', 2t)          K/V again and their gradients
  all-to-all  (DeepSpeed-Ulysses) before attention an all-to-all swaps the sequence split of
              q, k and v for a split of the heads, and one after swaps the output back; the
              backward runs the four again on the gradients. Nothing overlaps. Needs the
              rank's heads (after tensor parallelism) divisible by cp.
Causal attention is load-balanced (each rank holds chunk i and chunk 2cp - 1 - i of the
sequence, as Llama 3 and torchtitan split it), so every rank computes 1/cp of the attention
FLOPs; the sequence must split into 2 x cp chunks. The K/V moved are the keys and values as
the model computes them before grouped-query heads are repeated: the ring passes them, the
all-to-all splits them, repeated only where their heads do not divide cp (plans/head_split.py).
Weight gradients are reduced over the cp x dp ranks (Megatron's data-parallel group with
context parallelism), and ZeRO shards over them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from autopar.cost.collectives import Group, send_recv_time
from autopar.cost.compute import op_family
from autopar.cost.layout import GraphLayout, graph_batch, graph_sequence
from autopar.cost.storage import sixteen_bit_copy
from autopar.plans.head_split import kv_repeat
from autopar.plans.vocabulary import DTYPE_BYTES
from autopar.plans.vocabulary import ContextParallel
from autopar.errors import AutoparError
from autopar.graph import Graph, Role

# autopar.models.hf_attention's masks of a sliding window and of padding, as the capture names
# their ops
OWN_MASKS = ("autopar.sliding_window_mask.default", "autopar.padding_mask.default")

# Ops through which a value reaches attention unchanged in content (grouped-query heads repeated
# by expand + reshape, a copy): the K/V a ring passes are before them.
_REPEAT_STEPS = {"reshape", "view", "_unsafe_view", "clone", "expand"}
_SAME_VALUES = {"view", "reshape", "_unsafe_view", "expand", "unsqueeze", "clone", "contiguous",
                "slice", "transpose", "permute", "alias", "_to_copy", "squeeze"}


class AttentionBytes(NamedTuple):
    """What one attention op of a tensor-parallel rank moves under context parallelism, bytes
    per sample: keys and values as computed before grouped-query heads are repeated (what both
    kinds move), and the heads the rank attends with."""
    query: float
    kv: float                 # keys + values, before any repeat
    output: float
    heads: int                # the rank's query heads
    kv_heads: int             # the rank's key/value heads, before any repeat


def attention_bytes(graph: Graph, layout: GraphLayout) -> dict[str, AttentionBytes]:
    """Attention node -> what it moves on one tensor-parallel rank (`AttentionBytes`). Where the
    key/value heads do not split over the tp ranks, context parallelism's attention runs every
    head on every tp rank (autopar.passes.context_attention `_local_heads`). Floating values in
    the training dtype, even those mixed precision keeps in fp32 (`layout.wide`): the ring moves
    them in the dtype attention reads, autocast's (the all-to-alls: `swapped_bytes`)."""
    by_name = {n.name: n for n in graph.nodes}
    element = DTYPE_BYTES[layout.dtype]
    found = {}
    for node in layout.nodes:
        if node.family != "attention" or not node.attention:
            continue
        query, key, value = (by_name[name] for name in by_name[node.name].inputs[:3])
        heads = _numel(query.shape[:-2]) / layout.batch
        origin = by_name[_before_repeat(by_name, key.name)].shape
        kv_heads = origin[1] if len(origin) == 4 else heads
        tp = round(heads / node.attention["heads"]) if node.attention["heads"] else 1
        share = 1 / tp if kv_heads % tp == 0 else 1.0
        kv = sum(_smallest_origin(by_name, n.name, element) for n in (key, value))
        output = _numel(query.shape[:-1]) * value.shape[-1] * element
        found[node.name] = AttentionBytes(
            *(size / layout.batch * share for size in (_bytes(query, element), kv, output)),
            heads=round(heads * share), kv_heads=round(kv_heads * share))
    return found


def with_ring_attention(layout: GraphLayout, graph: Graph) -> GraphLayout:
    """`layout` with its attention as ring attention keeps it for the backward: the keys and
    values as the model computes them, before grouped-query heads are repeated (the tensors the
    ring passes; autopar.passes.context_parallel.before_repeat), with the queries, the output and
    its log-sum-exp. The repeated copies are never made. It keeps them in the dtype attention
    reads them in: a value mixed precision holds in fp32 (Llama's rotated queries) is kept as its
    16-bit copy."""
    by_name = {n.name: n for n in graph.nodes}
    sizes = attention_bytes(graph, layout)
    nodes, storage_bytes, seq_degree = [], dict(layout.storage_bytes), dict(layout.seq_degree)

    def as_read(key: str, reader: str) -> str:
        owner = key.partition("@")[0]
        if owner not in layout.wide:
            return key
        return sixteen_bit_copy(key, reader, storage_bytes, seq_degree,
                                DTYPE_BYTES[layout.dtype] / DTYPE_BYTES[layout.wide[owner]])

    for node in layout.nodes:
        if node.family == "attention" and node.attention and len(node.saved) >= 3:
            _, key, value = by_name[node.name].inputs[:3]
            origins = [_before_repeat(by_name, name) for name in (key, value)]
            repeat = _numel(by_name[key].shape) / _numel(by_name[origins[0]].shape)
            kept = (node.saved[0], *(layout.storage[o] for o in origins))
            node = replace(node, saved=(*(as_read(k, node.name) for k in kept), *node.saved[3:]),
                           backward_bytes=_ring_backward_bytes(*sizes[node.name][:3], repeat, layout.dtype))
        nodes.append(node)
    return replace(layout, nodes=nodes, storage_bytes=storage_bytes, seq_degree=seq_degree)


def _ring_backward_bytes(query: float, kv: float, output: float, repeat: float, dtype: str) -> float:
    """What ring attention's backward holds beyond the gradient it takes and the ones it gives,
    per sample (autopar.passes.context_attention.RingAttention.backward), which computes in
    fp32: fp32 copies of the queries and output (of 16-bit ones) and of the output's gradient,
    the queries' gradient, the K/V block it passes on with the fp32 gradients travelling with
    it, and for the block in hand its K/V repeated to every query head in fp32 and the block's
    three gradients. `repeat`: query heads per K/V head."""
    widen = 4 / DTYPE_BYTES[dtype]
    copies = (query + output) * widen if widen > 1 else 0.0
    return (copies + output * widen + query * widen + kv * (1 + widen)
            + query * widen + 2 * repeat * kv * widen)


def _before_repeat(by_name: dict, name: str) -> str:
    """The node whose heads `name` repeats (`x[:, :, None].expand(b, kv, g, s, d).reshape(b, kv
    * g, s, d)`), or `name` where it repeats none: the runtime's rule, on the captured graph."""
    node = by_name[name]
    while node.inputs and _op(node.target) in _REPEAT_STEPS:
        if _op(node.target) == "expand":
            source = by_name[node.inputs[0]]
            if _op(source.target) != "unsqueeze" or source.args[1:2] != (2,) or not source.inputs:
                return name
            kept, whole = by_name[source.inputs[0]].shape, by_name[name].shape
            repeated = len(kept) == 4 and len(whole) == 4 and whole[1] % kept[1] == 0 and \
                (kept[0], kept[2], kept[3]) == (whole[0], whole[2], whole[3])
            return source.inputs[0] if repeated else name
        node = by_name[node.inputs[0]]
    return name


def _numel(shape) -> int:
    size = 1
    for dim in shape:
        size *= dim
    return size


def _bytes(node, element: int) -> float:
    return _numel(node.shape) * (element if node.dtype.startswith(("float", "bfloat")) else DTYPE_BYTES.get(node.dtype, 4))


def _smallest_origin(by_name: dict, name: str, element: int) -> float:
    """The fewest bytes along the chain of value-preserving ops that lead to `name`."""
    smallest = _bytes(by_name[name], element)
    node = by_name[name]
    while node.inputs and node.role is Role.ACTIVATION and _op(node.target) in _SAME_VALUES:
        node = by_name[node.inputs[0]]
        smallest = min(smallest, _bytes(node, element))
    return smallest


def _op(target: str) -> str:
    parts = target.split(".")
    return parts[1] if len(parts) > 2 else parts[-1]


def check_sequence_split(graph: Graph, cp: int) -> None:
    """The captured sequence must split into 2 x cp chunks (causal load balancing), and the
    model's attention over it (`sequence_split_error`)."""
    if cp == 1:
        return
    seq = graph_sequence(graph)
    if seq and seq % (2 * cp):
        raise AutoparError(f"cp={cp}: the sequence of {seq} tokens does not split into 2 x cp = "
                           f"{2 * cp} equal chunks (each rank holds chunks i and 2cp-1-i); choose a "
                           f"cp with 2 x cp dividing {seq}, or a sequence length divisible by {2 * cp}")
    error = sequence_split_error(graph)
    if error is not None:
        raise AutoparError(f"cp={cp}: {error}; use cp=1")


def sequence_split_error(graph: Graph) -> str | None:
    """Why context parallelism cannot split this model's sequence, as far as its capture tells
    (None where it can): token ids to split, scaled_dot_product_attention to run over the
    pieces, without an explicit mask (a mask built for one rank's tokens is not the whole
    sequence's), and no softmax over the sequence outside it (attention written as its own ops).
    The runtime's analysis of the program is the finer one (autopar.passes.context_parallel)."""
    return graph.derive("sequence_split_error", lambda: _sequence_split_error(graph))


def _sequence_split_error(graph: Graph) -> str | None:
    seq = graph_sequence(graph)
    if not seq:
        return ("the model's first input is not a [batch, seq] tensor of token ids, so there is no "
                "sequence to split")
    attention = [n for n in graph.nodes if op_family(n.target) == "attention"]
    if not attention:
        return "the model has no attention op to split over the sequence (scaled_dot_product_attention)"
    # autopar's sliding-window and padding masks are computed from true positions: the runtime
    # splits them
    masked = next((n for n in attention if any(_foreign_mask(graph.node(name)) for name in n.inputs[3:])),
                  None)
    if masked is not None:
        return (f"its attention ({masked.name}) takes an explicit mask, which autopar cannot split "
                f"over the sequence (autopar.models.hf_attention.causal_sdpa gives HuggingFace "
                f"models causal attention without one)")
    softmax = next((n for n in graph.nodes if "softmax" in n.target and n.shape
                    and n.shape[-1] == seq), None)
    if softmax is not None:
        return f"{softmax.name} takes a softmax over the sequence outside scaled_dot_product_attention"
    by_name = {n.name: n for n in graph.nodes}
    running = next((n for n in sequence_scans(graph) if not _without_gradient(by_name, n.inputs[0])),
                   None)
    if running is not None:
        return (f"{running.name} is a running sum along the sequence of values that take gradients, "
                f"which autopar splits for counts only (OPT's positions)")
    return None


def sequence_scans(graph: Graph) -> list:
    """The cumsums along the sequence (a dim after the batch as long as it): a rank computes its
    chunks' and adds the totals of the chunks before them (autopar.passes.context_scan)."""
    seq = graph_sequence(graph)
    scans, live = [], _live(graph)
    for node in graph.nodes:
        if node.target != "aten.cumsum.default" or not node.inputs or node.name not in live:
            continue
        shape = graph.node(node.inputs[0]).shape
        dim = node.args[1] % len(shape) if len(node.args) > 1 and isinstance(node.args[1], int) else None
        if dim and shape[dim] == seq:
            scans.append(node)
    return scans


def _live(graph: Graph) -> set[str]:
    """The nodes whose values reach the outputs or an op with an effect: the runtime splits those
    (a count HuggingFace makes for packed sequences and never reads is left out)."""
    by_name = {n.name: n for n in graph.nodes}
    pending = [n.name for n in graph.nodes if n.role is Role.OUTPUT or n.effect]
    live = set()
    while pending:
        name = pending.pop()
        if name not in live:
            live.add(name)
            pending.extend(by_name[name].inputs)
    return live


def scan_bytes(graph: Graph) -> dict[str, float]:
    """Sequence cumsum -> bytes per sequence of its 2 chunk totals, which the rank all-gathers."""
    return {node.name: node.bytes / graph_batch(graph) / graph_sequence(graph) * 2
            for node in sequence_scans(graph)}


def _without_gradient(by_name: dict, name: str) -> bool:
    """Whether no gradient reaches `name`: counts (integers, booleans), constants, or values
    computed from those alone (the runtime's test, autopar.passes.context_parallel)."""
    node = by_name[name]
    if not node.dtype.startswith(("float", "bfloat", "complex")) or node.role is Role.BUFFER:
        return True
    if node.role is not Role.ACTIVATION:
        return False
    return all(_without_gradient(by_name, source) for source in node.inputs)


def _foreign_mask(node) -> bool:
    """Whether an input of attention beyond q, k and v is a mask the model built: not autopar's
    sliding-window or padding mask, nor a parameter (the sinks of autopar's attention)."""
    return node.target not in OWN_MASKS and node.param_fqn is None


def ulysses_error(layout: GraphLayout, cp: int) -> str | None:
    """Why the all-to-all form cannot split this layout's heads over `cp` ranks (None if it can):
    the query heads must divide; key/value heads that do not go repeated (`exchanged_kv`)."""
    for node in layout.nodes:
        if node.family == "attention" and node.attention:
            heads = node.attention["heads"]
            if heads % cp:
                return (f"all-to-all context parallelism splits heads over the cp ranks: "
                        f"{heads:g} heads per rank do not divide by cp={cp}: use "
                        f"cp_kind='ring', or a cp that divides them")
    return None


def exchanged_kv(sizes: AttentionBytes, cp: int) -> float:
    """The key and value bytes the all-to-all swaps: as the model computes them, each head
    repeated the fewest times that split over cp (`autopar.plans.head_split.kv_repeat`, the
    runtime's rule)."""
    return sizes.kv * kv_repeat(sizes.heads, sizes.kv_heads, cp)


def swapped_bytes(sizes: AttentionBytes, cp: int, dtype: str) -> tuple[float, float, float]:
    """What the all-to-all form swaps, per sample, as the runtime swaps it: queries, keys and
    values in fp32 (passes.context_attention computes on them in fp32 and casts them before
    the swap), the output in the training dtype `dtype` attention returns."""
    widen = 4 / DTYPE_BYTES[dtype]
    return sizes.query * widen, exchanged_kv(sizes, cp) * widen, sizes.output


def context_parallel_time(kind: str, group: Group, sizes: tuple[float, float, float],
                          samples: float, forward_s: float, backward_s: float) -> tuple[float, float]:
    """Seconds one attention op adds to its forward and its backward beyond their compute
    (`forward_s`, `backward_s`: the rank's 1/cp of the work, for `samples` sequences of the
    rank's share of the tokens) under context parallelism on `group` (module docstring)."""
    cp = group.size
    query, kv, output = (size * samples for size in sizes)
    if kind == ContextParallel.ALL_TO_ALL:
        # each a2a: the rank holds its share of a tensor and sends (cp-1)/cp of it
        swaps = sum(group.all_to_all(nbytes * cp) for nbytes in (query, kv, output))
        return swaps, swaps
    if kind != ContextParallel.RING:
        raise AutoparError(f"cp_kind={kind!r}: expected ring or all-to-all")
    link = group.levels[-1].link          # the ring's slowest hop bounds every step
    step = send_recv_time(kv, link)
    compute_f, compute_b = forward_s / cp, backward_s / cp
    forward = compute_f + (cp - 1) * max(compute_f, step)
    backward = compute_b + (cp - 1) * max(compute_b, 2 * step)
    return forward - forward_s, backward - backward_s
