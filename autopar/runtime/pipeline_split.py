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
Values that a later stage reads are passed along the stages between (pipeline_flow.py). Two
`split_module` passes follow:

1. one submodule per layer ("unit"), so recompute can wrap exactly one layer in a checkpoint
   ("full"), or, with the single-stage recompute pass on the unit's graph, only the attention of
   a layer ("selective");
2. the units grouped into one GraphModule per stage, which is what a `PipelineStage` runs.

`split_module` turns a parameter read (`get_attr` of a tensor) into an input of the submodule, which
would leave every parameter at the top; so each parameter is first put in a `TensorRef` module that
remembers its original name (`layers.0.attn.wq.weight`). A stage then owns exactly the parameters
it reads, fills them from a full state dict, and gives them back under the same names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import fx, nn
from torch.fx.passes.split_module import split_module
from torch.utils._pytree import tree_unflatten

from autopar.errors import PlanMismatchError
from autopar.passes.recompute import Recomputed, checkpoint_regions
from autopar.runtime.pipeline_flow import interface_examples, order_interfaces, pass_along
from autopar.plans.stage_flow import (BUFFER, FUNCTION, INPUT, OTHER, OUTPUT, PARAMETER, FlowNode,
                                       assign_units, dead, reader_unit, shared_values)


@dataclass(kw_only=True, slots=True)
class StageProgram:
    """One pipeline stage: its GraphModule and where each of its parameters came from."""
    index: int
    module: nn.Module                 # the stage's GraphModule, or a wrapper around it
    param_names: dict[str, str] = field(default_factory=dict)   # stage-local name -> model fqn
    out_spec: object = None           # the model's output structure (see model_outputs)
    # parameters that several stages hold a copy of (tied weights): fqn -> those stages, the same
    # for every stage of the model
    tied: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # what the stage takes and returns for one micro-batch, as meta tensors (PipelineStage's
    # input_args and output_args)
    example_inputs: tuple = ()
    example_outputs: tuple = ()
    # activations some stage reads more than one stage after the one that computes them, relayed
    # through the stages between (the same for every stage of the model)
    relayed: tuple[str, ...] = ()
    # the model's tensor keyword inputs (attention masks) that the first stage takes after its
    # positional inputs, in this order (the same for every stage of the model)
    keywords: tuple[str, ...] = ()


class TensorRef(nn.Module):
    """Holds one parameter (or buffer, or constant) of the model; calling it returns the tensor."""

    def __init__(self, fqn: str, tensor: torch.Tensor):
        super().__init__()
        self.fqn = fqn
        if isinstance(tensor, nn.Parameter):
            self.value = tensor
        else:
            self.register_buffer("value", tensor)

    def forward(self) -> torch.Tensor:
        return self.value


def export_for_pipeline(model: nn.Module, example_inputs: tuple, program=None,
                        example_kwargs: dict | None = None) -> fx.GraphModule:
    """The model as one flat ATen GraphModule whose tensors are `TensorRef` modules.

    `program` is the model's ExportedProgram when there is one already (a capture); it must be
    for ONE micro-batch, as an export here is: shapes in the graph are static, and a stage only
    ever sees micro-batches. `example_kwargs` are constants the model is always called with
    (`use_cache=False`): the export bakes them in."""
    if program is None:
        program = torch.export.export(model, tuple(example_inputs), dict(example_kwargs or {}),
                                      strict=False)
    module = program.module()
    # The guard checks the whole model's input shapes; stages are called with their own inputs.
    for node in list(module.graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            module.graph.erase_node(node)
    for node in module.graph.nodes:
        if node.op == "get_attr":
            tensor = _attribute(module, node.target)
            if isinstance(tensor, torch.Tensor):
                # a fresh name: the node's own may be the tensor's attribute name on the model
                name = f"ref_{node.name}"
                module.add_submodule(name, TensorRef(node.target, tensor))
                node.op, node.target = "call_module", name
    module.graph.lint()
    module.recompile()
    return module


def split_stages(module: fx.GraphModule, stage_layers: list[list[str]],
                 recompute: list[str] | None = None, blocks: set[str] | None = None,
                 boundary_dtype: torch.dtype | None = None) -> list[StageProgram]:
    """One StageProgram per entry of `stage_layers` (module paths in model order). `blocks`: the
    layers that recompute wraps (the repeated blocks, as Megatron's recompute does); default all.
    `boundary_dtype`: mixed precision's 16-bit dtype, which floating values cross stages in.

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
    recompute = recompute or ["none"] * len(stage_layers)
    _wrap_recomputed_units(by_unit, units, unit_stage, recompute, set(units) if blocks is None else blocks)

    stage_of_call = {f"submod_{u}": unit_stage[u] for u in range(len(units))}
    by_stage = split_module(by_unit, by_unit, lambda node: _stage_of_top_node(node, stage_of_call),
                            keep_original_node_name=True)
    for index in range(len(stage_layers)):
        if not hasattr(by_stage, f"submod_{index}"):
            raise PlanMismatchError(f"pipeline stage {index} (layers {stage_layers[index]}) computes "
                                    f"nothing in this model; plan this model again")
    order_interfaces(by_stage, len(stage_layers), [node.name for node in taken], boundary_dtype)
    programs = []
    for index in range(len(stage_layers)):
        stage_module = getattr(by_stage, f"submod_{index}")
        names = {f"{path}.value": ref.fqn for path, ref in stage_module.named_modules()
                 if isinstance(ref, TensorRef) and isinstance(ref.value, nn.Parameter)}
        programs.append(StageProgram(index=index, module=stage_module, param_names=names,
                                     out_spec=out_spec, relayed=relayed, keywords=keywords))
    tied = tied_stages(programs)
    examples = interface_examples([program.module for program in programs], inputs)
    for program, (example_inputs, example_outputs) in zip(programs, examples):
        program.tied = tied
        program.example_inputs, program.example_outputs = example_inputs, example_outputs
    return programs


def tied_stages(programs: list[StageProgram]) -> dict[str, tuple[int, ...]]:
    """fqn -> the stages holding a copy, for every parameter that more than one stage holds."""
    holders: dict[str, list[int]] = {}
    for program in programs:
        for fqn in sorted(set(program.param_names.values())):
            holders.setdefault(fqn, []).append(program.index)
    return {fqn: tuple(stages) for fqn, stages in holders.items() if len(stages) > 1}


def signature(module: fx.GraphModule) -> tuple[list[fx.Node], tuple[str, ...], object]:
    """The placeholders the first stage takes: the model's positional inputs, then its tensor
    keyword inputs (attention masks) in captured order; the names of those keywords; and the
    model's output structure. Keywords that are not tensors (use_cache=False) are constants baked
    into the graph, which a stage does not take."""
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    info = getattr(module.graph._codegen, "pytree_info", None)
    if info is None or info.in_spec is None:
        return placeholders, (), None
    args_spec = info.in_spec.child(0) if info.in_spec.type is tuple else info.in_spec
    taken, keywords = placeholders[:args_spec.num_leaves], []
    if info.in_spec.type is tuple and info.in_spec.num_children > 1:
        kwargs_spec = info.in_spec.child(1)
        leaves = iter(placeholders[args_spec.num_leaves:])
        for name, child in zip(kwargs_spec.context, kwargs_spec.children()):
            nodes = [next(leaves) for _ in range(child.num_leaves)]
            tensors = [n for n in nodes if isinstance(n.meta.get("val"), torch.Tensor)]
            if tensors and (len(nodes) != 1 or not child.is_leaf()):
                raise PlanMismatchError(f"keyword input {name!r} is a {child.type.__name__} holding "
                                        f"tensors; pass each tensor as a keyword of its own")
            if tensors:
                taken.append(tensors[0])
                keywords.append(name)
    return taken, tuple(keywords), info.out_spec


def model_outputs(outputs, out_spec):
    """The model's own output (a ModelOutput, a tuple, a tensor) from the last stage's flat outputs."""
    if out_spec is None:
        return outputs
    leaves = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
    return tree_unflatten(leaves, out_spec)


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
        elif _is_ref(module, node):
            kind = PARAMETER if isinstance(module.get_submodule(node.target).value, nn.Parameter) \
                else BUFFER
        else:
            kind = FUNCTION if node.op == "call_function" else OTHER
        stack = node.meta.get("nn_module_stack") or {}
        paths = [path for path, _ in stack.values()]
        nodes.append(FlowNode(name=node.name, kind=kind,
                              inputs=tuple(n.name for n in node.all_input_nodes),
                              module_path=paths[-1] if paths else "", target=str(node.target),
                              effect=kind not in (INPUT, OUTPUT) and node.is_impure()))
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
    refs = {unit_stage[first]: node.target} if _is_ref(module, node) else {}
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


def _wrap_recomputed_units(by_unit: fx.GraphModule, units: list[str], unit_stage: list[int],
                           recompute: list[str], blocks: set[str]):
    """Recompute per stage: with "full" every layer of the stage runs under a checkpoint, so only
    layer inputs stay alive between forward and backward; with "selective" only each layer's
    attention does (the intra-op recompute pass, run on the layer's own graph)."""
    for unit, stage in enumerate(unit_stage):
        name = f"submod_{unit}"
        # a unit without nodes (an identity dropout) has no submodule
        if recompute[stage] == "none" or units[unit] not in blocks or not hasattr(by_unit, name):
            continue
        unit_module = getattr(by_unit, name)
        if recompute[stage] == "selective":
            setattr(by_unit, name, checkpoint_regions(
                unit_module, (units[unit],), selective=True,
                reads_tensor=lambda node, module=unit_module: _is_ref(module, node)))
        else:
            setattr(by_unit, name, Recomputed(unit_module))


def _attribute(module: nn.Module, qualname: str):
    owner, _, name = qualname.rpartition(".")
    return getattr(module.get_submodule(owner), name)
