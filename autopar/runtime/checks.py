"""Training semantics that only a built model, optimizer or first step can reveal, refused with
the reason and the fix before they train silently wrong.

Each check is a pure function of what the runtime has at hand; none runs a collective, so every
rank reaches the same verdict from the same inputs and raises before the first collective.

- `check_optimizer`: the factory returned an optimizer (a lambda that forgets `return` gives None).
- `check_loss`: the loss is a scalar floating tensor that depends on the outputs.
- `loss_reduction` / `check_loss_reduction`: the loss averages over the batch. autopar splits the
  batch into micro-batches and data-parallel shards and averages their gradients, which is exact
  for a mean and halves a sum once per split.
- `updated_buffers` / `check_buffers`: buffers written in forward (BatchNorm running statistics).
  Each data-parallel rank sees a different shard of the batch, so its statistics would differ from
  every other rank's and from one process's.
- `check_example_kwargs` / `check_step_inputs`: keyword inputs of a step (attention masks) have the names, dtypes and
  shapes that were captured, and the batch dimension of the step.
"""

from __future__ import annotations

import math

import torch
from torch.utils import _pytree as pytree

from autopar.errors import AutoparError

# |sum-check| and |mean-check| tolerance relative to the loss's size: float32 sums of a batch
# split in two differ from the whole in the last bits only.
REDUCTION_RTOL = 1e-4
# Norms that write running statistics into their args 3 and 4 when args[5] (training or
# use_input_stats) is true, without saying so in their schema.
RUNNING_STATS_OPS = ("batch_norm", "native_batch_norm", "_native_batch_norm_legit", "instance_norm")


def check_optimizer(optimizer) -> torch.optim.Optimizer:
    """The value the user's `optimizer(params)` returned."""
    if optimizer is None:
        raise AutoparError("the optimizer factory returned None; it must return the optimizer it "
                           "builds, e.g. optimizer=lambda params: torch.optim.AdamW(params, lr=3e-4)")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise AutoparError(f"the optimizer factory returned a {type(optimizer).__name__}, not a "
                           f"torch.optim.Optimizer; return one built on the parameters it is given")
    return optimizer


def check_loss(loss) -> torch.Tensor:
    """The value `loss_fn(outputs, targets)` returned on a step."""
    if not isinstance(loss, torch.Tensor):
        raise AutoparError(f"loss_fn returned a {type(loss).__name__}, not a tensor; return the loss "
                           f"tensor, e.g. torch.nn.functional.cross_entropy(outputs, targets)")
    if loss.numel() != 1:
        raise AutoparError(f"loss_fn returned a tensor of shape {list(loss.shape)}, not a scalar; "
                           f"reduce it with .mean() (a per-sample loss cannot be backpropagated "
                           f"as one step)")
    if not loss.is_floating_point():
        raise AutoparError(f"loss_fn returned a {loss.dtype} tensor; a loss must be floating point")
    if not loss.requires_grad:
        raise AutoparError("loss_fn returned a tensor that does not depend on the model's outputs "
                           "(it has no gradient); compute the loss from the outputs it is given")
    return loss


def loss_reduction(loss_fn, outputs, targets) -> str:
    """"mean", "sum" or "other": how `loss_fn` reduces over the batch (dim 0 of every tensor in
    outputs and targets), told apart by comparing the whole batch with its two halves. A batch
    of one, or a loss of zero, cannot tell: "mean" is assumed."""
    batch = _batch_size(outputs)
    if batch is None or batch < 2:
        return "mean"
    first = batch // 2
    with torch.no_grad():
        whole = float(loss_fn(outputs, targets))
        a = float(loss_fn(*_take(outputs, targets, 0, first)))
        b = float(loss_fn(*_take(outputs, targets, first, batch)))
    scale = max(abs(whole), abs(a), abs(b), 1e-30)
    if not all(map(math.isfinite, (whole, a, b))) or scale == 1e-30:
        return "mean"
    if abs(whole - (first * a + (batch - first) * b) / batch) <= REDUCTION_RTOL * scale:
        return "mean"
    if abs(whole - (a + b)) <= REDUCTION_RTOL * scale:
        return "sum"
    return "other"


def check_loss_reduction(loss_fn, outputs, targets) -> None:
    """Refuse a loss that sums over the batch (see the module docstring for why)."""
    kind = loss_reduction(loss_fn, outputs, targets)
    if kind == "sum":
        raise AutoparError("loss_fn sums over the batch (the loss of the whole batch is the sum of "
                           "its halves' losses); autopar averages gradients over micro-batches and "
                           "data-parallel ranks, which needs a mean: use reduction='mean' or divide "
                           "by the batch size")
    if kind == "other":
        raise AutoparError("loss_fn is neither a mean nor a sum over the batch (the loss of the "
                           "whole batch is not the average of its halves' losses); autopar splits "
                           "the batch and averages, which is exact only for a mean over samples")


def updated_buffers(program) -> list[str]:
    """Names of the buffers that the captured forward writes: BatchNorm's running_mean,
    running_var and num_batches_tracked. torch.export's training IR leaves these writes in place
    (its graph signature lists no mutation until the graph is functionalized, which costs seconds
    on a large model), so they are read from the graph: an op whose schema writes an argument,
    and the norms that update their running statistics (args 3 and 4) when args[5] is true."""
    buffers = program.graph_signature.inputs_to_buffers
    written = set()
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        schema = getattr(node.target, "_schema", None)
        for i, argument in enumerate(schema.arguments if schema else ()):
            if argument.alias_info is not None and argument.alias_info.is_write and i < len(node.args):
                written.add(node.args[i])
        packet = getattr(getattr(node.target, "overloadpacket", None), "__name__", "")
        if packet in RUNNING_STATS_OPS and len(node.args) > 5 and node.args[5] is True:
            written.update(node.args[3:5])
    return sorted(buffers[arg.name] for arg in written
                  if getattr(arg, "op", None) == "placeholder" and arg.name in buffers)


def check_buffers(program, dp: int) -> None:
    """Refuse buffers updated in forward under data parallelism, where each rank would update
    its copy from its own shard of the batch."""
    names = updated_buffers(program)
    if dp > 1 and names:
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        raise AutoparError(
            f"the model updates buffers in forward ({shown}), as BatchNorm's running statistics "
            f"are; with {dp} data-parallel ranks each would keep statistics of its own shard of "
            f"the batch. Use a norm without running statistics (LayerNorm, GroupNorm), "
            f"track_running_stats=False, or a plan without data parallelism")


def check_example_kwargs(kwargs: dict, example_inputs: tuple) -> None:
    """Tensor keyword inputs are batch-sized like the positional ones: each step splits them into
    replicas and micro-batches along dim 0."""
    rows = next((x.shape[0] for x in example_inputs if isinstance(x, torch.Tensor) and x.dim()), None)
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor) and (value.dim() == 0 or value.shape[0] != rows):
            raise AutoparError(f"example_kwargs[{name!r}] has shape {list(value.shape)}, but the "
                               f"example inputs have {rows} rows; a tensor keyword input is split "
                               f"over the batch like the inputs: give it one row per sequence "
                               f"(expand it to the batch), or make it a buffer of the model")


def check_step_inputs(example_kwargs: dict, kwargs: dict, rows: int, hint: str = "") -> dict:
    """A step's keyword inputs against those captured; returns the tensor ones by name.

    Tensors (attention masks) must be given at every step, with the captured dtype and shape
    apart from the batch dimension (dim 0), which must be `rows`. Non-tensor keywords were
    captured into the graph as constants (`use_cache=False`): they may be left out, and if given
    must be the captured value. `hint` is added to a wrong batch dimension's message."""
    tensors = [name for name, value in example_kwargs.items() if isinstance(value, torch.Tensor)]
    unknown = sorted(set(kwargs) - set(example_kwargs))
    missing = [name for name in tensors if name not in kwargs]
    if unknown:
        raise AutoparError(f"step got keyword input(s) {unknown}, which were not captured (captured: "
                           f"{sorted(example_kwargs) or 'none'}); pass them to compile's "
                           f"example_kwargs too, or leave them out of step")
    if missing:
        raise AutoparError(f"step is missing the keyword input(s) {missing}, which were captured as "
                           f"tensors of the model's forward; pass them to every step, e.g. "
                           f"step(ids, targets, {missing[0]}=...)")
    for name, value in kwargs.items():
        example = example_kwargs[name]
        if isinstance(example, torch.Tensor) and not isinstance(value, torch.Tensor):
            raise AutoparError(f"step keyword {name!r} is a {type(value).__name__}, but a tensor was "
                               f"captured; pass a tensor of shape {['batch', *example.shape[1:]]}")
        if not isinstance(example, torch.Tensor):
            if isinstance(value, torch.Tensor) or value != example:
                raise AutoparError(f"step keyword {name!r} is {_short(value)}, but {example!r} was "
                                   f"captured into the graph; a non-tensor input is a constant of "
                                   f"the compiled program: pass {example!r} or leave it out")
            continue
        if value.dim() != example.dim() or value.shape[1:] != example.shape[1:]:
            raise AutoparError(f"step keyword {name!r} has shape {list(value.shape)}, but "
                               f"{list(example.shape)} was captured; only the batch dimension "
                               f"(dim 0) may differ")
        if value.dtype != example.dtype:
            raise AutoparError(f"step keyword {name!r} is {value.dtype}, but {example.dtype} was "
                               f"captured; pass it as {example.dtype}")
        if value.shape[0] != rows:
            raise AutoparError(f"step keyword {name!r} has a batch dimension of {value.shape[0]} but "
                               f"the inputs need {rows} rows; give it one row per sequence of the "
                               f"batch{hint}")
    return {name: kwargs[name] for name in tensors}


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"a {type(value).__name__}"


def _batch_size(tree) -> int | None:
    sizes = {leaf.shape[0] for leaf in pytree.tree_leaves(tree)
             if isinstance(leaf, torch.Tensor) and leaf.dim() > 0}
    return sizes.pop() if len(sizes) == 1 else None


def _take(outputs, targets, start: int, stop: int):
    """Rows start:stop of every batched tensor in (outputs, targets)."""
    def rows(leaf):
        return leaf[start:stop] if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 else leaf

    return pytree.tree_map(rows, outputs), pytree.tree_map(rows, targets)
