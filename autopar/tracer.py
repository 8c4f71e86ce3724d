"""Capture: a model and example inputs -> `autopar.graph.Graph`.

`torch.export.export(strict=False)` traces the forward into the ATen training IR on fake tensors:
parameters on the meta device stay on meta, real parameters are wrapped as fake tensors (nothing
is copied or computed), so even gpt3-175b captures in seconds. Each fx node becomes a `Node` with
its output's shape, dtype and bytes, its role from the export's graph signature, the innermost module
from `nn_module_stack`, and its forward FLOPs from `autopar.cost.flops`.

Block detection groups repeated submodules (transformer layers) so that later stages can price one
block and reuse it for its copies:
  1. The tree of module calls comes from the nodes' `nn_module_stack`s (a module called three
     times is three calls); each call covers a contiguous range of nodes (export records ops in
     execution order).
  2. Among the children of a module, a *chain* is a run of consecutive children where each one
     reads a value computed inside the previous one: layers are chained, parallel siblings such
     as the q/k/v projections or two embeddings are not.
  3. Each chained child gets a structural signature: a hash of its nodes' ops, shapes, dtypes and
     non-tensor arguments, of its wiring (inputs inside the child by relative position, parameters
     by their name relative to the child, anything else by order of first use).
  4. A chain's signatures are searched for periodic runs (period p, at least two periods): period 1
     finds identical layers, period 2 alternating layers. Children in such runs are block
     instances; the walk goes down from the root and stops at the first (outermost) level that
     has them, so the norms inside a layer are not blocks of their own.
Instances with the same signature form one `BlockKind`, numbered in order of first appearance.
"""

from __future__ import annotations

import hashlib
import linecache
import os
import re
import sysconfig
import traceback
from dataclasses import dataclass, field

import torch
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from autopar.cost.flops import forward_flops
from autopar.errors import CaptureError
from autopar.graph import RUNNING_STATISTICS, BlockInstance, BlockKind, Graph, Node, Role

_INPUT_ROLES = {InputKind.PARAMETER: Role.PARAMETER, InputKind.BUFFER: Role.BUFFER,
                InputKind.CONSTANT_TENSOR: Role.BUFFER, InputKind.USER_INPUT: Role.INPUT}


def capture(model: torch.nn.Module, example_inputs: tuple = (), example_kwargs: dict | None = None,
            ) -> Graph:
    """Trace `model(*example_inputs, **example_kwargs)` into a `Graph` without running it.

    Raises `CaptureError` naming the op, the source line and a likely fix when torch.export cannot
    trace the forward (data-dependent control flow, for example); the original error is chained.
    """
    if not isinstance(model, torch.nn.Module):
        raise CaptureError(f"capture needs a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    example_kwargs = example_kwargs or {}
    if _on_meta(model):
        # a meta model's trace takes its inputs' shapes only; some torch versions refuse to mix
        # meta weights with inputs on another device (an embedding of CPU ids)
        example_inputs = tuple(_meta_like(x) for x in example_inputs)
        example_kwargs = {name: _meta_like(x) for name, x in example_kwargs.items()}
    program = _export(model, example_inputs, example_kwargs)
    _check_static_shapes(model, program)
    nodes, stacks = _nodes(program, _tied_parameters(model))
    constants = frozenset(spec.arg.name for spec in program.graph_signature.input_specs
                          if spec.kind is InputKind.CONSTANT_TENSOR)
    return Graph(nodes=nodes, blocks=find_blocks(nodes, stacks, constants),
                 model_type=type(model).__name__, program=program)


def _on_meta(model: torch.nn.Module) -> bool:
    tensors = [*model.parameters(), *model.buffers()]
    return bool(tensors) and all(t.is_meta for t in tensors)


def _meta_like(value):
    return torch.empty_like(value, device="meta") if isinstance(value, torch.Tensor) else value


def _export(model, args: tuple, kwargs: dict):
    try:
        return torch.export.export(model, args, kwargs, strict=False)
    except Exception as err:    # re-raised as a CaptureError that keeps `err` as its cause
        raise _capture_error(model, err) from err


# --- errors --------------------------------------------------------------------------------------

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_STDLIB_DIR = sysconfig.get_paths()["stdlib"] + os.sep


def _user_frame(err: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of the user's code: not torch, not the standard library, not code
    generated at run time ("<string>"), not autopar's capture itself."""
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if not f.filename.startswith((_TORCH_DIR, "<")) and f.filename != __file__
              and not (f.filename.startswith(_STDLIB_DIR) and "site-packages" not in f.filename)]
    return frames[-1] if frames else None


def _capture_error(model: torch.nn.Module, err: Exception) -> CaptureError:
    frame = _user_frame(err)
    where = "at an unknown line"
    if frame is not None:
        code = (frame.line or linecache.getline(frame.filename, frame.lineno)).strip()
        where = f"at {frame.filename}:{frame.lineno} in {frame.name}: `{code}`"
    first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if isinstance(err, GuardOnDataDependentSymNode):
        conversion = "int()" if "integer" in first_line else "bool()"
        return CaptureError(
            f"cannot capture {type(model).__name__}: data-dependent control flow {where}. "
            f"The op aten.item ({conversion} of a tensor's value) decides Python control flow, "
            f"and capture traces with fake tensors whose values are unknown ({first_line}). "
            f"Likely fix: compute both branches and select with torch.where, use torch.cond for "
            f"a real branch, or move the branch out of forward.")
    if "in output, which is not a known type" in first_line:
        return CaptureError(
            f"cannot capture {type(model).__name__}: forward returns an object torch.export cannot "
            f"flatten ({first_line.split(' in output')[0].removeprefix('Found ')}), usually a "
            f"key-value cache. Likely fix: return tensors only; for HuggingFace models pass "
            f"use_cache=False in example_kwargs.")
    return CaptureError(
        f"cannot capture {type(model).__name__}: torch.export failed {where} with "
        f"{type(err).__name__}: {first_line}. Likely fix: make forward traceable by "
        f"torch.export (no data-dependent Python control flow, no calls outside torch on "
        f"tensors); see the chained error for details.")


def _check_static_shapes(model: torch.nn.Module, program) -> None:
    """Refuse a graph with an op whose output size depends on its input's values (nonzero, a
    boolean mask's selection): the planner sizes every op before the run, naming the op."""
    for fx_node in program.graph_module.graph.nodes:
        values = fx_node.meta.get("val")
        for value in values if isinstance(values, (tuple, list)) else (values,):
            if isinstance(value, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in value.shape):
                raise CaptureError(
                    f"cannot capture {type(model).__name__}: {fx_node.target} ({fx_node.name}) "
                    f"{_source_of(fx_node)}returns a tensor whose size depends on its input's "
                    f"values ({list(value.shape)}), and autopar sizes every op before the run. "
                    f"Likely fix: a fixed-size form (torch.where over every position, a top-k, "
                    f"a capacity, rows sorted by expert with counts as data) instead of nonzero, "
                    f"a boolean mask's selection or a split by counts the values decide.")


def _source_of(fx_node: torch.fx.Node) -> str:
    """"at FILE:LINE: `code` " of the innermost frame of the model's code that made the node."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in \S+\n\s*(.*)', fx_node.meta.get("stack_trace") or "")
    frames = [f for f in frames if not f[0].startswith(_TORCH_DIR) and f[0] != __file__]
    return f"at {frames[-1][0]}:{frames[-1][1]}: `{frames[-1][2].strip()}` " if frames else ""


# --- nodes ---------------------------------------------------------------------------------------

def _tied_parameters(model: torch.nn.Module) -> dict[str, str]:
    """{fqn: fqn of the first name of the same tensor} for parameters registered twice."""
    first: dict[int, str] = {}
    tied = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False),
                         *model.named_buffers(remove_duplicate=False)]:
        owner = first.setdefault(id(tensor), name)
        if owner != name:
            tied[name] = owner
    return tied


def _nodes(program, tied: dict[str, str]) -> tuple[list[Node], list[tuple[tuple[str, ...], ...]]]:
    """The graph's nodes, and for each its module stack, outermost first: (call key, path, class
    name), where the call key tells apart the calls of a module used more than once."""
    signature = program.graph_signature
    placeholders = {spec.arg.name: spec for spec in signature.input_specs
                    if hasattr(spec.arg, "name")}
    user_outputs = {spec.arg.name for spec in signature.output_specs
                    if spec.kind is OutputKind.USER_OUTPUT and hasattr(spec.arg, "name")}
    nodes, stacks = [], []
    for fx_node in program.graph_module.graph.nodes:
        role, fqn = Role.ACTIVATION, None
        value = fx_node.meta.get("val")
        if fx_node.op == "placeholder":
            spec = placeholders.get(fx_node.name)
            role = _INPUT_ROLES.get(spec.kind, Role.INPUT) if spec is not None else Role.INPUT
            fqn = spec.target if role in (Role.PARAMETER, Role.BUFFER) else None
        elif fx_node.op == "output":
            # Describes what the user gets back; buffer updates (BatchNorm statistics) are
            # among its inputs but not in its shape.
            role = Role.OUTPUT
            value = [n.meta.get("val") for n in fx_node.all_input_nodes if n.name in user_outputs]
            value = value[0] if len(value) == 1 else value
        shape, dtype, nbytes = _describe(value)
        stack = tuple((key, path, _class_name(module_type)) for key, (path, module_type)
                      in (fx_node.meta.get("nn_module_stack") or {}).items())
        module_path, module_type = stack[-1][1:] if stack else ("", "")
        stacks.append(stack)
        nodes.append(Node(
            name=fx_node.name, target=_target_name(fx_node), role=role, shape=shape, dtype=dtype,
            bytes=nbytes, inputs=tuple(n.name for n in fx_node.all_input_nodes),
            module_path=module_path, module_type=module_type, flops=forward_flops(fx_node),
            param_fqn=fqn, tied_to=tied.get(fqn), args=plain_arguments(fx_node.args),
            kwargs=plain_arguments(dict(fx_node.kwargs)),
            effect=fx_node.op == "call_function" and fx_node.is_impure(),
            writes=tuple(n.name for n in written_inputs(fx_node))))
    return nodes, stacks


def program_nodes(program) -> list[Node]:
    """An ExportedProgram's nodes as a Graph's, without finding its blocks."""
    return _nodes(program, {})[0]


def written_inputs(fx_node: torch.fx.Node) -> list[torch.fx.Node]:
    """The inputs an op writes in place. torch.export's training IR keeps the writes of a
    forward in place (its graph signature lists no buffer mutation until the graph is
    functionalized): an op whose schema marks an argument written (`add_` of a BatchNorm's
    num_batches_tracked), and a norm that updates its running statistics (args 3 and 4) when
    args[5] is true, which its schema does not say."""
    if fx_node.op != "call_function":
        return []
    written = []
    schema = getattr(fx_node.target, "_schema", None)
    for i, argument in enumerate(schema.arguments if schema else ()):
        if argument.alias_info is not None and argument.alias_info.is_write:
            written.append(fx_node.args[i] if i < len(fx_node.args) else fx_node.kwargs.get(argument.name))
    packet = getattr(getattr(fx_node.target, "overloadpacket", None), "__name__", "")
    if packet in RUNNING_STATISTICS and len(fx_node.args) > 5 and fx_node.args[5] is True:
        written.extend(fx_node.args[3:5])
    return [arg for arg in written if isinstance(arg, torch.fx.Node)]


def _target_name(fx_node: torch.fx.Node) -> str:
    if fx_node.op in ("placeholder", "output", "get_attr"):
        return fx_node.op
    target = fx_node.target
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    module = getattr(target, "__module__", None) or ""
    module = "operator" if module == "_operator" else module
    return f"{module}.{getattr(target, '__name__', repr(target))}".lstrip(".")


def _describe(value) -> tuple[tuple[int, ...], str, int]:
    """(shape, dtype, bytes) of a node's output; multi-output nodes have shape () and dtype ""."""
    if isinstance(value, torch.Tensor):
        shape = tuple(int(size) for size in value.shape)
        return shape, str(value.dtype).removeprefix("torch."), _numel(shape) * value.element_size()
    if isinstance(value, (tuple, list)):
        return (), "", sum(_describe(item)[2] for item in value)
    return (), "", 0


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def plain_arguments(value):
    """Arguments as plain Python values: fx nodes (tensors) become None, dtypes and devices str."""
    if isinstance(value, torch.fx.Node):
        return None
    if isinstance(value, (tuple, list)):
        return tuple(plain_arguments(item) for item in value)
    if isinstance(value, dict):
        return {key: plain_arguments(item) for key, item in value.items()}
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        return str(value)
    return str(value).removeprefix("torch.")


def _class_name(module_type) -> str:
    return module_type.__name__ if isinstance(module_type, type) else str(module_type).split(".")[-1]


# --- blocks --------------------------------------------------------------------------------------

@dataclass(slots=True)
class _Module:
    path: str
    module_type: str
    first: int                      # index of its first node
    last: int                       # index of its last node
    parent: str | None = None       # path of the calling module; None at the root
    count: int = 0                  # nodes under it; equal to last - first + 1 when contiguous
    children: list[str] = field(default_factory=list)    # call keys

    @property
    def contiguous(self) -> bool:
        return self.count == self.last - self.first + 1


def find_blocks(nodes: list[Node], stacks: list[tuple[tuple[str, ...], ...]],
                constants: frozenset[str] = frozenset()) -> list[BlockKind]:
    """Group repeated submodules into block kinds (the method is in the module docstring).
    `stacks[i]` is node i's module stack, (call key, path, class name) from the outermost module
    in; `constants` names the placeholders of tensors created inside forward (lifted constants).
    A module called several times (shared weights) gives one instance per call."""
    modules = _module_tree(stacks)
    roots = [module for module in modules.values() if module.parent is None]
    finder = _BlockFinder(nodes, constants)
    found: list[tuple[_Module, str]] = []          # (block instance, signature)
    pending = roots[::-1]
    while pending:
        children = [modules[key] for key in pending.pop().children]
        blocks = finder.repeated_children(children)
        found.extend(blocks)
        covered = {id(module) for module, _ in blocks}
        pending.extend(reversed([child for child in children if id(child) not in covered]))
    found.sort(key=lambda item: item[0].first)
    kinds: dict[str, BlockKind] = {}
    for module, signature in found:
        kind = kinds.setdefault(signature, BlockKind(
            kind=len(kinds), module_type=module.module_type, signature=signature, instances=[]))
        kind.instances.append(BlockInstance(module_path=module.path, start=module.first,
                                            stop=module.last + 1))
    return list(kinds.values())


def _module_tree(stacks) -> dict[str, _Module]:
    """Every module call, by call key, with its node range and its children in execution order."""
    modules: dict[str, _Module] = {}
    for i, stack in enumerate(stacks):
        parent = None
        for key, path, module_type in stack:
            module = modules.get(key)
            if module is None:
                module = modules[key] = _Module(path, module_type, first=i, last=i,
                                                parent=None if parent is None else parent.path)
                if parent is not None:
                    parent.children.append(key)
            module.last = i
            module.count += 1
            parent = module
    return modules


class _BlockFinder:
    """Chains and structural signatures of modules over one graph's nodes."""

    def __init__(self, nodes: list[Node], constants: frozenset[str]):
        self.nodes = nodes
        self.constants = constants
        self.index = {node.name: i for i, node in enumerate(nodes)}

    def repeated_children(self, children: list[_Module]) -> list[tuple[_Module, str]]:
        """The children that are instances of a repeated block: members of periodic runs of
        structurally identical children inside a chain."""
        found = []
        for chain in self.chains(children):
            signatures = [self.signature(module) for module in chain]
            covered = _periodic_cover(signatures)
            found.extend((module, signatures[i]) for i, module in enumerate(chain) if i in covered)
        return found

    def chains(self, children: list[_Module]) -> list[list[_Module]]:
        """Maximal runs (of two or more) of contiguous children in which each child reads a value
        computed inside the previous one."""
        chains, current = [], []
        for child in children:
            if not child.contiguous:
                current = []
                continue
            if current and not self.feeds(current[-1], child):
                current = []
            if not current:
                chains.append(current)
            current.append(child)
        return [chain for chain in chains if len(chain) >= 2]

    def feeds(self, producer: _Module, consumer: _Module) -> bool:
        """Whether the consumer reads a value computed inside the producer. Only direct reads
        count: layers hand their output straight to the next layer, while a chain through other
        ops would also link, say, a value projection to the output projection after attention."""
        if consumer.first <= producer.last:
            return False
        return any(producer.first <= self.index[name] <= producer.last
                   for node in self.nodes[consumer.first:consumer.last + 1] for name in node.inputs)

    def signature(self, module: _Module) -> str:
        """Hash of the ops, shapes, dtypes and arguments of the module's nodes and of their
        wiring: inputs inside the module by relative position, its own parameters and buffers by
        relative name, constants created in forward by shape (torch numbers their names over the
        whole model), anything else by order of first use."""
        start, prefix = module.first, module.path + "."
        outside: dict[str, int] = {}
        digest = hashlib.sha256()
        for i in range(start, module.last + 1):
            node = self.nodes[i]
            wiring = []
            for name in node.inputs:
                j = self.index[name]
                source = self.nodes[j]
                if start <= j < i:
                    wiring.append(j - start)
                elif name in self.constants:
                    wiring.append(("constant", source.shape, source.dtype))
                elif source.param_fqn is not None and source.param_fqn.startswith(prefix):
                    wiring.append((source.param_fqn[len(prefix):], source.shape))
                else:
                    wiring.append(("outside", outside.setdefault(name, len(outside))))
            digest.update(repr((node.target, node.shape, node.dtype, node.args, node.kwargs,
                                wiring)).encode())
        return digest.hexdigest()[:16]


def _periodic_cover(signatures: list[str]) -> set[int]:
    """Positions covered by runs that repeat with some period p at least twice (p = 1: identical
    neighbours; p = 2: alternating kinds). Runs are taken longest first (ties: shorter period)
    as long as they do not overlap runs already taken, so "ABAB CCC" yields both runs."""
    runs = []                                   # (length, period, start)
    for period in range(1, len(signatures) // 2 + 1):
        run = 0
        for i in range(len(signatures) - period + 1):
            if i < len(signatures) - period and signatures[i] == signatures[i + period]:
                run += 1
            elif run >= period:                 # positions i - run .. i + period - 1
                runs.append((run + period, period, i - run))
                run = 0
            else:
                run = 0
    covered: set[int] = set()
    for length, _, start in sorted(runs, key=lambda r: (-r[0], r[1], r[2])):
        positions = range(start, start + length)
        if covered.isdisjoint(positions):
            covered.update(positions)
    return covered
