"""Which pipeline unit computes each value of a model, and which values skip a stage.

The one place the planner, the estimator and the runtime read: the runtime's split assigns the
nodes of the exported graph to units and relays every value a stage reads more than one stage
after the stage that computes it; the estimator prices a plan's stages on the nodes these rules
give them (autopar.cost.plan_estimate); the planner asks the same of its captured Graph before
choosing a schedule, since torch's zero-bubble schedules train relayed activations wrong (seen on
T5, whose encoder output every decoder stage reads). No torch import: plans stay torch-free, so
each side describes its nodes as `FlowNode`s (`Graph.flow_nodes()` for a captured graph).

A unit is a module path ("embed", "layers.0", "head"), in model order; `unit_stage[u]` is the
pipeline stage of unit u. The rules:
- nodes no output depends on are dropped, and with them checks of constants and the export's
  `_assert_tensor_metadata`; other nodes with an effect stay (`dead`), writes to a buffer among
  them (BatchNorm's `num_batches_tracked.add_(1)`, which nothing reads);
- parameters, buffers and what is computed from buffers and constants alone (rotary tables, a
  position `arange`) are "shared": every unit that reads one has its own copy, so none is ever
  sent from stage to stage (`shared_values`); a write to a buffer is no such computation;
- every other node belongs to the layer its module path is in (the first such layer at or after
  its inputs' units, for a module that runs in several places); glue outside every layer follows
  its latest input, and glue that reads only the model's inputs goes with its first reader
  (`assign_units`);
- the model's inputs count as made before the first unit, its outputs as read after the last;
  a value skips a stage when some stage more than one after the stage that makes it reads it
  (`spans`, `skips_a_stage`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

# the export's check of a tensor's dtype, device and layout: it restates what the export traced
# and names the device it traced on, so it never keeps a node alive
ASSERT_METADATA = "aten._assert_tensor_metadata.default"


class NodeKind(StrEnum):
    INPUT = "input"                 # a model input
    PARAMETER = "parameter"
    BUFFER = "buffer"               # or a constant the export lifted
    FUNCTION = "function"           # an op
    OTHER = "other"                 # a get_attr
    OUTPUT = "output"               # the graph's outputs


INPUT, PARAMETER, BUFFER, FUNCTION, OTHER, OUTPUT = NodeKind


@dataclass(frozen=True, slots=True)
class FlowNode:
    name: str
    kind: NodeKind
    inputs: tuple[str, ...] = ()    # the nodes it reads, each once
    module_path: str = ""           # the innermost module it ran in; "" at the top level
    target: str = ""                # "aten.mm.default" for an op
    effect: bool = False            # it must run even when nothing reads it (torch's is_impure)
    writes: bool = False            # it writes one of its inputs in place (running statistics)


@dataclass(frozen=True, slots=True)
class Span:
    """Where one value is made and read, in units: a model input is made at unit -1, and the
    model's outputs are read at unit `count` (after the last)."""
    value: str
    made: int
    readers: dict[int, tuple[str, ...]]     # unit -> the nodes reading the value there

    @property
    def furthest(self) -> int:
        return max(self.readers, default=self.made)


def constants(nodes: Sequence[FlowNode]) -> set[str]:
    """Buffers, and ops computed from nothing but buffers and constants (not those writing one)."""
    found: set[str] = set()
    for node in nodes:
        if node.kind == BUFFER or node.kind == FUNCTION and not node.writes \
                and all(n in found for n in node.inputs):
            found.add(node.name)
    return found


def shared_values(nodes: Sequence[FlowNode]) -> set[str]:
    """What every unit that reads it holds a copy of: constants and parameters."""
    return constants(nodes) | {node.name for node in nodes if node.kind == PARAMETER}


def dead(nodes: Sequence[FlowNode]) -> list[str]:
    """The nodes to drop, last first: what no output depends on, but for ops with an effect on
    an activation or a write to a buffer (a check of a constant, or the export's metadata check,
    is dropped)."""
    constant = constants(nodes)
    users = _users(nodes)
    count = {name: len(readers) for name, readers in users.items()}
    dropped = []
    for node in reversed(nodes):
        if node.kind in (INPUT, OUTPUT) or count[node.name]:
            continue
        if node.name in constant or not (node.effect or node.writes) or node.target == ASSERT_METADATA:
            dropped.append(node.name)
            for name in node.inputs:
                count[name] -= 1
    return dropped


def assign_units(nodes: Sequence[FlowNode], units: Sequence[str]) -> dict[str, int]:
    """Unit index of every node that is neither a graph input or output nor shared (see the
    module's rules); nodes must be live (`dead` dropped)."""
    by_path: dict[str, list[int]] = {}

    def units_of_path(path: str) -> list[int]:
        if path not in by_path:
            by_path[path] = [index for index, unit in enumerate(units)
                             if path == unit or path.startswith(unit + ".")]
        return by_path[path]

    shared = shared_values(nodes)
    assigned: dict[str, int] = {}
    deferred: list[FlowNode] = []
    for node in nodes:
        if node.kind in (INPUT, OUTPUT) or node.name in shared:
            continue
        inputs = [assigned[name] for name in node.inputs if name in assigned]
        candidates = units_of_path(node.module_path) if node.module_path else []
        floor = max(inputs, default=0)
        if candidates:
            later = [c for c in candidates if c >= floor]
            assigned[node.name] = later[0] if later else candidates[-1]
        elif inputs:
            assigned[node.name] = floor
        else:
            deferred.append(node)
    users, kind = _users(nodes), {node.name: node.kind for node in nodes}
    for node in reversed(deferred):
        assigned[node.name] = min((reader_unit(user, kind[user] == OUTPUT, assigned, len(units))
                                   for user in users[node.name]), default=0)
    return assigned


def reader_unit(user: str, is_output: bool, assigned: dict[str, int], count: int) -> int:
    """The unit that reads a value: the model's outputs are read by the last unit."""
    return count - 1 if is_output else assigned[user]


def spans(nodes: Sequence[FlowNode], unit_of_node: dict[str, int], count: int) -> list[Span]:
    """Where each value of the graph is made and read (`count` units; the model's outputs read
    at unit `count`), in graph order; shared values each unit copies have no span."""
    users, kind = _users(nodes), {node.name: node.kind for node in nodes}
    found = []
    for node in nodes:
        if node.kind == OUTPUT or (node.kind != INPUT and node.name not in unit_of_node):
            continue
        readers: dict[int, list[str]] = {}
        for user in users[node.name]:
            unit = count if kind[user] == OUTPUT else unit_of_node[user]
            readers.setdefault(unit, []).append(user)
        found.append(Span(value=node.name, made=-1 if node.kind == INPUT else unit_of_node[node.name],
                          readers={unit: tuple(names) for unit, names in readers.items()}))
    return found


def stage_of(unit: int, unit_stage: Sequence[int]) -> int:
    """A unit's pipeline stage; unit -1 (the model's inputs) is before the first stage, and unit
    len(unit_stage) (the model's outputs) after the last."""
    if unit < 0:
        return -1
    return unit_stage[-1] + 1 if unit >= len(unit_stage) else unit_stage[unit]


def skips_a_stage(made: int, read: int, unit_stage: Sequence[int]) -> bool:
    """Whether a value made in unit `made` and read in unit `read` crosses a stage boundary
    without being read in the stage just after its own: then the stages between relay it."""
    return stage_of(read, unit_stage) > stage_of(made, unit_stage) + 1


def skipping_pairs(nodes: Sequence[FlowNode],
                   unit_layers: Sequence[Sequence[str]]) -> dict[tuple[int, int], str]:
    """For the planner, whose units are groups of layers (`unit_layers`, in model order): the
    (unit that computes, furthest unit that reads) of every activation that some cut could make
    skip a stage, i.e. read two or more units later, with the first such activation's name; the
    model's outputs are read at unit len(unit_layers). A cut into stages relays an activation
    when `skips_a_stage` says so for one of these pairs (with each unit's stage)."""
    layers = [layer for group in unit_layers for layer in group]
    group_of = [g for g, group in enumerate(unit_layers) for _ in group] + [len(unit_layers)]
    nodes = live(nodes)
    unit_of_node = assign_units(nodes, layers)
    pairs: dict[tuple[int, int], str] = {}
    for span in spans(nodes, unit_of_node, len(layers)):
        if span.made < 0:
            continue        # a model input needs no gradient: relaying it trains nothing wrong
        made, read = group_of[span.made], group_of[span.furthest]
        if read >= made + 2:
            pairs.setdefault((made, read), span.value)
    return pairs


def live(nodes: Sequence[FlowNode]) -> list[FlowNode]:
    """`nodes` without those `dead` drops."""
    dropped = set(dead(nodes))
    return [node for node in nodes if node.name not in dropped]


def _users(nodes: Sequence[FlowNode]) -> dict[str, list[str]]:
    users: dict[str, list[str]] = {node.name: [] for node in nodes}
    for node in nodes:
        for name in node.inputs:
            users[name].append(node.name)
    return users
