"""Which nodes each pipeline chunk holds.

A stage (`StageSpec`) lists modules by path (block instances, an embedding, a head), or node
ranges. Modules take their nodes by the stage-flow rules the runtime's split applies
(autopar.plans.stage_flow), so that the planner, the estimator and the runtime cut a model alike;
nodes outside every listed module (embeddings and heads a Megatron-style chunk does not name,
glue, the loss) go where those rules send them, parameters with their first consumer.
A Megatron-style configuration splits the blocks over pp x virtual chunks, evenly where they
divide and otherwise by `blocks_per_chunk`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from autopar.cost.config import Config
from autopar.cost.units import module_units
from autopar.errors import AutoparError
from autopar.graph import Graph, Role
from autopar.plans.stage_flow import assign_units, live
from autopar.plans.vocabulary import Recompute

if TYPE_CHECKING:
    from autopar.cost.layout import GraphLayout


@dataclass(kw_only=True, slots=True)
class StageSpec:
    """One pipeline chunk: block instances by module path ("layers.3") or (start, stop) node-index
    ranges. Nodes outside every block (embeddings, the head) join the chunk of the nearest block."""
    layers: list
    tp: int = 1
    dp: int = 1
    recompute: Recompute = Recompute.NONE
    zero: int = 0
    sequence_parallel: bool = False
    # Per-op placements on the tensor-parallel axis (cost.layout.TensorPlacements), the sharding
    # ILP's or Megatron's (cost.megatron); None without a tensor-parallel axis (tp = 1).
    placements: object = None
    ep: int = 1                     # expert parallelism (cost/experts.py)
    cp: int = 1                     # context parallelism (cost/context.py)
    cp_kind: str = "ring"           # ring | all-to-all
    # Model states on the host (cost/offload.py): under ZeRO-3 parameters, gradients and
    # optimizer state (FSDP2's CPU offload); under ZeRO-1/2 the optimizer state and its step
    # (DeepSpeed's ZeRO-Offload), the 16-bit weights staying on the device
    offload: bool = False
    # One of several chunks: the model is cut, its embedding and head never in one chunk, so a
    # head tied to the embedding is a unit FSDP2 wraps alone (autopar.mixed_dtypes.fsdp_units)
    pipelined: bool = False

    @property
    def layout_key(self) -> tuple:
        """What the chunk's layout depends on."""
        return (self.tp, self.sequence_parallel, self.placements if self.tp > 1 else None, self.ep,
                self.cp > 1 and self.cp_kind == "ring", self.pipelined)

    @property
    def ranks(self) -> int:
        """Devices of the stage: tensor x context x data parallel."""
        return self.tp * self.cp * self.dp


def block_refs(graph: Graph) -> list:
    """Block instances in order, by module path; by node range when one module runs several
    times (a shared block), since its path alone does not say which call."""
    instances = sorted((i for kind in graph.blocks for i in kind.instances), key=lambda i: i.start)
    paths = [i.module_path for i in instances]
    if len(set(paths)) == len(paths):
        return paths
    return [(i.start, i.stop) for i in instances]


def uniform_stages(graph: Graph, config: Config, placements=None) -> list[StageSpec]:
    """Megatron's chunks of `config`, each placed on the tensor-parallel axis as `placements`."""
    chunks = config.pp * config.virtual
    paths = block_refs(graph)
    if chunks == 1:
        groups = [paths or [(0, len(graph.nodes))]]
    elif len(paths) < chunks:
        groups = _ends_as_chunks(graph, paths, chunks, config)
    else:
        counts = blocks_per_chunk(len(paths), chunks)
        starts = [sum(counts[:c]) for c in range(chunks)]
        groups = [paths[start:start + count] for start, count in zip(starts, counts)]
    return [StageSpec(layers=group, tp=config.tp, dp=config.dp, recompute=config.recompute,
                      zero=config.zero, sequence_parallel=config.sequence_parallel,
                      placements=placements, ep=config.ep, cp=config.cp, cp_kind=config.cp_kind,
                      offload=config.offload, pipelined=len(groups) > 1)
            for group in groups]


def _ends_as_chunks(graph: Graph, paths: list, chunks: int, config: Config) -> list[list]:
    """One block a chunk, with the embedding (the modules before the first block) a chunk of its
    own where the blocks are one fewer than the chunks, and the head (those after the last) one
    too where they are two fewer: Megatron's `account_for_embedding_in_pipeline_split` and
    `account_for_loss_in_pipeline_split`, which run Qwen3-235B's 94 layers as 96 chunks. The
    modules named are those of the planner's units (autopar.cost.units)."""
    instances = [i for kind in graph.blocks for i in kind.instances]
    blocks = {i.module_path for i in instances}
    before = graph.top_modules(0, min(i.start for i in instances), blocks) if instances else ()
    after = graph.top_modules(max(i.stop for i in instances), len(graph.nodes), blocks) if instances else ()
    ends = chunks - len(paths)
    if ends > 2 or not all(isinstance(p, str) for p in paths) or not before or (ends == 2 and not after):
        raise AutoparError(f"{len(paths)} repeated blocks cannot fill pp x virtual = {config.pp} x "
                           f"{config.virtual} = {chunks} pipeline chunks (the embedding and the head "
                           f"can each take one more); choose pp and virtual whose product is at most "
                           f"{len(paths) + 2 if after else len(paths) + 1}")
    return [list(before)] + [[path] for path in paths] + ([list(after)] if ends == 2 else [])


def blocks_per_chunk(blocks: int, chunks: int) -> list[int]:
    """How many of `blocks` repeated blocks each of `chunks` pipeline chunks holds when they do not
    divide evenly: the extra blocks go to the middle chunks first, since the first chunk also runs
    the embedding and the last the head and loss, then to the first chunk (a lookup is lighter
    than the head). BLOOM-176B's 70 layers on 12 stages come out as Megatron-DeepSpeed ran them:
    5 on the first and last stages, 6 on the others."""
    counts = [blocks // chunks] * chunks
    order = list(range(1, chunks - 1)) + [0, chunks - 1]
    for c in order[:blocks % chunks]:
        counts[c] += 1
    return counts


def chunk_of_nodes(graph: Graph, stages: list[StageSpec], flow: list | None = None) -> list[int]:
    """The chunk each graph node belongs to. Chunks named by module paths (a plan's stages, the
    planner's candidates, Megatron's chunks of blocks) hold the nodes the stage-flow rules give
    their modules, the rules the runtime's split applies (autopar.plans.stage_flow.assign_units;
    `flow`: the graph's live `flow_nodes`, if the caller has them). Chunks named by node ranges
    (a block module that runs more than once, whose path says no one call) hold those ranges.
    Nodes left over (constants every reader copies, checks the runtime drops, parameters) join
    the nearest chunk before them; parameters and inputs their first consumer."""
    if all(isinstance(layer, str) for stage in stages for layer in stage.layers):
        owner = _flow_owner(graph, stages, flow)
    else:
        owner = _range_owner(graph, stages)
    return _fill_owners(graph, owner)


def _flow_owner(graph: Graph, stages: list[StageSpec], flow: list | None) -> list[int]:
    paths = {node.module_path for node in graph.nodes if node.module_path}
    for c, stage in enumerate(stages):
        for layer in stage.layers:
            if not any(path == layer or path.startswith(layer + ".") for path in paths):
                blocks = [inst.module_path for kind in graph.blocks for inst in kind.instances]
                raise AutoparError(f"stage {c} names layer {layer!r}, which is not a block of the "
                                   f"graph nor a module that runs in it; blocks are {blocks[:4]}...")
    if len(stages) == 1:
        return [0] * len(graph.nodes)
    units = [layer for stage in stages for layer in stage.layers]
    unit_stage = [c for c, stage in enumerate(stages) for _ in stage.layers]
    assigned = assign_units(flow if flow is not None else live(graph.flow_nodes()), units)
    owner = [unit_stage[assigned[node.name]] if node.name in assigned else -1 for node in graph.nodes]
    for c, stage in enumerate(stages):
        if c not in owner:
            raise AutoparError(f"stage {c} ({', '.join(stage.layers[:4])}) holds no op of the "
                               f"graph: the stages before and after it run all of its modules")
    return owner


def _range_owner(graph: Graph, stages: list[StageSpec]) -> list[int]:
    ranges: dict[str, list[tuple[int, int]]] = {}     # a shared block: every call of it
    for kind in graph.blocks:
        for inst in kind.instances:
            ranges.setdefault(inst.module_path, []).append((inst.start, inst.stop))
    owner = [-1] * len(graph.nodes)
    for c, stage in enumerate(stages):
        for layer in stage.layers:
            if isinstance(layer, str) and layer not in ranges:
                raise AutoparError(f"stage {c} names layer {layer!r}, which is not a block of the "
                                   f"graph; blocks are {list(ranges)[:4]}...")
            for start, stop in ranges[layer] if isinstance(layer, str) else [layer]:
                _assign(graph, owner, range(start, stop), c)
    return owner


def _assign(graph: Graph, owner: list[int], indices: range, chunk: int) -> None:
    for i in indices:
        if owner[i] != -1:
            raise AutoparError(f"node {graph.nodes[i].name} is in stages {owner[i]} and {chunk}")
        owner[i] = chunk


def _fill_owners(graph: Graph, owner: list[int]) -> list[int]:
    """Nodes outside the stages' blocks join the nearest assigned chunk before them (the first
    chunk for those at the top); parameters and inputs join their first consumer."""
    assigned = [c for c in owner if c != -1]
    if not assigned:
        raise AutoparError("the stages cover no node of the graph")
    current = assigned[0]
    for i, c in enumerate(owner):
        current = c if c != -1 else current
        owner[i] = current
    # Parameters are placeholders at the top: they live with their first consumer.
    first_use: dict[str, int] = {}
    for i, node in enumerate(graph.nodes):
        for name in node.inputs:
            first_use.setdefault(name, owner[i])
    index = {n.name: i for i, n in enumerate(graph.nodes)}
    for name, c in first_use.items():
        if graph.nodes[index[name]].role in (Role.PARAMETER, Role.BUFFER, Role.INPUT):
            owner[index[name]] = c
    return owner


def sharding_groups(graph: Graph, owner: list[int], chunks: int) -> list[int]:
    """How many FSDP groups each chunk's parameters fall into as the runtime wraps a stage: one
    per module of the stage that holds parameters (a block instance, or an outermost module that
    holds no block: the embedding, a final norm, the head), plus the stage's own group for the
    rest. A property of the chunk's nodes, not of how a stage names its layers."""
    return [len(groups) + 1 for groups in group_elements(graph, owner, chunks, {})]


def group_elements(graph: Graph, owner: list[int], chunks: int, elements: dict[str, float],
                   readers: dict[str, set[int]] | None = None) -> list[dict[str, float]]:
    """Per chunk, its FSDP groups (see `sharding_groups`; the stage's own group left out) with
    the parameter elements each holds, from `elements` (parameter node -> elements on a device),
    in every chunk that reads it (`readers`, where given: each stage its own copy of a tied
    weight), else in its own."""
    groups: list[dict[str, float]] = [{} for _ in range(chunks)]
    index = {node.name: i for i, node in enumerate(graph.nodes)}
    for name, path in parameter_groups(graph).items():
        for chunk in (readers or {}).get(name) or {owner[index[name]]}:
            groups[chunk][path] = groups[chunk].get(path, 0.0) + elements.get(name, 0.0)
    return groups


def reduce_order(graph: Graph, layout: GraphLayout, owner: list[int], chunks: int, experts: set[str],
                 readers: dict[str, set[int]]) -> list[tuple]:
    """Per chunk, its FSDP groups in the order the step's one reduction meets them
    (cost/step_reduce.py), each (elements a device holds, elements of its last parameter, whether
    it is the split `experts`' own group). The stage's own group first: what no layer's group
    holds (weights tied across layers: `parameter_groups`); each stage that reads a weight holds
    its own copy (`readers`: cost.traffic.parameter_readers), and a tied weight's unread name
    nothing (as cost.chunk_price.chunk_states counts them)."""
    groups = parameter_groups(graph)
    tied = {fqn for node in graph.parameters if node.tied_to for fqn in (node.param_fqn, node.tied_to)}
    order: list[dict] = [{} for _ in range(chunks)]
    for node in graph.parameters:
        elements = layout.param_local.get(node.name)
        if elements is None or (node.param_fqn in tied and node.name not in readers):
            continue
        path = groups.get(node.name, "")
        root = not path or TIED_SEPARATOR in path
        key = ("", False) if root else (path, node.name in experts)
        for chunk in readers.get(node.name) or {owner[layout.index[node.name]]}:
            held = order[chunk].setdefault(key, [0.0, 0.0])
            held[0] += elements
            held[1] = elements
    return [tuple((total, last, experts) for (path, experts), (total, last)
                  in sorted(chunk.items(), key=lambda item: item[0][0] != "")) for chunk in order]


def parameter_groups(graph: Graph) -> dict[str, str]:
    """Parameter node -> the module whose FSDP group holds it, as the runtime wraps a stage's
    layers (autopar.runtime.data_parallel): its block instance, or its outermost module that holds
    no block; in a model without repeated blocks, the planner's module unit it is under
    (cost.units.module_units), since those are the layers a stage is split into."""
    if graph.blocks:
        layers = {inst.module_path for kind in graph.blocks for inst in kind.instances}
        inside = {".".join(path.split(".")[:depth]) for path in layers
                  for depth in range(1, path.count(".") + 1)}
    else:
        layers = {path for paths, _, _ in module_units(graph) for path in paths}
        inside = set()
    groups = {}
    for node in graph.nodes:
        if node.role is not Role.PARAMETER:
            continue
        parts = node.param_fqn.split(".")[:-1]
        for depth in range(1, len(parts) + 1):
            path = ".".join(parts[:depth])
            if path in layers or (graph.blocks and path not in inside):
                groups[node.name] = path
                break
    return _tied_together(graph, groups)


# joins the module paths of the layers that share a weight into their group's name
TIED_SEPARATOR = " + "


def _tied_together(graph: Graph, groups: dict[str, str]) -> dict[str, str]:
    """FSDP2 gives a parameter to one group, so the runtime leaves the layers that share one (an
    LM head tied to its embedding) in the stage's own group: one group of both layers' weights,
    gathered from the first of them the backward meets to the end of the stage's backward."""
    by_fqn = {node.param_fqn: node.name for node in graph.parameters}
    merged: dict[str, str] = {}
    for node in graph.parameters:
        first = by_fqn.get(node.tied_to)
        if first in groups and node.name in groups and groups[first] != groups[node.name]:
            paths = {merged.get(groups[first], groups[first]), merged.get(groups[node.name], groups[node.name])}
            name = TIED_SEPARATOR.join(sorted({part for path in paths for part in path.split(TIED_SEPARATOR)}))
            merged.update({part: name for part in name.split(TIED_SEPARATOR)})
    return {param: merged.get(path, path) for param, path in groups.items()}


# Selective recompute reruns each block's attention: the block's child module named so.
ATTENTION_NAMES = ("attn", "attention")


def selective_region(module_path: str, block: str) -> str | None:
    """The module that selective recompute reruns for a node at `module_path` inside block
    instance `block`: the block's child whose name ends in one of ATTENTION_NAMES, or None."""
    if not module_path.startswith(block + "."):
        return None
    child = f"{block}.{module_path[len(block) + 1:].split('.')[0]}"
    return child if child.rpartition(".")[2].lower().endswith(ATTENTION_NAMES) else None


def block_mask(graph: Graph) -> list:
    """For each node, the (start, stop) node range of the block instance it is in, or None."""
    mask = [None] * len(graph.nodes)
    for kind in graph.blocks:
        for inst in kind.instances:
            for i in range(inst.start, inst.stop):
                mask[i] = (inst.start, inst.stop)
    return mask
