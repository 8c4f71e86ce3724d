"""DTensor sharding rules for ATen ops that torch's DTensor does not cover yet.

CPU attention (`_scaled_dot_product_flash_attention_for_cpu` and its backward) has no rule in
torch, while the CUDA kernels do; without one every attention would fail under tensor
parallelism on gloo. The rule mirrors torch's CUDA one: replicated, sharded on heads (dim 1), or
sharded on batch (dim 0). A mask is sharded along with the inputs unless it broadcasts on that dim.
Registered once, on import.

Any other op that DTensor has no rule for (a model's custom op, such as the grouped matmul of
mixture-of-experts layers) runs replicated inside a tensor-parallel stage: `replicate_ops_without_rule`.
"""

from __future__ import annotations

import torch
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding
from torch.utils._pytree import tree_map

aten = torch.ops.aten


def _mask_placement(attn_mask, dim: int):
    """A mask of size 1 on the sharded dim broadcasts, so every rank keeps all of it."""
    return Shard(dim) if attn_mask.shape[dim] > 1 else Replicate()


def _strategies(n_outputs: int, tensors_before: int, attn_mask, dims=(None, 1, 0)):
    """(outputs, inputs) placement lists: all replicated, then sharded on each of `dims`."""
    result = []
    for dim in dims:
        place = Replicate() if dim is None else Shard(dim)
        inputs = [place] * tensors_before + [None, None]       # dropout_p, is_causal
        if attn_mask is not None:
            inputs.append(Replicate() if dim is None else _mask_placement(attn_mask, dim))
        result.append(([place] * n_outputs, inputs))
    return result


@register_sharding(aten._scaled_dot_product_flash_attention_for_cpu.default)
def _sdpa_cpu_forward(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    """Outputs (attention, logsumexp) follow query, key and value."""
    return _strategies(2, 3, attn_mask)


@register_sharding(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
def _sdpa_cpu_backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *,
                       attn_mask=None, scale=None):
    """Gradients of query, key and value follow every tensor input."""
    return _strategies(3, 6, attn_mask)


def has_dtensor_rule(op) -> bool:
    """Whether DTensor can run `op` on DTensors: a sharding rule or strategy, a custom handler,
    or a composite kernel that DTensor decomposes into ops that have rules."""
    if not isinstance(op, torch._ops.OpOverload):
        return True         # Python functions and operator.getitem see DTensors as values
    dispatcher = DTensor._op_dispatcher
    propagator = dispatcher.sharding_propagator
    return (op in propagator.op_strategy_funcs or op in propagator.op_to_rules
            or op in propagator.op_single_dim_strategy_funcs or op in dispatcher._custom_op_handlers
            or torch._C._dispatch_has_kernel_for_dispatch_key(
                op.name(), torch._C.DispatchKey.CompositeImplicitAutograd))


class RunReplicated(nn.Module):
    """Runs `op` on whole plain tensors and returns replicated DTensors: what an op without a
    DTensor rule does under tensor parallelism (always correct; the planner prices such ops as
    replicated and lists them in `Plan.replicated_ops`). DTensor inputs are gathered first; the
    backward of that gather hands each rank's identical gradient back as replicated."""

    def __init__(self, op, mesh: DeviceMesh):
        super().__init__()
        self.op, self.mesh = op, mesh

    def forward(self, *args, **kwargs):
        def whole(value):
            if isinstance(value, DTensor):
                return value.redistribute(self.mesh, [Replicate()] * self.mesh.ndim).to_local()
            return value

        def replicated(value):
            if isinstance(value, torch.Tensor):
                return DTensor.from_local(value, self.mesh, [Replicate()] * self.mesh.ndim,
                                          run_check=False)
            return value

        return tree_map(replicated, self.op(*tree_map(whole, args), **tree_map(whole, kwargs)))

    def extra_repr(self) -> str:
        return f"op={self.op}"


class CheckLocal(nn.Module):
    """`_assert_tensor_metadata` (which export puts before dtype casts) on a DTensor: its dtype,
    device and layout are its local tensor's; its size and stride are global, so those are left to
    DTensor, and nothing is gathered for a check."""

    def forward(self, value, size=None, stride=None, dtype=None, **checks):
        local = value.to_local() if isinstance(value, DTensor) else value
        return aten._assert_tensor_metadata.default(local, dtype=dtype, **checks)


def replicate_ops_without_rule(module: nn.Module, mesh: DeviceMesh) -> list[str]:
    """Every op of `module`'s graphs that DTensor has no rule for runs replicated (RunReplicated)
    instead of failing at its first call; returns the ops, by name."""
    replaced = []
    for graph_module in [m for m in module.modules() if isinstance(m, fx.GraphModule)]:
        for node in list(graph_module.graph.nodes):
            # ops that create a tensor from nothing see no DTensor (replicate_created_tensors)
            if node.op != "call_function" or not node.all_input_nodes or has_dtensor_rule(node.target):
                continue
            if node.target == aten._assert_tensor_metadata.default:
                name = f"check_{node.name}"
                graph_module.add_submodule(name, CheckLocal())
            else:
                name = f"replicated_{node.name}"
                graph_module.add_submodule(name, RunReplicated(node.target, mesh))
                replaced.append(str(node.target))
            node.op, node.target = "call_module", name
        graph_module.recompile()
    return sorted(set(replaced))
