"""A forced configuration (`Config`) as a single-stage Plan with Megatron-LM's layout.

Used by `compile(plan=Config(...))` when the planner's `plan_from_config` (placements from the
ILP with pinned axis roles) is not available. Tensor parallelism follows the data flow of each
block: a linear whose input is whole is column-parallel (output features split over "tp"), a
linear whose input is split is row-parallel (input features split, partial sums reduced where the
residual stream enters the next norm). A weight read through a transpose (`x @ w.T`) counts as read
directly, its dims swapped.
So q/k/v, the MLP's up and gate projections and the LM head come out column-parallel, the
attention output and MLP down projections row-parallel, for any model built from linears,
whatever its names. Sequence parallelism splits the sequence dim of every norm's input. ZeRO-3
shards each parameter on its first dim divisible by "dp".
"""

from __future__ import annotations

from autopar.cost.config import Config
from autopar.cost.mesh import Mesh
from autopar.errors import MeshError
from autopar.graph import Graph, Role
from autopar.plans import Plan, Stage

# (weight dims of (output features, input features)) of each linear-like op, by its target.
LINEAR_WEIGHT_DIMS = {"aten.linear.default": (0, 1), "aten.addmm.default": (1, 0),
                      "aten.mm.default": (1, 0), "aten.matmul.default": (1, 0)}
# ops that transpose a matrix: a linear may read its weight through one (`x @ w.T`)
TRANSPOSES = ("aten.t.default", "aten.numpy_T.default", "aten.mT.default", "aten.transpose.int",
              "aten.permute.default", "aten.swapaxes.default", "aten.swapdims.default")
# position of the (input, weight, bias) arguments of each
LINEAR_ARGS = {"aten.linear.default": (0, 1, 2), "aten.addmm.default": (1, 2, 0),
               "aten.mm.default": (0, 1, None), "aten.matmul.default": (0, 1, None)}


def megatron_plan(graph: Graph, mesh: Mesh, config: Config) -> Plan:
    """The plan Megatron-LM would run for `config` on one pipeline stage."""
    if config.pp != 1:
        raise MeshError(f"config pp={config.pp}: the Megatron layout here covers one stage; "
                        f"pipelines are planned by autopar.plan")
    if config.world_size != mesh.world_size:
        raise MeshError(f"config dp x tp = {config.dp} x {config.tp} = {config.world_size} devices, but "
                        f"the mesh {mesh} has {mesh.world_size}; choose dp x tp = {mesh.world_size}")
    tensor = _tensor_parallel_placements(graph, config.tp)
    parameters = {}
    for node in graph.parameters:
        dp_place = _zero3_placement(node.shape, tensor.get(node.param_fqn), config) if config.zero == 3 else "R"
        parameters[node.param_fqn] = [dp_place, tensor.get(node.param_fqn, "R")]
    nodes = {n.name: ["S(0)", "R"] for n in graph.nodes if n.role is Role.INPUT}
    if config.tp > 1:
        # The residual stream is whole (or sequence-split) where it enters a norm: a row-parallel
        # output's partial sums are reduced there, as in Megatron, instead of flowing on.
        stream = "S(1)" if config.sequence_parallel else "R"
        nodes.update({name: ["S(0)", stream] for name in _norm_inputs(graph, config.tp, stream)})
    stage = Stage(index=0, layers=_units(graph), ranks=list(range(mesh.world_size)), tp=config.tp,
                  dp=config.dp, recompute=config.recompute, zero=config.zero,
                  sequence_parallel=config.sequence_parallel)
    return Plan(fingerprint=graph.fingerprint(), mesh=mesh.to_dict(), axes=[["dp", config.dp], ["tp", config.tp]],
                stages=[stage], global_batch=config.global_batch, micro_batches=config.micro_batches,
                micro_batch_size=config.micro_batch, schedule=config.schedule, parameters=parameters,
                nodes=nodes, model_type=graph.model_type, solver={"method": "megatron layout"})


def _tensor_parallel_placements(graph: Graph, tp: int) -> dict[str, str]:
    """Column- then row-parallel linears along the data flow: param fqn -> placement on "tp"."""
    if tp == 1:
        return {}
    fqn_of = {n.name: n.param_fqn for n in graph.nodes if n.role is Role.PARAMETER}
    shape_of = {n.name: n.shape for n in graph.nodes}
    # a matrix parameter seen through transposes (`x @ w.T`): node -> (parameter node, swapped)
    matrix = {name: (name, False) for name in fqn_of}
    split: set[str] = set()           # activations whose features are split over tp
    placements: dict[str, str] = {}
    for node in graph.nodes:
        if node.target in TRANSPOSES and len(node.shape) == 2 and node.inputs[0] in matrix:
            source, swapped = matrix[node.inputs[0]]
            matrix[node.name] = (source, not swapped)
            continue
        args = LINEAR_ARGS.get(node.target)
        operand = node.inputs[args[1]] if args and len(node.inputs) > args[1] else None
        weight, swapped = matrix.get(operand, (None, False))
        if weight is None or fqn_of[weight] in placements:
            if any(i in split for i in node.inputs) and node.role is Role.ACTIVATION:
                split.add(node.name)
            continue
        out_dim, in_dim = LINEAR_WEIGHT_DIMS[node.target]
        out_dim, in_dim = (in_dim, out_dim) if swapped else (out_dim, in_dim)
        bias = node.inputs[args[2]] if args[2] is not None and len(node.inputs) > args[2] else None
        if node.inputs[args[0]] in split:             # row-parallel: partial sums, reduced after
            placements[fqn_of[weight]] = f"S({in_dim})"
        elif shape_of[weight][out_dim] % tp == 0:     # column-parallel: output features split
            placements[fqn_of[weight]] = f"S({out_dim})"
            if bias in fqn_of:
                placements[fqn_of[bias]] = "S(0)"
            split.add(node.name)
    return placements


def _zero3_placement(shape: tuple, tensor_placement: str | None, config: Config) -> str:
    """Shard on the first dim that stays divisible after tensor parallelism, or keep whole."""
    for dim, size in enumerate(shape):
        if tensor_placement == f"S({dim})":
            size //= config.tp
        if size % config.dp == 0:
            return f"S({dim})"
    return "R"


def _norm_inputs(graph: Graph, tp: int, stream: str) -> list[str]:
    """Activations entering a norm module (with a sequence dim that tp divides, to split it)."""
    shapes = {node.name: node.shape for node in graph.nodes}
    return [name for name in graph.norm_inputs()
            if stream == "R" or len(shapes[name]) == 3 and shapes[name][1] % tp == 0]


def _units(graph: Graph) -> list[str]:
    """The planner's pipeline units (embedding, each block, head) as one stage's layers, so that
    recompute wraps each block as in a pipeline stage."""
    from autopar.solver.pipeline import pipeline_units

    return [layer for unit in pipeline_units(graph) for layer in unit.layers]
