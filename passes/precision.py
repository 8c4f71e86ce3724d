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

from autopar.mixed_dtypes import casts_following_weights
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
    `op(input, weight)` (autopar.mixed_dtypes.casts_following_weights, the rule the estimator
    prices values by). Before FSDP2 wraps the stage: a graph recompiled after it swapped the
    module's class calls itself."""
    for graph_module in [m for m in module.modules() if isinstance(m, fx.GraphModule)]:
        following = casts_following_weights(graph_module.graph, parameter_dtype(graph_module))
        for node, weight in following.items():
            with graph_module.graph.inserting_before(node):
                # the weight read again where the cast is: its own read stays with the op that
                # reads it, wherever recompute's regions later put the cast and the op
                weight = graph_module.graph.call_module(weight.target)
                dtype = graph_module.graph.call_function(_dtype_of, (weight,))
            if node.target is torch.ops.aten.to.dtype:
                node.args = (node.args[0], dtype, *node.args[2:])
            else:
                node.kwargs = {**node.kwargs, "dtype": dtype}
        if following:
            graph_module.recompile()


def parameter_dtype(graph_module: fx.GraphModule):
    """A node's captured dtype where it reads a parameter (a TensorRef call), else None."""
    def dtype(node: fx.Node) -> torch.dtype | None:
        if node.op != "call_module":
            return None
        ref = graph_module.get_submodule(node.target)
        return ref.value.dtype if isinstance(ref, TensorRef) and isinstance(ref.value, nn.Parameter) else None
    return dtype


def _dtype_of(tensor: torch.Tensor) -> torch.dtype:
    return tensor.dtype
