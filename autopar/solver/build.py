"""Graph + Mesh -> Problem: every node's strategies with their costs, every edge's resharding costs.

Strategies. An op's strategies are its rule's one-axis strategies (`autopar.cost.strategies`)
combined over the mesh axes; an op without a rule has one, everything replicated, and is listed
as replicated. A parameter chooses per axis how it is STORED: replicated "R"; sharded "S(d)",
which is tensor parallelism when its consumer uses it sharded and ZeRO-3/FSDP when the consumer
gathers it (all-gather before use in the forward and again in the backward, reduce-scatter of its
gradient: priced on the edge); or "Z", replicated weights with gradients and optimizer state
sharded on that axis (ZeRO-1/2: a reduce-scatter of the gradient on the edge, an all-gather of
the updated weights priced on the node). A replicated parameter used by work split on an axis gets
its gradient all-reduced there: data parallelism, priced on the edge. Graph inputs choose any
placement for free (each rank loads its part); graph outputs are made replicated (priced on their
producer's strategy).

Roles. `roles={"node": "dp", "gpu": "tp"}` (`AxisRole`) restricts axes: a data axis shards every
activation that has a batch dim on it and nothing else, its ops see parameters replicated (stored
R, Z or S: ZeRO); a tensor axis never shards the batch, and stores every matrix parameter
sharded on it (what a tensor-parallel degree means to the estimator and to a user who forces one). The batch dim of every tensor is found by following the graph inputs'
dim 0 through the rules. A forced configuration also fixes sequence parallelism: the residual
stream is read by each norm split on the sequence on the tensor axis, or whole (where it is
split is left to the ILP: a reshape may not keep the sequence split, a norm reading it can).

Memory (per device, alive at the peak of a training step, no recompute): parameters, gradients
and Adam state (two fp32 moments, plus an fp32 master copy of 16-bit weights) under their storage
placement, plus the activations autograd keeps for the backward: an op's inputs (matmuls, norms,
non-linear element-wise ops) and/or its output (softmax, attention), each under the placement the
op reads or writes it in; sums, views and copies keep nothing. A tensor kept by several ops
counts once, charged to the first op that keeps it (its producer when that keeps its output), under
that op's placement: q, k and v projections keep one input, once. Partial sums count at full size. Transient
buffers (a gathered ZeRO-3 weight, a collective's output) are not counted.

Ties. With `tie_blocks`, the k-th instance of a repeated block (Graph.blocks) has each node tied
to the node at the same position of instance 0, and the parameters they read tied likewise.
"""

from __future__ import annotations

from collections.abc import Mapping

from autopar.cost.mesh import Mesh
from autopar.cost.reshard import gradient_given, gradient_need, work_split
from autopar.plans.vocabulary import AXIS_ROLES, AxisRole
from autopar.cost.strategies import (R, S, OpStrategy, OpView, axis_strategies, combine,
                                     out_of_place, placement_str)
from autopar.errors import AutoparError
from autopar.graph import Graph, Node, Role
from autopar.solver.op_prices import (NOT_DIFFERENTIABLE, ZERO2, OpPricer, local_bytes,
                                    optimizer_bytes, saved_for_backward)
from autopar.solver.problem import Edge, Problem, ProblemNode, Strategy

SKIPPED = ("output",)
SEQUENCE_DIM = 1        # of the residual stream, [batch, sequence, hidden]


def build_problem(graph: Graph, mesh: Mesh, *, memory_limit: float | None = None,
                  roles: Mapping[str, str] | None = None, tie_blocks: bool = True,
                  overlap: bool = False, pricer: OpPricer | None = None,
                  sequence_parallel: bool | None = None) -> Problem:
    """`overlap`: parameter and gradient traffic (gradient reduction, ZeRO gathers) hides behind
    the backward's compute and only the excess counts; off, every byte counts.
    `sequence_parallel` (a forced configuration's): on a tensor axis, the residual stream entering
    each norm is split on its sequence dim (True) or whole (False); None leaves it to the ILP."""
    roles = check_roles(mesh, roles)
    builder = _Builder(graph, mesh, roles, pricer or OpPricer(mesh), overlap)
    if sequence_parallel is not None:
        wanted = S(SEQUENCE_DIM) if sequence_parallel else R
        for norm, k, value in graph.norm_reads():
            builder.stream.setdefault(norm, {})[k] = (value, wanted)
    return builder.build(memory_limit, tie_blocks)


def check_roles(mesh: Mesh, roles: Mapping[str, str] | None) -> list[str | None]:
    """Roles as a list per mesh axis; a clear error for unknown axes or roles."""
    roles = dict(roles or {})
    names = [axis.name for axis in mesh.axes]
    for name, role in roles.items():
        if name not in names:
            raise AutoparError(f"roles name axis {name!r}, which mesh {mesh} does not have; "
                               f"its axes are {names}")
        if role not in AXIS_ROLES:
            raise AutoparError(f"role {role!r} for axis {name!r} is unknown; roles are {AXIS_ROLES}")
    return [AxisRole(roles[name]) if name in roles else None for name in names]


class _Builder:
    def __init__(self, graph: Graph, mesh: Mesh, roles: list[str | None], pricer: OpPricer,
                 overlap: bool):
        self.graph, self.mesh, self.roles, self.pricer = graph, mesh, roles, pricer
        self.overlap = overlap
        self.sizes = pricer.sizes
        self.by_name = {n.name: n for n in graph.nodes}
        self.views = {n.name: self._view(n) for n in graph.nodes if n.target not in SKIPPED}
        self.batch = self._batch_dims()
        self.tie = {}
        self.edge_cache: dict[tuple, tuple] = {}
        self.kept = self._kept_inputs()
        self.outputs = {name for n in graph.nodes if n.target == "output" for name in n.inputs}
        self.requiring_grad = graph.requiring_grad()
        self.stream: dict = {}      # norm node -> {input index: (value, its forced placement on a tensor axis)}
        self.handed_on = self._handed_on()

    def build(self, memory_limit: float | None, tie_blocks: bool) -> Problem:
        if tie_blocks:
            self.tie = self._ties()
        made: dict[str, ProblemNode] = {}
        for node in self.graph.nodes:
            if node.target in SKIPPED:
                continue
            tied = self.tie.get(node.name)
            if tied is not None:
                first = made[tied]
                made[node.name] = ProblemNode(name=node.name, kind=first.kind, tie=tied,
                                              strategies=first.strategies, label=self._label(node))
            else:
                made[node.name] = self._node(node)
        edges = [edge for node in self.graph.nodes if node.name in made
                 for edge in self._edges(node, made)]
        meta = {"mesh": str(self.mesh), "roles": self.roles, "model": self.graph.model_type,
                "fingerprint": self.graph.fingerprint()}
        return Problem(axes=[[a.name, a.size] for a in self.mesh.axes], nodes=list(made.values()),
                       edges=edges, memory_limit=memory_limit, meta=meta)

    # --- strategies ------------------------------------------------------------------------

    def _view(self, node: Node) -> OpView:
        shapes = tuple(self.by_name[name].shape for name in node.inputs)
        return OpView(target=node.target, args=node.args, input_shapes=shapes,
                      output_shape=node.shape)

    def _label(self, node: Node) -> str:
        return node.param_fqn or f"{node.module_path or '<top>'}:{node.target}"

    def _node(self, node: Node) -> ProblemNode:
        label = self._label(node)
        if node.role is Role.PARAMETER:
            return ProblemNode(name=node.name, kind="parameter", label=label,
                               strategies=self._parameter_strategies(node))
        if node.target == "placeholder":
            combos = combine([self._input_axis(node, role) for role in self.roles], self.sizes,
                             node.shape, [])
            return ProblemNode(name=node.name, kind="input", label=label, strategies=[
                Strategy(output=[placement_str(s.output) for s in c], inputs=[]) for c in combos])
        one_axis = axis_strategies(self.views[node.name])
        kind = "op" if one_axis is not None else "replicated"
        per_axis = [self._allowed(node, one_axis or [], role, size)
                    for role, size in zip(self.roles, self.sizes)]
        combos = combine(per_axis, self.sizes, node.shape, self.views[node.name].input_shapes)
        return ProblemNode(name=node.name, kind=kind, label=label,
                           strategies=[self._op_strategy(node, c) for c in combos])

    def _input_axis(self, node: Node, role: str | None) -> list[OpStrategy]:
        dims = range(len(node.shape))
        batch = self.batch.get(node.name)
        if role == AxisRole.DATA:
            return [OpStrategy(S(batch), ())] if batch is not None else [OpStrategy(R, ())]
        if role == AxisRole.TENSOR:
            dims = [d for d in dims if d != batch]
        return [OpStrategy(R, ())] + [OpStrategy(S(d), ()) for d in dims]

    def _allowed(self, node: Node, one_axis: list[OpStrategy], role: str | None,
                 size: int) -> list[OpStrategy]:
        replicated = OpStrategy(R, tuple(R for _ in node.inputs))
        if role is None:
            return one_axis or [replicated]
        if role == AxisRole.TENSOR:
            allowed = [replicated] + [s for s in one_axis[1:] if not any(self._on_batch(node, s))]
            if node.name in self.stream:
                allowed = self._forced_stream(node, allowed, size)
            if node.name in self.handed_on:
                allowed = [s for s in allowed if not s.output.is_partial()] or allowed
            # matrices are used where they are stored, split (see _parameter_strategies)
            split = [s for s in allowed if not self._uses_whole_matrix(node, s)]
            return split or allowed
        # a data axis splits the batch wherever there is one, and only the batch
        split = [s for s in one_axis[1:] if self._batch_split(node, s, self._on_batch(node, s))]
        return split or [replicated]

    def _handed_on(self) -> set[str]:
        """The values a block instance hands on to the nodes after it, where a pipeline may cut
        the model. They are not left as partial sums on a tensor axis: a stage cannot send one
        (its sender would reduce it, unpriced, and its receiver hold it in another placement
        than the plan's), and the reduction costs the same at the end of the block as at the
        start of the next."""
        owner: dict[int, tuple] = {}
        for kind in self.graph.blocks:
            for number, instance in enumerate(kind.instances):
                owner.update({i: (kind.kind, number) for i in range(instance.start, instance.stop)})
        index = {n.name: i for i, n in enumerate(self.graph.nodes)}
        return {name for j, node in enumerate(self.graph.nodes) for name in node.inputs
                if index[name] in owner and owner[index[name]] != owner.get(j)}

    def _forced_stream(self, node: Node, allowed: list[OpStrategy], size: int) -> list[OpStrategy]:
        """The strategies of a norm that read the residual stream as the forced configuration says."""
        reads = self.stream[node.name]
        kept = [s for s in allowed if all(s.inputs[k] == wanted for k, (_, wanted) in reads.items())]
        for value, wanted in reads.values():
            shape = self.by_name[value].shape
            if wanted != R and (len(shape) <= SEQUENCE_DIM or shape[SEQUENCE_DIM] % size):
                kept = []
            if not kept:
                raise AutoparError(f"sequence parallelism: {value} (shape {list(shape)}, read by "
                                   f"the norm {node.module_path or node.name}) "
                                   f"{_unsplittable(shape, size)}")
        return kept

    def _uses_whole_matrix(self, node: Node, strategy: OpStrategy) -> bool:
        return any(p == R and self.by_name[name].role is Role.PARAMETER
                   and len(self.by_name[name].shape) >= 2
                   for name, p in zip(node.inputs, strategy.inputs))

    def _on_batch(self, node: Node, strategy: OpStrategy) -> list[bool]:
        """For the output and each input: is it sharded on its batch dim?"""
        tensors = [(node.name, strategy.output)] + list(zip(node.inputs, strategy.inputs))
        return [getattr(p, "dim", None) is not None and p.dim == self.batch.get(name)
                for name, p in tensors]

    def _batch_split(self, node: Node, strategy: OpStrategy, on_batch: list[bool]) -> bool:
        """Every tensor with a batch dim sharded on it, every other one replicated."""
        tensors = [(node.name, strategy.output)] + list(zip(node.inputs, strategy.inputs))
        for (name, placement), sharded in zip(tensors, on_batch):
            has_batch = self.batch.get(name) is not None
            if has_batch != sharded or (not has_batch and placement != R):
                return False
        return True

    def _batch_dims(self) -> dict[str, int]:
        """Follow the graph inputs' dim 0 through each op's batch-split strategy."""
        batch: dict[str, int] = {}
        for node in self.graph.nodes:
            if node.role is Role.INPUT and node.shape:
                batch[node.name] = 0
            if node.target == "placeholder" or node.target in SKIPPED:
                continue
            if not any(name in batch for name in node.inputs):
                continue
            for strategy in axis_strategies(self.views[node.name]) or []:
                fits = all((p == R) if name not in batch else (getattr(p, "dim", None) == batch[name])
                           for name, p in zip(node.inputs, strategy.inputs))
                if fits and getattr(strategy.output, "dim", None) is not None:
                    batch[node.name] = strategy.output.dim
                    break
        return batch

    def _op_strategy(self, node: Node, combo: tuple[OpStrategy, ...]) -> Strategy:
        output = [placement_str(s.output) for s in combo]
        inputs = [[placement_str(s.inputs[k]) for s in combo] for k in range(len(node.inputs))]
        split = work_split(output, inputs, self.sizes)
        moved = local_bytes(node.bytes, output, self.sizes) + sum(
            local_bytes(self.by_name[name].bytes, p, self.sizes) for name, p in zip(node.inputs, inputs))
        forward, backward = self.pricer.op_time(node.target, node.flops, moved, split, node.dtype)
        kept_inputs, kept_output = self.kept[node.name]
        saved = sum(local_bytes(self.by_name[node.inputs[k]].bytes, inputs[k], self.sizes)
                    for k in kept_inputs)
        if kept_output:
            saved += local_bytes(node.bytes, output, self.sizes)
        # the program's outputs leave it replicated (the loss reads whole logits)
        leaving = (self.pricer.reshard(tuple(output), ("R",) * len(output), node.bytes)
                   if node.name in self.outputs else 0.0)
        return Strategy(output=output, inputs=inputs, compute_s=forward + backward,
                        backward_s=backward, memory_bytes=saved, comm_s=leaving)

    def _kept_inputs(self) -> dict[str, tuple[list[int], bool]]:
        """Per op: the inputs it keeps for the backward (never parameters: their memory is the
        parameter's) and whether it keeps its output. A tensor kept by several ops (x read by
        q, k and v) is one tensor in memory: it is charged to the first op that keeps it."""
        kept, charged = {}, set()
        for node in self.graph.nodes:
            keeps_inputs, keeps_output = saved_for_backward(node.target)
            mine = []
            for k, name in enumerate(node.inputs):
                if keeps_inputs and self.by_name[name].role is not Role.PARAMETER and name not in charged:
                    charged.add(name)
                    mine.append(k)
            kept[node.name] = (mine, keeps_output)
            if keeps_output:          # produced here, so no op before charged it
                charged.add(node.name)
        return kept

    def _parameter_strategies(self, node: Node) -> list[Strategy]:
        per_axis = []
        for role in self.roles:
            sharded = [f"S({d})" for d in range(len(node.shape)) if node.shape[d] % self.sizes[len(per_axis)] == 0]
            choices = ["R"] + sharded
            if role != AxisRole.TENSOR and node.shape:
                choices.insert(1, ZERO2)
            elif role == AxisRole.TENSOR and len(node.shape) >= 2 and sharded:
                # A tensor axis exists to split the model's matrices: the estimator prices a
                # tensor-parallel degree as weights stored 1/tp per device, so the ILP may not
                # buy back its communication by replicating them.
                choices = sharded
            per_axis.append(choices)
        found = []
        for combo in _product(per_axis):
            storage = ["R" if c == ZERO2 else c for c in combo]
            grads = ["S(0)" if c == ZERO2 else c for c in combo]
            if not (_even(node.shape, storage, self.sizes) and _even(node.shape, grads, self.sizes)):
                continue
            param = local_bytes(node.bytes, storage, self.sizes)
            states = local_bytes(node.bytes + optimizer_bytes(node.bytes, node.dtype), grads, self.sizes)
            # ZeRO-1/2: each rank updates its shard, then the updated weights are all-gathered,
            # one parameter at a time after the step (latency included, nothing to hide it behind)
            gather = sum(self.pricer.all_gather(param, a) for a, c in enumerate(combo) if c == ZERO2)
            found.append(Strategy(output=storage, inputs=[], gradient=grads, comm_s=gather,
                                  memory_bytes=param + states))
        return found

    # --- edges -----------------------------------------------------------------------------

    def _edges(self, node: Node, made: dict[str, ProblemNode]) -> list[Edge]:
        found = []
        dst = made[node.name]
        for k, name in enumerate(node.inputs):
            if name not in made:
                continue
            src_node = self.by_name[name]
            one_tensor = src_node.dtype != ""     # a multi-output producer: price the piece read
            nbytes = src_node.bytes if one_tensor else node.bytes
            # a buffer's gradient (a rotary table read by sharded heads) is never reduced
            differentiable = (name in self.requiring_grad and
                              (src_node.dtype if one_tensor else node.dtype) not in NOT_DIFFERENTIABLE)
            is_param = src_node.role is Role.PARAMETER
            written = k == 0 and out_of_place(node.target) != node.target
            key = (id(made[name].strategies), id(dst.strategies), k, nbytes, differentiable, written)
            if key not in self.edge_cache:
                self.edge_cache[key] = self._edge_classes(made[name], dst, k, nbytes,
                                                          differentiable, is_param, written)
            src_class, dst_class, cost = self.edge_cache[key]
            found.append(Edge(src=name, dst=node.name, arg=k, src_class=src_class,
                              dst_class=dst_class, cost=cost,
                              overlapped=is_param and self.overlap))
        return found

    def _edge_classes(self, src: ProblemNode, dst: ProblemNode, k: int, nbytes: float,
                      differentiable: bool, is_param: bool, written: bool = False) -> tuple:
        """Classes of the two ends' strategies and the cost of each pair (None: not allowed). A
        value an op writes in place is taken as it was made: DTensor cannot move it first."""
        src_keys = [(tuple(s.output), gradient_need(s.output, s.gradient)) for s in src.strategies]
        dst_keys = [(tuple(s.inputs[k]), gradient_given(s.output, s.inputs, k))
                    for s in dst.strategies]
        src_ids, dst_ids = _classes(src_keys), _classes(dst_keys)
        src_unique = sorted(set(src_keys), key=src_ids.get)
        dst_unique = sorted(set(dst_keys), key=dst_ids.get)
        cost = []
        for out, need in src_unique:
            row = []
            for given_in, grad in dst_unique:
                forward = self.pricer.reshard(out, given_in, nbytes, bucketed=is_param)
                backward = (self.pricer.reshard(grad, need, nbytes, bucketed=is_param)
                            if differentiable else 0.0)
                if written and given_in != out:
                    row.append(None)
                elif forward is None or backward is None or (is_param and _zero3_off_dim0(need, given_in)):
                    row.append(None)
                else:   # a gathered parameter is freed after use and gathered again for the backward
                    row.append(forward * (2 if is_param else 1) + backward)
            cost.append(row)
        return [src_ids[key] for key in src_keys], [dst_ids[key] for key in dst_keys], cost

    def _ties(self) -> dict[str, str]:
        """Node (and parameter) of block instance k -> the same position in instance 0."""
        tie: dict[str, str] = {}
        for kind in self.graph.blocks:
            first = kind.instances[0]
            for instance in kind.instances[1:]:
                for offset in range(first.stop - first.start):
                    mine = self.graph.nodes[instance.start + offset]
                    theirs = self.graph.nodes[first.start + offset]
                    if not self._same(mine, theirs):
                        continue
                    tie[mine.name] = theirs.name
                    for a, b in zip(mine.inputs, theirs.inputs):
                        pa, pb = self.by_name[a], self.by_name[b]
                        if pa.role is Role.PARAMETER and pb.role is Role.PARAMETER and self._same(pa, pb):
                            tie.setdefault(a, b)
        return tie

    def _same(self, a: Node, b: Node) -> bool:
        return (a.target == b.target and a.shape == b.shape and a.dtype == b.dtype
                and a.args == b.args and a.name in self.views and b.name in self.views
                and self.views[a.name].input_shapes == self.views[b.name].input_shapes)


def _zero3_off_dim0(stored: tuple[str, ...], used: tuple[str, ...]) -> bool:
    """A parameter gathered for use (ZeRO-3/FSDP) is kept sharded on dim 0, as FSDP does; storing
    it on another dim instead costs and saves the same, so those duplicates are left out."""
    return any(s.startswith("S") and s != "S(0)" and u == "R" for s, u in zip(stored, used))


def _even(shape, placements: list[str], sizes: list[int]) -> bool:
    split = [1] * len(shape)
    for p, size in zip(placements, sizes):
        if p.startswith("S"):
            split[int(p[2:-1])] *= size
    return all(dim % parts == 0 for dim, parts in zip(shape, split))


def _product(per_axis: list[list[str]]) -> list[tuple[str, ...]]:
    combos = [()]
    for choices in per_axis:
        combos = [c + (x,) for c in combos for x in choices]
    return combos


def _classes(keys: list) -> dict:
    ids: dict = {}
    for key in keys:
        ids.setdefault(key, len(ids))
    return ids


def _unsplittable(shape: tuple, size: int) -> str:
    """Why a norm cannot read its input split on the sequence over `size` tensor-parallel ranks,
    and what to do. (No semicolons: a forced configuration's refusal keeps the reason up to the
    first one.)"""
    if len(shape) != 3:
        return ("is not [batch, sequence, hidden]: the model reshapes the stream before this norm, "
                "so there is no sequence dim to split, and sequence_parallel must stay off")
    if shape[SEQUENCE_DIM] % size:
        return (f"has a sequence of {shape[SEQUENCE_DIM]}, which {size} tensor-parallel ranks do "
                f"not divide: use a sequence length that they divide, or leave sequence_parallel off")
    return "cannot be read split on its sequence dim by this norm: leave sequence_parallel off"
