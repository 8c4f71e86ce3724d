"""One pipeline stage's plan, run: the rewritten program, gradient reduction, optimizer.

`build_compiled` resolves the plan on this rank (layout.py), rewrites the exported graph with
`autopar.passes.PASSES`, and returns a `CompiledModel` whose `step` trains on one global batch.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.utils.data.distributed import DistributedSampler

import autopar.runtime.dtensor_rules  # noqa: F401  (registers the CPU attention rule with DTensor)
from autopar.errors import AutoparError, PlanMismatchError
from autopar.graph import Graph
from autopar.passes import apply_passes
from autopar.plan import Plan
from autopar.runtime.grads import GradientReducer
from autopar.runtime.layout import StageLayout, build_layout


class CompiledModel:
    """A model trained under a plan: `step`, `sampler`, `full_state_dict`, `plan`."""

    def __init__(self, *, program: fx.GraphModule, plan: Plan, layout: StageLayout, params: dict,
                 buffers: dict, state_names: dict, loss_fn, optimizer, reducer: GradientReducer,
                 example_kwargs: dict):
        self.program = program
        self.plan = plan
        self.layout = layout
        self.params = params                  # canonical fqn -> this rank's local shard
        self.buffers = buffers
        self.state_names = state_names        # model.state_dict() key -> fqn in params or buffers
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.reducer = reducer
        self.example_kwargs = example_kwargs

    @property
    def global_batch(self) -> int:
        return self.plan.global_batch

    def step(self, *batch, local: bool = False) -> float:
        """One optimizer step on `(*inputs, targets)`: the global batch, or with `local=True` this
        rank's share of it. Returns the batch's mean loss, the same float on every rank."""
        batch = self._rows_of_this_rank(batch, local)
        layout = self.layout
        micro = layout.micro_batch_size
        total = torch.zeros((), dtype=torch.float32)
        loss_work = None
        context = implicit_replication() if layout.tensor_mesh is not None else contextlib.nullcontext()
        with context:
            for index in range(layout.micro_batches):
                *inputs, targets = (t[index * micro:(index + 1) * micro] for t in batch)
                last = index == layout.micro_batches - 1
                loss = self.loss_fn(self.program(*inputs, **self.example_kwargs), targets)
                total += loss.detach().float()
                if last and layout.dp_group is not None:
                    # Launched before backward: the scalar travels while gradients are computed.
                    total /= layout.micro_batches * layout.dp_size
                    loss_work = dist.all_reduce(total, group=layout.dp_group, async_op=True)
                self.reducer.armed = last
                (loss / layout.micro_batches).backward()
        self.reducer.finish()
        if loss_work is not None:
            loss_work.wait()
        elif layout.dp_group is None:
            total /= layout.micro_batches
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.reducer.broadcast_owned()
        for param in self.params.values():   # ZeRO-1/2: gradients of parameters other ranks own
            param.grad = None
        return total.item()

    def _rows_of_this_rank(self, batch: tuple, local: bool) -> tuple:
        """Check the batch size (before any collective) and keep this data-parallel rank's rows."""
        if len(batch) < 2:
            raise AutoparError("step(*inputs, targets): pass the model's inputs and the targets")
        share = self.global_batch // self.layout.dp_size
        expected = share if local else self.global_batch
        for tensor in batch:
            if tensor.shape[0] != expected:
                what = "share per data-parallel rank" if local else "global batch"
                hint = "" if local else " (or local=True with this rank's share)"
                raise AutoparError(f"step got a batch of {tensor.shape[0]} but the plan's {what} is "
                                   f"{expected}; pass {expected} rows{hint}")
        if local:
            return batch
        start = self.layout.dp_rank * share
        return tuple(t[start:start + share] for t in batch)

    def sampler(self, dataset, **kwargs) -> DistributedSampler:
        """A DistributedSampler over the data-parallel ranks: feed its batches to step(local=True)."""
        return DistributedSampler(dataset, num_replicas=self.layout.dp_size, rank=self.layout.dp_rank, **kwargs)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded parameters and buffers under model.state_dict()'s names. A collective: call it
        on every rank."""
        full = {fqn: self._gather(fqn, param.detach()) for fqn, param in self.params.items()}
        full.update({fqn: buffer.detach().clone() for fqn, buffer in self.buffers.items()})
        return {key: full[fqn] for key, fqn in self.state_names.items()}

    def _gather(self, fqn: str, local: torch.Tensor) -> torch.Tensor:
        spec = self.layout.parameters[fqn]
        if spec.data_dim is not None:
            parts = [torch.empty_like(local) for _ in range(self.layout.dp_size)]
            dist.all_gather(parts, local.contiguous(), group=self.layout.dp_group)
            local = torch.cat(parts, dim=spec.data_dim)
        if self.layout.tensor_mesh is not None:
            local = DTensor.from_local(local, self.layout.tensor_mesh, spec.tensor, run_check=False).full_tensor()
        return local.clone()


def build_compiled(model: nn.Module, plan: Plan, graph: Graph, *, example_inputs: tuple,
                   example_kwargs: dict, loss_fn, optimizer, device_type: str = "cpu") -> CompiledModel:
    """Rewrite `graph`'s program for this rank and wire gradient reduction and the optimizer."""
    meta = [name for name, p in model.named_parameters() if p.is_meta]
    if meta:
        raise AutoparError(f"parameters such as {meta[0]} are on the meta device; the runtime starts from "
                           f"the model's values: materialize it first (model.to_empty(device=...) and "
                           f"initialize, the same seed on every rank)")
    program = _program_for(model, graph, example_inputs, example_kwargs, plan.micro_batch_size)
    _broadcast_from_rank0(program)
    input_names = [n.name for n in program.graph.nodes if n.op == "placeholder"]
    input_names += [n.name for n in graph.nodes if n.role.value == "input"]
    shapes = {fqn: p.shape for fqn, p in program.named_parameters(remove_duplicate=False)}
    canonical = _canonical_names(program)
    placements = _plan_placements(plan, program)
    layout = build_layout(plan, input_names=input_names, param_shapes=shapes, param_placements=placements,
                          blocks=tuple(b.module_path for kind in graph.blocks for b in kind.instances),
                          device_type=device_type)
    state_names = _state_names(model, program)
    buffers = dict(program.named_buffers())      # the passes keep buffers as they are
    program = apply_passes(program, plan, layout)
    params = _shards_by_name(program, canonical)
    # Registration order is close to forward order; buckets fill in reverse, as gradients arrive.
    trainable = [p for p in params.values() if p.requires_grad]
    sharded = [p for fqn, p in params.items() if layout.parameters[fqn].data_dim is not None]
    reducer = GradientReducer([p for p in trainable if not any(p is s for s in sharded)], sharded,
                              group=layout.dp_group, zero=layout.zero)
    owned = reducer.owned_params(trainable)
    return CompiledModel(program=program, plan=plan, layout=layout, params=params, buffers=buffers,
                         state_names=state_names, loss_fn=loss_fn,
                         optimizer=optimizer(owned) if owned else None, reducer=reducer,
                         example_kwargs=example_kwargs)


def _plan_placements(plan: Plan, program: fx.GraphModule) -> dict[str, list[str] | None]:
    """The plan's placements under the program's names. Tied weights are one parameter with
    several names; the plan may use any of them."""
    aliases: dict[int, list[str]] = {}
    for name, param in program.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    known = {name for names in aliases.values() for name in names}
    unknown = sorted(set(plan.parameters) - known)
    if unknown:
        raise PlanMismatchError(f"the plan places parameters this model does not have ({unknown[:3]}); "
                                f"plan this model again")
    return {name: next((plan.parameters[n] for n in names if n in plan.parameters), None)
            for names in aliases.values() for name in names}


def _program_for(model, graph: Graph, example_inputs: tuple, example_kwargs: dict, micro: int) -> fx.GraphModule:
    """The exported program at the micro-batch size (shapes in an exported graph are static),
    holding `model`'s own parameters and buffers (the graph may come from another instance)."""
    batched = [t for t in example_inputs if isinstance(t, torch.Tensor)]
    if batched and batched[0].shape[0] == micro:
        program = graph.program.module()
    else:
        resized = tuple(t[torch.arange(micro) % t.shape[0]] if isinstance(t, torch.Tensor) else t
                        for t in example_inputs)
        program = torch.export.export(model, resized, example_kwargs, strict=False).module()
    model_state = dict(model.named_parameters(remove_duplicate=False))
    model_state.update(model.named_buffers(remove_duplicate=False))
    for name, _ in program.named_parameters(remove_duplicate=False):
        if name not in model_state:
            raise PlanMismatchError(f"the captured graph has parameter {name}, which the model does not: "
                                    f"pass the graph captured from this model")
    # Buffers the model lacks are constants the export lifted out of the forward: kept as they are.
    for name, _ in [*program.named_parameters(remove_duplicate=False), *program.named_buffers(remove_duplicate=False)]:
        if name in model_state:
            owner, _, attr = name.rpartition(".")
            setattr(program.get_submodule(owner), attr, model_state[name])
    return program


def _broadcast_from_rank0(program: fx.GraphModule) -> None:
    """Every rank starts from global rank 0's values, as torch's DDP does."""
    tensors = [t.detach() for t in [*program.parameters(), *program.buffers()]]
    if not tensors or dist.get_world_size() == 1:
        return
    for dtype in {t.dtype for t in tensors}:
        group = [t for t in tensors if t.dtype == dtype]
        flat = torch.cat([t.reshape(-1) for t in group])
        dist.broadcast(flat, src=0)
        with torch.no_grad():
            for tensor, value in zip(group, torch._utils._unflatten_dense_tensors(flat, group)):
                tensor.copy_(value)


def _state_names(model: nn.Module, program: fx.GraphModule) -> dict[str, str]:
    """model.state_dict() key -> the program's name for the same tensor (tied weights share one)."""
    own = {name for name, _ in program.named_parameters()} | {name for name, _ in program.named_buffers()}
    state = model.state_dict(keep_vars=True)
    by_id = {}
    for key, tensor in state.items():
        if key in own:
            by_id.setdefault(id(tensor), key)
    names = {}
    for key, tensor in state.items():
        source = key if key in own else by_id.get(id(tensor))
        if source is None:
            raise PlanMismatchError(f"state {key} of the model is not in its exported program")
        names[key] = source
    return names


def _canonical_names(program: fx.GraphModule) -> dict[str, str]:
    """Every name of a parameter -> its first name (tied weights have several)."""
    first: dict[int, str] = {}
    return {name: first.setdefault(id(param), name)
            for name, param in program.named_parameters(remove_duplicate=False)}


def _shards_by_name(program: fx.GraphModule, canonical: dict[str, str]) -> dict[str, nn.Parameter]:
    """First name -> shard, in registration order. Recompute moves parameters into submodules
    (same objects), so a name is found as the suffix of the path that now leads to it."""
    found: dict[str, nn.Parameter] = {}
    for path, param in program.named_parameters(remove_duplicate=False):
        parts = path.split(".")
        suffix = next((".".join(parts[i:]) for i in range(len(parts)) if ".".join(parts[i:]) in canonical), None)
        if suffix is not None and found.setdefault(canonical[suffix], param) is not param:
            raise AutoparError(f"parameter {suffix} has two copies in the rewritten program")
    order = list(dict.fromkeys(canonical.values()))
    missing = set(order) - set(found)
    if missing:
        raise AutoparError(f"parameters {sorted(missing)[:3]} are missing from the rewritten program")
    return {name: found[name] for name in order}
