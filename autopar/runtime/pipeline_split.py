"""Cut a captured model into the plan's pipeline stages.

The plan names each stage's layers by module path ("embed", "layers.0", ..., "head"). Every node of
the exported graph belongs to the layer whose path prefixes its `nn_module_stack`; nodes outside any
module (glue in the model's own forward) follow their inputs, or their first user when they read
nothing (a position `arange`). Two `split_module` passes follow:

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

from autopar.errors import PlanMismatchError
from autopar.passes.recompute import Recomputed, checkpoint_regions


@dataclass(kw_only=True, slots=True)
class StageProgram:
    """One pipeline stage: its GraphModule and where each of its parameters came from."""
    index: int
    module: nn.Module                 # the stage's GraphModule, or a wrapper around it
    param_names: dict[str, str] = field(default_factory=dict)   # stage-local name -> model fqn


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


def export_for_pipeline(model: nn.Module, example_inputs: tuple, program=None) -> fx.GraphModule:
    """The model as one flat ATen GraphModule whose tensors are `TensorRef` modules.

    `program` is the model's ExportedProgram when there is one already (a capture); it must be
    for ONE micro-batch, as an export here is: shapes in the graph are static, and a stage only
    ever sees micro-batches."""
    if program is None:
        program = torch.export.export(model, tuple(example_inputs), strict=False)
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
                 recompute: list[str] | None = None, blocks: set[str] | None = None) -> list[StageProgram]:
    """One StageProgram per entry of `stage_layers` (module paths in model order). `blocks`: the
    layers that recompute wraps (the repeated blocks, as Megatron's recompute does); default all."""
    units = [path for layers in stage_layers for path in layers]
    unit_stage = [s for s, layers in enumerate(stage_layers) for _ in layers]
    unit_of_node = _assign_units(module, units)
    _check_stage_flow(module, unit_of_node, unit_stage)

    by_unit = split_module(module, module, lambda node: unit_of_node[node.name],
                           keep_original_node_name=True)
    recompute = recompute or ["none"] * len(stage_layers)
    _wrap_recomputed_units(by_unit, units, unit_stage, recompute, set(units) if blocks is None else blocks)

    stage_of_call = {f"submod_{u}": unit_stage[u] for u in range(len(units))}
    by_stage = split_module(by_unit, by_unit, lambda node: _stage_of_top_node(node, stage_of_call),
                            keep_original_node_name=True)
    programs = []
    for index in range(len(stage_layers)):
        if not hasattr(by_stage, f"submod_{index}"):
            raise PlanMismatchError(f"pipeline stage {index} (layers {stage_layers[index]}) computes "
                                    f"nothing in this model; plan this model again")
        stage_module = getattr(by_stage, f"submod_{index}")
        names = {f"{path}.value": ref.fqn for path, ref in stage_module.named_modules()
                 if isinstance(ref, TensorRef) and isinstance(ref.value, nn.Parameter)}
        programs.append(StageProgram(index=index, module=stage_module, param_names=names))
    return programs


def _assign_units(module: fx.GraphModule, units: list[str]) -> dict[str, int]:
    """Unit index of every node that is not a graph input or output.

    A node belongs to the layer its module path is in; glue outside any layer follows its latest
    input. Constants (buffers and what is computed from them alone, e.g. rotary tables or a
    position `arange`) are copied into every unit that reads them, so no stage waits for another's."""
    def unit_of_path(path: str) -> int | None:
        for index, unit in enumerate(units):
            if path == unit or path.startswith(unit + "."):
                return index
        return None

    constants = _constants(module)
    assigned: dict[str, int] = {}
    for node in module.graph.nodes:
        if node.op in ("placeholder", "output") or node in constants:
            continue
        if _is_ref(module, node):
            unit = unit_of_path(module.get_submodule(node.target).fqn)
        else:
            stack = node.meta.get("nn_module_stack") or {}
            paths = [path for path, _ in stack.values()]
            unit = unit_of_path(paths[-1]) if paths else None
            if unit is None:
                inputs = [assigned[n.name] for n in node.all_input_nodes if n.name in assigned]
                unit = max(inputs) if inputs else None
        if unit is None:
            raise PlanMismatchError(
                f"graph node {node.name} ({node.target}) belongs to none of the plan's layers {units}; "
                f"the plan was made for another model, plan it again")
        assigned[node.name] = unit
    for node in reversed(constants):
        _copy_per_unit(module, node, assigned)
    module.recompile()
    return assigned


def _constants(module: fx.GraphModule) -> list[fx.Node]:
    """Buffers and nodes computed from nothing but buffers and constants, in graph order."""
    constants: list[fx.Node] = []
    for node in module.graph.nodes:
        if _is_ref(module, node):
            if not isinstance(module.get_submodule(node.target).value, nn.Parameter):
                constants.append(node)
        elif node.op == "call_function" and all(n in constants for n in node.all_input_nodes):
            constants.append(node)
    return constants


def _copy_per_unit(module: fx.GraphModule, node: fx.Node, assigned: dict[str, int]) -> None:
    """Give `node` the first unit that reads it and a copy of it to each other unit."""
    by_unit: dict[int, list[fx.Node]] = {}
    for user in node.users:
        if user.op != "output":
            by_unit.setdefault(assigned[user.name], []).append(user)
    if not by_unit:
        raise PlanMismatchError(f"constant {node.name} ({node.target}) feeds none of the plan's "
                                f"layers; the plan was made for another model, plan it again")
    first, *others = sorted(by_unit)
    assigned[node.name] = first
    for unit in others:
        with module.graph.inserting_after(node):
            copy = module.graph.node_copy(node)
        for user in by_unit[unit]:
            user.replace_input_with(node, copy)
        assigned[copy.name] = unit


def _is_ref(module: fx.GraphModule, node: fx.Node) -> bool:
    return node.op == "call_module" and isinstance(module.get_submodule(node.target), TensorRef)


def _check_stage_flow(module: fx.GraphModule, unit_of_node: dict[str, int], unit_stage: list[int]):
    """A stage may read only its own values, the model inputs, and values of the stage just before
    it: a pipeline passes activations to the next stage only."""
    for node in module.graph.nodes:
        if node.op == "placeholder":
            later = sorted({unit_stage[unit_of_node[user.name]] for user in node.users
                            if user.name in unit_of_node} - {0})
            if later:
                raise PlanMismatchError(
                    f"model input {node.name} is read by pipeline stage(s) {later}; a pipeline hands "
                    f"only activations from stage to stage, so only the first stage may read inputs")
        if node.name not in unit_of_node:
            continue
        stage = unit_stage[unit_of_node[node.name]]
        for source in node.all_input_nodes:
            if source.op == "placeholder" or source.name not in unit_of_node:
                continue
            source_stage = unit_stage[unit_of_node[source.name]]
            if _is_ref(module, source) and source_stage != stage:
                raise PlanMismatchError(
                    f"parameter {source.target} is used in pipeline stages {source_stage} and {stage} "
                    f"(tied weights); put the layers that share it in one stage")
            if source_stage not in (stage, stage - 1):
                raise PlanMismatchError(
                    f"{node.name} in pipeline stage {stage} reads {source.name} of stage "
                    f"{source_stage}; stages must follow the model's data flow in order")


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
