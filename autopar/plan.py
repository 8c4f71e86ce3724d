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
import sys
import types
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from autopar.errors import PlanMismatchError

SCHEMA_VERSION = 1


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
    precision: str = "fp32"           # fp32 | bf16 (compute dtype; master weights stay fp32)
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
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise PlanMismatchError(f"plan schema version {version} is not {SCHEMA_VERSION}, the one this "
                                    f"autopar reads; plan the model again with this version")
        _check_fields(cls, data, "plan")
        for stage in data["stages"]:
            _check_fields(Stage, stage, "plan stage")
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
        except json.JSONDecodeError as err:
            raise PlanMismatchError(f"{path} is not a plan: not valid JSON ({err})") from None
        if not isinstance(data, dict):
            raise PlanMismatchError(f"{path} is not a plan: expected a JSON object")
        return cls.from_dict(data)

    def check_graph(self, fingerprint) -> None:
        """Refuse a graph (or its fingerprint) other than the one this plan was made for."""
        fingerprint = fingerprint if isinstance(fingerprint, str) else fingerprint.fingerprint()
        if fingerprint != self.fingerprint:
            raise PlanMismatchError(
                f"this plan was made for another model or input shape (graph fingerprint "
                f"{self.fingerprint}, this model's is {fingerprint}); plan this model again")

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


class _CallableModule(types.ModuleType):
    """`autopar.plan` names both this module and the planning function of autopar.api. Importing
    the module binds the package attribute to it, so the module forwards calls to the function:
    `autopar.plan(model, mesh, ...)` works in every import order (as autopar.capture does)."""

    def __call__(self, *args, **kwargs) -> Plan:
        from autopar.api import plan

        return plan(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
