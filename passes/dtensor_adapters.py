"""What an exported graph needs to run on DTensors, beyond the plan's placements.

The export is ATen as traced on plain tensors; tensor_parallel.py runs it on DTensors. These
rewrites bridge the two, each for one thing DTensor does differently:
- `drop_metadata_checks`: the export's dtype and device checks, which DTensor has no rule for;
- `replicate_created_tensors`: a tensor created from nothing (a position `arange`) is plain, which
  DTensor ops refuse next to DTensors;
- `match_layouts`: a collective returns a contiguous local tensor whatever the global strides, so a
  view the global strides allow can fail on the local tensor;
- `place_attention`: DTensor reshards positional arguments but not an attention's mask keyword;
- `settle_lookups`: a lookup in a vocabulary-split table reads its rank's rows, a partial sum
  reduced once, and makes the gradient of those rows alone.
"""

from __future__ import annotations

import torch
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from autopar.cost.strategies import parse_placement
from autopar.passes.vocabulary_lookup import split_lookups


def drop_metadata_checks(module: nn.Module) -> None:
    """Remove the export's `_assert_tensor_metadata` checks: they compare a value's dtype and
    device with what was traced, which a DTensor cannot be asked (DTensor has no rule for them),
    and they compute nothing."""
    for graph_module in [m for m in module.modules() if isinstance(m, fx.GraphModule)]:
        checks = [node for node in graph_module.graph.nodes
                  if node.target is torch.ops.aten._assert_tensor_metadata.default]
        for node in checks:
            graph_module.graph.erase_node(node)
        if checks:
            graph_module.recompile()


def _apply_after(graph_module: fx.GraphModule, nodes: list, name: str, module: nn.Module) -> None:
    """Every user of each of `nodes` reads `module(node)` instead: one submodule `name`, called
    right after each node."""
    graph_module.add_submodule(name, module)
    for node in nodes:
        with graph_module.graph.inserting_after(node):
            applied = graph_module.graph.call_module(name, (node,))
        node.replace_all_uses_with(applied, delete_user_cb=lambda user: user is not applied)
    graph_module.recompile()


class Replicated(nn.Module):
    """Makes a plain tensor a replicated DTensor on `mesh`."""

    def __init__(self, mesh: DeviceMesh):
        super().__init__()
        self.mesh = mesh

    def forward(self, value: torch.Tensor) -> DTensor:
        if isinstance(value, DTensor):  # created from a DTensor's shape or dtype, already placed
            return value
        return DTensor.from_local(value, self.mesh, [Replicate()], run_check=False)


def replicate_created_tensors(module: nn.Module, mesh: DeviceMesh) -> None:
    """Ops that create a tensor from nothing (a position `arange`) give plain tensors, which DTensor
    ops refuse next to DTensors; every such value is made a replicated DTensor where it is created,
    in the graph, so that recomputation in backward does the same."""
    for graph_module in [m for m in module.modules() if isinstance(m, fx.GraphModule)]:
        created = [node for node in graph_module.graph.nodes
                   if node.op == "call_function" and not node.all_input_nodes
                   and isinstance(node.meta.get("val"), torch.Tensor)]
        if not created:
            continue
        _apply_after(graph_module, created, "replicated", Replicated(mesh))


# Ops that call `view` on their input's local tensor when the DTensor's (global) strides allow it.
VIEWING_OPS = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
               torch.ops.aten.reshape.default, torch.ops.aten.flatten.using_ints,
               torch.ops.aten.unflatten.int, torch.ops.aten.linear.default,
               torch.ops.aten.matmul.default}


def _laid_out_like_global(value):
    """`value` with its local tensor's dims in memory in the order of the DTensor's global strides.

    A DTensor's strides are those of the global tensor, computed from its inputs' global strides,
    but a collective (an implicit redistribute inside an op, e.g. partial sums reduced onto a
    head-sharded attention input) returns a contiguous local tensor whatever the global layout.
    Ops whose output layout follows their input (attention) then carry the mismatch on, and a
    reshape that the global strides allow as a view fails on the local tensor. Only the
    order of dims matters for which views are valid, so the local tensor is made dense in the
    global order, which is a copy only when it is not already so."""
    if not isinstance(value, DTensor) or value.dim() < 2:
        return value
    local = value.to_local()
    order = sorted(range(value.dim()), key=lambda d: (-value.stride(d), d))
    if local.permute(order).is_contiguous():
        return value
    inverse = sorted(range(len(order)), key=order.__getitem__)
    dense = local.permute(order).contiguous().permute(inverse)
    return DTensor.from_local(dense, value.device_mesh, value.placements, run_check=False,
                              shape=value.shape, stride=value.stride())


def match_layout(value):
    """`value` laid out like its global strides, by differentiable ops (forward)."""
    return _laid_out_like_global(value)


def match_grad_layout(value):
    """`value` itself; its gradient is laid out like its global strides (backward: the backward of
    a view reshapes the gradient). A hook, not an op, so in-place updates of `value` stay valid."""
    if isinstance(value, DTensor) and value.requires_grad:
        value.register_hook(_laid_out_like_global)
    return value


def match_layouts(module: nn.Module) -> None:
    """Around every op that may view its input's local tensor: the input laid out like its
    global strides before it (forward), and the output's gradient after it (backward)."""
    for graph_module in [m for m in module.modules() if isinstance(m, fx.GraphModule)]:
        graph = graph_module.graph
        for node in [n for n in graph.nodes if n.op == "call_function" and n.target in VIEWING_OPS]:
            source = node.args[0]
            if isinstance(source, fx.Node):
                with graph.inserting_before(node):
                    node.replace_input_with(source, graph.call_function(match_layout, (source,)))
            with graph.inserting_after(node):
                matched = graph.call_function(match_grad_layout, (node,))
            node.replace_all_uses_with(matched, delete_user_cb=lambda user: user is not matched)
        graph_module.recompile()


ATTENTION_OPS = (torch.ops.aten.scaled_dot_product_attention.default,
                 torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)


class MaskedAttention(nn.Module):
    """Attention with a mask tensor, its four tensors placed alike before the call.

    DTensor reshards positional arguments to the strategy it picks but not keyword ones (the CPU
    kernel's `attn_mask`), so a replicated per-head mask (T5's position bias) reaches a
    head-sharded kernel whole. Here q, k and v go to the plan's placement of the attention's
    output (else they keep a batch or head sharding they have, else heads are split when they
    divide) and the mask to the same split where it has that dim at full size, so no input
    needs resharding inside the op."""

    def __init__(self, op, mesh: DeviceMesh, placement: Placement | None):
        super().__init__()
        self.op, self.mesh, self.placement = op, mesh, placement

    def forward(self, query, key, value, *args, **kwargs):
        if not isinstance(query, DTensor):
            return self.op(query, key, value, *args, **kwargs)
        place = self._placement(query, key)
        query, key, value = (t.redistribute(self.mesh, (place,)) for t in (query, key, value))
        if args and isinstance(args[0], torch.Tensor):
            args = (self._place_mask(args[0], place), *args[1:])
        if isinstance(kwargs.get("attn_mask"), torch.Tensor):
            kwargs["attn_mask"] = self._place_mask(kwargs["attn_mask"], place)
        return self.op(query, key, value, *args, **kwargs)

    def _placement(self, query: DTensor, key: DTensor) -> Placement:
        """On the stage's one-dimensional tensor-parallel mesh."""
        size = self.mesh.size()
        for place in (self.placement, query.placements[0]):
            if isinstance(place, Shard) and place.dim in (0, 1) and query.shape[place.dim] % size == 0 \
                    and key.shape[place.dim] % size == 0:
                return place
        if query.shape[1] % size == 0 and key.shape[1] % size == 0:
            return Shard(1)
        return Shard(0) if query.shape[0] % size == 0 else Replicate()

    def _place_mask(self, mask: torch.Tensor, place: Placement) -> DTensor:
        if not isinstance(mask, DTensor):
            mask = DTensor.from_local(mask, self.mesh, [Replicate()], run_check=False)
        dim = place.dim - (4 - mask.dim()) if isinstance(place, Shard) else -1
        keep = Shard(dim) if dim >= 0 and mask.shape[dim] > 1 else Replicate()
        return mask.redistribute(self.mesh, (keep,))


def place_attention(module: nn.Module, mesh: DeviceMesh, nodes: dict[str, list[str]], tp_axis: int) -> None:
    """Every attention call with a mask runs as MaskedAttention."""
    for graph_module in [m for m in module.modules() if isinstance(m, fx.GraphModule)]:
        for node in list(graph_module.graph.nodes):
            masked = len(node.args) > 3 and node.args[3] is not None or node.kwargs.get("attn_mask") is not None
            if node.op != "call_function" or node.target not in ATTENTION_OPS or not masked:
                continue
            texts = nodes.get(node.name)
            name = f"masked_{node.name}"
            graph_module.add_submodule(name, MaskedAttention(
                node.target, mesh, parse_placement(texts[tp_axis]) if texts else None))
            node.op, node.target = "call_module", name
        graph_module.recompile()


class SettledLookup(nn.Module):
    """An embedding lookup's output reduced to replicated when its table is split on the vocabulary.

    Such a lookup is a partial sum (`vocabulary_lookup`; DTensor's own is a masked partial sum
    whose mask may be applied only once: a consumer whose op decomposes, rms_norm into pow, mean
    and mul, or a second consumer reduced it again and failed). Reducing it once, here,
    is the all-reduce the plan prices for the partial sum, done before any consumer. Its gradient
    is made replicated before it flows back: DTensor cannot turn a partial-sum gradient into the
    masked kind the lookup's backward was recorded with."""

    def __init__(self, mesh: DeviceMesh):
        super().__init__()
        self.mesh = mesh

    def forward(self, value):
        if isinstance(value, DTensor) and any(p.is_partial() for p in value.placements):
            value = value.redistribute(self.mesh, [Replicate()] * self.mesh.ndim)
            if value.requires_grad:
                value.register_hook(self._replicated)
        return value

    def _replicated(self, grad):
        if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
            return grad.redistribute(self.mesh, [Replicate()] * self.mesh.ndim)
        return grad


def settle_lookups(module: nn.Module, mesh: DeviceMesh) -> None:
    """Every embedding lookup looks up its rank's own rows (`vocabulary_lookup`), and after it a
    SettledLookup."""
    for graph_module in [m for m in module.modules() if isinstance(m, fx.GraphModule)]:
        lookups = [node for node in graph_module.graph.nodes
                   if node.op == "call_function" and node.target is torch.ops.aten.embedding.default]
        if not lookups:
            continue
        _apply_after(graph_module, lookups, "settled_lookup", SettledLookup(mesh))
        split_lookups(graph_module, lookups)
