"""The dtype each value of a captured graph has when a stage runs it in 16-bit mixed precision.

Under bf16 or fp16 a stage runs its graph as the runtime does (autopar.runtime.precision): under
autocast, with the weights FSDP2 hands it in 16 bits, buffers and inputs as captured, and the
casts the model computes from a weight's dtype following that weight (`casts_following_weights`,
the rule autopar.passes.precision applies). Not every value is then 16-bit: autocast keeps some ops
in fp32 (softmax and norms on a GPU), a model casts to fp32 on purpose (an RMSNorm's variance, a
router's logits), and an op of an fp32 value with a 16-bit one promotes to fp32. Tensor
parallelism moves those values, and autograd keeps them, in fp32.

Where a value crosses from one of the stage's units to another (`fsdp_units`: the pieces the
runtime splits a stage into, each layer path of the pipeline units), what the runtime does there
is done too: a view of the value (and a cast, whose schema is a view's) is taken again in the
reading unit, and a unit FSDP2 wraps is handed floating values in 16 bits (its mixed precision
casts a module's inputs). A head tied to the embedding shares its weight with it, and FSDP2 leaves
both unwrapped, where they are in one stage; in a pipeline they never are (`ties_apart`), and the
last stage wraps its head alone.

`wide_values(graph, device_type)` runs the captured program once on fake tensors under that
device's own autocast (torch's dispatch, not a list of ours; a fake CUDA tensor runs CUDA's rules
without a GPU) and returns the floating values held wider than 16 bits, so the estimator prices
each value in the dtype it has. The two device types differ: CUDA's autocast keeps layer_norm and
softmax in fp32, the CPU's computes them in 16 bits.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.export.graph_signature import InputKind
from torch.utils._pytree import tree_leaves, tree_map

from autopar.graph import Graph

CASTS = (torch.ops.aten.to.dtype, torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype_layout)
# what the export checks and the runtime drops under mixed precision (passes/precision.py)
_CHECKS = (torch.ops.aten._assert_tensor_metadata.default,)
_WIDE = ("float32", "float64")


def cast_dtype(node: fx.Node) -> torch.dtype | None:
    """The floating dtype a cast node converts to, or None for any other node."""
    if node.op != "call_function" or node.target not in CASTS:
        return None
    dtype = node.args[1] if node.target is torch.ops.aten.to.dtype else node.kwargs.get("dtype")
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def casts_following_weights(graph: fx.Graph, weight_dtype: Callable[[fx.Node], torch.dtype | None],
                            ) -> dict[fx.Node, fx.Node]:
    """Each cast to a weight's captured dtype whose result an op reads together with that weight
    (or a view of it), and the weight: `input.to(weight.dtype)` for `op(input, weight)`. The trace
    kept the target dtype, not where it came from; a cast made for the op that also reads the
    weight is the one the weight's dtype decides. `weight_dtype`: a node's captured dtype where
    it is a parameter, else None."""
    found = {}
    for node in graph.nodes:
        target = cast_dtype(node)
        if target is None:
            continue
        weights = [weight for user in node.users for weight in _weights_read(user, node, weight_dtype)
                   if weight_dtype(weight) == target]
        if weights:
            found[node] = weights[0]
    return found


def _weights_read(user: fx.Node, cast: fx.Node, weight_dtype) -> list[fx.Node]:
    """The parameters whose values `user` reads, directly or through views, besides `cast`."""
    found = []
    for arg in user.all_input_nodes:
        while (arg is not cast and arg.op == "call_function" and isinstance(arg.target, torch._ops.OpOverload)
               and arg.target.is_view and arg.target not in CASTS and arg.args):
            arg = arg.args[0]
        if arg is not cast and weight_dtype(arg) is not None:
            found.append(arg)
    return found


def wide_values(graph: Graph, device_type: str, ties_apart: bool = False) -> dict[str, str]:
    """Node -> dtype of the floating values held wider than 16 bits when `device_type` ("cuda",
    "cpu") runs the graph in bf16 (fp16 keeps the same ones: autocast's rules are the same), in
    one of a pipeline's stages where `ties_apart` (`fsdp_units`)."""
    return mixed_dtypes(graph, device_type, ties_apart)[0]


def mixed_dtypes(graph: Graph, device_type: str, ties_apart: bool = False) -> tuple[dict, dict, dict]:
    """The values held wider than 16 bits (`wide_values`); those made wider, whose gradients
    are: a value handed to another unit in 16 bits is held as the copy, but its gradient flows
    back to the fp32 original, which reduces it; and the ops autocast runs in 16 bits on wide
    inputs, each with those inputs (node -> names): each op casts them itself (autocast caches the
    casts of weights only), and what it keeps for its backward is its own 16-bit copy. Kept on the
    graph: each device type runs once, and once more in a pipeline's stages where the graph ties
    its head to its embedding."""
    key = (device_type, ties_apart and ties_apart_matter(graph))
    if key not in graph.mixed_dtypes:
        graph.mixed_dtypes[key] = _run_mixed(graph, device_type, key[1]) \
            if graph.program is not None else ({}, {}, {})
    return graph.mixed_dtypes[key]


def ties_apart_matter(graph: Graph) -> bool:
    """Whether FSDP2 wraps other units of a pipeline's stages than of the whole model: a
    weight the embedding and the head alone share (`fsdp_units`)."""
    return fsdp_units(graph, ties_apart=True)[1] != fsdp_units(graph)[1]


def as_run_on(graph: Graph, device_type: str) -> Graph:
    """A copy of `graph` whose every device type keeps the values `device_type`'s autocast keeps:
    what a run on that device's tensors standing for another's is priced against (a simulation's
    fake CPU tensors for GPUs)."""
    found = {apart: mixed_dtypes(graph, device_type, apart) for apart in (False, True)}
    return dataclasses.replace(graph, mixed_dtypes={(kind, apart): dtypes for kind in ("cpu", "cuda")
                                                    for apart, dtypes in found.items()})


def _run_mixed(graph: Graph, device_type: str, ties_apart: bool) -> tuple[dict, dict, dict]:
    program = graph.program
    module = program.graph_module
    parameters = {spec.arg.name for spec in program.graph_signature.input_specs
                  if spec.kind is InputKind.PARAMETER}
    placeholders = {node.name: node for node in module.graph.nodes if node.op == "placeholder"}
    captured = lambda node: (node.meta["val"].dtype if node.name in parameters
                             and isinstance(node.meta.get("val"), torch.Tensor) else None)
    following = casts_following_weights(module.graph, captured)
    dtype = torch.bfloat16
    units = fsdp_units(graph, ties_apart)
    with FakeTensorMode(allow_non_fake_inputs=True):
        inputs = [_fake(node, device_type, dtype if name in parameters else None)
                  for name, node in placeholders.items()]
        runner = _MixedRunner(module, {cast.name for cast in following}, dtype, device_type, units)
        with _autocast(device_type, dtype):
            runner.run(*inputs)
    return runner.held_wide(), runner.made_wide(), runner.cast_reads


def fsdp_units(graph: Graph, ties_apart: bool = False) -> tuple[dict[str, int], set[int]]:
    """The unit of each node as the runtime splits a stage (every layer path of the pipeline
    units, autopar.plans.stage_flow's rules), and the units FSDP2 wraps: those holding parameters
    of their own in their stage (autopar.runtime.data_parallel). FSDP2's mixed precision casts the
    floating values a wrapped unit is handed to 16 bits (`cast_forward_inputs`), and so does a
    pipeline stage's boundary, which is a unit's too. `ties_apart`: the stage is one of a
    pipeline's, where the first and the last pipeline units (the embedding, the head) never meet:
    a weight read by one unit of each is each one's own."""
    from autopar.cost.units import pipeline_units      # cost reads a Graph: imported when used
    from autopar.plans.stage_flow import assign_units, live

    pieces = pipeline_units(graph)
    layers = [layer for unit in pieces for layer in unit.layers]
    unit_of = assign_units(live(graph.flow_nodes()), layers)
    readers: dict[str, set[int]] = {}
    for node in graph.nodes:
        for name in node.inputs:
            if node.name in unit_of:
                readers.setdefault(name, set()).add(unit_of[node.name])
    held = [readers.get(p.name, set()) for p in graph.parameters]
    ends = (set(range(len(pieces[0].layers))), set(range(len(layers) - len(pieces[-1].layers), len(layers))))
    apart = lambda units: ties_apart and len(pieces) > 1 and all(len(units & end) == 1 for end in ends)
    shared = {unit for units in held if len(units) > 1 and not (len(units) == 2 and apart(units)) for unit in units}
    return unit_of, {unit for units in held for unit in units} - shared


def _fake(node: fx.Node, device_type: str, weight_dtype: torch.dtype | None):
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return value
    dtype = weight_dtype if weight_dtype is not None and value.dtype.is_floating_point else value.dtype
    return torch.empty(tuple(int(s) for s in value.shape), dtype=dtype, device=device_type)


class _autocast:
    """Autocast of `device_type` switched on below torch.autocast, whose constructor refuses CUDA
    on a machine without one: the dispatch itself needs only the tensors' device."""

    def __init__(self, device_type: str, dtype: torch.dtype):
        self.device_type, self.dtype = device_type, dtype

    def __enter__(self):
        self.saved = (torch.is_autocast_enabled(self.device_type),
                      torch.get_autocast_dtype(self.device_type))
        torch.set_autocast_enabled(self.device_type, True)
        torch.set_autocast_dtype(self.device_type, self.dtype)
        torch.autocast_increment_nesting()

    def __exit__(self, *exc):
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled(self.device_type, self.saved[0])
        torch.set_autocast_dtype(self.device_type, self.saved[1])


class _MixedRunner(fx.Interpreter):
    """The program as a 16-bit stage runs it, noting the floating values that come out wider."""

    def __init__(self, module: fx.GraphModule, following: set[str], dtype: torch.dtype,
                 device_type: str, units: tuple[dict[str, int], set[int]]):
        # every value kept: a reader in another unit takes a view again from its base
        super().__init__(module, garbage_collect_values=False)
        self.following, self.dtype, self.device_type = following, dtype, device_type
        self.unit_of, self.wrapped = units
        self.wide: dict[str, str] = {}
        self.read_as: dict[str, set[str]] = {}     # value -> dtypes other units read it in
        self.taken_again: set[str] = set()          # views other units take again from their base
        self.cast_reads: dict[str, tuple[str, ...]] = {}    # op -> wide inputs it ran in 16 bits

    def fetch_args_kwargs_from_env(self, n: fx.Node):
        """What `n` reads, as its unit is handed it (`handed`)."""
        unit = self.unit_of.get(n.name)
        if unit is None:
            return super().fetch_args_kwargs_from_env(n)
        load = lambda arg: self.handed(arg, unit)
        return fx.node.map_arg(n.args, load), fx.node.map_arg(n.kwargs, load)

    def handed(self, arg: fx.Node, unit: int):
        """`arg` as `unit` reads it. From another unit: a view of a value that unit made is taken
        again from its base in the reader (passes.stage_split; `to` is a view in its schema, so
        a cast is made again too), and a wrapped unit is handed floating values in 16 bits."""
        value = self.env[arg]
        producer = self.unit_of.get(arg.name, unit)
        if producer == unit:
            return value
        base = arg.all_input_nodes[0] if arg.all_input_nodes else None
        if _is_view(arg) and base is not None and self.unit_of.get(base.name) == producer:
            self.taken_again.add(arg.name)
            if arg.name in self.following:
                value = self.handed(base, unit).to(self.dtype)
            else:
                args, kwargs = fx.node.map_arg((arg.args, arg.kwargs), lambda a: (
                    self.handed(a, unit) if a is base else self.env[a]))
                value = self.call_function(arg.target, args, kwargs)
        elif unit in self.wrapped and isinstance(value, torch.Tensor) and value.is_floating_point():
            value = value.to(self.dtype)
        if isinstance(value, torch.Tensor):
            self.read_as.setdefault(arg.name, set()).add(_name(value.dtype))
        return value

    def held_wide(self) -> dict[str, str]:
        """The wide values as they are held: a value only other units read is held as they are
        handed it (the fp32 original of one cast to 16 bits goes once cast)."""
        held = {}
        for node in self.module.graph.nodes:
            dtypes = self.read_as.get(node.name, set()) if self._read_outside(node) else set()
            dtype = max(dtypes, key=_WIDE.count) if dtypes else self.wide.get(node.name)
            if dtype in _WIDE:
                held[node.name] = dtype
        return held

    def made_wide(self) -> dict[str, str]:
        """The values made wider, whose gradients are, but for a view only other units read: each
        takes it again from what it is handed (`handed`) and places it there (the tensor-parallel
        redistribution after it, autopar.passes.tensor_parallel.place_nodes, reduces its gradient
        there), a wrapped unit in 16 bits."""
        retaken = {node.name for node in self.module.graph.nodes
                   if node.name in self.taken_again and self._read_outside(node)
                   and not self.read_as.get(node.name, set()) & set(_WIDE)}
        return {name: dtype for name, dtype in self.wide.items() if name not in retaken}

    def _read_outside(self, node: fx.Node) -> bool:
        """Whether only other units than `node`'s read it (none the graph's output)."""
        unit, readers = self.unit_of.get(node.name), self._reader_units(node)
        return unit is not None and bool(readers) and unit not in readers and -1 not in readers

    def _reader_units(self, node: fx.Node) -> set[int]:
        """The units that read `node` (-1: the graph's output or a value every unit copies); a
        view made where `node` is and read elsewhere is taken again there, so its readers read
        `node`."""
        found = set()
        unit = self.unit_of.get(node.name)
        for user in node.users:
            again = _is_view(user) and self.unit_of.get(user.name) == unit and unit is not None
            inner = self._reader_units(user) if again else set()
            found |= inner if inner and unit not in inner else {self.unit_of.get(user.name, -1)}
        return found

    def call_function(self, target, args, kwargs):
        # the trace's device (a position table made on the CPU) is the stage's own
        # the trace's device (a position table made on the CPU) is the stage's own; a cast between
        # devices casts the dtype alone (a fake tensor cannot copy itself to CUDA without one)
        if target is torch.ops.aten.to.device:
            target, args = torch.ops.aten.to.dtype, (args[0], *args[2:])
        if target is torch.ops.aten._to_copy.default:
            kwargs = {key: value for key, value in kwargs.items() if key != "device"}
        here = lambda value: torch.device(self.device_type) if isinstance(value, torch.device) else value
        return super().call_function(target, tree_map(here, args), tree_map(here, kwargs))

    def run_node(self, node: fx.Node):
        if node.op == "call_function" and node.target in _CHECKS:
            return None
        if node.name in self.following:
            value = self.fetch_args_kwargs_from_env(node)[0][0]
            result = value.to(self.dtype)
        elif node.op == "call_function":
            args, kwargs = self.fetch_args_kwargs_from_env(node)
            result = self.call_function(node.target, args, kwargs)
            self._note_casts(node, (args, kwargs), result)
        else:
            result = super().run_node(node)
        # a multi-output op (an attention kernel's output and statistics): its first output's
        first = result[0] if isinstance(result, (tuple, list)) and result else result
        dtype = _name(first.dtype) if isinstance(first, torch.Tensor) else ""
        if dtype in _WIDE:
            self.wide[node.name] = dtype
        return result

    def _note_casts(self, node: fx.Node, read: tuple, result) -> None:
        """The wide inputs of an op whose result is 16-bit: autocast cast them for it (a cast of
        the model's own is an op of its own, and mixing dtypes otherwise promotes)."""
        first = result[0] if isinstance(result, (tuple, list)) and result else result
        if node.target in CASTS or not isinstance(first, torch.Tensor) or _name(first.dtype) in _WIDE \
                or not first.is_floating_point():
            return
        pairs = zip(tree_leaves((node.args, node.kwargs)), tree_leaves(read))
        wide = [arg.name for arg, value in pairs if isinstance(arg, fx.Node)
                and isinstance(value, torch.Tensor) and _name(value.dtype) in _WIDE]
        if wide:
            self.cast_reads[node.name] = tuple(dict.fromkeys(wide))


def _is_view(node: fx.Node) -> bool:
    return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) \
        and node.target.is_view


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
