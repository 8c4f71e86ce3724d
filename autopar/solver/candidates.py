"""What the inter-op search proposes: units, device layouts (`Shape`), cuts, candidates.

The model is a sequence of units (autopar.cost.units): the embedding (every node before the first
repeated block), each block instance, and the head (every node after the last block); a model
without repeated blocks, its modules (`module_shapes`). A candidate cuts that sequence
into pp * v contiguous chunks (v chunks per pipeline rank when interleaved) on a device layout,
with recompute and ZeRO per chunk. Layouts come from Megatron's grid (`megatron_shapes`), from
pipelines whose degree does not divide the blocks (`autopar_shapes`), with context parallelism
(`context_shapes`) and, when nothing else fits, pipelines shorter than their stages
(`short_pipeline_shapes`), each at a few expert-parallel degrees for a model with MoE layers
(`with_expert_degrees`, carved out of a stage's dp x cp x tp ranks); cuts are Megatron's uniform ones
or balanced by a dynamic program (`balanced_cuts`). What the runtime cannot run is never proposed
(`layout_error`, the rules of autopar.plans.schedules).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from autopar.plans.schedules import runs, schedule_error
from autopar.plans.vocabulary import Recompute, Schedule
from autopar.cost.units import Unit, pipeline_units, unit_weights  # noqa: F401 (the planner's API)

RECOMPUTE_ORDER = (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)   # cheapest time first
GRID_VIRTUAL = (2, 3, 4, 6, 8)
GRID_MICRO_BATCH = (1, 2, 4, 8, 16)
MAX_MICRO_BATCH = 32
MAX_TP = 8
CONTEXT_DEGREES = (2, 4, 8, 16, 32)


@dataclass(frozen=True, slots=True)
class Shape:
    """A pipeline layout of the devices: degrees, micro-batching and schedule."""
    tp: int
    pp: int
    dp: int
    micro_batch: int
    schedule: str
    virtual: int = 1
    sequence_parallel: bool = False
    ep: int = 1                 # expert parallelism, carved out of the dp x cp x tp ranks of a stage
    cp: int = 1                 # context parallelism: every sequence split over cp ranks
    cp_kind: str = "ring"       # ring | all-to-all
    offload: bool = False       # ZeRO-3's states on the host

    @property
    def replicas(self) -> int:
        """The ranks that hold the same weights and reduce their gradients (ZeRO's group)."""
        return self.dp * self.cp


@dataclass(frozen=True, slots=True)
class Candidate:
    shape: Shape
    cuts: tuple[int, ...]       # pp * v + 1 unit boundaries: chunk i holds units[cuts[i]:cuts[i+1]]
    recompute: tuple[str, ...]  # per chunk
    zero: tuple[int, ...]       # per chunk

    @property
    def chunks(self) -> int:
        return len(self.cuts) - 1


@dataclass(kw_only=True, slots=True)
class Priced:
    candidate: Candidate
    step_time_s: float
    memory_bytes: float
    fits: bool
    estimate: object = field(default=None, repr=False)


def layout_error(shape: Shape, global_batch: int, coupling: str | None = None) -> str | None:
    """Why the runtime cannot run a device layout for this global batch (None when it can): the
    batch must divide into dp replicas of m micro-batches of `micro_batch` sequences (m = 1 for
    a model whose `coupling`, Graph.batch_coupling, says why micro-batches change its numbers),
    and torch must run the schedule with m micro-batches on pp ranks of `virtual` chunks (one
    stage per rank when pp == 1, where no schedule is built). Every generator below keeps to
    it, so the search never prices what the runtime would refuse."""
    per_step = shape.dp * shape.micro_batch
    if global_batch % per_step:
        return (f"global batch {global_batch} is not divisible by dp x micro-batch = "
                f"{shape.dp} x {shape.micro_batch}")
    if coupling is not None and global_batch != per_step:
        return (f"{coupling}: each replica runs its {global_batch // shape.dp} samples as one "
                f"micro-batch, not {global_batch // per_step} of {shape.micro_batch}")
    if shape.pp == 1:
        return None if shape.virtual == 1 else "one pipeline rank holds one stage"
    return schedule_error(shape.schedule, shape.pp, global_batch // per_step, shape.virtual)


def balanced_cuts(weights: list[float], chunks: int) -> tuple[int, ...] | None:
    """Contiguous cuts of `weights` into `chunks` non-empty parts minimizing the heaviest part
    (dynamic program over prefix sums, O(chunks * n^2)); None when there are fewer units."""
    n = len(weights)
    if chunks > n:
        return None
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    # best[k][i]: the smallest heaviest part cutting the first i units into k parts
    best = [[math.inf] * (n + 1) for _ in range(chunks + 1)]
    choice = [[0] * (n + 1) for _ in range(chunks + 1)]
    best[0][0] = 0.0
    for k in range(1, chunks + 1):
        for i in range(k, n - (chunks - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], choice[k][i] = value, j
    cuts = [n]
    for k in range(chunks, 0, -1):
        cuts.append(choice[k][cuts[-1]])
    return tuple(reversed(cuts))


def uniform_cuts(units: list[Unit], chunks: int) -> tuple[int, ...] | None:
    """Megatron's cuts: blocks split evenly, the embedding with the first, the head with the last."""
    head = 1 if units[0].name == "embedding" else 0
    tail = 1 if units[-1].name == "head" else 0
    blocks = len(units) - head - tail
    if blocks % chunks or blocks == 0:
        return None
    per = blocks // chunks
    inner = [head + per * i for i in range(1, chunks)]
    return (0, *inner, len(units))


def micro_batch_sizes(per_replica: int, whole_batch: bool = False) -> list[int]:
    """The grid's micro-batch sizes that divide a replica's batch; with `whole_batch`, the batch."""
    return [per_replica] if whole_batch else [b for b in GRID_MICRO_BATCH if per_replica % b == 0]


def megatron_shapes(blocks: int, world: int, gpus_per_node: int, global_batch: int,
                    pp_divides_blocks: bool = True, whole_batch: bool = False) -> list[Shape]:
    """The grid's device layouts: TP within a node, PP (dividing the blocks when asked), DP the
    rest; micro-batch sizes that divide each replica's batch (`micro_batch_sizes`); interleaving
    with v chunks when the micro-batches fill the pipeline (m % pp == 0) and the blocks divide
    into pp * v."""
    shapes = []
    for tp in [t for t in range(1, min(MAX_TP, gpus_per_node) + 1) if gpus_per_node % t == 0]:
        for pp in [p for p in range(1, world // tp + 1) if (world // tp) % p == 0]:
            if pp > max(blocks, 1) or (pp_divides_blocks and blocks % pp):
                continue
            dp = world // (tp * pp)
            if global_batch % dp:
                continue
            for mbs in micro_batch_sizes(global_batch // dp, whole_batch):
                m = global_batch // (dp * mbs)
                sp = tp > 1
                if pp == 1:
                    shapes.append(Shape(tp, pp, dp, mbs, Schedule.ONE_F_ONE_B, 1, sp))
                    continue
                if runs(Schedule.ONE_F_ONE_B, pp, m):
                    shapes.append(Shape(tp, pp, dp, mbs, Schedule.ONE_F_ONE_B, 1, sp))
                # Megatron interleaves only when the micro-batches fill whole rounds
                if m % pp == 0:
                    shapes += [Shape(tp, pp, dp, mbs, Schedule.INTERLEAVED_1F1B, v, sp) for v in GRID_VIRTUAL
                               if blocks % (pp * v) == 0]
    return shapes


def autopar_shapes(blocks: int, world: int, gpus_per_node: int, global_batch: int,
                   whole_batch: bool = False) -> list[Shape]:
    """Layouts outside the grid whose PP does not divide the blocks: uneven stages."""
    return [shape for shape in megatron_shapes(blocks, world, gpus_per_node, global_batch,
                                               pp_divides_blocks=False, whole_batch=whole_batch)
            if shape.virtual == 1 and blocks % shape.pp]


def module_shapes(units: int, world: int, gpus_per_node: int, global_batch: int,
                  whole_batch: bool = False) -> list[Shape]:
    """Pipelines of a model without repeated blocks, cut between its `units` (modules) by cost:
    every depth from 2 to the units, one chunk per rank."""
    return [shape for shape in megatron_shapes(units, world, gpus_per_node, global_batch,
                                               pp_divides_blocks=False, whole_batch=whole_batch)
            if shape.virtual == 1 and shape.pp > 1]


def expert_degrees(ranks: int, experts: int, gpus_per_node: int, every: bool = False) -> list[int]:
    """Expert-parallel degrees for a stage of `ranks` (dp x cp x tp) devices whose MoE layers have
    `experts` experts (the gcd of their counts; 0 for a model without MoE layers): those that
    divide both, which the runtime runs. The grid tries two of them (`every`: all): 1, and the
    largest whose all-to-alls stay inside a node (NVLink), or the smallest past it; the
    refinement moves the best layouts to every other (search.py)."""
    valid = [d for d in range(2, ranks + 1) if ranks % d == 0 and experts and experts % d == 0]
    if every or not valid:
        return [1, *valid]
    inside = [d for d in valid if d <= gpus_per_node]
    return [1, inside[-1] if inside else valid[0]]


def with_expert_degrees(shapes: list[Shape], experts: int, gpus_per_node: int) -> list[Shape]:
    """Each shape at each of the grid's expert-parallel degrees (`expert_degrees`)."""
    return [replace(shape, ep=ep) for shape in shapes
            for ep in expert_degrees(shape.tp * shape.dp * shape.cp, experts, gpus_per_node)]


def context_shapes(blocks: int, world: int, gpus_per_node: int, global_batch: int, sequence: int,
                   whole_batch: bool = False) -> list[Shape]:
    """The grid's layouts with context parallelism: cp ranks (between the tensor- and the
    data-parallel ones in Megatron's rank order) split every sequence into 2 x cp chunks, so cp
    divides the devices and 2 x cp the sequence; tp, pp and dp as the grid lays out the rest.
    One sequence per micro-batch and one chunk per pipeline rank, as long-context runs are laid
    out (a sequence long enough to split leaves no memory for more): the refinement tries other
    micro-batch sizes and schedules from the best of them."""
    shapes = []
    for cp in CONTEXT_DEGREES:
        if world % cp or not sequence or sequence % (2 * cp):
            continue
        shapes += [replace(shape, cp=cp) for shape in megatron_shapes(
            blocks, world // cp, gpus_per_node, global_batch, whole_batch=whole_batch)
            if shape.virtual == 1 and (shape.micro_batch == 1 or whole_batch)]
    return shapes


def short_pipeline_shapes(blocks: int, world: int, gpus_per_node: int, global_batch: int,
                          whole_batch: bool = False) -> list[Shape]:
    """Pipelines with fewer micro-batches than stages, which only GPipe runs: a bubble of at least
    the whole ideal step, so the planner tries them only when nothing else fits (a small global
    batch on many devices)."""
    shapes = []
    for tp in [t for t in range(1, min(MAX_TP, gpus_per_node) + 1) if gpus_per_node % t == 0]:
        for pp in [p for p in range(2, min(world // tp, blocks) + 1) if (world // tp) % p == 0]:
            dp = world // (tp * pp)
            if global_batch % dp:
                continue
            for mbs in micro_batch_sizes(global_batch // dp, whole_batch):
                if global_batch // (dp * mbs) < pp:
                    shapes.append(Shape(tp, pp, dp, mbs, Schedule.GPIPE, 1, tp > 1))
    return shapes
