"""The program the passes read and write: one pipeline stage's GraphModule and what it came from.

`export_for_pipeline` turns the model into the first program, one flat ATen GraphModule whose
tensors are `TensorRef` modules. `split_module` (the stage split) turns a parameter read (`get_attr`
of a tensor) into an input of the submodule, which would leave every parameter at the top; held
in a `TensorRef`, a parameter remembers its original name (`layers.0.attn.wq.weight`), so a stage
owns exactly the parameters it reads, fills them from a full state dict, and gives them back under
the same names. The runtime reads these types too (checkpoints, tied weights, materializing a meta
model); they live here because passes never import the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import fx, nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._pytree import tree_unflatten

from autopar.errors import PlanMismatchError


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
    # the captured graph's name of each value the stage takes, in order (Plan.nodes's keys)
    input_values: tuple[str, ...] = ()
    output_values: tuple[str, ...] = ()     # those it sends: the next stage's inputs, in order
    # the stage's layers that recompute may wrap (the repeated blocks, as Megatron's recompute
    # does): submodule name ("submod_3") -> the layer's module path ("layers.1")
    blocks: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True, slots=True)
class PassTarget:
    """Where a stage's program runs, as the passes need it beyond the plan."""
    tp_mesh: DeviceMesh | None = None       # the stage's tensor-parallel sub-mesh; None without tp
    tp_axis: int | None = None              # the index of "tp" in the plan's per-axis placements
    compute_dtype: torch.dtype | None = None    # mixed precision's 16-bit dtype; None in fp32
    # the data-parallel group BatchNorm normalizes over (sync_batchnorm); None: each replica's own
    batch_norm_group: ProcessGroup | None = None
    # ep -> the (pp, edp, ep) mesh of the stages of that expert-parallel degree > 1
    # (autopar.passes.expert_parallel); empty when no stage splits experts
    expert_meshes: dict[int, DeviceMesh] = field(default_factory=dict)
    # context parallelism (context_parallel.py): the group of ranks that split each sequence,
    # this rank's place in it, and what the split rewrites; None without context parallelism
    cp_group: ProcessGroup | None = None
    cp_rank: int = 0
    sequence_split: object = None
    # the rank's device: the stages' example runs make their tensors there (the model's weights
    # are there, or on meta until they are filled, and ops the capture traced keep their device)
    device: torch.device = torch.device("cpu")


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


def parameter_names(module: nn.Module) -> dict[str, str]:
    """Stage-local name -> model fqn of every parameter `module` holds."""
    return {f"{path}.value": ref.fqn for path, ref in module.named_modules()
            if isinstance(ref, TensorRef) and isinstance(ref.value, nn.Parameter)}


def is_tensor_read(module: fx.GraphModule, node: fx.Node) -> bool:
    """Whether `node` fetches one of the model's tensors (a call of a TensorRef)."""
    return node.op == "call_module" and isinstance(module.get_submodule(node.target), TensorRef)


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
    regions = set()
    for node in module.graph.nodes:
        if node.op == "get_attr":
            value = _attribute(module, node.target)
            if isinstance(value, torch.Tensor):
                # a fresh name: the node's own may be the tensor's attribute name on the model
                name = f"ref_{node.name}"
                module.add_submodule(name, TensorRef(node.target, value))
                node.op, node.target = "call_module", name
            elif isinstance(value, fx.GraphModule):
                # the body of a no-grad or autocast region, which the export names submod_N:
                # renamed, as the stage split names its parts so (split_module)
                regions.add(node.target)
                node.target = f"region_{node.name}"
                module.add_submodule(node.target, value)
    for name in regions:
        delattr(module, name)
    module.graph.lint()
    module.recompile()
    return module


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


def _attribute(module: nn.Module, qualname: str):
    owner, _, name = qualname.rpartition(".")
    return getattr(module.get_submodule(owner), name)


def retarget_devices(module: fx.GraphModule, device: torch.device) -> None:
    """An export on meta records device='meta' in ops that create tensors (a position `arange`)
    and in its metadata checks: point them at this rank's device."""
    changed = False
    for node in module.graph.nodes:
        if isinstance(node.kwargs.get("device"), torch.device) and node.kwargs["device"].type == "meta":
            node.kwargs = {**node.kwargs, "device": device}
            changed = True
    if changed:
        module.recompile()
