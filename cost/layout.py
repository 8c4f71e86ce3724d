"""What each node of a captured graph costs one device under Megatron-style tensor parallelism.

The layout is inferred from the graph, not from a model formula, by the rule Megatron-LM applies
by hand: a matmul with a weight whose activation input is replicated is column-parallel (its
output sharded over the tensor-parallel group, its input's gradient all-reduced in the backward);
one whose input is sharded is row-parallel (its output partial, all-reduced in the forward). An
embedding looked up by the model's input ids is vocab-parallel (output all-reduced). Attention and
memory-bound ops follow their inputs: sharded if any input is. With sequence parallelism the
replicated region (norms, dropout, residual adds) is split over the sequence as well and its
all-reduces become reduce-scatter + all-gather pairs of the same ring cost.

Per node this module also answers what autograd keeps for the backward (`saved`), with views
resolved to the tensor that owns the storage, so that activation memory is the sum of distinct
saved tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.errors import AutoparError
from autopar.graph import Graph, Node, Role
from autopar.cost.compute import op_family
from autopar.cost.memory import sequence_dims

# Elementwise ops whose backward needs none of their inputs (gradients pass through or scale by a
# constant), so autograd saves nothing for them.
_SAVES_NOTHING = {"add", "sub", "neg", "clone", "_to_copy", "to", "copy", "contiguous", "cat",
                  "stack", "type_as", "fill", "zero", "masked_fill", "where", "rsub", "constant_pad_nd",
                  "pad", "repeat", "index", "slice_scatter", "select_scatter", "detach_", "tril", "triu"}
# Views that leave the tensor non-contiguous; a reshape after them copies.
_STRIDING = {"transpose", "permute", "t", "expand", "expand_as", "numpy_T", "mT", "mH", "adjoint",
              "swapaxes", "swapdims", "movedim"}
_DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
                "int16": 2, "int8": 1, "uint8": 1, "bool": 1}


def op_name(target: str) -> str:
    parts = target.split(".")
    return parts[1] if target.startswith("aten.") and len(parts) > 1 else parts[-1]


@dataclass(kw_only=True, slots=True)
class NodeLayout:
    """One node as one tensor-parallel rank sees it, for ONE sample of the batch."""
    name: str
    family: str
    sharded: bool              # output split over the tensor-parallel group
    requires_grad: bool
    flops: float               # forward flops on this rank
    act_bytes: float           # activation bytes read + written by the forward on this rank
    param_bytes: float         # parameter bytes read by the forward on this rank (per micro-batch)
    out_bytes: float           # this rank's share of the output, in the training dtype
    reduce_forward: float = 0.0    # bytes all-reduced over TP after the forward (full tensor)
    reduce_backward: float = 0.0   # bytes all-reduced over TP in the backward (input gradient)
    saved: tuple[str, ...] = ()    # storage owners kept for the backward
    attention: dict = field(default_factory=dict)   # q shape, k length, causal, dropout for sdpa
    gemm: tuple = ()               # a matmul with a weight: (output rows per sample, local columns)


@dataclass(kw_only=True, slots=True)
class GraphLayout:
    nodes: list[NodeLayout]            # compute nodes in graph order (views included, free)
    index: dict[str, int]              # graph node name -> position in Graph.nodes
    storage: dict[str, str]            # node -> the node that owns its storage (views resolved)
    storage_bytes: dict[str, float]    # storage owner -> bytes per sample on one rank
    param_local: dict[str, float]      # parameter node -> elements on one rank
    batch: int                         # the captured batch size
    seq_degree: dict[str, int] = field(default_factory=dict)   # storage owner -> power of the
                                       # sequence length in its size (memory.sequence_dims)
    dtype: str = "bfloat16"            # what floating activations and weights are computed in


def _itemsize(dtype: str, compute_dtype: str) -> int:
    """Floating tensors are held in the training dtype (mixed precision); integers as captured."""
    if dtype.startswith(("float", "bfloat")):
        return _DTYPE_BYTES[compute_dtype]
    return _DTYPE_BYTES.get(dtype, 4)


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


def infer_layout(graph: Graph, tp: int, *, sequence_parallel: bool = False,
                 compute_dtype: str = "bfloat16") -> GraphLayout:
    """Per-sample, per-rank costs of every node of `graph` under tensor parallelism of degree `tp`."""
    return _LayoutBuilder(graph, tp, sequence_parallel, compute_dtype).build()


class _LayoutBuilder:
    """One walk over the graph in topological order; each node's layout follows its inputs'."""

    def __init__(self, graph: Graph, tp: int, sequence_parallel: bool, compute_dtype: str):
        self.graph, self.tp, self.sp, self.dtype = graph, tp, sequence_parallel, compute_dtype
        self.batch = graph_batch(graph)
        self.by_name = {n.name: n for n in graph.nodes}
        self.sharded: dict[str, bool] = {}
        self.grad: dict[str, bool] = {}
        self.storage: dict[str, str] = {}          # node -> owner of its storage
        self.contiguous: dict[str, bool] = {}
        self.from_input: dict[str, bool] = {}      # derived from the model's inputs only (ids)
        self.storage_bytes: dict[str, float] = {}
        self.param_local: dict[str, float] = {}
        self.grad_reduced: set[str] = set()        # tensors whose gradient is all-reduced already
        self.weight_of: dict[str, str] = {}        # views and casts of a parameter -> it
        self.seq_dims = sequence_dims(graph, graph_sequence(graph))
        self.seq_degree: dict[str, int] = {}

    def build(self) -> GraphLayout:
        layouts = []
        for node in self.graph.nodes:
            if node.role in (Role.PARAMETER, Role.BUFFER, Role.INPUT) or node.target == "output":
                self._leaf(node)
            else:
                layouts.append(self._node(node))
        for node in self.graph.parameters:
            self.param_local.setdefault(node.name, _numel(node.shape))
        return GraphLayout(nodes=layouts, index={n.name: i for i, n in enumerate(self.graph.nodes)},
                           storage=self.storage, storage_bytes=self.storage_bytes,
                           param_local=self.param_local, batch=self.batch,
                           seq_degree=self.seq_degree, dtype=self.dtype)

    def full_bytes(self, node: Node) -> float:
        """Bytes of this node's whole output for one sample, in the training dtype."""
        return node.bytes / self.batch * _itemsize(node.dtype, self.dtype) / _DTYPE_BYTES.get(node.dtype, 4)

    def local_bytes(self, node: Node) -> float:
        """Bytes of this node's output on one rank for one sample."""
        split = self.sharded.get(node.name) or (self.sp and node.role is Role.ACTIVATION)
        return self.full_bytes(node) / self.tp if split else self.full_bytes(node)

    def _leaf(self, node: Node) -> None:
        self.sharded[node.name] = False
        self.grad[node.name] = node.role is Role.PARAMETER
        self.storage[node.name] = node.name
        self.contiguous[node.name] = True
        self.from_input[node.name] = node.role is Role.INPUT
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
        in_sharded = any(self.sharded[i] for i in acts)
        self.grad[node.name] = any(self.grad[i] for i in node.inputs)
        self.from_input[node.name] = bool(acts) and all(self.from_input[i] for i in acts) and not params
        layout = NodeLayout(name=node.name, family=family, sharded=in_sharded,
                            requires_grad=self.grad[node.name], flops=node.flops / self.batch,
                            act_bytes=0.0, param_bytes=0.0, out_bytes=0.0)
        parallel = self._tensor_parallel(node, family, params, acts, layout)
        if family == "matmul" and params and len(node.shape) >= 1:
            columns = node.shape[-1] / (self.tp if layout.sharded else 1)
            layout.gemm = (_numel(node.shape[:-1]) / self.batch, columns)
        for p in params:
            whole = _numel(by_name[p].shape)
            held = whole / self.tp if parallel else whole
            self.param_local[p] = min(self.param_local.get(p, whole), held)
        if family == "view" and in_sharded and name in ("view", "reshape", "_unsafe_view", "unflatten") \
                and not _splits_heads_evenly(self.tp, by_name[acts[0]].shape, node):
            # fewer key/value heads than tp (multi-query attention): as in Megatron, every rank
            # keeps them whole, gathered from the column-parallel projection
            layout.sharded = False
            layout.reduce_forward = self.full_bytes(node)
        self.sharded[node.name] = layout.sharded
        if parallel or layout.sharded or (self.sp and self.tp > 1):
            layout.flops /= self.tp
        _storage_of(node, name, family, self.storage, self.contiguous)
        degree = sum(self.seq_dims[node.name])
        if self.storage[node.name] == node.name:
            self.storage_bytes[node.name] = self.local_bytes(node)
            self.seq_degree[node.name] = degree
        layout.out_bytes = self.local_bytes(node)
        if family != "view" and not _is_noop(node, name):
            layout.act_bytes = layout.out_bytes + sum(self.local_bytes(by_name[i]) for i in acts)
            if family != "embedding":     # a lookup reads only the rows it returns
                layout.param_bytes = sum(self.param_local[p] * _DTYPE_BYTES[self.dtype] for p in params)
        if self.grad[node.name]:
            layout.saved = _saved(node, name, family, acts, self.storage)
            for key in layout.saved:
                if key.endswith(":mask"):     # one byte per element
                    self.storage_bytes[key] = layout.out_bytes / _itemsize(node.dtype, self.dtype)
                    self.seq_degree[key] = degree
        if family == "attention":
            layout.attention = _attention_info(node, by_name, self.batch, self.tp if in_sharded else 1)
            info = layout.attention     # the row-wise log-sum-exp, fp32
            info["q_seq"] = self.seq_dims[node.inputs[0]][-2]
            info["k_seq"] = self.seq_dims[node.inputs[1] if len(node.inputs) > 1 else node.inputs[0]][-2]
            self.storage_bytes[f"{node.name}:lse"] = info["heads"] * info["q_len"] * 4
            self.seq_degree[f"{node.name}:lse"] = info["q_seq"]
        return layout

    def _tensor_parallel(self, node: Node, family: str, params: list[str], acts: list[str],
                         layout: NodeLayout) -> bool:
        """Apply Megatron's rules to one node; True when its work is split over the tp ranks."""
        tp = self.tp
        if family == "matmul" and params and tp > 1:
            if layout.sharded:        # row-parallel: partial sums all-reduced after the forward
                layout.sharded = False
                layout.reduce_forward = self.full_bytes(node)
                return True
            # Column-parallel: the input's gradient is all-reduced in the backward, once however
            # many matmuls read that input (q, k and v).
            if (node.shape[-1] if node.shape else 1) % tp:
                return False          # too few output features to split (a router's gate): whole
            layout.sharded = True
            if acts and self.storage[acts[0]] not in self.grad_reduced:
                self.grad_reduced.add(self.storage[acts[0]])
                layout.reduce_backward = self.full_bytes(self.by_name[acts[0]])
            return True
        if family == "embedding" and params and tp > 1 and acts and all(self.from_input[i] for i in acts):
            layout.reduce_forward = self.full_bytes(node)      # vocab-parallel lookup of token ids
            return True
        if family == "attention" and tp > 1 and acts:
            # query heads are split over tp; key/value heads may be fewer (kept whole, above)
            shape = self.by_name[acts[0]].shape
            _check_divides(tp, shape[-3] if len(shape) >= 3 else 1, "heads", node)
        return family in ("matmul", "attention") and layout.sharded


def _check_divides(tp: int, size: int, what: str, node: Node) -> None:
    if size % tp:
        where = f" in {node.module_path}" if node.module_path else ""
        raise AutoparError(f"tp={tp} does not divide the {size} {what} of {node.name}{where}; "
                           f"choose a tensor-parallel degree that divides {size}")


def _splits_heads_evenly(tp: int, source: tuple, node: Node) -> bool:
    """A sharded feature dim reshaped into (heads, head_dim) shards the heads: whether tp divides
    them (grouped-query attention's key/value heads included)."""
    if not source or len(node.shape) < 2:
        return True
    features, product = source[-1], 1
    for k in range(len(node.shape) - 1, -1, -1):
        product *= node.shape[k]
        if product == features and k < len(node.shape) - 1:
            return node.shape[k] % tp == 0
        if product > features:
            return True
    return True


def _numel(shape) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _is_noop(node: Node, name: str) -> bool:
    """Dropout with p=0 or in eval returns its input untouched."""
    if name in ("dropout", "native_dropout", "feature_dropout", "alpha_dropout"):
        p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
        return p == 0 or not train
    return False


# Flash attention kernels (CUDA's and CPU's) write their output as [batch, seq, heads, dim] and
# return it as [batch, heads, seq, dim]: the transpose that merges the heads back is contiguous,
# so the reshape after it is a view, not a copy.
_HEADS_TRANSPOSED = "heads transposed"


def _storage_of(node: Node, name: str, family: str, storage: dict, contiguous: dict) -> None:
    """Which node owns `node`'s storage, and whether that view of it is contiguous (True,
    False, or `_HEADS_TRANSPOSED`: contiguous once heads and sequence are swapped back)."""
    source = node.inputs[0] if node.inputs else None
    if source is not None and (family == "view" or _is_noop(node, name)):
        copies = name in ("reshape", "flatten", "unflatten") and contiguous[source] is not True
        if not copies:
            storage[node.name] = storage[source]
            layout = contiguous[source]
            if name == "transpose" and layout == _HEADS_TRANSPOSED:
                contiguous[node.name] = sorted(node.args[1:3]) in ([1, 2], [-3, -2])
            else:
                contiguous[node.name] = layout is True and name not in _STRIDING
            return
    storage[node.name] = node.name
    contiguous[node.name] = _HEADS_TRANSPOSED if family == "attention" else True


def saves_for_backward(target: str) -> tuple[bool, bool]:
    """(keeps its activation inputs, keeps its output) for the backward, by op: the rule `_saved`
    applies to each node, for callers that price an op without its node (the sharding ILP).
    A dropout's one-byte mask and an op's scaling by a constant depend on the node's arguments
    and are left to `_saved`."""
    family, name = op_family(target), op_name(target)
    if family in ("view", "reduction") or name in _SAVES_NOTHING or "dropout" in name:
        return False, False
    if family == "softmax":
        return False, True
    return True, family == "attention"


def _saved(node: Node, name: str, family: str, acts: list[str], storage: dict) -> tuple[str, ...]:
    """Storage owners that autograd keeps for this node's backward (activations only: parameters
    are counted as model state)."""
    if family in ("view", "reduction") or _is_noop(node, name):
        return ()
    if family == "elementwise":
        if name in _SAVES_NOTHING:
            return ()
        if name in ("dropout", "native_dropout"):
            return (f"{node.name}:mask",)
        if name in ("mul", "div") and len(acts) == 1:
            return ()                                   # scaled by a parameter-free constant
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
    heads = _numel(query[:-2]) / batch / split        # batch x heads per sample on this rank
    return {"heads": heads, "q_len": query[-2], "k_len": key[-2], "head_dim": query[-1],
            "causal": causal, "dropout": float(dropout)}
