"""Megatron-LM's tensor-parallel layout of a captured graph, as placements on the tensor-parallel
axis: a producer of placements beside the sharding ILP, in the ILP's form (`TensorPlacements`),
which the estimator prices as it prices any plan's. Published runs of Megatron-LM are priced on it
(autopar.cost.reference); autopar's own plans, forced or free, on the ILP's.

The rule is the one Megatron-LM applies by hand (Shoeybi et al. 2019; Korthikanti et al. 2022),
read off the graph's data flow rather than a model formula:
- a matmul with a weight whose activation input is whole is column-parallel: the weight split on
  its output features (and its bias with them), the output split on its last dim; with too few
  output features to split, or a mixture-of-experts router (a top-k choice over the experts
  needs all their scores), it stays whole;
- one whose input is split on the contracted features is row-parallel: the weight split on its
  input features, partial sums out;
- an embedding looked up by the model's input ids is vocab-parallel: the table split on its rows,
  partial sums out;
- every other op follows its inputs: the placement its sharding rule writes from them as placed.
  Partial sums never flow on: an op reading them reads them reduced (Megatron all-reduces a
  row-parallel output where the residual stream takes it), or, with sequence parallelism,
  reduce-scattered onto the sequence; a split no rule reads (multi-query attention's key/value
  heads, fewer than tp) is gathered, as Megatron keeps those heads whole on every rank;
- with sequence parallelism every norm reads the residual stream split on the sequence.
Query heads must divide tp, as in Megatron.
"""

from __future__ import annotations

from autopar.cost.compute import op_family
from autopar.cost.expert_layers import routers
from autopar.cost.layout import TensorPlacements, op_name, strategy_strings
from autopar.errors import AutoparError
from autopar.graph import Graph, Node, Role
from autopar.plans.placements import PARTIAL, REPLICATE, is_shard, shard

SEQUENCE_DIM = 1                # of the residual stream, [batch, sequence, hidden]
R, P = str(REPLICATE), str(PARTIAL)


def megatron_placements(graph: Graph, tp: int, *,
                        sequence_parallel: bool = False) -> TensorPlacements | None:
    """Megatron-LM's placements of `graph` on a tensor-parallel axis of `tp` devices (module
    doc); None for tp = 1, which has no tensor-parallel axis."""
    if tp == 1:
        return None
    return _Walk(graph, tp, sequence_parallel).run()


class _Walk:
    """One walk over the graph in topological order; each op's placement follows its inputs'."""

    def __init__(self, graph: Graph, tp: int, sequence_parallel: bool):
        self.graph, self.tp, self.sp = graph, tp, sequence_parallel
        self.by_name = {node.name: node for node in graph.nodes}
        self.place: dict[str, str] = {}             # node -> its output's placement
        self.weight_of: dict[str, str] = {}         # a view or cast of a parameter -> the parameter
        self.from_input: set[str] = set()           # derived from the model's inputs alone (ids)
        self.norms = {norm for norm, _, _ in graph.norm_reads()} if sequence_parallel else set()
        self.routers = routers(graph)

    def run(self) -> TensorPlacements:
        for node in self.graph.nodes:
            if node.role is Role.ACTIVATION and node.target != "output":
                self._op(node)
            elif node.role is Role.INPUT:
                self.from_input.add(node.name)
        for node in self.graph.nodes:       # views of weights, once their weights are placed
            if node.name in self.weight_of:
                self.place[node.name] = self._follow(node, self._current(node)) or R
            elif node.role is Role.PARAMETER:
                self.place.setdefault(node.name, R)
        return TensorPlacements(
            nodes={node.name: self.place.get(node.name, R) for node in self.graph.nodes
                   if node.role is not Role.PARAMETER},
            parameters={node.name: self.place.get(node.name, R) for node in self.graph.parameters})

    def _op(self, node: Node) -> None:
        family = op_family(node.target)
        weights = [self.weight_of.get(i, i) for i in node.inputs if self._is_weight(i)]
        activations = [i for i in node.inputs if not self._is_weight(i)
                       and self.by_name[i].role is not Role.BUFFER]
        if len(node.inputs) == 1 and weights and (family == "view"
                                                  or op_name(node.target) in ("_to_copy", "to")):
            self.weight_of[node.name] = weights[0]      # w.t(), w.to(bf16): still the weight
            return
        if activations and all(i in self.from_input for i in activations) and not weights:
            self.from_input.add(node.name)
        if family == "attention":
            self._check_heads(node, activations)
        current = self._current(node)
        chosen = None
        if family == "matmul" and weights:
            chosen = self._matmul(node, current)
        elif family == "embedding" and weights and activations and \
                all(i in self.from_input for i in activations):
            chosen = self._written(node, P, lambda ins: self._weights_sharded(node, ins, dim=0))
        if chosen is None:
            self.place[node.name] = self._follow(node, current) or self._reduced(node)
            return
        out, inputs = chosen
        self.place[node.name] = out
        for name, placement in zip(node.inputs, inputs):
            if self._is_weight(name):
                self._place_weight(name, placement)

    def _matmul(self, node: Node, current: list[str | None]):
        """Row-parallel when the activation arrives split on the contracted features (a strategy
        writing partial sums reads it as it is), else column-parallel."""
        def reads(ins: tuple[str, ...], want) -> bool:
            """The activations read as `want` says, and some weight split."""
            return all(want(k, placement) for k, placement in enumerate(ins)
                       if not self._is_weight(node.inputs[k])) and self._weights_sharded(node, ins)

        row = self._written(node, P, lambda ins: reads(ins, lambda k, placement: placement == current[k]))
        if row is not None:
            return row
        last = f"S({len(node.shape) - 1})" if node.shape else None
        if last is None or node.shape[-1] % self.tp or node.name in self.routers:
            return None                 # too few output features to split, or a router: whole
        return self._written(node, last, lambda ins: reads(ins, lambda k, placement: placement == R))

    def _written(self, node: Node, out: str, accepts):
        """The first strategy of `node`'s rule that writes `out` from inputs `accepts` takes,
        with every weight already placed read as placed; None if there is none."""
        for written, inputs in self._strategies(node):
            if written == out and accepts(inputs) and all(
                    self._weight_placement(name) in (None, inputs[k])
                    for k, name in enumerate(node.inputs) if self._is_weight(name)):
                return written, inputs
        return None

    def _strategies(self, node: Node) -> list[tuple[str, tuple[str, ...]]]:
        """The rule's strategies whose split dims the tp devices divide evenly."""
        return strategy_strings(node, self.by_name, self.tp)

    def _weights_sharded(self, node: Node, inputs: tuple[str, ...], dim: int | None = None) -> bool:
        """Some weight the strategy reads is split (on `dim` when given; biases follow)."""
        return any(is_shard(inputs[k]) and (dim is None or inputs[k] == str(shard(dim)))
                   for k, name in enumerate(node.inputs) if self._is_weight(name))

    def _follow(self, node: Node, current: list[str]) -> str | None:
        """The output the rule writes from the inputs as placed; partial sums only for a scalar
        (a loss: vocab-parallel cross-entropy's, reduced where it is read)."""
        for written, inputs in self._strategies(node):
            if (written != P or not node.shape) and list(inputs) == current:
                if node.name in self.norms and not is_shard(written):
                    continue                # a norm reads the stream split on the sequence
                return written
        return None

    def _reduced(self, node: Node) -> str:
        """Where the inputs as placed are read by no rule: the stream split on the sequence under
        sequence parallelism (partial sums reduce-scattered onto it), whole otherwise."""
        split = str(shard(SEQUENCE_DIM))
        stream = self.sp and len(node.shape) == 3 and node.shape[SEQUENCE_DIM] % self.tp == 0
        if stream and any(written == split for written, _ in self._strategies(node)):
            return split
        return R

    def _current(self, node: Node) -> list[str]:
        """Each input's placement; a weight no matmul or lookup has split yet is whole."""
        return [(self._weight_placement(name) or R) if self._is_weight(name)
                else self.place.get(name, R) for name in node.inputs]

    def _is_weight(self, name: str) -> bool:
        return self.by_name[name].role is Role.PARAMETER or name in self.weight_of

    def _weight_placement(self, name: str) -> str | None:
        """A placed weight's placement, or a view's of it; None while the weight is not placed."""
        if name not in self.weight_of:
            return self.place.get(name)
        view = self.by_name[name]
        source = self._weight_placement(view.inputs[0])
        return None if source is None else self._follow(view, [source]) or R

    def _place_weight(self, name: str, placement: str) -> None:
        """Place a weight read as `placement`, through the views and casts it is read by: each
        view's rule says how the placement it writes maps back onto its input."""
        while name in self.weight_of:
            view = self.by_name[name]
            source = view.inputs[0]
            backward = [inputs[0] for written, inputs in self._strategies(view)
                        if written == placement]
            placement = backward[0] if backward else R
            name = source
        # a weight read as partial sums (a row-parallel matmul's bias) is stored whole: adding it
        # on one rank is a local step
        self.place.setdefault(name, R if placement == P else placement)

    def _check_heads(self, node: Node, activations: list[str]) -> None:
        """Query heads are split over tp (key/value heads may be fewer: gathered, above)."""
        shape = self.by_name[activations[0]].shape if activations else ()
        heads = shape[-3] if len(shape) >= 3 else 1
        if heads % self.tp:
            where = f" in {node.module_path}" if node.module_path else ""
            raise AutoparError(f"tp={self.tp} does not divide the {heads} heads of {node.name}{where}; "
                               f"choose a tensor-parallel degree that divides {heads}")
