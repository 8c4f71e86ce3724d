"""A Plan is pure data: how one model runs on one mesh.

The mesh a stage runs on is a sub-mesh of the cluster with named axes (`Plan.axes`, outer to
inner, e.g. [["dp", 2], ["tp", 4]]). Placements are written one per axis, as torch's DTensor prints
them: "S(0)" sharded on dim 0, "R" replicated, "P" partial sums. Parameter placements carry ZeRO:
a parameter sharded on the data-parallel axis is gathered before use (ZeRO-3/FSDP); ZeRO-1/2 shard
only gradients and optimizer state and are recorded on the stage.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
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
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise PlanMismatchError(f"plan schema version {version} is not {SCHEMA_VERSION}, the one this "
                                    f"autopar reads; plan the model again with this version")
        stages = [Stage(**s) for s in data["stages"]]
        return cls(**{**data, "stages": stages})

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def check_graph(self, fingerprint: str) -> None:
        if fingerprint != self.fingerprint:
            raise PlanMismatchError(
                f"this plan was made for another model or input shape (graph fingerprint "
                f"{self.fingerprint}, this model's is {fingerprint}); plan this model again")
