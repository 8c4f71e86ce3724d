"""Mixed precision's graph rewrites.

Under bf16 or fp16 a stage computes under autocast (the runtime's hooks, autopar.runtime.precision):
- values are 16-bit where the trace saw fp32, so the export's `_assert_tensor_metadata` checks would
  fail, and they compute nothing: they go (`drop_traced_dtype_checks`);
- FSDP2 may hand a stage its weights in 16 bits, so a cast to a weight's traced dtype reads the
  weight's dtype at run time (`cast_to_weight_dtypes`).
"""

from __future__ import annotations

import torch
from torch import fx, nn

from autopar.passes.dtensor_adapters import drop_metadata_checks
from autopar.passes.program import PassTarget, StageProgram, TensorRef


def drop_traced_dtype_checks(program: StageProgram, plan, target: PassTarget) -> StageProgram:
    """The stage without the export's dtype checks when it computes in 16 bits."""
    if target.compute_dtype is not None:
        drop_metadata_checks(program.module)
    return program


def cast_to_weight_dtypes(program: StageProgram, plan, target: PassTarget) -> StageProgram:
    """Under mixed precision, casts follow their weight's dtype at run time (`follow_weight_dtypes`)."""
    if target.compute_dtype is not None:
        follow_weight_dtypes(program.module)
    return program


def follow_weight_dtypes(module: nn.Module) -> None:
    """Each cast to a weight's captured dtype whose result an op reads together with that weight
    (or a view of it) reads the weight's dtype at run time instead: `input.to(weight.dtype)` for
    `op(input, weight)`. (The trace kept the target dtype, not where it came from; a cast made for
    the op that also reads the weight is the one the weight's dtype decides.) Before FSDP2 wraps
    the stage: a graph recompiled after it swapped the module's class calls itself."""
    for graph_module in [m for m in module.modules() if isinstance(m, fx.GraphModule)]:
        order = {node: index for index, node in enumerate(graph_module.graph.nodes)}
        changed = False
        for node in list(graph_module.graph.nodes):
            target = _cast_dtype(node)
            weights = [] if target is None else [
                weight for user in node.users for weight in _weights_read(graph_module, user, node)
                if graph_module.get_submodule(weight.target).value.dtype == target]
            if not weights:
                continue
            with graph_module.graph.inserting_before(node):
                # the weight as read where the cast is (a parameter's node may come later)
                weight = weights[0] if order[weights[0]] < order[node] else \
                    graph_module.graph.call_module(weights[0].target)
                dtype = graph_module.graph.call_function(_dtype_of, (weight,))
            if node.target is torch.ops.aten.to.dtype:
                node.args = (node.args[0], dtype, *node.args[2:])
            else:
                node.kwargs = {**node.kwargs, "dtype": dtype}
            changed = True
        if changed:
            graph_module.recompile()


_CASTS = (torch.ops.aten.to.dtype, torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype_layout)


def _cast_dtype(node: fx.Node) -> torch.dtype | None:
    """The floating dtype a cast node converts to, or None for any other node."""
    if node.op != "call_function" or node.target not in _CASTS:
        return None
    dtype = node.args[1] if node.target is torch.ops.aten.to.dtype else node.kwargs.get("dtype")
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def _weights_read(graph_module: fx.GraphModule, user: fx.Node, cast: fx.Node) -> list[fx.Node]:
    """The parameter nodes (TensorRef calls) whose values `user` reads, directly or through views,
    besides `cast`."""
    found = []
    for arg in user.all_input_nodes:
        while (arg is not cast and arg.op == "call_function" and isinstance(arg.target, torch._ops.OpOverload)
               and arg.target.is_view and arg.target not in _CASTS and arg.args):
            arg = arg.args[0]
        if arg is not cast and arg.op == "call_module":
            ref = graph_module.get_submodule(arg.target)
            if isinstance(ref, TensorRef) and isinstance(ref.value, nn.Parameter):
                found.append(arg)
    return found


def _dtype_of(tensor: torch.Tensor) -> torch.dtype:
    return tensor.dtype
