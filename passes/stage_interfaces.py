"""What crosses from pipeline stage to stage, and in which order.

A pipeline stage receives exactly what the stage before it sends (torch.distributed.pipelining
sends stage k's outputs, positionally, as stage k+1's inputs), and only the first stage sees the
model's inputs. A model's data flow is wider: T5's encoder output is read by every decoder block,
a decoder's input ids by a stage after the encoder's, an attention mask made from the inputs by
every layer. So:

- `pass_along` gives every value read more than one stage after the stage that makes it a copy
  in each stage between (Megatron passes the encoder's output along its decoder stages the same
  way); the model's inputs count as made before stage 0, its outputs as read after the last stage.
- `order_interfaces`, after the graph is cut into one submodule per stage, makes each stage's
  outputs the next stage's inputs in the same order, the first stage take the model's positional
  inputs in order and then its tensor keyword inputs (attention masks), and the last stage return
  the model's flat outputs in order. Under mixed
  precision, floating values cross stages in the 16-bit dtype (as Megatron-LM sends them, and as
  the cost model prices the sends): the receiving stage's buffers are made from what the fake run
  below records, so what a stage sends must not depend on whether FSDP2 cast its parameters
  (16-bit residual stream) or autocast alone ran it (fp32 residual stream).
- `interface_examples` runs the stages one after another on fake tensors and records what each
  one takes and returns (shape, dtype, whether it requires grad). Given to `PipelineStage`, these
  spare torch the forward it otherwise runs on uninitialized tensors to learn them, which
  fails in a stage that receives token ids (T5's decoder ids) and looks them up in a table.
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

from autopar.errors import AutoparError
from autopar.plans.stage_flow import skips_a_stage, spans, stage_of


def pass_along(module: fx.GraphModule, unit_of_node: dict[str, int], unit_stage: list[int],
               flow: list) -> list[str]:
    """Relay (copy) each value through the stages between its producer and its readers; a relay
    runs in the first unit of its stage, and `unit_of_node` learns it. `flow`: the graph's nodes
    as autopar.plans.stage_flow sees them, whose rule (`skips_a_stage`, the planner's too) says
    which values need relays. Returns the relayed values that a stage computed (not model
    inputs): gradients flow back through their relays."""
    relayed: list[str] = []
    first_unit: dict[int, int] = {}
    for unit, stage in enumerate(unit_stage):
        first_unit.setdefault(stage, unit)
    nodes = {node.name: node for node in module.graph.nodes}
    last_input = [n for n in module.graph.nodes if n.op == "placeholder"][-1:]
    for span in spans(flow, unit_of_node, len(unit_stage)):
        if not skips_a_stage(span.made, span.furthest, unit_stage):
            continue
        node = nodes[span.value]
        made, furthest = stage_of(span.made, unit_stage), stage_of(span.furthest, unit_stage)
        if not isinstance(node.meta.get("val"), torch.Tensor):
            raise AutoparError(f"{node.name} is read {furthest - made} pipeline stages after the one that "
                               f"makes it, but it is not a tensor, so no stage can send it on; "
                               f"make it a tensor input of the model, or plan fewer stages")
        relays = {made: node}
        if node.op != "placeholder":
            relayed.append(node.name)
        anchor = last_input[0] if node.op == "placeholder" else node
        for stage in range(made + 1, furthest):
            with module.graph.inserting_after(anchor):
                relay = module.graph.call_function(torch.ops.aten.clone.default, (relays[stage - 1],))
            relay.meta["val"] = node.meta["val"]
            unit_of_node[relay.name] = first_unit[stage]
            relays[stage] = anchor = relay
        for unit, users in span.readers.items():
            stage = stage_of(unit, unit_stage)
            for user in users:
                nodes[user].replace_input_with(node, relays[max(stage - 1, made)])
    module.graph.lint()
    module.recompile()
    return relayed


def order_interfaces(by_stage: fx.GraphModule, stages: int, taken: list[str],
                     boundary_dtype: torch.dtype | None = None) -> None:
    """Make the stages of `by_stage` (submodules `submod_0`...) fit one after another: see the
    module docstring. `taken` names the model's inputs the first stage takes, in order;
    `boundary_dtype`, the dtype floating values cross stages in (None: as computed)."""
    calls = {node.target: node for node in by_stage.graph.nodes if node.op == "call_module"}
    by_name = {node.name: node for node in by_stage.graph.nodes if node.op == "placeholder"}
    inputs = [by_name[name] for name in taken]
    first = calls["submod_0"]
    for arg in first.args:
        if arg not in inputs:
            raise AutoparError(f"the model's input {arg.name} is read by the first stage but is "
                               f"neither a positional input nor a tensor keyword input; pass it "
                               f"as a tensor")
    _take_inputs(by_stage.submod_0, [list(first.args).index(node) if node in first.args
                                     else None for node in inputs])
    for index in range(1, stages):
        before, call = calls[f"submod_{index - 1}"], calls[f"submod_{index}"]
        _give_outputs(getattr(by_stage, f"submod_{index - 1}"),
                      [(_output_index(arg, before), None) for arg in call.args],
                      single=len(call.args) == 1, contiguous=True, dtype=boundary_dtype)
    last = calls[f"submod_{stages - 1}"]
    output = next(node for node in by_stage.graph.nodes if node.op == "output")
    flat = output.args[0] if isinstance(output.args[0], (tuple, list)) else [output.args[0]]
    _give_outputs(getattr(by_stage, f"submod_{stages - 1}"),
                  [(_output_index(value, last), None) if isinstance(value, fx.Node) else (None, value)
                   for value in flat], single=False)


def _output_index(value: fx.Node, call: fx.Node) -> int:
    """Which output of the submodule `call` the top-level `value` is."""
    if value is call:
        return 0
    if value.op == "call_function" and value.target is operator.getitem and value.args[0] is call:
        return value.args[1]
    raise AutoparError(f"{value.name} reaches {call.target}'s successor without passing through "
                       f"{call.target}; the stages were not cut along the model's data flow")


def _take_inputs(stage: fx.GraphModule, order: list[int | None]) -> None:
    """The stage's placeholders become the model's positional inputs: `order[i]` is the current
    placeholder that input i is, or None for an input the stage does not read."""
    graph = stage.graph
    current = [node for node in graph.nodes if node.op == "placeholder"]
    anchor = next(node for node in graph.nodes if node.op != "placeholder")
    wanted = []
    for i, index in enumerate(order):
        if index is None:
            with graph.inserting_before(anchor):
                wanted.append(graph.placeholder(f"unused_input_{i}"))
        else:
            wanted.append(current[index])
    for node in wanted:
        anchor.prepend(node)
    stage.recompile()


def _give_outputs(stage: fx.GraphModule, order: list[tuple[int | None, object]], *, single: bool,
                  contiguous: bool = False, dtype: torch.dtype | None = None) -> None:
    """The stage returns, for each (index, constant) of `order`, its current output `index`, or
    `constant` where index is None (a None among the model's outputs): alone when `single`, else
    as a tuple. With `contiguous`, as fresh contiguous tensors: the next stage receives into
    buffers laid out like the outputs, and a receive needs a contiguous buffer; and zero-bubble
    schedules detach a stage's outputs in place after its input backward, which a view refuses.
    With `dtype`, floating outputs are sent in it (`boundary_copy`)."""
    output = next(node for node in stage.graph.nodes if node.op == "output")
    current = output.args[0]
    values = list(current) if isinstance(current, (tuple, list)) else [current]
    chosen = [constant if index is None else values[index] for index, constant in order]
    if contiguous:
        with stage.graph.inserting_before(output):
            chosen = [stage.graph.call_function(torch.ops.aten.clone.default, (value,),
                                                {"memory_format": torch.contiguous_format})
                      if dtype is None else stage.graph.call_function(boundary_copy, (value, dtype))
                      for value in chosen]
    output.args = (chosen[0],) if single else (tuple(chosen),)
    stage.recompile()


def boundary_copy(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A fresh contiguous copy of a value a stage sends, floating values in `dtype`. (Whether a
    value is floating is known only when it runs: the stage's outputs are its units' results,
    which carry no metadata.)"""
    if value.is_floating_point():
        return value.to(dtype, memory_format=torch.contiguous_format, copy=True)
    return value.clone(memory_format=torch.contiguous_format)


def interface_examples(stages: list[fx.GraphModule], inputs: list,
                       compute_dtype: torch.dtype | None = None,
                       device: torch.device = torch.device("cpu")) -> list[tuple[tuple, tuple]]:
    """(inputs, outputs) of each stage as meta-device tensors, from a run on fake tensors of the
    model's positional inputs `inputs` (fake or meta tensors: only their shapes and dtypes count).
    Under mixed precision (`compute_dtype`) the stages run under autocast, as they do in training:
    a later stage takes 16-bit values, which an op reading them with fp32 weights or fp32 values
    computed in the stage (rotary tables) accepts only under autocast. Every tensor of the run is on
    `device`, the rank's: the stages' own may still be on meta, and ops the capture traced on a
    GPU make theirs there."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    examples = []
    autocast = torch.autocast(device.type, dtype=compute_dtype or torch.bfloat16,
                              enabled=compute_dtype is not None)
    on_device = lambda x: torch.empty_strided(x.shape, x.stride(), dtype=x.dtype,
                                              device=device).requires_grad_(x.requires_grad)
    with mode, autocast:
        values = tuple(on_device(x) for x in inputs)
        for stage in stages:
            # on fake copies of the stage's tensors: fake mode runs some in-place ops (BatchNorm's
            # num_batches_tracked.add_) on the real tensor they are given, the model's own
            # (one name per module: a module two units share is swapped once, since torch's
            # reparametrization restores a name it swapped twice to the first swap's fake)
            state = {f"{path}.{name}" if path else name: on_device(tensor)
                     for path, module in stage.named_modules()
                     for name, tensor in [*module._parameters.items(), *module._buffers.items()]
                     if tensor is not None}
            output = torch.func.functional_call(stage, state, values, tie_weights=False)
            outputs = output if isinstance(output, tuple) else (output,)
            examples.append((values, tuple(x for x in outputs if isinstance(x, torch.Tensor))))
            values = outputs
    return [tuple(tuple(_on_meta(x) for x in side) for side in example) for example in examples]


def _on_meta(value: torch.Tensor) -> torch.Tensor:
    tensor = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    return tensor.requires_grad_(value.requires_grad)
