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

# Elementwise ops whose backward needs none of their inputs (gradients pass through or scale by a
# constant), so autograd saves nothing for them.
_SAVES_NOTHING = {"add", "sub", "neg", "clone", "_to_copy", "to", "copy", "contiguous", "cat",
                  "stack", "type_as", "fill", "zero", "masked_fill", "where", "rsub", "constant_pad_nd",
                  "pad", "repeat", "index", "slice_scatter", "select_scatter", "detach_", "tril", "triu"}
# Views that leave the tensor non-contiguous; a reshape after them copies.
_STRIDING = {"transpose", "permute", "t", "expand", "expand_as"}
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


@dataclass(kw_only=True, slots=True)
class GraphLayout:
    nodes: list[NodeLayout]            # compute nodes in graph order (views included, free)
    index: dict[str, int]              # graph node name -> position in Graph.nodes
    storage: dict[str, str]            # node -> the node that owns its storage (views resolved)
    storage_bytes: dict[str, float]    # storage owner -> bytes per sample on one rank
    param_local: dict[str, float]      # parameter node -> elements on one rank
    batch: int                         # the captured batch size


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


def infer_layout(graph: Graph, tp: int, *, sequence_parallel: bool = False,
                 compute_dtype: str = "bfloat16") -> GraphLayout:
    """Per-sample, per-rank costs of every node of `graph` under tensor parallelism of degree `tp`."""
    batch = graph_batch(graph)
    by_name = {n.name: n for n in graph.nodes}
    index = {n.name: i for i, n in enumerate(graph.nodes)}
    sharded: dict[str, bool] = {}
    grad: dict[str, bool] = {}
    storage: dict[str, str] = {}          # node -> owner of its storage
    contiguous: dict[str, bool] = {}
    from_input: dict[str, bool] = {}      # derived from the model's inputs only (ids, masks)
    storage_bytes: dict[str, float] = {}
    param_local: dict[str, float] = {}
    layouts: list[NodeLayout] = []
    grad_reduced: set[str] = set()       # inputs whose gradient is already all-reduced once
    weight_of: dict[str, str] = {}       # views and casts of a parameter -> that parameter

    def full_bytes(node: Node) -> float:
        """Bytes of this node's whole output for one sample, in the training dtype."""
        size = node.bytes / batch
        return size * _itemsize(node.dtype, compute_dtype) / _DTYPE_BYTES.get(node.dtype, 4)

    def local_bytes(node: Node) -> float:
        """Bytes of this node's output on one rank for one sample."""
        size = node.bytes / batch if node.shape and node.role is not Role.PARAMETER else node.bytes
        if node.dtype:
            size = size * _itemsize(node.dtype, compute_dtype) / _DTYPE_BYTES.get(node.dtype, 4)
        split = sharded.get(node.name) or (sequence_parallel and node.role is Role.ACTIVATION)
        return size / tp if split else size

    for node in graph.nodes:
        if node.role in (Role.PARAMETER, Role.BUFFER, Role.INPUT) or node.target == "output":
            sharded[node.name] = False
            grad[node.name] = node.role is Role.PARAMETER
            storage[node.name] = node.name
            contiguous[node.name] = True
            from_input[node.name] = node.role is Role.INPUT
            if node.role is Role.INPUT:       # kept when a first op saves it (a matmul's input)
                storage_bytes[node.name] = local_bytes(node)
            continue
        family = op_family(node.target)
        name = op_name(node.target)
        params = [weight_of.get(i, i) for i in node.inputs
                  if by_name[i].role is Role.PARAMETER or i in weight_of]
        acts = [i for i in node.inputs if by_name[i].role not in (Role.PARAMETER, Role.BUFFER)
                and i not in weight_of]
        if len(node.inputs) == 1 and params and (family == "view" or name in ("_to_copy", "to")):
            weight_of[node.name] = params[0]   # w.t(), w.to(bf16): still the weight
        in_sharded = any(sharded[i] for i in acts)
        grad[node.name] = any(grad[i] for i in node.inputs)
        from_input[node.name] = bool(acts) and all(from_input[i] for i in acts) and not params
        layout = NodeLayout(name=node.name, family=family, sharded=in_sharded,
                            requires_grad=grad[node.name], flops=node.flops / batch,
                            act_bytes=0.0, param_bytes=0.0, out_bytes=0.0)
        parallel = False
        if family == "matmul" and params and tp > 1:
            parallel = True
            if in_sharded:            # row-parallel: partial sums all-reduced after the forward
                layout.sharded = False
                layout.reduce_forward = full_bytes(node)
            else:                     # column-parallel: the input's gradient is all-reduced,
                layout.sharded = True     # once however many matmuls read that input (q, k, v)
                _check_divides(tp, node.shape[-1] if node.shape else 1, "output features", node)
                if acts and storage[acts[0]] not in grad_reduced:
                    grad_reduced.add(storage[acts[0]])
                    layout.reduce_backward = full_bytes(by_name[acts[0]])
        elif family == "embedding" and params and tp > 1 and acts and all(from_input[i] for i in acts):
            parallel = True           # vocab-parallel lookup of token ids
            layout.reduce_forward = full_bytes(node)
        elif family in ("matmul", "attention") and in_sharded:
            parallel = True
            if family == "attention":
                for i in acts[:3]:
                    shape = by_name[i].shape
                    _check_divides(tp, shape[-3] if len(shape) >= 3 else 1, "attention heads", node)
        for p in params:
            if parallel:
                param_local[p] = min(param_local.get(p, float("inf")), _numel(by_name[p].shape) / tp)
            else:
                param_local.setdefault(p, _numel(by_name[p].shape))
        if family == "view" and in_sharded and name in ("view", "reshape", "_unsafe_view", "unflatten"):
            _check_split_heads(tp, by_name[acts[0]].shape, node)
        sharded[node.name] = layout.sharded
        split_compute = parallel or layout.sharded or (sequence_parallel and tp > 1)
        layout.flops = layout.flops / tp if split_compute else layout.flops
        _storage_of(node, name, family, storage, contiguous)
        if storage[node.name] == node.name:
            storage_bytes[node.name] = local_bytes(node)
        layout.out_bytes = local_bytes(node)
        if family != "view" and not _is_noop(node, name):
            layout.act_bytes = layout.out_bytes + sum(local_bytes(by_name[i]) for i in acts)
            if family != "embedding":     # a lookup reads only the rows it returns
                layout.param_bytes = sum(param_local[p] * _DTYPE_BYTES[compute_dtype] for p in params)
        if grad[node.name]:
            layout.saved = _saved(node, name, family, acts, storage, grad, by_name)
            for key in layout.saved:
                if key.endswith(":mask"):     # one byte per element
                    storage_bytes[key] = layout.out_bytes / _itemsize(node.dtype, compute_dtype)
        if family == "attention":
            layout.attention = _attention_info(node, by_name, batch, tp if in_sharded else 1)
            info = layout.attention     # the row-wise log-sum-exp, fp32
            storage_bytes[f"{node.name}:lse"] = info["heads"] * info["q_len"] * 4
        layouts.append(layout)
    for node in graph.nodes:
        if node.role is Role.PARAMETER:
            param_local.setdefault(node.name, _numel(node.shape))
    return GraphLayout(nodes=layouts, index=index, storage=storage, storage_bytes=storage_bytes,
                       param_local=param_local, batch=batch)


def _check_divides(tp: int, size: int, what: str, node: Node) -> None:
    if size % tp:
        where = f" in {node.module_path}" if node.module_path else ""
        raise AutoparError(f"tp={tp} does not divide the {size} {what} of {node.name}{where}; "
                           f"choose a tensor-parallel degree that divides {size}")


def _check_split_heads(tp: int, source: tuple, node: Node) -> None:
    """A sharded feature dim reshaped into (heads, head_dim) shards the heads: tp must divide them
    (grouped-query attention's key/value heads included)."""
    if not source or len(node.shape) < 2:
        return
    features, product = source[-1], 1
    for k in range(len(node.shape) - 1, -1, -1):
        product *= node.shape[k]
        if product == features and k < len(node.shape) - 1:
            _check_divides(tp, node.shape[k], "heads", node)
            return
        if product > features:
            return


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


def _storage_of(node: Node, name: str, family: str, storage: dict, contiguous: dict) -> None:
    source = node.inputs[0] if node.inputs else None
    if source is not None and (family == "view" or _is_noop(node, name)):
        copies = name in ("reshape", "flatten", "unflatten") and not contiguous[source]
        if not copies:
            storage[node.name] = storage[source]
            contiguous[node.name] = contiguous[source] and name not in _STRIDING
            return
    storage[node.name] = node.name
    contiguous[node.name] = True


def _saved(node: Node, name: str, family: str, acts: list[str], storage: dict, grad: dict,
           by_name: dict) -> tuple[str, ...]:
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
