"""Expert parallelism, the pass: each MoE layer's experts split over the stage's `ep` ranks.

A stage with `ep` > 1 (autopar.plans.Stage.ep) runs every MoE layer it holds (found by structure,
experts.py) as an `ExpertParallel` call (expert_dispatch.py): the experts' body is taken out of
the layer's graph into a program of its own, and the call dispatches the rows to the ranks that
hold their experts and combines them back. As Megatron-Core carves expert parallelism out of data
x context x tensor parallelism, `ep` divides the stage's dp x cp x tp ranks: those ranks, in
row-major (dp, cp, tp) order, are cut into consecutive blocks of `ep` (an *expert-parallel group*:
its ranks hold E/ep experts each, in order); the ranks at the same position of every block (an
*expert data-parallel group*, dp x cp x tp / ep of them) hold the same experts. A cp rank's rows
are its chunks' tokens: experts see tokens, whichever sequence and place they come from. The
runtime makes the groups, one device mesh (pp, edp, ep) per distinct ep, and hands them to the
pass in `PassTarget.expert_meshes`.

What the pass does to a stage:
- the rewrite (`rewrite_experts`), which without process groups computes what the graph did;
- expert weights become DTensors `Shard(0)` over the "ep" mesh dim: a rank keeps only its
  experts, checkpoints store the whole [E, ...] tensors under the model's names (DCP reshards them
  to another ep or to a plan without one), a meta model fills only its slices. Tensor parallelism
  (after this pass) leaves them as they are;
- each call is bound to its group and to the stage's tensor-parallel mesh, whose ranks each
  dispatch 1/tp of the rows they share.
Gradients: the runtime reduces the experts' over the expert data-parallel group alone (FSDP2 over
"edp", autopar.runtime.data_parallel). Every row of the global batch is computed by exactly one
rank of each expert's data-parallel group, so the sum over that group is the sum over all
dp x cp replicas, of which the mean is wanted (what every other gradient gets, each cp rank's
loss being its tokens' mean): FSDP2 divides by the group's size, so the experts' weight gradients
are scaled by edp / (dp x cp) in the backward (a divide factor of FSDP2's own needs a
pre-multiplied sum, which gloo lacks).

`check_expert_parallelism` checks a plan's ep against the model's exported graph before any
process group exists: MoE layers there are, their routers can be split, ep divides their experts.
"""

from __future__ import annotations

import torch
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from autopar.errors import PlanMismatchError
from autopar.mixed_dtypes import casts_following_weights
from autopar.passes.expert_dispatch import ExpertParallel, LocalProgram, RouteInput, grouped_mm
from autopar.passes.experts import (CHECK, GROUPED_MM, ExpertLayer, ExpertStructureError,
                                    find_expert_layers, grouped_arguments)
from autopar.passes.precision import parameter_dtype
from autopar.passes.program import PassTarget, StageProgram


def split_experts(program: StageProgram, plan, target: PassTarget) -> StageProgram:
    """The stage's MoE layers run expert-parallel when its `ep` > 1 (module doc)."""
    stage = plan.stages[program.index]
    if stage.ep == 1:
        return program
    mesh = target.expert_meshes[stage.ep]
    # FSDP2 averages the expert gradients over their replicas; the mean over dp x cp is wanted
    replicas = stage.dp * stage.cp
    scale = (replicas * stage.tp // stage.ep) / replicas
    for graph_module in [m for m in program.module.modules() if isinstance(m, fx.GraphModule)]:
        for experts in rewrite_experts(graph_module):
            for holder in experts.experts:
                keep_own_experts(holder, mesh["ep"])
            experts.bind(mesh["ep"].get_group(), target.tp_mesh, gradient_scale=scale)
    return program


def check_expert_parallelism(module: fx.GraphModule, plan) -> list[ExpertLayer]:
    """The model's MoE layers (in `module`, the model's whole exported program), checked against
    the plan's ep per stage: a clear error, the same on every rank, before any collective, for a
    plan that splits experts of a model without MoE layers, a router or experts the rewrite cannot
    split, or an ep that does not divide a layer's experts. Nothing of `module` changes."""
    if max(stage.ep for stage in plan.stages) == 1:
        return []
    layers = find_expert_layers(module)
    if not layers:
        raise PlanMismatchError(
            f"the plan splits experts (ep={max(s.ep for s in plan.stages)}) but this model has no "
            f"mixture-of-experts layer (a router's top-k choosing among expert weights stacked on "
            f"a leading dim); plan it with ep=1")
    for layer in layers:
        _check_any_size(_extract(layer), layer)
        ep = plan.stages[stage_of(layer.where, plan)].ep
        if layer.num_experts % ep:
            fits = [d for d in range(1, layer.num_experts + 1) if layer.num_experts % d == 0]
            raise PlanMismatchError(
                f"ep={ep} does not divide the {layer.num_experts} experts of {layer.where}; use "
                f"an ep in {fits} that divides the stage's dp x cp x tp ranks too")
    return layers


def stage_of(where: str, plan) -> int:
    """The stage whose layers hold the module at `where` ("module model.layers.1.mlp"); stage 0
    for the model's own forward (a single-stage plan may name no layers)."""
    path = where.removeprefix("module ")
    for stage in plan.stages:
        if any(path == layer or path.startswith(layer + ".") for layer in stage.layers):
            return stage.index
    return 0


def keep_own_experts(holder: nn.Module, mesh: DeviceMesh) -> None:
    """The holder's weight as a Shard(0) DTensor over `mesh`, holding only this rank's experts:
    a copy of the slice, so that the whole tensor is freed (a meta tensor is only cut)."""
    whole = holder.value
    size, rank = mesh.size(), mesh.get_local_rank()
    count = whole.shape[0] // size
    local = whole.detach()[rank * count:(rank + 1) * count].clone()
    tensor = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=whole.shape,
                                stride=whole.stride())
    holder.value = nn.Parameter(tensor, requires_grad=whole.requires_grad)


def rewrite_experts(gm: fx.GraphModule) -> list[ExpertParallel]:
    """Replace every MoE layer's experts in `gm` by an `ExpertParallel` call taking the rows, the
    routing value that says which expert each row goes to, and the constants; returns the new
    modules, in graph order. Without process groups they compute what the graph did."""
    modules = []
    following = casts_following_weights(gm.graph, parameter_dtype(gm))
    for index, layer in enumerate(find_expert_layers(gm)):
        program = _extract(layer)
        _check_any_size(program, layer)
        cast = _rows_cast_to_the_experts(layer, following)
        module = ExpertParallel(
            program=program, experts=[gm.get_submodule(h.target) for h in layer.holders],
            num_experts=layer.num_experts, route=_route_input(layer),
            output=layer.out.meta["val"], where=layer.where, rows_follow_weights=cast is not None)
        name = f"expert_parallel_{index}"
        gm.add_submodule(name, module)
        rows = layer.rows if cast is None else cast.args[0]
        with gm.graph.inserting_after(layer.out):
            call = gm.graph.call_module(name, (rows, _route_node(layer), *layer.constants))
        call.meta = dict(layer.out.meta)
        layer.out.replace_all_uses_with(call, delete_user_cb=lambda user: user is not call)
        _erase(gm, layer)
        if cast is not None and not cast.users:
            gm.graph.erase_node(cast)
        modules.append(module)
    if modules:
        gm.graph.lint()
        gm.recompile()
    return modules


def _rows_cast_to_the_experts(layer: ExpertLayer, following: dict[fx.Node, fx.Node]) -> fx.Node | None:
    """The cast of the layer's rows to its experts' weights' dtype (`input.to(weight.dtype)`), if
    that is what the rows are and only the experts read it: ExpertParallel makes it, in the
    dtype of the weights it runs with (FSDP2 may hand them in 16 bits), before it splits and
    sends the rows. Left in the graph it would cast them to the traced dtype (fp32), and the
    rows would be split, sent and their gradients gathered at twice the bytes of 16-bit ones."""
    rows = layer.rows
    members = set(layer.body) | set(layer.weights)
    if following.get(rows) in layer.weights and all(user in members for user in rows.users):
        return rows
    return None


def _extract(layer: ExpertLayer) -> LocalProgram:
    """The body as a program of (rows, expert weights, routing inputs, constants)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {layer.rows: graph.placeholder("rows")}
    for index, holder in enumerate(layer.holders):
        env[holder] = graph.placeholder(f"expert_weight_{index}")
    for index, route in enumerate(layer.routes):
        env[route] = graph.placeholder(f"route_{index}")
    for index, constant in enumerate(layer.constants):
        env[constant] = graph.placeholder(f"constant_{index}")
    members = set(layer.body) | set(layer.weights)
    for node in [n for n in layer.source.graph.nodes if n in members and n not in env]:
        if str(node.target) in GROUPED_MM:
            rows, weight, offsets = grouped_arguments(node)
            env[node] = graph.call_function(grouped_mm, (env[rows], env[weight], env[offsets]))
        else:
            env[node] = graph.node_copy(node, lambda value: env[value])
    graph.output(env[layer.out])
    return LocalProgram(fx.GraphModule(nn.Module(), graph),
                        roles=tuple(layer.routes.values()),
                        route_dtypes=tuple(r.meta["val"].dtype for r in layer.routes))


def _check_any_size(program: LocalProgram, layer: ExpertLayer) -> None:
    """Run the body on meta tensors for another number of rows and one expert: an op that fixed
    the number of rows (a view to the traced count) cannot run on the rows a rank receives, nor
    one that fixed the number of experts of a batched layer (its rows [1, n + 1, ...] then)."""
    rows = layer.rows.meta["val"]
    count = rows.shape[0] + 1
    shape = (1, rows.shape[1] + 1, *rows.shape[2:]) if layer.batched else (count, *rows.shape[1:])
    weights = [torch.empty((1, *h.meta["val"].shape[1:]), dtype=h.meta["val"].dtype, device="meta")
               for h in layer.holders]
    constants = [torch.empty_like(value, device="meta") if isinstance(value, torch.Tensor) else value
                 for value in (c.meta.get("val") for c in layer.constants)]
    try:
        out = program.run(torch.empty(shape, dtype=rows.dtype, device="meta"), weights,
                          torch.zeros(count, dtype=torch.long, device="meta"),
                          torch.full((1,), count, dtype=torch.long, device="meta"), constants)
        leading = 2 if layer.batched else 1
        if tuple(out.shape[:leading]) != shape[:leading]:
            raise ValueError(f"rows {list(shape)} gave {list(out.shape)}")
    except Exception as err:     # any failure means the same: the body is tied to its traced sizes
        first = str(err).splitlines()[0] if str(err) else ""
        raise ExpertStructureError(
            f"the experts in {layer.where} cannot run on another number of tokens or experts than "
            f"traced ({type(err).__name__}: {first}); expert parallelism needs experts whose ops "
            f"do not fix the token count: train this model with ep=1") from err


def _route_input(layer: ExpertLayer) -> RouteInput | None:
    node = _route_node(layer)
    return None if node is None else RouteInput(role=layer.routes[node], dtype=node.meta["val"].dtype)


def _route_node(layer: ExpertLayer) -> fx.Node | None:
    """The routing input that tells each row's expert: per-row ids where the body gathers by
    them (they are aligned with the rows), else the grouped matmuls' offsets; None for a batched
    layer (each expert's rows are its slice of dim 0)."""
    if layer.batched:
        return None
    ids = [node for node, role in layer.routes.items() if role == "ids"]
    return ids[0] if ids else next(iter(layer.routes))


def _erase(gm: fx.GraphModule, layer: ExpertLayer) -> None:
    """Drop the body, the weights' reads and the checks of body values (now computed inside)."""
    doomed = set(layer.body) | set(layer.weights)
    for node in reversed(list(gm.graph.nodes)):
        if node in doomed or str(node.target) == CHECK and any(i in doomed for i in node.all_input_nodes):
            gm.graph.erase_node(node)
    for holder in layer.holders:
        # the module moved into ExpertParallel; the graph's own reference to it goes
        if holder.op == "call_module" and not any(n.target == holder.target for n in gm.graph.nodes
                                                  if n.op == "call_module"):
            gm.delete_submodule(holder.target)
