"""Cut a captured model into the plan's pipeline stages.

The plan names each stage's layers by module path ("embed", "layers.0", ..., "head"). Every node of
the exported graph gets a stage:
- a node belongs to the layer whose path prefixes its `nn_module_stack`;
- glue outside every layer (the model's own forward, or a parent module's, e.g. `input_ids.view`)
  follows its latest input, or its first user when it reads only the model's inputs;
- constants (buffers, and what is computed from them alone: rotary tables, a position `arange`)
  are copied into every layer that reads them, and parameters into every stage that reads them: a
  weight tied between the embedding and the LM head has a copy in each of their stages, whose
  gradients `autopar.runtime.tied` keeps equal;
- nodes no output depends on are dropped, as are checks of constants (`_assert_tensor_metadata`
  on a rotary table); a check of an activation runs with that activation.
These rules are autopar.plans.stage_flow's, which the planner applies to its captured graph
too (so it knows which cuts relay an activation). A view that another unit reads is taken again
in that unit, so no unit returns a view (FSDP2 hooks what a unit returns).
Values that a later stage reads are passed along the stages between (stage_interfaces.py). Two
`split_module` passes follow:

1. one submodule per layer ("unit"), so the recompute pass (recompute.py) can wrap exactly one
   layer in a checkpoint ("full"), or only the attention of a layer ("selective");
2. the units grouped into one GraphModule per stage, which is what a `PipelineStage` runs.

Each parameter is held in a `TensorRef` (program.py), so a stage owns exactly the parameters it
reads, under their model names.
"""

from __future__ import annotations

import heapq
import operator

import torch
from torch import fx, nn
from torch.fx.passes.split_module import split_module

from autopar.errors import PlanMismatchError
from autopar.passes.program import (PassTarget, StageProgram, TensorRef, is_tensor_read, parameter_names,
                                    signature)
from autopar.passes.stage_interfaces import interface_examples, order_interfaces, pass_along
from autopar.plans.stage_flow import (BUFFER, FUNCTION, INPUT, OTHER, OUTPUT, PARAMETER, FlowNode,
                                       assign_units, dead, reader_unit, shared_values)
from autopar.tracer import written_inputs


def split_model(module: fx.GraphModule, plan, target: PassTarget,
                blocks: set[str] | None = None) -> list[StageProgram]:
    """The model's program cut into the plan's stages: the first rewrite, which makes one program
    per stage of one (`split_stages` with the plan's layers; floating values cross stages in the
    target's compute dtype)."""
    return split_stages(module, [stage.layers for stage in plan.stages], blocks=blocks,
                        boundary_dtype=target.compute_dtype, device=target.device)


def split_stages(module: fx.GraphModule, stage_layers: list[list[str]],
                 blocks: set[str] | None = None,
                 boundary_dtype: torch.dtype | None = None,
                 device: torch.device = torch.device("cpu")) -> list[StageProgram]:
    """One StageProgram per entry of `stage_layers` (module paths in model order). `blocks`: the
    layers that recompute may wrap (the repeated blocks, as Megatron's recompute does; default
    all), recorded in each StageProgram for the recompute pass. `boundary_dtype`: mixed
    precision's 16-bit dtype, which floating values cross stages in.

    Stage 0 takes the model's positional inputs in order, then its tensor keyword inputs in
    captured order (StageProgram.keywords); stage k > 0 takes stage k-1's outputs in
    order; the last stage returns the model's flat outputs (`model_outputs` rebuilds the model's
    output structure from them)."""
    units = [path for layers in stage_layers for path in layers]
    unit_stage = [s for s, layers in enumerate(stage_layers) for _ in layers]
    taken, keywords, out_spec = signature(module)
    inputs = [node.meta["val"] for node in taken]
    _drop_unused(module)
    unit_of_node = _assign_units(module, units, unit_stage)
    _check_order(module, unit_of_node, unit_stage)
    relayed = tuple(pass_along(module, unit_of_node, unit_stage, flow_nodes(module)))

    by_unit = split_module(module, module, lambda node: unit_of_node[node.name],
                           keep_original_node_name=True)
    _call_units_in_model_order(by_unit)
    for unit in by_unit.children():
        if isinstance(unit, fx.GraphModule):
            _no_writes_to_inputs(unit)

    stage_of_call = {f"submod_{u}": unit_stage[u] for u in range(len(units))}
    by_stage = split_module(by_unit, by_unit, lambda node: _stage_of_top_node(node, stage_of_call),
                            keep_original_node_name=True)
    for index in range(len(stage_layers)):
        if not hasattr(by_stage, f"submod_{index}"):
            raise PlanMismatchError(f"pipeline stage {index} (layers {stage_layers[index]}) computes "
                                    f"nothing in this model; plan this model again")
    order_interfaces(by_stage, len(stage_layers), [node.name for node in taken], boundary_dtype)
    blocks = set(units) if blocks is None else blocks
    programs = []
    for index in range(len(stage_layers)):
        stage_module = getattr(by_stage, f"submod_{index}")
        # a unit without nodes (an identity dropout) has no submodule
        stage_blocks = {f"submod_{u}": units[u] for u, stage in enumerate(unit_stage)
                        if stage == index and units[u] in blocks and hasattr(by_unit, f"submod_{u}")}
        programs.append(StageProgram(index=index, module=stage_module,
                                     param_names=parameter_names(stage_module), out_spec=out_spec,
                                     relayed=relayed, keywords=keywords, blocks=stage_blocks,
                                     input_values=_input_values(stage_module, by_unit)))
    for program, following in zip(programs, programs[1:]):
        program.output_values = following.input_values
    tied = tied_stages(programs)
    examples = interface_examples([program.module for program in programs], inputs, boundary_dtype,
                                  device)
    for program, (example_inputs, example_outputs) in zip(programs, examples):
        program.tied = tied
        program.example_inputs, program.example_outputs = example_inputs, example_outputs
    return programs


def _input_values(stage: fx.GraphModule, by_unit: fx.GraphModule) -> tuple[str, ...]:
    """The captured graph's name of each value `stage` takes (the plan places values by these
    names); a stage's input is named after the unit call, or the item of it, that made it."""
    nodes = {node.name: node for node in by_unit.graph.nodes}
    names = []
    for placeholder in (n for n in stage.graph.nodes if n.op == "placeholder"):
        made = nodes.get(placeholder.name)
        item = None
        if made is not None and made.target is operator.getitem:
            made, item = made.args
        if made is None or made.op != "call_module":     # a model input
            names.append(placeholder.name)
            continue
        unit = by_unit.get_submodule(made.target)
        value = next(n for n in unit.graph.nodes if n.op == "output").args[0]
        value = value if item is None else value[item]
        names.append(value.name if isinstance(value, fx.Node) else placeholder.name)
    return tuple(names)


def tied_stages(programs: list[StageProgram]) -> dict[str, tuple[int, ...]]:
    """fqn -> the stages holding a copy, for every parameter that more than one stage holds."""
    holders: dict[str, list[int]] = {}
    for program in programs:
        for fqn in sorted(set(program.param_names.values())):
            holders.setdefault(fqn, []).append(program.index)
    return {fqn: tuple(stages) for fqn, stages in holders.items() if len(stages) > 1}


def _drop_unused(module: fx.GraphModule) -> None:
    """Remove what no output depends on: dead nodes, checks of constants, and the export's checks
    of a tensor's dtype, device and layout (`_assert_tensor_metadata`): they restate what the
    export traced, name the device it traced on (a stage may run on another), and DTensor has no
    rule for them. Other checks of activations stay and run with the value they check. The rule
    is autopar.plans.stage_flow's, which the planner applies to its graph too."""
    dropped = set(dead(flow_nodes(module)))
    for node in reversed(list(module.graph.nodes)):
        if node.name in dropped:
            module.graph.erase_node(node)
    module.recompile()


def _assign_units(module: fx.GraphModule, units: list[str], unit_stage: list[int]) -> dict[str, int]:
    """Unit index of every node that is not a graph input or output.

    Nodes go to units by autopar.plans.stage_flow's rules (the planner's too): a layer's own
    nodes to it, glue after its latest input or with its first reader. Constants (buffers and
    what is computed from them alone, e.g. rotary tables) are copied into every unit that reads
    them, and parameters into every stage, so no stage waits for another's; a parameter that
    several stages read (tied weights) has a copy in each."""
    flow = flow_nodes(module)
    assigned = assign_units(flow, units)
    shared = shared_values(flow)
    _views_with_readers(module, assigned, unit_stage)
    for node in reversed([n for n in module.graph.nodes if n.name in shared]):
        _copy_per_unit(module, node, assigned, unit_stage)
    module.recompile()
    return assigned


def _views_with_readers(module: fx.GraphModule, assigned: dict[str, int], unit_stage: list[int]):
    """A view (`unsqueeze`, `alias`, `permute`...) that another unit reads runs in each unit that
    reads it, and its own unit returns the view's base instead: FSDP2 hooks the outputs of the
    units it wraps for its backward all-gather, an in-place op on a returned view loses that
    hook (torch warns of it), and a view costs nothing to take again. Only views taken in the
    unit that makes their base move, so what crosses from stage to stage (which
    autopar.plans.stage_flow predicts for the planner) is the same tensor as before."""
    for node in reversed(list(module.graph.nodes)):
        if not (isinstance(node.target, torch._ops.OpOverload) and node.target.is_view) \
                or node.name not in assigned or not node.all_input_nodes:
            continue
        base = node.all_input_nodes[0]
        readers = {reader_unit(user.name, user.op == "output", assigned, len(unit_stage))
                   for user in node.users}
        if assigned.get(base.name) == assigned[node.name] and readers - {assigned[node.name]}:
            _copy_per_unit(module, node, assigned, unit_stage)


def flow_nodes(module: fx.GraphModule) -> list[FlowNode]:
    """The graph's nodes as autopar.plans.stage_flow's rules see them."""
    nodes = []
    for node in module.graph.nodes:
        if node.op in ("placeholder", "output"):
            kind = INPUT if node.op == "placeholder" else OUTPUT
        elif is_tensor_read(module, node):
            kind = PARAMETER if isinstance(module.get_submodule(node.target).value, nn.Parameter) \
                else BUFFER
        else:
            kind = FUNCTION if node.op == "call_function" else OTHER
        stack = node.meta.get("nn_module_stack") or {}
        paths = [path for path, _ in stack.values()]
        nodes.append(FlowNode(name=node.name, kind=kind,
                              inputs=tuple(n.name for n in node.all_input_nodes),
                              module_path=paths[-1] if paths else "", target=str(node.target),
                              effect=kind not in (INPUT, OUTPUT) and node.is_impure(),
                              writes=bool(written_inputs(node))))
    return nodes


def _copy_per_unit(module: fx.GraphModule, node: fx.Node, assigned: dict[str, int],
                   unit_stage: list[int]) -> None:
    """Give `node` the first unit that reads it and a copy of it to each other unit. A parameter
    copied into another stage reads its own `TensorRef` there (the stage's own copy of the tied
    weight); inside one stage the copies share one, so the stage holds the parameter once."""
    by_unit: dict[int, list[fx.Node]] = {}
    for user in node.users:
        unit = reader_unit(user.name, user.op == "output", assigned, len(unit_stage))
        by_unit.setdefault(unit, []).append(user)
    first, *others = sorted(by_unit) or [0]
    assigned[node.name] = first
    refs = {unit_stage[first]: node.target} if is_tensor_read(module, node) else {}
    for unit in others:
        with module.graph.inserting_after(node):
            copy = module.graph.node_copy(node)
        if refs:
            stage = unit_stage[unit]
            if stage not in refs:
                ref = module.get_submodule(node.target)
                refs[stage] = f"{node.target}_stage{stage}"
                module.add_submodule(refs[stage], TensorRef(ref.fqn, ref.value))
            copy.target = refs[stage]
        for user in by_unit[unit]:
            user.replace_input_with(node, copy)
        assigned[copy.name] = unit


def _is_ref(module: fx.GraphModule, node: fx.Node) -> bool:
    return node.op == "call_module" and isinstance(module.get_submodule(node.target), TensorRef)


def _no_writes_to_inputs(unit: fx.GraphModule) -> None:
    """An in-place op on what the unit takes from another unit (a residual `+=` or a `relu_`
    on the previous module's output, when a CNN is cut between modules) writes a new tensor
    instead: FSDP2 hands a unit's outputs over as views of its backward hook, which refuses
    in-place writes. The op's out-of-place form where nothing reads the input after it, else
    a copy of the input that it and its later readers take."""
    graph = unit.graph
    order = {node: index for index, node in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        for written in [w for w in written_inputs(node) if w.op == "placeholder"]:
            later = [user for user in written.users if order.get(user, -1) > order[node]]
            packet = node.target.overloadpacket.__name__
            functional = getattr(getattr(torch.ops.aten, packet[:-1], None), node.target._overloadname,
                                 None) if packet.endswith("_") else None
            if functional is not None and not later and node.args[0] is written:
                node.target = functional
                continue
            with graph.inserting_before(node):
                copy = graph.call_function(torch.ops.aten.clone.default, (written,))
            copy.meta = dict(written.meta)
            for user in [node, *later]:
                user.replace_input_with(written, copy)
    graph.lint()
    unit.recompile()


def _call_units_in_model_order(split: fx.GraphModule) -> None:
    """Call the units in the model's order (their numbers) wherever the data flow allows.
    `split_module` calls them in a depth-first order of its own: a layer whose attention and MLP
    read the same norm (Falcon, GPT-J) ran its MLP first, so the MLP's wide activations were
    alive through the attention, and FSDP2, which prefetches each group's backward by the order
    the forwards ended, gathered another group than the one the planner priced. The values
    computed are the same in either order."""
    graph = split.graph
    body = [node for node in graph.nodes if node.op not in ("placeholder", "output")]
    position = {node: index for index, node in enumerate(body)}

    def unit(node: fx.Node) -> int:       # a unit's call, or what reads one (its outputs' getitem)
        if node.op == "call_module":
            return int(node.target.rpartition("_")[2])
        return max((unit(source) for source in node.all_input_nodes if source in position), default=-1)

    waiting = {node: sum(source in position for source in node.all_input_nodes) for node in body}
    ready = [(unit(node), position[node], node) for node in body if not waiting[node]]
    heapq.heapify(ready)
    output = next(node for node in graph.nodes if node.op == "output")
    while ready:
        *_, node = heapq.heappop(ready)
        output.prepend(node)
        for user in node.users:
            if user in waiting:
                waiting[user] -= 1
                if not waiting[user]:
                    heapq.heappush(ready, (unit(user), position[user], user))
    graph.lint()
    split.recompile()


def _check_order(module: fx.GraphModule, unit_of_node: dict[str, int], unit_stage: list[int]):
    """A stage may not read a value of a later stage: a pipeline runs its stages in order."""
    for node in module.graph.nodes:
        if node.name not in unit_of_node:
            continue
        stage = unit_stage[unit_of_node[node.name]]
        for source in node.all_input_nodes:
            source_stage = unit_stage[unit_of_node[source.name]] if source.name in unit_of_node else 0
            if source_stage > stage:
                raise PlanMismatchError(
                    f"{node.name} ({_module_of(node)}) in pipeline stage {stage} reads {source.name} "
                    f"({_module_of(source)}) of the later stage {source_stage}; stages must follow "
                    f"the model's data flow: put both modules in one stage, or plan again")


def _module_of(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    paths = [path for path, _ in stack.values() if path]
    return f"module {paths[-1]}" if paths else "the model's own forward"


def _stage_of_top_node(node: fx.Node, stage_of_call: dict[str, int]) -> int:
    if node.op == "call_module":
        return stage_of_call[node.target]
    # getitem on a unit's tuple output goes with that unit
    producers = [_stage_of_top_node(n, stage_of_call) for n in node.all_input_nodes
                 if n.op != "placeholder"]
    return max(producers) if producers else 0
