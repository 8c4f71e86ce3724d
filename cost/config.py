"""A Megatron-style uniform parallel configuration: what `estimate` prices, what the grid search
enumerates, and what a user can force instead of a solved plan."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import StrEnum

from autopar.errors import AutoparError

from autopar.plans.vocabulary import CONTEXT_PARALLEL, RECOMPUTE, SCHEDULES, Recompute, Schedule


@dataclass(kw_only=True, slots=True, frozen=True)
class Config:
    """Ranks are laid out as Megatron-LM lays them: tensor-parallel innermost, then context-,
    then data-parallel, pipeline outermost: tp x cp x dp ranks run a pipeline stage. Expert
    parallelism is carved out of those ranks (ep consecutive ranks hold different experts), as
    Megatron-Core does with expert tensor parallelism 1."""
    tp: int = 1                     # tensor-parallel degree (inside a node)
    pp: int = 1                     # pipeline stages
    dp: int = 1                     # data-parallel replicas
    ep: int = 1                     # expert-parallel degree: each rank holds 1/ep of every MoE layer's experts
    cp: int = 1                     # context-parallel degree: every sequence split over cp ranks
    cp_kind: str = "ring"           # ring (K/V blocks around a ring) | all-to-all (Ulysses)
    offload: bool = False           # parameters, gradients, optimizer state on the host (ZeRO-3)
    # the slowest rank's expert rows over the mean (1.0: balanced routing, the assumption of
    # cost/experts.py); scales its expert compute and all-to-alls
    routing_imbalance: float = 1.0
    virtual: int = 1                # model chunks per pipeline rank (interleaved 1F1B when > 1)
    global_batch: int = 1           # sequences per optimizer step, over all replicas
    micro_batch: int = 1            # sequences per micro-batch on one replica
    recompute: Recompute = Recompute.NONE   # selective: attention's core only
    zero: int = 0                   # ZeRO stage 0-3 over the data-parallel axis
    sequence_parallel: bool = False  # norms and dropout sharded on the sequence dim inside TP
    schedule: Schedule = Schedule.ONE_F_ONE_B

    def __post_init__(self):
        for name in ("tp", "pp", "dp", "ep", "cp", "virtual", "global_batch", "micro_batch"):
            if getattr(self, name) < 1:
                raise AutoparError(f"config {name}={getattr(self, name)} must be at least 1")
        self._check_new_forms()
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

    def _check_new_forms(self) -> None:
        """Expert and context parallelism and offload: what a Config can check without the
        model (the experts' count and the sequence length are checked where the graph is)."""
        stage = self.tp * self.cp * self.dp
        if stage % self.ep:
            raise AutoparError(
                f"ep={self.ep} does not divide the tp x cp x dp = {self.tp} x {self.cp} x "
                f"{self.dp} = {stage} ranks of a pipeline stage, out of which expert parallelism "
                f"is carved; choose an ep that divides {stage} (or more data parallelism)")
        if self.cp_kind not in CONTEXT_PARALLEL:
            raise AutoparError(f"cp_kind={self.cp_kind!r}: expected one of {CONTEXT_PARALLEL}")
        if self.offload and self.zero != 3:
            raise AutoparError(f"offload=True keeps the sharded parameters, gradients and "
                               f"optimizer state on the host, which needs ZeRO-3; set zero=3 "
                               f"(got zero={self.zero})")
        if not 1.0 <= self.routing_imbalance < float("inf"):
            raise AutoparError(f"routing_imbalance={self.routing_imbalance} must be at least 1.0 "
                               f"(the slowest rank's expert rows over the mean; 1.0 is balanced)")

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

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
