"""A Plan is pure data: how one model runs on one mesh.

The mesh a stage runs on is a sub-mesh of the cluster with axes named by their roles
(`Plan.axes`, outer to inner, e.g. [["dp", 2], ["tp", 4]]: `AxisRole` values). Placements are
written one per axis, as torch's DTensor prints them: "S(0)" sharded on dim 0, "R" replicated, "P"
partial sums (autopar.plans.placements). Parameter placements carry ZeRO: a parameter sharded on
the data-parallel axis is gathered before use (ZeRO-3/FSDP); ZeRO-1/2 shard only gradients and
optimizer state and are recorded on the stage.

Pipelines: `stages` lists the model chunks in model order. With `virtual` = v chunks per pipeline
rank (interleaved 1F1B), there are pp * v stages and stage i runs on the ranks of pipeline rank
i % pp, as torch.distributed.pipelining places them; all stages share the sub-mesh shape `axes`.

The JSON form is exact: `Plan.load(path)` of a saved plan equals the plan, and saving it again
writes the same bytes. Every value of a loaded file is checked (autopar.plans.checks).

Context parallelism and offload (schema 3): a stage with `cp` > 1 splits every sequence over cp
ranks (the plan then has a "cp" axis between "dp" and "tp", Megatron's rank order), its
attention by `cp_kind`; `offload` keeps a ZeRO-3 stage's shards, gradients and optimizer state on
the host. A stage writes these three fields only where they differ from their defaults, so a plan
without either form reads as it did before them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path

from autopar.errors import PlanMismatchError
from autopar.plans.checks import check_plan_dict, read_plan_json
from autopar.plans.placements import shard_dim
from autopar.plans.vocabulary import AxisRole, ContextParallel, Precision, Recompute, Schedule

# 2: stages record `ep`, the expert-parallel degree
# 3: stages record `cp`, `cp_kind` and `offload` where they use them
SCHEMA_VERSION = 3


@dataclass(kw_only=True, slots=True)
class Stage:
    index: int
    layers: list[str]                 # module paths in order: "embed", "layers.0", ..., "head"
    ranks: list[int]                  # global ranks of the stage's sub-mesh, row-major over Plan.axes
    tp: int = 1
    dp: int = 1
    recompute: Recompute = Recompute.NONE
    zero: int = 0                     # 0-3
    sequence_parallel: bool = False
    # expert parallelism: each MoE layer's experts split over `ep` of the stage's dp x cp x tp
    # ranks (consecutive in row-major (dp, cp, tp) order), as Megatron-Core carves it out of them
    ep: int = 1
    predicted: dict = field(default_factory=dict)   # time and memory breakdowns of this stage
    cp: int = 1                       # context parallelism: every sequence split over cp ranks
    cp_kind: ContextParallel = ContextParallel.RING     # how attention runs over those ranks
    offload: bool = False             # ZeRO-3's shards, gradients and optimizer state on the host

    def __post_init__(self):
        self.recompute = _member(Recompute, self.recompute, f"stages[{self.index}].recompute")
        self.cp_kind = _member(ContextParallel, self.cp_kind, f"stages[{self.index}].cp_kind")


# Stage fields written only where they differ from these defaults (module docstring).
_UNUSED_FORMS = {"cp": 1, "cp_kind": ContextParallel.RING, "offload": False}


@dataclass(kw_only=True, slots=True)
class Plan:
    fingerprint: str                  # Graph.fingerprint() of the model it was made for
    mesh: dict                        # Mesh.to_dict() of the whole cluster
    axes: list[list]                  # [[role, size], ...] of each stage's sub-mesh, outer to inner
    stages: list[Stage]
    global_batch: int
    micro_batches: int                # per replica per step
    micro_batch_size: int
    schedule: Schedule = Schedule.ONE_F_ONE_B
    virtual: int = 1                  # model chunks per pipeline rank
    parameters: dict[str, list[str]] = field(default_factory=dict)   # fqn -> placement per axis
    nodes: dict[str, list[str]] = field(default_factory=dict)        # node name -> output placement per axis
    predicted: dict = field(default_factory=dict)   # step_time_s, tflops_per_gpu, memory_per_gpu_bytes, bubble_fraction
    solver: dict = field(default_factory=dict)      # seconds, status, gap, variables, constraints
    replicated_ops: list[str] = field(default_factory=list)  # ops with no sharding rule, run replicated
    model_type: str = ""
    precision: Precision = Precision.FP32   # the compute dtype; master weights stay fp32
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self):
        self.schedule = _member(Schedule, self.schedule, "schedule")
        self.precision = _member(Precision, self.precision, "precision")
        self.axes = [[_member(AxisRole, name, "axes"), size] for name, size in self.axes]

    @property
    def pp(self) -> int:
        """Pipeline ranks (stages per model replica divided by the chunks each rank holds)."""
        return len(self.stages) // self.virtual

    @property
    def tp(self) -> int:
        return self.stages[0].tp

    @property
    def dp(self) -> int:
        return self.stages[0].dp

    @property
    def cp(self) -> int:
        return self.stages[0].cp

    @property
    def offload(self) -> bool:
        return any(stage.offload for stage in self.stages)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def ep(self) -> int:
        """The largest expert-parallel degree of any stage (1: every expert on every rank)."""
        return max(stage.ep for stage in self.stages)

    @property
    def axis_roles(self) -> list[AxisRole]:
        return [role for role, _ in self.axes]

    def axis_index(self, role: AxisRole) -> int | None:
        """The position of the axis of `role` in `axes` (and in every placement list), or None."""
        roles = self.axis_roles
        return roles.index(role) if role in roles else None

    def summary(self) -> str:
        """One line a person can compare: degrees, schedule, micro-batches, per-stage choices."""
        # repeated blocks (module paths ending in an index) per stage: the embedding and head not counted
        counts = [sum(1 for layer in s.layers if layer.rsplit(".", 1)[-1].isdigit()) for s in self.stages]
        layer_counts = (f"{counts[0]}x{len(counts)}" if len(set(counts)) == 1
                        else "/".join(map(str, counts)))
        # per-stage choices in stage order, one value when all stages agree
        recompute = [str(s.recompute) for s in self.stages]
        recompute = recompute[:1] if len(set(recompute)) == 1 else recompute
        zero = [s.zero for s in self.stages]
        zero = zero[:1] if len(set(zero)) == 1 else zero
        schedule = self.schedule + (f" v={self.virtual}" if self.virtual > 1 else "")
        ep = [s.ep for s in self.stages]
        ep = ep[:1] if len(set(ep)) == 1 else ep
        experts = f" ep={'/'.join(map(str, ep))}" if max(ep) > 1 else ""
        context = f" cp={self.cp} ({self.stages[0].cp_kind})" if self.cp > 1 else ""
        return (f"tp={self.tp} pp={self.pp} dp={self.dp}{context}{experts} {schedule} "
                f"mbs={self.micro_batch_size} "
                f"m={self.micro_batches} recompute={'/'.join(recompute)} zero={'/'.join(map(str, zero))}"
                + (" offload" if self.offload else "")
                + (f" blocks={layer_counts}" if len(self.stages) > 1 else ""))

    def to_dict(self) -> dict:
        """Plain JSON data: the vocabularies' members as their strings; a stage's fields of forms
        it does not use left out (module docstring)."""
        data = _plain(asdict(self))
        for stage in data["stages"]:
            for key, default in _UNUSED_FORMS.items():
                if stage[key] == default:
                    del stage[key]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        """A plan from its JSON data; every value is checked first, and a bad one is named."""
        check_plan_dict(data, SCHEMA_VERSION, cls, Stage)
        stages = [Stage(**s) for s in data["stages"]]
        return cls(**{**data, "stages": stages})

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1) + "\n"

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        return cls.from_dict(read_plan_json(path))

    def check_graph(self, graph) -> None:
        """Refuse a graph (or its fingerprint) other than the one this plan was made for. Given the
        Graph itself, also check that every parameter placement shards a dimension the parameter
        has, into equal parts (a hand-edited plan can pass the fingerprint and still do neither)."""
        fingerprint = graph if isinstance(graph, str) else graph.fingerprint()
        if fingerprint != self.fingerprint:
            raise PlanMismatchError(
                f"this plan was made for another model or input shape (graph fingerprint "
                f"{self.fingerprint}, this model's is {fingerprint}); plan this model again")
        if not isinstance(graph, str):
            self.check_shapes({n.param_fqn: n.shape for n in graph.parameters if n.param_fqn})
            self.check_node_ranks({n.name: len(n.shape) for n in graph.nodes if n.shape})

    def check_shapes(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """Every placed parameter exists in `shapes` and each S(d) names one of its dimensions,
        which the axes sharding it divide evenly."""
        sizes = [size for _, size in self.axes]
        for fqn, placement in self.parameters.items():
            if fqn not in shapes:
                raise PlanMismatchError(f"the plan places parameter {fqn!r}, which this model does "
                                        f"not have; plan this model again")
            shape = shapes[fqn]
            parts = [1] * len(shape)
            for axis, text in enumerate(placement):
                dim = shard_dim(text)
                if dim is None:
                    continue
                if dim >= len(shape):
                    raise PlanMismatchError(f"the plan shards parameter {fqn!r} of shape {list(shape)} "
                                            f"on dim {dim}, which it does not have; plan this model again")
                parts[dim] *= sizes[axis]
            for dim, count in enumerate(parts):
                if shape[dim] % count:
                    raise PlanMismatchError(
                        f"the plan splits dim {dim} of parameter {fqn!r} (size {shape[dim]}) into "
                        f"{count} parts, which do not divide it; plan this model again")

    def check_node_ranks(self, ranks: dict[str, int]) -> None:
        """Each S(d) of a node's placement names a dim of its output (`ranks`: node -> number of
        dims, for the nodes whose output is one tensor)."""
        for name, placement in self.nodes.items():
            dims = [dim for dim in map(shard_dim, placement) if dim is not None]
            if name in ranks and dims and max(dims) >= ranks[name]:
                raise PlanMismatchError(f"the plan shards node {name!r} on dim {max(dims)}, but its "
                                        f"output has {ranks[name]} dims; plan this model again")

    def diff(self, other: Plan) -> list[tuple[str, object, object]]:
        """Differences as (path, this value, other value), paths like "stages[2].recompute"; a
        form one plan's stage uses and the other's does not compared with its default."""
        a, b = self.to_dict(), other.to_dict()
        for mine, theirs in zip(a["stages"], b["stages"]):
            for key, default in _UNUSED_FORMS.items():
                if key in mine or key in theirs:
                    mine.setdefault(key, _plain(default))
                    theirs.setdefault(key, _plain(default))
        return _diff(a, b, "")


def _member(vocabulary, value, name: str):
    """`value` as a member of the `StrEnum` `vocabulary`, or an error naming the field."""
    try:
        return vocabulary(value)
    except (ValueError, TypeError):
        choices = ", ".join(member.value for member in vocabulary)
        raise PlanMismatchError(f"plan field {name!r} is {value!r}; expected one of {choices}") from None


def _plain(value):
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    return value.value if isinstance(value, StrEnum) else value


def _diff(a, b, path: str) -> list[tuple[str, object, object]]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in list(a) + [k for k in b if k not in a]:
            sub = f"{path}.{key}" if path else str(key)
            if key not in a or key not in b:
                out.append((sub, a.get(key), b.get(key)))
            else:
                out.extend(_diff(a[key], b[key], sub))
        return out
    if isinstance(a, list) and isinstance(b, list) and any(isinstance(x, dict) for x in a + b):
        # lists of records (stages): field by field where both have the record, whole otherwise
        return [d for i in range(max(len(a), len(b)))
                for d in _diff(a[i] if i < len(a) else None, b[i] if i < len(b) else None,
                               f"{path}[{i}]")]
    return [] if a == b else [(path, a, b)]
