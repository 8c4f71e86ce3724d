"""The captured model graph, as the later stages see it.

`autopar.capture` builds a `Graph` from `torch.export`'s ATen training IR. Nodes are in
topological order; each carries its output's shape, dtype and bytes, its role, the module it came
from and the FLOPs of its forward. `blocks` groups structurally identical submodules (transformer
layers) so that the solver can price one block and reuse it for its N copies.
"""

from __future__ import annotations

import enum
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Callable

# ATen ops (by packet) that normalize over the batch (BatchNorm) when their `training` argument,
# args[5], is true, and the norms that then also write their running statistics (args 3 and 4)
# without saying so in their schema (instance norm's args[5] is `use_input_stats`).
BATCH_STATISTICS = ("batch_norm", "native_batch_norm", "_native_batch_norm_legit")
RUNNING_STATISTICS = (*BATCH_STATISTICS, "instance_norm")
from autopar.plans.stage_flow import FlowNode, NodeKind


class Role(str, enum.Enum):
    PARAMETER = "parameter"
    BUFFER = "buffer"
    INPUT = "input"
    ACTIVATION = "activation"
    OUTPUT = "output"


@dataclass(kw_only=True, slots=True)
class Node:
    name: str                       # the FX node's name, unique in the graph
    target: str                     # "aten.mm.default"; "placeholder" or "output" for graph inputs/outputs
    role: Role
    shape: tuple[int, ...]          # of the output; () for a scalar or for a multi-output node
    dtype: str                      # "float32", "int64", ...; "" when the output is not one tensor
    bytes: int                      # of all outputs together
    inputs: tuple[str, ...]         # names of the nodes whose outputs this node reads
    module_path: str = ""           # "layers.3.attn"; "" at the top level
    module_type: str = ""           # class name of that innermost module
    flops: int = 0                  # of the forward
    param_fqn: str | None = None    # for parameters and buffers: "layers.3.attn.wq.weight"
    args: tuple[Any, ...] = ()      # non-tensor arguments as plain values (dims, sizes), tensors as None
    kwargs: dict[str, Any] = field(default_factory=dict)   # keyword arguments, plain like args
    tied_to: str | None = None      # a parameter shared with an earlier one (tied embeddings): its fqn
    effect: bool = False            # an op that runs even when nothing reads it (torch's is_impure)
    writes: tuple[str, ...] = ()    # inputs the op writes in place (running statistics, relu_)


@dataclass(kw_only=True, slots=True)
class BlockInstance:
    module_path: str                # "layers.3"
    start: int                      # index of its first node in Graph.nodes
    stop: int                       # one past its last node


@dataclass(kw_only=True, slots=True)
class BlockKind:
    kind: int                       # 0, 1, ... in order of first appearance
    module_type: str                # class name shared by the instances
    signature: str                  # structural hash: same ops, shapes and wiring
    instances: list[BlockInstance]

    @property
    def count(self) -> int:
        return len(self.instances)

    @property
    def nodes_per_block(self) -> int:
        first = self.instances[0]
        return first.stop - first.start


@dataclass(kw_only=True, slots=True)
class Graph:
    nodes: list[Node]
    blocks: list[BlockKind]
    model_type: str = ""
    program: Any = field(default=None, repr=False)   # the torch.export.ExportedProgram
    # device type -> ({node: dtype} held wider than 16 bits under mixed precision, {node: dtype}
    # made wider, whose gradients are): autopar.mixed_dtypes, filled when first asked
    mixed_dtypes: dict = field(default_factory=dict, repr=False, compare=False)
    # analyses of the graph alone (its index by name, expert layers, module units, whether its
    # sequence splits), made when first asked: the planner prices thousands of candidates on one
    # graph, whose nodes do not change after capture (a replaced graph starts without them)
    derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def derive(self, key: str, make: Callable[[], Any]) -> Any:
        """`make()`, made once for this graph under `key`."""
        if key not in self.derived:
            self.derived[key] = make()
        return self.derived[key]

    def node(self, name: str) -> Node:
        return self._by_name()[name]

    def _by_name(self) -> dict[str, Node]:
        return self.derive("by_name", lambda: {n.name: n for n in self.nodes})

    @property
    def parameters(self) -> list[Node]:
        return [n for n in self.nodes if n.role is Role.PARAMETER]

    @property
    def param_count(self) -> int:
        """Distinct parameters: a tied weight is counted once."""
        return sum(_numel(n.shape) for n in self.parameters if n.tied_to is None)

    @property
    def forward_flops(self) -> int:
        return sum(n.flops for n in self.nodes)

    def requiring_grad(self) -> set[str]:
        """Nodes whose value has a gradient in training: the parameters and every value computed
        from one. Inputs and buffers (a rotary table, a mask) and what derives from them alone do
        not, so nothing of their backward is priced."""
        found: set[str] = set()
        for node in self.nodes:
            if node.role is Role.PARAMETER or any(name in found for name in node.inputs):
                found.add(node.name)
        return found

    def norm_reads(self) -> list[tuple[str, int, str]]:
        """(norm node, input index, value) where a norm module reads the residual stream: an
        activation from outside its own module. Sequence parallelism splits these reads on the
        sequence dim between the tensor-parallel regions; without it they are whole on every
        tensor-parallel rank."""
        by_name = self._by_name()
        found = []
        for node in self.nodes:
            if not node.module_type.endswith("Norm"):
                continue
            for k, name in enumerate(node.inputs):
                source = by_name[name]
                if source.role is Role.ACTIVATION and not source.module_path.startswith(node.module_path):
                    found.append((node.name, k, name))
        return found

    def norm_inputs(self) -> list[str]:
        """The values of `norm_reads`, each once."""
        return list(dict.fromkeys(value for _, _, value in self.norm_reads()))

    def batch_coupling(self) -> str | None:
        """Why this model computes other numbers when a replica's batch is cut into micro-batches
        (None when it does not): a BatchNorm in training mode normalizes over the samples it is
        given, and a buffer written in forward (running statistics) is written once per forward,
        so once per micro-batch where one process writes it once per step."""
        by_name = self._by_name()
        norms = [node.module_path or node.name for node in self.nodes
                 if node.target.removeprefix("aten.").partition(".")[0] in BATCH_STATISTICS
                 and node.target.startswith("aten.") and len(node.args) > 5 and node.args[5] is True]
        written = [by_name[name].param_fqn for node in self.nodes for name in node.writes
                   if by_name[name].role is Role.BUFFER]
        reasons = []
        if norms:
            reasons.append(f"batch norms in training mode normalize over the samples of each "
                           f"micro-batch ({_listed(norms)})")
        if written:
            reasons.append(f"the forward writes buffers once per micro-batch "
                           f"({_listed(sorted(set(written)))})")
        return "; ".join(reasons) or None
    def flow_nodes(self) -> list[FlowNode]:
        """The nodes as the stage-flow rules see them (autopar.plans.stage_flow), the same as the
        runtime's export: which unit computes each value is decided on these."""
        kinds = {Role.INPUT: NodeKind.INPUT, Role.PARAMETER: NodeKind.PARAMETER,
                 Role.BUFFER: NodeKind.BUFFER, Role.OUTPUT: NodeKind.OUTPUT}
        return [FlowNode(name=node.name, inputs=node.inputs, module_path=node.module_path,
                         target=node.target, effect=node.effect, writes=bool(node.writes),
                         kind=kinds.get(node.role) or (NodeKind.OTHER if node.target == "get_attr"
                                                       else NodeKind.FUNCTION))
                for node in self.nodes]

    def top_modules(self, start: int, stop: int, block_paths) -> tuple[str, ...]:
        """The outermost modules of the ops in nodes[start:stop] that hold no block (for a model
        nested as `transformer.wte`, `transformer.h.0`: `transformer.wte`, not `transformer`), in
        first-use order: what a pipeline chunk names for the ops outside its blocks."""
        seen: dict[str, None] = {}
        for node in self.nodes[start:stop]:
            if node.role is not Role.ACTIVATION or not node.module_path:
                continue
            parts = node.module_path.split(".")
            for depth in range(1, len(parts) + 1):
                path = ".".join(parts[:depth])
                if not any(block == path or block.startswith(path + ".") for block in block_paths):
                    seen.setdefault(path, None)
                    break
        return tuple(seen)

    def fingerprint(self) -> str:
        """A hash of the structure (ops, shapes, dtypes, wiring, parameter names): equal for the same
        model and input shapes, different when any of them change."""
        parts = [(n.name, n.target, list(n.shape), n.dtype, list(n.inputs), n.param_fqn)
                 for n in self.nodes]
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def _listed(names: list[str], shown: int = 3) -> str:
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
