"""Tensor parallelism inside a pipeline stage, with DTensor.

The stage's parameters become DTensors over the stage's tensor-parallel sub-mesh with the plan's
placement for the "tp" axis ("S(0)" column-parallel, "S(1)" row-parallel, "R" replicated), so every
op of the stage's graph computes on global shapes and DTensor's sharding propagation inserts the
collectives. Between stages activations travel as ordinary tensors, each tensor-parallel rank's
1/tp chunk of a value (`TensorParallelStage`, stage_boundaries.py), rebuilt by the receiving stage.

Values the plan places (`Plan.nodes`, e.g. the residual stream at each norm's input: whole, or
split on the sequence for sequence parallelism) are moved there with the intra-op runtime's
`Redistribute`. Where ops read a value in another placement (a sequence-split norm output read
whole by q, k and v), it is redistributed once per placement read, by a node of the graph that
all those readers share (`share_redistributions`). What else an exported graph needs to run on
DTensors is dtensor_adapters.py's; ops DTensor has no rule for, dtensor_rules.py's.
"""

from __future__ import annotations

import operator

import torch
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from autopar.cost.reshard import cheapest_inputs
from autopar.cost.strategies import axis_strategies, parse_placement, placement_str
from autopar.errors import PlanMismatchError
from autopar.passes.collectives import Redistribute
from autopar.passes.dtensor_adapters import (drop_metadata_checks, match_layouts, place_attention,
                                             replicate_created_tensors, settle_lookups)
from autopar.passes.dtensor_rules import (PARTIAL_RULES, RunByStrategy, op_view,
                                          replicate_ops_without_rule)
from autopar.passes.program import PassTarget, StageProgram, TensorRef


def shard_tensor_parallel(program: StageProgram, plan, target: PassTarget) -> StageProgram:
    """The stage on DTensors over its tensor-parallel mesh with the plan's placements, when the
    plan shards any of its parameters or values there (`shard_stage`). When it shards none, every
    tp rank computes the whole stage with plain tensors: the same numbers DTensor would give with
    all placements replicated, without its dispatch cost on every op."""
    if target.tp_mesh is None or not _sharded_on(program, plan, target.tp_axis):
        return program
    program.module = shard_stage(program.module, target.tp_mesh, plan.parameters, plan.nodes,
                                 target.tp_axis)
    return program


def _sharded_on(program: StageProgram, plan, axis: int) -> bool:
    """Whether the plan shards any of the stage's parameters or values on `axis`."""
    names = [node.name for graph_module in program.module.modules()
             if isinstance(graph_module, fx.GraphModule) for node in graph_module.graph.nodes]
    placed = [plan.parameters.get(fqn) for fqn in program.param_names.values()]
    placed += [plan.nodes.get(name) for name in names]
    return any(texts is not None and texts[axis] != "R" for texts in placed)


class TensorParallelStage(nn.Module):
    """Runs `inner` over the tensor-parallel ranks of `mesh`, on DTensors (`dtensors`) or, for a
    stage the plan does not shard, on plain tensors that every rank computes whole.

    The model's own inputs and outputs are whole on every rank. A value that crosses to another
    pipeline stage travels as each rank's 1/tp chunk on dim `inputs[i]` / `outputs[i]` (set by
    autopar.passes.stage_boundaries; None: whole), as Megatron-LM's scatter/gather sends it: the
    sender keeps its chunk (a sequence-split value is split already), the receiver rebuilds the
    placement the plan gives the value (`input_placements`), gathering only where that placement
    is not the chunk's. Autograd is DTensor's, so gradients travel back as chunks too."""

    def __init__(self, inner: nn.Module, mesh: DeviceMesh, *, dtensors: bool = True):
        super().__init__()
        self.inner = inner
        self.mesh = mesh
        self.dtensors = dtensors
        self.inputs: tuple[int | None, ...] = ()
        self.input_placements: tuple = ()
        self.outputs: tuple[int | None, ...] = ()

    def forward(self, *args):
        inputs = [self._received(value, i) for i, value in enumerate(args)]
        leaves, spec = tree_flatten(self.inner(*inputs))
        sent, index = [], 0             # outputs[i] is the i-th tensor output
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                leaf, index = self._sent(leaf, index), index + 1
            sent.append(leaf)
        return tree_unflatten(sent, spec)

    def _received(self, value, index: int):
        if not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
            return value
        dim = self.inputs[index] if index < len(self.inputs) else None
        if dim is None:
            return DTensor.from_local(value, self.mesh, [Replicate()], run_check=False) \
                if self.dtensors else value
        chunk = DTensor.from_local(value, self.mesh, [Shard(dim)], run_check=False)
        placed = chunk.redistribute(self.mesh, [self.input_placements[index]]) \
            if self.dtensors else chunk.redistribute(self.mesh, [Replicate()])
        return placed if self.dtensors else placed.to_local()

    def _sent(self, value: torch.Tensor, index: int):
        dim = self.outputs[index] if index < len(self.outputs) else None
        if dim is None and not isinstance(value, DTensor):
            return value
        if not isinstance(value, DTensor):
            value = DTensor.from_local(value, self.mesh, [Replicate()], run_check=False)
        placement = Replicate() if dim is None else Shard(dim)
        # a copy, not the local view: FSDP's backward hook on a stage output must not be lost
        # to an in-place op on a view; dense, as the pipeline sends it
        return value.redistribute(self.mesh, [placement]).to_local().clone(
            memory_format=torch.contiguous_format)


def written_nodes(graph: fx.Graph) -> set[fx.Node]:
    """The values whose storage an in-place op writes into (`copy_`'s self, `index_put_`'s self,
    ...), with every view of the same storage.

    A key assembled as `buffer = new_empty(...); buffer[..., :8].copy_(k)` is read through
    `buffer` after the write: a redistribution inserted after `buffer` or its view (or before the
    write, for a reader) copies it before the write or writes into the copy, and the written
    value's gradient is lost (DeepSeek-V3's latent attention under tensor parallelism left its
    keys' projection without one). Such values keep the placement DTensor gives them, which its
    in-place rules preserve, and their readers' redistributions stay inside DTensor's dispatch,
    where they happen at the read."""
    base: dict[fx.Node, fx.Node] = {}
    written = set()
    for node in graph.nodes:
        source = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        if source is not None and (node.target is operator.getitem or _returns_alias(node)):
            base[node] = base.get(source, source)
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            for index, argument in enumerate(node.target._schema.arguments):
                if argument.alias_info is not None and argument.alias_info.is_write:
                    value = node.args[index] if index < len(node.args) \
                        else node.kwargs.get(argument.name)
                    if isinstance(value, fx.Node):
                        written.add(base.get(value, value))
    return {node for node in graph.nodes if base.get(node, node) in written}


def _returns_alias(node: fx.Node) -> bool:
    """Whether `node` is an ATen op whose output aliases its first input (a view, an in-place op)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    returns = node.target._schema.returns
    return bool(returns) and returns[0].alias_info is not None


def place_nodes(module: nn.Module, mesh: DeviceMesh, nodes: dict[str, list[str]], tp_axis: int) -> None:
    """After each node the plan places on `tp_axis`, move its value to that placement (but for
    views of values written in place and the writes themselves: `written_nodes`). A value
    written in place is moved where it is made, before any view or write reads it, and every
    reader then reads the moved one: the plan places it as the op that writes it keeps it (a
    buffer `full_like` a column-split router's scores, then filled by `scatter_`)."""
    for graph_module in [m for m in module.modules() if isinstance(m, fx.GraphModule)]:
        written = {node for node in written_nodes(graph_module.graph)
                   if node.target is operator.getitem or _returns_alias(node)}
        weights = _computed_from_parameters(graph_module)
        for node in list(graph_module.graph.nodes):
            texts = nodes.get(node.name)
            if node.op != "call_function" or texts is None or node in written \
                    or not isinstance(node.meta.get("val"), torch.Tensor):
                continue
            placement = parse_placement(texts[tp_axis])
            if isinstance(placement, Partial):
                continue
            name = f"place_{node.name}"
            graph_module.add_submodule(name, Redistribute(mesh, (placement,), weight=node in weights))
            with graph_module.graph.inserting_after(node):
                placed = graph_module.graph.call_module(name, (node,))
            node.replace_all_uses_with(placed, delete_user_cb=lambda user: user is not placed)
        graph_module.recompile()


def _computed_from_parameters(graph_module: fx.GraphModule) -> set[fx.Node]:
    """The nodes computed from parameters alone (views, transposes, casts of weights): a stage
    reads its parameters with `call_module` nodes that take no input."""
    found: set[fx.Node] = set()
    for node in graph_module.graph.nodes:
        if node.op == "call_module" and not node.all_input_nodes:
            if isinstance(getattr(graph_module.get_submodule(node.target), "value", None), nn.Parameter):
                found.add(node)
        elif node.op == "call_function" and node.all_input_nodes \
                and all(value in found for value in node.all_input_nodes):
            found.add(node)
    return found


def share_redistributions(module: nn.Module, mesh: DeviceMesh, parameters: dict[str, list[str]],
                          nodes: dict[str, list[str]], tp_axis: int) -> None:
    """Every value that ops read in another placement than the plan gives it is redistributed once
    per placement read, by one node after its producer that all those readers use.

    Left to DTensor, each op redistributes its inputs inside its own dispatch, out of autograd's
    sight: a sequence-split norm output read by q, k and v is gathered three times in forward, its
    gradient reduce-scattered three times in backward, and gathered three times more there for
    the weight gradients (autograd saved each op's input as it was before the gather). As a node,
    the gather is recorded once: its readers save the gathered value and their gradients are
    summed before its one reverse collective. Which placement an op reads is the cost model's
    choice (`cost.reshard.cheapest_inputs`), so what runs is what the plan was priced with.
    Partial reads (R -> P, a local zeroing) and values written in place (`written_nodes`) are
    left to DTensor. A value handed to several parts of a graph split for recomputation is
    redistributed before it is handed on, where every part reads it the same way
    (`_read_before_parts`)."""
    graph_modules = [m for m in module.modules() if isinstance(m, fx.GraphModule)]
    for graph_module in graph_modules:
        _read_before_parts(graph_module, mesh, parameters, nodes, tp_axis)
    for graph_module in graph_modules:
        placed = _planned_placements(graph_module, parameters, nodes, tp_axis)
        written = written_nodes(graph_module.graph)
        readers: dict[tuple[fx.Node, str], list[fx.Node]] = {}
        for node in graph_module.graph.nodes:
            for source, read in zip(node.all_input_nodes, _read_placements(node, placed, mesh.size())):
                value = source.op in ("call_function", "placeholder") and source.name in nodes \
                    and source not in written
                if value and read not in (placed[source.name], "P"):
                    readers.setdefault((source, read), []).append(node)
        for (source, read), users in readers.items():
            name = f"read_{source.name}_{read.replace('(', '').replace(')', '')}"
            graph_module.add_submodule(name, Redistribute(mesh, (parse_placement(read),)))
            with graph_module.graph.inserting_after(source):
                shared = graph_module.graph.call_module(name, (source,))
            for user in users:
                user.replace_input_with(source, shared)
        if readers:
            graph_module.recompile()


def _read_before_parts(graph_module: fx.GraphModule, mesh: DeviceMesh, parameters: dict[str, list[str]],
                       nodes: dict[str, list[str]], tp_axis: int) -> None:
    """Where selective recompute split a layer into parts (graph modules: the attention's, under
    its checkpoint, and those before and after it), a value read by several parts, each in the
    same placement but the plan's (the first layer's input, an embedding split on the hidden dim,
    read whole by its norm and by the residual add), is redistributed here once, before the
    parts: within each part it then arrives as its ops read it, and each part's own redistribution
    is the identity. Left to the parts, each gathered it again."""
    placed = _planned_placements(graph_module, parameters, nodes, tp_axis)
    written = written_nodes(graph_module.graph)
    for source in list(graph_module.graph.nodes):
        if source.op not in ("call_function", "placeholder") or source.name not in nodes \
                or source in written or len(source.users) < 2:
            continue
        reads = {_part_reads(graph_module, user, source, parameters, nodes, tp_axis, mesh.size())
                 for user in source.users}
        read = reads.pop() if len(reads) == 1 else None
        if read is None or read in (placed[source.name], "P"):
            continue
        name = f"read_{source.name}_{read.replace('(', '').replace(')', '')}"
        graph_module.add_submodule(name, Redistribute(mesh, (parse_placement(read),)))
        with graph_module.graph.inserting_after(source):
            shared = graph_module.graph.call_module(name, (source,))
        source.replace_all_uses_with(shared, delete_user_cb=lambda user: user is not shared)
        graph_module.recompile()


def _part_reads(graph_module: fx.GraphModule, user: fx.Node, source: fx.Node, parameters: dict,
                nodes: dict, tp_axis: int, size: int) -> str | None:
    """The one placement in which the part that `user` calls reads `source` (None: not a part,
    or a part that reads it in several placements or through ops the plan does not place)."""
    part = graph_module.get_submodule(user.target) if user.op == "call_module" else None
    if not isinstance(part, fx.GraphModule) or source in user.kwargs.values() or user.args.count(source) != 1:
        return None
    inputs = [node for node in part.graph.nodes if node.op == "placeholder"]
    given = inputs[user.args.index(source)]
    placed = _planned_placements(part, parameters, nodes, tp_axis)
    reads = set()
    for reader in given.users:
        found = [read for read_from, read in zip(reader.all_input_nodes, _read_placements(reader, placed, size))
                 if read_from is given]
        reads.update(found or [None])
    return reads.pop() if len(reads) == 1 else None


def _planned_placements(graph_module: fx.GraphModule, parameters: dict[str, list[str]],
                        nodes: dict[str, list[str]], tp_axis: int) -> dict[str, str]:
    """Node name -> its placement on `tp_axis` by the plan: a parameter's storage, a value's output."""
    placed = {}
    for node in graph_module.graph.nodes:
        ref = graph_module.get_submodule(node.target) if node.op == "call_module" else None
        if isinstance(ref, TensorRef):
            placed[node.name] = parameters[ref.fqn][tp_axis] if ref.fqn in parameters else "R"
        elif node.name in nodes:
            placed[node.name] = nodes[node.name][tp_axis]
    return placed


def _read_placements(node: fx.Node, placed: dict[str, str], size: int) -> tuple[str, ...]:
    """The placements in which `node`, an ATen op the plan places, reads its inputs (in
    `all_input_nodes` order); () for any other node."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload) \
            or node.name not in placed:
        return ()
    inputs = node.all_input_nodes
    strategies = axis_strategies(op_view(node))
    if strategies is None:          # run replicated (replicate_ops_without_rule)
        return ()
    output = placed[node.name]
    options = [tuple(placement_str(p) for p in s.inputs) for s in strategies
               if placement_str(s.output) == output]
    return cheapest_inputs(output, [placed.get(i.name, "R") for i in inputs], options,
                           [_bytes(i) for i in inputs], size)


def run_by_plan(module: nn.Module, mesh: DeviceMesh, parameters: dict[str, list[str]],
                nodes: dict[str, list[str]], tp_axis: int) -> None:
    """Every op whose DTensor support is partial (PARTIAL_RULES) and that the plan places runs by
    the strategy the plan priced: its output's placement, its inputs read as `_read_placements`
    says. The others of those ops run replicated (replicate_ops_without_rule)."""
    for graph_module in [m for m in module.modules() if isinstance(m, fx.GraphModule)]:
        placed = _planned_placements(graph_module, parameters, nodes, tp_axis)
        for node in list(graph_module.graph.nodes):
            if node.op != "call_function" or node.target not in PARTIAL_RULES:
                continue
            reads = _read_placements(node, placed, mesh.size())
            if not reads or len(reads) != len(node.all_input_nodes):
                continue
            name = f"by_strategy_{node.name}"
            graph_module.add_submodule(name, RunByStrategy(
                node.target, mesh, tuple(parse_placement(p) for p in reads),
                parse_placement(placed[node.name])))
            node.op, node.target = "call_module", name
        graph_module.recompile()


def _bytes(node: fx.Node) -> float:
    value = node.meta.get("val")
    return float(value.numel() * value.element_size()) if isinstance(value, torch.Tensor) else 0.0


def shard_stage(module: nn.Module, mesh: DeviceMesh, parameters: dict[str, list[str]],
                nodes: dict[str, list[str]], tp_axis: int) -> TensorParallelStage:
    """Distribute the stage's tensors by the plan's placements on axis `tp_axis`; unplaced ones
    (buffers, constants, parameters the plan leaves out) are replicated. Then place the nodes."""
    for ref in module.modules():
        # a DTensor is placed already: an expert weight split over its expert-parallel ranks
        if not isinstance(ref, TensorRef) or isinstance(ref.value, DTensor):
            continue
        texts = parameters.get(ref.fqn)
        placement = parse_placement(texts[tp_axis]) if texts else Replicate()
        if not isinstance(placement, Replicate):
            dim = placement.dim
            if dim >= ref.value.dim() or ref.value.shape[dim] % mesh.size():
                raise PlanMismatchError(
                    f"parameter {ref.fqn} of shape {tuple(ref.value.shape)} cannot be split in "
                    f"{mesh.size()} equal shards on dim {dim}; plan it replicated or change tp")
        # a meta tensor (a model too big for one process) is only split, no values move: the
        # local shards get storage and values after the sharding (materialize.py)
        tensor = distribute_tensor(ref.value.detach(), mesh, [placement],
                                   src_data_rank=None if ref.value.is_meta else 0)
        if isinstance(ref.value, nn.Parameter):
            ref.value = nn.Parameter(tensor, requires_grad=ref.value.requires_grad)
        else:
            ref.value = tensor
    # these three first: they read the traced shapes and placements of the ops' producers, which
    # the nodes inserted after them do not have
    run_by_plan(module, mesh, parameters, nodes, tp_axis)
    drop_metadata_checks(module)
    replicate_ops_without_rule(module, mesh)
    share_redistributions(module, mesh, parameters, nodes, tp_axis)
    replicate_created_tensors(module, mesh)
    place_attention(module, mesh, nodes, tp_axis)
    settle_lookups(module, mesh)
    place_nodes(module, mesh, nodes, tp_axis)
    match_layouts(module)
    return TensorParallelStage(module, mesh)
