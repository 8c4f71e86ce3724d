"""What a chunk's backward holds besides the activations its forward kept: the gradients on their
way through it, as autograd's engine holds them.

A value's gradient exists from the backward of its last reader (the first to run) until the
backward of its producer has used it. A value read twice (the residual stream, a norm's input
read by its square and by its product) holds a pending gradient while the other reader's branch
runs. An op's backward makes the gradients of its inputs, and some make more on the way (pow's
`grad * 2 * x^1`, rsqrt's cube). Ops that only reshape, and add, hand their gradient on as it is
(the same storage), so a gradient read by two values counts once; autograd adds a second
gradient into a first in place when nothing else holds the first. Kept activations are freed as
their keepers' backwards pass (`first_kept`), so the fullest moment is found by a sweep over the
chunk's ops in backward order. A recomputed region's forward runs again when the backward reaches
it: what it keeps is alive from then, each storage until its first keeper's backward has run,
so the sweep also finds where the rerun's activations and the gradients weigh most together.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from autopar.cost.backward_moments import GroupReductions, Moment, whole_held
from autopar.cost.layout import TAKES_NO_GRADIENT, GraphLayout, NodeLayout, op_name
from autopar.cost.stages import TIED_SEPARATOR, parameter_groups
from autopar.cost.units import module_units
from autopar.graph import Graph, Role

# Tensors as large as the op's output that its backward makes beyond the gradients it gives, as
# torch's derivative formulas compute them (counted on fake tensors): pow's x^(e-1) and its
# product by e; rsqrt's result cubed and scaled; div's 1/b and a/b^2 terms.
# Fused norms (layer_norm, rms_norm: the fused kernel a GPU runs) make only their gradients.
_TEMPORARIES = {"pow": 2, "rsqrt": 2, "sqrt": 1, "div": 2, "square": 2, "abs": 1, "reciprocal": 1}
# Of these, ops whose temporaries differentiate one input alone, by position: div's are the
# divisor's (a/b^2); dividing by a constant (a scale, a buffer) makes none.
_TEMPORARIES_FOR_INPUT = {"div": 1}
# Ops whose backward hands the gradient it takes on as it is, or a view of it, to its inputs of
# the output's size (add's second input, broadcast, gets a reduced copy).
_PASSING = {"view", "_unsafe_view", "reshape", "permute", "transpose", "t", "unsqueeze", "squeeze",
            "alias", "detach", "unflatten", "flatten", "view_as", "getitem", "numpy_T", "mT",
            "swapaxes", "swapdims", "movedim", "add", "clone", "contiguous", "cat", "type_as",
            "to", "_to_copy", "lift_fresh_copy"}


@dataclass(slots=True)
class _Gradients:
    """Gradient storages alive in the sweep: id -> (power of seq, bytes per sample), how many
    values (or the op running) hold each, and the bytes of those held, by power of seq."""
    sizes: dict[int, tuple[int, float]] = field(default_factory=dict)
    holders: dict[int, int] = field(default_factory=dict)
    of_value: dict[str, list[int]] = field(default_factory=dict)
    live: dict[int, float] = field(default_factory=dict)

    def make(self, degree: int, nbytes: float) -> int:
        gradient = len(self.sizes)
        self.sizes[gradient], self.holders[gradient] = (degree, nbytes), 1
        self.live[degree] = self.live.get(degree, 0.0) + nbytes
        return gradient

    def release(self, gradient: int) -> None:
        self.holders[gradient] -= 1
        if not self.holders[gradient]:
            degree, nbytes = self.sizes[gradient]
            self.live[degree] -= nbytes

    def give(self, value: str, gradient: int, *, slot: bool) -> None:
        """Hand `gradient` (held by the op running) to `value`: as a further output's slot
        (`slot`, a multi-output op's item), or added into the gradient `value` has: in place
        where only `value` holds that one, else as a new sum."""
        held = self.of_value.setdefault(value, [])
        self.holders[gradient] += 1
        if slot or not held:
            held.append(gradient)
            return
        if len(held) == 1 and self.holders[held[0]] == 1 and held[0] != gradient:
            self.release(gradient)          # added into the one it holds alone
            return
        total = self.make(*self.sizes[held[0]])
        for old in [*held, gradient]:
            self.release(old)
        self.of_value[value] = [total]


def backward_peak(graph: Graph, layout: GraphLayout, nodes: list[NodeLayout],
                  first_kept: dict[str, int], regions: list | None = None) -> dict[int, float]:
    """{power of seq: bytes per sample} the chunk's backward holds at its fullest beyond the kept
    activations: the gradients alive then, the running op's temporaries and what the rerun of
    its recomputed region (`regions`, by position) keeps, less what the backward freed before
    it: storages `first_kept` (storage -> position of its first keeper outside recomputed
    regions) only by later ops, and within the region, what the rerun kept for its later ops
    only."""
    facts, readers = _facts(graph, layout)
    regions = regions or [None] * len(nodes)
    key = _chunk_key(nodes, regions, first_kept)
    peaks = layout.gradient_facts["peaks"]
    if key not in peaks:        # the same chunk recurs in many candidates (other batches, ZeRO)
        peaks[key] = _sweep(layout, nodes, first_kept, regions, facts, readers)
    return dict(peaks[key][0])


def split_backward_peak(graph: Graph, layout: GraphLayout, nodes: list[NodeLayout],
                        first_kept: dict[str, int], regions: list | None = None) -> dict[int, float]:
    """`backward_peak` of an input backward split from the weight backward (zero-bubble): the
    gradient reaching each op that reads a weight stays, for that weight's backward."""
    return dict(_swept(graph, layout, nodes, first_kept, regions)[3])


def split_whole_reads(graph: Graph, layout: GraphLayout, nodes: list[NodeLayout],
                      first_kept: dict[str, int], regions: list | None = None) -> tuple:
    """The input backward's moments (split from the weight backward) at the ops that read a
    weight whole (run replicated on a tensor-parallel stage), each with the elements it holds of
    it (`whole_held`): ((({power of seq: bytes per sample}), elements), ...). Its saved weight is
    gathered whole as the input backward unpacks it, and again in the weight backward's rerun
    of the op (torch reruns the op's backward node from it, passes.dtensor_rules.RunReplicated)."""
    return _swept(graph, layout, nodes, first_kept, regions)[5]


def paired_backward_peaks(graph: Graph, layout: GraphLayout, nodes: list[NodeLayout],
                          first_kept: dict[str, int], regions: list | None = None) -> tuple:
    """The chunk's backward moments each with the weight gradients its op makes: ((({power of
    seq: bytes per sample}), weight elements), ...), those that may be the fullest (`_Paired`).
    The heaviest weight's gradient is made late, where the backward has freed most it held."""
    return _swept(graph, layout, nodes, first_kept, regions)[4]


def backward_moments(graph: Graph, layout: GraphLayout, nodes: list[NodeLayout],
                     first_kept: dict[str, int], regions: list | None = None) -> tuple[Moment, ...]:
    """The same sweep's moments with the weight gradients FSDP2 reduces group by group
    (cost/backward_moments.py), for plans that reduce every micro-batch (ZeRO-2 and 3)."""
    return _swept(graph, layout, nodes, first_kept, regions)[1]


def last_gathered(graph: Graph, layout: GraphLayout, nodes: list[NodeLayout],
                  first_kept: dict[str, int], regions: list | None = None) -> float:
    """Elements of the FSDP group the chunk's forward gathers last, the first its backward meets
    (the same sweep's)."""
    return _swept(graph, layout, nodes, first_kept, regions)[2]


def _swept(graph: Graph, layout: GraphLayout, nodes: list[NodeLayout], first_kept: dict[str, int],
           regions: list | None) -> tuple:
    backward_peak(graph, layout, nodes, first_kept, regions)
    return layout.gradient_facts["peaks"][_chunk_key(nodes, regions or [None] * len(nodes), first_kept)]


def _chunk_key(nodes: list[NodeLayout], regions: list, first_kept: dict) -> tuple:
    # first_kept follows from the nodes and regions (`first_keepers`): its size tells
    # the two ways it is called apart
    return tuple(node.name for node in nodes), tuple(regions), len(first_kept)


def _sweep(layout: GraphLayout, nodes: list[NodeLayout], first_kept: dict[str, int], regions: list,
           facts: dict, readers: dict) -> tuple[dict[int, float], tuple[Moment, ...], float, dict, tuple]:
    grads, groups = _Gradients(), GroupReductions(nodes, facts, layout.param_local,
                                                   layout.distributed)
    in_chunk = {node.name for node in nodes}
    for node in nodes:
        if facts[node.name].differentiable and any(r not in in_chunk for r in readers.get(node.name, ())):
            grads.of_value[node.name] = [grads.make(*facts[node.name].size)]
    freed_after, rerun, rerun_before = _freed_after(first_kept, nodes, regions, layout)
    released: dict = {}                  # region (None: outside) -> {power of seq: bytes freed}
    retained: dict = {}                  # split: weight readers' gradients, {power of seq: bytes}
    best = split_best = ({}, float("-inf"))
    paired, region_entry, split_whole = _Paired(), {}, []
    for position in range(len(nodes) - 1, -1, -1):
        node = nodes[position]
        incoming = grads.of_value.pop(node.name, [])
        if node.requires_grad and incoming:
            fact = facts[node.name]
            kept = rerun.get(regions[position], {})
            groups.enter(fact, grads.live, rerun_before, released.get(None, {}))
            made = _give_inputs(fact, facts, incoming, grads)
            spaces = {None, regions[position]}
            total = sum(grads.live.values()) + sum(kept.values()) + fact.extra - sum(
                sum(released.get(region, {}).values()) for region in spaces)
            at = _at(grads.live, kept, fact, [released.get(region, {}) for region in spaces])
            if total > best[1]:
                best = (at, total)
            paired.add(at, total, _made_elements(fact, layout.param_local))
            if regions[position] is not None:
                entry = region_entry.setdefault(regions[position], (at, total))
                if fact.whole:      # gathered by the rerun as it enters the region, all it keeps alive
                    paired.add(*entry, whole_held(fact))
            # split, the input backward keeps its graph: nothing saved is freed before the weights'
            split_total = sum(grads.live.values()) + sum(kept.values()) + fact.extra + sum(retained.values())
            if split_total > split_best[1] or fact.whole:
                unfreed = _at(grads.live, kept, fact, [])
                split_at = {d: unfreed.get(d, 0.0) + retained.get(d, 0.0) for d in {*unfreed, *retained}}
                split_best = (split_at, split_total) if split_total > split_best[1] else split_best
                if fact.whole:      # its saved weights gathered whole again, its whole gradient made
                    split_whole.append((split_at, whole_held(fact)))
            inner = [released.get(regions[position], {})] if regions[position] is not None else []
            groups.record(fact, _at(grads.live, kept, fact, inner), released.get(None, {}))
            for gradient in made:
                grads.release(gradient)
        for gradient in incoming:
            grads.release(gradient)
        if incoming and node.requires_grad and facts[node.name].weights:
            degree, nbytes = facts[node.name].size
            retained[degree] = retained.get(degree, 0.0) + nbytes
        for region, key in freed_after.get(position, ()):
            freed = released.setdefault(region, {})
            degree = layout.seq_degree.get(key, 0)
            freed[degree] = freed.get(degree, 0.0) + layout.storage_bytes.get(key, 0.0)
        groups.after(position, grads.live, released.get(None, {}))
    return best[0], groups.kept(), groups.first_met, split_best[0], paired.kept(), tuple(split_whole)


def _made_elements(fact: "_Facts", param_local: dict[str, float]) -> float:
    """Elements of the weight gradients an op's backward makes: its weights' (a weight it reads
    whole is held whole beside its whole gradient, as `GroupReductions.moment` counts it)."""
    own = sum(param_local.get(name, 0.0) for name, _ in fact.weights)
    return max(own, whole_held(fact))



class _Paired:
    """Each op's moment with the weight gradients it makes, as (bytes per sample by power of seq,
    their total, weight elements): of those, only the ones no other exceeds in both."""

    def __init__(self):
        self.found: list[tuple] = []

    def add(self, at: dict, total: float, elements: float) -> None:
        if any(t >= total and e >= elements for _, t, e in self.found):
            return
        self.found = [(a, t, e) for a, t, e in self.found if not (total >= t and elements >= e)]
        self.found.append((dict(at), total, elements))

    def kept(self) -> tuple:
        return tuple((tuple(at.items()), elements) for at, _, elements in self.found)


def _at(live: dict, kept: dict, fact: "_Facts", freed: list[dict]) -> dict[int, float]:
    """The sweep's moment as {power of seq: bytes}: gradients alive, the rerun's keeps, the op's
    extra, less freed."""
    now = dict(live)
    now[fact.size[0]] = now.get(fact.size[0], 0.0) + fact.extra
    for part, sign in ((kept, 1), *((part, -1) for part in freed)):
        for degree, value in part.items():
            now[degree] = now.get(degree, 0.0) + sign * value
    return now


def _freed_after(first_kept: dict[str, int], nodes: list[NodeLayout], regions: list,
                 layout: GraphLayout) -> tuple[dict, dict, dict]:
    """Position -> (region, storage) freed once that op's backward has run: kept outside
    recomputed regions by it first, or within a region, kept there by it first; region ->
    {power of seq: bytes} its rerun keeps; and position in a region -> what the rerun keeps
    before it reaches that op."""
    freed: dict[int, list] = {}
    for key, position in first_kept.items():
        freed.setdefault(position, []).append((None, key))
    seen: set = set()
    rerun: dict = {}
    before: dict[int, dict] = {}
    for position, node in enumerate(nodes):
        region = regions[position]
        if region is not None:
            before[position] = dict(rerun.get(region, {}))
        for key in node.saved if region is not None else ():
            if (region, key) not in seen:
                seen.add((region, key))
                freed.setdefault(position, []).append((region, key))
                kept, degree = rerun.setdefault(region, {}), layout.seq_degree.get(key, 0)
                kept[degree] = kept.get(degree, 0.0) + layout.storage_bytes.get(key, 0.0)
    return freed, rerun, before


@dataclass(frozen=True, slots=True)
class _Facts:
    """What the sweep reads of one node, the same in every chunk of a layout."""
    differentiable: bool                # its output gets a gradient (an activation needing one)
    size: tuple[int, float]             # its gradient's (power of seq, bytes per sample)
    gives: tuple[tuple[str, bool], ...]     # (differentiable input, takes the gradient as it is)
    slot: bool                          # a multi-output op's item: its gradient fills a slot
    extra: float                        # bytes per sample its backward makes beyond those
    weights: tuple = ()                 # (parameter, its FSDP group) of each weight it reads
    whole: float = 0.0                  # elements of the weights it reads whole (NodeLayout)
    gathering: float = 0.0              # elements alive at the fullest of their gathers
    group: str | None = None            # the FSDP group whose backward it is part of
    expert: bool = False                # an expert's op: its weights are the experts'


def _facts(graph: Graph, layout: GraphLayout) -> tuple[dict, dict]:
    """Node name -> `_Facts`, and value -> the nodes that read it (the model's output included),
    made once per layout and kept in it: every chunk of every candidate plan on it sweeps them."""
    if not layout.gradient_facts:
        by_name = {node.name: node for node in layout.nodes}
        facts, readers = {}, {}
        weights, views = _weights_read(graph)
        # under expert parallelism (its all-to-alls) each layer's experts are an FSDP group of
        # their own, inside their block's (autopar.runtime.data_parallel.expert_data_parallel)
        own_group = any(node.exchange_bytes for node in layout.nodes)
        for node in layout.nodes:
            graph_node = graph.nodes[layout.index[node.name]]
            read = weights.get(node.name, {})
            if own_group and node.expert and read:
                read = dict(weights=tuple((name, f"{group} experts") for name, group in read["weights"]),
                            group=f"{read['group']} experts")
            facts[node.name] = replace(_node_facts(graph, layout, by_name, node, graph_node, views),
                                       **read, expert=node.expert, whole=node.weight_gathered,
                                       gathering=node.weight_gathering)
        for node in graph.nodes:            # the model's output reads from outside every chunk
            for value in node.inputs:
                readers.setdefault(value, []).append("" if node.role is Role.OUTPUT else node.name)
        layout.gradient_facts.update(facts=facts, readers=readers, peaks={})
    return layout.gradient_facts["facts"], layout.gradient_facts["readers"]


def _weights_read(graph: Graph) -> tuple[dict[str, dict], set[str]]:
    """Node name -> the `_Facts` fields of the weights it reads (through views and casts of a
    parameter, as cost/layout.py resolves them) and of the FSDP group it is part of: its block
    instance's, else its first weight's (cost.stages.parameter_groups); and the names of those
    views and casts."""
    groups, weight_of = parameter_groups(graph), {}
    block = _running_groups(graph, set(groups.values()))
    out = {}
    for i, node in enumerate(graph.nodes):
        read = [weight_of.get(name, name) for name in node.inputs
                if name in weight_of or name in groups]
        if node.role is Role.PARAMETER or len(node.inputs) != 1 or not read:
            pass
        elif op_name(node.target) in _PASSING:        # w.t(), w.to(bf16): still the weight
            weight_of[node.name] = read[0]
            continue
        weights = tuple((name, groups[name]) for name in dict.fromkeys(read))
        group = block.get(i) or (weights[0][1] if weights else None)
        if node.role is Role.ACTIVATION and (weights or group):
            out[node.name] = dict(weights=weights, group=group)
    return out, set(weight_of)


def _running_groups(graph: Graph, groups: set[str]) -> dict[int, str]:
    """Node index -> the FSDP group whose module runs it: its block instance, or in a model
    without blocks its module unit's (cost.units.module_units: a parent module's own ops, such
    as attention between two projections, or a head's logit capping, run in the unit before
    them), which may hold it with another unit (cost.stages.parameter_groups: tied weights)."""
    running = {}
    for kind in graph.blocks:
        for instance in kind.instances:
            running.update(dict.fromkeys(range(instance.start, instance.stop), instance.module_path))
    holder = {path: group for group in groups for path in group.split(TIED_SEPARATOR)}
    for paths, first, stop in module_units(graph):
        if len(paths) == 1 and paths[0] in holder:
            for index in range(first, stop):
                running.setdefault(index, holder[paths[0]])
    return running


def _node_facts(graph: Graph, layout: GraphLayout, by_name: dict, node: NodeLayout,
                graph_node, weight_views: set[str]) -> _Facts:
    name = op_name(graph_node.target)
    elementwise = node.family != "view" and name != "cat"
    gives = []
    for k, value in enumerate(graph_node.inputs):
        source = by_name.get(value)
        # the gradient of a weight's view (w.t() read by a grouped GEMM) is the weight's own,
        # counted with the weight gradients of its group
        if source is None or not source.requires_grad or value in weight_views or \
                graph.nodes[layout.index[value]].role is not Role.ACTIVATION or \
                k in TAKES_NO_GRADIENT.get(name, ()):
            continue
        passes = name in _PASSING and \
            (not elementwise or graph.nodes[layout.index[value]].shape == graph_node.shape)
        gives.append((value, passes))
    size = (layout.seq_degree.get(layout.storage.get(node.name, node.name), 0), node.out_bytes)
    extra = _temporaries(graph_node, node, graph, layout, {value for value, _ in gives}) * node.out_bytes \
        + node.backward_bytes
    return _Facts(differentiable=node.requires_grad and graph_node.role is Role.ACTIVATION,
                  size=size, gives=tuple(gives), slot=name == "getitem", extra=extra)


def _give_inputs(fact: _Facts, facts: dict, incoming: list[int], grads: _Gradients) -> list[int]:
    """Give each differentiable input of a node its gradient: the one the node takes where its
    backward hands that on (`_PASSING`: a view, or an input of the output's shape), else a new
    one. Returns the new ones, which the running op holds until it ends."""
    made = []
    for value, passes in fact.gives:
        passes = passes and len(incoming) == 1
        gradient = incoming[0] if passes else grads.make(*facts[value].size)
        if not passes:
            made.append(gradient)
        grads.give(value, gradient, slot=fact.slot)
    return made


def _temporaries(graph_node, node: NodeLayout, graph: Graph, layout: GraphLayout,
                 given: set[str]) -> int:
    """Output-sized tensors `node`'s backward makes beyond its inputs' gradients: its derivative's
    (`_TEMPORARIES`, where the input they differentiate gets a gradient: `given`), and for an
    elementwise op with a weight broadcast over the rows (a norm's scale, a bias), the product
    of the gradient with the other factor before its sum over them."""
    broadcast = node.family == "elementwise" and any(
        graph.nodes[layout.index[name]].role is Role.PARAMETER
        and graph.nodes[layout.index[name]].shape != graph_node.shape for name in graph_node.inputs)
    name = op_name(graph_node.target)
    position = _TEMPORARIES_FOR_INPUT.get(name)
    differentiated = position is None or (len(graph_node.inputs) > position
                                          and graph_node.inputs[position] in given)
    return _TEMPORARIES.get(name, 0) * differentiated + int(broadcast)


def first_keepers(graph: Graph, layout: GraphLayout, regions: list, nodes: list[NodeLayout]) -> dict:
    """Saved storage -> the position of the first node keeping it outside recomputed regions,
    or of a recomputed region's first node where the region keeps it (its inputs, which the
    checkpoint holds until the region's backward is done)."""
    kept_at: dict[str, int] = {}
    members: dict[str, set[int]] = {}
    for position, node in enumerate(nodes):
        i = layout.index[node.name]
        if regions[i]:
            members.setdefault(regions[i], set()).add(i)
        for key in () if regions[i] else node.saved:
            kept_at.setdefault(key, position)
    at = {layout.index[node.name]: position for position, node in enumerate(nodes)}
    for inside in members.values():
        first = min(at[i] for i in inside)
        for key in region_inputs(graph, layout, inside):
            kept_at[key] = min(kept_at.get(key, first), first)
    return kept_at


def region_inputs(graph: Graph, layout: GraphLayout, members: set[int]) -> set[str]:
    """What a recomputed region keeps: the activations it reads from outside itself."""
    inside = {graph.nodes[i].name for i in members}
    kept = set()
    for i in members:
        for name in graph.nodes[i].inputs:
            if name not in inside and graph.nodes[layout.index[name]].role is Role.ACTIVATION:
                kept.add(layout.storage[name])
    return kept
