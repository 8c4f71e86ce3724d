"""DTensor sharding rules for ATen ops that torch's DTensor does not cover yet.

CPU attention (`_scaled_dot_product_flash_attention_for_cpu` and its backward) has no rule in
torch, while the CUDA kernels do; without one every attention would fail under tensor
parallelism on gloo. The rule mirrors torch's CUDA one: replicated, sharded on heads (dim 1), or
sharded on batch (dim 0). A mask is sharded along with the inputs unless it broadcasts on that dim.
Registered once, on import.

Any other op that DTensor has no rule for (a model's custom op, such as the grouped matmul of
mixture-of-experts layers), or that autopar's rules (cost.strategies) do not cover and the planner
therefore priced as replicated, runs replicated inside a tensor-parallel stage:
`replicate_ops_without_rule`. So does an op whose DTensor support covers only some placements
(`PARTIAL_RULES`), unless the plan places it by one of autopar's own strategies, which
`RunByStrategy` runs on local shards.
"""

from __future__ import annotations

import torch
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from autopar.cost.strategies import OpView, axis_strategies
from autopar.models import capped_attention  # noqa: F401  (its ops, for the rules below)
from autopar.errors import AutoparError
from autopar.passes.program import is_tensor_read
from autopar.tracer import plain_arguments

aten = torch.ops.aten

# Ops that DTensor supports for some placements only. Convolutions go to DTensor's halo-exchange
# handler, which splits the input's width with the weight whole: a weight split on its output
# channels meets a whole bias there (ViT's patch embedding under tensor parallelism failed so).
# conv1d/2d/3d decompose into `convolution` inside DTensor, so they are listed too.
PARTIAL_RULES = frozenset({aten.convolution.default, aten.conv1d.default, aten.conv2d.default,
                           aten.conv3d.default, aten.conv1d.padding, aten.conv2d.padding,
                           aten.conv3d.padding})


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


def _capped_strategies(n_outputs: int, tensors_before: int, attn_mask, sinks, scalars: int):
    """autopar::attention and its backward: replicated, heads split (the sinks with them), or
    the batch split where there are no sinks (their gradient would be a partial sum)."""
    result = []
    for dim in (None, 1) if sinks is not None else (None, 1, 0):
        place = Replicate() if dim is None else Shard(dim)
        mask = None if attn_mask is None else (
            Replicate() if dim is None or len(attn_mask.shape) < 4 else _mask_placement(attn_mask, dim))
        sink = None if sinks is None else (Shard(0) if dim == 1 else Replicate())
        outputs = [place] * 3 + [Shard(0) if dim == 1 else Replicate()] if n_outputs == 4 else [place]
        result.append((outputs, [place] * tensors_before + [mask] + [None] * scalars + [sink]))
    return result


@register_sharding(torch.ops.autopar.attention.default)
def _capped_forward(query, key, value, attn_mask, dropout_p, is_causal, scale, softcap, sinks):
    return _capped_strategies(1, 3, attn_mask, sinks, 4)


@register_sharding(torch.ops.autopar.attention_backward.default)
def _capped_backward(grad_out, query, key, value, out, attn_mask, is_causal, scale, softcap, sinks):
    return _capped_strategies(4, 5, attn_mask, sinks, 3)


def has_dtensor_rule(op) -> bool:
    """Whether DTensor can run `op` on DTensors: a sharding rule or strategy, a custom handler,
    or a composite kernel that DTensor decomposes into ops that have rules."""
    if not isinstance(op, torch._ops.OpOverload):
        return True         # Python functions and operator.getitem see DTensors as values
    if op in PARTIAL_RULES:
        return False
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
    backward of that gather hands each rank's identical gradient back as replicated.

    A weight (an input at one of `weights`, the positions of the flattened arguments computed
    from parameters alone) is gathered again when the backward needs it, not kept whole from the
    forward: as DTensor does for the ops it runs, and as the estimator prices it. A whole copy of
    a mixture-of-experts layer's experts kept per micro-batch in flight would hold the memory
    that splitting them saved."""

    def __init__(self, op, mesh: DeviceMesh, weights: tuple[int, ...] = ()):
        super().__init__()
        self.op, self.mesh, self.weights = op, mesh, frozenset(weights)

    def forward(self, *args, **kwargs):
        flat, spec = tree_flatten((args, kwargs))
        gathered = []           # (whole local tensor, the DTensor it was gathered from)
        for position, value in enumerate(flat):
            if isinstance(value, DTensor):
                flat[position] = self._whole(value)
                if position in self.weights:
                    gathered.append((flat[position], value))
        args, kwargs = tree_unflatten(flat, spec)
        # the hooks around this op (a recomputed region's checkpoint) still take what it saves
        # but its weights: torch applies only the innermost, and the op's saved inputs and
        # activations were otherwise kept through a checkpointed layer's forward
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)

        def pack(tensor):
            source = next((source for whole, source in gathered if tensor is whole), None)
            if source is not None:
                return _GatherWhenUnpacked(source)
            return tensor if outer is None else outer[0](tensor)

        def unpack(saved):
            if isinstance(saved, _GatherWhenUnpacked):
                with torch.no_grad():
                    return self._whole(saved.source)
            return saved if outer is None else outer[1](saved)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            result = self.op(*args, **kwargs)
        gathered.clear()        # autograd keeps `pack` with what it saved: not the whole copies
        return tree_map(self._replicated, result)

    def _whole(self, value: DTensor) -> torch.Tensor:
        return value.redistribute(self.mesh, [Replicate()] * self.mesh.ndim).to_local()

    def _replicated(self, value):
        if isinstance(value, torch.Tensor):
            return DTensor.from_local(value, self.mesh, [Replicate()] * self.mesh.ndim, run_check=False)
        return value

    def extra_repr(self) -> str:
        return f"op={self.op}, weights={sorted(self.weights)}"


class _GatherWhenUnpacked:
    """A weight `RunReplicated` saved as its shards, to be gathered whole when unpacked."""

    __slots__ = ("source",)

    def __init__(self, source: DTensor):
        self.source = source


class RunByStrategy(nn.Module):
    """Runs `op` on local shards by one of autopar's strategies for it (cost.strategies): its
    tensor inputs, in the order they appear in the call, moved to `inputs`, the op run on their
    local tensors, the result placed as `output`. For ops whose DTensor support does not cover the
    plan's placements (PARTIAL_RULES)."""

    def __init__(self, op, mesh: DeviceMesh, inputs: tuple[Placement, ...], output: Placement):
        super().__init__()
        self.op, self.mesh, self.inputs, self.output = op, mesh, tuple(inputs), output

    def forward(self, *args, **kwargs):
        flat, spec = tree_flatten((args, kwargs))
        positions = [i for i, value in enumerate(flat) if isinstance(value, torch.Tensor)]
        for position, placement in zip(positions, self.inputs, strict=True):
            flat[position] = self._local(flat[position], placement)
        args, kwargs = tree_unflatten(flat, spec)
        return DTensor.from_local(self.op(*args, **kwargs), self.mesh, (self.output,), run_check=False)

    def _local(self, value: torch.Tensor, placement: Placement) -> torch.Tensor:
        """This rank's part of `value` in `placement`, differentiably, with the placement of the
        gradient that the local op gives it: a shard's gradient is that shard's; a whole input's
        is whole where every rank computes the whole output, and each rank's contribution (a
        partial sum) where the ranks compute parts of it. A whole value read as a partial sum (a
        convolution's bias when the input channels are split) is kept by the first rank and zero
        elsewhere, so its gradient is the first rank's; a partial sum's gradient is whole."""
        if not isinstance(value, DTensor):
            value = DTensor.from_local(value, self.mesh, [Replicate()], run_check=False)
        if placement.is_partial() and not value.placements[0].is_partial():
            local = value.redistribute(self.mesh, (Replicate(),)).to_local(grad_placements=(placement,))
            return local if self.mesh.get_local_rank() == 0 else local * 0
        if placement.is_partial() or placement.is_replicate() and self.output.is_replicate():
            grad = Replicate()
        else:
            grad = Partial() if placement.is_replicate() else placement
        return value.redistribute(self.mesh, (placement,)).to_local(grad_placements=(grad,))

    def extra_repr(self) -> str:
        return f"op={self.op}, inputs={self.inputs}, output={self.output}"


class CheckLocal(nn.Module):
    """`_assert_tensor_metadata` (which export puts before dtype casts) on a DTensor: its dtype,
    device and layout are its local tensor's; its size and stride are global, so those are left to
    DTensor, and nothing is gathered for a check."""

    def forward(self, value, size=None, stride=None, dtype=None, **checks):
        local = value.to_local() if isinstance(value, DTensor) else value
        return aten._assert_tensor_metadata.default(local, dtype=dtype, **checks)


def op_view(node: fx.Node) -> OpView | None:
    """What autopar's rules see of an ATen op node (cost.strategies); None for anything else."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    return OpView(target=str(node.target), args=plain_arguments(node.args),
                  input_shapes=tuple(node_shape(i) for i in node.all_input_nodes),
                  output_shape=node_shape(node))


def node_shape(node: fx.Node) -> tuple[int, ...]:
    value = node.meta.get("val")
    return tuple(int(d) for d in value.shape) if isinstance(value, torch.Tensor) else ()


def replicate_ops_without_rule(module: nn.Module, mesh: DeviceMesh) -> list[str]:
    """Every op of `module`'s graphs that autopar's rules or DTensor's do not cover runs
    replicated (RunReplicated): as the planner priced it, and instead of failing at its first
    call or inside DTensor's decomposition of it (Swin's adaptive_avg_pool1d decomposes into an
    in-place squeeze that DTensor has no rule for). An op that writes its input or returns a view
    of it keeps DTensor's own rule (a gathered copy would take the write); without one it is
    refused. Returns the ops run replicated, by name."""
    replaced = []
    for graph_module in [m for m in module.modules() if isinstance(m, fx.GraphModule)]:
        weights = parameters_only(graph_module)
        for node in list(graph_module.graph.nodes):
            # ops that create a tensor from nothing see no DTensor (replicate_created_tensors)
            if node.op != "call_function" or not node.all_input_nodes:
                continue
            view = op_view(node)
            ruled = view is None or axis_strategies(view) is not None
            if has_dtensor_rule(node.target) and (ruled or _aliases(node.target)):
                continue
            if node.target == aten._assert_tensor_metadata.default:
                name = f"check_{node.name}"
                graph_module.add_submodule(name, CheckLocal())
            elif _aliases(node.target):
                raise AutoparError(
                    f"{node.target} ({node.name}) writes its input or returns a view of it, and "
                    f"DTensor has no rule to run it on sharded values; plan this stage without "
                    f"tensor parallelism (tp=1)")
            else:
                name = f"replicated_{node.name}"
                positions = tuple(k for k, value in enumerate(tree_flatten((node.args, node.kwargs))[0])
                                  if value in weights)
                graph_module.add_submodule(name, RunReplicated(node.target, mesh, positions))
                replaced.append(str(node.target))
            node.op, node.target = "call_module", name
        graph_module.recompile()
    return sorted(set(replaced))


def parameters_only(module: fx.GraphModule) -> set[fx.Node]:
    """The nodes of `module` computed from the model's tensors (parameters, buffers) alone: what
    does not change with the samples, such as a weight, its transpose or its cast."""
    found = set()
    for node in module.graph.nodes:
        inputs = node.all_input_nodes
        if node.op == "get_attr" or is_tensor_read(module, node) or (
                node.op != "placeholder" and inputs and all(i in found for i in inputs)):
            found.add(node)
    return found


def _aliases(op) -> bool:
    """Whether `op` writes one of its inputs or returns a view of one."""
    schema = op._schema
    return any(argument.alias_info is not None and argument.alias_info.is_write
               for argument in schema.arguments) or any(
        value.alias_info is not None for value in schema.returns)
