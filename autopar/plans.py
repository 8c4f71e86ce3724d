"""A Plan is pure data: how one model runs on one mesh.

The mesh a stage runs on is a sub-mesh of the cluster with named axes (`Plan.axes`, outer to
inner, e.g. [["dp", 2], ["tp", 4]]). Placements are written one per axis, as torch's DTensor prints
them: "S(0)" sharded on dim 0, "R" replicated, "P" partial sums. Parameter placements carry ZeRO:
a parameter sharded on the data-parallel axis is gathered before use (ZeRO-3/FSDP); ZeRO-1/2 shard
only gradients and optimizer state and are recorded on the stage.

Pipelines: `stages` lists the model chunks in model order. With `virtual` = v chunks per pipeline
rank (interleaved 1F1B), there are pp * v stages and stage i runs on the ranks of pipeline rank
i % pp, as torch.distributed.pipelining places them; all stages share the sub-mesh shape `axes`.

The JSON form is exact: `Plan.load(path)` of a saved plan equals the plan, and saving it again
writes the same bytes.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from autopar.cost.vocabulary import MULTI_CHUNK_SCHEDULES, RECOMPUTE, SCHEDULES
from autopar.errors import MeshError, PlanMismatchError

SCHEMA_VERSION = 1
PRECISIONS = ("fp32", "bf16", "fp16")
# Bounds that no real run comes near; a value past them is a corrupt or crafted file, and would
# otherwise make explain or the runtime loop over billions of micro-batches or ranks.
MAX_BATCH = 2**24
MAX_MICRO_BATCHES = 2**16     # the timeline of a plan is simulated and drawn per micro-batch
MAX_WORLD = 2**20
PLACEMENT = re.compile(r"R|P|S\((\d+)\)")


@dataclass(kw_only=True, slots=True)
class Stage:
    index: int
    layers: list[str]                 # module paths in order: "embed", "layers.0", ..., "head"
    ranks: list[int]                  # global ranks of the stage's sub-mesh, row-major over Plan.axes
    tp: int = 1
    dp: int = 1
    recompute: str = "none"           # none | selective | full
    zero: int = 0                     # 0-3
    sequence_parallel: bool = False
    predicted: dict = field(default_factory=dict)   # time and memory breakdowns of this stage


@dataclass(kw_only=True, slots=True)
class Plan:
    fingerprint: str                  # Graph.fingerprint() of the model it was made for
    mesh: dict                        # Mesh.to_dict() of the whole cluster
    axes: list[list]                  # [[name, size], ...] of each stage's sub-mesh, outer to inner
    stages: list[Stage]
    global_batch: int
    micro_batches: int                # per replica per step
    micro_batch_size: int
    schedule: str = "1f1b"            # gpipe | 1f1b | interleaved-1f1b | zero-bubble
    virtual: int = 1                  # model chunks per pipeline rank
    parameters: dict[str, list[str]] = field(default_factory=dict)   # fqn -> placement per axis
    nodes: dict[str, list[str]] = field(default_factory=dict)        # node name -> output placement per axis
    predicted: dict = field(default_factory=dict)   # step_time_s, tflops_per_gpu, memory_per_gpu_bytes, bubble_fraction
    solver: dict = field(default_factory=dict)      # seconds, status, gap, variables, constraints
    replicated_ops: list[str] = field(default_factory=list)  # ops with no sharding rule, run replicated
    model_type: str = ""
    precision: str = "fp32"           # fp32 | bf16 | fp16 (compute dtype; master weights stay fp32)
    schema_version: int = SCHEMA_VERSION

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
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def summary(self) -> str:
        """One line a person can compare: degrees, schedule, micro-batches, per-stage choices."""
        # repeated blocks (module paths ending in an index) per stage: the embedding and head not counted
        counts = [sum(1 for layer in s.layers if layer.rsplit(".", 1)[-1].isdigit()) for s in self.stages]
        layer_counts = (f"{counts[0]}x{len(counts)}" if len(set(counts)) == 1
                        else "/".join(map(str, counts)))
        # per-stage choices in stage order, one value when all stages agree
        recompute = [s.recompute for s in self.stages]
        recompute = recompute[:1] if len(set(recompute)) == 1 else recompute
        zero = [s.zero for s in self.stages]
        zero = zero[:1] if len(set(zero)) == 1 else zero
        schedule = self.schedule + (f" v={self.virtual}" if self.virtual > 1 else "")
        return (f"tp={self.tp} pp={self.pp} dp={self.dp} {schedule} mbs={self.micro_batch_size} "
                f"m={self.micro_batches} recompute={'/'.join(recompute)} zero={'/'.join(map(str, zero))}"
                + (f" blocks={layer_counts}" if len(self.stages) > 1 else ""))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        if not isinstance(data, dict):
            raise PlanMismatchError("a plan is a JSON object; this is not one")
        version = data.get("schema_version")
        if type(version) is not int or version != SCHEMA_VERSION:
            raise PlanMismatchError(f"plan schema version {version} is not {SCHEMA_VERSION}, the one this "
                                    f"autopar reads; plan the model again with this version")
        _check_fields(cls, data, "plan")
        if not isinstance(data["stages"], list) or not data["stages"]:
            raise PlanMismatchError("plan field 'stages' must be a non-empty list of stages")
        for stage in data["stages"]:
            if not isinstance(stage, dict):
                raise PlanMismatchError(f"plan stage {stage!r} is not an object")
            _check_fields(Stage, stage, "plan stage")
        _check_values(data)
        stages = [Stage(**s) for s in data["stages"]]
        return cls(**{**data, "stages": stages})

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1) + "\n"

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise PlanMismatchError(f"no plan file at {path}; write one with `autopar plan`") from None
        except OSError as err:   # a folder, no permission
            raise PlanMismatchError(f"plan file {path} cannot be read: {err.strerror}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise PlanMismatchError(f"{path} is not a plan: not valid JSON ({err})") from None
        if not isinstance(data, dict):
            raise PlanMismatchError(f"{path} is not a plan: expected a JSON object")
        return cls.from_dict(data)

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
                dim = _shard_dim(text)
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

    def diff(self, other: Plan) -> list[tuple[str, object, object]]:
        """Differences as (path, this value, other value), paths like "stages[2].recompute"."""
        return _diff(self.to_dict(), other.to_dict(), "")


def _check_fields(cls, data: dict, what: str) -> None:
    known = {f.name for f in fields(cls)}
    required = {f.name for f in fields(cls)
                if f.default is f.default_factory}  # both MISSING: no default at all
    unknown = sorted(set(data) - known)
    missing = sorted(required - set(data))
    if unknown or missing:
        raise PlanMismatchError(f"{what} has unknown fields {unknown} and lacks fields {missing}; "
                                f"it was not written by this autopar version: plan the model again")


def _shard_dim(placement: str) -> int | None:
    match = PLACEMENT.fullmatch(placement)
    return int(match.group(1)) if match and match.group(1) is not None else None


def _check_values(data: dict) -> None:
    """Values, not only names: types and ranges, a mesh that parses, axes that multiply to each
    stage's devices, stages in order whose ranks cover the mesh once, a batch that splits into
    dp x micro-batches x micro-batch size, and placements that parse, one per axis. Every refusal
    names the field; none of it needs torch."""
    for key in ("fingerprint", "model_type"):
        _expect(data[key], str, key)
    for key in ("predicted", "solver", "parameters", "nodes"):
        _expect(data[key], dict, key)
    world = _check_mesh(data["mesh"])
    axes = _check_axes(data["axes"])
    sub = math.prod(size for _, size in axes)
    for key in ("global_batch", "micro_batch_size", "virtual"):
        _int(data[key], key, MAX_BATCH)
    _int(data["micro_batches"], "micro_batches", MAX_MICRO_BATCHES)
    if data.get("precision", "fp32") not in PRECISIONS:
        raise PlanMismatchError(f"plan field 'precision' is {data['precision']!r}; expected one of "
                                f"{', '.join(PRECISIONS)}")
    if data["schedule"] not in SCHEDULES:
        raise PlanMismatchError(f"plan field 'schedule' is {data['schedule']!r}; expected one of "
                                f"{', '.join(SCHEDULES)}")
    stages, virtual = data["stages"], data["virtual"]
    if virtual > 1 and data["schedule"] not in MULTI_CHUNK_SCHEDULES:
        raise PlanMismatchError(f"plan has virtual={virtual} chunks per rank with schedule "
                                f"{data['schedule']!r}, which runs one; use interleaved-1f1b")
    if len(stages) % virtual:
        raise PlanMismatchError(f"plan has {len(stages)} stages, not a multiple of virtual={virtual}")
    for position, stage in enumerate(stages):
        _check_stage(stage, position, axes, sub, world)
    pp = len(stages) // virtual
    _check_ranks(stages, pp, world)
    dp = stages[0]["dp"]
    if data["global_batch"] != dp * data["micro_batches"] * data["micro_batch_size"]:
        raise PlanMismatchError(
            f"plan's global_batch {data['global_batch']} is not dp x micro_batches x micro_batch_size "
            f"= {dp} x {data['micro_batches']} x {data['micro_batch_size']}")
    for key in ("parameters", "nodes"):
        for name, placement in data[key].items():
            if (not isinstance(placement, list) or len(placement) != len(axes)
                    or not all(isinstance(p, str) and PLACEMENT.fullmatch(p) for p in placement)):
                raise PlanMismatchError(
                    f"plan {key}[{name!r}] is {placement!r}; expected one placement per axis "
                    f"({len(axes)}), each R, P or S(dim)")
    if not isinstance(data["replicated_ops"], list) or not all(
            isinstance(op, str) for op in data["replicated_ops"]):
        raise PlanMismatchError("plan field 'replicated_ops' must be a list of op names")


def _expect(value, kind, name: str) -> None:
    if not isinstance(value, kind):
        raise PlanMismatchError(f"plan field {name!r} is {value!r}; expected a {kind.__name__}")


def _int(value, name: str, largest: int, smallest: int = 1) -> int:
    # bool is an int to Python, never to a plan
    if not isinstance(value, int) or isinstance(value, bool) or not smallest <= value <= largest:
        raise PlanMismatchError(f"plan field {name!r} is {value!r}; expected an integer from "
                                f"{smallest} to {largest}")
    return value


def _check_mesh(mesh: dict) -> int:
    from autopar.cost.mesh import Mesh

    try:
        world = Mesh.from_dict(mesh).world_size
    except MeshError as err:
        raise PlanMismatchError(f"plan field 'mesh' is not a mesh: {err}") from None
    return world


def _check_axes(axes) -> list:
    if (not isinstance(axes, list) or not axes
            or not all(isinstance(a, list) and len(a) == 2 and isinstance(a[0], str) for a in axes)):
        raise PlanMismatchError(f"plan field 'axes' is {axes!r}; expected [[name, size], ...] such as "
                                f"[['dp', 2], ['tp', 4]]")
    for name, size in axes:
        _int(size, f"axes[{name!r}]", MAX_WORLD)
    names = [name for name, _ in axes]
    if len(set(names)) != len(names):
        raise PlanMismatchError(f"plan field 'axes' names an axis twice: {names}")
    return axes


def _check_stage(stage: dict, position: int, axes: list, sub: int, world: int) -> None:
    where = f"stages[{position}]"
    if stage["index"] != position:
        raise PlanMismatchError(f"plan {where} has index {stage['index']!r}; stages must be listed "
                                f"in order, 0, 1, 2, ...")
    # a single-stage plan may list no layers: it holds the whole model
    if not isinstance(stage["layers"], list) or not all(isinstance(x, str) for x in stage["layers"]):
        raise PlanMismatchError(f"plan {where}.layers must be a list of module paths")
    tp, dp = _int(stage["tp"], f"{where}.tp", MAX_WORLD), _int(stage["dp"], f"{where}.dp", MAX_WORLD)
    # The planner names its axes dp and tp; plans of the intra-op solver alone keep the mesh's
    # axis names (node, gpu), where the stage's degrees are not read.
    named = dict(axes)
    if {"dp", "tp"} <= set(named) and (tp, dp) != (named["tp"], named["dp"]):
        raise PlanMismatchError(f"plan {where} has tp={tp} x dp={dp}, which is not its sub-mesh "
                                f"{axes}")
    ranks = stage["ranks"]
    if not isinstance(ranks, list) or len(ranks) != sub:
        raise PlanMismatchError(f"plan {where}.ranks must list the {sub} ranks of the stage's "
                                f"sub-mesh {axes}")
    for rank in ranks:
        _int(rank, f"{where}.ranks", world - 1, smallest=0)
    if stage["recompute"] not in RECOMPUTE:
        raise PlanMismatchError(f"plan {where}.recompute is {stage['recompute']!r}; expected one of "
                                f"{', '.join(RECOMPUTE)}")
    _int(stage["zero"], f"{where}.zero", 3, smallest=0)
    _expect(stage["sequence_parallel"], bool, f"{where}.sequence_parallel")
    _expect(stage["predicted"], dict, f"{where}.predicted")


def _check_ranks(stages: list, pp: int, world: int) -> None:
    """The pp pipeline ranks' sub-meshes cover the mesh once; chunk i runs where stage i % pp does."""
    covered = sorted(rank for stage in stages[:pp] for rank in stage["ranks"])
    if covered != list(range(world)):
        raise PlanMismatchError(f"the plan's {pp} pipeline stages run on ranks {covered}, which do not "
                                f"cover the mesh's {world} devices exactly once")
    for i, stage in enumerate(stages[pp:], start=pp):
        if stage["ranks"] != stages[i % pp]["ranks"]:
            raise PlanMismatchError(f"plan stages[{i}] runs on ranks {stage['ranks']}, but as chunk "
                                    f"of pipeline rank {i % pp} it belongs on {stages[i % pp]['ranks']}")


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
