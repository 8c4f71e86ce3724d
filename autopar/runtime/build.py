"""`build_runtime(...) -> CompiledModel`: this rank's compiled model for a plan, one stage or many.

Every rank runs the same steps, in this order:
1. check what was given against the plan, before any collective, so every rank refuses alike;
2. the model exported for one micro-batch (on meta for a meta model): shapes in the graph are
   static, and a stage only ever sees micro-batches; under context parallelism, of a rank's
   tokens, exported again at twice as many to find what the sequence split rewrites or refuses
   (passes/context_parallel.py); its MoE layers checked against the plan's expert parallelism:
   the last checks before any collective;
3. the rank grid (pp, dp, cp, tp) and the process group of each axis, and the expert-parallel
   groups of stages that split experts (rank_grid.py);
4. its program cut into the plan's stages, this rank's stages kept with their own copy of only
   their tensors, and each rewritten by autopar.passes.PASSES (expert parallelism, recompute,
   context parallelism, tensor parallelism, precision);
5. data parallelism and ZeRO: FSDP2 over the dp x cp ranks, each layer its own group, split
   experts over the ranks holding the same ones, the states on the host under offload
   (data_parallel.py);
6. a meta model's shards, or `load_from`/`init`, filled: this rank's only (materialize.py);
7. the plan's precision (autocast, fp16's loss scaler), weights tied across stages, the schedule
   of the micro-batches (schedule.py) and the optimizer on the local shards (compiled_model.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import fx, nn
from torch._subclasses.fake_tensor import unset_fake_temporarily

from autopar.errors import AutoparError, MeshError, PlanMismatchError
from autopar.passes import PassTarget, find_sequence_split, run_passes, split_model
from autopar.passes.expert_parallel import check_expert_parallelism
from autopar.passes.program import (StageProgram, TensorRef, export_for_pipeline, model_outputs,
                                    signature)
from autopar.plans import AxisRole, Plan
from autopar.runtime import materialize
from autopar.runtime import precision as mixed
from autopar.runtime.checks import (check_example_kwargs, check_loss, check_loss_reduction,
                                   check_micro_batching, check_optimizer)
from autopar.runtime.compiled_model import CompiledModel, state_aliases
from autopar.runtime.data_parallel import data_parallel, expert_data_parallel, stage_class
from autopar.runtime.rank_grid import (PipelineLayout, context_group, device_mesh, expert_meshes,
                                       pipeline_layout)
from autopar.runtime.schedule import build_schedule
from autopar.runtime.stage_state import broadcast_from_first_rank, hold_unread_buffers
from autopar.runtime.tied import TiedWeights
from autopar.plans.schedules import recompute_error, relay_error
from autopar.plans.zero import holds_weights_in_fsdp


def build_runtime(model: nn.Module, plan: Plan, *, example_inputs: tuple, loss_fn, optimizer,
                  example_kwargs: dict | None = None, device: torch.device | str | None = None,
                  graph=None, load_from=None, init=None, seed: int = 0,
                  sync_batchnorm: bool = False) -> CompiledModel:
    """This rank's CompiledModel for `plan`, by the steps of the module docstring. Call on every
    rank with the default process group up.

    `optimizer` is a function from a list of parameters to a torch.optim optimizer. `graph` is the
    model's capture for `example_inputs`: its export is reused when it was made for one micro-batch
    on real tensors (the stage's tensors come from `model` by name either way). `example_kwargs`
    are keyword arguments of the model's forward: constants (`use_cache=False`) are fixed in the
    exported program, tensors (an `attention_mask` for one micro-batch) are inputs given again at
    every step. A model on the meta device, or `load_from`/`init`, fill each
    rank's shards only (materialize.py); the plan's precision runs mixed precision (precision.py).
    Otherwise each stage starts from the values its first rank's `model` has (stage_state.py).
    `sync_batchnorm`: BatchNorm in training mode normalizes over the samples of all data-parallel
    replicas, not each replica's own (passes/batch_norm.py)."""
    example_kwargs = dict(example_kwargs or {})
    layout = check_inputs(model, plan, example_inputs, example_kwargs, load_from, init)
    device = torch.device(device or _default_device())
    meta = materialize.is_meta_model(model)
    sequence = example_inputs[0].shape[1] if layout.cp > 1 else 0
    exported, split = export_checked(model, plan, graph, example_inputs, example_kwargs, device,
                                     meta, sequence // layout.cp)
    # then the first collectives: the process groups
    mesh = device_mesh(layout, device)
    experts = expert_meshes(layout, plan, device)
    programs = rank_programs(exported, model, plan, layout, mesh, device, meta,
                             from_model=not meta and load_from is None and init is None,
                             sync_batchnorm=sync_batchnorm, expert_meshes=experts,
                             sequence_split=split)
    wrap_data_parallel(programs, plan, layout, mesh, experts)
    if meta or load_from is not None or init is not None:
        materialize.fill_stages([p.module for p in programs], model, device, load_from=load_from,
                                init=init, seed=seed)
    return compiled_model(model, plan, programs, layout, mesh, device, loss_fn=loss_fn,
                          optimizer=optimizer, example_kwargs=example_kwargs, sequence=sequence)


def export_checked(model: nn.Module, plan: Plan, graph, example_inputs: tuple, example_kwargs: dict,
                   device: torch.device, meta: bool, tokens: int):
    """Step 2: the program of one micro-batch (of a context-parallel rank's `tokens`), and what
    the sequence split rewrites (None without context parallelism), found against an export at
    another length (half the tokens, or twice under 4: passes/context_parallel.py says why); the
    model's MoE layers checked against the plan's expert parallelism."""
    exported = export_micro_batch(model, plan, graph, example_inputs, example_kwargs, device, meta,
                                  tokens=tokens or None)
    other = tokens // 2 if tokens >= 4 else 2 * tokens
    split = None if not tokens else find_sequence_split(
        exported, export_micro_batch(model, plan, None, example_inputs, example_kwargs, device,
                                     meta, tokens=other), plan.cp)
    check_expert_parallelism(exported, plan)
    return exported, split


def check_inputs(model: nn.Module, plan: Plan, example_inputs: tuple, example_kwargs: dict,
                 load_from, init) -> PipelineLayout:
    """Step 1: what was given, against the plan; the plan's rank grid when it all fits."""
    check_example_kwargs(example_kwargs, example_inputs)
    materialize.check_sources(model, load_from, init)
    mixed.check_precision(plan.precision)
    layout = pipeline_layout(plan)
    if dist.get_world_size() != layout.world_size:
        raise MeshError(f"the plan needs {layout.world_size} ranks (pp={layout.pp} x dp={layout.dp} x "
                        f"cp={layout.cp} x tp={layout.tp}) but {dist.get_world_size()} are running; "
                        f"launch {layout.world_size} ranks or plan for this world size")
    check_layers(model, plan)
    check_forms(plan, example_inputs, example_kwargs)
    return layout


def check_forms(plan: Plan, example_inputs: tuple, example_kwargs: dict) -> None:
    """Context parallelism and offload, as far as the inputs tell: a sequence that splits into
    2 x cp chunks and no keyword tensors (masks) to split with it; offload under ZeRO-3 only."""
    for stage in plan.stages:
        if stage.offload and stage.zero != 3:
            raise PlanMismatchError(f"stage {stage.index} offloads with ZeRO-{stage.zero}; offload "
                                    f"keeps ZeRO-3's shards, gradients and optimizer state on the "
                                    f"host: set zero=3")
    cp = plan.cp
    if cp == 1:
        return
    ids = example_inputs[0]
    if ids.dim() < 2:
        raise AutoparError(f"cp={cp} splits every sequence on dim 1 of the model's first input, "
                           f"which has shape {list(ids.shape)}; use cp=1")
    if ids.shape[1] % (2 * cp):
        raise AutoparError(f"cp={cp}: the sequence of {ids.shape[1]} tokens does not split into 2 x "
                           f"cp = {2 * cp} equal chunks (each rank holds chunks i and 2cp-1-i); use a "
                           f"sequence length divisible by {2 * cp}, or a cp with 2 x cp dividing "
                           f"{ids.shape[1]}")
    masks = [name for name, value in example_kwargs.items() if isinstance(value, torch.Tensor)]
    if masks:
        raise AutoparError(f"cp={cp} with the keyword tensors {masks}: autopar splits attention over "
                           f"the sequence without masks only (a padding mask would have to be split "
                           f"with every chunk pair of the ring); use cp=1, or pad-free sequences "
                           f"without an attention_mask")


def check_layers(model: nn.Module, plan: Plan) -> None:
    """Every layer the plan names is a module of `model`."""
    # a module reached under two names (T5's shared embedding) is a layer under either
    modules = dict(model.named_modules(remove_duplicate=False))
    missing = [path for stage in plan.stages for path in stage.layers if path not in modules]
    if missing:
        raise PlanMismatchError(f"the plan's layers {missing} are not modules of this "
                                f"{type(model).__name__}; the plan was made for another model, plan it again")


def export_micro_batch(model: nn.Module, plan: Plan, graph, example_inputs: tuple,
                       example_kwargs: dict, device: torch.device, meta: bool,
                       tokens: int | None = None) -> fx.GraphModule:
    """Step 2: the model's program for one micro-batch (the capture's when it was made so), whose
    tensors are `TensorRef`s, and whose tensor keyword inputs are those of `example_kwargs`;
    `tokens`: of that many tokens per sequence (a context-parallel rank's)."""
    program = graph.program if graph is not None and tokens is None \
        and _reusable(graph.program, example_inputs, plan) else None
    micro = tuple(_micro_batch(x, plan.micro_batch_size) for x in example_inputs)
    if tokens is not None:   # every input holds sequences on dim 1 (CompiledModel.step checks it)
        micro = tuple(_tokens(x, tokens) if isinstance(x, torch.Tensor) and x.dim() >= 2 else x
                      for x in micro)
    micro_kwargs = {name: _micro_batch(value, plan.micro_batch_size) if isinstance(value, torch.Tensor)
                    else value for name, value in example_kwargs.items()}
    if meta:    # exported on fake tensors, sharded on meta; then only local shards get storage
        program = materialize.export_meta_model(model, micro, micro_kwargs, device)
    elif program is None:
        program = torch.export.export(model, micro, micro_kwargs, strict=False)
    check_micro_batching(program, plan, graph)
    exported = export_for_pipeline(model, (), program)
    keywords = signature(exported)[1]
    tensors = [name for name, value in example_kwargs.items() if isinstance(value, torch.Tensor)]
    if sorted(keywords) != sorted(tensors):
        raise PlanMismatchError(f"the graph takes the keyword inputs {list(keywords)} but example_kwargs "
                                f"has the tensors {tensors}; capture the graph with the example_kwargs "
                                f"given to compile")
    return exported


def rank_programs(exported: fx.GraphModule, model: nn.Module, plan: Plan, layout: PipelineLayout,
                  mesh, device: torch.device, meta: bool = False, *, from_model: bool = False,
                  sync_batchnorm: bool = False, expert_meshes: dict | None = None,
                  sequence_split=None) -> list[StageProgram]:
    """Step 4: this rank's stages, in order. The export is cut into the plan's stages, each buffer
    of the model held by one; ours keep their own copy of only their tensors (`from_model`: the
    values of the stage's first rank), then are rewritten by the passes (tensor parallelism
    distributes whole tensors, so after the copy)."""
    cp_group, cp_rank = context_group(layout, dist.get_rank())
    target = PassTarget(tp_mesh=mesh["tp"] if layout.tp > 1 else None,
                        tp_axis=plan.axis_index(AxisRole.TENSOR) if layout.tp > 1 else None,
                        compute_dtype=mixed.compute_dtype(plan.precision),
                        batch_norm_group=mesh["dp"].get_group() if sync_batchnorm and layout.replicas > 1
                        else None, expert_meshes=expert_meshes or {}, cp_group=cp_group,
                        cp_rank=cp_rank, sequence_split=sequence_split, device=device)
    programs = split_model(exported, plan, target, blocks=_repeated_layers(model, plan))
    hold_unread_buffers(programs, model, [stage.layers for stage in plan.stages])
    # the planner never emits this (autopar.plans.stage_flow finds the same values); a plan
    # written by hand, or for other stages, may
    refusal = relay_error(plan.schedule, programs[0].relayed) \
        or recompute_error(plan.schedule, [stage.recompute for stage in plan.stages])
    if refusal is not None:
        raise AutoparError(refusal)
    mine = [copy_tensors(programs[s], model, device, meta) for s in layout.own_stages(dist.get_rank())]
    if from_model:
        for program in mine:
            broadcast_from_first_rank(program.module, mesh)
    return [run_passes(program, plan, target) for program in mine]


def wrap_data_parallel(programs: list[StageProgram], plan: Plan, layout: PipelineLayout, mesh,
                       expert_meshes: dict | None = None) -> None:
    """Step 5: plain data parallelism or ZeRO over the dp x cp ranks of the same weights, after
    the passes: FSDP2 shards what tensor parallelism left. Split experts first, over the ranks
    that hold the same experts. An offloaded stage is wrapped on a single replica too: FSDP2 is
    what moves its states to the host."""
    with unset_fake_temporarily():
        # FSDP2 builds device meshes (host data) from these; a meta model's tensors stay on meta
        # until step 6, even when a fake tensor mode is active (autopar simulate)
        _wrap_stages(programs, plan, layout, mesh, expert_meshes)


def _wrap_stages(programs: list[StageProgram], plan: Plan, layout: PipelineLayout, mesh,
                 expert_meshes: dict | None) -> None:
    for program in programs:
        stage = plan.stages[program.index]
        wrapped = holds_weights_in_fsdp(replicas=layout.replicas, offload=stage.offload,
                                        precision=plan.precision)
        if stage.ep > 1:
            expert_data_parallel(program.module, stage.zero, plan.schedule,
                                 expert_meshes[stage.ep]["edp"], wrapped,
                                 mixed.mp_policy(plan.precision), offload=stage.offload)
        if wrapped:
            data_parallel(program.module, stage.zero, plan.schedule, mesh["dp"],
                          mixed.mp_policy(plan.precision), offload=stage.offload)


def compiled_model(model: nn.Module, plan: Plan, programs: list[StageProgram], layout: PipelineLayout,
                   mesh, device: torch.device, *, loss_fn, optimizer,
                   example_kwargs: dict, sequence: int = 0) -> CompiledModel:
    """Step 7: the stages under the plan's precision, the weights tied across them, the schedule of
    the micro-batches and the optimizer on this rank's parameters."""
    for p in programs:  # compute under autocast (FSDP2 casts the parameters it gathers)
        mixed.autocast_stage(p.module, device, plan.precision)
    loss_fn = mixed.autocast_loss(loss_fn, device, plan.precision)
    scaler = mixed.loss_scaler(plan.precision, device)
    tied = TiedWeights(programs, layout.stage_rank, layout.grid, mesh.get_group("pp"),
                       zero=[stage.zero for stage in plan.stages], dp=layout.replicas)
    # the split's record of what each stage takes and returns spares torch a forward to learn it
    stages = None if len(plan.stages) == 1 else [
        stage_class(plan, p.index, layout.replicas)(
            p.module, p.index, len(plan.stages), device, input_args=p.example_inputs,
            output_args=p.example_outputs, group=mesh.get_group("pp")) for p in programs]
    out_spec = programs[0].out_spec     # the last stage returns the model's outputs flat
    schedule = build_schedule(plan, layout.stage_rank, layout.pp, [p.module for p in programs], stages,
                              mixed.scaled_loss(_checked_loss(loss_fn, out_spec), scaler))
    params = [p for program in programs for p in program.module.parameters()]
    return CompiledModel(plan=plan, layout=layout, mesh=mesh, programs=programs, schedule=schedule,
                         optimizer=check_optimizer(optimizer(params)), device=device,
                         state_aliases=state_aliases(model), tied=tied, example_kwargs=example_kwargs,
                         scaler=scaler, sequence=sequence)


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


def _repeated_layers(model: nn.Module, plan: Plan) -> set[str]:
    """The plan's layers that are elements of a ModuleList or Sequential: the repeated blocks."""
    found = set()
    for layer in (layer for stage in plan.stages for layer in stage.layers):
        parent, _, index = layer.rpartition(".")
        if index.isdigit() and isinstance(model.get_submodule(parent), (nn.ModuleList, nn.Sequential)):
            found.add(layer)
    return found


def copy_tensors(program: StageProgram, model: nn.Module, device: torch.device,
                 meta: bool = False) -> StageProgram:
    """The stage's own copy of its tensors, from the model by name, on its device: nothing is shared
    with the caller's model, and nothing of other stages is kept. For a meta model the copies stay
    on meta (shapes only) until the sharding is done (materialize.fill_stages)."""
    for ref in program.module.modules():
        if isinstance(ref, TensorRef):
            source = materialize.model_tensor(model, ref.fqn)
            # constants the export lifted out of the forward are not the model's attributes
            source = ref.value if source is None else source
            if meta and source is not ref.value:    # constants keep the export's values
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


def _tokens(tensor: torch.Tensor, tokens: int) -> torch.Tensor:
    """`tensor`'s sequences cut or repeated to `tokens` on dim 1 (only shapes matter to an export)."""
    repeats = -(-tokens // tensor.shape[1])
    return tensor.repeat(1, repeats, *([1] * (tensor.dim() - 2)))[:, :tokens]


def _micro_batch(tensor: torch.Tensor, size: int) -> torch.Tensor:
    if tensor.shape[0] >= size:
        return tensor[:size]
    repeats = -(-size // tensor.shape[0])
    return tensor.repeat(repeats, *([1] * (tensor.dim() - 1)))[:size]


def _reusable(program, example_inputs: tuple, plan: Plan) -> bool:
    """A capture can be cut into stages when it was made for one micro-batch and on real tensors:
    ops that create tensors (a position `arange`) keep the device they were traced on, meta too."""
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor) and x.dim() > 0]
    if program is None or not tensors or tensors[0].shape[0] != plan.micro_batch_size:
        return False
    return not any(t.is_meta for t in [*tensors, *program.state_dict.values()])


def _default_device() -> torch.device:
    """This rank's GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
