"""From a captured graph and a mesh to a Plan: the inter-op search, then per-op placements.

`plan_graph` runs the search of autopar.solver.search under a time limit, whose pricer asks the
intra-op ILP for the placements of every parameter and node on the tensor-parallel axis of each
dp x tp sub-mesh it prices (once per degree) and prices candidates on them; the chosen one's are the
plan's. The data-parallel axis splits the batch (and ZeRO-3 parameters) by the plan's decision.
All stages share that sub-mesh shape and the ILP ties repeated blocks, so one solve covers every
stage: solving scales with distinct blocks, not layers.
`plan_config` turns a forced Megatron-style Config into a Plan the same way. Both price at a
precision (bf16, fp16, fp32; the device's training dtype by default), which the plan records;
`at_precision` prices a made plan again at another.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from functools import cache

from autopar.plans.vocabulary import TIME_LIMIT_S
from autopar.cost.calibration import calibrated
from autopar.cost.config import Config
from autopar.cost.estimator import default_precision
from autopar.cost.expert_layers import expert_layers
from autopar.cost.context import sequence_split_error
from autopar.cost.layout import graph_sequence
from autopar.cost.plan_estimate import estimate_plan
from autopar.cost.stages import blocks_per_chunk
from autopar.cost.mesh import Mesh
from autopar.errors import AutoparError, InfeasibleError, format_bytes
from autopar.graph import Graph, Role
from autopar.plans import AxisRole, Plan, Stage
from autopar.solver.candidate_prices import CandidatePricer, chunk_layers
from autopar.solver.candidates import (MAX_TP, Candidate, Priced, Shape, autopar_shapes, balanced_cuts,
                                       context_shapes, layout_error, megatron_shapes, module_shapes,
                                       pipeline_units, short_pipeline_shapes, uniform_cuts,
                                       unit_weights, with_expert_degrees)
from autopar.solver.search import (Search, context_phase, grid_phase, offload_phase, refine,
                                   uneven_phase)
from autopar.plans.stage_flow import skipping_pairs
from autopar.timeline import plan_timeline

REFINED_SHAPES = 3          # the best distinct device layouts that the local search starts from
REFINING_SHARE = 0.15       # of the time left for the search, what its phases leave to the local search
Progress = Callable[[str, int, int], None]


def plan_graph(graph: Graph, mesh: Mesh, *, global_batch: int, memory_limit: float | None = None,
               time_limit: float = TIME_LIMIT_S, progress: Progress | None = None,
               precision: str | None = None, calibration=None) -> Plan:
    return plan_and_search(graph, mesh, global_batch=global_batch, memory_limit=memory_limit,
                           time_limit=time_limit, progress=progress, precision=precision,
                           calibration=calibration)[0]


def plan_and_search(graph: Graph, mesh: Mesh, *, global_batch: int, memory_limit: float | None = None,
                    time_limit: float = TIME_LIMIT_S, progress: Progress | None = None,
                    precision: str | None = None, calibration=None) -> tuple[Plan, Search]:
    """The plan and the search that found it (its priced candidates, for benchmarks). With a
    `calibration` file (`autopar calibrate`), candidates are priced with its efficiencies and, where
    it measured them, its links (which the plan's mesh then carries); the plan names the file."""
    started = time.monotonic()
    efficiencies = None
    if calibration is not None:
        mesh, efficiencies = calibrated(mesh, None, calibration)
    search = search_pipeline(graph, mesh, global_batch=global_batch, memory_limit=memory_limit,
                             deadline=started + time_limit, progress=progress, precision=precision,
                             efficiencies=efficiencies)
    inter_seconds = time.monotonic() - started
    _report(progress, "placements", 3, 3)
    status = "time_limit" if search.timed_out else "searched"
    refused = search.pricer.refusals
    plan = _assemble(graph, mesh, search.best, search.units, global_batch=global_batch, solver={
        "seconds": inter_seconds, "status": status, "gap": None, "candidates": search.priced,
        "refused": sum(refused.values()),
        "refusal_reasons": dict(sorted(refused.items(), key=lambda kv: -kv[1])[:5]),
        **({"calibration": str(calibration)} if calibration is not None else {})},
        pricer=search.pricer)
    return plan, search


def search_pipeline(graph: Graph, mesh: Mesh, *, global_batch: int, memory_limit: float | None,
                    deadline: float, progress: Progress | None = None,
                    precision: str | None = None, efficiencies=None) -> Search:
    """The inter-op search alone; `search.best` is the fastest candidate that fits."""
    limit = memory_limit or mesh.device.memory_bytes
    search = new_search(graph, mesh, global_batch, limit, deadline, precision, efficiencies)
    # the phases stop early enough to leave the refinement of their best layouts a share of the
    # time: its moves are few and cheap, and a search cut short needs them most
    search.deadline = deadline - REFINING_SHARE * max(0.0, deadline - time.monotonic())
    weights_for = cache(lambda tp: unit_weights(graph, search.units, mesh, tp))
    blocks = sum(1 for unit in search.units if unit.block)
    whole = search.coupling is not None
    grid = with_expert_degrees(megatron_shapes(blocks, mesh.world_size, mesh.gpus_per_node, global_batch,
                                               whole_batch=whole), search.experts, mesh.gpus_per_node)
    _report(progress, "Megatron grid", 0, 3)
    # ZeRO-1 moves the bytes of ZeRO-0's all-reduce (reduce-scatter, then all-gather) and steps
    # the optimizer on 1/dp of the parameters: never slower, less memory. The grid's ZeRO-0 points
    # are therefore dominated and skipped here (refinement still tries ZeRO 0). ZeRO-2 and -3 are
    # candidates wherever there is data parallelism: they fit where less sharding does not, and
    # the estimator decides whether their extra collectives cost time.
    grid_phase(search, grid, zero_levels=(1, 2, 3))
    _report(progress, "uneven stages", 1, 3)
    # a model without repeated blocks is cut between its modules (balanced by cost) at any depth
    uneven = autopar_shapes(blocks, mesh.world_size, mesh.gpus_per_node, global_batch, whole) if blocks \
        else module_shapes(len(search.units), mesh.world_size, mesh.gpus_per_node, global_batch, whole)
    uneven_phase(search, with_expert_degrees(uneven, search.experts, mesh.gpus_per_node), weights_for)
    # where activations bind: context parallelism, when the model's sequence can be split
    if blocks and sequence_split_error(graph) is None:
        context_phase(search, with_expert_degrees(
            context_shapes(blocks, mesh.world_size, mesh.gpus_per_node, global_batch,
                           graph_sequence(graph), whole), search.experts, mesh.gpus_per_node))
    if search.best is None:
        # a pipeline with fewer micro-batches than stages (GPipe only) is all bubble: tried
        # only when nothing else fits
        short = short_pipeline_shapes(blocks or len(search.units), mesh.world_size,
                                      mesh.gpus_per_node, global_batch, whole)
        uneven_phase(search, with_expert_degrees(short, search.experts, mesh.gpus_per_node),
                     weights_for)
    # then the model's states on the host
    offload_phase(search, grid)
    _report(progress, "refining", 2, 3)
    search.deadline = deadline
    for seed in _seeds(search):
        refine(search, seed, weights_for)
    if search.best is None:
        raise infeasible(search, limit)
    return search


def plan_config(graph: Graph, mesh: Mesh, config: Config, *, memory_limit: float | None = None,
                time_limit: float = TIME_LIMIT_S, precision: str | None = None, calibration=None) -> Plan:
    """A forced uniform configuration as a Plan, priced by `estimate`, placements by the ILP; with
    a `calibration` file both use what it measured, as a free plan's do (`plan_and_search`)."""
    started = time.monotonic()
    efficiencies = None
    if calibration is not None:
        mesh, efficiencies = calibrated(mesh, None, calibration)
    if config.world_size != mesh.world_size:
        raise AutoparError(f"config tp x cp x pp x dp = {config.tp} x {config.cp} x {config.pp} x "
                           f"{config.dp} = {config.world_size} devices, but mesh {mesh} has "
                           f"{mesh.world_size}")
    if config.tp > mesh.gpus_per_node or mesh.gpus_per_node % config.tp:
        raise AutoparError(f"tp={config.tp} must divide the {mesh.gpus_per_node} devices of a node: "
                           f"tensor parallelism stays inside a node")
    limit = memory_limit or mesh.device.memory_bytes
    # the config's sequence parallelism is the placements' (the ILP's is free in a free plan)
    search = new_search(graph, mesh, config.global_batch, limit, started + time_limit, precision,
                        efficiencies, config.sequence_parallel if config.tp > 1 else None)
    # Megatron's uniform stages over repeated blocks; a model without them cut between modules
    uniform = any(unit.block for unit in search.units)
    cuts = _megatron_cuts(search.units, config.pp * config.virtual) if uniform else \
        _module_cuts(graph, mesh, search.units, config)
    chunks = len(cuts) - 1
    shape = Shape(config.tp, config.pp, config.dp, config.micro_batch, config.schedule,
                  config.virtual, config.sequence_parallel, ep=config.ep, cp=config.cp,
                  cp_kind=config.cp_kind, offload=config.offload)
    candidate = Candidate(shape, cuts, (config.recompute,) * chunks, (config.zero,) * chunks)
    error = layout_error(shape, config.global_batch, search.coupling) or search.relay_error(candidate)
    if error is not None:
        raise AutoparError(f"autopar cannot run {config}: {error}")
    priced = search.price(candidate, uniform=uniform)
    if priced is None:
        # the one candidate priced: its refusal is the only reason recorded
        reason = next(iter(search.pricer.refusals), "check the degrees against the model's heads "
                                                     "and hidden size")
        raise AutoparError(f"autopar cannot plan {config}: {reason}")
    return _assemble(graph, mesh, priced, search.units, global_batch=config.global_batch, solver={
        "seconds": time.monotonic() - started, "status": "forced", "gap": 0.0, "candidates": 1,
        **({"calibration": str(calibration)} if calibration is not None else {})},
        pricer=search.pricer)


def _megatron_cuts(units, chunks: int) -> tuple[int, ...]:
    """The cuts `estimate` prices a Config with (cost.stages.blocks_per_chunk: even where the
    blocks divide, the extra blocks in the middle chunks where not), the embedding with the first
    chunk and the head with the last, so that the forced plan's stages are the ones priced."""
    cuts = uniform_cuts(units, chunks)
    if cuts is not None:
        return cuts
    head = 1 if units[0].name == "embedding" else 0
    blocks = sum(1 for unit in units if unit.block)
    if blocks < chunks:
        if len(units) < chunks:
            raise AutoparError(f"{len(units)} units (embedding, blocks, head) cannot fill {chunks} "
                               f"pipeline chunks; use at most {len(units)}")
        # Megatron's accounting of the embedding and the loss as layers (cost.stages.uniform_stages):
        # a unit a chunk, what is left with the last
        return (*range(chunks), len(units))
    counts = blocks_per_chunk(blocks, chunks)
    inner = [head + sum(counts[:c]) for c in range(1, chunks)]
    return (0, *inner, len(units))


def _module_cuts(graph: Graph, mesh: Mesh, units, config: Config) -> tuple[int, ...]:
    """The stages of a model without repeated blocks: its modules cut where the pipeline's
    ranks get the most even compute (balanced_cuts), as a free plan's are."""
    chunks = config.pp * config.virtual
    cuts = balanced_cuts(unit_weights(graph, units, mesh, config.tp), chunks)
    if cuts is None:
        raise AutoparError(f"this model has no repeated blocks and {len(units)} modules that can "
                           f"stand as pipeline stages ({', '.join(u.name for u in units[:4])}), "
                           f"too few for {chunks} pipeline chunks; use fewer stages")
    return cuts


def new_search(graph: Graph, mesh: Mesh, global_batch: int, limit: float, deadline: float,
               precision: str | None = None, efficiencies=None,
               sequence_parallel: bool | None = None) -> Search:
    if global_batch < 1:
        raise AutoparError(f"global batch {global_batch} must be at least 1")
    pricer = CandidatePricer(graph=graph, mesh=mesh, global_batch=global_batch, memory_limit=limit,
                    precision=precision, deadline=deadline, efficiencies=efficiencies,
                    sequence_parallel=sequence_parallel)
    units = pipeline_units(graph)
    return Search(pricer=pricer, units=units, deadline=deadline,
                  skipping=skipping_pairs(graph.flow_nodes(), [unit.layers for unit in units]),
                  coupling=graph.batch_coupling(),
                  experts=math.gcd(*(layer.experts for layer in expert_layers(graph))))


def _seeds(search: Search) -> list[Priced]:
    """The best candidate of each of the best few device layouts: the fastest that fit, or while
    none fits, those that need the least memory."""
    priced = search.candidates()
    fitting = [p for p in priced if p.fits]
    ranked = sorted(fitting, key=lambda p: p.step_time_s) if fitting else \
        sorted(priced, key=lambda p: p.memory_bytes)
    seeds: dict[tuple, Priced] = {}
    for candidate in ranked:
        shape = candidate.candidate.shape
        seeds.setdefault((shape.tp, shape.pp, shape.dp, shape.ep, shape.micro_batch, shape.virtual,
                          shape.cp, shape.offload), candidate)
        if len(seeds) == REFINED_SHAPES:
            break
    return list(seeds.values())


def _report(progress: Progress | None, phase: str, done: int, total: int) -> None:
    if progress is not None:
        progress(phase, done, total)


def _stage_predictions(graph: Graph, mesh: Mesh, priced: Priced, units, devices: list) -> list[dict]:
    """Each chunk's pipeline rank's predicted time and memory (the estimator prices ranks), and
    the chunk's own time per micro-batch: its rank's time shared among the rank's chunks in
    proportion to their roofline weights (what the timeline picture draws)."""
    candidate, pp = priced.candidate, priced.candidate.shape.pp
    weights = unit_weights(graph, units, mesh, candidate.shape.tp)
    chunk_weight = [sum(weights[candidate.cuts[c]:candidate.cuts[c + 1]]) for c in range(candidate.chunks)]
    predictions = []
    for c in range(candidate.chunks):
        siblings = chunk_weight[c % pp::pp]
        share = chunk_weight[c] / sum(siblings) if sum(siblings) else 1.0 / len(siblings)
        device = dict(devices[c % pp])
        predictions.append({**device,
                            "chunk_time_per_micro_batch_s": device["time_per_micro_batch_s"] * share})
    return predictions


def _data_placement(carries_batch: bool, node_shape: tuple) -> str:
    """On the data axis: batch-carrying tensors split on dim 0; a batch-carrying scalar (the
    loss) is each replica's partial value; everything else replicated."""
    if not carries_batch:
        return "R"
    return "S(0)" if node_shape else "P"


def _context_placement(carries_batch: bool, node_shape: tuple, sequence: int) -> str:
    """On the context-parallel axis: batch-carrying tensors split on their first dim of the
    sequence's length after the batch's; a batch-carrying scalar (the loss) is each rank's
    partial value; everything else replicated."""
    if not carries_batch:
        return "R"
    if not node_shape:
        return "P"
    dim = next((d for d, size in enumerate(node_shape) if d > 0 and size == sequence), None)
    return "R" if dim is None else f"S({dim})"


def _batch_nodes(graph: Graph) -> set[str]:
    """Nodes whose value depends on the inputs: the batch flows through them, so the data axis
    splits them (dim 0, where the models keep the batch); the rest derive from parameters alone."""
    carrying: set[str] = set()
    for node in graph.nodes:
        if node.role is Role.INPUT or any(name in carrying for name in node.inputs):
            carrying.add(node.name)
    return carrying


def _assemble(graph: Graph, mesh: Mesh, priced: Priced, units, *, global_batch: int, solver: dict,
              pricer: CandidatePricer) -> Plan:
    candidate, shape = priced.candidate, priced.candidate.shape
    tensor = pricer.tensor_axis(shape.tp)[0]
    group = shape.dp * shape.cp * shape.tp
    stages = [Stage(index=i, layers=chunk_layers(units, candidate, i),
                    ranks=list(range((i % shape.pp) * group, (i % shape.pp + 1) * group)),
                    tp=shape.tp, dp=shape.dp, recompute=candidate.recompute[i], zero=candidate.zero[i],
                    sequence_parallel=pricer.splits_stream(shape), ep=shape.ep, cp=shape.cp,
                    cp_kind=shape.cp_kind, offload=shape.offload)
              for i in range(candidate.chunks)]
    batch = _batch_nodes(graph)
    shapes = {n.name: n.shape for n in graph.nodes}
    # Megatron's rank order: tensor-parallel ranks innermost, then context-, then data-parallel
    context = [[AxisRole.CONTEXT, shape.cp]] if shape.cp > 1 else []
    sequence = graph_sequence(graph) if shape.cp > 1 else 0
    nodes = {name: [_data_placement(name in batch and shape.dp > 1, shapes.get(name, ())),
                    *[_context_placement(name in batch, shapes.get(name, ()), sequence)
                      for _ in context], *placements]
             for name, placements in tensor["nodes"].items()}
    parameters = _with_zero3({fqn: ["R", *["R" for _ in context], *placements]
                              for fqn, placements in tensor["parameters"].items()},
                             stages, {n.param_fqn: n.shape for n in graph.parameters})
    # the placements were solved while pricing (their seconds are in the search's)
    solver = {**solver, "intra_op": tensor["stats"]}
    plan = Plan(fingerprint=graph.fingerprint(), mesh=mesh.to_dict(),
                axes=[[AxisRole.DATA, shape.dp], *context, [AxisRole.TENSOR, shape.tp]], stages=stages,
                global_batch=global_batch, micro_batches=global_batch // (shape.dp * shape.micro_batch),
                micro_batch_size=shape.micro_batch, schedule=shape.schedule, virtual=shape.virtual,
                parameters=parameters, nodes=nodes, solver=solver,
                replicated_ops=tensor["replicated_ops"], model_type=graph.model_type,
                # what the estimator priced and the runtime will run
                precision=pricer.precision or default_precision(mesh))
    # What the plan records is the plan's own price, from its stages as written (the search's
    # price of the candidate is the same call, shared through `cache`).
    estimate = estimate_plan(graph, plan, cache=pricer.estimates,
                             efficiencies=pricer.efficiencies).to_dict()
    plan.predicted = {key: value for key, value in estimate.items() if key != "devices"}
    for stage, predicted in zip(stages, _stage_predictions(graph, mesh, priced, units,
                                                           estimate["devices"])):
        stage.predicted = predicted
    # A check on the estimator's bubble formula: torch's own action order, simulated with the
    # stages' predicted times.
    plan.predicted["simulated_bubble_fraction"] = plan_timeline(plan).bubble_fraction
    return plan


def at_precision(graph: Graph, plan: Plan, precision: str) -> Plan:
    """A copy of `plan` that runs at `precision`, priced again at it: activations, the 16-bit
    weights and traffic, and the matmuls' FLOP/s all change with it. Each stage keeps its share of
    its pipeline rank's time (what the timeline draws)."""
    if precision == plan.precision:
        return plan
    plan = Plan.from_dict({**plan.to_dict(), "precision": precision})
    estimate = estimate_plan(graph, plan).to_dict()
    plan.predicted = {key: value for key, value in estimate.items() if key != "devices"}
    for stage in plan.stages:
        before = stage.predicted
        device = dict(estimate["devices"][stage.index % plan.pp])
        if before.get("time_per_micro_batch_s"):
            share = before.get("chunk_time_per_micro_batch_s", before["time_per_micro_batch_s"]) \
                / before["time_per_micro_batch_s"]
            device["chunk_time_per_micro_batch_s"] = device["time_per_micro_batch_s"] * share
        stage.predicted = device
    plan.predicted["simulated_bubble_fraction"] = plan_timeline(plan).bubble_fraction
    return plan


def _with_zero3(parameters: dict[str, list[str]], stages: list[Stage],
                shapes: dict[str, tuple]) -> dict[str, list[str]]:
    """Parameters of ZeRO-3 stages are sharded over the data-parallel axis (gathered before use),
    on the first dim whose size, after any tensor-parallel split, the data-parallel degree divides:
    OPT's 2050 positions split on the hidden dim over 4 ranks, and a parameter no dim of which
    divides stays whole (a runtime that accepts uneven shards loses nothing by it, and one that
    does not can run every plan). With context parallelism the shards are over dp x cp ranks (the
    ranks holding the same weights), written on both axes (each splits the dim further)."""
    for stage in stages:
        replicas = stage.dp * stage.cp
        if stage.zero < 3 or replicas == 1:
            continue
        # the sizes of the plan's axes before the tensor-parallel one: dp, and cp where it is one
        replica_axes = (stage.dp, stage.cp) if stage.cp > 1 else (stage.dp,)
        for fqn, placements in parameters.items():
            if any(fqn.startswith(layer + ".") for layer in stage.layers) and placements[0] == "R":
                tensor = placements[len(replica_axes):]
                shard = _data_shard(shapes[fqn], tensor, stage.tp, replicas)
                parameters[fqn] = [shard if size > 1 else "R" for size in replica_axes] + tensor
    return parameters


def _data_shard(shape: tuple, tensor: list[str], tp: int, dp: int) -> str:
    for dim, size in enumerate(shape):
        local = size // tp if f"S({dim})" in tensor else size
        if local % dp == 0:
            return f"S({dim})"
    return "R"


def infeasible(search: Search, memory_limit: float) -> InfeasibleError:
    """Why nothing was planned: no layout fits the memory (with the least found), or no layout of
    the mesh runs this global batch at all (with the batch sizes that would)."""
    least = search.least_memory
    if least is None:
        return _no_layout(search)
    if search.least_host is not None:
        return _host_too_small(search)
    shape = least.candidate.shape
    error = InfeasibleError(
        f"no plan fits {format_bytes(memory_limit)} per device; the least memory found is "
        f"{format_bytes(least.memory_bytes)} (tp={shape.tp} pp={shape.pp} dp={shape.dp} "
        f"{f'ep={shape.ep} ' if shape.ep > 1 else ''}{f'cp={shape.cp} ' if shape.cp > 1 else ''}"
        f"micro-batch {shape.micro_batch}, recompute {least.candidate.recompute[0]}, ZeRO "
        f"{least.candidate.zero[0]}{', offloaded' if shape.offload else ''}); use more devices, a larger memory limit or a smaller model"
        + ("; the search stopped at its time limit, and a longer one may find a plan"
           if search.timed_out else ""))
    error.least_memory_bytes = least.memory_bytes      # for callers that retry with it
    return error


def _host_too_small(search: Search) -> InfeasibleError:
    """Offloading would fit the devices, but not the hosts' memory."""
    least = search.least_host
    shape, estimate = least.candidate.shape, least.estimate
    mesh = search.pricer.mesh
    per_host = min(mesh.device.host_figures.gpus, mesh.gpus_per_node)
    needed = estimate.host_memory_bytes * per_host
    return InfeasibleError(
        f"no plan fits {format_bytes(search.pricer.memory_limit)} per device without offloading, "
        f"and offloaded (tp={shape.tp} pp={shape.pp} dp={shape.dp}, ZeRO 3) the model states need "
        f"{format_bytes(needed)} of host memory for the host's {per_host} device(s), more than "
        f"the {format_bytes(mesh.device.host_figures.memory_bytes)} the host has; if your hosts "
        f"have more, say so in the mesh spec (e.g. '{_with_host(mesh, needed)}'), else use more "
        f"devices or a smaller model")


def _with_host(mesh: Mesh, needed: float) -> str:
    """The mesh spec with a host memory that would hold `needed` bytes, in whole GB."""
    return f"{mesh},host={math.ceil(needed / 1e9)}g"


def _no_layout(search: Search) -> InfeasibleError:
    mesh, batch = search.pricer.mesh, search.pricer.global_batch
    # data-parallel degrees of the mesh's layouts, whatever the batch: TP inside a node, at most
    # one pipeline stage per unit
    degrees = sorted({mesh.world_size // (tp * pp)
                      for tp in range(1, min(MAX_TP, mesh.gpus_per_node) + 1) if mesh.gpus_per_node % tp == 0
                      for pp in range(1, len(search.units) + 1) if (mesh.world_size // tp) % pp == 0})
    refused = search.pricer.refusals
    reasons = "; ".join(sorted(refused, key=lambda r: -refused[r])[:3])
    if not any(batch % dp == 0 for dp in degrees):
        smallest = degrees[0] if degrees else mesh.world_size
        below, above = batch // smallest * smallest, (batch // smallest + 1) * smallest
        return InfeasibleError(
            f"no layout of {mesh.world_size} devices runs global batch {batch}: its "
            f"data-parallel degree would be one of {degrees} (at most {MAX_TP}-way tensor "
            f"parallelism inside a node, one pipeline stage per layer), and none divides "
            f"{batch}; use a global batch that is a multiple of {smallest}, e.g. "
            f"{' or '.join(str(b) for b in (below, above) if b > 0)}")
    return InfeasibleError(
        f"no configuration of this mesh could be priced for this model with global batch "
        f"{batch}{f' ({reasons})' if reasons else ''}; try another mesh or global batch")


