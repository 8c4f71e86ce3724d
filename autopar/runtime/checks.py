"""Training semantics that only a built model, optimizer or first step can reveal, refused with
the reason and the fix before they train silently wrong.

Each check is a pure function of what the runtime has at hand; none runs a collective, so every
rank reaches the same verdict from the same inputs and raises before the first collective.

- `check_optimizer`: the factory returned an optimizer (a lambda that forgets `return` gives None).
- `check_loss`: the loss is a scalar floating tensor that depends on the outputs.
- `loss_reduction` / `check_loss_reduction`: the loss averages over the batch. autopar splits the
  batch into micro-batches and data-parallel shards and averages their gradients, which is exact
  for a mean and halves a sum once per split.
- `check_micro_batching`: micro-batches change the numbers of a model with BatchNorm in
  training mode or buffers written in forward (running statistics).
- `check_example_kwargs` / `check_step_inputs`: keyword inputs of a step (attention masks) have the names, dtypes and
  shapes that were captured, and the batch dimension of the step.
"""

from __future__ import annotations

import math

import torch
from torch.utils import _pytree as pytree

from autopar.errors import AutoparError
from autopar.runtime.fake_tensors import simulated
from autopar.graph import Graph
from autopar.tracer import program_nodes

# |sum-check| and |mean-check| tolerance relative to the loss's size: float32 sums of a batch
# split in two differ from the whole in the last bits only.
REDUCTION_RTOL = 1e-4


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
    """Refuse a loss that sums over the batch (see the module docstring for why). Fake tensors
    hold no values to compare (autopar simulate): the run checks it."""
    if simulated():
        return
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


def check_micro_batching(program, plan, graph: Graph | None = None) -> None:
    """Refuse micro-batches where they would change the numbers: a BatchNorm in training mode
    normalizes over the samples of each micro-batch, and buffers written in forward are written
    once per micro-batch (autopar.graph.Graph.batch_coupling of `graph`, the capture, or of the
    exported `program`). Data parallelism is not refused: each replica normalizes over its own
    samples and keeps its own running statistics, as DDP does (compile's sync_batchnorm=True
    normalizes over all replicas' samples instead)."""
    reason = (graph or Graph(nodes=program_nodes(program), blocks=[])).batch_coupling()
    if reason is None or plan.micro_batches == 1:
        return
    share = plan.global_batch // plan.stages[0].dp
    raise AutoparError(
        f"the plan cuts each replica's {share} samples into {plan.micro_batches} micro-batches of "
        f"{plan.micro_batch_size}, but {reason}: the model would train on other numbers than one "
        f"process on the same batch. Plan one micro-batch per replica (micro_batch={share}; a "
        f"free plan does so for this model), or use norms without batch statistics (GroupNorm, "
        f"LayerNorm, or BatchNorm in eval mode)")


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
