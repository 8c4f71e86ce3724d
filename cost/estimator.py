"""The one estimator: step time, throughput and memory of a parallel configuration of a graph.

`estimate(graph, mesh, config, placements=...)` prices a Megatron-style uniform configuration;
`estimate_stages` prices any list of pipeline chunks (`StageSpec`), each with its own tensor/data
parallelism, recompute and ZeRO, so that the pipeline planner's plans and `autopar estimate` agree.
Tensor parallelism is priced on given placements, whoever produced them: the sharding ILP
(autopar's plans, `autopar estimate --tp`) or Megatron-LM's layout (cost/megatron.py, for
published runs); the estimator itself has one way to price a configuration.

Per device and micro-batch, from the graph's nodes (cost/layout.py), in order:
  compute      every op's forward and backward by roofline (cost/compute.py), the forward again
               for recomputed layers; attention as the kernels that run it (flash or unfused)
  tensor par.  the collectives the placements need (Megatron's: 2 all-reduces per layer
               forward, 2 backward, 2 more when the forward is recomputed), on the
               tensor-parallel group's links, not overlapped
  pipeline     activations and their gradients sent to the next stage over its link, as the
               runtime sends them (cost/traffic.py add_sends): each tensor-parallel rank its
               1/tp chunk, gathered by the receiver where the stage holds the value whole
               (Megatron-LM's scatter/gather, and autopar's)
  host         the runtime's machinery: each action of torch's pipeline schedule, each FSDP
               group's hooks, zero-bubble's walk of the autograd graph to split the backward,
               the copies of each FSDP2 reduction (cost/overlap.py); measured on CPU meshes,
               hidden behind a GPU's kernels (cost/host.py)
Per step:
  m x the slowest device's time per micro-batch, plus the pipeline bubble: the fill and drain,
  (sum of the devices' times - the slowest) / v, which is (p-1)/(v m) of the ideal time when stages
  are equal. A zero-bubble schedule (ZB-H1 of Qi et al. 2023) fills the drain with the weight
  halves of the backward, which no other stage waits for: the bubble shrinks by twice their time,
  (sum of the devices' weight halves - the slowest's) * 2 / v. Where forward, input and weight
  halves take equal time and transfers none, that leaves a third of it, the paper's figure; where
  transfers or host costs are a stage's larger part, as on CPU meshes, it leaves more;
  the data-parallel traffic the computation does not hide: gradient reduction, ZeRO's gathers,
  as the runtime that trains overlaps them (cost/overlap.py: `runtime=`);
  a weight tied across pipeline ranks (embedding and LM head): its copies' gradients all-reduced
  over the ranks holding them (Megatron's embedding group), after the backward, not overlapped;
  the optimizer step, memory-bound;
  the loss all-reduced over every rank for the mean that `step` returns (`cost/traffic.py`).
Where ranks share a host's cores, each blocking collective after a group's forward or backward
(FSDP2's reductions and gathers, the loss) also waits for the rank the scheduler ran least
(`Efficiencies.wait_after`, measured by `autopar calibrate --mesh`; 0 on GPUs).
Where a mesh has more ranks than the host has cores (gloo ranks on a CPU; `host_cores` of the
calibration), a rank idle in a pipeline's bubble lends its core to the others: the pipeline takes
its average rank's work, or its critical path at a core per rank, whichever is longer
(cost/host.py; the breakdown's negative "lent_cores").
A calibration file (`autopar calibrate`, `calibration=path`) replaces the efficiencies and, when it
measured the mesh's collectives, the links' latency and bandwidth.
Hardware FLOP/s count the recomputed forward, as Megatron-LM reports them; model FLOP/s do not.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


from autopar.errors import AutoparError
from autopar.graph import Graph
from autopar.cost.backward_moments import last_scattered
from autopar.cost.calibration import calibrated
from autopar.cost.compute import Efficiencies, compute_time
from autopar.cost.config import Config
from autopar.cost.master_weights import cast_seconds
from autopar.cost.memory import in_flight, peak_bytes, pending_weight_backwards
from autopar.cost.mesh import Mesh
from autopar.cost.overlap import DeviceWork, Runtime, holds_every_transfer, keeps_every_send, runtime_named
from autopar.cost.host import host_time, ranks_per_core, shared_host_time
from autopar.cost.price_cache import PriceCache
from autopar.cost.backward_transients import block_transients
from autopar.cost.chunk_price import (Chunk, heaviest_gradient, padded_ratios, partial_gradients_time,
                                     partial_reductions, poly_at)
from autopar.cost.traffic import add_sends, crossing_bytes, loss_sync, received_bytes, tied_exposed
from autopar.cost.interleaved_order import at_fullest
from autopar.cost.forms import (backward_reductions, check_stages, expert_data_parallel, offload_step, sharded_params,
                                sharded_traffic)
from autopar.cost.offload import host_bytes, host_fits, host_memory_share
from autopar.cost.stages import StageSpec, uniform_stages
from autopar.plans.schedules import recompute_error
from autopar.plans.vocabulary import DTYPE_BYTES, Precision, Recompute, Schedule
from autopar.plans.zero import holds_weights_in_fsdp, keeps_weights_gathered, reduces_every_micro_batch
# The dtype activations are held in and matmuls run at under each precision (a plan's
# `precision`); model states are fp32 master weights under both 16-bit ones (cost/memory.py).
# "fp8" is bf16 mixed precision with the matmuls in FP8 (Transformer Engine's recipes): priced
# at the device's FP8 rate where it has one, plus the casts (cost/chunk_price.py); activations,
# model states and traffic as bf16's.
ACTIVATION_DTYPE = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8": "bfloat16"}
_PRECISION_OF_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
DISPATCHES = ("all-to-all", "deduplicated")


def default_precision(mesh: Mesh) -> str:
    """The precision a plan for `mesh` trains in unless told: the device's training dtype."""
    return Precision.of_dtype(mesh.device.training_dtype)


@dataclass(kw_only=True, slots=True)
class Estimate:
    step_time_s: float
    breakdown: dict                 # compute, exposed_comm, bubble, optimizer: they sum to the step
    comm_breakdown: dict            # exposed_comm by kind: tensor, pipeline, data
    memory_per_gpu_bytes: float     # the fullest device
    memory_breakdown: dict          # the parts of `autopar.cost.memory.peak_bytes`
    tflops_per_gpu: float           # hardware: recomputed forwards counted
    model_tflops_per_gpu: float
    mfu: float
    bubble_fraction: float          # bubble time / ideal time, (p-1)/(v m) for equal stages
    micro_batches: int
    memory_limit_bytes: float
    fits: bool
    devices: list = field(default_factory=list)    # per pipeline rank: time per micro-batch, memory
                                                    # (total and its parts)
    host_memory_bytes: float = 0.0  # offloaded model states one device keeps on its host
    # the host memory each device has for them: its host's over the devices it serves (0: the
    # host's memory is not stated, and not checked)
    host_memory_limit_bytes: float = 0.0

    def to_dict(self) -> dict:
        """Plain data; the host's bytes only where the states are offloaded."""
        data = asdict(self)
        for key in ("host_memory_bytes", "host_memory_limit_bytes"):
            if not data[key]:
                del data[key]
        return data


def estimate(graph: Graph, mesh: Mesh, config: Config, *, efficiencies: Efficiencies | None = None,
             attention: str = "flash", memory_limit: float | None = None,
             cache: dict | None = None, runtime: str | Runtime = "autopar",
             calibration=None, precision: str | None = None, placements=None) -> Estimate:
    """Price a Megatron-style configuration: layers split over pp x virtual chunks (evenly where
    they divide, `autopar.cost.stages.blocks_per_chunk` where not), each op placed on the
    tensor-parallel axis as `placements` (cost.layout.TensorPlacements: the sharding ILP's, or
    cost.megatron.megatron_placements) say; needed when config.tp > 1. `cache`: see
    `estimate_stages`; `runtime`: the training runtime whose overlap applies (cost/overlap.py);
    `calibration`: a file written by `autopar calibrate`, whose measured efficiencies and
    collectives replace the defaults and the mesh's links; `precision`: see `estimate_stages`."""
    check_world(mesh, config)
    refusal = recompute_error(config.schedule, (config.recompute,))
    if refusal is not None:
        raise AutoparError(refusal)
    stages = uniform_stages(graph, config, placements)
    return estimate_stages(graph, mesh, stages, global_batch=config.global_batch,
                           micro_batch=config.micro_batch, schedule=config.schedule,
                           virtual=config.virtual, efficiencies=efficiencies, attention=attention,
                           memory_limit=memory_limit, cache=cache, runtime=runtime,
                           calibration=calibration, precision=precision,
                           routing_imbalance=config.routing_imbalance)


def check_world(mesh: Mesh, config: Config) -> None:
    if config.world_size != mesh.world_size:
        raise AutoparError(f"tp x cp x pp x dp = {config.tp} x {config.cp} x {config.pp} x "
                           f"{config.dp} = {config.world_size} does not match the "
                           f"{mesh.world_size} devices of mesh {mesh}; choose degrees whose "
                           f"product is {mesh.world_size}")


def estimate_stages(graph: Graph, mesh: Mesh, stages: list[StageSpec], *, global_batch: int,
                    micro_batch: int, schedule: str = Schedule.ONE_F_ONE_B, virtual: int = 1,
                    efficiencies: Efficiencies | None = None, attention: str = "flash",
                    memory_limit: float | None = None, cache: dict | None = None,
                    runtime: str | Runtime = "autopar", calibration=None,
                    precision: str | None = None, routing_imbalance: float = 1.0,
                    dispatch: str = "all-to-all", overlap_exchange: bool = False) -> Estimate:
    """Price pipeline chunks `stages` in model order; with `virtual` v, chunk c runs on pipeline
    rank c % p of p = len(stages) / v ranks (Megatron's interleaving).

    `cache`, a dict the caller owns, keeps what calls on the same graph, mesh and efficiencies
    share (layouts, chunk owners, priced chunks), so that a search pricing many configurations
    pays for each part once; results are the same with or without it. `precision` "bf16" or
    "fp16" (mixed precision, the same bytes) or "fp32": the bytes of activations, model states and
    data-parallel traffic, and the FLOP/s of the device's matmuls in that dtype; by default what
    the device trains in (bf16 on GPUs, fp32 on CPUs); "fp8": see ACTIVATION_DTYPE.
    `routing_imbalance`: the slowest rank's expert rows over the mean; `dispatch`: "all-to-all" or "deduplicated"
    (cost.experts.exchange_time); `overlap_exchange`: the experts' all-to-alls run behind
    another micro-batch's compute (Megatron-Core's 1F1B all-to-all overlap, DualPipe), showing
    only where they outlast it."""
    runtime = runtime_named(runtime)
    mesh, eff = calibrated(mesh, efficiencies, calibration, runtime.attention_kernel)
    precision = precision or default_precision(mesh)
    memo = _price_cache(cache, graph, mesh, eff, precision, routing_imbalance, dispatch, runtime.autocast)
    check_stages(graph, stages, memo)
    pipe = price_pipeline(graph, mesh, stages, global_batch=global_batch, micro_batch=micro_batch,
                           virtual=virtual, efficiencies=eff, attention=attention, memo=memo)
    chunks, devices, m = pipe.chunks, pipe.devices, pipe.micro_batches
    split = memo.split(stages)
    for c, spec in enumerate(stages):
        chunks[c].host_s = host_time(spec, split.groups[c], chunks[c],
                                      pipelined=len(devices) > 1, schedule=schedule, eff=eff)
        weights, gradients = cast_seconds(chunks[c].params, spec, schedule, m, device=mesh.device,
                                          eff=eff, precision=precision, runtime=runtime)
        chunks[c].casts_s, chunks[c].gradient_casts_s = weights + gradients, gradients
    for chunk in chunks if overlap_exchange else ():
        chunk.exchange_s = max(0.0, chunk.exchange_s - chunk.forward_s - chunk.backward_s)
    per_mb = [sum(_chunk_time(chunks[c]) for c in cs) for cs in devices]
    ideal = m * max(per_mb)
    bubble = _bubble(chunks, devices, per_mb, schedule, virtual)
    lent = 0.0      # < 0 where ranks idle in the bubble lend their cores (cost/host.py)
    sharing = ranks_per_core(mesh, eff)
    if len(devices) > 1 and sharing > 1:
        lent = shared_host_time(per_mb, m, ideal + bubble, sharing) - ideal - bubble
    data_comm, optimizer, offloaded = _device_steps(pipe, stages, split, schedule, mesh=mesh,
                                                    eff=eff, runtime=runtime, memo=memo)
    memory, host = pipeline_memory(pipe, stages, pipe.samples, schedule, virtual, precision=precision,
                                   receive_buffers=holds_every_transfer(runtime, schedule))
    exposed_copies = max((copies for copies, _ in offloaded), default=0.0)
    tied = tied_exposed(memo.readers(split), memo.layout(stages[0]), stages[0], mesh, pp=len(devices))
    closing = loss_sync(mesh, eff)
    step = ideal + bubble + lent + max(data_comm) + tied + max(optimizer) + closing + exposed_copies
    result = _summarize(memo.model_flops_per_sample(), mesh, chunks, devices, per_mb, memory,
                        step=step, ideal=ideal, bubble=bubble, lent=lent,
                        data_comm=max(data_comm) + tied, loss_sync=closing,
                        optimizer=max(optimizer), m=m, global_batch=global_batch,
                        memory_limit=memory_limit)
    if offloaded:
        _add_offload(result, exposed_copies, max(host), mesh)
    return result


def _add_offload(result: Estimate, exposed_copies: float, host_bytes: float, mesh: Mesh) -> None:
    """An offloaded plan's copies to and from the host, and its states on the host's memory."""
    result.breakdown["offload"] = exposed_copies
    result.comm_breakdown["host"] = exposed_copies
    result.host_memory_bytes = host_bytes
    result.host_memory_limit_bytes = host_memory_share(mesh)
    result.fits = result.fits and host_fits(result)


def _price_cache(cache: dict | None, graph: Graph, mesh: Mesh, eff: Efficiencies, precision: str,
                 routing_imbalance: float, dispatch: str, autocast: bool) -> PriceCache:
    """What the estimator's calls on this graph, mesh and precision share (price_cache.py)."""
    if precision not in ACTIVATION_DTYPE:
        raise AutoparError(f"precision {precision!r} is not one of {', '.join(ACTIVATION_DTYPE)}")
    gemm_dtype = "float8" if precision == "fp8" and "float8" in mesh.device.peak_flops else ""
    if dispatch not in DISPATCHES:
        raise AutoparError(f"dispatch {dispatch!r} is not one of {', '.join(DISPATCHES)}")
    return PriceCache.of(cache, graph, mesh, eff, ACTIVATION_DTYPE[precision], routing_imbalance,
                         gemm_dtype, dispatch, autocast)


def _device_steps(pipe: _Pipeline, stages: list[StageSpec], split, schedule: str, *, mesh: Mesh,
                  eff: Efficiencies, runtime: Runtime, memo: PriceCache) -> tuple[list, list, list]:
    """Per pipeline rank: its exposed data-parallel traffic and its optimizer step's seconds; and
    for the ranks that offload, (exposed host copies, the host's step)."""
    chunks, devices, m = pipe.chunks, pipe.devices, pipe.micro_batches
    data_comm, optimizer, offloaded = [], [], []
    for d, cs in enumerate(devices):
        spec = stages[cs[0]]
        work = _device_work([chunks[c] for c in cs], [stages[c] for c in cs],
                            [split.groups[c] for c in cs], stage=d, pipelined=len(devices) > 1,
                            kept_gathered=keeps_weights_gathered(spec.zero, schedule),
                            reduce_every=reduces_every_micro_batch(spec.zero, schedule), eff=eff)
        partial = partial_reductions(spec, schedule, _PRECISION_OF_DTYPE[memo.dtype], m)
        data_comm.append(sharded_traffic(work, spec, micro_batches=m, mesh=mesh, runtime=runtime,
                                         element_bytes=DTYPE_BYTES[memo.dtype])
                         + partial_gradients_time([chunks[c] for c in cs], mesh, spec.tp, *partial))
        if spec.offload:
            offloaded.append(offload_step(work, spec, micro_batches=m, schedule=schedule,
                                          mesh=mesh, eff=eff))
            optimizer.append(offloaded[-1][1])
            continue
        optimizer.append(compute_time(0, sharded_params(work, spec) * runtime.optimizer_step_bytes,
                                      mesh.device, "elementwise", efficiencies=eff))
    return data_comm, optimizer, offloaded


def _bubble(chunks: list[Chunk], devices: list[list[int]], per_mb: list[float], schedule: str,
            virtual: int) -> float:
    """The fill and drain: the devices' times beyond the slowest, over the chunks per rank; a
    zero-bubble schedule fills it with the weight halves of the backward (module doc)."""
    bubble = (sum(per_mb) - max(per_mb)) / virtual
    if schedule == Schedule.ZERO_BUBBLE:
        weight = [sum(chunks[c].weight_backward_s + chunks[c].gradient_casts_s for c in cs)
                  for cs in devices]
        bubble = max(bubble - 2 * (sum(weight) - max(weight)) / virtual, 0.0)
    return bubble


def _device_work(chunks: list[Chunk], stages: list[StageSpec], groups: list[int],
                 stage: int, pipelined: bool, kept_gathered: bool, reduce_every: bool,
                 eff: Efficiencies) -> DeviceWork:
    """A pipeline rank's chunks as the data-parallel traffic sees them; its last backward runs
    while the stages after it (`stage` is its place) drain theirs."""
    backward = sum(c.backward_s + c.recompute_s for c in chunks)
    forward = sum(c.forward_s for c in chunks)
    units = max(1, sum(groups))
    return DeviceWork(params=sum(c.params for c in chunks), tensors=sum(c.tensors for c in chunks),
                      expert_params=sum(c.expert_params for c in chunks),
                      padding=tuple(sum(c.padding[k] for c in chunks) for k in (0, 1)),
                      blocks=sum(groups), forward_s=forward, backward_s=backward,
                      drain_s=backward * (1 + stage),
                      recompute=any(s.recompute == Recompute.FULL for s in stages),
                      pipelined=pipelined, kept_gathered=kept_gathered, reduce_every=reduce_every,
                      forward_wait_s=eff.wait_after(forward / units),
                      backward_wait_s=eff.wait_after(backward / units),
                      reduce_group_s=(eff.sharded_reduce_group_s if stages[0].zero
                                      else eff.data_parallel_reduce_group_s),
                      reduce_byte_s=eff.data_parallel_reduce_byte_s)


@dataclass(kw_only=True, slots=True)
class _Pipeline:
    chunks: list[Chunk]
    devices: list[list[int]]        # pipeline rank -> its chunks
    micro_batches: int
    samples: float = 1.0            # sequences of a micro-batch on one rank: micro_batch / cp
    one_tensor_steps: bool = False  # Adam steps one tensor at a time: torch's foreach runs on GPUs


def price_pipeline(graph: Graph, mesh: Mesh, stages: list[StageSpec], *, global_batch: int,
                    micro_batch: int, virtual: int, efficiencies: Efficiencies,
                    attention: str, memo: PriceCache) -> _Pipeline:
    pp, dp = _pipeline_shape(stages, virtual, mesh)
    if global_batch % (dp * micro_batch):
        raise AutoparError(f"global batch {global_batch} is not divisible by dp x micro_batch = "
                           f"{dp} x {micro_batch}")
    m = global_batch // (dp * micro_batch)
    if virtual > 1 and m % pp:
        raise AutoparError(f"the interleaved schedule needs the micro-batches per step ({m}) to be a "
                           f"multiple of the {pp} pipeline ranks; change the global or micro-batch")
    split = memo.split(stages)
    samples = micro_batch / stages[0].cp      # each rank holds 1/cp of every sequence
    chunks = [memo.chunk(split, c, s, samples, attention)
              for c, s in enumerate(stages)]
    for c, s in enumerate(stages):
        params, loss, tensors, gathered = memo.states(split, s)
        chunks[c].params, chunks[c].loss_poly, chunks[c].tensors = params[c], loss[c], tensors[c]
        chunks[c].gathered, chunks[c].largest, chunks[c].group = gathered[c]
        chunks[c].reduce_order = memo.reduce_order(split, s)[c]
        chunks[c].loss_per_sample = poly_at(loss[c], 1)
        chunks[c].expert_params = memo.expert_params(split, s)[c]
        chunks[c].padding = memo.shard_padding(split, s)[c] if s.zero else (0.0, 0.0)
        chunks[c].experts_by_rows = memo.experts_by_rows(split, s)[c] if s.zero else 0.0
    crossing = memo.crossing(split, stages, crossing_bytes)
    add_sends(memo, split, stages, chunks, mesh, samples)
    for c, poly in enumerate(crossing):
        chunks[c].sent_poly = poly
    for c, poly in enumerate(received_bytes(crossing, stages)):
        chunks[c].received_poly = poly
    devices = [[c for c in range(len(stages)) if c % pp == d] for d in range(pp)]
    return _Pipeline(chunks=chunks, devices=devices, micro_batches=m, samples=samples,
                     one_tensor_steps=mesh.device.name == "cpu")


def pipeline_memory(pipe: _Pipeline, stages: list[StageSpec], samples, schedule: str, virtual: int,
                    seq_ratio=1, precision: str = Precision.BF16, receive_buffers: bool = False) -> tuple:
    """Memory breakdown of each pipeline rank and the bytes it keeps on its host (offload);
    `samples` (a micro-batch's sequences over cp) and `seq_ratio` (sequence length over the captured
    one) may be sympy expressions; `receive_buffers`: the rank holds every micro-batch's transfers."""
    parts = [_device_memory([pipe.chunks[c] for c in cs], stages[cs[0]], samples, schedule,
                            pp=len(pipe.devices), m=pipe.micro_batches, virtual=virtual, stage=d,
                            seq_ratio=seq_ratio, precision=precision, receive_buffers=receive_buffers,
                            one_tensor_steps=pipe.one_tensor_steps)
             for d, cs in enumerate(pipe.devices)]
    return [device for device, _ in parts], [host for _, host in parts]


def _pipeline_shape(stages: list[StageSpec], virtual: int, mesh: Mesh) -> tuple[int, int]:
    if not stages or len(stages) % virtual:
        raise AutoparError(f"{len(stages)} pipeline chunks cannot be spread over pipeline ranks "
                           f"with virtual={virtual} chunks each; give a multiple of {virtual} chunks")
    pp = len(stages) // virtual
    devices = sum(s.ranks for s in stages[:pp])
    if devices != mesh.world_size:
        raise AutoparError(f"the stages use {devices} devices (sum of tp x cp x dp over the {pp} "
                           f"pipeline ranks) but mesh {mesh} has {mesh.world_size}")
    for c, s in enumerate(stages):
        mine = stages[c % pp]
        if (s.tp, s.dp, s.cp, s.ep) != (mine.tp, mine.dp, mine.cp, mine.ep):
            raise AutoparError(f"chunk {c} runs on pipeline rank {c % pp} but asks for tp={s.tp}, "
                               f"dp={s.dp}, cp={s.cp}, ep={s.ep}; all chunks of one rank share "
                               f"its devices")
    for name in ("dp", "cp"):
        degrees = {getattr(s, name) for s in stages}
        if len(degrees) > 1:
            raise AutoparError(f"stages have different {name} degrees {sorted(degrees)}; one global "
                               f"batch splits into the same micro-batches (of the same sequences) "
                               f"on every stage")
    return pp, stages[0].dp


def _chunk_time(chunk: Chunk) -> float:
    return (chunk.forward_s + chunk.backward_s + chunk.recompute_s + chunk.tensor_comm_s
            + chunk.exchange_s + chunk.send_s + chunk.host_s + chunk.casts_s)


def _device_memory(chunks: list[Chunk], spec: StageSpec, b, schedule: str, *, pp: int, m: int,
                   virtual: int, stage: int, seq_ratio=1, precision: str = Precision.BF16,
                   receive_buffers: bool = True, one_tensor_steps: bool = False) -> tuple[dict, float]:
    """A pipeline rank's peak (cost.memory.peak_bytes), and what it keeps on its host when its
    stage offloads (cost/offload.py). Under ZeRO-3 a zero-bubble schedule keeps the weights
    gathered from forward to backward (its weight backward runs after the input backward, on
    the same gathered weights), so the rank holds them all, not GATHERED_GROUPS at a time;
    other schedules free them after each use (`fully_shard(reshard_after_forward=True)`,
    `autopar.runtime.schedule.ReshardingStage`). ZeRO shards over the cp x dp ranks, experts' states
    over their own group (cost/forms.py). `receive_buffers`: `cost.overlap.holds_every_transfer`."""
    params = sum(c.params for c in chunks)
    held = in_flight(schedule, pp=pp, micro_batches=m, virtual=virtual, stage=stage)
    # a micro-batch's bytes per chunk: kept for the backward, and sent (cached by torch's stage)
    sent = 0.0 if receive_buffers and keeps_every_send(schedule) else 1.0   # else in `received`
    kept = [b * (poly_at(c.saved_poly, seq_ratio) + sent * poly_at(c.sent_poly, seq_ratio)) for c in chunks]
    # a zero-bubble rank's micro-batches between their input and weight backwards also keep the
    # gradients their weights' backward needs (cost.memory.pending_weight_backwards)
    pending = pending_weight_backwards(schedule, pp=pp, micro_batches=m, virtual=virtual, stage=stage)
    deferred = sum(poly_at(c.deferred_poly, seq_ratio) for c in chunks) / len(chunks) * b
    element = 4 if precision == Precision.FP32 else 2
    fsdp = holds_weights_in_fsdp(replicas=spec.dp * spec.cp, offload=spec.offload, precision=precision)
    resharding, reduction = backward_reductions(spec, schedule, pipelined=pp > 1)
    transients = block_transients(chunks, seq_ratio, b, element, split=pending > 0, fsdp=fsdp, between=m > 2,
                                  resharding=resharding, last_reduction=reduction, alone=m == 1)
    # what the earlier backwards' last reduce-scatters hold: each chunk of a rank is an FSDP2
    # root of its own, keeping its last reduce-scatter input until its own last backward
    lasts = [c.group if (last := last_scattered(c.moments)) is None else last * padded_ratios(c)[0] for c in chunks]
    # what each backward of an interleaved rank meets in its order (cost/interleaved_order.py)
    meets, ends = at_fullest(chunks, lasts, kept, zero=spec.zero, schedule=schedule, pp=pp, micro_batches=m,
                             virtual=virtual, stage=stage, b=b, seq_ratio=seq_ratio)
    gathered = params if keeps_weights_gathered(spec.zero, schedule) else max(
        c.gathered + max(extra for _, extra, _ in met) for c, met in zip(chunks, meets))
    reduce_every = reduces_every_micro_batch(spec.zero, schedule)
    fullest = max((backed for *_, backed in ends if backed), key=lambda backed: backed.share, default=None)
    logits = sum(poly_at(c.loss_poly, seq_ratio) for c in chunks) * b
    parts = peak_bytes(params=params, gathered=gathered, group=sum(lasts), offload=spec.offload,
                       zero=spec.zero, dp=spec.dp * spec.cp, precision=precision, micro_batches=m * virtual,
                       reduce_every=reduce_every, held=held, pipelined=pp > 1,   # (chunk, micro-batch) pairs
                       activations=held * sum(kept) / len(kept), weight=heaviest_gradient(chunks),
                       deferred=(max(pending - 1, 0) * deferred, pending * deferred), split_backward=pending > 0,
                       # the last chunk's micro-batches among them, each keeping its loss's copy
                       # until its input backward, after which torch detaches the loss
                       loss_held=in_flight(schedule, pp=pp, micro_batches=m, stage=pp - 1)
                       - max(pending_weight_backwards(schedule, pp=pp, micro_batches=m,
                                                      stage=pp - 1) - 1, 0),
                       logits=logits, **transients._asdict(),
                       expert_params=sum(c.expert_params for c in chunks), one_tensor=max(
                           c.largest for c in chunks) if one_tensor_steps else 0.0,
                       padding=tuple(sum(c.padding[k] for c in chunks) for k in (0, 1)),
                       expert_dp=expert_data_parallel(spec), alone=m == 1 and fsdp and reduction is not None,
                       received=m * b * sum(poly_at(c.received_poly, seq_ratio) for c in chunks)
                       if receive_buffers else 0.0,
                       moments=[_weighed(moment, seq_ratio, b, padded, c.experts_by_rows, *met)
                                for c, situations in zip(chunks, meets) for padded in [padded_ratios(c)]
                                for met in situations for moment in c.moments] if reduce_every else (),
                       forwards=[*ends, (chunks[-1].last_gathered * padded_ratios(chunks[-1])[0],  # the loss's
                                         element * logits * (2 + 1 / spec.tp if spec.tp > 1 else 1), fullest)],
                       walked=[backed for met in meets for _, _, backed in met if backed is not None],
                       reduced_at_end=(chunks[0].reduce_order if len(chunks) == 1 else (), padded_ratios(chunks[0])))
    return parts, host_bytes(params=params, shards=spec.dp * spec.cp, zero=spec.zero) if spec.offload else 0.0


def _weighed(moment, seq_ratio, b, padded: tuple, by_rows: float, others: float, ahead: float, backed) -> tuple:
    """A backward's moment (cost/backward_moments.py) at this micro-batch and sequence length,
    as cost.memory.peak_bytes weighs it; what FSDP2 gathers and reduces, padded (`padded_ratios`), and
    the temporary it copies experts sharded on a later dim out through (`by_rows` of them). Once
    the chunk has reduced a group, the reduce-scatter inputs alive are its own and the `others`
    the rank's other chunks keep; with the chunks gathered whole `ahead` and the gradients the
    chunks `backed` hold where the rank's order is walked (cost/interleaved_order.py)."""
    net = (poly_at(dict(moment.flowing), seq_ratio) - poly_at(dict(moment.freed), seq_ratio)) * b
    scattering = None if moment.scattering is None else moment.scattering * padded[0] + others
    gathered = moment.gathered * padded[0] + moment.copying * padded[1] * by_rows + ahead
    return (net, moment.grads, gathered, scattering, moment.reduced[0] * padded[0],
            moment.reduced[1] * padded[1], tuple(part * pad for part, pad in zip(moment.releasing, padded)), backed)


def _summarize(model_flops_per_sample: float, mesh: Mesh, chunks: list[Chunk], devices: list, per_mb: list,
               memory: list, *, step: float, ideal: float, bubble: float, lent: float, data_comm: float,
               loss_sync: float, optimizer: float, m: int, global_batch: int,
               memory_limit: float | None) -> Estimate:
    world = mesh.world_size
    model_flops = model_flops_per_sample * global_batch
    hardware = model_flops + sum(c.recomputed_flops for c in chunks) * global_batch
    slowest = max(range(len(devices)), key=lambda d: per_mb[d])
    cs = [chunks[c] for c in devices[slowest]]
    total = lambda attr: m * sum(getattr(c, attr) for c in cs)
    totals = [sum(part.values()) for part in memory]
    fullest = max(range(len(memory)), key=lambda d: totals[d])
    limit = memory_limit if memory_limit is not None else mesh.device.memory_bytes
    peak = mesh.device.flops("bfloat16")
    return Estimate(
        step_time_s=step,
        breakdown={"compute": total("forward_s") + total("backward_s") + total("recompute_s")
                   + total("host_s") + total("casts_s"),
                   "exposed_comm": total("tensor_comm_s") + total("exchange_s") + total("send_s")
                   + data_comm + loss_sync,
                   "bubble": bubble, "optimizer": optimizer,
                   # cores that ranks idle in the bubble lend the others, on a shared host
                   **({"lent_cores": lent} if lent else {})},
        comm_breakdown={"tensor": total("tensor_comm_s"), "pipeline": total("send_s"),
                        "data": data_comm, "loss": loss_sync,
                        **({"expert": total("exchange_s")} if total("exchange_s") else {})},
        memory_per_gpu_bytes=totals[fullest], memory_breakdown=memory[fullest],
        tflops_per_gpu=hardware / step / world / 1e12,
        model_tflops_per_gpu=model_flops / step / world / 1e12,
        mfu=model_flops / step / world / peak,
        bubble_fraction=bubble / ideal if ideal else 0.0, micro_batches=m,
        memory_limit_bytes=limit, fits=totals[fullest] <= limit,
        devices=[{"stage": d, "time_per_micro_batch_s": per_mb[d], "memory_bytes": totals[d],
                  "memory": memory[d]} for d in range(len(devices))])
