"""autopar's runtime: `build_runtime(...) -> CompiledModel` runs any plan, one stage or many.

Every rank runs the same code. From the plan it derives one rank grid (pp, dp, tp) and the process
groups of each axis (a device mesh over that grid), exports the model for one micro-batch, cuts the
graph into the plan's stages (pipeline_split.py; a single-stage plan is one stage), and keeps only
the stages placed on its pipeline rank, with their own copy of only their parameters. One mechanism
per form:
- tensor and sequence parallelism: parameters are DTensors over tp with the plan's placements
  (pipeline_tensor.py);
- data parallelism and ZeRO: FSDP2 over dp, each layer its own group so that its collectives
  overlap the neighbouring layers' compute: `replicate` (gradients all-reduced) for plain data
  parallelism, `fully_shard` for ZeRO (1 and 2 keep parameters gathered from forward to backward,
  3 frees them between; 2 and 3 reduce-scatter the gradients after every micro-batch, 1 once
  a step, schedule.py);
- micro-batches and pipelining: `torch.distributed.pipelining` runs the plan's schedule.
The optimizer steps on the local shards.

The loss of one step is the mean over micro-batches and replicas, computed on the last stage and
shared with every rank, so `step` returns the same float everywhere.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor
from torch.utils.data.distributed import DistributedSampler

from autopar.errors import AutoparError, MeshError, PlanMismatchError
from autopar.plans import AxisRole, Plan
from autopar.runtime import checkpoint, materialize
from autopar.runtime.gloo_reduce import reduce_in_place_on_cpu
from autopar.runtime import precision as mixed
from autopar.runtime.checks import (check_buffers, check_example_kwargs, check_loss, check_loss_reduction,
                                   check_optimizer, check_step_inputs)
from autopar.runtime.pipeline_split import (StageProgram, TensorRef, export_for_pipeline, model_outputs,
                                            signature, split_stages)
from autopar.runtime.pipeline_tensor import TensorParallelStage, reduce_partial_gradients, shard_stage
from autopar.runtime.schedule import ReducingStage, ReshardingStage, build_schedule
from autopar.runtime.tied import TiedWeights
from autopar.plans.schedules import relay_error
from autopar.plans.zero import keeps_weights_gathered, reduces_every_micro_batch


@dataclass(kw_only=True, slots=True)
class PipelineLayout:
    """Where the plan's stages live: the rank grid and each stage's pipeline rank."""
    grid: list[list[list[int]]]       # [pipeline rank][dp index][tp index] -> global rank
    stage_rank: list[int]             # stage index -> pipeline rank holding it
    dp: int
    tp: int

    @property
    def pp(self) -> int:
        return len(self.grid)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        for p, plane in enumerate(self.grid):
            for d, row in enumerate(plane):
                if rank in row:
                    return p, d, row.index(rank)
        raise MeshError(f"rank {rank} is in none of the plan's stages; the plan covers ranks "
                        f"0..{self.world_size - 1}")


def pipeline_layout(plan: Plan) -> PipelineLayout:
    """Stages with the same ranks share a pipeline rank (interleaved and V schedules place several
    stages on one); each stage's ranks are row-major over the plan's (dp, tp) axes."""
    first = plan.stages[0]
    for stage in plan.stages:
        if (stage.dp, stage.tp) != (first.dp, first.tp):
            raise AutoparError(
                f"stage {stage.index} runs on dp={stage.dp} x tp={stage.tp} but stage 0 on "
                f"dp={first.dp} x tp={first.tp}; the pipeline runtime needs one sub-mesh shape for all "
                f"stages: plan again with uniform stages")
        if len(stage.ranks) != stage.dp * stage.tp:
            raise PlanMismatchError(f"stage {stage.index} lists {len(stage.ranks)} ranks for "
                                    f"dp={stage.dp} x tp={stage.tp}")
    rank_sets: list[tuple[int, ...]] = []
    stage_rank = []
    for stage in plan.stages:
        key = tuple(stage.ranks)
        if key not in rank_sets:
            rank_sets.append(key)
        stage_rank.append(rank_sets.index(key))
    dp_major = plan.axis_roles[:1] != [AxisRole.TENSOR]
    grid = [[[ranks[_flat(d, t, first.dp, first.tp, dp_major)] for t in range(first.tp)]
             for d in range(first.dp)] for ranks in rank_sets]
    everyone = sorted(r for ranks in rank_sets for r in ranks)
    if everyone != list(range(len(everyone))):
        raise PlanMismatchError(f"the plan's stages use ranks {everyone}; each rank must appear in "
                                f"exactly one pipeline position")
    return PipelineLayout(grid=grid, stage_rank=stage_rank, dp=first.dp, tp=first.tp)


def _flat(d: int, t: int, dp: int, tp: int, dp_major: bool) -> int:
    return d * tp + t if dp_major else t * dp + d


def check_batch(plan: Plan, global_batch: int) -> None:
    """The global batch must split into dp replicas x micro_batches x micro_batch_size exactly."""
    dp = plan.stages[0].dp
    expected = dp * plan.micro_batches * plan.micro_batch_size
    if global_batch != expected:
        raise AutoparError(
            f"global batch {global_batch} does not split into the plan's micro-batches: dp={dp} x "
            f"{plan.micro_batches} micro-batches x {plan.micro_batch_size} sequences = {expected}; "
            f"pass a batch of {expected} sequences, or plan again with global_batch={global_batch}")


class CompiledModel:
    """A model trained under a plan on this rank: its stages, its schedule and its optimizer."""

    def __init__(self, *, plan: Plan, layout: PipelineLayout, mesh: DeviceMesh,
                 programs: list[StageProgram], schedule, optimizer, device: torch.device,
                 state_aliases: dict[str, list[str]], tied: TiedWeights | None = None,
                 example_kwargs: dict | None = None, scaler: mixed.LossScaler | None = None):
        self.plan = plan
        self.scaler = scaler                # fp16's loss scaler (precision.py); None otherwise
        # the captured keyword inputs (tensors change per step, constants are in the graph) and
        # the order in which the first stage takes the tensor ones after the positional inputs
        self.example_kwargs = dict(example_kwargs or {})
        self.keywords = programs[0].keywords if programs else ()
        self.tied = tied
        self.state_aliases = state_aliases
        self.layout = layout
        self.mesh = mesh
        self.programs = programs
        self.schedule = schedule
        self.optimizer = optimizer
        self.device = device
        self.pp_rank, self.dp_rank, self.tp_rank = layout.coordinates(dist.get_rank())
        self.is_first = any(p.index == 0 for p in programs)
        self.is_last = any(p.index == len(plan.stages) - 1 for p in programs)
        self.steps = 0                      # steps taken; saved and restored by checkpoints
        self.skipped_steps = 0              # of those, updates fp16's scaler skipped (inf or NaN)

    @property
    def global_batch(self) -> int:
        return self.plan.global_batch

    @property
    def stages(self) -> nn.ModuleList:
        """The modules of this rank's stages, as they run (wrapped for TP, ZeRO, recompute)."""
        return nn.ModuleList(program.module for program in self.programs)

    def step(self, *batch: torch.Tensor, local: bool = False, **kwargs) -> float:
        """One optimizer step on `(*inputs, targets)`: the global batch, or with `local=True` this
        replica's share. Keyword inputs that were captured as tensors (`attention_mask=...`) are
        given at every step, batch-sized like the inputs: they are split across replicas and
        micro-batches as the inputs are. Returns the mean loss over micro-batches and replicas on
        every rank. Under fp16, a step whose gradients overflow on any rank updates nothing on
        every rank (`skipped_steps` counts it) and still returns its loss."""
        rows = self.global_batch // self.layout.dp if local else self.global_batch
        tensors = check_step_inputs(self.example_kwargs, kwargs, rows,
                                    "" if local else " (or local=True with this rank's share)")
        if len(batch) >= 2:
            # the first stage takes the tensor keywords after the positional inputs (pipeline_split)
            batch = (*batch[:-1], *(tensors[name] for name in self.keywords), batch[-1])
        batch = self._rows_of_this_rank(batch, local)
        *inputs, targets = (t.to(self.device) for t in batch)
        losses: list[torch.Tensor] = []
        args = tuple(inputs) if self.is_first else ()
        last = {"target": targets, "losses": losses} if self.is_last else {}
        # the scale the schedule's losses are multiplied by (a power of 2: dividing is exact)
        scale = 1.0 if self.scaler is None else self.scaler.get_scale()
        # only the losses are wanted: torch's last stage would otherwise keep every
        # micro-batch's outputs (logits) to the end of the step to return them merged
        self.schedule.step(*args, **last, return_outputs=False)
        reduce_partial_gradients([program.module for program in self.programs])
        if self.tied is not None:
            self.tied.reduce_gradients()   # tied weights' copies in several stages (tied.py)
        if self.scaler is None:
            self.optimizer.step()
        else:
            self.scaler.unscale_(self.optimizer)   # the inf check, agreed by every rank
            self.scaler.step(self.optimizer)       # skipped on every rank when any found inf
            self.scaler.update()
            # a skip is what lowers the scale (torch's backoff factor is below 1)
            self.skipped_steps += int(self.scaler.get_scale() < scale)
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return self._shared_loss(losses) / scale

    def _rows_of_this_rank(self, batch: tuple, local: bool) -> tuple:
        """Check the batch size (before any collective) and keep this data-parallel rank's rows."""
        if len(batch) < 2:
            raise AutoparError("step(*inputs, targets): pass the model's inputs and the targets")
        share = self.global_batch // self.layout.dp
        expected = share if local else self.global_batch
        for tensor in batch:
            if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0 or tensor.shape[0] != expected:
                got = f"a batch of {tensor.shape[0]}" if isinstance(tensor, torch.Tensor) and tensor.dim() \
                    else f"{type(tensor).__name__} {tuple(getattr(tensor, 'shape', ()))}"
                what = "share per data-parallel rank" if local else "global batch"
                hint = "" if local else " (or local=True with this rank's share)"
                raise AutoparError(f"step got {got} but the plan's {what} is {expected}; pass "
                                   f"{expected} rows{hint}")
        if local:
            return batch
        return tuple(t[self.dp_rank * share:(self.dp_rank + 1) * share] for t in batch)

    def sampler(self, dataset, **kwargs) -> DistributedSampler:
        """A DistributedSampler over the data-parallel replicas: feed its batches to step(local=True)."""
        return DistributedSampler(dataset, num_replicas=self.layout.dp, rank=self.dp_rank, **kwargs)

    def _shared_loss(self, losses: list[torch.Tensor]) -> float:
        """Mean over micro-batches and replicas, the same on every rank."""
        value = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.is_last:
            value += torch.stack([loss.detach() for loss in losses]).double().mean()
        dist.all_reduce(value)
        return (value / (self.layout.dp * self.layout.tp)).item()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters and buffers under model.state_dict()'s names, gathered on every rank. A
        collective: call it on every rank."""
        mine = {}
        for program in self.programs:
            for ref in program.module.modules():
                if isinstance(ref, TensorRef):
                    # gathering a DTensor is a collective of its mesh: every rank takes part
                    value = ref.value.detach()
                    value = value.full_tensor() if isinstance(value, DTensor) else value
                    mine[ref.fqn] = value.cpu().clone()
        if (self.dp_rank, self.tp_rank) != (0, 0):
            mine = {}
        gathered: list[dict] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        found = {name: tensor for part in gathered for name, tensor in part.items()}
        state = {}
        for key, aliases in self.state_aliases.items():
            present = [alias for alias in aliases if alias in found]
            if not present:
                raise AutoparError(f"{key} is in the model's state_dict but no pipeline stage reads "
                                   f"it, so no rank holds it; read it from the model itself")
            state[key] = found[present[0]]
        return state

    # Checkpoints (checkpoint.py): DCP directories under the model's own names, any plan to any plan.
    def save(self, path, extra: dict | None = None):
        """Write a checkpoint (model, optimizer, step count, RNG states, plan, `extra`) to directory
        `path`, atomically. A collective: every rank calls it."""
        return checkpoint.save(self, path, extra)

    def load(self, path) -> dict | None:
        """Restore a checkpoint saved under any plan; returns the `extra` saved with it. A
        collective: every rank calls it."""
        return checkpoint.load(self, path)


def state_aliases(model: nn.Module) -> dict[str, list[str]]:
    """Each state_dict key and every name of the same tensor (tied weights have several; the graph
    knows one of them)."""
    names: dict[int, list[str]] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False),
                         *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(tensor), []).append(name)
    return {key: names.get(id(tensor), [key])
            for key, tensor in model.state_dict(keep_vars=True).items()}


def build_runtime(model: nn.Module, plan: Plan, *, example_inputs: tuple, loss_fn, optimizer,
                  example_kwargs: dict | None = None, device: torch.device | str | None = None,
                  graph=None, load_from=None, init=None, seed: int = 0) -> CompiledModel:
    """This rank's CompiledModel for `plan`. Call on every rank with the default process group up.

    `optimizer` is a function from a list of parameters to a torch.optim optimizer. `graph` is the
    model's capture for `example_inputs`: its export is reused when it was made for one micro-batch
    on real tensors (the stage's tensors come from `model` by name either way). `example_kwargs`
    are keyword arguments of the model's forward: constants (`use_cache=False`) are fixed in the
    exported program, tensors (an `attention_mask` for one micro-batch) are inputs given again at
    every step. A model on the meta device, or `load_from`/`init`, fill each
    rank's shards only (materialize.py); the plan's precision runs mixed precision (precision.py)."""
    example_kwargs = dict(example_kwargs or {})
    check_example_kwargs(example_kwargs, example_inputs)
    materialize.check_sources(model, load_from, init)
    mixed.check_precision(plan.precision)
    layout = pipeline_layout(plan)
    if dist.get_world_size() != layout.world_size:
        raise MeshError(f"the plan needs {layout.world_size} ranks (pp={layout.pp} x dp={layout.dp} x "
                        f"tp={layout.tp}) but {dist.get_world_size()} are running; launch "
                        f"{layout.world_size} ranks or plan for this world size")
    check_batch(plan, plan.global_batch)
    check_layers(model, plan)
    device = torch.device(device or _default_device())
    mesh = _device_mesh(layout, device)
    pp_rank = layout.coordinates(dist.get_rank())[0]
    own = [s for s, r in enumerate(layout.stage_rank) if r == pp_rank]

    program = graph.program if graph is not None and _reusable(graph.program, example_inputs, plan) \
        else None
    micro = tuple(_micro_batch(x, plan.micro_batch_size) for x in example_inputs)
    micro_kwargs = {name: _micro_batch(value, plan.micro_batch_size) if isinstance(value, torch.Tensor)
                    else value for name, value in example_kwargs.items()}
    # --- meta models: exported on meta, sharded on meta, then only local shards get storage ---
    meta = materialize.is_meta_model(model)
    if meta:
        program, micro = None, materialize.meta_inputs(micro)
        micro_kwargs = dict(zip(micro_kwargs, materialize.meta_inputs(tuple(micro_kwargs.values()))))
    if program is None:
        program = torch.export.export(model, micro, micro_kwargs, strict=False)
    check_buffers(program, layout.dp)
    exported = export_for_pipeline(model, (), program)
    if meta:
        materialize.retarget_devices(exported, device)
    keywords = signature(exported)[1]
    tensors = [name for name, value in example_kwargs.items() if isinstance(value, torch.Tensor)]
    if sorted(keywords) != sorted(tensors):
        raise PlanMismatchError(f"the graph takes the keyword inputs {list(keywords)} but example_kwargs "
                                f"has the tensors {tensors}; capture the graph with the example_kwargs "
                                f"given to compile")
    programs = _stage_programs(exported, model, plan, layout, mesh, own, device, meta)
    # the planner never emits this (autopar.plans.stage_flow finds the same values); a plan
    # written by hand, or for other stages, may
    relay_refusal = relay_error(plan.schedule, programs[0].relayed if programs else ())
    if relay_refusal is not None:
        raise AutoparError(relay_refusal)
    if meta or load_from is not None or init is not None:
        materialize.fill_stages([p.module for p in programs], model, device, load_from=load_from,
                                init=init, seed=seed)
    # --- mixed precision: compute under autocast (FSDP2 casts the parameters it gathers) ---
    for p in programs:
        mixed.autocast_stage(p.module, device, plan.precision)
    loss_fn = mixed.autocast_loss(loss_fn, device, plan.precision)
    scaler = mixed.loss_scaler(plan.precision, device)
    tied = TiedWeights(programs, layout.stage_rank, layout.grid, mesh.get_group("pp"))
    # the split's record of what each stage takes and returns spares torch a forward to learn it
    stages = None if len(plan.stages) == 1 else [
        _stage_class(plan, p.index, layout.dp)(
            p.module, p.index, len(plan.stages), device, input_args=p.example_inputs,
            output_args=p.example_outputs, group=mesh.get_group("pp")) for p in programs]
    out_spec = programs[0].out_spec     # the last stage returns the model's outputs flat
    schedule = build_schedule(plan, layout.stage_rank, layout.pp, [p.module for p in programs], stages,
                              mixed.scaled_loss(_checked_loss(loss_fn, out_spec), scaler))
    params = [p for program in programs for p in program.module.parameters()]
    return CompiledModel(plan=plan, layout=layout, mesh=mesh, programs=programs, schedule=schedule,
                         optimizer=_optimizer(optimizer, params), device=device,
                         state_aliases=state_aliases(model), tied=tied, example_kwargs=example_kwargs,
                         scaler=scaler)


def _checked_loss(loss_fn, out_spec):
    """The user's loss on the model's own output structure (a ModelOutput, a tuple...), checked to
    be a scalar that averages over the batch (on the first micro-batch; autopar averages over
    micro-batches and replicas, exact only for a mean)."""
    checked = []

    def loss(outputs, target):
        outputs = model_outputs(outputs, out_spec)
        if not checked:
            check_loss_reduction(loss_fn, outputs, target)
            checked.append(True)
        value = check_loss(loss_fn(outputs, target))
        # a new tensor, not a view: zero-bubble schedules detach the loss in place
        return value if value.dim() == 0 else value.sum()
    return loss


def _device_mesh(layout: PipelineLayout, device: torch.device) -> DeviceMesh:
    """The (pp, dp, tp) mesh of the rank grid; torch's init_device_mesh when the grid is in rank
    order (Megatron's, which the planner writes), a DeviceMesh over the grid as given otherwise."""
    grid = torch.tensor(layout.grid)
    names = ("pp", "dp", "tp")
    if torch.equal(grid.flatten(), torch.arange(grid.numel())):
        return init_device_mesh(device.type, tuple(grid.shape), mesh_dim_names=names)
    return DeviceMesh(device.type, grid, mesh_dim_names=names)


def _stage_programs(exported: fx.GraphModule, model: nn.Module, plan: Plan, layout: PipelineLayout,
                    mesh: DeviceMesh, own: list[int], device: torch.device,
                    meta: bool = False) -> list[StageProgram]:
    """This rank's stages, in order: cut the export into the plan's stages (with recompute per
    layer); keep our stages and copy only their tensors; shard parameters over tp (DTensor needs
    whole tensors to distribute); then over dp (FSDP shards what TP left, so it comes last)."""
    programs = split_stages(exported, [s.layers for s in plan.stages], [s.recompute for s in plan.stages],
                            blocks=_repeated_layers(model, plan),
                            boundary_dtype=mixed.compute_dtype(plan.precision))
    programs = [_materialize(programs[s], model, device, meta) for s in own]
    tp_axis = plan.axis_index(AxisRole.TENSOR) if layout.tp > 1 else None
    for program in programs:
        if tp_axis is not None and _sharded_on(program, plan, tp_axis):
            program.module = shard_stage(program.module, mesh["tp"], plan.parameters, plan.nodes, tp_axis)
        if layout.dp > 1:
            _data_parallel(program.module, plan.stages[program.index].zero, plan.schedule, mesh["dp"],
                           mixed.mp_policy(plan.precision))
    return programs


def _repeated_layers(model: nn.Module, plan: Plan) -> set[str]:
    """The plan's layers that are elements of a ModuleList or Sequential: the repeated blocks."""
    found = set()
    for layer in (layer for stage in plan.stages for layer in stage.layers):
        parent, _, index = layer.rpartition(".")
        if index.isdigit() and isinstance(model.get_submodule(parent), (nn.ModuleList, nn.Sequential)):
            found.add(layer)
    return found


def _data_parallel(module: nn.Module, zero: int, schedule: str, dp_mesh: DeviceMesh,
                   mp_policy=None) -> None:
    """Plain data parallelism or ZeRO over `dp_mesh`, one FSDP group per layer, then the rest.

    ZeRO-1 runs as ZeRO-2 but reduces its gradients once a step (schedule.py): FSDP2 shards them
    with the optimizer state after that reduce. Under zero-bubble schedules (backward split into input and weight
    parts) freeing parameters between forward and backward gives wrong weight gradients in this
    torch, so there ZeRO-3 keeps them, as ZeRO-2 does."""
    policy = {} if mp_policy is None else {"mp_policy": mp_policy}
    if zero == 0:
        wrap = functools.partial(replicate, mesh=dp_mesh, **policy)
    else:
        wrap = functools.partial(fully_shard, mesh=dp_mesh, **policy,
                                 reshard_after_forward=not keeps_weights_gathered(zero, schedule))
    for layer in _layers(module):
        wrap(layer)
    wrap(module)
    if zero:
        reduce_in_place_on_cpu(module)


def _stage_class(plan: Plan, index: int, dp: int) -> type:
    """ZeRO-2 and 3 stages reduce their gradients after each micro-batch's backward, ZeRO-3
    stages also free their gathered weights (schedule.py)."""
    zero = plan.stages[index].zero
    if dp == 1 or not reduces_every_micro_batch(zero, plan.schedule):
        return PipelineStage
    return ReshardingStage if zero == 3 else ReducingStage


def _layers(module: nn.Module) -> list[nn.Module]:
    """The stage's per-layer submodules (the split's units) that hold parameters of their own. A
    unit sharing a parameter with another (an LM head tied to the embedding in the same stage)
    stays in the stage's group: FSDP2 gives each parameter to one group."""
    inner = module.inner if isinstance(module, TensorParallelStage) else module
    units = [child for name, child in inner.named_children() if name.startswith("submod_")]
    owners: dict[int, int] = {}
    for unit in units:
        for param in unit.parameters():
            owners[id(param)] = owners.get(id(param), 0) + 1
    return [unit for unit in units
            if any(True for _ in unit.parameters()) and all(owners[id(p)] == 1 for p in unit.parameters())]


def _sharded_on(program: StageProgram, plan: Plan, axis: int) -> bool:
    """Whether the plan shards any of the stage's parameters or values on `axis`. When it shards
    none, every tp rank computes the whole stage with plain tensors: the same numbers DTensor would
    give with all placements replicated, without its dispatch cost on every op."""
    names = [node.name for graph_module in program.module.modules()
             if isinstance(graph_module, fx.GraphModule) for node in graph_module.graph.nodes]
    placed = [plan.parameters.get(fqn) for fqn in program.param_names.values()]
    placed += [plan.nodes.get(name) for name in names]
    return any(texts is not None and texts[axis] != "R" for texts in placed)


def _optimizer(make_optimizer, params: list[nn.Parameter]):
    """The user's optimizer on this rank's parameters (FSDP2 shards for ZeRO: the state follows)."""
    return check_optimizer(make_optimizer(params))


def _default_device() -> torch.device:
    """This rank's GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_layers(model: nn.Module, plan: Plan) -> None:
    """Every layer the plan names is a module of `model`."""
    # a module reached under two names (T5's shared embedding) is a layer under either
    modules = dict(model.named_modules(remove_duplicate=False))
    missing = [path for stage in plan.stages for path in stage.layers if path not in modules]
    if missing:
        raise PlanMismatchError(f"the plan's layers {missing} are not modules of this "
                                f"{type(model).__name__}; the plan was made for another model, plan it again")


def _micro_batch(tensor: torch.Tensor, size: int) -> torch.Tensor:
    if tensor.shape[0] >= size:
        return tensor[:size]
    repeats = -(-size // tensor.shape[0])
    return tensor.repeat(repeats, *([1] * (tensor.dim() - 1)))[:size]


def _materialize(program: StageProgram, model: nn.Module, device: torch.device,
                 meta: bool = False) -> StageProgram:
    """The stage's own copy of its tensors, from the model by name, on its device: nothing is shared
    with the caller's model, and nothing of other stages is kept. For a meta model the copies stay
    on meta (shapes only) until the sharding is done (materialize.fill_stages)."""
    for ref in program.module.modules():
        if isinstance(ref, TensorRef):
            source = materialize.model_tensor(model, ref.fqn)
            # constants the export lifted out of the forward are not the model's attributes
            source = ref.value if source is None else source
            if meta:
                copy = torch.empty_like(source.detach(), device="meta")
            elif source.is_meta:
                raise AutoparError(
                    f"{ref.fqn} is on the meta device; build the model with real weights "
                    f"(every rank the same, e.g. from one seed) before compiling a pipeline")
            else:
                copy = source.detach().to(device, copy=True)
            if isinstance(ref.value, nn.Parameter):
                ref.value = nn.Parameter(copy, requires_grad=ref.value.requires_grad)
            else:
                ref.value = copy
    return program




def _reusable(program, example_inputs: tuple, plan: Plan) -> bool:
    """A capture can be cut into stages when it was made for one micro-batch and on real tensors:
    ops that create tensors (a position `arange`) keep the device they were traced on, meta too."""
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor) and x.dim() > 0]
    if program is None or not tensors or tensors[0].shape[0] != plan.micro_batch_size:
        return False
    return not any(t.is_meta for t in [*tensors, *program.state_dict.values()])
