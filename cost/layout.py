"""What each node of a captured graph costs one device on a tensor-parallel axis of given
placements. Placements (`TensorPlacements`: each node's output and each parameter's storage on the
tensor-parallel axis) come from a producer: the sharding ILP's (autopar's plans, forced or free)
or Megatron-LM's layout (autopar.cost.megatron, for published runs). Each op runs the strategy of
its rule that writes its planned output and reads its producers with the least traffic (the
choice the ILP made: with every output fixed, an op's inputs are a local choice), its work split
when any of its tensors is sharded, and the collectives come from the placement changes along its
input edges (`autopar.cost.reshard`, the ILP's own facts); a value's gradient is redistributed once
for all its readers, as autograd sums it first. Without a tensor-parallel axis every op runs whole.
Per node this module also answers what autograd keeps for the backward (`saved`), with views
resolved to the tensor that owns the storage: activation memory is the sum of distinct ones.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from autopar.errors import AutoparError
from autopar.graph import Graph, Node, Role
from autopar.cost.compute import op_family
from autopar.cost.sequence_dims import sequence_dims
from autopar.cost.storage import copies, is_noop, sixteen_bit_copy, storage_of
from autopar.plans.placements import shard_dim
from autopar.plans.vocabulary import DTYPE_BYTES
from autopar.cost.reshard import (cheapest_inputs, gradient_given, gradient_need,
                                  reshard_steps, work_split, written_as_computed)

# Elementwise ops whose backward needs none of their inputs (gradients pass through or scale by a
# constant), so autograd saves nothing for them.
_SAVES_NOTHING = {"add", "sub", "neg", "clone", "_to_copy", "to", "copy", "contiguous", "cat",
                  "stack", "type_as", "fill", "zero", "masked_fill", "where", "rsub", "constant_pad_nd",
                  "pad", "repeat", "index", "slice_scatter", "select_scatter", "detach", "tril", "triu"}
# Inputs (by position) that an op reads for their dtype or shape alone: they get no gradient.
TAKES_NO_GRADIENT = {"type_as": (1,), "expand_as": (1,), "view_as": (1,), "reshape_as": (1,)}
# Elementwise ops whose backward reads their result, not their input (sigmoid_backward,
# tanh_backward, threshold_backward of relu; exp, sqrt and rsqrt from their result).
_SAVES_OUTPUT = {"sigmoid", "tanh", "relu", "exp", "sqrt", "rsqrt"}


def op_name(target: str) -> str:
    """The op's name, an in-place variant's as its out-of-place op's ("add_" -> "add"): autograd
    keeps the same for both."""
    parts = target.split(".")
    name = parts[1] if target.startswith(("aten.", "autopar.")) and len(parts) > 1 else parts[-1]
    return name.rstrip("_") if name.endswith("_") and not name.startswith("_") else name


@dataclass(kw_only=True, slots=True)
class NodeLayout:
    """One node as one tensor-parallel rank sees it, for ONE sample of the batch."""
    name: str
    family: str
    sharded: bool              # output split over the tensor-parallel group
    placement: str = "R"       # its output's placement on the tensor-parallel axis ("S(1)", ...)
    requires_grad: bool
    flops: float               # forward flops on this rank
    act_bytes: float           # activation bytes read + written by the forward on this rank
    param_bytes: float         # parameter bytes read by the forward on this rank (per micro-batch)
    out_bytes: float           # this rank's share of the output, in the training dtype
    # Collectives over the tp group in the forward and backward: (kind, bytes of the whole
    # tensor, per sample: activations' are, parameters' are per micro-batch)
    comm_forward: tuple = ()
    comm_backward: tuple = ()
    # The value each forward collective moves, where the runtime moves it once after the op that
    # makes it (passes.tensor_parallel.share_redistributions: an activation), "" at the op itself
    forward_from: tuple = ()
    # Reductions of weight gradients tp leaves partial (a norm's under sequence parallelism), fp32
    # bytes: FSDP2's or the runtime's after the backward (plans.zero.partial_gradient_reductions)
    comm_step: tuple = ()
    saved: tuple[str, ...] = ()    # storage owners kept for the backward
    attention: dict = field(default_factory=dict)   # q shape, k length, causal, dropout for sdpa
    gemm: tuple = ()               # a matmul with a weight: (output rows per sample, local columns),
                                   # and for grouped matmuls the GEMMs run together (cost/experts.py)
    expert: bool = False           # runs on a mixture-of-experts layer's rows (cost/experts.py)
    routing_counts: int = 0        # experts whose row counts (int64) a dispatch exchanges first
    exchange_bytes: float = 0.0    # per sample sent into an expert all-to-all, forward and backward
    backward_bytes: float = 0.0    # its backward's beyond the gradients (ring attention's), per sample
    weight_gathered: float = 0.0   # elements of the tensor-parallel-split weights it reads whole:
                                   # gathered for its forward and again for its backward, which
                                   # also makes their whole gradient (an op run replicated)
    weight_gathering: float = 0.0  # elements alive at the fullest of those gathers (`_gathering`)


@dataclass(kw_only=True, slots=True, eq=False)
class TensorPlacements:
    """Placements on the tensor-parallel axis: graph node name -> its output's ("R", "P", "S(d)"),
    parameter node name -> how it is stored. Equal (and hashed alike) when the placements are, so
    that a plan priced again finds what the search that made it priced in a shared cache."""
    nodes: dict[str, str]
    parameters: dict[str, str]
    key: int = 0

    def __post_init__(self):
        self.key = hash((tuple(sorted(self.nodes.items())), tuple(sorted(self.parameters.items()))))

    def __eq__(self, other) -> bool:
        return (isinstance(other, TensorPlacements) and self.key == other.key
                and self.nodes == other.nodes and self.parameters == other.parameters)

    def __hash__(self) -> int:
        return self.key


@dataclass(kw_only=True, slots=True)
class GraphLayout:
    nodes: list[NodeLayout]            # compute nodes in graph order (views included, free)
    index: dict[str, int]              # graph node name -> position in Graph.nodes
    storage: dict[str, str]            # node -> the node that owns its storage (views resolved)
    storage_bytes: dict[str, float]    # storage owner -> bytes per sample on one rank
    param_local: dict[str, float]      # parameter node -> elements on one rank
    batch: int                         # the captured batch size
    seq_degree: dict[str, int] = field(default_factory=dict)   # storage owner -> power of the
                                       # sequence length in its size (cost/sequence_dims.py)
    dtype: str = "bfloat16"            # what floating activations and weights are computed in
    wide: dict = field(default_factory=dict)   # node -> dtype: values held wider (element_bytes)
    distributed: bool = False          # its values are DTensors (tp > 1), which autograd sums out of place
    gradient_facts: dict = field(default_factory=dict, init=False, compare=False, repr=False)


def element_bytes(node: Node, compute_dtype: str, wide: dict | None = None) -> int:
    """Floating values in the training dtype, save those mixed precision holds wider (`wide`: node
    -> dtype, autopar.mixed_dtypes); integers as captured."""
    if node.dtype.startswith(("float", "bfloat")):
        return DTYPE_BYTES[(wide or {}).get(node.name, compute_dtype)]
    return DTYPE_BYTES.get(node.dtype, 4)


def whole_bytes(node: Node, batch: int, compute_dtype: str, wide: dict | None = None) -> float:
    """Bytes of a node's whole output for one sample (of `batch` captured), as element_bytes."""
    return node.bytes / batch * element_bytes(node, compute_dtype, wide) / DTYPE_BYTES.get(node.dtype, 4)


def graph_batch(graph: Graph) -> int:
    """The batch the graph was captured with: the leading size of its first input tensor."""
    for node in graph.nodes:
        if node.role is Role.INPUT and node.shape:
            return node.shape[0]
    return 1


def graph_sequence(graph: Graph) -> int:
    """The sequence length the graph was captured with: dim 1 of its first input when that input
    holds token ids; 0 for a model without one."""
    for node in graph.nodes:
        if node.role is Role.INPUT:
            integer = node.dtype.startswith(("int", "uint"))
            return node.shape[1] if integer and len(node.shape) >= 2 else 0
    return 0


def infer_layout(graph: Graph, tp: int, *, compute_dtype: str = "bfloat16",
                 placements: TensorPlacements | None = None, wide: tuple = ({}, {}, {})) -> GraphLayout:
    """Per-sample, per-rank costs of every node of `graph` on `placements` over a tp axis of `tp`
    devices (which say what is split on the sequence too); tp = 1: every node whole. `wide`: the
    values mixed precision holds wider, those whose gradients are, and the ops autocast runs in 16
    bits on wide inputs (autopar.mixed_dtypes)."""
    if tp > 1 and placements is None:
        raise AutoparError(f"tensor parallelism (tp={tp}) is priced on placements: give the "
                           f"sharding ILP's (autopar.plan_from_config, as compile runs a Config) or "
                           f"Megatron-LM's (autopar.cost.megatron.megatron_placements)")
    return _LayoutBuilder(graph, tp, compute_dtype, placements if tp > 1 else None, wide).build()


class _LayoutBuilder:
    """One walk over the graph in topological order; each node's layout follows its inputs'."""

    def __init__(self, graph: Graph, tp: int, compute_dtype: str,
                 placements: TensorPlacements | None = None, wide: tuple = ({}, {}, {})):
        self.graph, self.tp, self.dtype = graph, tp, compute_dtype
        self.wide, self.wide_gradients, self.cast_reads = wide
        self.placements = placements
        self.place: dict[str, str] = {}            # node -> its placement (placements given)
        self.moved: set[tuple] = set()             # redistributions already priced, by storage
        self.read_as: dict[str, str] = {}          # this node's inputs' storage -> what it reads
        self.batch = graph_batch(graph)
        self.by_name = {n.name: n for n in graph.nodes}
        self.sharded: dict[str, bool] = {}
        self.grad: dict[str, bool] = {}
        self.storage: dict[str, str] = {}          # node -> owner of its storage
        self.contiguous: dict[str, bool] = {}
        self.storage_bytes: dict[str, float] = {}
        self.param_local: dict[str, float] = {}
        self.weight_of: dict[str, str] = {}        # views and casts of a parameter -> it
        self.from_parameters: set[str] = set()     # values computed from parameters alone
        self.seq_dims = sequence_dims(graph, graph_sequence(graph))
        self.seq_degree: dict[str, int] = {}

    def build(self) -> GraphLayout:
        layouts = []
        for node in self.graph.nodes:
            if node.role in (Role.PARAMETER, Role.BUFFER, Role.INPUT) or node.target == "output":
                self._leaf(node)
                if self.placements is not None and node.target == "output":
                    layouts.append(self._output(node))
            else:
                layouts.append(self._node(node))
        for node in self.graph.parameters:
            self.param_local.setdefault(node.name, math.prod(node.shape))
        return GraphLayout(nodes=layouts, index={n.name: i for i, n in enumerate(self.graph.nodes)},
                           storage=self.storage, storage_bytes=self.storage_bytes,
                           param_local=self.param_local, batch=self.batch,
                           seq_degree=self.seq_degree, dtype=self.dtype, wide=self.wide,
                           distributed=self.tp > 1)

    def full_bytes(self, node: Node) -> float:
        return whole_bytes(node, self.batch, self.dtype, self.wide)

    def local_bytes(self, node: Node) -> float:
        """Bytes of this node's output on one rank for one sample."""
        return self.full_bytes(node) / self.tp if self.sharded.get(node.name) else self.full_bytes(node)

    def _leaf(self, node: Node) -> None:
        if self.placements is not None:
            table = self.placements.parameters if node.role is Role.PARAMETER else self.placements.nodes
            self.place[node.name] = table.get(node.name, "R")
        if node.role is Role.PARAMETER:      # held as stored
            split = self.tp if self.place.get(node.name, "R").startswith("S") else 1
            self.param_local[node.name] = math.prod(node.shape) / split
        self.sharded[node.name] = self.place.get(node.name, "R").startswith("S")
        self.grad[node.name] = node.role is Role.PARAMETER
        self.storage[node.name] = node.name
        self.contiguous[node.name] = True
        if node.role is Role.INPUT:       # kept when a first op saves it (a matmul's input)
            self.storage_bytes[node.name] = self.local_bytes(node)
            self.seq_degree[node.name] = sum(self.seq_dims[node.name])

    def _node(self, node: Node) -> NodeLayout:
        family, name, by_name = op_family(node.target), op_name(node.target), self.by_name
        params = [self.weight_of.get(i, i) for i in node.inputs
                  if by_name[i].role is Role.PARAMETER or i in self.weight_of]
        acts = [i for i in node.inputs if by_name[i].role not in (Role.PARAMETER, Role.BUFFER)
                and i not in self.weight_of]
        if len(node.inputs) == 1 and params and (family == "view" or name in ("_to_copy", "to")):
            self.weight_of[node.name] = params[0]   # w.t(), w.to(bf16): still the weight
        elif node.inputs and all(by_name[i].role is Role.PARAMETER or i in self.weight_of
                                 or i in self.from_parameters for i in node.inputs):
            self.from_parameters.add(node.name)
        in_sharded = any(self.sharded[i] for i in acts)
        self.grad[node.name] = any(self.grad[i] for i in node.inputs)
        layout = NodeLayout(name=node.name, family=family, sharded=False,
                            requires_grad=self.grad[node.name], flops=node.flops / self.batch,
                            act_bytes=0.0, param_bytes=0.0, out_bytes=0.0)
        parallel = self._placed(node, layout) if self.placements is not None else False
        if parallel or layout.sharded:
            layout.flops /= self.tp
        if family == "matmul" and params and len(node.shape) >= 1:
            columns = node.shape[-1] / (self.tp if layout.sharded else 1)
            layout.gemm = (math.prod(node.shape[:-1]) / self.batch, columns)
        self.sharded[node.name] = layout.sharded
        storage_of(node, name, family, self.storage, self.contiguous,
                   tuple(by_name[node.inputs[0]].shape) if node.inputs else None)
        degree = sum(self.seq_dims[node.name])
        if self.storage[node.name] == node.name:
            self.storage_bytes[node.name] = self.local_bytes(node)
            self.seq_degree[node.name] = degree
        layout.out_bytes = self.local_bytes(node)
        if family != "view" and not is_noop(node, name):
            layout.act_bytes = layout.out_bytes + sum(self.local_bytes(by_name[i]) for i in acts)
            if family != "embedding":     # a lookup reads only the rows it returns
                layout.param_bytes = sum(self.param_local[p] * DTYPE_BYTES[self.dtype] for p in params)
        if self.grad[node.name]:
            self._saved(node, name, family, acts, layout, degree)
        if family == "attention":
            self._attention(node, layout, in_sharded)
        return layout

    def _saved(self, node: Node, name: str, family: str, acts: list[str], layout: NodeLayout,
               degree: int) -> None:
        """What autograd keeps for the node's backward: the storage it reads, as it reads it (a
        redistributed copy where it reads one), and a dropout's one-byte mask. A lookup's
        backward needs its indices, not the table (or activation) it reads."""
        if family == "embedding":
            acts = [i for i in acts if not node_differentiable(self.by_name[i])]
        if name == "mul" and len(node.inputs) == 2:
            # a product keeps each factor for the other's gradient: q * cos (no gradient) keeps cos, not q
            first, second = node.inputs
            acts = [i for i in acts if self.grad[second if i == first else first]]
        # a buffer read as it is (a rotary table's slice) is model state, not an activation
        kept = [self.read_as.get(key, key) for key in _saved(node, name, family, acts, self.storage)
                if key not in self.by_name or self.by_name[key].role not in (Role.PARAMETER, Role.BUFFER)]
        layout.saved = tuple(self._as_kept(node.name, key) for key in kept)
        for key in layout.saved:
            if key.endswith(":mask"):     # one byte per element
                self.storage_bytes[key] = layout.out_bytes / element_bytes(node, self.dtype, self.wide)
                self.seq_degree[key] = degree

    def _as_kept(self, reader: str, key: str) -> str:
        """Storage `key` as op `reader` keeps it: autocast's 16-bit copy where it cast it (mixed_dtypes)."""
        if key not in {self.read_as.get(k, k) for k in map(self.storage.get, self.cast_reads.get(reader, ()))}:
            return key
        wide = element_bytes(self.by_name[key.partition("@")[0]], self.dtype, self.wide)
        return sixteen_bit_copy(key, reader, self.storage_bytes, self.seq_degree, DTYPE_BYTES[self.dtype] / wide)

    def _attention(self, node: Node, layout: NodeLayout, in_sharded: bool) -> None:
        layout.attention = _attention_info(node, self.by_name, self.batch, self.tp if in_sharded else 1)
        info = layout.attention     # the row-wise log-sum-exp, fp32
        info["q_seq"] = self.seq_dims[node.inputs[0]][-2]
        info["k_seq"] = self.seq_dims[node.inputs[1] if len(node.inputs) > 1 else node.inputs[0]][-2]
        self.storage_bytes[f"{node.name}:lse"] = info["heads"] * info["q_len"] * 4
        self.seq_degree[f"{node.name}:lse"] = info["q_seq"]

    def _placed(self, node: Node, layout: NodeLayout) -> bool:
        """The plan's placements for one node: the strategy of its rule that writes its planned
        output and reads its producers with the least traffic; the collectives of the placement
        changes on its input edges; True when its work is split."""
        sources, strategies = [self.place[name] for name in node.inputs], self._strategies(node)
        if node.inputs and copies(op_name(node.target), self.contiguous[node.inputs[0]]):
            strategies = [(out, ins) for out, ins in strategies if out != "P"]     # DTensor reduces first
        out = written_as_computed(self.placements.nodes.get(node.name, "R"), sources, strategies)
        options = [ins for written, ins in strategies if written == out]
        # an output no rule writes (an op without a rule, planned replicated) is computed whole;
        # R -> S and R -> P are local, so it is then placed as planned for free
        inputs = cheapest_inputs(out, sources, options, [self.by_name[name].bytes for name in node.inputs],
                                 self.tp)
        self.place[node.name] = out
        layout.sharded, layout.placement = out.startswith("S"), out
        forward, backward, step, origins = [], [], [], []
        self.read_as = {}
        for k, name in enumerate(node.inputs):
            whole, per_sample, value, widen = self._edge_bytes(name, node)
            moves = reshard_steps((sources[k],), (inputs[k],), [self.tp]) or []
            widen = 1.0 if moves else widen     # reduced where it is made, not moved back as read
            if moves and value:
                self._read_redistributed(name, inputs[k])
            moved = (name if value else self.storage[name]) if self.by_name[name].dtype else node.name  # one per piece
            if moves and self._first((moved, sources[k], inputs[k])):
                forward += [(kind, whole / divisor, per_sample) for kind, _, divisor in moves]
                origins += [name if value else ""] * len(moves)
                if not value:    # a gathered weight is freed, and gathered again for the backward
                    backward += [(kind, whole / divisor, per_sample) for kind, _, divisor in moves]
            if moves and not value and inputs[k] == "R":
                elements = math.prod(self.by_name[self.weight_of.get(name, name)].shape)
                gathering = _gathering(sources[k], self.contiguous[name] is True, self.tp)
                layout.weight_gathering = max(layout.weight_gathering,
                                              layout.weight_gathered + gathering * elements)
                layout.weight_gathered += elements
            if not (self.grad[name] and node_differentiable(self.by_name[name])) \
                    or k in TAKES_NO_GRADIENT.get(op_name(node.target), ()):
                continue
            given = gradient_given((out,), [(p,) for p in inputs], k)
            need = gradient_need((sources[k],))
            moves = reshard_steps(given, need, [self.tp]) or []
            piece = name if self.by_name[name].dtype else node.name     # a tuple's: per piece
            if not (moves and self._first((piece, given, need, "gradient"))):
                continue
            if value:
                backward += [(kind, whole * widen / divisor, per_sample) for kind, _, divisor in moves]
            else:       # a weight's gradient, reduced in the dtype the weight is held in
                whole = self.by_name[self.weight_of.get(name, name)].bytes
                step += [(kind, whole / divisor, False) for kind, _, divisor in moves]
        if out == "P" and op_family(node.target) == "embedding":
            # a lookup in a table split on the vocabulary: the runtime reduces its masked partial
            # sums to whole right away (autopar.passes.dtensor_adapters.SettledLookup), which its
            # readers then take as they read them without moving anything (R -> S, R -> P)
            forward.append(("all_reduce", self.full_bytes(node), True))
            origins.append("")
            self.place[node.name] = "R"
        layout.comm_forward, layout.comm_backward = tuple(forward), tuple(backward)
        layout.forward_from = tuple(origins)
        layout.comm_step = tuple(step)
        return work_split((out,), [(p,) for p in inputs], [self.tp]) > 1

    def _read_redistributed(self, name: str, placement: str) -> None:
        """The runtime redistributes an activation read in another placement once per placement
        (autopar.passes.tensor_parallel.share_redistributions) and its readers keep that copy
        for their backward, not the producer's: its own storage, at the read placement's size."""
        key = f"{self.storage[name]}@{placement}"
        self.read_as[self.storage[name]] = key
        if key not in self.storage_bytes:
            whole = self.full_bytes(self.by_name[name])
            self.storage_bytes[key] = whole / self.tp if placement.startswith("S") else whole
            self.seq_degree[key] = self.seq_degree.get(self.storage[name], 0)

    def _output(self, node: Node) -> NodeLayout:
        """The graph's outputs leave the program replicated (the loss reads whole logits)."""
        layout = NodeLayout(name=node.name, family="view", sharded=False, flops=0.0, act_bytes=0.0,
                            requires_grad=any(self.grad[name] for name in node.inputs),
                            param_bytes=0.0, out_bytes=0.0)
        self._placed(node, layout)
        return layout

    def _strategies(self, node: Node) -> list[tuple[str, tuple[str, ...]]]:
        return strategy_strings(node, self.by_name)

    def _edge_bytes(self, name: str, consumer: Node) -> tuple[float, bool, bool, float]:
        """Bytes of an input (of a multi-output producer, the piece read), whole; whether per
        sample; whether a value computed (moved as an activation, each micro-batch; Gemma's 1 + w,
        at its own size) rather than a parameter, view, cast or buffer; its gradient's element
        over its own (one handed to another unit in 16 bits, made in fp32: mixed_dtypes)."""
        node = self.by_name[name] if self.by_name[name].dtype else consumer
        element = element_bytes(node, self.dtype, self.wide)
        held, widen = node.bytes * element / DTYPE_BYTES.get(node.dtype, 4), \
            element_bytes(node, self.dtype, self.wide_gradients) / element
        state = node.role is not Role.ACTIVATION or name in self.weight_of
        if state or name in self.from_parameters:
            return held, False, not state, widen
        return self.full_bytes(node), True, True, widen

    def _first(self, key: tuple) -> bool:
        """Whether this redistribution of a stored tensor is priced for the first time."""
        if key in self.moved:
            return False
        self.moved.add(key)
        return True


def strategy_strings(node: Node, by_name: dict[str, Node],
                     tp: int | None = None) -> list[tuple[str, tuple[str, ...]]]:
    """The strategies of `node`'s sharding rule on one axis, as (output, inputs) placement
    strings, replicate-everything first (none for an op without a rule); with `tp`, only those
    whose split dims `tp` devices divide evenly."""
    from autopar.cost.strategies import OpView     # torch's placements: only for placed layouts

    view = OpView(target=node.target, args=node.args, output_shape=node.shape,
                  input_shapes=tuple(by_name[name].shape for name in node.inputs))
    try:
        found = _view_strategies(view, tp)
    except TypeError:         # arguments that do not hash (a list of tensors' sizes)
        found = _view_strategies.__wrapped__(view, tp)
    return found


@functools.lru_cache(maxsize=None)
def _view_strategies(view, tp: int | None) -> list[tuple[str, tuple[str, ...]]]:
    """Shared by every op of the same view (repeated blocks) and every layout of a process."""
    from autopar.cost.strategies import axis_strategies, combine, placement_str

    strategies = axis_strategies(view) or []
    if tp is not None:
        strategies = [combo[0] for combo in combine([strategies], [tp], view.output_shape,
                                                    view.input_shapes)]
    return [(placement_str(s.output), tuple(placement_str(p) for p in s.inputs)) for s in strategies]


def node_differentiable(node: Node) -> bool:
    return node.dtype.startswith(("float", "bfloat")) or node.dtype == ""


def _gathering(source: str, contiguous: bool, tp: int) -> float:
    """Whole copies alive at once while DTensor gathers a tensor split as `source`: the
    all-gather's output; before it a dense copy of a strided local shard (a transposed weight's);
    after it, where the split dim is not the first, the concatenation of its chunks (the output
    is stacked on the first dim), until the output is freed."""
    split_dim = shard_dim(source)
    if split_dim is None:
        return 1.0
    dense_copy = 0.0 if contiguous else 1.0 / tp
    return 1.0 + dense_copy + (1.0 if split_dim != 0 else 0.0)


def saves_for_backward(target: str) -> tuple[bool, bool]:
    """(keeps its activation inputs, keeps its output) for the backward, by op: the rule `_saved`
    applies to each node, for callers that price an op without its node (the sharding ILP).
    A dropout's one-byte mask and an op's scaling by a constant depend on the node's arguments
    and are left to `_saved`."""
    family, name = op_family(target), op_name(target)
    if family in ("view", "reduction") or name in _SAVES_NOTHING or "dropout" in name:
        return False, False
    if family == "softmax" or family == "elementwise" and name in _SAVES_OUTPUT:
        return False, True
    return True, family == "attention"


def _saved(node: Node, name: str, family: str, acts: list[str], storage: dict) -> tuple[str, ...]:
    """Storage owners that autograd keeps for this node's backward (activations only: parameters
    are counted as model state)."""
    if family in ("view", "reduction") or is_noop(node, name):
        return ()
    if family == "elementwise":
        if name in _SAVES_NOTHING:
            return ()
        if name in ("dropout", "native_dropout"):
            return (f"{node.name}:mask",)
        if name in ("mul", "div") and len(node.inputs) == 1:
            return ()                                   # scaled by a number
        if name in _SAVES_OUTPUT:
            return (storage[node.name],)
    if family == "softmax":
        return (storage[node.name],)
    if family == "attention":
        return tuple(storage[i] for i in acts[:3]) + (storage[node.name], f"{node.name}:lse")
    if family == "embedding":
        return tuple(storage[i] for i in acts)         # the indices
    return tuple(storage[i] for i in acts)


def _attention_info(node: Node, by_name: dict, batch: int, split: int) -> dict:
    query = by_name[node.inputs[0]].shape
    key = by_name[node.inputs[1]].shape if len(node.inputs) > 1 else query
    args = list(node.args) + [None] * 6
    dropout = node.kwargs.get("dropout_p", args[4]) or 0.0
    causal = bool(node.kwargs.get("is_causal", args[5]) or False)
    heads = math.prod(query[:-2]) / batch / split        # batch x heads per sample on this rank
    # grouped-query attention passes fewer key/value heads (enable_gqa)
    kv_heads = heads * math.prod(key[:-2]) / math.prod(query[:-2])
    return {"heads": heads, "kv_heads": kv_heads, "q_len": query[-2], "k_len": key[-2],
            "head_dim": query[-1], "causal": causal, "dropout": float(dropout),
            "recomputes_scores": node.target.startswith("autopar.attention")}
