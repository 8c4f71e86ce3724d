"""Recomputation: regions of the graph that run under torch.utils.checkpoint.

`recompute_layers` is the pass: per stage, as the plan's stage says, every repeated layer under a
checkpoint ("full": only layer inputs stay alive between forward and backward) or only each
layer's attention ("selective", `checkpoint_regions` on the layer's own graph).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import fx, nn
from torch.fx.passes.split_module import split_module
from torch.overrides import _get_current_function_mode_stack
from torch.utils.checkpoint import checkpoint

from autopar.cost.stages import selective_region
from autopar.passes.program import PassTarget, StageProgram, is_tensor_read, parameter_names
from autopar.tracer import written_inputs


class Recomputed(nn.Module):
    """Runs `region` under a non-reentrant checkpoint: only its inputs stay alive for backward.

    The recomputation runs the region's forward again, writes to buffers included (BatchNorm's
    running statistics and num_batches_tracked): the buffers the region writes are put back as
    they were before it, so they are written once per forward, as without recompute. It runs
    under the torch function modes the first forward ran under (a `torch.device` context, or
    `autopar simulate`'s choice of attention kernel), which autograd does not keep active in
    the backward: otherwise the two forwards could compute, and save, different tensors."""

    def __init__(self, region: nn.Module):
        super().__init__()
        self.region = region
        # where the written tensors are, not the tensors: a stage gets its own copies later
        self.written = written_paths(region)

    def forward(self, *args):
        modes = _get_current_function_mode_stack()
        if not self.written and not modes:
            return checkpoint(self.region, *args, use_reentrant=False)
        return checkpoint(self.region, *args, use_reentrant=False,
                          context_fn=lambda: (contextlib.nullcontext(), self.recomputing(modes)))

    @contextlib.contextmanager
    def recomputing(self, modes: list):
        with contextlib.ExitStack() as stack:
            for mode in modes:
                stack.enter_context(mode)
            if self.written:
                stack.enter_context(self.restoring())
            yield

    @contextlib.contextmanager
    def restoring(self):
        tensors = [_tensor_at(self.region, path) for path in self.written]
        saved = [tensor.detach().clone() for tensor in tensors]
        try:
            yield
        finally:
            with torch.no_grad():
                for tensor, before in zip(tensors, saved):
                    tensor.copy_(before)


def written_paths(module: nn.Module) -> list[tuple[str, str]]:
    """(module path, attribute) of each tensor that the graphs in `module` write in place: a
    `get_attr`, or the `value` of a module that holds one tensor (the runtime's TensorRef)."""
    found: dict[tuple[str, str], None] = {}
    for prefix, graph_module in module.named_modules():
        if not isinstance(graph_module, fx.GraphModule):
            continue
        for node in graph_module.graph.nodes:
            for written in written_inputs(node):
                path = ".".join(p for p in (prefix, str(written.target)) if p)
                if written.op == "get_attr":
                    found[tuple(path.rpartition(".")[::2])] = None
                elif written.op == "call_module":
                    found[(path, "value")] = None
    return list(found)


def _tensor_at(module: nn.Module, path: tuple[str, str]) -> torch.Tensor:
    owner, attribute = path
    return getattr(module.get_submodule(owner), attribute)


def recompute_layers(program: StageProgram, plan, target: PassTarget) -> StageProgram:
    """The stage's repeated layers recomputed as the plan's stage says (none, selective, full)."""
    return recompute_blocks(program, plan.stages[program.index].recompute)


def recompute_blocks(program: StageProgram, recompute: str) -> StageProgram:
    """Each of the stage's blocks (the split's layer units it records) under a checkpoint with
    "full", only each block's attention with "selective"; the stage as it is with "none"."""
    if recompute == "none":
        return program
    module = program.module
    for name, layer in program.blocks.items():
        unit = getattr(module, name)
        if recompute == "selective":
            setattr(module, name, checkpoint_regions(
                unit, (layer,), selective=True,
                reads_tensor=lambda node, unit=unit: is_tensor_read(unit, node)))
        else:
            setattr(module, name, Recomputed(unit))
    program.param_names = parameter_names(module)    # the same tensors, under the wrappers' paths
    return program


def _is_attribute_read(node: fx.Node) -> bool:
    return node.op == "get_attr"


def checkpoint_regions(gm: fx.GraphModule, blocks: tuple[str, ...], *, selective: bool,
                       reads_tensor: Callable[[fx.Node], bool] = _is_attribute_read) -> fx.GraphModule:
    """`gm` with each block in `blocks` (module paths), or with `selective` each block's attention,
    split out and run under a checkpoint. `reads_tensor` tells the nodes that only fetch a
    parameter or buffer (a `get_attr` in an export; other graphs hold them in modules): they have
    no module path and go with their first user."""
    def follows_user(node: fx.Node) -> bool:
        return reads_tensor(node) or bool(node.meta.get("autopar_inserted"))

    _next_to_first_user(gm, follows_user)
    region_of = _regions(gm, blocks, selective, follows_user)
    part_of, recomputed = _partitions(gm, region_of, follows_user)
    if not recomputed:
        return gm
    split = split_module(gm, gm, lambda node: part_of[node.name], keep_original_order=True,
                         keep_original_node_name=True)
    for part in recomputed:
        name = f"submod_{part}"
        setattr(split, name, Recomputed(getattr(split, name)))
    # The split graph takes and returns flat values; keep the original calling convention.
    split.graph._codegen = gm.graph._codegen
    split.recompile()
    return split


def _next_to_first_user(gm: fx.GraphModule, follows_user: Callable[[fx.Node], bool]) -> None:
    """Move each node that goes with its first user (a parameter read) to just before it: the
    split keeps the graph's order of partitions, by the first node of each, and a parameter read
    at the top of the graph would put its user's partition before those it reads from."""
    for node in reversed(list(gm.graph.nodes)):
        if node.op not in ("placeholder", "output") and follows_user(node) and node.users:
            position = {other: index for index, other in enumerate(gm.graph.nodes)}
            min(node.users, key=position.__getitem__).prepend(node)
    gm.graph.lint()


def _regions(gm: fx.GraphModule, blocks: tuple[str, ...], selective: bool,
             follows_user: Callable[[fx.Node], bool]) -> dict[str, str | None]:
    """Module path of the recomputed region each node belongs to (None: not recomputed).
    Nodes without a module (parameters, inserted collectives) go with their first user."""
    region_of: dict[str, str | None] = {}
    for node in reversed(gm.graph.nodes):
        if node.op in ("placeholder", "output"):
            continue
        paths = [path for path, _ in (node.meta.get("nn_module_stack") or {}).values()]
        if follows_user(node) or not paths:
            users = [region_of.get(u.name) for u in node.users]
            region_of[node.name] = users[0] if users else None
        else:
            region_of[node.name] = _region(paths, blocks, selective)
    return region_of


def _region(paths: list[str], blocks: tuple[str, ...], selective: bool) -> str | None:
    block = next((p for p in paths if p in blocks), None)
    if block is None or not selective:
        return block
    inside = [p for p in paths if p.startswith(block + ".")]
    return selective_region(inside[0], block) if inside else None


def _partitions(gm: fx.GraphModule, region_of: dict[str, str | None],
                follows_user: Callable[[fx.Node], bool]) -> tuple[dict[str, int], set[int]]:
    """Partition numbers in graph order: a new one each time the region changes."""
    part_of, recomputed = {}, set()
    current, part = object(), -1
    first_part_of_region: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.name not in region_of:
            continue
        region = region_of[node.name]
        if follows_user(node):
            continue
        if region != current:
            part, current = part + 1, region
            if region is not None:
                recomputed.add(part)
                first_part_of_region.setdefault(region, part)
        part_of[node.name] = part
    for node in reversed(gm.graph.nodes):     # users first: a chain of inserted nodes follows its end
        if node.name in region_of and node.name not in part_of:
            users = [part_of.get(u.name) for u in node.users]
            region = region_of[node.name]
            part_of[node.name] = first_part_of_region.get(region) if region is not None else \
                min((u for u in users if u is not None), default=0)
    return part_of, recomputed
