"""A Megatron-style uniform parallel configuration: what `estimate` prices, what the grid search
enumerates, and what a user can force instead of a solved plan."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import StrEnum

from autopar.errors import AutoparError

from autopar.plans.vocabulary import RECOMPUTE, SCHEDULES, Recompute, Schedule


@dataclass(kw_only=True, slots=True, frozen=True)
class Config:
    tp: int = 1                     # tensor-parallel degree (inside a node)
    pp: int = 1                     # pipeline stages
    dp: int = 1                     # data-parallel replicas
    virtual: int = 1                # model chunks per pipeline rank (interleaved 1F1B when > 1)
    global_batch: int = 1           # sequences per optimizer step, over all replicas
    micro_batch: int = 1            # sequences per micro-batch on one replica
    recompute: Recompute = Recompute.NONE   # selective: attention's core only
    zero: int = 0                   # ZeRO stage 0-3 over the data-parallel axis
    sequence_parallel: bool = False  # norms and dropout sharded on the sequence dim inside TP
    schedule: Schedule = Schedule.ONE_F_ONE_B

    def __post_init__(self):
        for name in ("tp", "pp", "dp", "virtual", "global_batch", "micro_batch"):
            if getattr(self, name) < 1:
                raise AutoparError(f"config {name}={getattr(self, name)} must be at least 1")
        if self.recompute not in RECOMPUTE:
            raise AutoparError(f"recompute={self.recompute!r}: expected one of {RECOMPUTE}")
        if self.schedule not in SCHEDULES:
            raise AutoparError(f"schedule={self.schedule!r}: expected one of {SCHEDULES}")
        # the vocabularies' members from here on (a frozen record: set once, as constructed)
        object.__setattr__(self, "recompute", Recompute(self.recompute))
        object.__setattr__(self, "schedule", Schedule(self.schedule))
        if self.zero not in (0, 1, 2, 3):
            raise AutoparError(f"zero={self.zero}: ZeRO stages are 0, 1, 2 and 3")
        if self.virtual > 1 and self.schedule != Schedule.INTERLEAVED_1F1B:
            raise AutoparError(f"virtual={self.virtual} chunks need schedule='interleaved-1f1b', "
                               f"not {self.schedule!r}")
        per_step = self.dp * self.micro_batch
        if self.global_batch % per_step:
            raise AutoparError(
                f"global batch {self.global_batch} is not divisible by dp x micro_batch = "
                f"{self.dp} x {self.micro_batch}; choose a global batch that is a multiple of {per_step}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def micro_batches(self) -> int:
        """Micro-batches per replica per optimizer step."""
        return self.global_batch // (self.dp * self.micro_batch)

    def to_dict(self) -> dict:
        return {key: value.value if isinstance(value, StrEnum) else value
                for key, value in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict) -> Config:
        return cls(**data)
