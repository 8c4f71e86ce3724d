"""The user's entry points: `autopar.plan` (offline planning) and `autopar.compile` (running a plan).

Planning needs no GPU and no process group: the model is captured on fake or meta tensors, priced
on the mesh's device specs, and the result is a `Plan` that can be saved, read and compared.
"""

from __future__ import annotations

import datetime
import os
import re
import time
from collections.abc import Callable

from autopar.errors import AutoparError, MeshError
from autopar.plans.vocabulary import TIME_LIMIT_S

# ---------------------------------------------------------------------------------------------
# Planning: autopar.plan, autopar.plan_from_config
# ---------------------------------------------------------------------------------------------

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


# A device memory outside these bounds is a mistake of units ("0.5" meant GiB, "1e400" is not
# a size), not a limit: refused rather than read as "nothing fits" or "no limit".
MIN_MEMORY = 2**10
MAX_MEMORY = 2**60
# Bounds of planning: far beyond any real run, and what keeps a typo from searching for hours.
MAX_GLOBAL_BATCH = 2**24
MAX_TIME_LIMIT = 7 * 24 * 3600.0
# Beyond the search's time limit, what planning on rank 0 may take: the intra-op ILP's own minimum
# time, building the Plan, pickling it.
PLAN_BROADCAST_SLACK_S = 120.0


def parse_bytes(text: str | int | float) -> int:
    """A memory size: an int of bytes, or "80GiB", "40GB", "512MiB", "1e9"."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), ""
    elif isinstance(text, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", text)
        if not match or match.group(2).lower() not in _UNITS:
            raise AutoparError(f"memory size {text!r} is not understood: write bytes or a number with "
                               f"a unit such as 80GiB, 40GB, 512MiB")
        value, unit = float(match.group(1)), match.group(2).lower()
    else:
        raise AutoparError(f"memory size {text!r} is not understood: give bytes or a string such as "
                           f"'80GiB'")
    nbytes = value * _UNITS[unit]
    if not MIN_MEMORY <= nbytes <= MAX_MEMORY:   # NaN fails both comparisons
        raise AutoparError(f"memory size {text!r} is {nbytes:g} bytes; a device's memory is positive, "
                           f"from 1 KiB to 1 EiB: write it with a unit, e.g. 80GiB")
    return int(nbytes)


def check_planning(global_batch, time_limit, memory_limit) -> int | None:
    """Planning arguments checked before any work; returns the memory limit in bytes (or None)."""
    if not isinstance(global_batch, int) or isinstance(global_batch, bool) or not (
            1 <= global_batch <= MAX_GLOBAL_BATCH):
        raise AutoparError(f"global_batch={global_batch!r} must be an integer from 1 to "
                           f"{MAX_GLOBAL_BATCH} (sequences per optimizer step over all replicas)")
    if (not isinstance(time_limit, (int, float)) or isinstance(time_limit, bool)
            or not 0 < time_limit <= MAX_TIME_LIMIT):
        raise AutoparError(f"time_limit={time_limit!r} must be a number of seconds above 0 and at most "
                           f"{MAX_TIME_LIMIT:.0f} (a week)")
    return None if memory_limit is None else parse_bytes(memory_limit)


def _as_mesh(mesh):
    from autopar.cost.mesh import Mesh
    from autopar.errors import MeshError

    if isinstance(mesh, str):
        return Mesh.parse(mesh)
    if not isinstance(mesh, Mesh):
        raise MeshError(f"mesh {mesh!r} is neither an autopar.Mesh nor a spec such as '4:cpu' or "
                        f"'2x8:a100-80g'")
    return mesh


def plan(model, mesh, *, example_inputs: tuple, global_batch: int, memory_limit=None,
         time_limit: float = TIME_LIMIT_S, example_kwargs: dict | None = None,
         progress: Callable[[str, int, int], None] | None = None, precision: str | None = None,
         calibration=None):
    """Plan `model` for `mesh` (a Mesh or a spec such as "128x8:a100-80g") and return a Plan.

    `example_inputs` are ONE micro-batch's inputs (meta or fake tensors are fine: nothing runs);
    `global_batch` the sequences per optimizer step over all replicas; `memory_limit` bytes per
    device or a size such as "80GiB" (default: the device's memory); `time_limit` seconds for all
    of planning, capture included. `progress(phase, done, total)` is called as the search goes.
    `precision` "bf16", "fp16" or "fp32" is what the plan is priced and run at (default: the
    device's training dtype, bf16 on GPUs, fp32 on CPUs). `calibration`, a file from `autopar
    calibrate`, prices the candidates with what it measured instead of the published figures."""
    from autopar.tracer import capture

    check_planning(global_batch, time_limit, memory_limit)
    check_precision(precision)
    check_example_tuple(example_inputs)
    mesh = _as_mesh(mesh)
    started = time.monotonic()
    graph = capture(model, example_inputs=example_inputs, example_kwargs=example_kwargs)
    return plan_graph(graph, mesh, global_batch=global_batch, memory_limit=memory_limit,
                      time_limit=remaining_time(time_limit, started), progress=progress,
                      precision=precision, calibration=calibration)


def remaining_time(time_limit: float, started: float) -> float:
    """What is left of `time_limit` for the search after the work since `started` (capture)."""
    left = time_limit - (time.monotonic() - started)
    if left <= 0:
        raise AutoparError(f"capturing the model took {time.monotonic() - started:.1f} s, all of the "
                           f"time_limit of {time_limit:g} s; raise time_limit")
    return left


def plan_graph(graph, mesh, *, global_batch: int, memory_limit=None, time_limit: float = TIME_LIMIT_S,
               progress: Callable[[str, int, int], None] | None = None, precision: str | None = None,
               calibration=None):
    """`plan` for an already captured Graph."""
    from autopar.solver.planner import plan_graph as search

    limit = check_planning(global_batch, time_limit, memory_limit)
    check_precision(precision)
    return search(graph, _as_mesh(mesh), global_batch=global_batch, memory_limit=limit,
                  time_limit=time_limit, progress=progress, precision=precision,
                  calibration=calibration)


def plan_from_config(graph, mesh, config, *, memory_limit=None, time_limit: float = TIME_LIMIT_S,
                     precision: str | None = None, calibration=None):
    """A forced Megatron-style `Config` as a Plan: uniform stages, the estimator's predictions, and
    per-op placements from the ILP with the config's roles (data axis, tensor axis), both priced
    with `calibration` (a file from `autopar calibrate`) when one is given."""
    from autopar.solver.planner import plan_config

    limit = None if memory_limit is None else parse_bytes(memory_limit)
    check_precision(precision)
    return plan_config(graph, _as_mesh(mesh), config, memory_limit=limit, time_limit=time_limit,
                       precision=precision, calibration=calibration)


def check_precision(precision: str | None) -> None:
    """None (the plan's or the device's precision) or one a plan can record."""
    from autopar.plans.vocabulary import PRECISIONS

    if precision is not None and precision not in PRECISIONS:
        raise AutoparError(f"precision={precision!r} is not one of {', '.join(PRECISIONS)}; use "
                           f"'bf16' (or 'fp16' where bf16 is not supported) for mixed precision")


# ---------------------------------------------------------------------------------------------
# Running: autopar.compile
# ---------------------------------------------------------------------------------------------


def compile(model, mesh, *, example_inputs: tuple, loss_fn, optimizer, example_kwargs: dict | None = None,
            global_batch: int | None = None, memory_limit=None, plan=None, time_limit: float = TIME_LIMIT_S,
            graph=None, precision: str | None = None, load_from=None, init=None, seed: int = 0,
            calibration=None, sync_batchnorm: bool = False):
    """Train `model` on this process's rank of `mesh` under a plan; returns a `CompiledModel`.

    `plan` is a Plan, a path to a saved one, a forced `Config`, or None: then rank 0 plans (for
    `global_batch`, default the example batch) and every rank receives the same plan.
    `optimizer(params)` builds any torch.optim optimizer; it steps on this rank's local shards.
    `loss_fn(outputs, targets)` must average over the batch, as a mean-reduced loss does.
    Every rank starts from rank 0's parameter values (broadcast into `model`, as torch's DDP does)
    and trains its own shards of them; `full_state_dict()` gathers them. Every rank calls it; mistakes (a mesh that is not the process group, a plan for another
    model, a batch the data-parallel degree does not divide) raise on every rank before any
    collective. `graph`: this model's `autopar.capture` for these example inputs, to skip capturing
    it again (after planning, or to compile one model several ways).
    `precision`: "bf16" or "fp16" computes in 16 bits with fp32 master weights and optimizer state
    (fp16 with dynamic loss scaling), "fp32" in fp32; the plan is priced at it (planned at it, or a
    given plan priced again) and records it. Default: the plan's, which is the device's training
    dtype for a plan made here (fp32 on CPUs, bf16 on GPUs).
    A model built under `torch.device("meta")` is never materialized whole: each rank allocates its
    own shards and fills them from `load_from` (a safetensors file, a directory of safetensors
    shards or a DCP checkpoint; names as in model.state_dict()) or `init(module)` (applied like
    model.apply, seeded per module name from `seed`: the same values under every plan).
    `load_from`/`init` also overwrite a real model's values.
    `calibration`: a file from `autopar calibrate` that the planner prices and places with (a free
    plan or a forced `Config`).
    BatchNorm in training mode follows DDP: each data-parallel replica normalizes over its own
    samples and keeps its own running statistics (`full_state_dict()` and checkpoints hold the
    first replica's); `sync_batchnorm=True` normalizes over the samples of all replicas, as
    torch.nn.SyncBatchNorm does, which trains exactly as one process on the global batch. Such
    models run one micro-batch per replica (more would normalize over fewer samples): a free plan
    does so, and a plan with more micro-batches is refused."""
    from autopar.tracer import capture
    from autopar.runtime.build import build_runtime
    from autopar.solver.planner import at_precision

    # Every argument first: a mistake is named before any process group or collective.
    mesh = _as_mesh(mesh)
    _check_training(model, example_inputs, loss_fn, optimizer, example_kwargs)
    plan = _checked_plan_arguments(plan, global_batch, time_limit, memory_limit, precision)
    _check_model_arguments(model, load_from, init, seed, sync_batchnorm)
    _join_process_group(mesh)
    example_inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    example_kwargs = dict(example_kwargs or {})
    if graph is None:
        graph = capture(model, example_inputs=example_inputs, example_kwargs=example_kwargs)
    plan = _plan_to_run(graph, mesh, plan, global_batch or example_inputs[0].shape[0],
                        memory_limit=memory_limit, time_limit=time_limit, precision=precision,
                        calibration=calibration)
    _check_global_batch(plan, global_batch)
    if precision is not None:
        # a given plan's predictions are of its own precision: priced again at this one
        plan = at_precision(graph, plan, precision)
    # One runtime: splitting into stages is the first lowering step; a single-stage plan is one stage.
    return build_runtime(model, plan, graph=graph, example_inputs=example_inputs,
                         example_kwargs=example_kwargs, loss_fn=loss_fn, optimizer=optimizer,
                         load_from=load_from, init=init, seed=seed, sync_batchnorm=sync_batchnorm)


def _checked_plan_arguments(plan, global_batch, time_limit, memory_limit, precision):
    """The plan as compile takes it (a file read, a Plan checked as one read from JSON, a
    Config), after the planning arguments are checked."""
    from autopar.cost.config import Config

    check_precision(precision)
    if plan is None:
        check_planning(global_batch or 1, time_limit, memory_limit)
    elif global_batch is not None:
        check_planning(global_batch, time_limit, None)
    return plan if plan is None or isinstance(plan, Config) else _load_plan(plan)


def _check_model_arguments(model, load_from, init, seed, sync_batchnorm) -> None:
    """Where the model's values come from, and how BatchNorm normalizes."""
    from autopar.runtime.materialize import check_sources

    if not isinstance(sync_batchnorm, bool):
        raise AutoparError(f"sync_batchnorm must be True or False, got {sync_batchnorm!r}")
    check_sources(model, load_from, init)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise AutoparError(f"seed={seed!r} must be an integer (it seeds init= per module)")


def _plan_to_run(graph, mesh, plan, batch: int, *, memory_limit, time_limit: float,
                 precision: str | None, calibration):
    """The plan `compile` runs: a forced Config planned (`plan_from_config`), none planned freely
    on rank 0 for `batch`, or a given one loaded; checked against the graph."""
    from autopar.cost.config import Config

    if isinstance(plan, Config):
        plan = _plan_for_config(graph, mesh, plan, time_limit, precision, calibration)
    elif plan is None:
        plan = _plan_freely(graph, mesh, batch, memory_limit, time_limit, precision, calibration)
    plan.check_graph(graph.fingerprint())
    return plan


# What torch's env:// rendezvous reads; torchrun and autopar.launch set them for every rank.
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _start_ranks(mesh) -> None:
    """The default process group: from a launcher's environment (torchrun, autopar.launch), or,
    in a process no launcher started, a world of this one process when the mesh has one device.
    A larger mesh needs one process per device, which only a launcher starts."""
    import torch.distributed as dist

    from autopar.runtime.launch import init_default_group

    backend = "gloo" if mesh.device.name == "cpu" else "nccl"
    missing = [name for name in LAUNCHER_VARIABLES if name not in os.environ]
    if not missing:
        # from torchrun's environment, safe across its restarts (launch.init_default_group)
        init_default_group(backend)
    elif len(missing) < len(LAUNCHER_VARIABLES):
        raise AutoparError(f"this process has {', '.join(n for n in LAUNCHER_VARIABLES if n not in missing)} "
                           f"in its environment but not {', '.join(missing)}: start it with torchrun "
                           f"or autopar.launch, which set all of them")
    elif mesh.world_size == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    else:
        raise AutoparError(
            f"mesh {mesh} has {mesh.world_size} devices, one process each, but this process was not "
            f"started by a launcher (no {', '.join(LAUNCHER_VARIABLES)} in its environment): run "
            f"the script with `torchrun --nproc-per-node {mesh.world_size} script.py`, or call "
            f"autopar.launch(train, {mesh.world_size}, ...) with a function that compiles and trains; "
            f"a mesh of one device (\"1:{mesh.device.name}\") runs in this process")


def _join_process_group(mesh) -> None:
    """This rank's GPU and the default process group (`_start_ranks`), checked to have the mesh's
    size."""
    import torch.distributed as dist

    if mesh.device.name != "cpu":
        _use_local_gpu(mesh)
    if not dist.is_initialized():
        _start_ranks(mesh)
    if mesh.world_size != dist.get_world_size():
        raise MeshError(f"mesh {mesh} has {mesh.world_size} devices but the process group has "
                        f"{dist.get_world_size()} ranks; start {mesh.world_size} processes or use a "
                        f"mesh of {dist.get_world_size()}")


def _use_local_gpu(mesh) -> None:
    """Make this rank's GPU the current device (torchrun's LOCAL_RANK; the rank modulo the node's
    GPUs otherwise) before NCCL starts: the runtime puts the model and batches there."""
    import torch

    if not torch.cuda.is_available():
        raise MeshError(f"mesh {mesh} is a GPU mesh but this process sees no CUDA device; use a CPU "
                        f"mesh such as \"{mesh.world_size}:cpu\" or run where GPUs are visible")
    rank = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
    torch.cuda.set_device(rank % torch.cuda.device_count())


def _check_training(model, example_inputs, loss_fn, optimizer, example_kwargs) -> None:
    """What compile can refuse before building anything: the callables and the example inputs.
    What only a built model reveals (the optimizer's return value, the loss's shape and
    reduction, buffers updated in forward) is checked by autopar.runtime.checks."""
    import torch

    from autopar.runtime.checks import check_example_kwargs

    if not isinstance(model, torch.nn.Module):
        raise AutoparError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(optimizer) or isinstance(optimizer, torch.optim.Optimizer):
        raise AutoparError(f"optimizer must be a function of the parameters that builds an optimizer, "
                           f"e.g. optimizer=lambda params: torch.optim.AdamW(params, lr=3e-4); got "
                           f"{type(optimizer).__name__}. An optimizer already built holds the "
                           f"unsharded parameters, which each rank does not train")
    if not callable(loss_fn):
        raise AutoparError(f"loss_fn must be a function loss_fn(outputs, targets) -> scalar tensor; "
                           f"got {type(loss_fn).__name__}")
    check_example_tuple(example_inputs)
    inputs = example_inputs
    if not inputs or not isinstance(inputs[0], torch.Tensor) or inputs[0].dim() == 0:
        raise AutoparError("example_inputs must start with a tensor whose first dimension is the "
                           "batch (one micro-batch's inputs), e.g. example_inputs=(ids,)")
    if example_kwargs is not None and not isinstance(example_kwargs, dict):
        raise AutoparError(f"example_kwargs must be a dict of the forward's keyword arguments, got "
                           f"{type(example_kwargs).__name__}")
    check_example_kwargs(dict(example_kwargs or {}), inputs)


def check_example_tuple(example_inputs) -> None:
    if not isinstance(example_inputs, tuple):
        raise AutoparError(f"example_inputs must be a tuple of the forward's positional inputs for one "
                           f"micro-batch, e.g. example_inputs=(ids,); got a {type(example_inputs).__name__}")


def _load_plan(plan):
    """A Plan, or one read from a file; either way its values checked by the plan package (a
    plan made or edited in code is checked as one read from JSON is)."""
    from autopar.plans import Plan

    if isinstance(plan, Plan):
        Plan.from_dict(plan.to_dict())
        return plan
    if not isinstance(plan, (str, os.PathLike)):
        raise AutoparError(f"plan={plan!r} is not a plan: pass an autopar.Plan, a path to a saved plan "
                           f"(plan.json), a forced autopar.Config, or None to plan here")
    return Plan.load(plan)


def _plan_for_config(graph, mesh, config, time_limit, precision, calibration):
    """A forced configuration as the planner places it (the ILP with the config's axis roles, the
    same placements a free plan of that shape gets), made on rank 0."""
    return _plan_on_rank0(lambda: plan_from_config(graph, mesh, config, time_limit=time_limit,
                                                   precision=precision, calibration=calibration),
                          time_limit)


def _plan_freely(graph, mesh, global_batch, memory_limit, time_limit, precision, calibration):
    return _plan_on_rank0(lambda: plan_graph(graph, mesh, global_batch=global_batch, memory_limit=memory_limit,
                                             time_limit=time_limit, precision=precision,
                                             calibration=calibration), time_limit)


def _plan_on_rank0(make_plan, time_limit):
    """Rank 0 plans and broadcasts: every rank runs the identical plan (a solver with a time limit
    may answer differently on different ranks). A planning error is raised on every rank."""
    import torch.distributed as dist

    from autopar.plans import Plan

    # The other ranks wait for rank 0's whole search: on a group whose timeout outlasts the time
    # limit, or a short default timeout (a launcher's, torchrun's) would fail them mid-search.
    waiting = dist.new_group(timeout=datetime.timedelta(seconds=time_limit + PLAN_BROADCAST_SLACK_S))
    message = [None]
    if dist.get_rank() == 0:
        try:
            message[0] = ("plan", make_plan().to_dict())
        except AutoparError as err:   # sent to the other ranks, then raised here too
            message[0] = ("error", err)
    dist.broadcast_object_list(message, src=0, group=waiting)
    # The group is left to the default group's teardown: destroying it here, while a peer's gloo
    # threads may still be finishing the broadcast, can abort a process at exit.
    kind, payload = message[0]
    if kind == "error":
        raise payload
    return Plan.from_dict(payload)


def _check_global_batch(plan, global_batch) -> None:
    """The caller's global batch against the plan's (whose split into dp x micro-batches x
    micro-batch size the plan package checked when it read the plan)."""
    if global_batch is not None and global_batch != plan.global_batch:
        raise AutoparError(f"global_batch={global_batch} but the plan was made for {plan.global_batch}; "
                           f"plan again for {global_batch} or pass the plan's batch")
